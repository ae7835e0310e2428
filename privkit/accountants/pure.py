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
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.errors import InvalidParameterError, NumericalError

_fft = LazyModule("scipy.fft")
_optimize = LazyModule("scipy.optimize")
_signal = LazyModule("scipy.signal")
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


# -------------------------------------------------------- basic / advanced
def basic_epsilon(terms: Terms) -> float:
    """Basic composition ``sum_j count_j eps_j`` in nats (delta = 0)."""
    return _checked("basic epsilon", _sums(*_terms(terms))[0])


def _drv(sums: Sums, d: float) -> float:
    return _checked("advanced epsilon", math.sqrt(2.0 * -math.log(d) * sums[1]) + sums[2])


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
def _kov_eps(sums: Sums, d: float) -> float:
    s1, s2, _, m = sums
    second = m + math.sqrt(2.0 * s2 * math.log(math.e + math.sqrt(s2) / d))
    third = m + math.sqrt(2.0 * s2 * -math.log(d))
    return _checked("KOV closed-form epsilon", min(s1, second, third))


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


# ---------------------------------------------------- optimal, heterogeneous
class _Lattice(NamedTuple):
    neg_x: np.ndarray  # -x_i, ascending; x_i = s (M - 2i) are the loss values, descending
    d: np.ndarray  # D_i = delta(x_i) from the clipped PMF P
    g: np.ndarray  # G_i = sum_{i' <= i} P_i' e^(x_i - x_i')
    e2: float  # bound on ||FFT rounding error of the tilted PMF||_2
    factor: float  # >= 1: allowance for the relative rounding of weights and recurrences
    theta: float  # exponential tilt (<= 0) per lattice index
    log_z: float  # log E[e^(theta T)]


def _plan(eps: np.ndarray, counts: list[int], h: float) -> tuple[list[int], int, int]:
    """m_j = smallest m >= 1 with m h >= eps_j (float64); g = gcd(m_j); lattice size."""
    ms = []
    for e in eps:
        m = max(1, math.ceil(e / h))
        m = m - 1 if m > 1 and (m - 1) * h >= e else m
        ms.append(m + 1 if m * h < e else m)
    g = math.gcd(*ms)
    return ms, g, sum(m // g * c for m, c in zip(ms, counts, strict=True)) + 1


def _sized_plan(eps: np.ndarray, counts: list[int], grid: Any) -> tuple[list[int], int, int]:
    ms, g, n_pts = _plan(eps, counts, _validate.positive("grid", grid))
    if n_pts > MAX_POINTS:
        raise InvalidParameterError(
            "grid", grid, f"coarse enough for a lattice of <= {MAX_POINTS} points (got {n_pts})")
    return ms, g, n_pts


def _slack(lat: _Lattice, n: Any) -> Any:
    """FFT allowance sum_{i<n} |err P_i| <= e2 sqrt(sum_{i<n} Z^2 e^(-2 theta i)), n points."""
    if lat.theta == 0.0:
        return np.sqrt(n) * lat.e2
    a = -2.0 * lat.theta
    with np.errstate(divide="ignore", over="ignore"):
        log_r = 2 * lat.log_z + np.log(np.expm1(a * np.asarray(n, dtype=np.float64)))
        return lat.e2 * np.exp(0.5 * (log_r - math.log(math.expm1(a))))


def _lattice(eps: np.ndarray, counts: list[int], grid: Any, center: float | None) -> _Lattice:
    """The lattice of :func:`_tilted_lattice`; when the tilt towards ``center`` is so strong that
    its rounding allowance would swamp delta (a centre at or beyond the largest loss), the
    untilted lattice (``center`` None) is used instead: both are upper bounds."""
    lat = _tilted_lattice(eps, counts, grid, center)
    if lat.factor > 1.001 and center is not None:
        return _tilted_lattice(eps, counts, grid, None)
    return lat


def _tilted_lattice(eps: np.ndarray, counts: list[int], grid: Any,
                    center: float | None) -> _Lattice:
    """PMF of L = sum_j (+-eps_j^up) on the lattice, and the O(N) arrays giving delta(eps).

    With s = h g (g = gcd of the m_j), L = s (M - 2T), T = sum_j m'_j l_j and
    l_j ~ Binomial(count_j, q_j) the number of "minus" outcomes: term j is a binomial PMF on
    stride m'_j. Each term is tilted by e^(theta T) (still binomial), theta <= 0 chosen so that
    the tilted mean sits at the loss ``center`` (nats): this makes FFT rounding relative where
    delta is decided. The terms are multiplied in the rFFT domain (one forward transform each,
    one inverse); negative rounding is clipped to 0 (which cannot increase any error) and
    ``e2`` bounds the 2-norm error by the FFT bound of Higham (Accuracy and Stability, 2002,
    Thm 24.2), (K+1) 6.7 u log2 n (|FFT a_j| <= ||a_j||_1 = 1), with a 1.5x margin. After
    untilting, P_i = P~_i Z e^(-theta i), a tail sum with weights in [0, 1] errs by at most
    e2 sqrt(sum_tail Z^2 e^(-2 theta i)) (:func:`_slack`). Then with r = e^-2s,
    G_i = P_i + r G_{i-1} and D_{i+1} = D_i + (1 - r) G_i: sums of non-negative terms.
    """
    h = _validate.positive("grid", grid)
    ms, gcd, n_pts = _sized_plan(eps, counts, grid)
    k_terms, s = len(ms), h * gcd
    strides = np.array([m // gcd for m in ms], dtype=np.float64)
    e_up = np.array([m * h for m in ms])
    c_arr = np.array(counts, dtype=np.float64)

    def mean_t(th: float) -> float:  # tilted mean of T
        return float(np.sum(c_arr * strides * _special.expit(th * strides - e_up))) - target_t

    theta, target_t = 0.0, 0.5 * max(n_pts - 1 - (center or 0.0) / s, 0.5)
    if center is not None and k_terms > 1 and mean_t(0.0) > 0:
        lo = -1.0 / strides.max()
        while mean_t(lo) > 0:
            lo *= 2.0
        theta = _optimize.brentq(mean_t, lo, 0.0, xtol=1e-300, rtol=1e-6)
    nfft = n_pts if k_terms == 1 else _fft.next_fast_len(n_pts, real=True)
    rel, log_z, spec, pmf = 0.0, 0.0, None, np.zeros(0)
    for c, stride, e in zip(counts, strides.astype(int), e_up, strict=True):
        log_p = -math.log1p(math.exp(-e))
        log_zj = np.logaddexp(log_p, log_p - e + theta * stride)
        log_z += c * log_zj
        log_pt, log_qt = log_p - log_zj, log_p - e + theta * stride - log_zj
        ell = np.arange(c + 1, dtype=np.float64)
        gln = _special.gammaln
        log_c = gln(c + 1.0) - gln(ell + 1.0) - gln(c - ell + 1.0)
        rel += 4 * _U * (3 * _special.gammaln(c + 1.0) + c * (abs(log_pt) + abs(log_qt)) + 4)
        pmf = np.zeros(nfft)
        pmf[: stride * c + 1 : stride] = np.exp(log_c + (c - ell) * log_pt + ell * log_qt)
        if k_terms > 1:
            f = _fft.rfft(pmf, workers=-1)
            spec = f if spec is None else np.multiply(spec, f, out=spec)
    e2 = 0.0
    if k_terms > 1:
        pmf = _fft.irfft(spec, nfft, workers=-1)[:n_pts]
        e2 = 10 * _U * (k_terms + 1) * (math.log2(nfft) + 1)
    pmf = np.maximum(pmf, 0.0)
    total = float(np.sum(pmf))
    if not abs(total - 1.0) <= 1e-8 + e2 * math.sqrt(n_pts):
        raise NumericalError(f"privacy-loss PMF sums to {total}, not 1")
    if theta != 0.0:  # untilt: P_i = P~_i Z e^(-theta i), capped at 1 (true P_i <= 1)
        rel += 2 * _U * (abs(log_z) - theta * n_pts + 1)
        with np.errstate(divide="ignore", over="ignore"):
            log_pmf = np.log(pmf) + (log_z - theta * np.arange(n_pts))
            pmf = np.minimum(np.exp(log_pmf), 1.0)
    g_arr = _signal.lfilter([1.0], [1.0, -math.exp(-2.0 * s)], pmf)
    d_arr = np.zeros(n_pts)
    np.cumsum(-math.expm1(-2.0 * s) * g_arr[:-1], out=d_arr[1:])
    neg_x = s * (2.0 * np.arange(n_pts) - (n_pts - 1))
    factor = math.exp(2 * rel + 8 * _U * n_pts)
    return _Lattice(neg_x, d_arr, g_arr, e2, factor, float(theta), float(log_z))


def _lattice_delta(lat: _Lattice, epsilon: float) -> float:
    """Upper bound on delta(eps); for x_{j+1} <= eps <= x_j it is D_j + (1 - e^(eps-x_j)) G_j."""
    n = int(np.searchsorted(lat.neg_x, -epsilon, side="left"))  # #{i : x_i > eps}
    if n == 0:
        return 0.0
    j = n - 1
    val = lat.d[j] - math.expm1(epsilon + lat.neg_x[j]) * lat.g[j] + float(_slack(lat, n))
    return _checked("optimal delta", min(1.0, lat.factor * val))


def _lattice_epsilon(lat: _Lattice, delta: float) -> float:
    """Smallest eps >= 0 with ``_lattice_delta(eps) <= delta``: closed form in one cell."""
    if _lattice_delta(lat, 0.0) <= delta:
        return 0.0
    j, hi = 0, lat.d.size  # largest j with U_j = factor (D_j + slack(j)) <= delta (U_0 = 0)
    while hi - j > 1:
        mid = (j + hi) // 2
        j, hi = (mid, hi) if lat.factor * (lat.d[mid] + _slack(lat, mid)) <= delta else (j, mid)
    best = -float(lat.neg_x[j])  # verified; look for a smaller answer inside cell j
    room = delta / lat.factor - lat.d[j] - float(_slack(lat, j + 1))
    if lat.g[j] > 0 and room > 0:
        a_star = room / lat.g[j]
        cand = max(0.0, best + (math.log1p(-a_star) if a_star < 1 else -math.inf))
        for i in range(60):  # round up, verify, move further up if needed
            cand += abs(cand) * 2.0 ** (i - 50) + _TINY
            if cand >= best or _lattice_delta(lat, cand) <= delta:
                best = min(best, cand)
                break
    if not _lattice_delta(lat, best) <= delta:
        raise NumericalError(f"lattice inversion did not verify at epsilon={best}")
    return best


def _bin_width(eps: np.ndarray, counts: list[int]) -> float:
    """Tilt centres are snapped to bins of one standard deviation of L (nats)."""
    with np.errstate(over="ignore"):
        var = math.fsum(np.array(counts, dtype=np.float64) * (eps / np.cosh(eps / 2)) ** 2)
    return max(math.sqrt(var), 1e-6 * float(eps.max()), 1e-12)


def _bin(e: float, w: float) -> int:
    """The b with b w <= e < (b + 1) w, exactly as float64 computes b w."""
    b = int(e // w)
    while b > 0 and b * w > e:
        b -= 1
    while (b + 1) * w <= e:
        b += 1
    return b


def _grid_delta(eps: np.ndarray, counts: list[int], e: float, grid: Any) -> float:
    """The lattice bound at ``e``, tilted at the centre of the bin of ``e``."""
    _, g, n_pts = _sized_plan(eps, counts, grid)
    if e >= (n_pts - 1) * (float(grid) * g):  # at or above the largest loss: delta is 0
        return 0.0
    w = _bin_width(eps, counts)
    return _lattice_delta(_lattice(eps, counts, grid, (_bin(e, w) + 0.5) * w), e)


def _grid_epsilon(eps: np.ndarray, counts: list[int], d: float, grid: Any) -> float:
    """Invert on the lattice whose tilt :func:`_grid_delta` uses at the answer (round trip).

    A closed-form guess (for large lattices refined on a 16x coarser lattice, re-tilted until
    its bin is stable) picks the bin b; the lattice tilted at bin b is inverted; if the answer
    leaves bin b, the bin it names is tried next. If two neighbouring lattices each put the
    answer in the other's bin, their common edge is returned, checked on the lattice that
    :func:`_grid_delta` uses there.
    """
    sums, w, h = _sums(eps, counts), _bin_width(eps, counts), _validate.positive("grid", grid)
    guess = min(_kov_eps(sums, d), _drv(sums, d))
    for _ in range(6 if _sized_plan(eps, counts, grid)[2] > 200_000 else 0):
        coarse = _lattice_epsilon(_lattice(eps, counts, 16 * h, guess), d)
        guess, stop = coarse, _bin(coarse, w) == _bin(guess, w)
        if stop:
            break
    b, seen, edge_ok = _bin(guess, w), {}, {}
    for _ in range(20):
        lat = _lattice(eps, counts, grid, (b + 0.5) * w)
        e = _lattice_epsilon(lat, d)
        seen[b], edge_ok[b] = _bin(e, w), _lattice_delta(lat, b * w) <= d
        if seen[b] == b:
            return _checked("optimal epsilon", e)
        if seen[b] < b and seen.get(b - 1, -1) >= b and edge_ok[b]:
            return _checked("optimal epsilon", b * w)
        if seen[b] > b and b + 1 in seen and seen[b + 1] <= b and edge_ok[b + 1]:
            return _checked("optimal epsilon", (b + 1) * w)
        b = seen[b]
    raise NumericalError("the lattice inversion did not settle on a tilt")


def dominating_pair_delta(terms: Terms, epsilon: float, *, grid: float = 1e-4) -> float:
    """Upper bound on delta(epsilon) (epsilon in nats, inf gives 0) from prod_j RR(eps_j^up).

    eps_j^up = m_j * grid >= eps_j (``grid`` in nats); delta(eps) = sum_{L > eps} P(L)
    (1 - e^(eps - L)) over the lattice PMF of the loss L, plus the FFT allowance: exact up to
    it (relative ~1e-12) when every eps_j is a multiple of ``grid``. Raises
    InvalidParameterError (``grid``) when the lattice would exceed :data:`MAX_POINTS` points.
    """
    eps, counts = _terms(terms)
    e = _validate.nonnegative_or_inf("epsilon", epsilon)
    _validate.positive("grid", grid)
    return 0.0 if e == math.inf else _grid_delta(eps, counts, e, grid)


def dominating_pair_epsilon(terms: Terms, delta: float, *, grid: float = 1e-4) -> float:
    """Smallest epsilon (nats) with ``dominating_pair_delta(terms, eps, grid=grid) <= delta``.

    Solved exactly in the lattice cell that holds it, rounded up by a few ulps and verified.
    """
    eps, counts = _terms(terms)
    return _grid_epsilon(eps, counts, _validate.delta("delta", delta), grid)


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
