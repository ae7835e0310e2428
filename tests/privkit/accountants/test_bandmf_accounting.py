"""Banded-MF accounting: sensitivity against a brute-force maximum over every participation
pattern, the b = 1 case against DP-FedAvg's numbers, per-round charges that compose to the
run's event, dp-accounting pricing the same events, calibration, monotonicity, bad input."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

import privkit
from privkit.accountants import (
    Cyclic,
    CyclicPoisson,
    MinSeparation,
    bandmf_assumptions,
    bandmf_event,
    bandmf_round_events,
    bandmf_sensitivity,
    calibrate_bandmf,
)
from privkit.accountants import _bandmf_sensitivity as sensitivity_module
from privkit.errors import InvalidParameterError
from privkit.events import (
    ComposedDpEvent,
    GaussianDpEvent,
    NoOpDpEvent,
    PoissonSampledDpEvent,
    SelfComposedDpEvent,
)
from privkit.events.mechanisms import NeighboringRelation
from privkit.ledger import Ledger
from privkit.mechanisms import (
    BandedToeplitzStrategy,
    ClientLevelGaussian,
    TreeStrategy,
    unamplified_event,
)

REPLACE = NeighboringRelation.REPLACE_ONE


# --------------------------------------------------------------------------- brute force
def _patterns(t: int, s: int, k: int):
    """Every set of 1..k rounds in [0, t), any two >= s apart."""
    def rec(start, cur):
        if cur:
            yield tuple(cur)
        if len(cur) < k:
            for i in range(start, t):
                yield from rec(i + s, [*cur, i])
    yield from rec(0, [])


def _cyclic_patterns(t: int, g: int):
    """Each group's full pattern (its subsets are covered, see _brute)."""
    return [tuple(range(r, t, g)) for r in range(min(g, t))]


def _brute(c: np.ndarray, patterns) -> dict[str, float]:
    """Over the patterns: ``equal``, the best sum X_pi (all rows one unit vector);
    ``signed``, the best sigma^T X_pi sigma over sign vectors (rows +-u: realisable, and the
    true maximum in one dimension, X_pi being PSD, so a box's maximum is at a vertex, which
    covers the pattern's subsets); ``abs``, the best sum |X_pi| (>= the true maximum in any
    dimension); ``trace``, the best trace."""
    x = c.T @ c
    out = dict.fromkeys(("equal", "signed", "abs", "trace"), 0.0)
    for p in patterns:
        sub = x[np.ix_(p, p)]
        out["equal"] = max(out["equal"], sub.sum())
        out["abs"] = max(out["abs"], np.abs(sub).sum())
        out["trace"] = max(out["trace"], np.trace(sub))
        for signs in itertools.product((1.0, -1.0), repeat=len(p) - 1):
            sig = np.array((1.0, *signs))
            out["signed"] = max(out["signed"], float(sig @ sub @ sig))
    return out


RNG = np.random.default_rng(2024)
DENSE = np.tril(RNG.normal(size=(12, 12)))
np.fill_diagonal(DENSE, 1.0 + np.abs(np.diag(DENSE)))
DENSE_BANDED = np.tril(DENSE) - np.tril(DENSE, -3)  # 3 bands, signed, not Toeplitz

#: (name, strategy, whether X = C^T C >= 0 entrywise)
CASES = [
    ("optimized", BandedToeplitzStrategy.optimized(3, 12), True),
    ("sqrt4", BandedToeplitzStrategy.square_root(4), True),
    ("identity", BandedToeplitzStrategy.identity(), True),
    ("signed", BandedToeplitzStrategy((1.0, -0.5, 0.3)), False),
    ("bumpy", BandedToeplitzStrategy((1.0, 0.2, 0.6)), True),  # X >= 0, not monotone
    ("tree", TreeStrategy(), True),
    ("dense", DENSE, False),
    ("dense_banded", DENSE_BANDED, False),
]


def _matrix(strategy, t):
    return strategy[:t, :t] if isinstance(strategy, np.ndarray) else strategy.matrix(t)


def _check_against_brute(strategy, nonneg, t, schema, patterns):
    c = _matrix(strategy, t)
    patterns = list(patterns)
    r = bandmf_sensitivity(c if isinstance(strategy, np.ndarray) else strategy, rounds=t,
                           participation=schema)
    b = _brute(c, patterns)
    value2, lower2 = r.value ** 2, r.lower_bound ** 2
    tol = 1e-9 * max(1.0, b["abs"])
    assert value2 >= b["signed"] - tol  # never below a realisable value
    assert lower2 <= b["equal"] + tol  # the lower bound is realisable
    true = b["equal"] if nonneg else None  # the true maximum in any dimension
    x = c.T @ c
    if all(not np.triu(x[np.ix_(p, p)], 1).any() for p in patterns):
        true = b["trace"]  # every pattern's columns are orthogonal
    if r.exact:
        # known maximum, or (signed X) the bound met a realisable pattern: nothing exceeds it
        want = true if true is not None else b["equal"]
        assert value2 == pytest.approx(want, rel=1e-9), r
    else:
        assert value2 >= b["abs"] - tol, r  # the bound covers every sign and dimension
    return r, true


@pytest.mark.parametrize("t", [7, 12])
@pytest.mark.parametrize("name, strategy, nonneg", CASES, ids=[c[0] for c in CASES])
def test_min_separation_sensitivity_against_brute_force(name, strategy, nonneg, t):
    for s, k in [(1, 1), (1, 2), (1, 4), (2, 3), (3, 2), (3, 4), (5, 3)]:
        r, true = _check_against_brute(strategy, nonneg, t, MinSeparation(s, k),
                                       _patterns(t, s, k))
        toeplitz_closed_form = isinstance(strategy, BandedToeplitzStrategy) and (
            strategy.monotone or s >= strategy.num_bands)
        if toeplitz_closed_form:
            assert r.exact and r.method.startswith("exact"), (s, k, r)
        assert r.participations == min(k, -(-t // s))


@pytest.mark.parametrize("t", [7, 12])
@pytest.mark.parametrize("name, strategy, nonneg", CASES, ids=[c[0] for c in CASES])
def test_cyclic_sensitivity_against_brute_force(name, strategy, nonneg, t):
    for g in [1, 2, 3, 5]:
        if t == 12 and g == 1:
            continue  # 2^11 sign vectors: covered at t = 7
        r, _ = _check_against_brute(strategy, nonneg, t, Cyclic(g), _cyclic_patterns(t, g))
        if isinstance(strategy, BandedToeplitzStrategy) and (strategy.monotone
                                                             or g >= strategy.num_bands):
            assert r.exact


def test_the_closed_form_is_the_uniform_pattern_at_scale():
    """T = 10^4, b = 64, 100 participations 100 apart: sqrt(k) times the column norm; the
    Toeplitz entries of C^T C match the dense product."""
    s = BandedToeplitzStrategy.optimized(64, 10_000)
    r = bandmf_sensitivity(s, rounds=10_000, participation=MinSeparation(100, 100))
    assert r.exact and r.value == pytest.approx(10 * s.column_norm, rel=1e-12)
    st_ = sensitivity_module._strategy(BandedToeplitzStrategy.square_root(5), 40)
    idx = np.arange(40)
    c = BandedToeplitzStrategy.square_root(5).matrix(40)
    np.testing.assert_allclose(st_.gram(idx, idx), c.T @ c, atol=1e-14)


def test_tree_sensitivity_is_bracketed_at_the_benchmark_size():
    r = bandmf_sensitivity(TreeStrategy(), rounds=1000, participation=MinSeparation(100, 10))
    assert not r.exact and r.lower_bound <= r.value
    assert r.value == pytest.approx(math.sqrt(112), rel=1e-12)  # the documented bound
    assert r.lower_bound == pytest.approx(math.sqrt(104), rel=1e-12)


# --------------------------------------------------------------------------- b = 1
@pytest.mark.parametrize("z", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("s, k", [(20, 5), (1, 7), (30, 10)])
def test_identity_is_dp_fedavg_unamplified(z, s, k):
    ev = bandmf_event(BandedToeplitzStrategy.identity(), noise_multiplier=z, rounds=100,
                      participation=MinSeparation(s, k))
    k_eff = min(k, -(-100 // s))  # 30 apart: at most 4 rounds in 100
    ours = privkit.epsilon(ev, 1e-5)
    theirs = privkit.epsilon(unamplified_event(z, k_eff), 1e-5)
    assert ours.method == theirs.method == "exact"
    assert ours.epsilon == pytest.approx(theirs.epsilon, rel=1e-12)


def test_the_issue_numbers():
    """q 0.05, z 1, T 100: 3.50 amplified (Poisson), 11.48 for a client in 5 rounds."""
    ident = BandedToeplitzStrategy.identity()
    unamp = bandmf_event(ident, noise_multiplier=1.0, rounds=100,
                         participation=MinSeparation(20, 5))
    amp = bandmf_event(ident, noise_multiplier=1.0, rounds=100,
                       participation=CyclicPoisson(1, 0.05))
    assert round(privkit.epsilon(unamp, 1e-5).epsilon, 2) == 11.48
    assert round(privkit.epsilon(amp, 1e-5).epsilon, 2) == 3.50


@pytest.mark.parametrize("relation", [NeighboringRelation.ADD_OR_REMOVE_ONE, REPLACE])
@pytest.mark.parametrize("q", [0.02, 1.0])
def test_identity_amplified_is_dp_fedavgs_poisson_composition(q, relation):
    ev = bandmf_event(BandedToeplitzStrategy.identity(), noise_multiplier=1.1, rounds=50,
                      participation=CyclicPoisson(1, q), neighboring_relation=relation)
    fedavg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1.1, sampling_probability=q)
    assert ev == SelfComposedDpEvent(fedavg.event(relation), 50)
    a = privkit.epsilon(ev, 1e-5, neighboring_relation=relation)
    b = privkit.epsilon(SelfComposedDpEvent(fedavg.event(relation), 50), 1e-5,
                        neighboring_relation=relation)
    assert a.epsilon == b.epsilon


def test_amplified_banded_is_k_subsampled_gaussians_at_the_column_norm():
    s = BandedToeplitzStrategy((2.0, 1.0, 0.5))
    ev = bandmf_event(s, noise_multiplier=3.0, rounds=100, participation=CyclicPoisson(4, 0.1))
    zeta = math.sqrt(4 + 1 + 0.25)
    assert ev == SelfComposedDpEvent(PoissonSampledDpEvent(0.1, GaussianDpEvent(3.0 / zeta)), 25)
    ev = bandmf_event(s, noise_multiplier=3.0, rounds=101, participation=CyclicPoisson(3, 0.1))
    assert ev.count == 34


# --------------------------------------------------------------------------- ledger charges
@pytest.mark.parametrize("strategy, schema", [
    (BandedToeplitzStrategy.optimized(8, 60), MinSeparation(3, 12)),  # monotone, s < b
    (BandedToeplitzStrategy((1.0, -0.4, 0.2)), MinSeparation(4, 9)),  # separable
    (BandedToeplitzStrategy.square_root(4), Cyclic(5)),
], ids=["monotone", "separable", "cyclic"])
@pytest.mark.parametrize("relation", [NeighboringRelation.ADD_OR_REMOVE_ONE, REPLACE])
def test_round_events_price_every_prefix_exactly(strategy, schema, relation):
    t, z = 60, 2.0
    events = bandmf_round_events(strategy, noise_multiplier=z, rounds=t, participation=schema,
                                 neighboring_relation=relation)
    assert len(events) == t
    for prefix in (1, 7, 30, 60):
        charged = privkit.epsilon(ComposedDpEvent(list(events[:prefix])), 1e-6,
                                  neighboring_relation=relation)
        run = privkit.epsilon(bandmf_event(strategy, noise_multiplier=z, rounds=prefix,
                                           participation=schema, neighboring_relation=relation),
                              1e-6, neighboring_relation=relation)
        assert charged.epsilon == pytest.approx(run.epsilon, rel=1e-9)


def test_round_events_of_a_bound_charge_the_run_up_front_and_amplified_per_block():
    ev = bandmf_round_events(TreeStrategy(), noise_multiplier=1.0, rounds=20,
                             participation=MinSeparation(2, 4))
    whole = bandmf_event(TreeStrategy(), noise_multiplier=1.0, rounds=20,
                         participation=MinSeparation(2, 4))
    assert ev[0] == whole and all(e == NoOpDpEvent() for e in ev[1:])
    s = BandedToeplitzStrategy.square_root(3)
    amp = CyclicPoisson(4, 0.1)
    ev = bandmf_round_events(s, noise_multiplier=1.0, rounds=20, participation=amp)
    whole = bandmf_event(s, noise_multiplier=1.0, rounds=20, participation=amp)
    charged = [e for e in ev if e != NoOpDpEvent()]
    assert [i for i, e in enumerate(ev) if e != NoOpDpEvent()] == [0, 4, 8, 12, 16]
    assert SelfComposedDpEvent(charged[0], len(charged)) == whole


def test_a_ledger_charged_round_by_round_reports_the_runs_epsilon():
    s = BandedToeplitzStrategy.optimized(4, 30)
    schema = MinSeparation(5, 6)
    ledger = Ledger.create(None, population_id="bandmf", delta=1e-5)
    for r, ev in enumerate(bandmf_round_events(s, noise_multiplier=1.5, rounds=30,
                                               participation=schema)):
        if ev != NoOpDpEvent():
            ledger.spend(["population"], ev, label="round", round=r)
    whole = privkit.epsilon(bandmf_event(s, noise_multiplier=1.5, rounds=30,
                                         participation=schema), 1e-5)
    assert ledger.epsilons()["population"] == pytest.approx(whole.epsilon, rel=1e-9)


# --------------------------------------------------------------------------- dp-accounting
def test_dp_accounting_prices_the_same_events():
    s = BandedToeplitzStrategy.optimized(4, 200)
    amp = bandmf_event(s, noise_multiplier=1.2, rounds=200, participation=CyclicPoisson(5, 0.2))
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(amp)
    ours = privkit.epsilon(amp, 1e-5).epsilon
    assert ours == pytest.approx(pld.get_epsilon(1e-5), rel=1e-3)
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(amp)
    assert ours <= rdp.get_epsilon(1e-5)
    unamp = bandmf_event(s, noise_multiplier=3.0, rounds=200, participation=MinSeparation(5, 40))
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(unamp)
    assert privkit.epsilon(unamp, 1e-5).epsilon == pytest.approx(pld.get_epsilon(1e-5), rel=1e-3)


# --------------------------------------------------------------------------- calibration
@pytest.mark.parametrize("schema", [MinSeparation(10, 8), CyclicPoisson(8, 0.05)],
                         ids=["unamplified", "amplified"])
@pytest.mark.parametrize("relation", [NeighboringRelation.ADD_OR_REMOVE_ONE, REPLACE])
def test_calibration_meets_the_target_and_is_tight(schema, relation):
    s = BandedToeplitzStrategy.optimized(8, 80)
    tol = 1e-5
    r = calibrate_bandmf(s, target_epsilon=3.0, delta=1e-5, rounds=80, participation=schema,
                         neighboring_relation=relation, tol=tol)
    ev = bandmf_event(s, noise_multiplier=r.noise_multiplier, rounds=80, participation=schema,
                      neighboring_relation=relation)
    assert ev == r.event
    assert privkit.epsilon(ev, 1e-5, neighboring_relation=relation).epsilon <= 3.0
    less = bandmf_event(s, noise_multiplier=r.noise_multiplier / (1 + 4 * tol), rounds=80,
                        participation=schema, neighboring_relation=relation)
    assert privkit.epsilon(less, 1e-5, neighboring_relation=relation).epsilon > 3.0


def test_amplification_helps():
    s = BandedToeplitzStrategy.optimized(8, 400)
    unamp = calibrate_bandmf(s, target_epsilon=2.0, delta=1e-6, rounds=400,
                             participation=Cyclic(50))
    amp = calibrate_bandmf(s, target_epsilon=2.0, delta=1e-6, rounds=400,
                           participation=CyclicPoisson(50, 0.1))
    assert amp.noise_multiplier < unamp.noise_multiplier


def test_replace_one_doubles_the_sensitivity():
    """The event is the same under every relation; the accountant doubles the sensitivity
    under replace-one (the epsilon of half the noise multiplier), zero-out prices C."""
    import privkit

    s = BandedToeplitzStrategy.square_root(3)
    a = bandmf_event(s, noise_multiplier=2.0, rounds=30, participation=MinSeparation(3, 5))
    b = bandmf_event(s, noise_multiplier=2.0, rounds=30, participation=MinSeparation(3, 5),
                     neighboring_relation="REPLACE_ONE")
    assert a == b
    ro = privkit.epsilon(b, 1e-5, neighboring_relation="REPLACE_ONE").epsilon
    half = privkit.epsilon(type(a)(a.noise_multiplier / 2), 1e-5).epsilon
    assert ro == pytest.approx(half, rel=1e-12)
    zo = privkit.epsilon(b, 1e-5, neighboring_relation="zero-out").epsilon
    assert zo == pytest.approx(privkit.epsilon(a, 1e-5).epsilon, rel=1e-12)


# --------------------------------------------------------------------------- properties
COEFFS = st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=0, max_size=5).map(
    lambda rest: (1.0, *rest))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(coefficients=COEFFS, t=st.integers(1, 40), s=st.integers(1, 6), k=st.integers(1, 8))
def test_sensitivity_is_monotone_in_participations_and_rounds(coefficients, t, s, k):
    def sens(rounds, kk):
        return bandmf_sensitivity(coefficients, rounds=rounds,
                                  participation=MinSeparation(s, kk))
    assert sens(t, k).value <= sens(t, k + 1).value * (1 + 1e-12)
    assert sens(t, k).lower_bound <= sens(t, k + 1).lower_bound * (1 + 1e-12)
    a, b = sens(t, k), sens(t + 3, k)
    if a.exact and b.exact:  # the true maximum: a prefix of the run is never worse
        assert a.value <= b.value * (1 + 1e-12)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(z=st.floats(0.3, 20.0), factor=st.floats(1.001, 3.0), bands=st.integers(1, 6),
       q=st.sampled_from([1.0, 0.3]))
def test_epsilon_is_monotone_in_noise(z, factor, bands, q):
    s = BandedToeplitzStrategy.square_root(bands)
    schema = MinSeparation(4, 6) if q == 1 else CyclicPoisson(6, q)
    def eps(zz):
        ev = bandmf_event(s, noise_multiplier=zz, rounds=36, participation=schema)
        return privkit.epsilon(ev, 1e-5).epsilon
    assert eps(z * factor) <= eps(z)


def test_schemas_say_which_participation_fits():
    m = MinSeparation(min_separation=5, max_participations=2)
    assert m.allows([]) and m.allows([3]) and m.allows([10, 5])
    assert not m.allows([0, 4]) and not m.allows([0, 5, 10])
    assert Cyclic(4).allows([1, 5, 9], group=1) and not Cyclic(4).allows([1, 6], group=1)
    assert CyclicPoisson(3, 0.5).allows([2, 5], group=2)
    with pytest.raises(InvalidParameterError, match="rounds_taken"):
        m.allows([1, 1])
    with pytest.raises(InvalidParameterError, match="rounds_taken"):
        m.allows([-1])
    with pytest.raises(InvalidParameterError, match="group"):
        Cyclic(4).allows([1], group=4)


# --------------------------------------------------------------------------- assumptions
def test_assumptions_say_what_is_assumed():
    text = " ".join(bandmf_assumptions(MinSeparation(10, 3)))
    assert "trusted aggregator" in text and "knows who took part" in text
    assert "add or remove one client" in text
    text = " ".join(bandmf_assumptions(CyclicPoisson(4, 0.1), REPLACE))
    assert "stays secret" in text and "replace one client" in text
    assert "t mod 4" in " ".join(bandmf_assumptions(Cyclic(4)))


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("call, name", [
    (lambda: MinSeparation(0, 3), "min_separation"),
    (lambda: MinSeparation(2, math.nan), "max_participations"),
    (lambda: Cyclic(0), "groups"),
    (lambda: CyclicPoisson(2, 0.0), "sampling_probability"),
    (lambda: CyclicPoisson(2, 1.5), "sampling_probability"),
    (lambda: bandmf_sensitivity((1.0,), rounds=0, participation=Cyclic(2)), "rounds"),
    (lambda: bandmf_sensitivity((1.0,), rounds=5, participation="cyclic"), "participation"),
    (lambda: bandmf_sensitivity((0.0, 1.0), rounds=5, participation=Cyclic(2)), "strategy"),
    (lambda: bandmf_sensitivity("tree", rounds=5, participation=Cyclic(2)), "strategy"),
    (lambda: bandmf_sensitivity(np.ones((4, 4)), rounds=4, participation=Cyclic(2)),
     "strategy"),
    (lambda: bandmf_sensitivity(np.eye(4), rounds=5, participation=Cyclic(2)), "strategy"),
    (lambda: bandmf_sensitivity(TreeStrategy(), rounds=5000, participation=Cyclic(2)),
     "rounds"),
    (lambda: bandmf_event((1.0, 0.5, 0.2), noise_multiplier=1.0, rounds=10,
                          participation=CyclicPoisson(2, 0.1)), "groups"),
    (lambda: bandmf_event(TreeStrategy(), noise_multiplier=1.0, rounds=8,
                          participation=CyclicPoisson(4, 0.1)), "groups"),
    (lambda: bandmf_event((1.0,), noise_multiplier=math.nan, rounds=10,
                          participation=Cyclic(2)), "noise_multiplier"),
    (lambda: bandmf_event((1.0,), noise_multiplier=1.0, rounds=10, participation=Cyclic(2),
                          neighboring_relation="neighbours"), "neighboring_relation"),
    (lambda: calibrate_bandmf((1.0,), target_epsilon=-1.0, delta=1e-5, rounds=10,
                              participation=Cyclic(2)), "target_epsilon"),
    (lambda: calibrate_bandmf((1.0,), target_epsilon=1.0, delta=1.0, rounds=10,
                              participation=Cyclic(2)), "delta"),
])
def test_bad_input_is_named(call, name):
    with pytest.raises(InvalidParameterError, match=name):
        call()
