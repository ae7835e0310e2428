"""The strategies of matrix-factorization noise: banded Toeplitz and binary tree.

A strategy is the lower-triangular ``T x T`` matrix ``C`` of ``C^-1 (C x + Z)``:
:class:`BandedToeplitzStrategy` (its coefficients, optimised or the banded square root) and
:class:`TreeStrategy` (online DP-FTRL's tree), each with its dense matrix and the error it
gives a workload. Apart from :mod:`privkit.mechanisms.bandmf`, which exports them and streams
the noise, because choosing ``C`` is an offline optimisation (scipy, cached) that knows
nothing of updates, clipping or state.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.errors import InvalidParameterError

_optimize = LazyModule("scipy.optimize")
_signal = LazyModule("scipy.signal")

__all__ = ["BandedToeplitzStrategy", "TreeStrategy", "MAX_DENSE_ROUNDS"]

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
