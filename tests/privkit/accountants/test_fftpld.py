"""privkit's own PLD (privkit.accountants.fftpld): bracketed by dp-accounting's optimistic and
pessimistic PLDs, exact where the answer is known, monotone, and one-sided at every step."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as dp_pld

import privkit
from privkit.accountants import fftpld
from privkit.accountants.gaussian import exact_epsilon
from privkit.errors import UnsupportedEventError
from privkit.events import (
    ComposedDpEvent,
    GaussianDpEvent,
    PoissonSampledDpEvent,
    SelfComposedDpEvent,
    gaussian_steps_event,
)

logging.getLogger().setLevel(logging.ERROR)  # dp-accounting's optimistic-PLD warning
AR, RO = "ADD_OR_REMOVE_ONE", "REPLACE_ONE"
R = privkit.NeighboringRelation


def _dp(z: float, q: float, t: int, rel: str, pessimistic: bool, vdi: float = 1e-3):
    relation = R.REPLACE_ONE if rel == RO else R.ADD_OR_REMOVE_ONE
    return dp_pld.from_gaussian_mechanism(
        z, sensitivity=0.5 if rel == RO else 1.0, sampling_prob=q,
        neighboring_relation=relation, value_discretization_interval=vdi,
        pessimistic_estimate=pessimistic, use_connect_dots=pessimistic).self_compose(t)


def _dp_epsilon(pld, d: float, hint: float) -> float:
    """dp-accounting's epsilon read from its own delta curve (its get_epsilon_for_delta can be
    up to ~1 nat loose at large epsilon): bisection on get_delta_for_epsilon."""
    if pld.get_delta_for_epsilon(0.0) <= d:
        return 0.0
    lo, hi = 0.0, max(hint, 1e-6)
    while pld.get_delta_for_epsilon(hi) > d:
        hi *= 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if pld.get_delta_for_epsilon(mid) > d else (lo, mid)
    return hi


def _settings(n: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        z = float(np.exp(rng.uniform(math.log(0.5), math.log(15))))
        q = float(np.exp(rng.uniform(math.log(1e-3), 0))) if rng.random() < 0.9 else 1.0
        t = int(np.exp(rng.uniform(0, math.log(200))))
        d = float(10 ** rng.uniform(-9, -2))
        yield z, q, t, d, RO if rng.random() < 0.3 else AR


SETTINGS = list(_settings(200, 7))


@pytest.mark.parametrize("chunk", range(4))
def test_between_dp_accountings_optimistic_and_pessimistic_pld(chunk: int) -> None:
    """200 random settings: never below dp-accounting's optimistic PLD (a lower bound: delta
    read at privkit's epsilon is <= the target) and at most 0.1% above its pessimistic PLD."""
    for z, q, t, d, rel in SETTINGS[chunk::4]:
        e, _ = fftpld.epsilon([(fftpld.GaussianAtom(z, q), t)], d, rel)
        opt = _dp(z, q, t, rel, False)
        assert opt.get_delta_for_epsilon(e) <= d * (1 + 1e-9), (z, q, t, d, rel, e)
        pes = _dp_epsilon(_dp(z, q, t, rel, True), d, e)
        assert e <= pes * 1.001 + 1e-9, (z, q, t, d, rel, e, pes)


@pytest.mark.parametrize(("z", "t", "d", "rel"), [
    (2.0, 10, 1e-5, AR), (1.0, 100, 1e-5, AR), (0.5, 1000, 1e-5, AR), (5.0, 1, 1e-10, AR),
    (2.0, 10, 1e-5, RO), (0.509, 1738, 5e-8, RO), (20.0, 10**6, 1e-10, AR)])
def test_unsampled_gaussian_matches_the_exact_value(z, t, d, rel) -> None:
    exact = float(exact_epsilon(math.sqrt(t) / z, d))
    e, _ = fftpld.epsilon([(fftpld.GaussianAtom(z, 1.0), t)], d, rel)
    # 10^6 steps at delta 1e-10: the floating-point allowance (2.5e-13) is 0.25% of delta,
    # which costs ~1e-5 of epsilon on top of the grid's error.
    rtol = 2 * fftpld.RELATIVE_ERROR if t < 10**6 else 3e-5
    assert exact * (1 - 1e-12) <= e <= exact * (1 + rtol)


def test_w1_reproduces_dp_accounting_and_the_rigorous_lower_bounds() -> None:
    # W1 (z = 1.1, q = 0.01, delta 1e-5): dp-accounting's PLD 1.5154 / 5.1926 / 21.0897 and
    # prv_accountant's rigorous lower bounds 1.5053 / 5.1823 / 21.0787 (spec, accounting.md).
    for t, dp_val, lower in ((1000, 1.5154, 1.5053), (10_000, 5.1926, 5.1823),
                             (100_000, 21.0897, 21.0787)):
        e, _ = fftpld.epsilon([(fftpld.GaussianAtom(1.1, 0.01), t)], 1e-5, AR)
        assert lower <= e <= dp_val * (1 + 2e-5)


def test_monotone_in_steps_rate_and_noise() -> None:
    base = (1.3, 0.02, 400)
    d = 1e-6

    def eps(z, q, t):
        return fftpld.epsilon([(fftpld.GaussianAtom(z, q), t)], d, AR)[0]

    slack = 1 + 2 * fftpld.RELATIVE_ERROR
    z, q, t = base
    ts = [eps(z, q, x) for x in (100, 200, 400, 800)]
    qs = [eps(z, x, t) for x in (0.005, 0.01, 0.02, 0.04)]
    zs = [eps(x, q, t) for x in (2.6, 1.8, 1.3, 0.9)]
    for seq in (ts, qs, zs):
        assert all(a <= b * slack for a, b in zip(seq, seq[1:]))


def test_heterogeneous_composition_equals_its_parts_priced_together() -> None:
    # Mixed q and z as a trainer produces them: the same bound however the event is built.
    parts = [(PoissonSampledDpEvent(0.01, GaussianDpEvent(1.1)), 500),
             (PoissonSampledDpEvent(0.05, GaussianDpEvent(2.0)), 200), (GaussianDpEvent(8.0), 3)]
    composed = ComposedDpEvent([SelfComposedDpEvent(a, n) for a, n in parts])
    loop = ComposedDpEvent([a for a, n in parts for _ in range(n)])
    a = privkit.epsilon(composed, 1e-5, "pld-fft").epsilon
    b = privkit.epsilon(loop, 1e-5, "pld-fft").epsilon
    assert a == b
    # each part alone is below the whole; the whole is below the sum of the parts
    alone = [privkit.epsilon(SelfComposedDpEvent(x, n), 1e-5, "pld-fft").epsilon
             for x, n in parts]
    assert max(alone) <= a <= sum(alone)


def test_delta_direction_is_an_upper_bound_too() -> None:
    z, q, t = 1.1, 0.01, 1000
    for e in (0.5, 1.5, 3.0):
        got = fftpld.delta([(fftpld.GaussianAtom(z, q), t)], e, AR, e, 1e-5)
        assert got >= _dp(z, q, t, AR, False).get_delta_for_epsilon(e)
        assert got <= _dp(z, q, t, AR, True, 1e-4).get_delta_for_epsilon(e) * 1.01 + 1e-15


def test_refuses_what_it_cannot_represent() -> None:
    with pytest.raises(UnsupportedEventError):
        fftpld.epsilon([(fftpld.GaussianAtom(1e-120, 0.5), 10)], 1e-5, AR)
    with pytest.raises(UnsupportedEventError, match="allowance"):
        fftpld.epsilon([(fftpld.GaussianAtom(1.0, 0.01), 10**6)], 1e-25, AR)


def test_auto_uses_it_for_subsampled_gaussians_and_calibration_agrees() -> None:
    ev = gaussian_steps_event(1.1, 1000, 0.01)
    r = privkit.epsilon(ev, 1e-5)
    assert r.method.startswith("pld-fft")
    c = privkit.calibrate_noise_multiplier(target_epsilon=r.epsilon, delta=1e-5, steps=1000,
                                           sampling_probability=0.01)
    assert c.noise_multiplier <= 1.1 * (1 + 1e-5)
    assert privkit.epsilon(gaussian_steps_event(c.noise_multiplier, 1000, 0.01),
                           1e-5).epsilon <= r.epsilon
