"""Shared pieces of pure-DP composition (:mod:`privkit.accountants.pure`): validated terms,
the closed-form sums and bounds, and the inversions that return the safe side."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.errors import InvalidParameterError, NumericalError

_optimize = LazyModule("scipy.optimize")

MAX_POINTS = 4_000_000  # largest lattice (or k + 1) the exact methods allocate (~1 s)

Terms = Iterable[tuple[float, int]]
Sums = tuple[float, float, float, float]
_U = float(np.finfo(np.float64).eps) / 2  # unit roundoff
_TINY = math.ulp(0.0)  # a positive delta is never rounded down to 0


# ------------------------------------------------------------------ helpers
def _terms(terms: Any) -> tuple[np.ndarray, list[int]]:
    """Validate ``terms``; return the sorted distinct epsilons and their summed counts."""
    need = "a non-empty sequence of (epsilon, count) pairs"
    if isinstance(terms, (str, bytes)) or not isinstance(terms, Iterable):
        raise InvalidParameterError("terms", terms, need)
    merged: dict[float, int] = {}
    for i, item in enumerate(terms):
        try:
            e, c = item
        except (TypeError, ValueError):
            raise InvalidParameterError(f"terms[{i}]", item, "an (epsilon, count) pair") from None
        e = _validate.positive(f"terms[{i}] epsilon", e)
        merged[e] = merged.get(e, 0) + _validate.positive_int(f"terms[{i}] count", c)
    if not merged:
        raise InvalidParameterError("terms", terms, need)
    eps = sorted(merged)
    return np.array(eps, dtype=np.float64), [merged[e] for e in eps]


def _checked(what: str, value: float) -> float:
    """``value`` as a float; NaN or negative raises NumericalError (it is never clamped)."""
    value = float(value)
    if math.isnan(value) or value < 0:
        raise NumericalError(f"{what} came out as {value}; refusing to report it")
    return value


def _sums(eps: np.ndarray, counts: list[int]) -> Sums:
    """S1 = sum c eps, S2 = sum c eps^2, B = sum c eps (e^eps - 1), m = sum c eps tanh(eps/2)."""
    c = np.array(counts, dtype=np.float64)
    with np.errstate(over="ignore"):
        terms = (c * eps, c * eps**2, c * eps * np.expm1(eps), c * eps * np.tanh(eps / 2))
        return tuple(math.fsum(t) for t in terms)  # type: ignore[return-value]


def _smallest_delta(eps_of: Callable[[float], float], d: float, target: float) -> float:
    """Move a closed-form delta up (never down) until ``eps_of(delta) <= target``."""
    d = max(d, _TINY)
    for i in range(200):
        if d >= 1.0:
            return 1.0
        if eps_of(d) <= target:
            return d
        d = min(1.0, d * (1.0 + 2.0 ** (i - 52)))
    raise NumericalError(f"could not invert the closed form at epsilon={target}")


def _delta_of_log(v: float) -> float:
    """The delta reported for a log delta: in [0, 1], a positive one never rounded down to 0."""
    return 0.0 if v == -math.inf else min(1.0, max(math.exp(v), _TINY))


def _log_invert(log_delta: Callable[[float], float], delta: float, hi: float, rtol: float) -> float:
    """Smallest eps >= 0 with ``log_delta(eps) <= log(delta)``, to relative width ``rtol``.

    ``log_delta`` is non-increasing. The bracket is grown by doubling from ``hi``, then narrowed
    by Brent's method on log delta and bisection, recording every evaluation. The UPPER end is
    returned: a point where the delta that optimal_delta reports was computed <= ``delta``.
    """
    target = math.log(delta)
    if _delta_of_log(log_delta(0.0)) <= delta:
        return 0.0
    br = [0.0, hi, -math.inf]  # lo, hi, log delta at hi

    def g(x: float) -> float:
        v = log_delta(x)
        if math.isnan(v):
            raise NumericalError(f"log delta came out as NaN at epsilon={x}")
        if _delta_of_log(v) > delta:  # the very test optimal_delta's output would fail
            br[0] = max(br[0], x)
            return max(v - target, 1e-300)
        if x <= br[1]:
            br[1], br[2] = x, v
        return min(max(v, -1e300) - target, 0.0)

    while g(br[1]) > 0:
        br[1] *= 2.0
        if not math.isfinite(br[1]):
            raise NumericalError("no finite epsilon reaches the target delta")
    while br[2] == -math.inf and br[1] - br[0] > rtol * br[1]:
        g(0.5 * (br[0] + br[1]))  # until log delta at the upper end is finite
    if br[1] - br[0] > rtol * br[1]:
        _optimize.brentq(g, br[0], br[1], xtol=max(0.25 * rtol * br[0], 1e-300),
               rtol=max(0.25 * rtol, 4 * _U), maxiter=200)
    for _ in range(200):
        if br[1] - br[0] <= rtol * br[1]:
            break
        g(0.5 * (br[0] + br[1]))
    return br[1]


def _drv(sums: Sums, d: float) -> float:
    return _checked("advanced epsilon", math.sqrt(2.0 * -math.log(d) * sums[1]) + sums[2])


def _kov_eps(sums: Sums, d: float) -> float:
    s1, s2, _, m = sums
    second = m + math.sqrt(2.0 * s2 * math.log(math.e + math.sqrt(s2) / d))
    third = m + math.sqrt(2.0 * s2 * -math.log(d))
    return _checked("KOV closed-form epsilon", min(s1, second, third))
