"""Confidence bounds the audits share: counts of an event under two neighbours -> a lower bound.

Every bound here holds with probability at least ``1 - alpha`` over the draws (one-sided
Clopper-Pearson intervals combined by a union bound), so an audit that finds a lower bound above
a mechanism's claim has found a violation with that confidence. Pure DP
(:func:`threshold_epsilon_lower_bound`), Gaussian DP (:func:`gdp_mu_lower_bound`), Renyi
divergence of order 2 (:func:`renyi2_lower_bound`) and mutual information
(:func:`binary_mi_lower_bound`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privkit._lazy import LazyModule

special = LazyModule("scipy.special")
stats = LazyModule("scipy.stats")

__all__ = [
    "clopper_pearson_upper",
    "clopper_pearson_lower",
    "threshold_epsilon_lower_bound",
    "gdp_mu_lower_bound",
    "renyi2_lower_bound",
    "binary_mi_lower_bound",
]


def clopper_pearson_upper(k: Any, n: int, a: float) -> np.ndarray:
    """One-sided upper (1 - a) Clopper-Pearson bound on p from k successes in n (vectorised)."""
    k = np.asarray(k, dtype=np.float64)
    out = stats.beta.ppf(1.0 - a, k + 1.0, np.maximum(n - k, 1.0))
    return np.where(k >= n, 1.0, out)


def clopper_pearson_lower(k: Any, n: int, a: float) -> np.ndarray:
    """One-sided lower (1 - a) Clopper-Pearson bound on p from k successes in n (vectorised)."""
    k = np.asarray(k, dtype=np.float64)
    out = stats.beta.ppf(a, np.maximum(k, 1.0), n - k + 1.0)
    return np.where(k <= 0, 0.0, out)


def threshold_epsilon_lower_bound(
    k0: Any, k1: Any, n: int, alpha: float, delta: float = 0.0
) -> np.ndarray:
    """eps lower bound from k0 of n draws of M(D) and k1 of n draws of M(D') in an event S.

    ``max(ln((TPR_lo - delta) / FPR_hi), ln((1 - FPR_hi - delta) / (1 - TPR_lo)))``,
    each Clopper-Pearson bound at ``alpha/4`` (mechanisms.md 5). ``-inf`` where
    both logarithms are undefined.
    """
    fpr_hi = clopper_pearson_upper(k0, n, alpha / 4)
    tpr_lo = clopper_pearson_lower(k1, n, alpha / 4)
    with np.errstate(divide="ignore", invalid="ignore"):
        e1 = np.log((tpr_lo - delta) / fpr_hi)
        e2 = np.log((1.0 - fpr_hi - delta) / (1.0 - tpr_lo))
    out = np.fmax(e1, e2)
    return np.where(np.isnan(out), -np.inf, out)


def gdp_mu_lower_bound(false_pos: int, false_neg: int, n: int, alpha: float) -> float:
    """``Phi^-1(1 - FPR_hi) - Phi^-1(FNR_hi)``, each bound at ``alpha/2`` (mechanisms.md 5)."""
    fpr_hi = float(clopper_pearson_upper(false_pos, n, alpha / 2))
    fnr_hi = float(clopper_pearson_upper(false_neg, n, alpha / 2))
    return float(stats.norm.ppf(1.0 - fpr_hi) - stats.norm.ppf(fnr_hi))


def _count_at_least(sorted_s: np.ndarray, t: Any) -> np.ndarray:
    return sorted_s.size - np.searchsorted(sorted_s, t, side="left")


def _threshold_audit(
    cal0: np.ndarray, cal1: np.ndarray, ev0: np.ndarray, ev1: np.ndarray, alpha: float
) -> dict[str, Any]:
    """Choose an orientation and t on the calibration half; bound eps on the evaluation half.

    The event is ``S = {sign * s >= t}``. The bound's formula needs S to favour D'
    (its first term) or its complement to favour D (second term), so both signs are
    tried on the calibration half and the better one is kept.
    """
    n_cal, n_ev = cal0.size, ev0.size
    best: tuple[float, float, float] = (-np.inf, 1.0, float(np.median(cal0)))
    for sign in (1.0, -1.0):
        c0, c1 = np.sort(sign * cal0), np.sort(sign * cal1)
        pooled = np.sort(np.concatenate([c0, c1]))
        m = pooled.size
        frac = np.geomspace(min(5.0 / m, 0.5), 0.5, 200)
        idx = np.clip(np.concatenate([frac * m, (1.0 - frac) * m]).astype(np.int64), 0, m - 1)
        cands = np.unique(pooled[idx])
        scores = threshold_epsilon_lower_bound(
            _count_at_least(c0, cands), _count_at_least(c1, cands), n_cal, alpha
        )
        i = int(np.argmax(scores))
        if scores[i] > best[0]:
            best = (float(scores[i]), sign, float(cands[i]))
    score, sign, t = best
    k0 = int(np.count_nonzero(sign * ev0 >= t))
    k1 = int(np.count_nonzero(sign * ev1 >= t))
    eps_lb = float(threshold_epsilon_lower_bound(k0, k1, n_ev, alpha))
    return {
        "threshold": t,
        "orientation": sign,
        "calibration_epsilon_lower": score,
        "count_D": k0,
        "count_D_prime": k1,
        "fpr_hi": float(clopper_pearson_upper(k0, n_ev, alpha / 4)),
        "tpr_lo": float(clopper_pearson_lower(k1, n_ev, alpha / 4)),
        "epsilon_lower_raw": eps_lb,
    }


def renyi2_lower_bound(k0: Any, k1: Any, n: int, alpha: float) -> float:
    """Lower bound on max(D_2(P1||P0), D_2(P0||P1)) from binned counts (n draws each).

    With Clopper-Pearson bounds at ``alpha / (4 B)`` per bin (B bins, union bound), every
    ``P1_b >= lo1_b`` and ``P0_b <= hi0_b`` (and the reverse) hold together with probability
    >= 1 - alpha, so ``log sum_b lo1_b^2 / hi0_b`` is below the binned D_2(P1||P0), which is
    below the true one (data processing). Clamped at 0.
    """
    k0, k1 = np.asarray(k0, dtype=np.float64), np.asarray(k1, dtype=np.float64)
    a = alpha / (4 * k0.size)
    lo0, hi0 = clopper_pearson_lower(k0, n, a), clopper_pearson_upper(k0, n, a)
    lo1, hi1 = clopper_pearson_lower(k1, n, a), clopper_pearson_upper(k1, n, a)
    fwd = float(np.sum(lo1**2 / hi0))
    bwd = float(np.sum(lo0**2 / hi1))
    return max(0.0, math.log(fwd) if fwd > 0 else 0.0, math.log(bwd) if bwd > 0 else 0.0)


def _entropy2(p: np.ndarray) -> np.ndarray:
    """Binary entropy in nats (0 at p = 0 or 1)."""
    return special.entr(p) + special.entr(1.0 - p)


def binary_mi_lower_bound(k0: Any, k1: Any, n: int, alpha: float, prior: float) -> np.ndarray:
    """Lower bound (nats) on I(X; Y) for X ~ Bernoulli(prior) from an event's counts.

    ``k0`` of ``n`` draws of Y given X = 0 and ``k1`` of ``n`` given X = 1 fell in an event S.
    By data processing ``I(X; Y) >= I(X; 1_S(Y)) = f(p0, p1)``, the mutual information of a
    binary channel. For a fixed input law f is convex in the channel ``(p0, p1)`` and zero on
    ``p0 = p1``, so it increases in p1 and decreases in p0 while ``p0 <= p1``; with
    Clopper-Pearson bounds ``p0 <= hi0``, ``p1 >= lo1`` (``alpha / 2`` each, holding together
    with probability >= 1 - alpha) ``f(p0, p1) >= f(hi0, lo1)`` when ``lo1 > hi0`` (else 0).
    (For ``prior = 1/2`` this is at least Fano's ``log 2 - H_b(P_e)``.) Vectorised over counts.
    """
    hi0 = clopper_pearson_upper(k0, n, alpha / 2)
    lo1 = clopper_pearson_lower(k1, n, alpha / 2)
    mix = prior * lo1 + (1.0 - prior) * hi0
    mi = _entropy2(mix) - prior * _entropy2(lo1) - (1.0 - prior) * _entropy2(hi0)
    return np.where(lo1 > hi0, np.maximum(mi, 0.0), 0.0)
