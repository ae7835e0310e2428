"""Soundness findings of an independent check, each with its exact inputs, and the property
tests that guard them: one noise-multiplier convention under both relations, every method an
upper bound, AUTO the minimum of the valid bounds it computes, monotone in q up to q = 1."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from dp_accounting import dp_event as E
from dp_accounting.pld import privacy_loss_distribution as dp_pld

import privkit
from privkit.accountants import fftpld, midp, pure, rec
from privkit.accountants.amplification import PoissonSampledPureDpEvent
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.events import (
    ComposedDpEvent,
    GaussianDpEvent,
    L2LaplaceDpEvent,
    PureDpEvent,
    SelfComposedDpEvent,
    gaussian_steps_event,
)

AR = privkit.NeighboringRelation.ADD_OR_REMOVE_ONE
RO = privkit.NeighboringRelation.REPLACE_ONE
logging.getLogger().setLevel(logging.ERROR)  # dp-accounting's optimistic-PLD warning


def _optimistic(z: float, q: float, t: int, rel, vdi: float = 1e-3):
    """dp-accounting's optimistic PLD (privacy buckets rounding down): a lower bound, in
    privkit's convention (sensitivity 1/2 under REPLACE_ONE)."""
    return dp_pld.from_gaussian_mechanism(
        z, sensitivity=0.5 if rel == RO else 1.0, sampling_prob=q, neighboring_relation=rel,
        value_discretization_interval=vdi, pessimistic_estimate=False,
        use_connect_dots=False).self_compose(t)


# ------------------------------------------------------------------ finding 1: convention
@pytest.mark.parametrize("method", ["auto", "exact", "rdp", "pld", "pld-fft", "moments"])
def test_replace_one_means_the_same_noise_multiplier_for_every_method(method: str) -> None:
    # z = 2 (stddev / C), T = 10, delta 1e-5 under REPLACE_ONE (sensitivity 2C): the exact
    # epsilon of z = 1 against C, 17.8566, in every method; never 7.5113 (the sensitivity not
    # doubled: privkit 0.1's reading) and never below the exact value.
    ev = gaussian_steps_event(2.0, 10)
    r = privkit.epsilon(ev, 1e-5, method, neighboring_relation=RO)
    assert r.epsilon >= 17.8565868 * (1 - 1e-12)
    if method in ("auto", "exact", "pld", "pld-fft"):
        assert r.epsilon == pytest.approx(17.8565868, rel=2e-5)
    assert "replace_one" in r.assumptions[0]


@pytest.mark.parametrize("rel", [AR, RO])
def test_epsilon_is_continuous_and_monotone_in_q_up_to_one(rel) -> None:
    qs = [0.5, 0.9, 0.99, 1 - 1e-6, 1 - 1e-9, 1.0]
    eps = [privkit.epsilon(gaussian_steps_event(2.0, 10, q), 1e-5, neighboring_relation=rel)
           .epsilon for q in qs]
    assert all(a <= b * (1 + 2 * fftpld.RELATIVE_ERROR) for a, b in zip(eps, eps[1:]))
    exact = 7.5112759 if rel == AR else 17.8565868  # replace-one: sensitivity 2C
    assert eps[-2] <= eps[-1] and eps[-1] == pytest.approx(exact, rel=1e-7)


def _random_settings(n: int, seed: int) -> list[tuple[float, float, int, float, object]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        z = float(np.exp(rng.uniform(math.log(0.5), math.log(20))))
        q = 1.0 if rng.random() < 0.15 else float(np.exp(rng.uniform(math.log(1e-3), 0)))
        t = int(np.exp(rng.uniform(0, math.log(500))))
        d = float(10 ** rng.uniform(-10, -2))
        out.append((z, q, t, d, RO if rng.random() < 0.35 else AR))
    return out


SETTINGS = _random_settings(200, 20261201)


@pytest.mark.parametrize("chunk", range(4))
def test_every_method_is_an_upper_bound_and_auto_is_their_minimum(chunk: int) -> None:
    """200 random (z, q, T, delta, relation): each method that prices a setting is at least the
    exact value (q = 1) or dp-accounting's optimistic PLD (a lower bound; checked on every
    fourth setting, it is slow); AUTO is <= every method it ran."""
    for i, (z, q, t, d, rel) in enumerate(SETTINGS[chunk::4]):
        ev = gaussian_steps_event(z, t, q)
        got: dict[str, float] = {}
        # dp-accounting's PLD (and its optimistic reference) on every fourth setting: slow
        for m in ("exact", "rdp", "pld-fft", "moments") + (("pld",) if i % 4 == 0 else ()):
            try:
                got[m] = privkit.epsilon(ev, d, m, neighboring_relation=rel).epsilon
            except (UnsupportedEventError, InvalidParameterError):
                continue
        auto = privkit.epsilon(ev, d, neighboring_relation=rel).epsilon
        for m in ("rdp", "pld-fft", "exact"):
            if m in got:
                assert auto <= got[m], (z, q, t, d, rel, m)
        if "pld" in got:
            assert auto <= got["pld"] * (1 + 1e-4), (z, q, t, d, rel)
        if q == 1:
            exact = privkit.epsilon(ev, d, "exact").epsilon
            assert all(v >= exact * (1 - 1e-12) for v in got.values()), (z, t, d, got)
            assert auto >= exact * (1 - 1e-12)
        elif i % 4 == 0:
            lower = _optimistic(z, q, t, rel)
            for m, v in list(got.items()) + [("auto", auto)]:
                assert lower.get_delta_for_epsilon(v) <= d * (1 + 1e-9), (z, q, t, d, rel, m)


def test_monotone_in_q_on_random_settings() -> None:
    for z, q, t, d, rel in SETTINGS[:60]:
        qs = sorted({q, min(1.0, 1.5 * q), min(1.0, 3 * q), 1.0})
        eps = [privkit.epsilon(gaussian_steps_event(z, t, x), d, neighboring_relation=rel)
               .epsilon for x in qs]
        assert all(a <= b * (1 + 2 * fftpld.RELATIVE_ERROR) for a, b in zip(eps, eps[1:])), \
            (z, t, d, rel, qs, eps)


# ------------------------------------------------------------------ finding 2: AUTO
def test_auto_beats_the_old_rdp_fallback_at_large_epsilon() -> None:
    # The old RDP fallback (epsilon > 200) gave 18647; PLD gives ~3626.
    r = privkit.epsilon(gaussian_steps_event(0.3709, 22449, 0.09198), 5.59e-6)
    assert r.method.startswith("pld-fft") and r.epsilon < 3640
    assert r.epsilon <= privkit.epsilon(gaussian_steps_event(0.3709, 22449, 0.09198), 5.59e-6,
                                        "rdp").epsilon


def test_auto_below_delta_1e_10_is_tight_and_above_a_lower_bound() -> None:
    # The old RDP fallback below delta 1e-10 gave 0.0157; the truth is ~1.09e-4.
    z, t, q, d = 11.34, 3, 1.47e-4, 3.83e-11
    r = privkit.epsilon(gaussian_steps_event(z, t, q), d)
    lower = _optimistic(z, q, t, AR, vdi=1e-7)
    assert lower.get_delta_for_epsilon(r.epsilon) <= d
    assert r.epsilon < 1.1e-4
    # no jump either side of the old 1e-10 floor
    a = privkit.epsilon(gaussian_steps_event(1.1, 100, 0.01), 1e-10 * (1 - 1e-6)).epsilon
    b = privkit.epsilon(gaussian_steps_event(1.1, 100, 0.01), 1e-10 * (1 + 1e-6)).epsilon
    assert a == pytest.approx(b, rel=2 * fftpld.RELATIVE_ERROR)


def test_auto_at_ten_million_steps_is_fast_and_tighter_than_rdp() -> None:
    ev = gaussian_steps_event(2.0, 10**7, 1e-5)
    r = privkit.epsilon(ev, 1e-8)
    assert r.method.startswith("pld-fft")
    assert r.epsilon <= privkit.epsilon(ev, 1e-8, "rdp").epsilon  # 0.223
    assert r.epsilon < 0.08  # the CLT value (accurate here) is 0.0765


@pytest.mark.parametrize(("z", "t", "q", "d"), [(1.0, 2 * 10**6, 1e-4, 1e-9),
                                                 (1.0, 3 * 10**5, 1e-3, 2e-10)])
def test_auto_and_calibration_fall_back_instead_of_raising(z, t, q, d) -> None:
    e = privkit.epsilon(gaussian_steps_event(z, t, q), d).epsilon
    assert math.isfinite(e)
    c = privkit.calibrate_noise_multiplier(target_epsilon=e, delta=d, steps=t,
                                           sampling_probability=q)
    assert c.epsilon <= e and c.noise_multiplier <= z * (1 + 1e-3)


# -------------------------------------------------- finding 3: heterogeneous pure steps
TERMS = [(0.47102907783123743, 9), (0.01016525086997564, 10), (0.10695355018977398, 18)]
TERMS_DELTA = 4.5177780015656535e-05


def _pure_event(terms):
    return ComposedDpEvent([SelfComposedDpEvent(PureDpEvent(e), n) for e, n in terms])


def test_heterogeneous_pure_is_as_tight_as_the_exact_composition() -> None:
    ev = _pure_event(TERMS)
    auto = privkit.epsilon(ev, TERMS_DELTA)
    assert auto.epsilon == pytest.approx(5.2275, abs=1e-3)  # was 6.1645
    for m in ("pld", "rdp", "optimal"):
        assert auto.epsilon <= privkit.epsilon(ev, TERMS_DELTA, m).epsilon * (1 + 1e-9)


def test_optimal_delta_is_monotone_and_small_where_it_was_one() -> None:
    eps = np.linspace(5.0, 6.2, 61)
    ds = [pure.optimal_delta(TERMS, float(e)) for e in eps]
    assert all(a >= b for a, b in zip(ds, ds[1:]))
    assert max(pure.optimal_delta(TERMS, x) for x in (5.8, 5.9, 6.0, 6.1)) < 1e-6


# --------------------------------------------------------------- finding 6: smaller
def test_exact_gaussian_at_huge_noise_does_not_under_report() -> None:
    r = privkit.epsilon(gaussian_steps_event(1e8, 1), 1e-12)
    assert r.epsilon >= 3.3630153302891904e-08  # mpmath, 60 digits


@pytest.mark.parametrize("tol", [math.nan, 10.0, -1.0, 0.0, math.inf])
def test_calibration_tolerance_is_validated(tol: float) -> None:
    for q in (1.0, 0.01):
        with pytest.raises(InvalidParameterError, match="tol"):
            privkit.calibrate_noise_multiplier(target_epsilon=1.0, delta=1e-5, steps=100,
                                               sampling_probability=q, tol=tol)


def test_rdp_gives_zero_where_the_conversion_goes_negative() -> None:
    ev = gaussian_steps_event(1e4, 1, 1e-3)
    r = privkit.epsilon(ev, 0.5, "rdp")
    assert r.epsilon == 0.0
    assert privkit.delta(ev, 0.0, "rdp").delta <= 0.5


def test_huge_epsilon_and_tiny_noise_give_answers_not_errors() -> None:
    assert privkit.delta(GaussianDpEvent(1.0), epsilon=1e308).delta == 0.0
    assert midp.midp_coded_features(10, 1e-300, 1.0, 3) == math.inf


def test_unsupported_and_relation_errors_are_privkit_errors() -> None:
    with pytest.raises(UnsupportedEventError):
        privkit.epsilon(E.MixtureOfGaussiansDpEvent(1.0, [0, 1], [0.5, 0.5]), 1e-5)
    ev = PoissonSampledPureDpEvent(0.1, L2LaplaceDpEvent(1.0, 3))
    assert privkit.epsilon(ev, 1e-5).epsilon > 0
    for m in ("auto", "optimal", "basic", "rdp", "pld-fft"):
        with pytest.raises(UnsupportedEventError, match="ADD_OR_REMOVE_ONE"):
            privkit.epsilon(ev, 1e-5, m, neighboring_relation=RO)


def test_bool_is_not_a_dimension() -> None:
    with pytest.raises(InvalidParameterError, match="dim"):
        midp.midp_coded_features(10, 1.0, 1.0, True)
    with pytest.raises(InvalidParameterError, match="dimension"):
        L2LaplaceDpEvent(1.0, True)


def test_rec_bound_uses_the_specs_60_point_grid() -> None:
    # The Hoelder-p grid only adds valid bounds to a minimum: more points are never looser;
    # at K = 4 and small noise multipliers 60 points are up to ~4% tighter than 24.
    orders = np.array([2.0, 3.0, 16.0])
    default = rec.rec_rdp(orders, 0.25, 4)
    assert np.array_equal(default, rec.rec_rdp(orders, 0.25, 4, grid_points=60))
    assert (default <= rec.rec_rdp(orders, 0.25, 4, grid_points=24)).all()
    assert (default < rec.rec_rdp(orders, 0.25, 4, grid_points=24)).any()
