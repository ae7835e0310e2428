"""REC accountant: the spec's test vectors, soundness against Monte Carlo, limits, sampling."""

import math

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp
from scipy import special

import privkit
from privkit.accountants import rdp, rec
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.events import (
    GaussianDpEvent,
    SampledWithReplacementDpEvent,
    SelfComposedDpEvent,
    event_from_dict,
    event_to_dict,
)
from privkit.ledger import Ledger

R1 = NeighboringRelation.REPLACE_ONE

# spec dp_rec 9.4: K, c, alpha, replace-one (unrounded), add, remove
TABLE = [
    (16, 0.5, 2, 1.093284, 0.2500, 0.3059), (16, 0.5, 8, 4.303083, 1.057, 1.095),
    (16, 1.0, 2, 4.498640, 1.000, 1.294), (16, 1.0, 8, 21.25854, 4.730, 4.466),
    (256, 0.5, 2, 1.005564, 0.2500, 0.2533), (256, 0.5, 8, 4.017963, 1.003, 1.006),
    (256, 1.0, 2, 4.033157, 1.000, 1.020), (256, 1.0, 8, 17.88687, 4.021, 4.033),
]


@pytest.mark.parametrize("k, c, a, r1, add, remove", TABLE)
def test_spec_vectors(k, c, a, r1, add, remove):
    assert rec.rec_rdp_replace_one_pstar([a], 1 / c, k)[0] == pytest.approx(r1, rel=2e-6)
    # the p grid never beats p* here (spec), and the envelope keeps it
    assert rec.rec_rdp([a], 1 / c, k)[0] == pytest.approx(r1, rel=2e-6)
    a_, r_ = rec.rec_rdp_zero_out([a], 1 / c, k)
    assert a_[0] == pytest.approx(add, abs=6e-4) and r_[0] == pytest.approx(remove, abs=6e-4)
    z = rec.rec_rdp([a], 1 / c, k, "ADD_OR_REMOVE_ONE")[0]
    assert z <= max(add, remove) + 6e-4


def test_moments_vectors_and_mpmath():
    assert rec.log_m_plus(15, 0.5, 3) == pytest.approx(0.0563638137344, rel=1e-11)
    assert rec.log_m_plus(255, 1.0, 15) == pytest.approx(27.4254863508695, rel=1e-11)
    assert rec.log_m_minus(15, 0.5, 3)[0] == pytest.approx(0.111743899, rel=1e-6)
    assert rec.log_m_minus(255, 1.0, 15)[0] == pytest.approx(0.767864124, rel=1e-6)
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    for n, c, r in ((3, 0.7, 4), (15, 0.5, 7), (40, 1.3, 5)):
        c_m = mpmath.mpf(c)
        poly = [mpmath.e ** (k * (k - 1) * c_m**2 / 2) / mpmath.factorial(k) for k in range(r + 1)]
        acc = [mpmath.mpf(1)] + [mpmath.mpf(0)] * r
        for _ in range(n):
            acc = [sum(acc[i] * poly[j - i] for i in range(j + 1)) for j in range(r + 1)]
        exact = mpmath.log(mpmath.factorial(r) * acc[r] / mpmath.mpf(n) ** r)
        assert float(rec.log_m_plus(n, c, r)) == pytest.approx(float(exact), rel=1e-12)


def test_moments_against_monte_carlo():
    g = np.random.default_rng(0)
    for n, c, r in ((15, 0.5, 2.0), (15, 0.25, 3.0), (63, 0.5, 1.5)):
        y = np.exp(c * g.standard_normal((200_000, n)) - c * c / 2).mean(axis=1)
        for val, moment in ((rec.log_m_plus(n, c, max(r, 1.0)), y ** max(r, 1.0)),
                            (rec.log_m_minus(n, c, r)[0], y ** -r)):
            se = moment.std() / math.sqrt(moment.size) / moment.mean()
            if r == int(r) or val is not None:
                assert abs(float(val) - math.log(moment.mean())) < 4 * se + 1e-4


def _exact_mc(k, c, alpha, d, n=20_000, seed=0):
    """Monte Carlo of exp(beta D_alpha) of the full view, antipodal pair, d dimensions."""
    g = np.random.default_rng(seed)
    u = np.zeros(d)
    u[0] = c
    z = g.standard_normal((n, k, d))
    lu, lv = special.log_softmax(z @ u, axis=1), special.log_softmax(z @ -u, axis=1)
    terms = special.logsumexp(alpha * lu + (1 - alpha) * lv, axis=1)  # log sum_k pi^a pi'^(1-a)
    w = np.exp(terms)
    return math.log(w.mean()) / (alpha - 1), w.std() / w.mean() / math.sqrt(n) / (alpha - 1)


@pytest.mark.parametrize("k, c, exact", [(4, 0.25, 0.1844), (16, 0.5, 0.9141), (16, 1.0, 3.1836)])
@pytest.mark.parametrize("d", [1, 2])
def test_bound_exceeds_monte_carlo_of_the_exact_divergence(k, c, exact, d):
    mc, se = _exact_mc(k, c, 2.0, d)
    assert mc == pytest.approx(exact, abs=4 * se + 2e-3)  # spec 5.10's exact column (alpha 2)
    assert rec.rec_rdp([2.0], 1 / c, k)[0] >= mc + 4 * se


def test_bound_exceeds_the_spec_exact_column():
    for k, c, a, exact in ((4, 1.0, 10, 9.2760), (16, 1.0, 10, 9.6089), (256, 0.5, 10, 4.7009),
                           (256, 1.0, 10, 11.1224), (256, 0.5, 2, 0.9943)):
        assert rec.rec_rdp([a], 1 / c, k)[0] >= exact


def test_tends_to_gaussian_and_monotone():
    orders = np.array([1.5, 2.0, 3.0, 8.0, 20.0])
    c = 0.5
    gauss = 2 * orders * c * c
    big = rec.rec_rdp(orders, 1 / c, 1 << 16)
    assert np.all(big >= gauss) and np.all(big <= gauss * 1.01)
    prev = None
    for k in (4, 16, 256, 4096):
        cur = rec.rec_rdp(orders, 1 / c, k)
        assert np.all(cur >= gauss) and np.all(np.diff(cur) >= 0)
        if prev is not None:
            assert np.all(cur <= prev + 1e-9)  # non-increasing in K
        prev = cur
    by_c = [rec.rec_rdp(orders, 1 / cc, 64) for cc in (0.25, 0.5, 1.0, 1.5)]
    assert all(np.all(b >= a) for a, b in zip(by_c, by_c[1:]))  # monotone in C / sigma
    assert np.isinf(rec.rec_rdp([300.0], 2.0, 16)[0])


def test_composition_matches_the_rdp_accountant():
    ev = rec.RecDpEvent(2.0, 256, 3)
    r = privkit.epsilon(SelfComposedDpEvent(ev, 10), 1e-5, "rdp", neighboring_relation=R1)
    curve = rec.rec_rdp(rdp.ORDERS, 2.0, 256)
    assert r.epsilon == pytest.approx(rdp.epsilon_from_rdp(rdp.ORDERS, 10 * curve, 1e-5)[0])
    assert any("Theorem R" in a for a in r.assumptions)
    # groups do not change the bound; AUTO falls back to RDP (no PLD for REC)
    r2 = privkit.epsilon(SelfComposedDpEvent(rec.RecDpEvent(2.0, 256, 50), 10), 1e-5,
                         neighboring_relation=R1)
    assert r2.epsilon == pytest.approx(r.epsilon) and r2.method.startswith("rdp")


def _wor_gaussian(gamma, z, alpha):
    return dp_rdp._compute_rdp_sample_wor_gaussian_int(gamma, z, alpha) / (alpha - 1)


def test_with_replacement_bound_against_dp_accounting_gaussian():
    def base(z):
        return lambda o: np.asarray(o) / (2 * z * z)

    for z, n, a, want in ((1.0, 1000, 2, 5.436549e-06), (1.0, 1000, 8, 2.207437e-05),
                          (2.0, 100, 8, 4.883930e-04), (2.0, 100, 32, 2.517182e-03)):
        got = rec.subsampled_with_replacement_rdp(base(z), n, [float(a)])[0]
        assert got == pytest.approx(want, rel=1e-5)
        assert got >= _wor_gaussian(1 / n, z, a) * (1 - 1e-9)


def test_with_replacement_rec_vectors_and_worked_example():
    base = lambda o: rec.rec_rdp(o, 2.0, 256)  # noqa: E731
    got = rec.subsampled_with_replacement_rdp(base, 1000, [2.0, 8.0, 13.0])
    np.testing.assert_allclose(got, [5.466881e-06, 2.220061e-05, 3.847342e-05], rtol=1e-5)
    # interpolation between integers: (alpha - 1) eps' linear
    mid = rec.subsampled_with_replacement_rdp(base, 1000, [2.5])[0]
    assert mid * 1.5 == pytest.approx((1 * got[0] + 2 * rec.subsampled_with_replacement_rdp(
        base, 1000, [3.0])[0]) / 2, rel=1e-9)
    r = rec.rec_epsilons(noise_multiplier=2.0, num_candidates=256, population_size=1000,
                         draws_per_round=10, rounds=1000, delta=1e-5, messages_of_client=10)
    assert r["central"]["epsilon"] == pytest.approx(1.050, abs=1e-3)  # spec 6.5
    assert r["local"]["epsilon"] > 19.0
    assert any("link a message" in a for a in r["central"]["assumptions"])


def test_sampled_event_rules():
    ev = rec.rec_run_event(noise_multiplier=2.0, num_candidates=16, population_size=100,
                           messages=50)
    with pytest.raises(UnsupportedEventError, match="REPLACE_ONE"):
        privkit.epsilon(ev, 1e-5, "rdp")
    with pytest.raises(UnsupportedEventError, match="sample_size"):
        privkit.epsilon(SampledWithReplacementDpEvent(100, 2, rec.RecDpEvent(2.0, 16)), 1e-5,
                        "rdp", neighboring_relation=R1)
    # a Gaussian inner event works too (generic bound)
    g = SelfComposedDpEvent(SampledWithReplacementDpEvent(100, 1, GaussianDpEvent(2.0)), 5)
    assert privkit.epsilon(g, 1e-5, "rdp", neighboring_relation=R1).epsilon > 0


def test_event_json_validation_and_relation():
    ev = rec.RecDpEvent(2.0, 256, 4, NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert ev.neighboring_relation == "ADD_OR_REMOVE_ONE"
    assert event_from_dict(event_to_dict(ev)) == ev
    zero = privkit.epsilon(ev, 1e-5, "rdp").epsilon
    r1 = privkit.epsilon(ev, 1e-5, "rdp", neighboring_relation=R1).epsilon
    assert zero < r1  # zero-out only when both the event and the accountant say so
    ledger = Ledger.create(None, population_id="p", delta=1e-5,
                           neighboring_relation=R1)
    ledger.spend(["a"], rec.RecDpEvent(2.0, 256), label="m", count=3)
    assert ledger.epsilons()["a"] > 0
    for kwargs, name in (({"noise_multiplier": 0.0}, "noise_multiplier"),
                         ({"num_candidates": 1}, "num_candidates"),
                         ({"num_candidates": 2**25}, "num_candidates"),
                         ({"num_groups": 0}, "num_groups"),
                         ({"neighboring_relation": "x"}, "neighboring_relation")):
        with pytest.raises(InvalidParameterError, match=name):
            rec.RecDpEvent(**({"noise_multiplier": 2.0, "num_candidates": 16} | kwargs))
