"""Client-level DP for federated averaging: clip each client's update, noise the sum once.

DP-FedAvg (McMahan, Ramage, Talwar & Zhang, ICLR 2018): each participating client's update
``Delta_i`` (its model minus the global model; the whole tree) is clipped to L2 norm ``C``,
the clipped updates are summed, and Gaussian noise ``N(0, (z C)^2 I)`` is added **once** to
the sum. Adding or removing one client moves the sum by at most ``C``, so one round is the
Gaussian mechanism with noise multiplier ``z`` under ``ADD_OR_REMOVE_ONE`` *clients*; with
Poisson client sampling at rate ``q`` (each client independently, the outcome secret) it is
``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, priced with amplification by
:func:`privkit.epsilon`. Under ``REPLACE_ONE`` the sum moves by up to ``2 C``: the event is
the same (its noise multiplier is stddev / C under every relation, as in Opacus and
dp-accounting's PLD) and the accountant doubles the sensitivity when it is priced under
``REPLACE_ONE``.

Assumption, printed in every report that uses it (:data:`TRUST_ASSUMPTION`): **a trusted
aggregator** that sees the clipped updates, adds the noise itself and releases only the noisy
sum. Secure aggregation alone is not enough: it would show the server the exact sum before
any noise. The server also chooses the sample, so amplification holds only against those who
do not know it; against the server a client that took part in ``k`` rounds has the
unamplified epsilon of ``k`` Gaussian releases (:func:`unamplified_event`).

The server then divides the noisy sum by a *fixed* number (the expected number of clients
``q N``), never by the realised count, which would depend on who was sampled. A client's
update must depend only on its own data, the global model and randomness of its own (never
on who else was sampled): otherwise adding one client could move another's update too.

Non-finite updates: by default (:attr:`NonFiniteUpdates.ZERO`) a client whose update holds a
NaN or an infinity contributes zeros, silently: an error naming it would reveal that this
client was sampled. :attr:`NonFiniteUpdates.RAISE` raises instead (for debugging, outside any
privacy claim).

Weights: a weighted average is fine when each client's weight ``w_i`` lies in [0, 1] and is
public (fixed before training, not computed from the data): client i contributes
``w_i clip(Delta_i)``, whose norm is still <= ``C``. |D_i|-weighted averaging must use
``w_i = min(1, |D_i| / D_max)`` with a public ``D_max``.

:class:`AdaptiveClipping` is the quantile-based clip norm of Andrew, Thakkar, McMahan &
Ramaswamy (NeurIPS 2021): each round the fraction of sampled clients whose update norm is at
most ``C`` is released with its own Gaussian noise (the count centred, so that one client
moves it by 1/2) and ``C`` moves geometrically towards the target quantile. The count and
the sum are computed on the *same* Poisson sample, so they are one Gaussian release with two
noise scales: one round is ``PoissonSampledDpEvent(q, GaussianDpEvent(z_eff))`` with
``z_eff = (z^-2 + (2 sigma_b)^-2)^-1/2`` (:meth:`AdaptiveClipping.round_event`). Charging the
two as independently sampled events would under-report.

Examples:
    >>> import numpy as np
    >>> agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1.0,
    ...                           sampling_probability=0.1)
    >>> updates = {"w": np.ones((3, 4)), "b": np.zeros((3, 1))}  # 3 clients
    >>> noisy = agg(updates, rng=np.random.default_rng(0))
    >>> noisy["w"].shape, agg.event().sampling_probability
    ((4,), 0.1)
    >>> per_client = [{"w": np.ones(4)}, {"w": np.zeros(4)}]   # what a PyTorch loop holds
    >>> ClientLevelGaussian.stack(per_client)["w"].shape
    (2, 4)
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.events import DpEvent, GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from privkit.mechanisms._tree import _no_grad, _torch
from privkit.mechanisms.clipping import _clip_per_example
from privkit.mechanisms.sampling import _float_leaves, _leaves, _unflatten, gaussian_noise

__all__ = ["ClientLevelGaussian", "AdaptiveClipping", "NonFiniteUpdates", "TRUST_ASSUMPTION",
           "floating_state", "unamplified_event"]

#: What client-level DP assumes about the aggregator (every report states it).
TRUST_ASSUMPTION = ("trusted aggregator: the server sees the clipped updates, adds the noise "
                    "itself and releases only the noisy sum (secure aggregation alone would "
                    "show it the exact sum, so it is not enough)")


class NonFiniteUpdates(enum.Enum):
    """What :class:`ClientLevelGaussian` does with a client update holding NaN or inf."""

    #: The client contributes zeros, and nothing says so (an error would reveal that this
    #: client was sampled). Its contribution still has norm <= C: the guarantee holds.
    ZERO = "zero"
    #: Raise, naming the client's row (for debugging: the error itself is not covered by
    #: any privacy claim).
    RAISE = "raise"


def _relation(value: Any) -> Any:
    from privkit.events.mechanisms import NeighboringRelation, as_relation

    if value is None:
        return NeighboringRelation.ADD_OR_REMOVE_ONE
    return as_relation(value)


def _sampled(inner: DpEvent, q: float) -> DpEvent:
    return inner if q == 1 else PoissonSampledDpEvent(q, inner)


def unamplified_event(noise_multiplier: float, rounds: int, *,
                      neighboring_relation: Any = None) -> DpEvent:
    """The event of ``rounds`` client-level Gaussian releases that one client took part in,
    *without* amplification: what someone who knows the sample (the server that drew it)
    can be held to. ``rounds`` >= 1.

    Example:
        >>> import privkit
        >>> round(privkit.epsilon(unamplified_event(1.0, 5), 1e-5).epsilon, 2)
        11.48
    """
    z = _validate.positive("noise_multiplier", noise_multiplier)
    k = _validate.positive_int("rounds", rounds)
    _relation(neighboring_relation)  # validated; the event is the same under every relation
    return SelfComposedDpEvent(GaussianDpEvent(z), k)


def floating_state(tree: Any) -> Any:
    """The floating-point part of a state dict (or any dict of arrays / tensors): integer and
    bool entries, such as BatchNorm's ``num_batches_tracked``, are dropped. An update is made
    of these (``{k: local[k] - global[k] for k in floating_state(global)}``).

    Example:
        >>> import numpy as np
        >>> sorted(floating_state({"w": np.zeros(2), "steps": np.array(3)}))
        ['w']
    """
    if not isinstance(tree, dict):
        raise InvalidParameterError("tree", type(tree).__name__, "a dict (e.g. a state dict)")
    torch = _torch()
    out = {}
    for k, v in tree.items():
        if isinstance(v, np.ndarray):
            keep = v.dtype.kind == "f"
        elif torch is not None and isinstance(v, torch.Tensor):
            keep = v.dtype.is_floating_point
        else:
            raise InvalidParameterError(f"tree[{k!r}]", type(v).__name__,
                                        "a numpy array or torch tensor")
        if keep:
            out[k] = v
    return out


def _refuse_sequence(updates: Any, name: str) -> None:
    if isinstance(updates, (list, tuple)):
        raise InvalidParameterError(
            name, f"a {type(updates).__name__} of {len(updates)} entries",
            "one tree whose every leaf holds the clients on a new axis 0 (a list of "
            "per-client trees would have rows of weight matrices clipped as if they were "
            "clients): use ClientLevelGaussian.stack(list_of_trees), and "
            "privkit.mechanisms.floating_state to drop integer buffers first")


def _rows(updates: Any, name: str) -> tuple[list[tuple[str, Any]], Any, int]:
    _refuse_sequence(updates, name)
    leaves, spec = _float_leaves(updates, name, allow_empty=True)  # K = 0 clients is fine
    if not leaves:
        raise InvalidParameterError(name, updates, "a tree with at least one array or tensor")
    k = None
    for path, leaf in leaves:
        shape = tuple(leaf.shape)
        if not shape:
            raise InvalidParameterError(path, shape, "an array of shape (clients, ...)")
        if k is None:
            k = shape[0]
        elif shape[0] != k:
            raise InvalidParameterError(path, shape, f"leading (client) dimension {k}")
    assert k is not None
    return leaves, spec, int(k)


def _finite_rows(leaves: list[tuple[str, Any]], k: int) -> np.ndarray:
    """(k,) bool: whether each client's row is finite in every leaf.

    A row's sum is finite only if every entry is (an infinity or a NaN makes any IEEE sum
    infinite or NaN), so one cheap row sum clears almost every row; the rows whose sum is
    not finite (a bad entry, or finite entries whose sum overflows) are checked entry by
    entry. A pass over the data instead of a boolean copy of it."""
    ok = np.ones(k, dtype=bool)
    torch = _torch()
    for _, leaf in leaves:
        if torch is not None and isinstance(leaf, torch.Tensor):
            rows = leaf.detach().reshape(k, -1)
            maybe = np.flatnonzero(~torch.isfinite(rows.sum(1)).cpu().numpy())
            if maybe.size:
                sel = torch.from_numpy(maybe).to(rows.device)
                bad = ~torch.isfinite(rows[sel]).all(1).cpu().numpy()
                ok[maybe[bad]] = False
        else:
            rows = np.asarray(leaf).reshape(k, -1)
            with np.errstate(over="ignore", invalid="ignore"):
                maybe = np.flatnonzero(~np.isfinite(rows.sum(1)))
            if maybe.size:
                ok[maybe[~np.isfinite(rows[maybe]).all(1)]] = False
    return ok


def _zero_rows(leaves: list[tuple[str, Any]], bad: np.ndarray) -> list[Any]:
    torch = _torch()
    out = []
    for _, leaf in leaves:
        if torch is not None and isinstance(leaf, torch.Tensor):
            x = leaf.detach().clone()
            x[torch.as_tensor(bad, device=x.device)] = 0
        else:
            x = np.array(leaf, copy=True)
            x[bad] = 0
        out.append(x)
    return out


def _check_weights(weights: Any, k: int) -> np.ndarray:
    w = np.asarray(weights.detach().cpu() if hasattr(weights, "detach") else weights,
                   dtype=np.float64)
    if w.shape != (k,):
        raise InvalidParameterError("weights", w.shape, f"shape ({k},), one per client")
    if not (np.isfinite(w).all() and (w >= 0).all() and (w <= 1).all()):
        bad = w[~(np.isfinite(w) & (w >= 0) & (w <= 1))][0]
        raise InvalidParameterError("weights", float(bad), "public weights in [0, 1]")
    return w


def _sum_rows(leaf: Any, w: np.ndarray | None) -> Any:
    """Sum over the client axis in float64 (weighted), cast back to the leaf's dtype."""
    torch = _torch()
    if torch is not None and isinstance(leaf, torch.Tensor):
        if (w is None and leaf.device.type == "cpu" and leaf.dim() > 1
                and leaf.is_contiguous()
                and leaf.dtype in (torch.float16, torch.float32, torch.float64)):
            # numpy casts in small buffers as it adds the rows: no float64 copy of the
            # whole (K, ...) leaf, the same float64 sums (rows added in order, as torch
            # does; a 1-D or strided leaf could be summed pairwise, so it goes to torch)
            return torch.from_numpy(np.add.reduce(leaf.detach().numpy(), axis=0,
                                                  dtype=np.float64))
        x = leaf.to(torch.float64)
        if w is not None:
            x = x * torch.as_tensor(w, dtype=torch.float64, device=x.device).reshape(
                (-1,) + (1,) * (x.dim() - 1))
        return x.sum(0)
    x = np.asarray(leaf, dtype=np.float64)
    if w is not None:
        x = x * w.reshape((-1,) + (1,) * (x.ndim - 1))
    return x.sum(0)


def _cast(x: Any, like: Any) -> Any:
    torch = _torch()
    if torch is not None and isinstance(like, torch.Tensor):
        return x.to(like.dtype)
    return np.asarray(x, dtype=like.dtype)


@dataclass(frozen=True)
class ClientLevelGaussian:
    """DP-FedAvg's aggregate: per-client L2 clipping of whole updates, one Gaussian noise draw.

    Args:
        l2_clip_norm: C, the bound on one client's update (whole tree, L2), finite and > 0.
        noise_multiplier: z = stddev / C, finite and > 0; the sum gets N(0, (z C)^2) per
            coordinate.
        sampling_probability: q, the Poisson rate at which each client takes part in a
            round, in (0, 1]; 1 means every client every round (no amplification).
        nonfinite: what a client update with NaN or inf becomes (:class:`NonFiniteUpdates`;
            default zeros, said nowhere).

    Calling it on ``updates`` (a tree whose every leaf has a leading client axis of size K,
    numpy or torch, K = 0 allowed; :meth:`stack` builds it from a list of per-client trees)
    returns the noisy sum as a tree without that axis: noise is drawn even when no client
    took part (the release exists either way). A list or tuple of trees is refused.
    """

    l2_clip_norm: float
    noise_multiplier: float
    sampling_probability: float = 1.0
    nonfinite: NonFiniteUpdates = NonFiniteUpdates.ZERO

    def __post_init__(self) -> None:
        _validate.positive("l2_clip_norm", self.l2_clip_norm)
        _validate.positive("noise_multiplier", self.noise_multiplier)
        _validate.probability("sampling_probability", self.sampling_probability)
        if not isinstance(self.nonfinite, NonFiniteUpdates):
            raise InvalidParameterError("nonfinite", self.nonfinite,
                                        "a NonFiniteUpdates member (ZERO or RAISE)")

    @property
    def stddev(self) -> float:
        """Absolute noise standard deviation on each coordinate of the sum, z C."""
        return float(self.noise_multiplier) * float(self.l2_clip_norm)

    @property
    def neighboring_relation(self) -> Any:
        """The relation of :meth:`event`'s default: adding or removing one whole client."""
        return _relation(None)

    def event(self, neighboring_relation: Any = None) -> DpEvent:
        """One round: Poisson-subsampled Gaussian (plain Gaussian when q = 1). The event is
        the same under every relation (``neighboring_relation`` is only validated): price it
        under the relation you claim, and the accountant applies that relation's
        sensitivity (C under add/remove, 2C under ``REPLACE_ONE``)."""
        _relation(neighboring_relation)
        return _sampled(GaussianDpEvent(float(self.noise_multiplier)),
                        float(self.sampling_probability))

    def clip(self, updates: Any) -> Any:
        """Each client's update (row along the client axis) clipped to ``l2_clip_norm``
        (non-finite rows as :attr:`nonfinite` says)."""
        leaves, spec, k = _rows(updates, "updates")
        if k and self.nonfinite is NonFiniteUpdates.ZERO:
            ok = _finite_rows(leaves, k)
            if not ok.all():
                updates = _unflatten(spec, iter(_zero_rows(leaves, ~ok)))
        return _clip_per_example(updates, self.l2_clip_norm, "updates")

    @staticmethod
    def stack(trees: Sequence[Any], *, like: Any = None) -> Any:
        """Per-client trees (e.g. state-dict deltas, all of one structure and shapes) as one
        tree with the clients on a new axis 0, what :meth:`__call__` takes.

        An empty round (no client sampled) needs ``like``, a tree of one update's shapes
        (the global model, say): the result then has zero rows. Integer leaves are refused;
        :func:`floating_state` drops them from a state dict.

        Example:
            >>> import numpy as np
            >>> ClientLevelGaussian.stack([], like={"w": np.zeros(3)})["w"].shape
            (0, 3)
        """
        if isinstance(trees, dict) or not isinstance(trees, Sequence) or isinstance(trees, str):
            raise InvalidParameterError("trees", type(trees).__name__,
                                        "a list of per-client trees")
        torch = _torch()
        if not trees:
            if like is None:
                raise InvalidParameterError("like", None, "given when trees is empty (a tree "
                                            "of one update's shapes, e.g. the global model)")
            leaves, spec = _float_leaves(like, "like", allow_empty=False)
            empty = [leaf.detach().unsqueeze(0)[:0].clone()
                     if torch is not None and isinstance(leaf, torch.Tensor)
                     else np.zeros((0, *leaf.shape), dtype=leaf.dtype) for _, leaf in leaves]
            return _unflatten(spec, iter(empty))
        first, spec0 = _leaves(trees[0], "trees[0]")
        columns: list[list[Any]] = [[] for _ in first]
        for i, tree in enumerate(trees):
            try:
                leaves, spec = _float_leaves(tree, f"trees[{i}]", allow_empty=False)
            except InvalidParameterError as exc:
                raise InvalidParameterError(
                    exc.name, exc.value, f"{exc.requirement} (privkit.mechanisms."
                    "floating_state drops integer buffers from a state dict)") from None
            if spec != spec0:
                raise InvalidParameterError(f"trees[{i}]", "another structure",
                                            "the structure (keys) of trees[0]")
            for col, (path, leaf), (_, ref) in zip(columns, leaves, first):
                if tuple(leaf.shape) != tuple(ref.shape):
                    raise InvalidParameterError(path, tuple(leaf.shape),
                                                f"shape {tuple(ref.shape)} like trees[0]")
                col.append(leaf)
        stacked = [torch.stack([t.detach() for t in col])
                   if torch is not None and isinstance(col[0], torch.Tensor)
                   else np.stack([np.asarray(t) for t in col]) for col in columns]
        return _unflatten(spec0, iter(stacked))

    def __call__(self, updates: Any, *, rng: Any, weights: Any = None) -> Any:
        """The noisy (weighted) sum of the clipped updates.

        Args:
            updates: tree of arrays or tensors with a leading client axis (not a list of
                per-client trees: see :meth:`stack`).
            rng: ``numpy.random.Generator``, ``torch.Generator`` on the updates' device,
                or :class:`~privkit.mechanisms.sampling.SecureRandom`.
            weights: optional public per-client weights in [0, 1] (module docstring).
        """
        leaves, spec, k = _rows(updates, "updates")
        w = None if weights is None else _check_weights(weights, k)
        with _no_grad():
            clipped = self.clip(updates) if k > 0 else updates
            c_leaves, _ = _float_leaves(clipped, "updates", allow_empty=True)
            sums = [_sum_rows(leaf, w) for _, leaf in c_leaves]
            noise = gaussian_noise(_unflatten(spec, iter(sums)), self.stddev, rng=rng)
            n_leaves, _ = _float_leaves(noise, "noise", allow_empty=False)
            out = [_cast(s + n, leaf) for s, (_, n), (_, leaf)
                   in zip(sums, n_leaves, leaves)]
        return _unflatten(spec, iter(out))

    @staticmethod
    def mean(noisy_sum: Any, expected_clients: float) -> Any:
        """The noisy sum divided by a fixed, public number (the expected participants q N)."""
        n = _validate.positive("expected_clients", expected_clients)
        leaves, spec = _float_leaves(noisy_sum, "noisy_sum", allow_empty=False)
        return _unflatten(spec, (leaf / n for _, leaf in leaves))


@dataclass(frozen=True)
class AdaptiveClipping:
    """The clip norm C tracks a quantile of the update norms (Andrew et al., NeurIPS 2021).

    Each round releases the noisy fraction of sampled clients whose update norm is <= C,
    centred as in the paper: ``b = (sum_i (1[||Delta_i|| <= C] - 1/2) + N(0, count_stddev^2))
    / m + 1/2`` with ``m`` the expected number of clients (public), and moves
    ``C <- C exp(-learning_rate (b - target_quantile))``. One client moves the centred sum by
    1/2, so the count's noise multiplier is ``2 count_stddev``. The count and the update sum
    are computed on the same Poisson sample: one round is one Gaussian mechanism with two
    noise scales, ``PoissonSampledDpEvent(q, GaussianDpEvent(z_eff))`` with
    ``z_eff = (z^-2 + (2 count_stddev)^-2)^-1/2`` (:meth:`round_event`, charged *instead of*
    the sum's own event).

    Args:
        target_quantile: gamma in (0, 1), the fraction of updates to leave unclipped.
        learning_rate: eta_C > 0 of the geometric update (0.2 in the paper).
        count_stddev: sigma_b > 0, the noise on the count (the paper: expected clients / 20).
        sampling_probability: q of the clients, as for the sum.

    Example:
        >>> ac = AdaptiveClipping(0.5, count_stddev=1.0, sampling_probability=0.02)
        >>> round(ac.joint_noise_multiplier(1.1), 4)
        0.9638
        >>> round(ac.sum_noise_multiplier(ac.joint_noise_multiplier(1.1)), 9)
        1.1
    """

    target_quantile: float
    learning_rate: float = 0.2
    count_stddev: float = 1.0
    sampling_probability: float = 1.0

    #: How far one client moves the centred count (add or remove one client).
    COUNT_SENSITIVITY = 0.5

    def __post_init__(self) -> None:
        g = _validate.positive("target_quantile", self.target_quantile)
        if not g < 1:
            raise InvalidParameterError("target_quantile", self.target_quantile, "in (0, 1)")
        _validate.positive("learning_rate", self.learning_rate)
        _validate.positive("count_stddev", self.count_stddev)
        _validate.probability("sampling_probability", self.sampling_probability)

    @property
    def count_noise_multiplier(self) -> float:
        """The count's noise over its sensitivity: ``count_stddev / (1/2)``."""
        return float(self.count_stddev) / self.COUNT_SENSITIVITY

    def joint_noise_multiplier(self, noise_multiplier: float) -> float:
        """z_eff of one round whose sum has noise multiplier ``noise_multiplier``."""
        z = _validate.positive("noise_multiplier", noise_multiplier)
        zc = self.count_noise_multiplier
        try:
            return (z ** -2 + zc ** -2) ** -0.5
        except OverflowError:  # z below ~1e-154: the same value, computed without z^-2
            return z / math.sqrt(1 + (z / zc) ** 2)

    def sum_noise_multiplier(self, joint_noise_multiplier: float) -> float:
        """The sum's z that gives the round the joint multiplier ``joint_noise_multiplier``.

        Raises:
            InvalidParameterError: naming ``noise_multiplier`` when the count's noise alone
                leaves no room (z_eff >= 2 count_stddev: no z reaches it).
        """
        zj = _validate.positive("noise_multiplier", joint_noise_multiplier)
        zc = self.count_noise_multiplier
        if not zj < zc:
            raise InvalidParameterError(
                "noise_multiplier", zj, f"a joint noise multiplier below {zc:.6g}, the "
                f"adaptive-clipping count's own (2 x count stddev {self.count_stddev:.6g}): "
                "with adaptive clipping no update noise reaches this epsilon; raise the "
                "count's stddev or the target epsilon")
        return (zj ** -2 - zc ** -2) ** -0.5

    def round_event(self, mechanism: ClientLevelGaussian, neighboring_relation: Any = None
                    ) -> DpEvent:
        """The one event of a round: the sum of ``mechanism`` and this count, released on
        the same sample (the same event under every relation: ``neighboring_relation`` is
        only validated; pricing it under replace-one doubles both sensitivities)."""
        if not isinstance(mechanism, ClientLevelGaussian):
            raise InvalidParameterError("mechanism", type(mechanism).__name__,
                                        "the round's ClientLevelGaussian")
        q = float(self.sampling_probability)
        if float(mechanism.sampling_probability) != q:
            raise InvalidParameterError(
                "sampling_probability", q, f"the mechanism's ({mechanism.sampling_probability}): "
                "the count and the sum are computed on the same sample")
        _relation(neighboring_relation)
        z = self.joint_noise_multiplier(float(mechanism.noise_multiplier))
        return _sampled(GaussianDpEvent(z), q)

    def update(self, clip: float, norms: Any, *, expected_clients: float, rng: Any) -> float:
        """The next clip norm from this round's update norms (the count's noise drawn once)."""
        c = _validate.positive("clip", clip)
        m = _validate.positive("expected_clients", expected_clients)
        n = np.asarray(norms.detach().cpu() if hasattr(norms, "detach") else norms,
                       dtype=np.float64).reshape(-1)
        # a non-finite norm (a zeroed update's, say) counts as above the clip norm
        centred = float(np.where(np.isfinite(n) & (n <= c), 0.5, -0.5).sum())
        torch = _torch()
        if torch is not None and isinstance(rng, torch.Generator):
            like: Any = torch.zeros(1, dtype=torch.float64, device=rng.device)
        else:
            like = np.zeros(1)
        z = gaussian_noise(like, float(self.count_stddev), rng=rng)
        z0 = float(z.reshape(-1)[0])
        noisy = (centred + z0) / m + 0.5
        return c * math.exp(-float(self.learning_rate) * (noisy - float(self.target_quantile)))
