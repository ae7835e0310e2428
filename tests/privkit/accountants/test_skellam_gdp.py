"""Gaussian-DP of the Skellam mechanism (privkit.accountants._skellam_gdp): the bound against
brute force on the exact laws, in one and several dimensions, and the accountant's delta slack.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

import privkit
from privkit.accountants import gaussian, rules
from privkit.accountants._skellam_gdp import TAIL_TV, _log_pmf, skellam_unit_gdp
from privkit.accountants.distributed import skellam_gdp_mu
from privkit.errors import InvalidParameterError
from privkit.events import SelfComposedDpEvent
from privkit.events.distributed import SkellamDpEvent


def _pmf(m: float) -> tuple[np.ndarray, np.ndarray]:
    """(k, P(Skellam(m) = k)) from scipy.stats (another code path than the module's)."""
    r = int(45 * math.sqrt(m) + 60)
    k = np.arange(-r, r + 1)
    return k, stats.skellam.pmf(k, m / 2, m / 2)


def _quantile_gap(m: float, c: int) -> float:
    """sup_s [Phi^-1(F(s)) - Phi^-1(F(s - c))] by brute force (left half from the CDF, right
    half from the survival function, both summed in extended precision), over the outputs whose
    tails are above 1e-150 (scipy's Skellam masses lose accuracy near 1e-200)."""
    k, p = _pmf(m)
    pl = p.astype(np.longdouble)
    cdf = np.cumsum(pl)
    sf = np.cumsum(pl[::-1])[::-1] - pl  # P(X > k)
    h = np.where(k < 0, special.ndtri(np.asarray(cdf, dtype=float)),
                 -special.ndtri(np.asarray(sf, dtype=float)))
    ok = (np.asarray(cdf, dtype=float) > 1e-150) & (np.asarray(sf, dtype=float) > 1e-150)
    with np.errstate(invalid="ignore"):
        gaps = h[c:] - h[:-c]
    return float(np.max(gaps[ok[c:] & ok[:-c]]))


@pytest.mark.parametrize("m", [1.0, 2.5, 7.5, 40.0, 300.0, 5000.0])
def test_unit_gdp_is_the_quantile_gap_rounded_up(m):
    """mu_1 is the exact GDP of a unit shift: at or above the brute-force supremum, and not
    more than the margins above it (a value too small would price too little noise)."""
    exact = _quantile_gap(m, 1)
    mu = skellam_unit_gdp(m)
    assert exact <= mu <= exact * (1 + 1e-8) + 2e-10


@pytest.mark.parametrize("m", [2.5, 7.5, 40.0])
@pytest.mark.parametrize("c", [1, 2, 3, 5])
def test_a_shift_by_c_is_below_c_mu1_gdp(m, c):
    """The telescoping: the exact privacy profile of (X, X + c) never exceeds the Gaussian's
    at mu = c mu_1 (every epsilon, both directions by symmetry); at c = 1, 2% less mu does not
    bound it (the bound is tight)."""
    k, p = _pmf(m)
    q = np.concatenate([np.zeros(c), p[:-c]])  # law of X + c on the same support
    mu = skellam_unit_gdp(m)
    assert _quantile_gap(m, c) <= c * mu
    for e in np.linspace(0.0, 8.0, 81):
        exact = float(np.sum(np.maximum(p - math.exp(e) * q, 0.0)))
        assert exact <= float(gaussian.exact_delta(c * mu, e)) + 1e-12
    if c == 1:
        worse = [float(np.sum(np.maximum(p - math.exp(e) * q, 0.0)))
                 - float(gaussian.exact_delta(0.98 * mu, e)) for e in np.linspace(0, 8, 161)]
        assert max(worse) > 0


@pytest.mark.parametrize("shift", [(1, 1), (2, 1), (1, 1, 1), (2, 1, 1), (3, 2)])
def test_a_vector_shift_is_below_mu1_times_its_l2_norm(shift):
    """Several coordinates: the exact hockey-stick divergence of the product laws (every
    combination of outputs enumerated) never exceeds that of mu_1 ||c||_2-GDP."""
    m = 2.5
    k, p = _pmf(m)
    keep = p > 1e-18
    k, p = k[keep], p[keep]
    logp = dict(zip(k.tolist(), np.log(p).tolist()))
    losses, probs = [], []
    for c in shift:
        # L = log P(x) - log P(x - c) on P's support; x - c outside it has mass < 1e-18
        lq = np.array([logp.get(x - c, -np.inf) for x in k.tolist()])
        losses.append(np.log(p) - lq)
        probs.append(p)
    total_l = losses[0]
    total_p = probs[0]
    for lj, pj in zip(losses[1:], probs[1:]):
        total_l = (total_l[:, None] + lj[None, :]).ravel()
        total_p = (total_p[:, None] * pj[None, :]).ravel()
    mu = skellam_unit_gdp(m) * math.sqrt(sum(c * c for c in shift))
    for e in np.linspace(0.0, 10.0, 51):
        with np.errstate(over="ignore"):
            exact = float(np.sum(total_p * np.maximum(1.0 - np.exp(e - total_l), 0.0)))
        assert exact <= float(gaussian.exact_delta(mu, e)) + 1e-12


def test_the_two_mass_evaluations_agree_where_both_apply():
    """The asymptotic expansion (used from 10^6) against scipy's Bessel function."""
    for m in (1e6, 1e7, 1e8, 1e9):
        k = np.linspace(0.0, 25 * math.sqrt(m), 9).round()
        assert np.max(np.abs(_log_pmf(k, m) - np.log(special.ive(k, m)))) < 2e-10


@pytest.mark.parametrize("m", [1e4, 1e6, 2.2e7, 5.7e9])
def test_large_variances_are_priced_as_the_gaussian_of_the_same_variance(m):
    mu = skellam_unit_gdp(m)
    assert 1.0 <= mu * math.sqrt(m) <= 1.0 + 1.0 / (4 * m) + 2e-10 * math.sqrt(m) + 1e-8


@pytest.mark.parametrize("bad", [0.5, 0.0, -1.0, math.nan, math.inf, 2.0**41])
def test_variance_out_of_range_is_refused_naming_it(bad):
    with pytest.raises(InvalidParameterError, match="^variance"):
        skellam_unit_gdp(bad)


def test_the_accountant_adds_the_tail_slack_and_falls_back_where_it_would_not_be_small():
    ev = SkellamDpEvent(1e4, 100, 300.0, 9600.0)
    run = SelfComposedDpEvent(ev, 10)
    comp = rules.flatten(run)
    assert rules.slack_total(comp) == pytest.approx(10 * 9600.0 * TAIL_TV)
    mu = skellam_gdp_mu(ev) * math.sqrt(10)
    r = privkit.delta(run, 3.0, neighboring_relation="zero-out")
    assert r.delta >= float(gaussian.exact_delta(mu, 3.0)) and r.method == "exact"
    assert privkit.epsilon(run, 1e-5, neighboring_relation="zero-out").epsilon >= \
        float(gaussian.exact_epsilon(mu, 1e-5))
    # almost no noise: epsilon in the hundreds, where (1 + e^eps) k Delta_1 1e-100 is not
    # negligible; the Renyi bound prices it instead, with no slack and no error
    tiny = SelfComposedDpEvent(SkellamDpEvent(1.0, 1, 300.0, 9600.0), 10)
    r = privkit.epsilon(tiny, 1e-5, neighboring_relation="zero-out")
    assert r.method.startswith("rdp") and math.isfinite(r.epsilon)
    with rules.without_nearby_laws():
        assert skellam_gdp_mu(ev) is None and rules.slack_total(comp) == 0.0
    assert skellam_gdp_mu(ev) is not None


def test_a_sampled_release_is_never_priced_above_its_unsampled_form():
    """Joint convexity: AUTO takes the unsampled Gaussian-DP where the sampled Renyi bound is
    looser (large epsilon per round), and the amplified bound where it is tighter."""
    for q, count in ((0.2, 4), (0.01, 100)):
        sampled = SelfComposedDpEvent(SkellamDpEvent(50.0, 7, 100.7, 1139.0, q), count)
        unsampled = SelfComposedDpEvent(SkellamDpEvent(50.0, 7, 100.7, 1139.0), count)
        e_s = privkit.epsilon(sampled, 1e-5, neighboring_relation="zero-out").epsilon
        e_u = privkit.epsilon(unsampled, 1e-5, neighboring_relation="zero-out").epsilon
        assert e_s <= e_u
