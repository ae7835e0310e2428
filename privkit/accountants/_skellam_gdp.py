"""Gaussian-DP of the Skellam mechanism: the tight (epsilon, delta) of a securely summed Skellam
release, from the exact tradeoff curve of a one-dimensional unit shift.

**The one-dimensional pair.** ``X ~ Skellam(M)`` (variance ``M``: ``Poisson(M/2) -
Poisson(M/2)``) has a symmetric, log-concave probability mass function (Poisson masses are
log-concave; so are their reflections and convolutions). For the pair ``(X, X + c)``, ``c`` a
positive integer, the likelihood ratio is therefore monotone, the Neyman-Pearson tests are
thresholds, and the tradeoff curve is the polygon through ``(P(X >= t), P(X + c < t))``,
``t`` an integer. The Gaussian tradeoff ``G_mu`` is convex, so the pair is ``mu``-GDP
(Dong, Roth & Su 2022) exactly when every vertex lies on or above ``G_mu``:
``mu_c = sup_s [h(s) - h(s - c)]`` with ``h = Phi^{-1} o F`` (``F`` the CDF of ``X``).
Telescoping, ``mu_c <= c mu_1`` with ``mu_1 = sup_s r(s)``, ``r(s) = h(s) - h(s - 1)``.

**A release.** A released sum carries ``Skellam(M)`` noise in every coordinate and moves by an
integer vector ``c`` with ``||c||_2 <= Delta_2``. Coordinates where ``c_j = 0`` are the same
law on both sides; the others are independent ``mu_{c_j}``-GDP pairs, so the release is
``sqrt(sum mu_{c_j}^2) <= mu_1 Delta_2``-GDP (GDP composes exactly, adaptively too). For large
``M`` ``mu_1 sqrt(M) -> 1``: the Gaussian mechanism of the same variance, priced exactly,
instead of the Renyi bound of Agarwal, Kairouz & Liu (whose conversion to (epsilon, delta)
asks 6-8% more noise).

**Computing mu_1.** ``r(-s) = r(s)`` (symmetry), so ``s >= 0``; ``r(0) = 2 h(0)``. The masses
``p(k)`` are computed for ``0 <= k <= K`` (scipy's exponentially scaled Bessel function
``ive(k, M)`` below ``M = 10^6``, from there the uniform asymptotic expansion of ``I_k(M)`` with
its first two corrections, whose remainder is ``O(M^-3)``; the two agree to 1e-11 relative
from 10^6 to 10^9, where both apply), ``F`` by summing them in extended
precision, and ``r(s)`` for ``0 <= s <= K'`` directly. ``K`` is chosen so that the Chernoff
bound on ``P(X > K)`` is below ``1e-30 P(X > K')``: the sums are exact to rounding on
``[0, K']``. Past ``K'`` the analysis uses a modified law ``X~``: the same masses on
``|k| <= K'``, geometric tails beyond with the same tail mass ``S(K') = P(X > K')`` and ratio
``a / (1 + a)``, ``a = S(K') / p(K')`` (which keeps it log-concave). ``X~`` has the same CDF on
``[-K' - 1, K']``, and in its tail ``L(s) = -log P(X~ > s)`` grows by the same step each time
while ``G(L) = Phi^{-1}(1 - e^{-L})`` is concave, so its increments there are at most its
increment at ``K' + 1``, itself at most ``r(K')``: ``X~``'s ``mu_1`` is the maximum over
``[0, K']``. ``X`` and ``X~`` differ in total variation by at most ``tau = 2 S(K')`` (below
``1e-100``); a release that moves at most ``Delta_1`` coordinates (an integer vector's
nonzero count is at most its L1 norm) therefore satisfies, composed ``k`` times,
``delta(epsilon) <= delta_GDP(epsilon) + (1 + e^epsilon) k Delta_1 tau``
(:func:`privkit.accountants.rules.delta_slack`; the accountant adds it).

The value returned is rounded up: a relative margin of 1e-9 and an absolute one of 1e-10 cover
the floating-point error of the masses, of the sums and of ``Phi^{-1}`` (about 1e-13
absolute in ``h``).
Each variance's value is cached (a calibration asks for a few dozen).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from privkit import _validate
from privkit.accountants._wraparound import skellam_chernoff_tail
from privkit.errors import InvalidParameterError, NumericalError

__all__ = ["skellam_unit_gdp", "MAX_GDP_VARIANCE", "TAIL_TV"]

#: Largest Skellam variance priced by GDP (about 2^40: ~3.4e7 masses); above it only the Renyi
#: bound prices the event.
MAX_GDP_VARIANCE = float(1 << 40)
#: The total-variation budget per coordinate of the modified law (module docstring).
TAIL_TV = 1e-100
_DEBYE_MIN = 1e6
_REL_MARGIN = 1e-9
_ABS_MARGIN = 1e-10
_CHUNK = 1 << 20


def _log_pmf(k: np.ndarray, m: float) -> np.ndarray:
    """log P(Skellam(m) = k) for integers k >= 0 (float64 array)."""
    if m < _DEBYE_MIN:
        from scipy.special import ive

        with np.errstate(divide="ignore"):
            return np.log(ive(k, m))
    # DLMF 10.41.3 with nu = k, nu z = m:  I_k(m) ~ e^{sqrt(k^2+m^2) + k log(m / (k +
    # sqrt(k^2+m^2)))} / (sqrt(2 pi) (k^2+m^2)^{1/4}) (1 + u_1(t)/k + u_2(t)/k^2), where
    # t = k / w, w = sqrt(k^2+m^2), u_1(t)/k = (3 / w - 5 k^2 / w^3) / 24 and
    # u_2(t)/k^2 = (81 / w^2 - 462 k^2 / w^4 + 385 k^4 / w^6) / 1152 (DLMF 10.41.10); the
    # remainder is O(w^-3) (below 1e-18 here). The exponent, k^2 / (w + m) - k asinh(k / m),
    # is sqrt(k^2+m^2) - m + k log(m / (k + w)) without cancellation.
    w = np.hypot(k, m)
    k2 = (k / w) ** 2
    expo = k * k / (w + m) - k * np.arcsinh(k / m)
    u1 = (3.0 - 5.0 * k2) / (24.0 * w)
    u2 = (81.0 - 462.0 * k2 + 385.0 * k2 * k2) / (1152.0 * w * w)
    return expo - 0.5 * math.log(2 * math.pi) - 0.5 * np.log(w) + np.log1p(u1 + u2)


def _tail_log_bound(t: float, m: float) -> float:
    """log of the Chernoff bound on P(Skellam(m) >= t)."""
    p = skellam_chernoff_tail(t, m)
    return math.log(p) if p > 0 else -math.inf


@functools.lru_cache(maxsize=1024)
def _unit_gdp(m: float) -> float:
    from scipy.special import ndtri

    sigma = math.sqrt(m)
    # K': where the tail is below TAIL_TV / 2 (Chernoff), then K so that P(X > K) is below
    # 1e-30 of the smallest tail the sums need (P(X > K') >= p(K' + 1)).
    k_prime = max(1, math.ceil(sigma))
    while _tail_log_bound(k_prime + 1.0, m) > math.log(TAIL_TV / 4):
        k_prime = math.ceil(k_prime * 1.25) + 1
    k_end = k_prime + 1
    ref = float(_log_pmf(np.array([float(k_prime + 1)]), m)[0])
    while _tail_log_bound(k_end + 1.0, m) > ref + math.log(1e-30):
        k_end = math.ceil(k_end * 1.05) + 1
    # masses p(0..k_end) and tails S(s) = P(X > s), summed from the far end in extended
    # precision (the tail beyond k_end, < 1e-30 of every S used, is left out and covered by
    # the margin)
    surv = np.empty(k_prime + 1, dtype=np.float64)
    acc = np.longdouble(0.0)
    hi = k_end
    while hi >= 0:
        lo = max(0, hi - _CHUNK + 1)
        ks = np.arange(lo, hi + 1, dtype=np.float64)
        pm = np.exp(_log_pmf(ks, m)).astype(np.longdouble)
        # S(s) for s in [lo - 1, hi - 1] is acc + sum of p over (s, hi]
        tail = np.cumsum(pm[::-1])[::-1] + acc  # tail[i] = P(X >= lo + i) (within the sums)
        acc = tail[0]
        s_lo, s_hi = lo - 1, hi - 1  # S(s) = P(X >= s + 1) = tail[s + 1 - lo]
        a, b = max(s_lo, 0), min(s_hi, k_prime)
        if a <= b:
            surv[a:b + 1] = np.asarray(tail[a + 1 - lo:b + 2 - lo], dtype=np.float64)
        hi = lo - 1
    h = -ndtri(surv)  # h(s) = Phi^{-1}(1 - S(s)), s = 0..K'
    r = np.empty_like(h)
    r[0] = 2.0 * h[0]  # r(0) = h(0) - h(-1) = 2 h(0) by symmetry
    r[1:] = h[1:] - h[:-1]
    best = float(np.max(r))
    if not (math.isfinite(best) and best > 0):
        raise NumericalError(f"the Skellam's GDP at variance {m!r} came out as {best}")
    return best * (1.0 + _REL_MARGIN) + _ABS_MARGIN


def skellam_unit_gdp(variance: float) -> float:
    """mu_1: the GDP parameter of ``Skellam(variance)`` against its shift by 1, rounded up
    (module docstring); a release moving an integer vector of L2 norm at most ``Delta_2`` is
    ``mu_1 Delta_2``-GDP up to the total-variation term :data:`TAIL_TV`.

    Args:
        variance: M, the Skellam variance, in [1, :data:`MAX_GDP_VARIANCE`].

    Example:
        >>> mu = skellam_unit_gdp(1e6)
        >>> 1.0 < mu * 1e3 < 1.000001   # the Gaussian of the same variance: exactly 1e-3
        True
    """
    m = _validate.positive("variance", variance)
    if not 1.0 <= m <= MAX_GDP_VARIANCE:
        raise InvalidParameterError("variance", variance, f"in [1, {MAX_GDP_VARIANCE:g}]")
    return _unit_gdp(m)
