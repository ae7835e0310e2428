"""Scores -> bounds (privkit.audit.scores) against reference formulas written here.

JAX Privacy (``jax_privacy.auditing``) is not installed (it needs jax), so each reference below
is written from the published statement, independently of privkit's code, following JAX
Privacy's formulas where privkit's method is the same:

* Clopper-Pearson at a threshold: ``ln(1 - FNR_ub - delta) - ln(FPR_ub)`` with
  ``FNR_ub``/``FPR_ub`` one-sided Clopper-Pearson upper bounds, each at ``alpha/2``
  (``CanaryScoreAuditor.epsilon_clopper_pearson`` with an explicit threshold); privkit's
  ``thresholds="all"`` band is checked against a loop over every threshold at its levels.
* GDP: ``mu = Phi^-1(1 - FPR_ub) - Phi^-1(FNR_ub)`` (Dong, Roth & Su Eq. 6) and the (eps,
  delta) conversion of their Corollary 2.13 solved by a root finder (``epsilon_from_gdp``).
* One run: the p-value of Steinke, Nasr & Jagielski's Theorem (their Algorithm's code:
  ``beta + alpha * delta * 2 m``) and the largest epsilon it rejects.

Agreement is to 1e-9 (absolute) on scores generated here. The Gaussian one-run bound has no
published reference implementation: it is checked by its coverage over many draws and
against the normal approximation it tends to.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, optimize, stats

from privkit.accountants.gaussian import exact_epsilon
from privkit.audit import (
    CanaryScoreAuditor,
    clopper_pearson_bound,
    gaussian_bound,
    gaussian_estimate,
    gaussian_pair_epsilon,
    gdp_bound,
    one_run_bound,
    one_run_p_value,
)
from privkit.errors import InvalidParameterError


# ------------------------------------------------------------------ references
def ref_cp_upper(k: int, n: int, a: float) -> float:
    return 1.0 if k >= n else float(stats.beta.ppf(1 - a, k + 1, n - k))


def ref_cp_eps(in_s, out_s, t, alpha, delta, a_in=None, a_out=None):
    """eps at threshold t (JAX Privacy's formula): FNR and FPR upper bounds."""
    a_in = alpha / 2 if a_in is None else a_in
    a_out = alpha / 2 if a_out is None else a_out
    fn = int(np.sum(in_s < t))
    fp = int(np.sum(out_s >= t))
    fnr_ub = ref_cp_upper(fn, len(in_s), a_in)
    fpr_ub = ref_cp_upper(fp, len(out_s), a_out)
    tpr_lb = 1 - fnr_ub
    if tpr_lb <= delta:
        return 0.0, fpr_ub, fnr_ub
    return max(0.0, math.log(tpr_lb - delta) - math.log(fpr_ub)), fpr_ub, fnr_ub


def ref_gdp_eps(mu: float, delta: float) -> float:
    """Corollary 2.13 of Dong, Roth & Su in the log domain, solved by brentq."""
    def gap(eps):
        a = stats.norm.logcdf(-eps / mu + mu / 2)
        b = eps + stats.norm.logcdf(-eps / mu - mu / 2)
        return a + math.log1p(-math.exp(b - a)) - math.log(delta)
    return optimize.brentq(gap, 0.0, 200.0, xtol=1e-14, rtol=1e-15)


def ref_one_run_p(m, r, v, eps, delta):
    """Steinke et al.'s Theorem: P[>= v of r guesses right] <= f(v) + 2 m delta max_i ..."""
    q = 1 / (1 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    alpha = 0.0
    for i in range(1, v + 1):
        alpha = max(alpha, (stats.binom.sf(v - i - 1, r, q) - beta) / i)
    return min(beta + alpha * delta * 2 * m, 1.0)


def ref_one_run_eps(m, r, v, delta, level):
    if ref_one_run_p(m, r, v, 0.0, delta) > level:
        return 0.0
    hi = 1.0
    while ref_one_run_p(m, r, v, hi, delta) <= level:
        hi *= 2
    return optimize.brentq(lambda e: level - ref_one_run_p(m, r, v, e, delta), 0.0, hi,
                           xtol=1e-13, rtol=1e-15)


def scores(seed, mu, n_in=400, n_out=400):
    rng = np.random.default_rng(seed)
    return rng.normal(mu, 1.0, n_in), rng.normal(0.0, 1.0, n_out)


# ------------------------------------------------------------------ Clopper-Pearson
@pytest.mark.parametrize("seed,mu,delta", [(0, 1.0, 0.0), (1, 2.5, 1e-5), (2, 0.3, 1e-3),
                                           (3, 4.0, 0.0)])
def test_clopper_pearson_fixed_threshold_agrees_with_reference(seed, mu, delta):
    ins, outs = scores(seed, mu)
    for t in (-0.5, 0.3, mu / 2, mu, mu + 1.5):
        got = clopper_pearson_bound(ins, outs, delta=delta, thresholds=t, confidence=0.95)
        want, _, _ = ref_cp_eps(ins, outs, t, 0.05, delta)
        assert got.epsilon_lower_bound == pytest.approx(want, abs=1e-9)
        assert got.counts["threshold"] == t and got.confidence == 0.95


def test_clopper_pearson_all_thresholds_is_the_max_of_the_band():
    ins, outs = scores(4, 1.5, n_in=300, n_out=500)
    got = clopper_pearson_bound(ins, outs, delta=1e-5, confidence=0.9)
    a_in, a_out = 0.1 / (2 * 300), 0.1 / (2 * 500)
    want = max(ref_cp_eps(ins, outs, t, 0.1, 1e-5, a_in, a_out)[0]
               for t in np.concatenate([ins, outs, [np.inf]]))
    assert got.epsilon_lower_bound == pytest.approx(want, abs=1e-9)
    assert got.counts["level_tpr"] == pytest.approx(a_in) and got.counts["level_fpr"] == (
        pytest.approx(a_out))


def test_clopper_pearson_band_is_never_looser_than_a_union_over_every_threshold():
    # JAX Privacy's Bonferroni divides alpha among thresholds; over all n_in + n_out + 1 of
    # them that is alpha / (2 (n_in + n_out + 1)) per bound, which privkit's band beats
    ins, outs = scores(5, 2.0)
    n = len(ins) + len(outs) + 1
    union = max(ref_cp_eps(ins, outs, t, 0.05, 0.0, 0.05 / (2 * n), 0.05 / (2 * n))[0]
                for t in np.concatenate([ins, outs, [np.inf]]))
    band = clopper_pearson_bound(ins, outs).epsilon_lower_bound
    assert union < band < union + 0.2


def test_clopper_pearson_two_sided_uses_the_complement_event():
    # two-sided (JAX Privacy's one_sided=False): also TNR <= e^eps FNR + delta, the DP
    # inequality the other way round on the event {score < t}
    ins, outs = scores(6, 2.0)
    t = -1.0
    one = clopper_pearson_bound(ins, outs, thresholds=t)
    two = clopper_pearson_bound(ins, outs, thresholds=t, two_sided=True)
    e1, fpr_ub, fnr_ub = ref_cp_eps(ins, outs, t, 0.05, 0.0)
    e2 = math.log(1 - fpr_ub) - math.log(fnr_ub)
    assert one.epsilon_lower_bound == pytest.approx(e1, abs=1e-9)
    assert two.epsilon_lower_bound == pytest.approx(max(e1, e2), abs=1e-9)
    assert e2 > e1


def test_split_thresholds_bound_on_the_other_half():
    ins, outs = scores(7, 2.0, 1000, 1000)
    b = clopper_pearson_bound(ins, outs, thresholds="split", seed=3)
    assert b.counts["n_in"] == 500 and b.counts["n_out"] == 500
    assert b.counts["level_tpr"] == pytest.approx(0.025)
    assert 0.5 < b.epsilon_lower_bound < 5.0


# ------------------------------------------------------------------ GDP
@pytest.mark.parametrize("seed,mu", [(0, 0.5), (1, 1.0), (2, 2.0), (3, 3.0)])
def test_gdp_fixed_threshold_agrees_with_reference(seed, mu):
    ins, outs = scores(seed, mu, 2000, 2000)
    t = mu / 2
    got = gdp_bound(ins, outs, delta=1e-5, thresholds=t)
    _, fpr_ub, fnr_ub = ref_cp_eps(ins, outs, t, 0.05, 1e-5)
    ref_mu = stats.norm.isf(fpr_ub) - stats.norm.ppf(fnr_ub)
    assert got.mu_lower_bound == pytest.approx(ref_mu, abs=1e-9)
    assert got.epsilon_lower_bound == pytest.approx(ref_gdp_eps(ref_mu, 1e-5), abs=1e-9)


def test_gdp_conversion_is_the_gaussian_profile():
    for mu in (0.1, 0.5, 1.0, 2.0, 4.0):
        assert exact_epsilon(mu, 1e-5) == pytest.approx(ref_gdp_eps(mu, 1e-5), abs=1e-9)


def test_gdp_all_thresholds_is_the_max_over_the_band():
    ins, outs = scores(8, 1.2, 500, 500)
    got = gdp_bound(ins, outs, delta=1e-5)
    a = 0.05 / 1000
    best = -np.inf
    for t in np.concatenate([ins, outs, [np.inf]]):
        _, fpr_ub, fnr_ub = ref_cp_eps(ins, outs, t, 0.05, 1e-5, a, a)
        best = max(best, stats.norm.isf(fpr_ub) - stats.norm.ppf(fnr_ub))
    assert got.mu_lower_bound == pytest.approx(best, abs=1e-9)


# ------------------------------------------------------------------ one run
@pytest.mark.parametrize("m,r,v,delta", [(1000, 100, 80, 0.0), (1000, 100, 80, 1e-5),
                                         (10000, 500, 400, 1e-5), (200, 20, 20, 1e-4),
                                         (5000, 1000, 640, 1e-6)])
def test_one_run_p_value_and_epsilon_agree_with_the_theorem(m, r, v, delta):
    for eps in (0.0, 0.5, 1.0, 2.0, 3.0):
        assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(
            ref_one_run_p(m, r, v, eps, delta), abs=1e-12)
    rng = np.random.default_rng(m + r + v)
    # scores whose top r hold exactly v in-canaries: guess rule (r, 0)
    label = np.zeros(m, bool)
    label[:v] = True
    label[r:r + (m - r) // 2] = True
    s = np.concatenate([np.sort(rng.uniform(10, 11, r))[::-1], rng.uniform(0, 1, m - r)])
    got = one_run_bound(s[label], s[~label], delta=delta, guesses=[(r, 0)])
    assert got.counts["correct"] == v and got.counts["guesses"] == r
    assert got.epsilon_lower_bound == pytest.approx(
        ref_one_run_eps(m, r, v, delta, 0.05), abs=1e-9)


def test_one_run_union_over_rules_and_bottom_guesses():
    ins, outs = scores(9, 3.0, 500, 500)
    b = one_run_bound(ins, outs, delta=1e-5)
    assert b.counts["rules_tried"] == 12 and b.counts["level"] == pytest.approx(0.05 / 12)
    r, v = b.counts["guesses"], b.counts["correct"]
    assert b.epsilon_lower_bound == pytest.approx(
        ref_one_run_eps(1000, r, v, 1e-5, 0.05 / 12), abs=1e-9)
    # bottom guesses count out-canaries among the lowest scores
    two = one_run_bound(ins, outs, guesses=[(50, 50)])
    order = np.argsort(-np.concatenate([ins, outs]), kind="stable")
    lab = np.concatenate([np.ones(500, bool), np.zeros(500, bool)])
    assert two.counts["correct"] == int(lab[order[:50]].sum() + (~lab[order[-50:]]).sum())


def test_one_run_ties_are_not_broken_by_the_coins():
    # every score equal: the in-scores come first in the concatenation, and a tie broken by
    # position would guess them all right (a bound of ~3); a tie must say nothing
    b = one_run_bound(np.zeros(500), np.zeros(500), delta=1e-5)
    assert b.epsilon_lower_bound < 0.5


def test_one_run_refuses_a_delta_that_makes_the_tail_meaningless():
    with pytest.raises(InvalidParameterError, match="delta"):
        one_run_bound(np.ones(10), np.zeros(10), delta=0.05)
    with pytest.raises(InvalidParameterError, match="guesses"):
        one_run_bound(np.ones(10), np.zeros(10), guesses=[(15, 10)])


# ------------------------------------------------------------------ Gaussian one run
def test_gaussian_bound_covers_the_true_mu_at_its_confidence():
    # 400 draws of the exact model: the 95% lower bound exceeds the true mu ~5% of the time
    rng = np.random.default_rng(10)
    above = sum(gaussian_bound(rng.normal(0.7, 2.0, 60), rng.normal(0.0, 2.0, 40),
                               delta=1e-5).mu_lower_bound > 0.35 for _ in range(400))
    # Binomial(400, 0.05): 95% of its mass in [12, 29]
    assert 10 <= above <= 31, above


def test_gaussian_bound_tends_to_the_normal_approximation():
    ins, outs = scores(11, 1.0, 20000, 20000)
    b = gaussian_bound(ins, outs, delta=1e-5)
    n1 = n0 = 20000
    mu_hat = b.counts["mu_hat"]
    approx = mu_hat - stats.norm.ppf(0.95) * math.sqrt(1 / n1 + 1 / n0 + mu_hat ** 2 / (
        2 * (n1 + n0)))
    assert b.mu_lower_bound == pytest.approx(approx, abs=2e-4)
    assert b.epsilon_lower_bound == pytest.approx(exact_epsilon(b.mu_lower_bound, 1e-5),
                                                  abs=1e-12)
    est = gaussian_estimate(ins, outs, delta=1e-5)
    assert est.epsilon_estimate > b.epsilon_lower_bound and est.note.startswith("an estimate")


def test_gaussian_pair_epsilon_matches_the_hockey_stick_integral():
    assert gaussian_pair_epsilon(1.3, 1.0, 0.0, 1.0, 1e-5) == pytest.approx(
        exact_epsilon(1.3, 1e-5), abs=1e-9)
    m1, s1, m0, s0 = 1.0, 1.4, 0.0, 1.0
    eps = gaussian_pair_epsilon(m1, s1, m0, s0, 1e-4)

    def hs(a, sa, b, sb, e):
        def f(x):
            return max(0.0, stats.norm.pdf(x, a, sa) - math.exp(e) * stats.norm.pdf(x, b, sb))
        return math.fsum(integrate.quad(f, lo, lo + 1, epsabs=1e-14)[0]
                         for lo in range(-40, 40))

    worst = max(hs(m1, s1, m0, s0, eps), hs(m0, s0, m1, s1, eps))
    assert worst == pytest.approx(1e-4, rel=1e-5)


# ------------------------------------------------------------------ auditor, errors
def test_auditor_and_result_fields():
    ins, outs = scores(12, 1.0)
    aud = CanaryScoreAuditor(ins, outs)
    bounds = aud.bounds(delta=1e-5)
    assert [b.method for b in bounds] == ["clopper-pearson", "gdp", "one-run",
                                          "gaussian-one-run"]
    for b in bounds:
        d = b.to_dict()
        assert d["kind"] == "lower_bound" and d["confidence"] == 0.95 and d["assumptions"]
        assert b.epsilon_lower_bound >= 0 and not b.exceeds(10.0)
    assert 0.7 < aud.auroc() < 0.82
    assert 0 < aud.tpr_at_fpr(0.05) < 1


@pytest.mark.parametrize("call,name", [
    (lambda: gdp_bound([1.0], [0.0], delta=0.0), "delta"),
    (lambda: gdp_bound([], [0.0], delta=1e-5), "in_scores"),
    (lambda: clopper_pearson_bound([1.0, np.nan], [0.0]), "in_scores"),
    (lambda: clopper_pearson_bound([1.0], [0.0], confidence=1.0), "confidence"),
    (lambda: clopper_pearson_bound([1.0], [0.0], thresholds="best"), "thresholds"),
    (lambda: gaussian_bound([1.0], [0.0], delta=1e-5), "in_scores"),
    (lambda: one_run_p_value(10, 5, 6, 1.0, 0.0), "correct"),
])
def test_errors_name_the_argument(call, name):
    with pytest.raises(InvalidParameterError) as e:
        call()
    assert e.value.name == name
