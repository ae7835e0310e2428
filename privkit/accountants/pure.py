"""Composition of pure epsilon-DP steps: basic, advanced and optimal (spec section 2.5).

``terms`` is a sequence of ``(epsilon_j, count_j)`` pairs: ``count_j`` steps, each
``epsilon_j``-DP (epsilon in nats, finite and > 0; count an integer >= 1); equal epsilons are
merged. Every result is an upper bound: epsilon in nats, delta a probability.

* Basic: ``sum_j count_j eps_j``, delta = 0.
* Advanced [Dwork, Rothblum & Vadhan, "Boosting and Differential Privacy", FOCS 2010]:
  ``sqrt(2 log(1/delta) sum c eps^2) + sum c eps (e^eps - 1)``, reported capped at basic.
* Optimal, one distinct eps0 [Kairouz, Oh & Viswanath, "The Composition Theorem for Differential
  Privacy", ICML 2015, Thm 3.3]: the exact profile of k-fold randomized response RR(eps0), in
  log space, O(k).
* Optimal, several epsilons: exact evaluation is #P-hard [Murtagh & Vadhan, TCC 2016]. The
  product of the RR(eps_j) (the dominating pair) is composed by privkit's PLD
  (:mod:`privkit.accountants.fftpld`) on the grid ``grid``: a loss +-eps_j between grid points
  is split between its neighbours (connect-the-dots, which dominates), so the result is an
  upper bound, exact up to the FFT allowance when every eps_j is a multiple of ``grid``, and
  never above rounding each eps_j up. One composed PMF answers every delta(eps), so
  :func:`optimal_delta` is monotone. When the composition does not fit the grid (or, for one
  epsilon, k + 1 exceeds :data:`MAX_POINTS`), privkit's PLD plans a coarser grid itself
  (:data:`METHOD_PLD`), still an upper bound.
* :func:`dominating_pair_delta` / :func:`dominating_pair_epsilon` keep the older bound that
  rounds every eps_j UP to the grid and convolves on the lattice (exponentially tilted).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.accountants._pure_lattice import (
    _grid_delta,
    _grid_epsilon,
    _plan,
    dominating_pair_delta,
    dominating_pair_epsilon,
)
from privkit.accountants._pure_terms import (
    _TINY,
    MAX_POINTS,
    Sums,
    Terms,
    _checked,
    _delta_of_log,
    _drv,
    _kov_eps,
    _log_invert,
    _smallest_delta,
    _sums,
    _terms,
)
from privkit.errors import InvalidParameterError, NumericalError

_special = LazyModule("scipy.special")

__all__ = [
    "METHOD_KOV_EXACT", "METHOD_GRID", "METHOD_PLD", "METHOD_KOV_CLOSED_FORM", "METHOD_ADVANCED",
    "METHOD_BASIC", "MAX_POINTS", "basic_epsilon", "drv_epsilon", "advanced_epsilon",
    "advanced_delta", "kov_closed_form_epsilon", "kov_closed_form_delta",
    "dominating_pair_delta", "dominating_pair_epsilon", "optimal_method", "optimal_delta",
    "optimal_epsilon", "tightest_epsilon",
]

METHOD_KOV_EXACT = "optimal (KOV exact, homogeneous)"
METHOD_GRID = "optimal (dominating pair on grid)"
METHOD_PLD = "optimal (dominating pair, privkit PLD on a coarser grid)"
METHOD_KOV_CLOSED_FORM = "KOV Thm 3.5 closed form"
METHOD_ADVANCED = "advanced (DRV)"
METHOD_BASIC = "basic"


# -------------------------------------------------------- basic / advanced
def basic_epsilon(terms: Terms) -> float:
    """Basic composition ``sum_j count_j eps_j`` in nats (delta = 0)."""
    return _checked("basic epsilon", _sums(*_terms(terms))[0])


def drv_epsilon(terms: Terms, delta: float) -> float:
    """The raw Dwork-Rothblum-Vadhan bound (FOCS 2010, Thm III.3), NOT capped at basic.

    ``sqrt(2 log(1/delta) sum c eps^2) + sum c eps (e^eps - 1)``; for k steps of eps0 this is
    ``sqrt(2 k log(1/delta)) eps0 + k eps0 (e^eps0 - 1)``.

    Args:
        terms: ``(epsilon_j, count_j)`` pairs, epsilon in nats.
        delta: The extra delta' in (0, 1).

    Returns:
        Epsilon in nats (may exceed :func:`basic_epsilon`; inf on overflow).
    """
    return _drv(_sums(*_terms(terms)), _validate.delta("delta", delta))


def advanced_epsilon(terms: Terms, delta: float) -> float:
    """Advanced composition as reported: ``min(drv_epsilon(terms, delta), basic)`` in nats."""
    sums = _sums(*_terms(terms))
    return min(_drv(sums, _validate.delta("delta", delta)), _checked("basic epsilon", sums[0]))


def advanced_delta(terms: Terms, epsilon: float) -> float:
    """Smallest delta with ``advanced_epsilon(terms, delta) <= epsilon`` (closed form).

    Args:
        terms: ``(epsilon_j, count_j)`` pairs, epsilon in nats.
        epsilon: Target epsilon in nats, >= 0 (inf allowed).

    Returns:
        0.0 if ``epsilon >= basic``; 1.0 if no delta < 1 reaches it; else
        ``exp(-(epsilon - B)^2 / (2 S2))``, moved up by ulps until the forward formula agrees.
    """
    s1, s2, b, _ = _sums(*_terms(terms))
    target = _validate.nonnegative_or_inf("epsilon", epsilon)
    if target >= s1:
        return 0.0
    if not target > b:
        return 1.0
    d = math.exp(-((target - b) ** 2) / (2.0 * s2))
    return _checked("advanced delta", _smallest_delta(
        lambda x: math.sqrt(2.0 * -math.log(x) * s2) + b, d, target))


# ------------------------------------------------------ KOV Thm 3.5 closed form
def kov_closed_form_epsilon(terms: Terms, delta: float) -> float:
    """KOV (ICML 2015) Theorem 3.5 closed form for heterogeneous pure steps, in nats.

    With S1 = sum c eps, S2 = sum c eps^2, m = sum c eps (e^eps - 1)/(e^eps + 1):
    ``min{S1, m + sqrt(2 S2 log(e + sqrt(S2)/delta)), m + sqrt(2 S2 log(1/delta))}``.

    Args:
        terms: ``(epsilon_j, count_j)`` pairs, epsilon in nats.
        delta: Target delta in (0, 1).
    """
    return _kov_eps(_sums(*_terms(terms)), _validate.delta("delta", delta))


def _kov_delta(sums: Sums, target: float) -> float:
    s1, s2, _, m = sums
    if target >= s1:
        return 0.0
    if not target > m:
        return 1.0
    y = (target - m) ** 2 / (2.0 * s2)
    d = math.exp(-y)
    if y > 1.0:  # log(e + sqrt(S2)/d) <= y  <=>  d >= sqrt(S2) / (e^y - e)
        d = min(d, math.exp(0.5 * math.log(s2) - y - math.log(-math.expm1(1.0 - y))))
    return _checked("KOV closed-form delta", _smallest_delta(
        lambda x: _kov_eps((math.inf, s2, 0.0, m), x), d, target))


def kov_closed_form_delta(terms: Terms, epsilon: float) -> float:
    """Smallest delta with ``kov_closed_form_epsilon(terms, delta) <= epsilon``.

    Returns:
        0.0 if ``epsilon >= S1`` (inf allowed), 1.0 if unreachable, else the inverse.
    """
    sums = _sums(*_terms(terms))
    return _kov_delta(sums, _validate.nonnegative_or_inf("epsilon", epsilon))


# ------------------------------------------------------ optimal, homogeneous
def _kov_log_delta_fn(eps0: float, k: int) -> Callable[[float], float]:
    """log delta(eps) of k-fold RR(eps0) [KOV Thm 3.3]: O(k) setup, O(k) per call.

    delta(eps) = sum_l C(k,l) [p^(k-l) q^l - e^eps q^(k-l) p^l]_+, p = e^eps0 / (1 + e^eps0).
    Summand l is w_l (1 - e^(eps - L_l)) with w_l = C(k,l) p^(k-l) q^l and loss
    L_l = (k - 2l) eps0; it is positive iff L_l > eps, so nothing cancels. gammaln's absolute
    error ~ u k log k gives a relative error of about 1e-9 in delta at k = 1e6.
    """
    ell = np.arange(k + 1, dtype=np.float64)
    log_p = -math.log1p(math.exp(-eps0))
    gln = _special.gammaln
    log_w = gln(k + 1.0) - gln(ell + 1.0) - gln(k - ell + 1.0) + k * log_p - ell * eps0
    neg_loss = -(k - 2.0 * ell) * eps0  # ascending

    def log_delta(epsilon: float) -> float:
        n = int(np.searchsorted(neg_loss, -epsilon, side="left"))  # #{l : L_l > epsilon}
        if n == 0:
            return -math.inf
        return float(_special.logsumexp(log_w[:n] + np.log(-np.expm1(epsilon + neg_loss[:n]))))

    return log_delta


# --------------------------------------------------- optimal, via privkit's PLD
def _atoms(eps: np.ndarray, counts: list[int]) -> list[tuple[Any, int]]:
    from privkit.accountants.fftpld import PureAtom

    return [(PureAtom(float(e)), int(c)) for e, c in zip(eps, counts, strict=True)]


def _curve(eps: np.ndarray, counts: list[int], grid: Any) -> Any:
    """privkit's PLD of the dominating pair on ``grid`` (cached), or None if it does not fit.

    The FFT runs in extended precision (chosen from the terms alone, so that
    :func:`optimal_delta` is one monotone curve)."""
    h = _validate.positive("grid", grid)
    key = (tuple(eps.tolist()), tuple(counts), h)
    if key not in _CURVES:
        from privkit.accountants import fftpld

        try:
            _CURVES[key] = fftpld.curve(_atoms(eps, counts), "ADD_OR_REMOVE_ONE", h,
                                        extended=True)
        except fftpld.WindowTooLarge:
            _CURVES[key] = None
        if len(_CURVES) > 64:
            _CURVES.pop(next(iter(_CURVES)))
    return _CURVES[key]


_CURVES: dict[tuple[Any, ...], Any] = {}
#: Below this multiple of the PLD's floating-point allowance, the tilted lattice (relative
#: precision at tiny deltas) is computed too and the smaller bound is used.
_LATTICE_BELOW = 1e4


def _lattice_fits(eps: np.ndarray, counts: list[int], grid: Any) -> bool:
    return _plan(eps, counts, float(grid))[2] <= MAX_POINTS


# ------------------------------------------------------------ optimal, public
def _method(eps: np.ndarray, counts: list[int], grid: Any) -> str:
    h = _validate.positive("grid", grid)
    if len(eps) == 1:
        return METHOD_KOV_EXACT if counts[0] + 1 <= MAX_POINTS else METHOD_PLD
    return METHOD_GRID if _curve(eps, counts, h) is not None else METHOD_PLD


def optimal_method(terms: Terms, *, grid: float = 1e-4) -> str:
    """The bound :func:`optimal_delta` and :func:`optimal_epsilon` use for these terms.

    Returns:
        :data:`METHOD_KOV_EXACT` (one distinct epsilon), :data:`METHOD_GRID` (several), or
        :data:`METHOD_PLD` when k + 1 exceeds :data:`MAX_POINTS` or the composition does not
        fit the grid.
    """
    return _method(*_terms(terms), grid)


def optimal_delta(terms: Terms, epsilon: float, *, grid: float = 1e-4) -> float:
    """Optimal-composition delta at ``epsilon``: an upper bound (see :func:`optimal_method`).

    Args:
        terms: ``(epsilon_j, count_j)`` pairs, epsilon in nats.
        epsilon: Epsilon in nats, >= 0 (inf gives 0).
        grid: Lattice step in nats, used when there are several distinct epsilons.

    Returns:
        delta in [0, 1]; a positive delta is never rounded down to 0.
    """
    eps, counts = _terms(terms)
    e = _validate.nonnegative_or_inf("epsilon", epsilon)
    method = _method(eps, counts, grid)
    if e == math.inf:
        return 0.0
    if e >= _sums(eps, counts)[0]:  # at or above basic composition: delta is 0
        return 0.0
    if method == METHOD_PLD:
        from privkit.accountants import fftpld

        return _checked("optimal delta", fftpld.delta(
            _atoms(eps, counts), e, "ADD_OR_REMOVE_ONE", e, _kov_delta(_sums(eps, counts), e)))
    if method == METHOD_GRID:
        cur = _curve(eps, counts, grid)
        d = cur.delta(e)
        if d < _LATTICE_BELOW * cur.slack and _lattice_fits(eps, counts, grid):
            d = min(d, _grid_delta(eps, counts, e, grid))
        return _checked("optimal delta", d)
    log_d = _kov_log_delta_fn(float(eps[0]), counts[0])(e)
    if math.isnan(log_d):
        raise NumericalError(f"optimal delta came out as NaN at epsilon={e}")
    return _delta_of_log(log_d)


def _optimal(
    eps: np.ndarray, counts: list[int], d: float, grid: Any, rtol: float
) -> tuple[float, str]:
    method = _method(eps, counts, grid)
    sums = _sums(eps, counts)
    if method == METHOD_PLD:
        from privkit.accountants import fftpld

        e = fftpld.epsilon(_atoms(eps, counts), d, "ADD_OR_REMOVE_ONE")[0]
        return min(_checked("optimal epsilon", e), _checked("basic", sums[0])), method
    if method == METHOD_GRID:
        cur = _curve(eps, counts, grid)
        e = math.inf
        if d >= 2 * cur.slack:
            e = _checked("optimal epsilon", cur.epsilon(d))
        if d < _LATTICE_BELOW * cur.slack and _lattice_fits(eps, counts, grid):
            e = min(e, _grid_epsilon(eps, counts, d, grid))
        if not math.isfinite(e):  # delta below the PLD's allowance, lattice too large
            e = _kov_eps(sums, d)
            method = METHOD_KOV_CLOSED_FORM
        return min(e, _checked("basic", sums[0])), method
    start = max(min(sums[0], _drv(sums, d)), _TINY)
    fn = _kov_log_delta_fn(float(eps[0]), counts[0])
    return _checked("optimal epsilon", _log_invert(fn, d, start, rtol)), method


def optimal_epsilon(terms: Terms, delta: float, *, grid: float = 1e-4,
                    rtol: float = 1e-10) -> float:
    """Optimal-composition epsilon (nats) at ``delta``: a verified upper bound.

    One distinct eps0: the KOV exact profile inverted on log delta (bracket grown by doubling,
    Brent then bisection to relative width ``rtol``); the bracket's upper end is returned, where
    delta was computed <= ``delta``. Several: privkit's PLD of the dominating pair (module doc).

    Args:
        terms: ``(epsilon_j, count_j)`` pairs, epsilon in nats.
        delta: Target delta in (0, 1).
        grid: Lattice step in nats, used when there are several distinct epsilons.
        rtol: Relative bracket width of the homogeneous inversion, in [1e-15, 0.1].
    """
    eps, counts = _terms(terms)
    d = _validate.delta("delta", delta)
    if not 1e-15 <= _validate.positive("rtol", rtol) <= 0.1:
        raise InvalidParameterError("rtol", rtol, "in [1e-15, 0.1]")
    return _optimal(eps, counts, d, grid, float(rtol))[0]


def tightest_epsilon(terms: Terms, delta: float, *, grid: float = 1e-4) -> tuple[float, str]:
    """The smallest of the optimal, advanced (raw DRV) and basic epsilon, and its method.

    Returns:
        ``(epsilon in nats, method)``, the method being one of the ``METHOD_*`` constants.
    """
    eps, counts = _terms(terms)
    d = _validate.delta("delta", delta)
    sums = _sums(eps, counts)
    best = (_checked("basic epsilon", sums[0]), METHOD_BASIC)
    for cand in ((_drv(sums, d), METHOD_ADVANCED), _optimal(eps, counts, d, grid, 1e-10)):
        if cand[0] < best[0]:
            best = cand
    return best
