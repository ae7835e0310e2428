"""Correlated noise for client-level DP without Poisson sampling: banded matrix factorization.

The matrix-factorization family (DP-FTRL with tree aggregation, Kairouz et al., ICML 2021;
banded MF, Choquette-Choo et al., "Multi-Epoch Matrix Factorization Mechanisms for Private
Machine Learning", ICML 2023, and "(Amplified) Banded Matrix Factorization", NeurIPS 2023)
releases, in round ``t``, the clipped sum of the round's client updates ``x_t`` plus the
correlated noise ``(C^-1 Z)_t``: ``Z`` has i.i.d. ``N(0, (z C_clip)^2)`` rows and ``C`` is a
lower-triangular ``T x T`` *strategy* matrix. The releases are ``C^-1 (C x + Z)``, a
post-processing of the Gaussian mechanism ``C x + Z``, so the whole run is **one** Gaussian
mechanism whose sensitivity depends on ``C`` and on how often and how far apart one client
can take part (:mod:`privkit.accountants.bandmf` computes it and states the event).

Strategies (all lower-triangular with positive diagonal):

- :class:`BandedToeplitzStrategy`: ``C[i, j] = c_(i-j)`` for ``0 <= i - j < b``, else 0
  (``b`` bands). :meth:`~BandedToeplitzStrategy.optimized` minimises the total squared error
  of the prefix sums (or of SGD with momentum) under a column-norm constraint;
  :meth:`~BandedToeplitzStrategy.identity` (``b = 1``) is DP-FedAvg's independent noise;
  :meth:`~BandedToeplitzStrategy.square_root` is the banded square root of the prefix-sum
  matrix (no optimisation).
- :class:`TreeStrategy`: binary-tree aggregation as in online DP-FTRL (the nodes a prefix sum
  uses; no Honaker estimator), not banded.

**Streaming.** Round ``t``'s noise needs no matrix: for a banded Toeplitz ``C`` it is the
linear recurrence ``y_t = (Z_t - sum_{j=1}^{b-1} c_j y_(t-j)) / c_0`` (the last ``b - 1``
noise outputs, O(b d) state and time per round); for the tree, ``y_t`` is the new node's
noise minus the noise of the nodes it closes (a stack of at most ``log2(t) + 1`` of them).
The state (:class:`BandMFState`) is plain float64 arrays or tensors on the model's device
and one integer; :meth:`BandMFState.state_dict` and :meth:`BandMF.load_state` checkpoint it.

Assumptions (:data:`BANDMF_TRUST_ASSUMPTION`, every report should print it): a trusted
aggregator that clips, sums and adds the noise itself, and keeps the noise state secret
(anyone holding it can subtract the correlated part); the participation schema the accounting
assumes is enforced by the server (see :mod:`privkit.accountants.bandmf`).

Example:
    >>> import numpy as np
    >>> strategy = BandedToeplitzStrategy.optimized(num_bands=4, rounds=100)
    >>> mech = BandMF(strategy, l2_clip_norm=1.0, noise_multiplier=2.0)
    >>> state = mech.initial_state()
    >>> rng = np.random.default_rng(0)
    >>> for _ in range(5):
    ...     noisy, state = mech({"w": np.ones((3, 4))}, state, rng=rng)  # 3 clients
    >>> noisy["w"].shape, state.next_round, len(state.history)
    ((4,), 5, 3)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.errors import InvalidParameterError
from privkit.mechanisms._bandmf_strategies import BandedToeplitzStrategy, TreeStrategy
from privkit.mechanisms._tree import _no_grad, _torch
from privkit.mechanisms.aggregate import (
    ClientLevelGaussian,
    NonFiniteUpdates,
    _cast,
    _check_weights,
    _rows,
    _sum_rows,
)
from privkit.mechanisms.sampling import _float_leaves, _unflatten, gaussian_noise

_blas = LazyModule("scipy.linalg.blas")

__all__ = [
    "BANDMF_TRUST_ASSUMPTION",
    "BandMF",
    "BandMFState",
    "BandedToeplitzStrategy",
    "TreeStrategy",
]

#: What the correlated-noise mechanisms assume about the aggregator (every report states it).
BANDMF_TRUST_ASSUMPTION = (
    "trusted aggregator: the server sees the clipped updates, adds the correlated noise itself, "
    "releases only the noisy sums and keeps the noise state (the last noise outputs) secret; "
    "anyone holding that state could remove the correlated part of the noise")


@dataclass(frozen=True)
class BandMFState:
    """Where a :class:`BandMF` run stands: plain data, checkpointable.

    Attributes:
        next_round: rounds released so far (the 0-based index of the next round).
        history: float64 noise trees shaped like the released sums (numpy arrays, or
            tensors on the model's device), oldest first. Banded Toeplitz: the last
            ``min(next_round, b - 1)`` noise outputs; tree: the ``popcount(next_round)``
            open nodes' noise. Never more than ``b - 1`` (or ``log2(t) + 1``) of them.
    """

    next_round: int = 0
    history: tuple[Any, ...] = field(default=())

    def __post_init__(self) -> None:
        _validate.nonnegative_int("next_round", self.next_round)
        if not isinstance(self.history, tuple):
            raise InvalidParameterError("history", type(self.history).__name__, "a tuple")

    @property
    def num_floats(self) -> int:
        """How many float64 numbers the state holds (``(b - 1) d`` once b - 1 rounds ran)."""
        total = 0
        for tree in self.history:
            leaves, _ = _float_leaves(tree, "history", allow_empty=True)
            total += sum(int(np.prod(tuple(leaf.shape))) for _, leaf in leaves)
        return total

    def state_dict(self) -> tuple[dict[str, Any], dict[str, int]]:
        """``(tensors, meta)`` for a checkpoint: ``tensors["history.i.j"]`` is leaf ``j``
        (in the tree's flattening order) of ``history[i]``; ``meta`` holds
        ``next_round`` and the history length. Load with :meth:`BandMF.load_state`."""
        tensors = {}
        for i, tree in enumerate(self.history):
            leaves, _ = _float_leaves(tree, f"history[{i}]", allow_empty=True)
            for j, (_, leaf) in enumerate(leaves):
                tensors[f"history.{i}.{j}"] = leaf
        return tensors, {"next_round": int(self.next_round), "history": len(self.history)}


def _zeros_f64_like(leaf: Any) -> Any:
    """A float64 stand-in with ``leaf``'s shape and device (a broadcast view, no memory)."""
    torch = _torch()
    if torch is not None and isinstance(leaf, torch.Tensor):
        return torch.zeros((), dtype=torch.float64, device=leaf.device).expand(leaf.shape)
    return np.broadcast_to(np.float64(0.0), tuple(leaf.shape))


def _released(y: Any, like: Any) -> Any:
    """A copy of the float64 noise ``y`` in ``like``'s dtype: the state keeps ``y`` itself, so
    what the caller gets must never alias it."""
    torch = _torch()
    if torch is not None and isinstance(y, torch.Tensor):
        return y.to(dtype=like.dtype, copy=True)
    return np.array(y, dtype=like.dtype, copy=True)


def _as_history_leaf(value: Any, like: Any, path: str) -> Any:
    torch = _torch()
    is_torch_like = torch is not None and isinstance(like, torch.Tensor)
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype != torch.float64:
            raise InvalidParameterError(path, value.dtype, "float64")
        value = value.detach().to(like.device) if is_torch_like else value.detach().cpu().numpy()
    elif isinstance(value, np.ndarray):
        if value.dtype != np.float64:
            raise InvalidParameterError(path, value.dtype, "float64")
        value = torch.from_numpy(value.copy()).to(like.device) if is_torch_like else value
    else:
        raise InvalidParameterError(path, type(value).__name__, "a numpy array or torch tensor")
    if tuple(value.shape) != tuple(like.shape):
        raise InvalidParameterError(path, tuple(value.shape), f"shape {tuple(like.shape)}")
    return value


@dataclass(frozen=True)
class BandMF:
    """Client-level aggregation with correlated noise from a matrix factorization.

    Each round: clip every client's whole update to ``l2_clip_norm`` (as
    :class:`~privkit.mechanisms.ClientLevelGaussian`), sum in float64, add round ``t``'s
    correlated noise ``(C^-1 Z)_t`` with ``Z`` i.i.d. ``N(0, (z C_clip)^2)``. The run's event
    is priced by :func:`privkit.accountants.bandmf_event` from ``strategy``,
    ``noise_multiplier``, the number of rounds and the participation schema.

    Args:
        strategy: a :class:`BandedToeplitzStrategy` or :class:`TreeStrategy`.
        l2_clip_norm: C_clip, the bound on one client's update (whole tree), finite, > 0.
        noise_multiplier: z = stddev of ``Z`` / ``l2_clip_norm``, finite, > 0 (the event's
            noise multiplier is z / sensitivity of ``C``).
        nonfinite: what a client update with NaN or inf becomes (default: zeros, silently).

    Example:
        >>> import numpy as np
        >>> mech = BandMF(BandedToeplitzStrategy.square_root(2), 1.0, 1.0)
        >>> noise, state = mech.noise({"w": np.zeros(3)}, mech.initial_state(),
        ...                           rng=np.random.default_rng(0))
        >>> noise["w"].shape, state.next_round
        ((3,), 1)
    """

    strategy: BandedToeplitzStrategy | TreeStrategy
    l2_clip_norm: float
    noise_multiplier: float
    nonfinite: NonFiniteUpdates = NonFiniteUpdates.ZERO

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, (BandedToeplitzStrategy, TreeStrategy)):
            raise InvalidParameterError("strategy", type(self.strategy).__name__,
                                        "a BandedToeplitzStrategy or a TreeStrategy")
        _validate.positive("l2_clip_norm", self.l2_clip_norm)
        _validate.positive("noise_multiplier", self.noise_multiplier)
        if not isinstance(self.nonfinite, NonFiniteUpdates):
            raise InvalidParameterError("nonfinite", self.nonfinite,
                                        "a NonFiniteUpdates member (ZERO or RAISE)")

    @property
    def stddev(self) -> float:
        """Standard deviation of each coordinate of ``Z``: z C_clip."""
        return float(self.noise_multiplier) * float(self.l2_clip_norm)

    @staticmethod
    def initial_state() -> BandMFState:
        """The state before round 0 (no noise drawn yet)."""
        return BandMFState(0, ())

    def history_length(self, next_round: int) -> int:
        """How many noise trees the state holds before round ``next_round``."""
        t = _validate.nonnegative_int("next_round", next_round)
        if isinstance(self.strategy, TreeStrategy):
            return t.bit_count()
        return min(t, self.strategy.num_bands - 1)

    def _check_state(self, state: Any, leaves: list[tuple[str, Any]], spec: Any
                     ) -> list[list[Any]]:
        if not isinstance(state, BandMFState):
            raise InvalidParameterError("state", type(state).__name__,
                                        "a BandMFState (BandMF.initial_state() to start)")
        want = self.history_length(state.next_round)
        if len(state.history) != want:
            raise InvalidParameterError(
                "state", f"{len(state.history)} history entries at round {state.next_round}",
                f"{want} for this strategy (a state from another mechanism?)")
        out = []
        for i, tree in enumerate(state.history):
            h_leaves, h_spec = _float_leaves(tree, f"state.history[{i}]", allow_empty=True)
            if h_spec != spec or any(tuple(a.shape) != tuple(b.shape)
                                     for (_, a), (_, b) in zip(h_leaves, leaves)):
                raise InvalidParameterError(f"state.history[{i}]", "another structure or shape",
                                            "the structure and shapes of the released sums")
            out.append([leaf for _, leaf in h_leaves])
        return out

    def noise(self, like: Any, state: BandMFState, *, rng: Any) -> tuple[Any, BandMFState]:
        """Round ``state.next_round``'s correlated noise, shaped like ``like`` (its dtypes and
        devices), and the state after it. One ``N(0, stddev^2)`` draw per coordinate, in
        float64 (``gaussian_noise`` on a float64 tree of ``like``'s shapes).

        Args:
            like: a tree of arrays or tensors (the round's sum, or the model).
            state: from :meth:`initial_state` or the previous call.
            rng: ``numpy.random.Generator``, ``torch.Generator`` on the model's device, or
                :class:`~privkit.mechanisms.sampling.SecureRandom`.
        """
        leaves, spec = _float_leaves(like, "like", allow_empty=False)
        history = self._check_state(state, leaves, spec)
        with _no_grad():
            z_tree = gaussian_noise(_unflatten(spec, (_zeros_f64_like(x) for _, x in leaves)),
                                    self.stddev, rng=rng)
            z_leaves = [leaf for _, leaf in _float_leaves(z_tree, "noise")[0]]
            if isinstance(self.strategy, TreeStrategy):
                y_leaves, new_history = self._tree_step(z_leaves, history, state.next_round)
            else:
                y_leaves, new_history = self._toeplitz_step(z_leaves, history)
            out = [_released(y, leaf) for y, (_, leaf) in zip(y_leaves, leaves)]
        trees = tuple(_unflatten(spec, iter(h)) for h in new_history)
        return _unflatten(spec, iter(out)), BandMFState(state.next_round + 1, trees)

    def _toeplitz_step(self, z: list[Any], history: list[list[Any]]
                       ) -> tuple[list[Any], list[list[Any]]]:
        """y_t = (Z_t - sum_{j>=1} c_j y_(t-j)) / c_0, in place on the fresh draw Z_t."""
        c = self.strategy.coefficients  # type: ignore[union-attr]
        torch = _torch()
        for i, y in enumerate(z):
            if torch is not None and isinstance(y, torch.Tensor):
                for j, past in enumerate(reversed(history), start=1):  # past = y_(t-j)
                    y.add_(past[i], alpha=-c[j])
            elif history:  # one pass per term (BLAS axpy), no temporary
                flat = y.reshape(-1)
                for j, past in enumerate(reversed(history), start=1):
                    flat = _blas.daxpy(past[i].reshape(-1), flat, a=-c[j])
                z[i] = flat.reshape(y.shape)
        if c[0] != 1.0:
            for y in z:
                y /= c[0]
        if len(c) == 1:
            return z, []
        return z, [*history[max(0, len(history) - (len(c) - 2)):], z]  # the last b - 1

    @staticmethod
    def _tree_step(z: list[Any], history: list[list[Any]], t: int
                   ) -> tuple[list[Any], list[list[Any]]]:
        """Round t (0-based) opens node t + 1 and closes the nodes of (t+1)'s trailing zero
        bits: y_t = w_(t+1) - sum of the closed nodes' noise; push w_(t+1)."""
        closes = ((t + 1) & -(t + 1)).bit_length() - 1
        y = [leaf.clone() if hasattr(leaf, "clone") else leaf.copy() for leaf in z]
        for past in history[len(history) - closes:] if closes else []:
            for out, h in zip(y, past):
                out -= h
        return y, [*history[: len(history) - closes], z]

    def __call__(self, updates: Any, state: BandMFState, *, rng: Any, weights: Any = None
                 ) -> tuple[Any, BandMFState]:
        """The round's noisy (weighted) sum of the clipped updates, and the next state.

        Args:
            updates: a tree whose leaves hold the round's clients on axis 0 (K = 0 allowed;
                ``ClientLevelGaussian.stack`` builds it from a list of per-client trees).
            state: from :meth:`initial_state` or the previous round.
            rng: as for :meth:`noise`.
            weights: optional public per-client weights in [0, 1].
        """
        leaves, spec, k = _rows(updates, "updates")
        w = None if weights is None else _check_weights(weights, k)
        clipper = ClientLevelGaussian(self.l2_clip_norm, self.noise_multiplier,
                                      nonfinite=self.nonfinite)
        with _no_grad():
            clipped = clipper.clip(updates) if k > 0 else updates
            sums = [_sum_rows(leaf, w) for _, leaf in _float_leaves(clipped, "updates",
                                                                       allow_empty=True)[0]]
        noise, new_state = self.noise(_unflatten(spec, iter(sums)), state, rng=rng)
        n_leaves = [leaf for _, leaf in _float_leaves(noise, "noise")[0]]
        out = [_cast(s + n, leaf) for s, n, (_, leaf) in zip(sums, n_leaves, leaves)]
        return _unflatten(spec, iter(out)), new_state

    def load_state(self, tensors: Any, meta: Any, *, like: Any) -> BandMFState:
        """Rebuild a :class:`BandMFState` from :meth:`BandMFState.state_dict`'s output.

        ``like`` gives the structure, shapes and devices (the model or one update); the
        history length must be this strategy's for ``meta["next_round"]``.

        Raises:
            InvalidParameterError: naming the missing, extra or malformed entry.
        """
        if not isinstance(meta, dict) or not isinstance(tensors, dict):
            raise InvalidParameterError("meta", type(meta).__name__,
                                        "the dicts BandMFState.state_dict() returned")
        t = _validate.nonnegative_int("meta['next_round']", meta.get("next_round"))
        n = self.history_length(t)
        if meta.get("history") != n:
            raise InvalidParameterError("meta['history']", meta.get("history"),
                                        f"{n}, this strategy's history at round {t}")
        leaves, spec = _float_leaves(like, "like", allow_empty=False)
        expected = {f"history.{i}.{j}" for i in range(n) for j in range(len(leaves))}
        if set(tensors) != expected:
            extra = sorted(set(tensors) ^ expected)
            raise InvalidParameterError("tensors", extra[:3], "exactly the keys "
                                        "BandMFState.state_dict() wrote for this model")
        history = tuple(
            _unflatten(spec, iter([_as_history_leaf(tensors[f"history.{i}.{j}"], leaf,
                                                    f"tensors['history.{i}.{j}']")
                                   for j, (_, leaf) in enumerate(leaves)]))
            for i in range(n))
        return BandMFState(t, history)
