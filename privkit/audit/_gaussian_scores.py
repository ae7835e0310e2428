"""Gaussian models of the scores: the Gaussian one-run bound and estimate, and the epsilon of
two 1-D Gaussians.

:func:`gaussian_bound` (Agrawal et al. 2026: in- and out-scores Gaussian with one variance,
an exact noncentral-t bound on their separation), :func:`gaussian_estimate` (its point
estimate) and :func:`gaussian_pair_epsilon` (the hockey-stick divergence of two Gaussians, as
Andrew et al. 2024 fit to canary cosines). Apart from the threshold tests of
:mod:`privkit.audit.scores` (which exports the public names) because they assume a model of
the scores instead of counting them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.audit._score_results import (
    DEFAULT_CONFIDENCE,
    EpsilonEstimate,
    EpsilonLowerBound,
    _confidence,
    _delta,
    _eps_of_mu,
    _scores,
)
from privkit.errors import InvalidParameterError, NumericalError

stats = LazyModule("scipy.stats")
special = LazyModule("scipy.special")
optimize = LazyModule("scipy.optimize")

__all__ = ["gaussian_bound", "gaussian_estimate", "gaussian_pair_epsilon"]

_GAUSS_SCORES = ("in- and out-scores are independent Gaussians with one common variance "
                 "(exact for white-box sums of unsampled Gaussian releases along orthogonal "
                 "canaries; asymptotic by the CLT otherwise, Agrawal et al. 2026)")


def _separation(in_s: np.ndarray, out_s: np.ndarray) -> tuple[float, float, int, float]:
    n1, n0 = in_s.size, out_s.size
    df = n1 + n0 - 2
    ss = float(np.sum((in_s - in_s.mean()) ** 2) + np.sum((out_s - out_s.mean()) ** 2))
    sd = math.sqrt(ss / df)
    if not sd > 0:
        raise NumericalError("gaussian_bound: the scores have no spread (all equal on each "
                             "side): the Gaussian model does not apply")
    diff = float(in_s.mean() - out_s.mean())
    scale = math.sqrt(1.0 / n1 + 1.0 / n0)
    return diff / sd, diff / (sd * scale), df, scale


def gaussian_bound(in_scores: Any, out_scores: Any, *, delta: float,
                   confidence: float = DEFAULT_CONFIDENCE) -> EpsilonLowerBound:
    """The Gaussian one-run method: a lower bound on the separation ``mu`` of in- and
    out-scores, then epsilon at ``delta``.

    Model (Agrawal et al. 2026: the normalised sum of canary-aligned signals is
    asymptotically Gaussian): out-scores ``N(a, s^2)``, in-scores ``N(a + mu s, s^2)``, all
    independent. ``T = (mean_in - mean_out) / (s_pooled sqrt(1/n_in + 1/n_out))`` is then
    noncentral t with ``n_in + n_out - 2`` degrees of freedom and noncentrality ``mu /
    sqrt(1/n_in + 1/n_out)``; the bound inverts its law exactly (the smallest noncentrality
    under which ``T`` or more has probability ``1 - confidence``). Under the model the pair
    of score laws is a post-processing of the run, so the run's epsilon is at least the
    Gaussian mechanism's epsilon at ``mu``.

    Args:
        in_scores: scores of the inserted canaries (at least 2 on each side in all).
        out_scores: scores of the canaries left out.
        delta: in (0, 1).
        confidence: in (0, 1).

    Returns:
        An :class:`EpsilonLowerBound` (method ``gaussian-one-run``) with ``mu_lower_bound``;
        its counts hold the point estimate ``mu_hat`` and the variance ratio (a check of the
        one-variance model).

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(2)
        >>> b = gaussian_bound(rng.normal(1, 1, 400), rng.normal(0, 1, 400), delta=1e-5)
        >>> round(b.mu_lower_bound, 3), round(b.counts["mu_hat"], 3)
        (0.913, 1.037)
    """
    in_s, out_s = _scores("in_scores", in_scores), _scores("out_scores", out_scores)
    if in_s.size + out_s.size < 3:
        raise InvalidParameterError("in_scores", in_s.size + out_s.size,
                                    "at least 3 scores in all (a variance to estimate)")
    d = _delta(delta, zero=False)
    c = _confidence(confidence)
    alpha = 1.0 - c
    mu_hat, t_obs, df, scale = _separation(in_s, out_s)

    def tail(nc: float) -> float:  # P[T >= t_obs] - alpha (the noncentral t's sf, as
        # 1 - scipy.special.nctdtr: scipy.stats' own to ~1e-16, without importing it)
        return min(max(1.0 - float(special.nctdtr(df, nc, t_obs)), 0.0), 1.0) - alpha

    if t_obs <= 0 or tail(0.0) >= 0:
        nc_lb = 0.0
    else:
        hi = t_obs
        while tail(hi) <= 0:  # sf at nc = t_obs is ~1/2 > alpha; guard odd inputs anyway
            hi *= 2.0
        lo = 0.0  # bisection keeping tail(lo) <= 0 < tail(hi): lo is the conservative end
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if tail(mid) <= 0:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-13 + 1e-15 * hi:
                break
        nc_lb = lo
    mu_lb = max(0.0, nc_lb * scale)
    var_in = float(np.var(in_s, ddof=1)) if in_s.size > 1 else float("nan")
    var_out = float(np.var(out_s, ddof=1)) if out_s.size > 1 else float("nan")
    counts = {"n_in": int(in_s.size), "n_out": int(out_s.size), "mu_hat": mu_hat,
              "t_statistic": t_obs, "degrees_of_freedom": df,
              "variance_ratio_in_out": var_in / var_out if var_out > 0 else float("nan")}
    return EpsilonLowerBound(_eps_of_mu(mu_lb, d), "gaussian-one-run", c, d,
                             (_GAUSS_SCORES,), counts, mu_lower_bound=mu_lb)


def gaussian_estimate(in_scores: Any, out_scores: Any, *, delta: float) -> EpsilonEstimate:
    """The point estimate ``mu_hat = (mean_in - mean_out) / s_pooled`` converted to epsilon
    at ``delta`` as a Gaussian mechanism: an **estimate** (it is above the truth about half
    the time).

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(2)
        >>> e = gaussian_estimate(rng.normal(1, 1, 400), rng.normal(0, 1, 400), delta=1e-5)
        >>> round(e.epsilon_estimate, 3), e.note
        (4.565, 'an estimate, not a bound')
    """
    in_s, out_s = _scores("in_scores", in_scores), _scores("out_scores", out_scores)
    if in_s.size + out_s.size < 3:
        raise InvalidParameterError("in_scores", in_s.size + out_s.size, "at least 3 in all")
    d = _delta(delta, zero=False)
    mu_hat, _, _, _ = _separation(in_s, out_s)
    return EpsilonEstimate(_eps_of_mu(max(mu_hat, 0.0), d), "gaussian-point-estimate", d,
                           (_GAUSS_SCORES,), {"mu_hat": mu_hat, "n_in": int(in_s.size),
                                              "n_out": int(out_s.size)})


# ------------------------------------------------------------------ two Gaussians
def _hockey_stick(m1: float, s1: float, m0: float, s0: float, eps: float) -> float:
    """H_eps(N(m1, s1^2) || N(m0, s0^2)) = P1[L > eps] - e^eps P0[L > eps], L = ln p1/p0."""
    norm = stats.norm
    if abs(s1 - s0) <= 1e-12 * max(s1, s0):
        mu = abs(m1 - m0) / s0
        if mu == 0:
            return 0.0
        return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2))
    # L(x) = ln(s0/s1) - (x-m1)^2/(2 s1^2) + (x-m0)^2/(2 s0^2) > eps: a quadratic in x
    a = 1 / (2 * s0 ** 2) - 1 / (2 * s1 ** 2)
    b = m1 / s1 ** 2 - m0 / s0 ** 2
    c = m0 ** 2 / (2 * s0 ** 2) - m1 ** 2 / (2 * s1 ** 2) + math.log(s0 / s1) - eps
    disc = b * b - 4 * a * c
    if disc <= 0:  # the quadratic keeps one sign
        return 0.0 if a < 0 else 1.0 - math.exp(eps)
    r1, r2 = sorted(((-b - math.sqrt(disc)) / (2 * a), (-b + math.sqrt(disc)) / (2 * a)))

    def mass(m: float, s: float) -> float:
        inner = float(norm.cdf((r2 - m) / s) - norm.cdf((r1 - m) / s))
        return inner if a < 0 else 1.0 - inner  # a < 0: L > eps between the roots

    return mass(m1, s1) - math.exp(eps) * mass(m0, s0)


def gaussian_pair_epsilon(mean_in: float, sd_in: float, mean_out: float, sd_out: float,
                          delta: float) -> float:
    """The smallest epsilon with ``H_eps <= delta`` both ways between ``N(mean_in, sd_in^2)``
    and ``N(mean_out, sd_out^2)`` (the pair of 1-D Gaussians that Andrew et al. 2024 fit to
    canary cosines; equal standard deviations give the Gaussian mechanism's epsilon).

    Examples:
        >>> round(gaussian_pair_epsilon(1.0, 1.0, 0.0, 1.0, 1e-5), 4)
        4.3772
    """
    m1, m0 = _validate.real("mean_in", mean_in), _validate.real("mean_out", mean_out)
    s1, s0 = _validate.positive("sd_in", sd_in), _validate.positive("sd_out", sd_out)
    d = _delta(delta, zero=False)
    best = 0.0
    for args in ((m1, s1, m0, s0), (m0, s0, m1, s1)):
        def gap(e: float, args: tuple[float, float, float, float] = args) -> float:
            return _hockey_stick(*args, e) - d
        if gap(0.0) <= 0:
            continue
        hi = 1.0
        while gap(hi) > 0:
            hi *= 2.0
            if hi > 1e4:
                raise NumericalError("gaussian_pair_epsilon: no epsilon below 1e4 reaches delta")
        best = max(best, float(optimize.brentq(gap, 0.0, hi, xtol=1e-12)))
    return best
