"""Record-level DP-SGD in a plain PyTorch training loop (the Opacus-shaped entry point).

:func:`make_private` wraps a module, its optimizer and its data into a :class:`DpSgd`:

- **Poisson batches**: every record joins each batch independently with probability
  ``q = b / n`` (``b`` the expected batch size, ``n`` the data set size); batches vary in
  size and may be empty (an empty batch is a valid step: noise only). An epoch is
  ``ceil(n / b)`` steps.
- **One step** (:meth:`DpSgd.step`): per-example gradients clipped to L2 norm C
  (:func:`privkit.torch.clipped_grad_sum`), summed, ``N(0, (z C)^2)`` added to every
  coordinate, the result divided by the *expected* batch size ``q n`` (a fixed number, never
  the realised one) and stored in ``.grad``; then ``optimizer.step()``. Under add/remove of
  one record, one step is ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` (Abadi et al.,
  CCS 2016; Mironov et al. 2019); the optimizer's update is post-processing.
- **Charged first**: with a :class:`~privkit.ledger.Ledger`, every step is charged to the
  client before its noise is drawn: :meth:`DpSgd.epoch` charges the epoch's steps before
  yielding its first batch (one ledger write per epoch); a step outside a charged epoch
  charges itself, after its clipped sum and before its noise (so a step that raises is not
  charged). A budget refusal raises before anything is drawn or changed.
- **Non-finite gradients** (``nonfinite``, :class:`~privkit.mechanisms.NonFiniteUpdates`):
  an example whose gradient holds NaN or inf (a NaN in its input, an infinite output)
  contributes zeros, silently (``ZERO``, the default: its contribution has norm 0 <= C, the
  others' are unchanged, the step is charged once and the weights stay finite), or the step
  raises naming the example's row (``RAISE``, for debugging), before anything is charged,
  drawn or changed.
- **Randomness** is explicit: a ``torch.Generator`` on the model's device (fast mode; it
  draws the Poisson uniforms and the noise) or a :class:`privkit.SecureRandom` (OS CSPRNG,
  hardened noise ``z C (Z1 + Z2 + Z3 + Z4) / 2``). Inclusion is ``u < q`` with ``u``
  uniform on the 2**-53 grid of (0, 1], so a record's inclusion probability is at most q.

What the guarantee covers: the model after any number of steps. It does not cover numbers
computed from the private batches outside it (e.g. the training loss on a batch), which is
why :meth:`DpSgd.step` returns nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

import privkit
from privkit import _validate
from privkit._rng import RngKind, SecureRandom, check_rng
from privkit.errors import InvalidParameterError
from privkit.ledger import Ledger
from privkit.mechanisms.aggregate import NonFiniteUpdates
from privkit.mechanisms.sampling import gaussian_noise, torch_gaussian_like
from privkit.torch.grads import (
    GradMethod,
    LossFn,
    check_module,
    check_nonfinite,
    clip_factors,
    clipped_grad_sum,
    resolve_method,
)

__all__ = ["DpSgd", "PoissonBatchSampler", "make_private", "step_event", "poisson_take"]


def step_event(noise_multiplier: float, sampling_probability: float) -> Any:
    """The event of one DP-SGD step: ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``
    (just ``GaussianDpEvent(z)`` when q = 1: every record in every step).

    Examples:
        >>> ev = step_event(1.1, 0.01)
        >>> ev.sampling_probability, ev.event.noise_multiplier
        (0.01, 1.1)
    """
    z = _validate.positive("noise_multiplier", noise_multiplier)
    q = _validate.probability("sampling_probability", sampling_probability)
    inner: Any = privkit.GaussianDpEvent(z)
    return inner if q == 1.0 else privkit.PoissonSampledDpEvent(q, inner)


def poisson_take(n: int, q: float, rng: Any) -> torch.Tensor:
    """Bool ``(n,)``: which of n records join a batch, each independently with rate q
    (``u < q``, u on the 2**-53 grid of (0, 1]: probability at most q), on ``rng``'s
    device for a ``torch.Generator``, on the CPU for a :class:`SecureRandom`."""
    if isinstance(rng, SecureRandom):
        return torch.from_numpy(np.asarray(rng.uniform(n)) < q)
    u = torch.rand(n, generator=rng, device=rng.device, dtype=torch.float64)
    return torch.rsub(u, 1.0) < q  # 1 - u: on the grid of (0, 1]


class PoissonBatchSampler(Sampler[list[int]]):
    """Index lists of Poisson batches: ``steps`` batches per pass, each record in each batch
    independently with probability ``sampling_probability``.

    Examples:
        >>> s = PoissonBatchSampler(10, 0.5, 3, generator=torch.Generator().manual_seed(0))
        >>> len(s), [len(b) <= 10 for b in s]
        (3, [True, True, True])
    """

    def __init__(self, dataset_size: int, sampling_probability: float, steps: int, *,
                 generator: Any) -> None:
        self.dataset_size = _validate.positive_int("dataset_size", dataset_size)
        self.sampling_probability = _validate.probability(
            "sampling_probability", sampling_probability)
        self.steps = _validate.positive_int("steps", steps)
        if check_rng(generator) is RngKind.NUMPY:
            raise InvalidParameterError("generator", generator,
                                        "a torch.Generator or a privkit SecureRandom")
        self.generator = generator

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            take = poisson_take(self.dataset_size, self.sampling_probability, self.generator)
            yield torch.nonzero(take).reshape(-1).cpu().tolist()


def check_ledger(ledger: Any) -> Any:
    """``ledger``, checked: a :class:`~privkit.ledger.Ledger` or None."""
    if ledger is not None and not isinstance(ledger, Ledger):
        raise InvalidParameterError("ledger", type(ledger).__name__,
                                    "a privkit.ledger.Ledger or None")
    return ledger


def _empty_like_batch(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x[:0]
    if isinstance(x, (list, tuple)):
        return type(x)(_empty_like_batch(v) for v in x)
    if isinstance(x, dict):
        return {k: _empty_like_batch(v) for k, v in x.items()}
    raise InvalidParameterError("dataset", type(x).__name__,
                                "records that collate into tensors (an empty batch must exist)")


class _Collate:
    """The loader's collate function, also for an empty batch (the shapes of record 0's
    batch, with 0 rows)."""

    def __init__(self, collate: Callable[[list[Any]], Any], dataset: Any) -> None:
        self.collate, self.dataset = collate, dataset

    def __call__(self, records: list[Any]) -> Any:
        if records:
            return self.collate(records)
        return _empty_like_batch(self.collate([self.dataset[0]]))


class DpSgd:
    """Record-level DP-SGD on one module and its optimizer; build it with :func:`make_private`.

    Attributes:
        module, optimizer: what is trained (parameters with ``requires_grad``).
        loader: the Poisson batches (a ``DataLoader``; ``len`` = steps per epoch).
        dataset_size: n; expected_batch_size: b; sampling_probability: q = b / n.
        noise_multiplier: z; l2_clip_norm: C; delta: the delta of :meth:`epsilon`.
        method: the :class:`GradMethod` used (``FUNC`` where ``GHOST`` was asked for a
            model with a recurrent layer); nonfinite: the
            :class:`~privkit.mechanisms.NonFiniteUpdates` policy.
        steps: steps taken (noise drawn and applied).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, dataset: Any, *,
                 expected_batch_size: int, noise_multiplier: float, l2_clip_norm: float,
                 delta: float, generator: Any, loss_fn: LossFn | None = None,
                 ledger: Any = None, client_id: Any = None,
                 method: GradMethod = GradMethod.GHOST,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 num_workers: int = 0,
                 nonfinite: NonFiniteUpdates = NonFiniteUpdates.ZERO) -> None:
        check_module(module)
        self.module, self.optimizer = module, optimizer
        self.noise_multiplier = _validate.positive("noise_multiplier", noise_multiplier)
        self.l2_clip_norm = _validate.positive("max_grad_norm", l2_clip_norm)
        self.delta = _validate.delta("delta", delta)
        self.method, self.loss_fn = resolve_method(module, method), loss_fn
        self.nonfinite = check_nonfinite(nonfinite)
        self._params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        if not self._params:
            raise InvalidParameterError("module", type(module).__name__,
                                        "a module with trainable parameters")
        _check_optimizer(optimizer, self._params)
        self.device = next(iter(self._params.values())).device
        kind = check_rng(generator)
        if kind is RngKind.NUMPY:
            raise InvalidParameterError("generator", generator,
                                        "a torch.Generator or a privkit SecureRandom")
        if kind is RngKind.TORCH and generator.device.type != self.device.type:
            raise InvalidParameterError("generator", f"a generator on {generator.device}",
                                        f"a torch.Generator on the model's device "
                                        f"({self.device})")
        self.generator = generator
        check_ledger(ledger)
        if ledger is not None and client_id is None:
            raise InvalidParameterError("client_id", client_id,
                                        "the ledger id of the data's owner when a ledger is given")
        self.ledger, self.client_id = ledger, client_id
        try:
            n = len(dataset)
        except TypeError:
            raise InvalidParameterError("dataset", type(dataset).__name__,
                                        "a map-style dataset with a length") from None
        self.dataset_size = _validate.positive_int("len(dataset)", n)
        self.expected_batch_size = _validate.positive_int(
            "expected_batch_size", expected_batch_size)
        if self.expected_batch_size > n:
            raise InvalidParameterError("expected_batch_size", expected_batch_size,
                                        f"at most the dataset size {n}")
        self.sampling_probability = self.expected_batch_size / self.dataset_size
        self.steps_per_epoch = math.ceil(self.dataset_size / self.expected_batch_size)
        sampler = PoissonBatchSampler(n, self.sampling_probability, self.steps_per_epoch,
                                      generator=generator)
        default = collate_fn is None or collate_fn is _default_collate()
        if isinstance(dataset, TensorDataset) and default:
            # a TensorDataset indexes a whole batch at once (an empty one too): no per-record
            # fetch and collate
            self.loader = DataLoader(dataset, sampler=sampler, batch_size=None,
                                     num_workers=num_workers)
        else:
            self.loader = DataLoader(
                dataset, batch_sampler=sampler, num_workers=num_workers,
                collate_fn=_Collate(collate_fn or _default_collate(), dataset))
        self.steps = 0
        self._prepaid = 0

    # ------------------------------------------------------------------ privacy
    def step_event(self) -> Any:
        """The event of one step (see :func:`step_event`)."""
        return step_event(self.noise_multiplier, self.sampling_probability)

    def event(self) -> Any:
        """The composed event of the steps taken so far."""
        return privkit.SelfComposedDpEvent(self.step_event(), self.steps)

    def epsilon(self, delta: float | None = None) -> Any:
        """:func:`privkit.epsilon` of the steps taken (an upper bound; 0 before any step),
        at ``delta`` (default: the one given to :func:`make_private`)."""
        d = self.delta if delta is None else delta
        if self.steps == 0:
            return privkit.epsilon(privkit.ComposedDpEvent([]), d)
        return privkit.epsilon(self.event(), d)

    def _charge(self, count: int) -> None:
        if self.ledger is not None and count > 0:
            self.ledger.spend([self.client_id], self.step_event(), count=count,
                              label="dpsgd", step=self.steps)
        self._prepaid += count

    # ------------------------------------------------------------------ training
    def epoch(self) -> Iterator[Any]:
        """One pass of ``steps_per_epoch`` Poisson batches, charged on the ledger (if any)
        before the first is yielded; feed each to :meth:`step`."""
        self._charge(max(0, self.steps_per_epoch - self._prepaid))
        yield from self.loader

    def step(self, inputs: Any, targets: Any, *, extra_gradients: Any = None) -> None:
        """One DP-SGD step on a Poisson batch: clip, charge (unless prepaid by
        :meth:`epoch`), add noise, divide by ``q n``, ``optimizer.step()``.

        An example whose gradient holds NaN or inf contributes zeros (``nonfinite=ZERO``) or
        raises (``RAISE``) before the step is charged or anything is drawn or changed (but
        the parameters' ``.grad`` from the previous step, already applied, is released first,
        as ``optimizer.zero_grad()`` does).

        Args:
            inputs: the module's input for the batch (a tensor or a tuple of them).
            targets: what the loss compares the output with.
            extra_gradients: the audit hook (:mod:`privkit.audit.canaries`): per-example
                gradients of **canary examples** that this step's Poisson batch drew,
                ``{parameter name: (k, *shape)}`` for every trainable parameter (or None).
                Each row is one more example: clipped to C like the others and added to the
                sum before the noise; the step is charged as usual and the divisor stays
                ``q n`` (canaries are extra records the accounting per record does not
                change, but a report must say they were there). They must be finite.
        """
        for p in self._params.values():  # the last step's gradients, used: released now
            p.grad = None
        s = clipped_grad_sum(self.module, inputs, targets, l2_clip_norm=self.l2_clip_norm,
                             loss_fn=self.loss_fn, method=self.method,
                             nonfinite=self.nonfinite)
        if extra_gradients is not None:
            self._add_extra(s.grads, extra_gradients)
        if self._prepaid == 0:
            self._charge(1)
        self._prepaid -= 1
        stddev = _validate.positive("stddev", self.noise_multiplier * self.l2_clip_norm)
        expected = self.sampling_probability * self.dataset_size
        fast = check_rng(self.generator) is RngKind.TORCH  # the same draws, checked once
        for name, p in self._params.items():  # one parameter's noise alive at a time
            g = s.grads[name]
            noise = torch_gaussian_like(g, stddev, self.generator) if fast else \
                gaussian_noise({name: g}, stddev, rng=self.generator)[name]
            p.grad = g.add_(noise).div_(expected)
        self.optimizer.step()
        self.steps += 1


    def _add_extra(self, grads: dict[str, torch.Tensor], extra: Any) -> None:
        """Clip each row of ``extra`` (one canary example over all parameters) to C and add
        the rows' sum to ``grads`` (in place)."""
        if not isinstance(extra, dict) or set(extra) != set(self._params):
            raise InvalidParameterError(
                "extra_gradients", type(extra).__name__ if not isinstance(extra, dict)
                else sorted(extra), f"a dict over the trainable parameters {sorted(self._params)}")
        k = None
        for name, p in self._params.items():
            g = extra[name]
            if not isinstance(g, torch.Tensor) or tuple(g.shape[1:]) != tuple(p.shape) or (
                    k is not None and g.shape[0] != k):
                raise InvalidParameterError(f"extra_gradients[{name!r}]",
                                            tuple(getattr(g, "shape", ())),
                                            f"a tensor of shape (k, {', '.join(map(str, p.shape))})"
                                            " with one k for every parameter")
            k = g.shape[0]
        if not k:
            return
        rows = {n: extra[n].detach().to(self.device, torch.float64).reshape(k, -1)
                for n in self._params}
        sq = sum(r.pow(2).sum(1) for r in rows.values())
        assert isinstance(sq, torch.Tensor)
        if not bool(torch.isfinite(sq).all()):
            raise InvalidParameterError("extra_gradients", "a row with NaN or inf",
                                        "finite canary gradients")
        f = clip_factors(sq.sqrt(), self.l2_clip_norm, torch.float64)
        for n, p in self._params.items():
            grads[n].add_((f[:, None] * rows[n]).sum(0).reshape(p.shape).to(grads[n].dtype))


def _default_collate() -> Callable[[list[Any]], Any]:
    from torch.utils.data import default_collate

    return default_collate


def _check_optimizer(optimizer: Any, params: dict[str, nn.Parameter]) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidParameterError("optimizer", optimizer, "a torch.optim.Optimizer")
    ours = {id(p) for p in params.values()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in ours:
                raise InvalidParameterError(
                    "optimizer", f"a parameter of shape {tuple(p.shape)} outside the module",
                    "an optimizer over the module's trainable parameters only (anything else "
                    "would be updated without noise)")


def make_private(module: nn.Module, optimizer: torch.optim.Optimizer,
                 data_loader: DataLoader | None = None, *, dataset: Dataset | None = None,
                 expected_batch_size: int | None = None, max_grad_norm: float, delta: float,
                 noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 epochs: int | None = None, generator: Any,
                 loss_fn: LossFn | None = None, ledger: Any = None, client_id: Any = None,
                 method: GradMethod = GradMethod.GHOST,
                 nonfinite: NonFiniteUpdates = NonFiniteUpdates.ZERO) -> DpSgd:
    """Record-level DP-SGD for a plain PyTorch loop (module docstring).

    Args:
        module: any ``nn.Module`` whose forward treats examples independently.
        optimizer: over the module's trainable parameters (plain SGD, momentum, Adam, ...).
        data_loader: its dataset, ``collate_fn`` and ``num_workers`` are used, and its
            ``batch_size`` is the expected batch size (its own sampling is replaced by
            Poisson sampling at ``q = batch_size / len(dataset)``); or give ``dataset``
            and ``expected_batch_size`` instead.
        max_grad_norm: C, the per-example L2 clip norm, finite and > 0.
        delta: the delta of :meth:`DpSgd.epsilon` and of ``target_epsilon``, in (0, 1).
        noise_multiplier: z (noise stddev / C); or give ``target_epsilon`` and ``epochs``
            for the smallest z whose ``epochs`` epochs meet the target
            (:func:`privkit.calibrate_noise_multiplier`, verified).
        generator: a ``torch.Generator`` on the module's device or a
            :class:`privkit.SecureRandom`.
        loss_fn: ``loss_fn(output, targets) -> (B,)`` per-example losses (default
            cross-entropy; use ``reduction="none"``).
        ledger: a :class:`~privkit.ledger.Ledger` to charge before each step's noise, or
            None.
        client_id: the data owner's id on ``ledger`` (needed with a ledger).
        method: :class:`~privkit.torch.GradMethod` (ghost clipping by default; a model with
            a recurrent layer gets ``FUNC``, said at INFO).
        nonfinite: :class:`~privkit.mechanisms.NonFiniteUpdates`: an example whose gradient
            holds NaN or inf contributes zeros, silently (``ZERO``, the default), or the step
            raises naming its row (``RAISE``, for debugging).

    Raises:
        InvalidParameterError: a bad argument, named, or a layer that mixes examples.

    Examples:
        >>> net = nn.Linear(4, 2)
        >>> data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
        >>> dp = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), dataset=data,
        ...                   expected_batch_size=8, max_grad_norm=1.0, delta=1e-5,
        ...                   noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
        >>> for x, y in dp.epoch():
        ...     dp.step(x, y)
        >>> dp.steps, round(dp.epsilon().epsilon, 2)
        (5, 3.88)
    """
    if (data_loader is None) == (dataset is None):
        raise InvalidParameterError("data_loader", data_loader,
                                    "given, or else dataset= (exactly one of the two)")
    collate, workers = None, 0
    if data_loader is not None:
        if not isinstance(data_loader, DataLoader):
            raise InvalidParameterError("data_loader", data_loader, "a torch DataLoader")
        dataset, collate, workers = (data_loader.dataset, data_loader.collate_fn,
                                     data_loader.num_workers)
        if expected_batch_size is None:
            if data_loader.batch_size is None:
                raise InvalidParameterError("expected_batch_size", None,
                                            "given when the data loader has no batch_size")
            expected_batch_size = data_loader.batch_size
    if expected_batch_size is None:
        raise InvalidParameterError("expected_batch_size", None, "given with dataset=")
    if (noise_multiplier is None) == (target_epsilon is None):
        raise InvalidParameterError("noise_multiplier", noise_multiplier,
                                    "given, or else target_epsilon= (exactly one of the two)")
    if target_epsilon is not None:
        if epochs is None:
            raise InvalidParameterError("epochs", epochs, "given with target_epsilon")
        n = _validate.positive_int("len(dataset)", len(dataset))  # type: ignore[arg-type]
        b = _validate.positive_int("expected_batch_size", expected_batch_size)
        steps = _validate.positive_int("epochs", epochs) * math.ceil(n / b)
        noise_multiplier = privkit.calibrate_noise_multiplier(
            target_epsilon=target_epsilon, delta=delta, steps=steps,
            sampling_probability=min(1.0, b / n)).noise_multiplier
    assert noise_multiplier is not None
    return DpSgd(module, optimizer, dataset, expected_batch_size=expected_batch_size,
                 noise_multiplier=noise_multiplier, l2_clip_norm=max_grad_norm, delta=delta,
                 generator=generator, loss_fn=loss_fn, ledger=ledger, client_id=client_id,
                 method=method, collate_fn=collate, num_workers=workers, nonfinite=nonfinite)

