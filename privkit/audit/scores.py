"""Canary scores to high-confidence **lower** bounds on epsilon (and labelled estimates).

An audit of a training run plants canaries, each held in (inserted) or held out, and gives
each a score (higher: more likely in). This module turns the in- and out-scores into lower
bounds on the epsilon of the run at a delta, each valid with probability at least
``confidence`` over the run's randomness **under the assumptions it states**
(:attr:`EpsilonLowerBound.assumptions`). A lower bound above the accounted (upper-bound)
epsilon means the run is not what its accounting says.

Methods (all for ``in``-scores expected to be higher; negate scores otherwise):

* :func:`clopper_pearson_bound`: threshold tests ``score >= t``; Clopper-Pearson bounds on
  the FPR (upper) and TPR (lower) and ``eps >= ln((TPR_lo - delta) / FPR_hi)`` from
  ``TPR <= e^eps FPR + delta``. Needs independent trials (two-run mode: one run per score).
* :func:`gdp_bound`: the GDP method of Nasr et al. 2023: ``mu >= Phi^-1(TPR_lo) -
  Phi^-1(FPR_hi)``, converted to epsilon at delta with the exact Gaussian profile (assumes
  the mechanism's trade-off curve is Gaussian).
* :func:`one_run_bound`: Steinke, Nasr & Jagielski 2023 (one run, m canaries with fair
  coins, guesses on the top-k / bottom-k scores, abstention elsewhere): the exact tail of
  their Theorem, the largest epsilon rejected at ``1 - confidence``. No assumption beyond
  the coins.
* :func:`gaussian_bound`: the Gaussian one-run method (Agrawal et al. 2026, "Let's Ask
  Gauss"): in- and out-scores are Gaussians with one variance; an exact noncentral-t lower
  confidence bound on their separation ``mu``, converted as for GDP.
* :func:`gaussian_estimate` and :meth:`CanaryScoreAuditor.bootstrap` are **estimates** (no
  confidence statement on epsilon), returned as :class:`EpsilonEstimate`.

Thresholds (``thresholds=`` of the first two): ``"all"`` takes the best threshold with a
simultaneous band: the Clopper-Pearson FPR bound of each count ``k`` of out-scores at level
``alpha / (2 n_out)`` and the TPR bound of each count at ``alpha / (2 n_in)``. For a count
``k`` the worst threshold with that count has an FPR distributed as the ``(k+1)``-th
smallest of ``n_out`` uniforms (at most: sub-uniform for discrete scores), which is the
Beta law the Clopper-Pearson bound inverts, so one union over the ``n_out + n_in`` counts
covers every threshold at once. ``"split"`` chooses the threshold on a random half and
bounds at that one threshold on the other half (``alpha/2`` each); a number is a threshold
fixed in advance (``alpha/2`` each, all scores used).

Examples:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> out_s, in_s = rng.normal(0, 1, 2000), rng.normal(2, 1, 2000)  # mu = 2
    >>> b = gaussian_bound(in_s, out_s, delta=1e-5)
    >>> b.method, round(b.mu_lower_bound, 2), round(b.epsilon_lower_bound, 2)
    ('gaussian-one-run', 1.96, 9.78)
    >>> round(gdp_bound(in_s, out_s, delta=1e-5).epsilon_lower_bound, 2)
    8.82
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.audit._gaussian_scores import (
    gaussian_bound,
    gaussian_estimate,
    gaussian_pair_epsilon,
)
from privkit.audit._one_run import default_guesses, one_run_bound, one_run_p_value
from privkit.audit._score_results import (
    DEFAULT_CONFIDENCE,
    EpsilonEstimate,
    EpsilonLowerBound,
    _confidence,
    _delta,
    _eps_of_mu,
    _scores,
)
from privkit.audit.bounds import clopper_pearson_lower, clopper_pearson_upper
from privkit.errors import InvalidParameterError

stats = LazyModule("scipy.stats")

__all__ = [
    "DEFAULT_CONFIDENCE",
    "EpsilonLowerBound",
    "EpsilonEstimate",
    "CanaryScoreAuditor",
    "clopper_pearson_bound",
    "gdp_bound",
    "one_run_bound",
    "one_run_p_value",
    "gaussian_bound",
    "gaussian_estimate",
    "gaussian_pair_epsilon",
    "default_guesses",
]

_INDEPENDENT = ("the scores are independent draws: one training run per score, or canaries "
                "whose scores do not depend on each other (two-run mode)")
_IN_HIGHER = "the decision is 'in' for score >= threshold (in-canaries score higher)"
_GDP = ("the mechanism's trade-off curve (in vs out, one canary) is Gaussian, G_mu: exact for "
        "compositions of unsampled Gaussian releases, only approximate (CLT) with subsampling")


def _counts_at_all_thresholds(in_s: np.ndarray, out_s: np.ndarray
                              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every threshold worth trying (each observed score, and +inf) with its (tp, fp):
    every (tp, fp) pair a threshold can give arises at one of these."""
    t = np.concatenate([np.unique(np.concatenate([in_s, out_s])), [np.inf]])
    tp = in_s.size - np.searchsorted(np.sort(in_s), t, side="left")
    fp = out_s.size - np.searchsorted(np.sort(out_s), t, side="left")
    return t, tp, fp


def _eps_from_rates(tpr_lo: Any, fpr_hi: Any, delta: float, two_sided: bool) -> np.ndarray:
    tpr_lo, fpr_hi = np.asarray(tpr_lo, np.float64), np.asarray(fpr_hi, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.where(tpr_lo > delta, np.log(tpr_lo - delta) - np.log(fpr_hi), -np.inf)
        if two_sided:  # the complement event: TNR <= e^eps FNR + delta
            tnr_lo, fnr_hi = 1.0 - fpr_hi, 1.0 - tpr_lo
            e2 = np.where(tnr_lo > delta, np.log(tnr_lo - delta) - np.log(fnr_hi), -np.inf)
            e = np.fmax(e, e2)
    return np.where(np.isnan(e), -np.inf, e)


def _mu_from_rates(tpr_lo: Any, fpr_hi: Any) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = stats.norm.ppf(np.asarray(tpr_lo, np.float64)) - stats.norm.ppf(
            np.asarray(fpr_hi, np.float64))
    return np.where(np.isnan(mu), -np.inf, mu)


def _split(in_s: np.ndarray, out_s: np.ndarray, seed: Any
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if in_s.size < 2 or out_s.size < 2:
        raise InvalidParameterError("thresholds", "split",
                                    "'all' or a number when a side has fewer than 2 scores")
    rng = np.random.default_rng(seed)
    pi, po = rng.permutation(in_s.size), rng.permutation(out_s.size)
    hi, ho = in_s.size // 2, out_s.size // 2
    return in_s[pi[:hi]], out_s[po[:ho]], in_s[pi[hi:]], out_s[po[ho:]]


def _thresholded(in_s: np.ndarray, out_s: np.ndarray, thresholds: Any, alpha: float,
                 seed: Any, objective: Callable[[np.ndarray, np.ndarray], np.ndarray]
                 ) -> tuple[float, dict[str, Any]]:
    """The best value of ``objective(tpr_lo, fpr_hi)`` under the threshold rule, and counts."""
    if isinstance(thresholds, str):
        if thresholds == "all":
            t, tp, fp = _counts_at_all_thresholds(in_s, out_s)
            a_in, a_out = alpha / (2 * in_s.size), alpha / (2 * out_s.size)
            vals = objective(clopper_pearson_lower(tp, in_s.size, a_in),
                             clopper_pearson_upper(fp, out_s.size, a_out))
            i = int(np.argmax(vals))
            return float(vals[i]), {
                "thresholds": "all (simultaneous band)", "threshold": float(t[i]),
                "n_in": int(in_s.size), "n_out": int(out_s.size),
                "true_positives": int(tp[i]), "false_positives": int(fp[i]),
                "level_tpr": a_in, "level_fpr": a_out}
        if thresholds == "split":
            cal_in, cal_out, ev_in, ev_out = _split(in_s, out_s, seed)
            _, chosen = _thresholded(cal_in, cal_out, "all", alpha, seed, objective)
            value, counts = _thresholded(ev_in, ev_out, chosen["threshold"], alpha, seed,
                                         objective)
            counts["thresholds"] = "split (chosen on a random half, bounded on the other)"
            counts["split_seed"] = seed
            return value, counts
        raise InvalidParameterError("thresholds", thresholds, "'all', 'split' or a number")
    t0 = _validate.real("thresholds", thresholds)
    if math.isnan(t0):
        raise InvalidParameterError("thresholds", thresholds, "'all', 'split' or a number")
    k_in, k_out = int(np.count_nonzero(in_s >= t0)), int(np.count_nonzero(out_s >= t0))
    a = alpha / 2
    val = objective(clopper_pearson_lower(k_in, in_s.size, a),
                    clopper_pearson_upper(k_out, out_s.size, a))
    return float(val), {"thresholds": "fixed", "threshold": t0, "n_in": int(in_s.size),
                        "n_out": int(out_s.size), "true_positives": k_in,
                        "false_positives": k_out, "level_tpr": a, "level_fpr": a}


# ------------------------------------------------------------------ (i) Clopper-Pearson
def clopper_pearson_bound(in_scores: Any, out_scores: Any, *, delta: float = 0.0,
                          confidence: float = DEFAULT_CONFIDENCE, thresholds: Any = "all",
                          two_sided: bool = False, seed: int | None = 0) -> EpsilonLowerBound:
    """Threshold-test lower bound: ``eps >= ln((TPR_lo - delta) / FPR_hi)``.

    For the decision "in" when ``score >= t``, a run that is (eps, delta)-DP with respect to
    one canary has ``TPR <= e^eps FPR + delta``. ``FPR_hi`` is a Clopper-Pearson upper bound
    on the FPR from the out-scores and ``TPR_lo`` a lower bound on the TPR from the
    in-scores (module docstring: how ``thresholds`` shares the error probability).

    Args:
        in_scores: scores of the canaries that were inserted (one per independent trial).
        out_scores: scores of the canaries that were not.
        delta: in [0, 1); 0 for pure DP.
        confidence: in (0, 1), the probability the bound holds.
        thresholds: ``"all"`` (simultaneous band, default), ``"split"`` (choose on a random
            half, bound on the other), or a threshold fixed before seeing the scores.
        two_sided: also try the complement event (``TNR <= e^eps FNR + delta``), under the
            same confidence statements.
        seed: the random half of ``"split"``.

    Returns:
        An :class:`EpsilonLowerBound` (method ``clopper-pearson``).

    Raises:
        InvalidParameterError: a bad argument, named.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(1)
        >>> b = clopper_pearson_bound(rng.normal(3, 1, 5000), rng.normal(0, 1, 5000),
        ...                           delta=1e-5)
        >>> round(b.epsilon_lower_bound, 3), b.counts["thresholds"]
        (4.752, 'all (simultaneous band)')
    """
    in_s, out_s = _scores("in_scores", in_scores), _scores("out_scores", out_scores)
    d = _delta(delta, zero=True)
    c = _confidence(confidence)
    two = bool(two_sided)
    value, counts = _thresholded(in_s, out_s, thresholds, 1.0 - c, seed,
                                 lambda tpr, fpr: _eps_from_rates(tpr, fpr, d, two))
    counts["two_sided"] = two
    return EpsilonLowerBound(max(0.0, value), "clopper-pearson", c, d,
                             (_INDEPENDENT, _IN_HIGHER), counts)


# ------------------------------------------------------------------ (ii) GDP
def gdp_bound(in_scores: Any, out_scores: Any, *, delta: float,
              confidence: float = DEFAULT_CONFIDENCE, thresholds: Any = "all",
              seed: int | None = 0) -> EpsilonLowerBound:
    """The GDP method (Nasr et al. 2023): a lower bound on ``mu``, then epsilon at ``delta``.

    A mu-GDP mechanism has ``FNR >= Phi(Phi^-1(1 - FPR) - mu)`` for every test, so
    ``mu >= Phi^-1(TPR) - Phi^-1(FPR)``; with ``TPR_lo`` and ``FPR_hi`` (Clopper-Pearson,
    shared as for :func:`clopper_pearson_bound`) the right side is a lower bound on mu. The
    epsilon is the exact (eps, delta) curve of the Gaussian mechanism at that mu, which is a
    lower bound on the mechanism's epsilon only if its trade-off curve is Gaussian.

    Args:
        in_scores: scores of the inserted canaries (one per independent trial).
        out_scores: scores of the canaries left out.
        delta: in (0, 1).
        confidence: in (0, 1).
        thresholds: ``"all"``, ``"split"`` or a fixed threshold (as for
            :func:`clopper_pearson_bound`).
        seed: the random half of ``"split"``.

    Returns:
        An :class:`EpsilonLowerBound` (method ``gdp``) with ``mu_lower_bound``.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(1)
        >>> b = gdp_bound(rng.normal(1, 1, 5000), rng.normal(0, 1, 5000), delta=1e-5)
        >>> round(b.mu_lower_bound, 3), round(b.epsilon_lower_bound, 3)
        (0.834, 3.551)
    """
    in_s, out_s = _scores("in_scores", in_scores), _scores("out_scores", out_scores)
    d = _delta(delta, zero=False)
    c = _confidence(confidence)
    mu, counts = _thresholded(in_s, out_s, thresholds, 1.0 - c, seed, _mu_from_rates)
    mu = max(0.0, mu)
    return EpsilonLowerBound(_eps_of_mu(mu, d), "gdp", c, d, (_INDEPENDENT, _IN_HIGHER, _GDP),
                             counts, mu_lower_bound=mu)


# ------------------------------------------------------------------ the auditor
class CanaryScoreAuditor:
    """Every bound and estimate of this module over one set of in- and out-scores.

    Args:
        in_scores: scores of the inserted canaries (higher: more likely in; negate
            otherwise).
        out_scores: scores of the canaries left out.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> aud = CanaryScoreAuditor(rng.normal(1.5, 1, 1000), rng.normal(0, 1, 1000))
        >>> [round(b.epsilon_lower_bound, 2) for b in aud.bounds(delta=1e-5)]
        [1.69, 5.28, 2.33, 6.36]
        >>> round(aud.auroc(), 3)
        0.85
    """

    def __init__(self, in_scores: Any, out_scores: Any) -> None:
        self.in_scores = _scores("in_scores", in_scores)
        self.out_scores = _scores("out_scores", out_scores)

    def clopper_pearson(self, **kwargs: Any) -> EpsilonLowerBound:
        """:func:`clopper_pearson_bound` of the scores."""
        return clopper_pearson_bound(self.in_scores, self.out_scores, **kwargs)

    def gdp(self, *, delta: float, **kwargs: Any) -> EpsilonLowerBound:
        """:func:`gdp_bound` of the scores."""
        return gdp_bound(self.in_scores, self.out_scores, delta=delta, **kwargs)

    def one_run(self, **kwargs: Any) -> EpsilonLowerBound:
        """:func:`one_run_bound` of the scores (they must come from one run with fair
        coins)."""
        return one_run_bound(self.in_scores, self.out_scores, **kwargs)

    def gaussian(self, *, delta: float, **kwargs: Any) -> EpsilonLowerBound:
        """:func:`gaussian_bound` of the scores."""
        return gaussian_bound(self.in_scores, self.out_scores, delta=delta, **kwargs)

    def bounds(self, *, delta: float, confidence: float = DEFAULT_CONFIDENCE
               ) -> tuple[EpsilonLowerBound, ...]:
        """The four bounds at ``delta`` (Clopper-Pearson, GDP, one-run, Gaussian one-run),
        each at ``confidence`` on its own; which apply depends on how the scores were made
        (each bound's assumptions say)."""
        return (self.clopper_pearson(delta=delta, confidence=confidence),
                self.gdp(delta=delta, confidence=confidence),
                self.one_run(delta=delta, confidence=confidence),
                self.gaussian(delta=delta, confidence=confidence))

    def auroc(self) -> float:
        """Area under the ROC curve of the scores (ties count 1/2): a description, not a
        privacy number."""
        ranks = stats.rankdata(np.concatenate([self.in_scores, self.out_scores]))
        n1, n0 = self.in_scores.size, self.out_scores.size
        return float((ranks[:n1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))

    def tpr_at_fpr(self, fpr: float) -> float:
        """The largest empirical TPR of a threshold whose empirical FPR is at most ``fpr``
        (a description of the scores, no confidence statement)."""
        f = _validate.real("fpr", fpr)
        if not 0.0 <= f <= 1.0:
            raise InvalidParameterError("fpr", fpr, "in [0, 1]")
        _, tp, fp = _counts_at_all_thresholds(self.in_scores, self.out_scores)
        ok = fp <= f * self.out_scores.size
        return float(tp[ok].max() / self.in_scores.size)

    def bootstrap(self, statistic: Callable[[CanaryScoreAuditor], float], *,
                  num_samples: int = 1000, quantiles: Sequence[float] = (0.025, 0.975),
                  seed: int | None = None, delta: float, method: str = "bootstrap"
                  ) -> EpsilonEstimate:
        """Quantiles of ``statistic`` (an epsilon computed from an auditor) over resamplings
        of the in- and out-scores with replacement, labelled an **estimate**: the spread of
        the statistic, not a confidence interval on the true epsilon.

        Examples:
            >>> import numpy as np
            >>> rng = np.random.default_rng(0)
            >>> aud = CanaryScoreAuditor(rng.normal(1, 1, 300), rng.normal(0, 1, 300))
            >>> est = aud.bootstrap(
            ...     lambda a: gaussian_estimate(a.in_scores, a.out_scores,
            ...                                 delta=1e-5).epsilon_estimate,
            ...     num_samples=200, seed=1, delta=1e-5)
            >>> est.note, len(est.interval)
            ('an estimate, not a bound', 2)
        """
        n = _validate.positive_int("num_samples", num_samples)
        qs = tuple(_validate.real("quantiles", x) for x in quantiles)
        if not qs or not all(0 < x < 1 for x in qs):
            raise InvalidParameterError("quantiles", quantiles, "values in (0, 1)")
        d = _delta(delta, zero=False)
        rng = np.random.default_rng(seed)
        vals = np.empty(n)
        for i in range(n):
            vals[i] = statistic(CanaryScoreAuditor(
                rng.choice(self.in_scores, self.in_scores.size),
                rng.choice(self.out_scores, self.out_scores.size)))
        point = float(statistic(self))
        return EpsilonEstimate(point, method, d, ("resampling the scores with replacement "
                                                  "mimics rerunning the audit",),
                               {"num_samples": n, "quantiles": list(qs), "seed": seed},
                               interval=tuple(float(x) for x in np.quantile(vals, qs)))
