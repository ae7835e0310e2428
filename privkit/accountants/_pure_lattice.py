"""The older heterogeneous bound kept as :func:`privkit.accountants.pure.dominating_pair_delta`:
every eps_j rounded UP to the grid, the product of the RR(eps_j^up) convolved on the lattice
with one FFT, exponentially tilted so that rounding stays relative at tiny deltas."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.accountants._pure_terms import (
    _TINY,
    _U,
    MAX_POINTS,
    Terms,
    _checked,
    _drv,
    _kov_eps,
    _sums,
    _terms,
)
from privkit.errors import InvalidParameterError, NumericalError

_fft = LazyModule("scipy.fft")
_optimize = LazyModule("scipy.optimize")
_signal = LazyModule("scipy.signal")
_special = LazyModule("scipy.special")

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
