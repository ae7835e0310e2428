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

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.audit.bounds import clopper_pearson_lower, clopper_pearson_upper
from privkit.errors import InvalidParameterError, NumericalError

stats = LazyModule("scipy.stats")
special = LazyModule("scipy.special")
optimize = LazyModule("scipy.optimize")

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

DEFAULT_CONFIDENCE = 0.95
"""Confidence of every bound unless said otherwise (the usual 95% of the auditing papers)."""

_INDEPENDENT = ("the scores are independent draws: one training run per score, or canaries "
                "whose scores do not depend on each other (two-run mode)")
_IN_HIGHER = "the decision is 'in' for score >= threshold (in-canaries score higher)"
_GDP = ("the mechanism's trade-off curve (in vs out, one canary) is Gaussian, G_mu: exact for "
        "compositions of unsampled Gaussian releases, only approximate (CLT) with subsampling")
_COINS = ("each canary was included independently with probability 1/2 (a fair coin), "
          "secret from the score function")
_GAUSS_SCORES = ("in- and out-scores are independent Gaussians with one common variance "
                 "(exact for white-box sums of unsampled Gaussian releases along orthogonal "
                 "canaries; asymptotic by the CLT otherwise, Agrawal et al. 2026)")


@dataclasses.dataclass(frozen=True)
class EpsilonLowerBound:
    """A lower bound on epsilon at ``delta``, holding with probability >= ``confidence``.

    Attributes:
        epsilon_lower_bound: the bound (>= 0; 0 when the scores show nothing).
        method: ``clopper-pearson``, ``gdp``, ``one-run`` or ``gaussian-one-run``.
        confidence: the probability the bound holds, over the randomness of the run(s).
        delta: the delta the epsilon is at.
        assumptions: what the bound assumes, as sentences; it is a bound only under them.
        counts: the numbers it used (sample sizes, threshold, counts, levels, ...).
        mu_lower_bound: for ``gdp`` and ``gaussian-one-run``, the bound on the Gaussian
            separation ``mu`` the epsilon was converted from; None otherwise.
    """

    epsilon_lower_bound: float
    method: str
    confidence: float
    delta: float
    assumptions: tuple[str, ...]
    counts: Mapping[str, Any]
    mu_lower_bound: float | None = None

    def exceeds(self, accounted_epsilon: float) -> bool:
        """Whether this lower bound is above an accounted (upper-bound) epsilon at the same
        delta: the run is not what its accounting says (with this bound's confidence)."""
        return self.epsilon_lower_bound > _validate.nonnegative("accounted_epsilon",
                                                                accounted_epsilon)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"kind": "lower_bound", "method": self.method,
                "epsilon_lower_bound": self.epsilon_lower_bound,
                "confidence": self.confidence, "delta": self.delta,
                "mu_lower_bound": self.mu_lower_bound,
                "assumptions": list(self.assumptions), "counts": _plain(self.counts)}


@dataclasses.dataclass(frozen=True)
class EpsilonEstimate:
    """An **estimate** of epsilon: no confidence statement makes it a bound.

    Attributes:
        epsilon_estimate: the point estimate.
        method: how it was computed.
        delta: the delta the epsilon is at.
        assumptions: what the estimate takes for granted.
        counts: the numbers it used.
        interval: bootstrap quantiles of the estimate (the spread of the estimator under
            resampling, not a confidence interval on the true epsilon), or None.
    """

    epsilon_estimate: float
    method: str
    delta: float
    assumptions: tuple[str, ...]
    counts: Mapping[str, Any]
    interval: tuple[float, ...] | None = None

    note = "an estimate, not a bound"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"kind": "estimate", "method": self.method,
                "epsilon_estimate": self.epsilon_estimate, "delta": self.delta,
                "interval": None if self.interval is None else list(self.interval),
                "note": self.note, "assumptions": list(self.assumptions),
                "counts": _plain(self.counts)}


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


# ------------------------------------------------------------------ argument checks
def _scores(name: str, value: Any, minimum: int = 1) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidParameterError(name, type(value).__name__,
                                    "a 1-D sequence of real scores") from None
    if arr.ndim != 1 or arr.size < minimum:
        raise InvalidParameterError(name, f"shape {arr.shape}",
                                    f"a 1-D sequence of at least {minimum} scores")
    if not np.isfinite(arr).all():
        raise InvalidParameterError(name, float(arr[~np.isfinite(arr)][0]), "finite scores")
    return arr


def _confidence(value: Any) -> float:
    c = _validate.real("confidence", value)
    if not 0.0 < c < 1.0:
        raise InvalidParameterError("confidence", value, "in the open interval (0, 1)")
    return c


def _delta(value: Any, *, zero: bool) -> float:
    d = _validate.real("delta", value)
    if not ((0.0 <= d < 1.0) if zero else (0.0 < d < 1.0)):
        raise InvalidParameterError("delta", value, "in [0, 1)" if zero else "in (0, 1)")
    return d


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
def _eps_of_mu(mu: float, delta: float) -> float:
    if not mu > 0:
        return 0.0
    from privkit.accountants.gaussian import exact_epsilon

    return float(exact_epsilon(mu, delta))


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


# ------------------------------------------------------------------ (iii) one run
def one_run_p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The tail of Steinke, Nasr & Jagielski's one-run Theorem.

    With m canaries each included by a fair coin and a run that is (epsilon, delta)-DP with
    respect to each canary, the probability that ``guesses`` guesses contain at least
    ``correct`` right ones is at most ``f(v) + 2 m delta max_{1 <= i <= v} (f(v - i) -
    f(v)) / i`` with ``v = correct`` and ``f(u) = P[Binomial(guesses, e^eps / (1 + e^eps))
    >= u]`` (``f(v)`` alone for delta = 0). Returned clipped to 1.

    Examples:
        >>> round(one_run_p_value(1000, 100, 80, 1.0, 0.0), 6)
        0.071556
    """
    r = _validate.nonnegative_int("guesses", guesses)
    v = _validate.nonnegative_int("correct", correct)
    n = _validate.positive_int("m", m)
    if not v <= r <= n:
        raise InvalidParameterError("correct", v, f"<= guesses ({r}) <= m ({n})")
    e = _validate.nonnegative("epsilon", epsilon)
    d = _delta(delta, zero=True)
    return _p_value(n, r, v, e, d)


def _binom_sf(k: Any, n: int, p: float) -> np.ndarray:
    """``P[Binomial(n, p) > k]`` for integer ``k`` (arrays too): ``scipy.special.bdtrc``,
    1 below 0 and 0 from n on (what ``scipy.stats.binom.sf`` gives, to ~1e-11 relative,
    without importing scipy.stats: a trainer's audit computes its bounds at the end of a
    run, and that import alone can cost a short run more than its canaries do)."""
    kk = np.asarray(k, dtype=np.float64)
    inside = np.clip(kk, 0.0, max(n - 1, 0))
    return np.where(kk < 0, 1.0, np.where(kk >= n, 0.0, special.bdtrc(inside, n, p)))


def _p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    q = float(special.expit(eps))
    beta = float(_binom_sf(v - 1, r, q))
    if delta == 0.0 or v == 0:
        return min(beta, 1.0)
    i = np.arange(1, v + 1)
    gaps = (_binom_sf(v - i - 1, r, q) - beta) / i
    return min(beta + 2.0 * m * delta * float(np.max(gaps)), 1.0)


def _largest_rejected(m: int, r: int, v: int, delta: float, level: float) -> float:
    """sup{eps : p(eps) <= level}; p increases with eps when 2 m delta < 1."""
    if r == 0 or _p_value(m, r, v, 0.0, delta) > level:
        return 0.0
    lo, hi = 0.0, 1.0
    while _p_value(m, r, v, hi, delta) <= level:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:
            raise NumericalError("one_run_bound: the p-value stays below the level for every "
                                 "epsilon (all guesses right with too many guesses?)")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _p_value(m, r, v, mid, delta) <= level:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return lo  # p(lo) <= level was checked: the conservative end


def default_guesses(m: int) -> tuple[tuple[int, int], ...]:
    """The (k_plus, k_minus) guess counts :func:`one_run_bound` tries by default: the top
    1, 2, 5, 10, 20 and 50% of the m scores guessed in, alone or with as many bottom scores
    guessed out (12 hypotheses, fixed before the scores are seen; duplicates removed).

    Examples:
        >>> default_guesses(100)[:3]
        ((1, 0), (1, 1), (2, 0))
    """
    n = _validate.positive_int("m", m)
    out: list[tuple[int, int]] = []
    for frac in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5):
        k = max(1, int(round(frac * n)))
        for g in ((k, 0), (k, k)):
            if g[0] + g[1] <= n and g not in out:
                out.append(g)
    return tuple(out)


def one_run_bound(in_scores: Any, out_scores: Any, *, delta: float = 0.0,
                  confidence: float = DEFAULT_CONFIDENCE,
                  guesses: Sequence[tuple[int, int]] | None = None) -> EpsilonLowerBound:
    """Steinke, Nasr & Jagielski's one-run lower bound (NeurIPS 2023), with abstention.

    The ``m = n_in + n_out`` canaries were each included by a fair coin in **one** run. For a
    guess rule ``(k_plus, k_minus)`` fixed in advance, the ``k_plus`` highest scores are
    guessed in, the ``k_minus`` lowest out, the rest abstain; ``v`` of the ``r = k_plus +
    k_minus`` guesses are right. The bound is the largest epsilon whose tail
    (:func:`one_run_p_value`) is at most ``(1 - confidence) / len(guesses)`` (a union over
    the rules), found by bisection (the tail increases with epsilon when ``2 m delta < 1``,
    required). Ties among scores are broken by a fixed random order, never by the coins.

    Args:
        in_scores: the scores of the canaries whose coin said in.
        out_scores: the scores of those whose coin said out.
        delta: in [0, 1/(2m)).
        confidence: in (0, 1).
        guesses: the rules to try; default :func:`default_guesses` of m.

    Returns:
        An :class:`EpsilonLowerBound` (method ``one-run``); its counts give the winning rule.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(3)
        >>> b = one_run_bound(rng.normal(4, 1, 500), rng.normal(0, 1, 500), delta=1e-5)
        >>> round(b.epsilon_lower_bound, 3), b.counts["guesses"], b.counts["correct"]
        (4.163, 400, 400)
    """
    in_s, out_s = _scores("in_scores", in_scores, 0), _scores("out_scores", out_scores, 0)
    m = in_s.size + out_s.size
    if m == 0:
        raise InvalidParameterError("in_scores", "no scores", "at least one canary in all")
    d = _delta(delta, zero=True)
    if not 2 * m * d < 1:
        raise InvalidParameterError("delta", delta, f"below 1/(2m) = {1 / (2 * m):.3g} (with "
                                    "more the one-run tail says nothing)")
    c = _confidence(confidence)
    rules = default_guesses(m) if guesses is None else tuple(guesses)
    if not rules:
        raise InvalidParameterError("guesses", guesses, "at least one (k_plus, k_minus)")
    checked = []
    for g in rules:
        try:
            kp, km = (_validate.nonnegative_int("guesses", x) for x in g)
        except (TypeError, ValueError):
            raise InvalidParameterError("guesses", g, "pairs (k_plus, k_minus)") from None
        if kp + km > m or kp + km == 0:
            raise InvalidParameterError("guesses", g, f"pairs with 1 <= k_plus + k_minus <= {m}")
        checked.append((kp, km))
    scores = np.concatenate([in_s, out_s])
    label = np.concatenate([np.ones(in_s.size, bool), np.zeros(out_s.size, bool)])
    # descending score; ties broken by a fixed random permutation, never by the coins (the
    # in-scores come first in ``scores``, so breaking ties by position would favour them)
    order = np.lexsort((np.random.default_rng(0).permutation(m), -scores))
    level = (1.0 - c) / len(checked)
    best = (-1.0, checked[0], 0, 0)
    for kp, km in checked:
        right = int(np.count_nonzero(label[order[:kp]]))
        right += int(np.count_nonzero(~label[order[m - km:]])) if km else 0
        if level < 0.5 and best[0] >= 0 and right <= (kp + km) * float(special.expit(best[0])):
            # at most the Binomial's mean right: its tail at the best epsilon so far is
            # >= 1/2 > level, and the tail increases with epsilon, so it cannot do better
            continue
        eps = _largest_rejected(m, kp + km, right, d, level)
        if eps > best[0]:
            best = (eps, (kp, km), kp + km, right)
    eps, (kp, km), r, v = best
    counts = {"m": m, "n_in": int(in_s.size), "n_out": int(out_s.size), "k_plus": kp,
              "k_minus": km, "guesses": r, "correct": v, "rules_tried": len(checked),
              "level": level}
    return EpsilonLowerBound(max(0.0, eps), "one-run", c, d, (_COINS,), counts)


# ------------------------------------------------------------------ (iv) Gaussian one run
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
