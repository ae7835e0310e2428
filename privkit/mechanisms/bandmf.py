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

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.errors import InvalidParameterError
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

_optimize = LazyModule("scipy.optimize")
_signal = LazyModule("scipy.signal")
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

#: Largest number of rounds for which a tree strategy builds dense matrices.
MAX_DENSE_ROUNDS = 4096


def _rounds(value: Any) -> int:
    return _validate.positive_int("rounds", value)


def _momentum(value: Any) -> float:
    m = _validate.nonnegative("momentum", value)
    if not m < 1:
        raise InvalidParameterError("momentum", value, "in [0, 1)")
    return m


def _workload_denominator(momentum: float) -> np.ndarray:
    """The workload's generating function is 1 / den(x): prefix sums 1 / (1 - x), SGD with
    momentum beta 1 / ((1 - x)(1 - beta x)) (a model's distance from its start)."""
    den = np.array([1.0, -1.0])
    return np.convolve(den, [1.0, -momentum]) if momentum else den


def _impulse(n: int) -> np.ndarray:
    e = np.zeros(n)
    e[0] = 1.0
    return e


def _square_root_coefficients(num_bands: int) -> np.ndarray:
    """c_j = binom(2j, j) / 4^j: the power series of (1 - x)^(-1/2), the Toeplitz square
    root of the prefix-sum matrix, kept to ``num_bands`` terms (positive, decreasing)."""
    j = np.arange(1, num_bands)
    return np.concatenate([[1.0], np.cumprod((2 * j - 1) / (2 * j))])


def _loss_and_gradient(c: np.ndarray, rounds: int, den: np.ndarray) -> tuple[float, np.ndarray]:
    """Total squared error ||A C^-1||_F^2 ||c||^2 of the workload A (Toeplitz, 1 / den) and its
    gradient in c. Every step is a causal filter (scipy's lfilter), O(rounds * bands).

    With h = C^-1's first column and g = A C^-1's, ||A C^-1||_F^2 = sum_n (T - n) g_n^2; the
    adjoint of a causal Toeplitz filter is the same filter run backwards, and
    d(C^-1) = -C^-1 dC C^-1, whose first column is -(h * h) * dc (series products)."""
    h = _signal.lfilter([1.0], c, _impulse(rounds))
    g = _signal.lfilter([1.0], den, h)
    weight = rounds - np.arange(rounds, dtype=np.float64)
    loss = float(np.dot(weight, g * g))
    dg = 2.0 * weight * g
    dh = _signal.lfilter([1.0], den, dg[::-1])[::-1]
    dc = -_signal.lfilter([1.0], np.convolve(c, c), dh[::-1])[::-1][: c.size]
    norm2 = float(np.dot(c, c))
    return loss * norm2, dc * norm2 + 2.0 * loss * c


def _is_monotone(c: np.ndarray) -> bool:
    return bool(c[-1] >= 0 and np.all(c[:-1] >= c[1:]))


@functools.lru_cache(maxsize=64)
def _optimized_coefficients(num_bands: int, rounds: int, momentum: float) -> tuple[float, ...]:
    """L-BFGS-B over ``c_0 = 1, c_j = c_(j-1) r_j`` with ``r_j`` in (0, 1], from the banded
    square root. The coefficients stay positive and non-increasing (what the accountant's
    closed form needs), and the inverse filter stays stable: by the Enestrom-Kakeya theorem
    the polynomial ``sum_j c_j x^j`` then has no root inside the unit disc, so no step of
    the search can make ``C^-1`` blow up. (Unconstrained runs found the same optima.)"""
    den = _workload_denominator(momentum)
    start = _square_root_coefficients(num_bands)
    if num_bands == 1:
        return (1.0,)
    f0 = _loss_and_gradient(start / np.linalg.norm(start), rounds, den)[0]

    def fun(r: np.ndarray) -> tuple[float, np.ndarray]:
        c = np.concatenate([[1.0], np.cumprod(r)])
        f, grad = _loss_and_gradient(c, rounds, den)
        # dF/dr_l = sum_{j >= l} G_j dc_j/dr_l = (sum_{j >= l} G_j c_j) / r_l
        tail = np.cumsum((grad * c)[::-1])[::-1][1:]
        return f / f0, tail / r / f0

    res = _optimize.minimize(fun, start[1:] / start[:-1], jac=True, method="L-BFGS-B",
                             bounds=[(1e-12, 1.0)] * (num_bands - 1),
                             options={"maxiter": 5000, "ftol": 1e-13, "gtol": 1e-10})
    c = np.concatenate([[1.0], np.cumprod(np.asarray(res.x, dtype=np.float64))])
    if not _loss_and_gradient(c, rounds, den)[0] <= _loss_and_gradient(start, rounds, den)[0]:
        c = start  # never worse than where it started
    return tuple(float(v) for v in c / np.linalg.norm(c))


def _prefix_decoder_rows(t: int) -> list[int]:
    """0-based indices of the tree nodes (one per round) whose sum is the prefix sum of
    rounds 0..t-1: the partial sums of t's binary expansion, highest bit first."""
    out, acc = [], 0
    for bit in reversed(range(t.bit_length())):
        if t >> bit & 1:
            acc += 1 << bit
            out.append(acc - 1)
    return out


@dataclass(frozen=True)
class BandedToeplitzStrategy:
    """A banded lower-triangular Toeplitz strategy: ``C[i, j] = coefficients[i - j]`` for
    ``0 <= i - j < num_bands``, else 0, for any number of rounds.

    Args:
        coefficients: ``c_0, ..., c_(b-1)``: finite, ``c_0 > 0``. The constructors below
            return them with unit L2 norm (every full column of ``C`` has norm 1, so a
            noise multiplier means what it means for DP-FedAvg).

    Example:
        >>> BandedToeplitzStrategy.identity().num_bands
        1
        >>> s = BandedToeplitzStrategy.square_root(3)
        >>> [round(v, 4) for v in s.coefficients], s.monotone
        ([0.848, 0.424, 0.318], True)
    """

    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        try:
            c = np.asarray(self.coefficients, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidParameterError("coefficients", self.coefficients,
                                        "a sequence of real numbers") from None
        if c.ndim != 1 or c.size == 0:
            raise InvalidParameterError("coefficients", self.coefficients,
                                        "a non-empty 1-D sequence (c_0, ..., c_(b-1))")
        if not np.isfinite(c).all():
            raise InvalidParameterError("coefficients", self.coefficients, "finite")
        if not c[0] > 0:
            raise InvalidParameterError("coefficients[0]", float(c[0]),
                                        "> 0 (C must be invertible)")
        object.__setattr__(self, "coefficients", tuple(float(v) for v in c))

    @property
    def num_bands(self) -> int:
        """b: ``C[i, j] = 0`` whenever ``i - j >= b``."""
        return len(self.coefficients)

    @property
    def column_norm(self) -> float:
        """L2 norm of a full column of ``C`` (the last ``b - 1`` columns are shorter)."""
        return float(np.linalg.norm(self.coefficients))

    @property
    def monotone(self) -> bool:
        """Whether ``c_0 >= c_1 >= ... >= c_(b-1) >= 0`` (the accountant's closed form)."""
        return _is_monotone(np.asarray(self.coefficients))

    @classmethod
    def identity(cls) -> BandedToeplitzStrategy:
        """``C = I`` (one band): independent noise each round, exactly DP-FedAvg's."""
        return cls((1.0,))

    @classmethod
    def square_root(cls, num_bands: int) -> BandedToeplitzStrategy:
        """The banded square root of the prefix-sum matrix (the coefficients of
        ``(1 - x)^(-1/2)`` kept to ``num_bands`` terms, normalised): no optimisation."""
        b = _validate.positive_int("num_bands", num_bands)
        c = _square_root_coefficients(b)
        return cls(tuple(c / np.linalg.norm(c)))

    @classmethod
    def optimized(cls, num_bands: int, rounds: int, *, momentum: float = 0.0
                  ) -> BandedToeplitzStrategy:
        """Coefficients minimising the total squared error of the prefix sums of ``rounds``
        releases (``momentum > 0``: of SGD with heavy-ball momentum, the model's distance
        from its start) among banded Toeplitz strategies with unit column norm.

        That objective is the right one when clients take part at least ``num_bands``
        rounds apart (then the sensitivity is set by the column norms alone). Deterministic
        (L-BFGS-B from :meth:`square_root`, never worse than it); the result is
        positive and non-increasing (:attr:`monotone`), found under that constraint
        (unconstrained searches found the same optima where we checked). About 1 s for
        b = 64, T = 10^4; cached.

        Raises:
            InvalidParameterError: ``num_bands`` not in [1, rounds], bad ``momentum``.
        """
        b = _validate.positive_int("num_bands", num_bands)
        t = _rounds(rounds)
        if b > t:
            raise InvalidParameterError("num_bands", num_bands, f"<= rounds ({t})")
        return cls(_optimized_coefficients(b, t, _momentum(momentum)))

    def matrix(self, rounds: int) -> np.ndarray:
        """The dense ``rounds x rounds`` strategy matrix ``C`` (float64)."""
        t = _rounds(rounds)
        c = np.zeros((t, t))
        for j, cj in enumerate(self.coefficients[:t]):
            c[np.arange(j, t), np.arange(t - j)] = cj
        return c

    def workload_error(self, rounds: int, *, momentum: float = 0.0) -> float:
        """RMS over the ``rounds`` prefix sums (``momentum``: the momentum workload) of the
        per-coordinate noise standard deviation for unit noise (``Z ~ N(0, 1)``):
        ``||A C^-1||_F / sqrt(rounds)``. Multiply by the noise stddev (``z C_clip``)."""
        t = _rounds(rounds)
        den = _workload_denominator(_momentum(momentum))
        h = _signal.lfilter([1.0], np.asarray(self.coefficients), _impulse(t))
        g = _signal.lfilter([1.0], den, h)
        weight = t - np.arange(t, dtype=np.float64)
        return math.sqrt(float(np.dot(weight, g * g)) / t)


@dataclass(frozen=True)
class TreeStrategy:
    """Binary-tree aggregation (online DP-FTRL, Kairouz et al., ICML 2021): row ``p`` of
    ``C`` (1-based) sums rounds ``p - lowbit(p) + 1 .. p``, the tree node that closes at
    round ``p``; a prefix sum adds the nodes of its binary expansion. Not banded: a round's
    noise depends on up to ``log2(t) + 1`` open nodes.

    Example:
        >>> TreeStrategy().matrix(4).astype(int).tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [1, 1, 1, 1]]
    """

    def matrix(self, rounds: int) -> np.ndarray:
        """The dense ``rounds x rounds`` 0/1 strategy matrix (rounds <= 4096)."""
        t = _dense_rounds(rounds)
        c = np.zeros((t, t))
        for p in range(1, t + 1):
            c[p - 1, p - (p & -p) : p] = 1.0
        return c

    def workload_error(self, rounds: int, *, momentum: float = 0.0) -> float:
        """As :meth:`BandedToeplitzStrategy.workload_error`. Prefix sums: the decoder adds
        ``popcount(t)`` nodes for prefix ``t``; with momentum, dense (rounds <= 4096)."""
        t = _rounds(rounds)
        m = _momentum(momentum)
        if m == 0:
            return math.sqrt(sum(k.bit_count() for k in range(1, t + 1)) / t)
        t = _dense_rounds(rounds)
        decoder = np.zeros((t, t))
        for k in range(1, t + 1):
            decoder[k - 1, _prefix_decoder_rows(k)] = 1.0
        filtered = _signal.lfilter([1.0], [1.0, -m], decoder, axis=0)
        return math.sqrt(float(np.sum(filtered * filtered)) / t)


def _dense_rounds(rounds: Any) -> int:
    t = _rounds(rounds)
    if t > MAX_DENSE_ROUNDS:
        raise InvalidParameterError("rounds", rounds, f"<= {MAX_DENSE_ROUNDS} for a dense "
                                    "matrix of this strategy")
    return t


_STRATEGIES = (BandedToeplitzStrategy, TreeStrategy)


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
        if not isinstance(self.strategy, _STRATEGIES):
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
