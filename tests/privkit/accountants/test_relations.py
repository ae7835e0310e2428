"""One meaning for an event under every relation: z = stddev / C, the accountant applies the
relation's sensitivity (replace-one: 2C), as dp-accounting's PLD accountant does.

The bug feared: privkit 0.1 read a replace-one noise multiplier as stddev / (2C), so the same
event printed half dp-accounting's PLD epsilon under replace-one (1.083 vs 2.478), and below
privkit's own add-remove number for the same noise.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.privacy_accountant import NeighboringRelation as R
from dp_accounting.privacy_accountant import UnsupportedEventError as DpaUnsupported
from dp_accounting.rdp import rdp_privacy_accountant

import privkit
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.events import (
    ComposedDpEvent,
    GaussianDpEvent,
    LaplaceDpEvent,
    PoissonSampledDpEvent,
    SampledWithoutReplacementDpEvent,
    SelfComposedDpEvent,
)
from privkit.ledger import Ledger

DELTA = 1e-5
RELATIONS = (R.ADD_OR_REMOVE_ONE, R.REPLACE_ONE, R.REPLACE_SPECIAL)


def _dpa_pld(event, relation) -> float:
    acc = pld_privacy_accountant.PLDAccountant(relation, value_discretization_interval=5e-4)
    acc.compose(event)
    return acc.get_epsilon(DELTA)


def _grid():
    out = []
    for z, t in itertools.product((0.7, 3.0), (1, 60)):
        out.append(SelfComposedDpEvent(GaussianDpEvent(z), t))
    for z, q, t in itertools.product((0.9, 2.5), (0.01, 0.3), (10, 400)):
        out.append(SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z)), t))
    out += [ComposedDpEvent([GaussianDpEvent(3), PoissonSampledDpEvent(0.1, GaussianDpEvent(1))]),
            ComposedDpEvent([SelfComposedDpEvent(GaussianDpEvent(4), 5),
                             SelfComposedDpEvent(PoissonSampledDpEvent(0.02,
                                                                       GaussianDpEvent(0.9)),
                                                 300)])]
    return out


@pytest.mark.parametrize("relation", RELATIONS, ids=lambda r: r.name)
@pytest.mark.parametrize("event", _grid(), ids=repr)
def test_every_gaussian_event_agrees_with_dp_accountings_pld(event, relation):
    got = privkit.epsilon(event, DELTA, neighboring_relation=relation).epsilon
    ref = _dpa_pld(event, relation)
    # both are pessimistic PLD upper bounds (or exact): to dp-accounting's discretisation
    assert got == pytest.approx(ref, rel=4e-3, abs=4e-3), (got, ref)
    assert got <= ref * (1 + 1e-4)  # privkit's finer grid is never looser


@pytest.mark.parametrize("z,count", [(0.7, 1), (2.0, 5), (5.0, 20)])
def test_laplace_agrees_with_dp_accounting_where_it_answers_and_doubles_under_replace_one(
        z, count):
    ev = SelfComposedDpEvent(LaplaceDpEvent(z), count)
    for rel in (R.ADD_OR_REMOVE_ONE, R.REPLACE_SPECIAL):
        got = privkit.epsilon(ev, DELTA, neighboring_relation=rel).epsilon
        assert got == pytest.approx(_dpa_pld(ev, rel), rel=4e-3, abs=4e-3)
    with pytest.raises(DpaUnsupported):  # dp-accounting's PLD refuses replace-one for Laplace
        _dpa_pld(ev, R.REPLACE_ONE)
    # the same Laplace(zC) against sensitivity 2C: pure 2/z per use
    basic = privkit.epsilon(ev, DELTA, "basic", neighboring_relation=R.REPLACE_ONE).epsilon
    assert basic == pytest.approx(count * 2 / z, rel=1e-12)
    got = privkit.epsilon(ev, DELTA, neighboring_relation=R.REPLACE_ONE).epsilon
    twice = privkit.epsilon(SelfComposedDpEvent(LaplaceDpEvent(z / 2), count), DELTA).epsilon
    assert got == pytest.approx(twice, rel=1e-9)


def test_the_issues_numbers():
    ev = SelfComposedDpEvent(PoissonSampledDpEvent(0.01, GaussianDpEvent(1.1)), 1000)
    assert privkit.epsilon(ev, DELTA, neighboring_relation=R.REPLACE_ONE).epsilon == \
        pytest.approx(2.478, abs=1e-3)
    assert privkit.epsilon(ev, DELTA).epsilon == pytest.approx(1.515, abs=1e-3)
    g = SelfComposedDpEvent(GaussianDpEvent(5), 10)
    assert privkit.epsilon(g, DELTA, neighboring_relation="replace-one").epsilon == \
        pytest.approx(5.7595, abs=1e-4)
    opacus_user = SelfComposedDpEvent(PoissonSampledDpEvent(0.01, GaussianDpEvent(1.1)), 10000)
    assert privkit.epsilon(opacus_user, DELTA, neighboring_relation=R.REPLACE_ONE).epsilon == \
        pytest.approx(9.42, abs=0.01)


@pytest.mark.parametrize("method", ["auto", "exact", "rdp", "moments", "pld", "pld-fft"])
def test_every_method_prices_replace_one_as_the_add_remove_curve_at_half_z(method):
    z, t = 1.7, 30
    ro = privkit.epsilon(SelfComposedDpEvent(GaussianDpEvent(z), t), DELTA, method,
                         neighboring_relation=R.REPLACE_ONE).epsilon
    ar = privkit.epsilon(SelfComposedDpEvent(GaussianDpEvent(z / 2), t), DELTA, method).epsilon
    assert ro == pytest.approx(ar, rel=1e-9)


@pytest.mark.parametrize("method", ["auto", "rdp", "pld", "pld-fft"])
def test_replace_one_is_never_below_add_remove_for_the_same_event(method):
    rng = np.random.default_rng(5)
    for _ in range(6):
        z, q, t = float(rng.uniform(0.6, 4)), float(rng.uniform(0.001, 0.5)), \
            int(rng.integers(1, 2000))
        ev = SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z)), t)
        ar = privkit.epsilon(ev, DELTA, method).epsilon
        zo = privkit.epsilon(ev, DELTA, method, neighboring_relation=R.REPLACE_SPECIAL).epsilon
        assert zo == pytest.approx(ar, rel=1e-9)
        if method == "rdp":  # no sampled replace-one RDP rule: refused, never guessed
            with pytest.raises(UnsupportedEventError):
                privkit.epsilon(ev, DELTA, method, neighboring_relation=R.REPLACE_ONE)
            continue
        ro = privkit.epsilon(ev, DELTA, method, neighboring_relation=R.REPLACE_ONE).epsilon
        assert ro >= ar * (1 - 1e-9), (z, q, t, ar, ro)


def test_sampling_without_replacement_is_dp_accountings_rdp_at_half_z():
    """dp-accounting answers only with RDP (replace-one), reading z against 2C: privkit's
    value of the same event in the per-contribution meaning is its RDP at z / 2."""
    ev = SelfComposedDpEvent(SampledWithoutReplacementDpEvent(1000, 10, GaussianDpEvent(2.0)), 50)
    got = privkit.epsilon(ev, DELTA, "rdp", neighboring_relation=R.REPLACE_ONE).epsilon
    half = SelfComposedDpEvent(SampledWithoutReplacementDpEvent(1000, 10, GaussianDpEvent(1.0)),
                               50)
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=R.REPLACE_ONE)
    acc.compose(half)
    assert got <= acc.get_epsilon(DELTA) * (1 + 1e-6)  # privkit's orders are a superset
    assert got >= acc.get_epsilon(DELTA) * 0.9
    # and never the (smaller) number of dp-accounting's reading of the same object
    acc2 = rdp_privacy_accountant.RdpAccountant(neighboring_relation=R.REPLACE_ONE)
    acc2.compose(ev)
    assert got > acc2.get_epsilon(DELTA) * 1.3


def test_an_event_of_unknown_meaning_is_refused_under_replace_one_and_zero_out():
    ev = dpe.RandomizedResponseDpEvent(noise_parameter=0.5, num_buckets=2)
    for rel in (R.REPLACE_ONE, R.REPLACE_SPECIAL):
        with pytest.raises(UnsupportedEventError, match="does not know"):
            privkit.epsilon(ev, DELTA, neighboring_relation=rel)
    mix = ComposedDpEvent([GaussianDpEvent(2.0), dpe.MixtureOfGaussiansDpEvent(1.0, [0, 1],
                                                                               [0.5, 0.5])])
    with pytest.raises(UnsupportedEventError, match="MixtureOfGaussiansDpEvent"):
        privkit.epsilon(mix, DELTA, neighboring_relation="replace-one")


def test_relation_names():
    for name in ("zero-out", "ZERO_OUT", "replace-special", "REPLACE_SPECIAL"):
        assert privkit.events.as_relation(name) is R.REPLACE_SPECIAL
    with pytest.raises(InvalidParameterError, match="zero-out"):
        privkit.events.as_relation("swap")
    r = privkit.epsilon(GaussianDpEvent(2.0), DELTA, neighboring_relation="zero-out")
    assert "zero-out" in str(r)


def test_calibration_under_replace_one_returns_the_same_noise_in_the_new_reading():
    ar = privkit.calibrate_noise_multiplier(target_epsilon=2.0, delta=DELTA, steps=40)
    ro = privkit.calibrate_noise_multiplier(target_epsilon=2.0, delta=DELTA, steps=40,
                                            neighboring_relation="REPLACE_ONE")
    assert ro.noise_multiplier == pytest.approx(2 * ar.noise_multiplier, rel=1e-5)
    sampled = privkit.calibrate_noise_multiplier(target_epsilon=2.0, delta=DELTA, steps=1000,
                                                 sampling_probability=0.02,
                                                 neighboring_relation="REPLACE_ONE")
    check = privkit.epsilon(privkit.gaussian_steps_event(sampled.noise_multiplier, 1000, 0.02),
                            DELTA, neighboring_relation="REPLACE_ONE").epsilon
    assert check <= 2.0
    assert check == pytest.approx(_dpa_pld(privkit.gaussian_steps_event(
        sampled.noise_multiplier, 1000, 0.02), R.REPLACE_ONE), rel=4e-3)


def test_mechanism_events_are_the_same_under_every_relation():
    agg = privkit.ClientLevelGaussian(1.0, 1.3, sampling_probability=0.1)
    assert agg.event(R.REPLACE_ONE) == agg.event() == PoissonSampledDpEvent(
        0.1, GaussianDpEvent(1.3))
    ac = privkit.AdaptiveClipping(0.5, count_stddev=1.0, sampling_probability=0.1)
    assert ac.round_event(agg, R.REPLACE_ONE) == ac.round_event(agg)
    assert privkit.mechanisms.unamplified_event(1.3, 4, neighboring_relation=R.REPLACE_ONE) \
        == SelfComposedDpEvent(GaussianDpEvent(1.3), 4)


def test_output_perturbation_refuses_a_replace_one_noise_multiplier_without_stddev():
    with pytest.raises(InvalidParameterError) as err:
        privkit.GaussianOutputPerturbation(l2_clip_norm=1.0, noise_multiplier=5.0)
    msg = str(err.value)
    assert "noise_multiplier" in msg and "stddev=10.0" in msg and "stddev=5.0" in msg
    m = privkit.GaussianOutputPerturbation(l2_clip_norm=1.0, stddev=10.0)
    assert (m.noise_multiplier, m.sensitivity, m.contribution_bound) == (10.0, 2.0, 1.0)
    # the epsilon of the same noise is what it was: stddev 10 against sensitivity 2
    e = privkit.epsilon(m.event(), DELTA, neighboring_relation=m.neighboring_relation).epsilon
    assert e == pytest.approx(privkit.epsilon(GaussianDpEvent(5.0), DELTA).epsilon, rel=1e-9)
    # PAPER (add/remove) reads noise_multiplier as before
    p = privkit.GaussianOutputPerturbation(10.0, 2.0, privkit.Sensitivity.PAPER, dataset_size=5)
    assert p.stddev == pytest.approx(4.0) and p.neighboring_relation is R.ADD_OR_REMOVE_ONE
    with pytest.raises(InvalidParameterError, match="stddev"):
        privkit.GaussianOutputPerturbation(1.0, 2.0, stddev=3.0)
    with pytest.raises(InvalidParameterError, match="stddev"):
        privkit.GaussianOutputPerturbation(1.0)


def test_an_l1_laplace_upload_costs_its_epsilon_under_replace_one_only_once():
    from privkit.mechanisms.laplace import LaplaceGradientNoise, NoiseShape

    mech = LaplaceGradientNoise(1.0, 4, 0.7, NoiseShape.L1)
    ev = mech.event(9)
    assert ev == privkit.events.ReplaceOneLaplaceDpEvent(2 / 0.7)
    with pytest.raises(UnsupportedEventError, match="REPLACE_ONE"):
        privkit.epsilon(ev, DELTA)
    e = privkit.epsilon(SelfComposedDpEvent(ev, 3), DELTA, "basic",
                        neighboring_relation=mech.neighboring_relation).epsilon
    assert e == pytest.approx(3 * 0.7, rel=1e-12)


def test_a_ledger_prices_the_same_event_under_its_relation():
    ev = PoissonSampledDpEvent(0.05, GaussianDpEvent(1.0))
    out = {}
    for rel in RELATIONS:
        led = Ledger.create(None, population_id="p", delta=DELTA,
                                           neighboring_relation=rel)
        led.spend(["a"], ev, count=200, label="x")
        out[rel] = led.epsilons()["a"]
        assert out[rel] == pytest.approx(_dpa_pld(SelfComposedDpEvent(ev, 200), rel), rel=4e-3)
    assert out[R.REPLACE_ONE] > 1.3 * out[R.ADD_OR_REMOVE_ONE]
    assert math.isclose(out[R.REPLACE_SPECIAL], out[R.ADD_OR_REMOVE_ONE], rel_tol=1e-9)
