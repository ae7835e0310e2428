"""K clients' record-level DP-SGD in lockstep: one module, parameters stacked on a client axis.

:class:`ClientsDpSgd` trains K copies of the same model, client i on its own records, as
batched tensor operations (``vmap`` over clients and examples; no Python loop over clients):

- client i has ``n_i`` records (rows ``0..n_i-1`` of its padded data), its own Poisson rate
  ``q_i`` (:func:`sampling_rates`: ``min(1, b / n_i)``, or given) and its own number of
  steps ``s_i`` (:func:`steps_for_epochs`); a client that has done its steps waits;
- each step of client i: Poisson batch at rate ``q_i``, per-example clipping to C, sum,
  ``N(0, (z C)^2)`` noise, division by the fixed ``q_i n_i``; then the update
  :class:`LocalSgd` (learning rate, heavy-ball momentum, proximal term ``mu (w - w_bar)``),
  which is post-processing;
- privacy: client i's run is ``s_i`` uses of ``PoissonSampledDpEvent(q_i,
  GaussianDpEvent(z))`` under add/remove of one of its records; with a ledger, each client
  is charged that, on its own entry, before any noise is drawn (all or nothing).

Randomness is per client (:class:`~privkit.torch.ClientStreams`: one generator per client,
seeded from the seed, the round and the client's key; at each of its steps a client draws
its Poisson uniforms, then its noise, from its own generator, so its draws never depend on
the other clients of the batch), or :class:`privkit.SecureRandom` (OS CSPRNG). The same
client with the same streams trains identically alone (K = 1, e.g. in a Flower ClientApp) and
batched: :meth:`ClientsDpSgd.reference_run` is the one-client-one-example-at-a-time loop the
batched path is tested against.

Per-example gradients: ghost clipping with the clients under ``vmap`` (:class:`GradMethod`
``GHOST``, the default), ``vmap`` over the clients of ``vmap(grad)`` over the examples
(``FUNC``), or a model's own clipped sum (:data:`ClippedSumFn`, e.g. closed-form norms).
torch's recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) cannot run with per-client
parameters under ``vmap`` and are refused by name (train such a client with
:func:`~privkit.torch.make_private`, or give a clipped sum of your own).

Non-finite gradients (``nonfinite``, :class:`~privkit.mechanisms.NonFiniteUpdates`): a
sampled example whose gradient holds NaN or inf contributes zeros, silently (``ZERO``, the
default; the other examples' contributions are unchanged and the step is charged once), or
raises (``RAISE``, for debugging: a record with NaN or inf in ``data`` is refused before
anything is charged; a gradient that becomes non-finite later in the run raises at that step,
when the run is already charged and nothing has been released). Unsampled filler rows never
leak into a client's sum, whatever they hold.

Parameters are a dict of ``(K, *shape)`` tensors; their flat layout (each flattened
row-major, in the dict's order) is the layout of the noise and of a model's own
``clipped_grad_sum``. Gradients, noise and updates are computed in the parameters' dtype (pass
float64 parameters for float64 arithmetic throughout); the clipping factors in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

import privkit
from privkit import _validate
from privkit._rng import SecureRandom
from privkit.errors import InvalidParameterError, NumericalError
from privkit.mechanisms.aggregate import NonFiniteUpdates
from privkit.torch._ghost import func_only, ghost_clients, trace
from privkit.torch.grads import (
    GradMethod,
    LossFn,
    check_module,
    check_nonfinite,
    clip_factors,
    cross_entropy_per_example,
    func_per_example_grads,
    nonfinite_rows,
)
from privkit.torch.private import check_ledger, poisson_take, step_event
from privkit.torch.streams import ClientStreams, client_keys_tensor

__all__ = ["ClientBatch", "LocalSgd", "ClientsDpSgd", "ClippedSumFn", "sampling_rates",
           "steps_for_epochs"]

ClippedSumFn = Callable[[Tensor, Tensor, Tensor, Callable[[Tensor], Tensor]], Tensor]
"""``clipped_grad_sum(theta, x, y, factor) -> (K, d)``: a model's own clipped sum.

``theta (K, d)`` flat parameters, ``x (K, B, ...)``, ``y (K, B, ...)``; ``factor(norms)``
maps the ``(K, B)`` float64 per-example gradient norms to the ``(K, B)`` factors (clip
factor times the row weight, 0 on filler rows and on rows whose norm is NaN or inf); the
result is ``sum_b factor_kb g_kb``. It must be deterministic: when some norm is not finite,
it is called again with those rows replaced by a finite row of the same client (and factor
0), since ``0 * nan`` is nan."""

class ClientBatch(NamedTuple):
    """K clients' records, padded: client i's are rows ``0..sizes[i]-1``.

    Attributes:
        x: ``(K, N, ...)`` inputs (padding rows never reach a client's sum, whatever they
            hold).
        y: ``(K, N, ...)`` targets.
        sizes: ``(K,)`` integers n_i in [1, N].
    """

    x: Tensor
    y: Tensor
    sizes: Tensor


@dataclass(frozen=True)
class LocalSgd:
    """The local update, applied to the noisy gradient (post-processing).

    ``g <- g + proximal_mu (w - anchor)``; ``buf <- momentum buf + g``; ``w <- w - lr buf``
    (the momentum buffer starts at 0 in every run).

    Attributes:
        lr: learning rate, finite and > 0.
        momentum: heavy-ball momentum in [0, 1).
        proximal_mu: FedProx's mu >= 0 (needs ``anchor`` in :meth:`ClientsDpSgd.run`).
    """

    lr: float
    momentum: float = 0.0
    proximal_mu: float = 0.0

    def __post_init__(self) -> None:
        _validate.positive("lr", self.lr)
        m = _validate.nonnegative("momentum", self.momentum)
        if not m < 1:
            raise InvalidParameterError("momentum", self.momentum, "in [0, 1)")
        _validate.nonnegative("proximal_mu", self.proximal_mu)


def sampling_rates(sizes: Any, batch_size: int) -> Tensor:
    """``q_i = min(1, b / n_i)`` per client, float64.

    Examples:
        >>> sampling_rates([10, 40], 20).tolist()
        [1.0, 0.5]
    """
    b = _validate.positive_int("batch_size", batch_size)
    n = torch.as_tensor(_validate.positive_int_array("sizes", sizes), dtype=torch.float64)
    return torch.clamp(b / n, max=1.0)


def steps_for_epochs(sizes: Any, epochs: Any, batch_size: int) -> Tensor:
    """``epochs_i * ceil(n_i / b)`` steps per client (int64): ``epochs_i`` expected passes.

    Examples:
        >>> steps_for_epochs([10, 45], [2, 1], 20).tolist()
        [2, 3]
    """
    b = _validate.positive_int("batch_size", batch_size)
    n = torch.as_tensor(_validate.positive_int_array("sizes", sizes))
    e = torch.as_tensor(epochs, dtype=torch.int64).expand_as(n)
    if bool((e < 0).any()):
        raise InvalidParameterError("epochs", epochs, "integers >= 0")
    return e * torch.div(n + b - 1, b, rounding_mode="floor")


def _flatten(params: Mapping[str, Tensor], k: int) -> Tensor:
    return torch.cat([v.reshape(k, -1) for v in params.values()], dim=1)


def _unflatten(theta: Tensor, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor]:
    out, at = {}, 0
    for n, s in shapes.items():
        size = math.prod(s)
        out[n] = theta[:, at:at + size].reshape(theta.shape[0], *s)
        at += size
    return out


def _poisson_rows(take: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(K, B) row indices, sampled rows first, and their weights (1 sampled, 0 filler); the
    fillers are the client's own unsampled records where it has them."""
    b = max(int(take.sum(1).max()) if take.numel() else 0, 1)
    key = take.to(torch.int8) * 2 + mask.to(torch.int8)
    order = torch.argsort(key, dim=1, descending=True, stable=True)[:, :b]
    return order, torch.gather(take, 1, order).to(torch.float64)


class ClientsDpSgd:
    """Record-level DP-SGD of K clients of one module, batched (module docstring).

    Args:
        module: the model; its forward treats examples independently. May be None with
            ``clipped_grad_sum``.
        l2_clip_norm: C, finite and > 0.
        noise_multiplier: z, noise stddev / C, finite and > 0.
        loss_fn: ``loss_fn(output, targets) -> (B,)`` per-example losses (default
            cross-entropy).
        clipped_grad_sum: a model's own clipped sum on flat parameters
            (:data:`ClippedSumFn`), e.g. closed-form per-example norms, used instead of
            ``method``.
        method: :class:`GradMethod` for the module's per-example gradients (module docstring).
        nonfinite: :class:`~privkit.mechanisms.NonFiniteUpdates`: a sampled example whose
            gradient holds NaN or inf contributes zeros (``ZERO``, the default) or raises
            (``RAISE``, for debugging; module docstring).

    Examples:
        >>> net = nn.Linear(3, 2)
        >>> dp = ClientsDpSgd(net, l2_clip_norm=1.0, noise_multiplier=1.0)
        >>> k, n = 4, 6
        >>> params = {name: p.detach().expand(k, *p.shape).clone()
        ...           for name, p in net.named_parameters()}
        >>> data = ClientBatch(torch.randn(k, n, 3), torch.randint(0, 2, (k, n)),
        ...                    torch.tensor([6, 5, 6, 3]))
        >>> out = dp.run(params, data, steps=torch.tensor([2, 2, 1, 0]),
        ...              sampling_rates=sampling_rates(data.sizes, 2), client_keys=range(k),
        ...              rng=ClientStreams(seed=1), update=LocalSgd(lr=0.1))
        >>> out["weight"].shape, bool((out["weight"][3] == params["weight"][3]).all())
        (torch.Size([4, 2, 3]), True)
    """

    def __init__(self, module: nn.Module | None = None, *, l2_clip_norm: float,
                 noise_multiplier: float, loss_fn: LossFn | None = None,
                 clipped_grad_sum: ClippedSumFn | None = None,
                 method: GradMethod = GradMethod.GHOST,
                 nonfinite: NonFiniteUpdates = NonFiniteUpdates.ZERO) -> None:
        if not isinstance(method, GradMethod):
            raise InvalidParameterError("method", method, "a privkit.torch.GradMethod")
        self.method = method
        self.l2_clip_norm = _validate.positive("l2_clip_norm", l2_clip_norm)
        self.noise_multiplier = _validate.positive("noise_multiplier", noise_multiplier)
        self.nonfinite = check_nonfinite(nonfinite)
        if module is None and clipped_grad_sum is None:
            raise InvalidParameterError("module", None, "a torch.nn.Module, or else "
                                        "clipped_grad_sum= (a model's own clipped sum)")
        if clipped_grad_sum is not None and not callable(clipped_grad_sum):
            raise InvalidParameterError("clipped_grad_sum", clipped_grad_sum, "a callable")
        if module is not None:
            check_module(module)
            layer = func_only(module) if clipped_grad_sum is None else None
            if layer is not None:
                raise InvalidParameterError(
                    f"module {layer[0]!r}", type(layer[1]).__name__,
                    "a layer that runs with per-client parameters under torch.func.vmap "
                    "(torch's recurrent layers do not, with either GradMethod): train each "
                    "client with privkit.torch.make_private (GradMethod.FUNC), or give "
                    "clipped_grad_sum=")
        self.module, self.loss_fn = module, loss_fn or cross_entropy_per_example
        self._own = clipped_grad_sum

    # ------------------------------------------------------------------ privacy
    def step_event(self, sampling_rate: float) -> Any:
        """The event of one step of a client sampled at ``sampling_rate``."""
        return step_event(self.noise_multiplier, sampling_rate)

    def client_event(self, sampling_rate: float, steps: int) -> Any:
        """The event of a client's run: ``steps`` uses of :meth:`step_event`."""
        return privkit.SelfComposedDpEvent(self.step_event(sampling_rate),
                                           _validate.positive_int("steps", steps))

    def _charge(self, ledger: Any, client_ids: list[Any], q: Tensor, steps: Tensor,
                label: str, round_: int | None) -> None:
        """Every client with steps, its own step event ``s_i`` times: one all-or-nothing
        ledger write (clients grouped by their event)."""
        groups: dict[tuple[float, int], list[Any]] = {}
        for cid, qi, si in zip(client_ids, q.tolist(), steps.tolist()):
            if si > 0:
                groups.setdefault((qi, si), []).append(cid)
        if groups:
            ledger.spend_many([(ids, self.step_event(qi), si)
                               for (qi, si), ids in groups.items()], label=label, round=round_)

    # ------------------------------------------------------------------ checks
    def _setup(self, params: Mapping[str, Tensor], data: ClientBatch, steps: Any,
               sampling_rates: Any, client_keys: Any, rng: Any, update: Any,
               anchor: Mapping[str, Tensor] | None, ledger: Any, client_ids: Any
               ) -> dict[str, Any]:
        if not isinstance(params, Mapping) or not params:
            raise InvalidParameterError("params", params, "a non-empty dict of (K, ...) tensors")
        first = next(iter(params.values()))
        k = first.shape[0] if first.dim() else 0
        for name, v in params.items():
            if not (isinstance(v, Tensor) and v.is_floating_point() and v.dim() >= 1
                    and v.shape[0] == k and v.dtype == first.dtype):
                raise InvalidParameterError(f"params[{name!r}]", getattr(v, "shape", v),
                                            f"a floating ({k}, ...) tensor of dtype "
                                            f"{first.dtype}")
        shapes = {n: tuple(v.shape[1:]) for n, v in params.items()}
        if self.module is not None:
            mine = {n: tuple(p.shape) for n, p in self.module.named_parameters()
                    if p.requires_grad}
            if mine != shapes:
                raise InvalidParameterError("params", shapes,
                                            f"the module's trainable parameters {mine}")
        if not isinstance(data, tuple) or len(data) != 3:
            raise InvalidParameterError("data", type(data).__name__, "a ClientBatch(x, y, sizes)")
        x, y, sizes = data
        if x.dim() < 2 or x.shape[0] != k or y.shape[:2] != x.shape[:2]:
            raise InvalidParameterError("data.x", tuple(x.shape),
                                        f"(K={k}, N, ...) inputs with (K, N, ...) targets")
        dev = first.device
        n = torch.as_tensor(_validate.positive_int_array("data.sizes", sizes.cpu()), device=dev)
        if n.shape != (k,) or bool((n > x.shape[1]).any()):
            raise InvalidParameterError("data.sizes", sizes.tolist(),
                                        f"{k} sizes in [1, {x.shape[1]}]")
        s = torch.as_tensor(steps).to(dev)
        if s.shape != (k,) or s.is_floating_point() or bool((s < 0).any()):
            raise InvalidParameterError("steps", steps, f"{k} integers >= 0")
        q = torch.as_tensor(sampling_rates, dtype=torch.float64).to(dev)
        if q.shape != (k,) or not bool(((q > 0) & (q <= 1)).all()):
            raise InvalidParameterError("sampling_rates", sampling_rates, f"{k} rates in (0, 1]")
        keys = client_keys_tensor(client_keys)
        if keys.shape != (k,) or len(set(keys.tolist())) != k:
            raise InvalidParameterError("client_keys", client_keys, f"{k} distinct integers")
        if not isinstance(rng, (ClientStreams, SecureRandom)):
            raise InvalidParameterError("rng", rng, "a privkit.torch.ClientStreams or a "
                                        "privkit.SecureRandom (one stream per client)")
        if not isinstance(update, LocalSgd):
            raise InvalidParameterError("update", update, "a privkit.torch.LocalSgd")
        bar = None
        if update.proximal_mu:
            if anchor is None or list(anchor) != list(params):
                raise InvalidParameterError("anchor", None if anchor is None else list(anchor),
                                            "the global model {name: tensor} (same names "
                                            "as params) when proximal_mu > 0")
            bar = torch.cat([anchor[nm].reshape(1, -1) for nm in params], 1).to(first.dtype)
        ids = None
        if check_ledger(ledger) is not None:
            ids = list(keys.tolist() if client_ids is None else client_ids)
            if len(ids) != k:
                raise InvalidParameterError("client_ids", client_ids, f"{k} ledger ids")
        return dict(k=k, shapes=shapes, dtype=first.dtype, dev=dev, n=n, steps=s, q=q,
                    keys=keys, bar=bar, ids=ids)

    # ------------------------------------------------------------------ draws
    @staticmethod
    def _client_draw(gen: torch.Generator, n: int, q: float, d: int, dtype: torch.dtype
                     ) -> tuple[Tensor, Tensor]:
        """One step of one client from its own generator: Poisson inclusion of its n records
        (rate q), then d standard normals."""
        take = poisson_take(n, q, gen)
        return take, torch.randn(d, generator=gen, dtype=dtype, device=gen.device)

    def _draws(self, rng: Any, gens: list[torch.Generator] | None, active: list[int],
               c: dict[str, Any], width: int, d: int, stddev: float) -> tuple[Tensor, Tensor]:
        """(K, width) inclusion and (K, d) noise ``N(0, stddev^2)`` (parameters' dtype) of one
        step; rows of inactive clients are False / 0 (nothing drawn for them)."""
        k, dev, n, q = c["k"], c["dev"], c["n_list"], c["q_list"]
        if isinstance(rng, SecureRandom):
            u = torch.from_numpy(np.asarray(rng.uniform((k, width)))).to(dev)
            z = torch.from_numpy(np.asarray(rng.gaussian(stddev, (k, d)))).to(dev, c["dtype"])
            return (u < c["q"][:, None]) & c["mask"], z
        assert gens is not None
        take = torch.zeros(k, width, dtype=torch.bool, device=dev)
        z = torch.zeros(k, d, dtype=c["dtype"], device=dev)
        for i in active:
            take[i, :n[i]], z[i] = self._client_draw(gens[i], n[i], q[i], d, c["dtype"])
        return take, z.mul_(stddev)

    # ------------------------------------------------------------------ gradients
    def _clipped(self, theta: Tensor, c: dict[str, Any], x: Tensor, y: Tensor, w: Tensor,
                 where: Callable[[Tensor], str]) -> Tensor:
        """(K, d): clipped per-example gradient sums of the rows (weights w) per client; a
        row whose norm is NaN or inf contributes 0 (or raises, named by ``where((k, j))``,
        under ``RAISE``)."""
        dtype, shapes = theta.dtype, c["shapes"]
        dropped: list[Tensor | None] = [None]

        def factor(norms: Tensor) -> Tensor:
            drop = dropped[0] = nonfinite_rows(norms, w, self.nonfinite, where)
            f = clip_factors(norms, self.l2_clip_norm, dtype, w)
            return f if drop is None else f.masked_fill(drop, 0.0)

        if self._own is not None:
            return self._own_sum(theta, x, y, w, factor, dropped)
        if self.method is GradMethod.FUNC:
            return self.func_clipped_grad_sum(theta, x, y, factor, shapes)
        assert self.module is not None
        sq, weighted = ghost_clients(self.module, _unflatten(theta, shapes), c["rest"], x, y,
                                     self.loss_fn, c["trace"])
        f = factor(sq.sqrt())
        summed = weighted(f, dropped[0])
        k = theta.shape[0]
        return torch.cat([summed[n].reshape(k, -1) if n in summed
                          else theta.new_zeros(k, math.prod(s)) for n, s in shapes.items()], 1)

    def _own_sum(self, theta: Tensor, x: Tensor, y: Tensor, w: Tensor,
                 factor: Callable[[Tensor], Tensor], dropped: list[Tensor | None]) -> Tensor:
        """The model's own clipped sum; rows whose norm is not finite are replaced by a finite
        row of the same client with factor 0 and the sum taken again (``0 * nan`` is nan
        inside the model's function), a client without a finite row contributing 0."""
        assert self._own is not None
        out = self._own(theta, x, y, factor)
        drop = dropped[0]
        if drop is not None:
            k, b = drop.shape
            keep = ~drop
            first = keep.to(torch.int8).argmax(1)
            ar = torch.arange(k, device=drop.device)[:, None]
            idx = torch.where(drop, first[:, None], torch.arange(b, device=drop.device)[None])
            w2 = w.masked_fill(drop, 0.0)

            def factor2(norms: Tensor) -> Tensor:
                f = clip_factors(norms, self.l2_clip_norm, theta.dtype, w2)
                return f.masked_fill(drop | ~torch.isfinite(norms), 0.0)

            out = self._own(theta, x[ar, idx], y[ar, idx], factor2)
            out = out.masked_fill(~keep.any(1)[:, None], 0.0)
        if not bool(torch.isfinite(out).all()):
            raise NumericalError("clipped_grad_sum returned NaN or inf although every row it "
                                 "was asked to sum has a finite gradient norm: a model's own "
                                 "clipped sum must be deterministic and give rows of factor 0 "
                                 "a contribution of 0")
        return out

    def func_clipped_grad_sum(self, theta: Tensor, x: Tensor, y: Tensor,
                              factor: Callable[[Tensor], Tensor],
                              shapes: Mapping[str, tuple[int, ...]]) -> Tensor:
        """The module's :data:`ClippedSumFn` by ``torch.func``: ``vmap`` over the clients of
        ``vmap(grad)`` over the examples (materialised ``(K, B, d)``); a row whose norm is
        NaN or inf contributes 0."""
        assert self.module is not None
        module, loss_fn = self.module, self.loss_fn
        rest = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
        rest.update(dict(module.named_buffers()))

        def one(p: dict[str, Tensor], xk: Tensor, yk: Tensor) -> dict[str, Tensor]:
            return func_per_example_grads(module, p, (xk,), yk, loss_fn, rest)

        per = torch.func.vmap(one)(_unflatten(theta, shapes), x, y)
        k, b = x.shape[:2]
        sq = torch.as_tensor(sum((v * v).reshape(k, b, -1).sum(2).to(torch.float64)
                                 for v in per.values()))
        bad = ~torch.isfinite(sq)[..., None]
        f = factor(sq.sqrt()).to(theta.dtype)
        return torch.cat([torch.einsum("kb,kbd->kd", f, v.reshape(k, b, -1).masked_fill(bad, 0))
                          for v in per.values()], dim=1)

    # ------------------------------------------------------------------ runs
    @torch.no_grad()
    def run(self, params: Mapping[str, Tensor], data: ClientBatch, *, steps: Any,
            sampling_rates: Any, client_keys: Any, rng: ClientStreams | SecureRandom,
            update: LocalSgd, anchor: Mapping[str, Tensor] | None = None, ledger: Any = None,
            client_ids: Any = None, label: str = "dpsgd", round: int | None = None,  # noqa: A002
            ) -> dict[str, Tensor]:
        """Train the K clients, each for its own number of steps; return their parameters.

        Args:
            params: ``{name: (K, *shape)}`` starting parameters (not modified).
            data: :class:`ClientBatch` of the K clients.
            steps: ``(K,)`` local steps per client (0: the client does nothing).
            sampling_rates: ``(K,)`` Poisson rates q_i in (0, 1] (:func:`sampling_rates`).
            client_keys: ``(K,)`` distinct stream keys in [0, 2**32) (e.g. client indices).
            rng: :class:`ClientStreams` (reproducible) or :class:`privkit.SecureRandom`.
            update: :class:`LocalSgd`; anchor: the global model ``{name: shape}`` for
                ``proximal_mu``.
            ledger: a :class:`~privkit.ledger.Ledger`, or None; every client with steps is
                charged ``s_i`` steps of ``PoissonSampledDpEvent(q_i, GaussianDpEvent(z))``
                before any noise is drawn (``label``, ``round``); over budget: nothing is
                charged or trained (:class:`~privkit.BudgetExceededError`).
            client_ids: the clients' ledger ids (default: ``client_keys``).

        Returns:
            ``{name: (K, *shape)}`` trained parameters, in the dtype of ``params``.
        """
        c = self._setup(params, data, steps, sampling_rates, client_keys, rng, update,
                        anchor, ledger, client_ids)
        k, dev, dtype = c["k"], c["dev"], c["dtype"]
        theta = _flatten(params, k).clone()
        d = theta.shape[1]
        x, y = data.x.to(dev), data.y.to(dev)
        if x.is_floating_point():
            x = x.to(dtype)
        width = x.shape[1]
        c["mask"] = torch.arange(width, device=dev)[None, :] < c["n"][:, None]
        self._prepare(c, x, y)
        if self.nonfinite is NonFiniteUpdates.RAISE:
            _refuse_nonfinite_records(x, y, c["mask"] & (c["steps"] > 0)[:, None])
        q, n, s_i = c["q"], c["n"], c["steps"]
        expected = (q * n.to(torch.float64))[:, None].to(dtype)
        stddev = self.noise_multiplier * self.l2_clip_norm
        if ledger is not None:
            self._charge(ledger, c["ids"], q, s_i, label, round)
        gens = (None if isinstance(rng, SecureRandom)
                else rng.generators(c["keys"], device=dev))
        buf = torch.zeros_like(theta)
        ar = torch.arange(k, device=dev)[:, None]
        todo = s_i.tolist()
        for s in range(max(todo) if k else 0):
            active = [i for i in range(k) if todo[i] > s]
            take, z = self._draws(rng, gens, active, c, width, d, stddev)
            rows, w = _poisson_rows(take, c["mask"])

            def where(at: Tensor, rows: Tensor = rows, s: int = s) -> str:
                return f"data.x[{int(at[0])}, {int(rows[at[0], at[1]])}] (step {s + 1})"

            g = self._clipped(theta, c, x[ar, rows], y[ar, rows], w, where)
            g = g.add_(z).div_(expected)
            _apply(update, theta, g, buf, c["bar"], None if len(active) == k else s_i > s)
        return {nm: v.clone() for nm, v in _unflatten(theta, c["shapes"]).items()}

    def _prepare(self, c: dict[str, Any], x: Tensor, y: Tensor) -> None:
        """What every step reuses: the fixed parameters and buffers, the ghost trace."""
        c["n_list"], c["q_list"] = c["n"].tolist(), c["q"].tolist()
        c["rest"], c["trace"] = {}, None
        if self.module is not None:
            c["rest"] = {n: p.detach() for n, p in self.module.named_parameters()
                         if not p.requires_grad}
            c["rest"].update(dict(self.module.named_buffers()))
        if self._own is None and self.method is GradMethod.GHOST and c["k"]:
            assert self.module is not None
            c["trace"] = trace(self.module, x[0, :1], y[0, :1], self.loss_fn)

    @torch.no_grad()
    def reference_run(self, params: Mapping[str, Tensor], data: ClientBatch, *, steps: Any,
                      sampling_rates: Any, client_keys: Any, rng: ClientStreams,
                      update: LocalSgd, anchor: Mapping[str, Tensor] | None = None
                      ) -> dict[str, Tensor]:
        """:meth:`run` one client, one step and one example at a time (per-example autograd,
        or the model's own ``clipped_grad_sum`` on one example): the reference the batched
        path is tested against. It draws the same numbers (:class:`ClientStreams`: each
        client's own generator, consumed in the same order)."""
        if not isinstance(rng, ClientStreams):
            raise InvalidParameterError("rng", rng, "a ClientStreams (reproducible draws)")
        c = self._setup(params, data, steps, sampling_rates, client_keys, rng, update,
                        anchor, None, None)
        k, dev, dtype, shapes = c["k"], c["dev"], c["dtype"], c["shapes"]
        theta = _flatten(params, k).clone()
        d = theta.shape[1]
        stddev = self.noise_multiplier * self.l2_clip_norm
        out = []
        for i in range(k):
            n_i, q_i = int(c["n"][i]), float(c["q"][i])
            gen = rng.generators(c["keys"][i:i + 1], device=dev)[0]
            th, buf = theta[i:i + 1].clone(), torch.zeros(1, d, dtype=dtype, device=dev)
            for _ in range(int(c["steps"][i])):
                take, z = self._client_draw(gen, n_i, q_i, d, dtype)
                total = torch.zeros(d, dtype=dtype, device=dev)
                for j in range(n_i):
                    if not bool(take[j]):
                        continue
                    xj = data.x[i, j].to(dev)
                    xj = xj.to(dtype) if xj.is_floating_point() else xj
                    gj = self._one_example(th, shapes, xj, data.y[i, j].to(dev))
                    norm = torch.linalg.vector_norm(gj.to(torch.float64))[None]
                    if not bool(torch.isfinite(norm).all()):
                        if self.nonfinite is NonFiniteUpdates.RAISE:
                            raise InvalidParameterError(
                                f"data.x[{i}, {j}]", f"a gradient norm of {float(norm[0])}",
                                "an example with a finite per-example gradient "
                                "(nonfinite=NonFiniteUpdates.RAISE)")
                        continue  # ZERO: it contributes nothing
                    f = clip_factors(norm, self.l2_clip_norm, dtype)
                    total += gj * f.to(dtype)
                g = (total + z * stddev) / (q_i * n_i)
                _apply(update, th, g[None], buf, c["bar"], None)
            out.append(th)
        res = _unflatten(torch.cat(out), shapes)
        return {nm: v.clone() for nm, v in res.items()}

    def _one_example(self, theta: Tensor, shapes: Mapping[str, tuple[int, ...]], x: Tensor,
                     y: Tensor) -> Tensor:
        """(d,): one example's gradient (autograd on the module, or the model's own sum
        with factor 1)."""
        if self._own is not None:
            def one(norms: Tensor) -> Tensor:
                return torch.ones_like(norms)
            return self._own(theta, x[None, None], y[None, None], one)[0]
        assert self.module is not None
        p = {n: v[0].detach().requires_grad_(True) for n, v in _unflatten(theta, shapes).items()}
        rest = {n: q.detach() for n, q in self.module.named_parameters() if not q.requires_grad}
        rest.update(dict(self.module.named_buffers()))
        with torch.enable_grad():
            out = torch.func.functional_call(self.module, (p, rest), (x[None],))
            loss = self.loss_fn(out, y[None]).sum()
            grads = torch.autograd.grad(loss, list(p.values()), allow_unused=True)
        return torch.cat([(g if g is not None else torch.zeros_like(v)).reshape(-1)
                          for g, v in zip(grads, p.values())])


def _refuse_nonfinite_records(x: Tensor, y: Tensor, live: Tensor) -> None:
    """Under ``RAISE``: the first record (of a client with steps) holding NaN or inf in its
    input or target, named, before anything is charged."""
    k, n = live.shape
    for name, t in (("data.x", x), ("data.y", y)):
        if t.is_floating_point():
            bad = ~torch.isfinite(t.reshape(k, n, -1)).all(2) & live
            if bool(bad.any()):
                i, j = (int(v) for v in torch.nonzero(bad)[0])
                raise InvalidParameterError(
                    f"{name}[{i}, {j}]", "a record holding NaN or inf",
                    "finite records (nonfinite=NonFiniteUpdates.RAISE; ZERO would leave "
                    "its gradient out)")


def _apply(update: LocalSgd, theta: Tensor, g: Tensor, buf: Tensor, bar: Tensor | None,
           active: Tensor | None) -> None:
    """One :class:`LocalSgd` step, in place, of the active clients (all if None)."""
    if update.proximal_mu:
        assert bar is not None
        g = g.add_(theta - bar, alpha=update.proximal_mu)
    if active is None:
        buf.mul_(update.momentum).add_(g)
        theta.sub_(buf, alpha=update.lr)
        return
    a = active.to(theta.device)[:, None]  # the same arithmetic as above, on the active rows
    buf.copy_(torch.where(a, (buf * update.momentum).add_(g), buf))
    theta.copy_(torch.where(a, theta.sub(buf, alpha=update.lr), theta))
