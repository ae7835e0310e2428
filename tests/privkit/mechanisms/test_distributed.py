"""Distributed Skellam mechanism: rotation, conditional rounding, exact modular sums, the noise
law of the sum, exact secure-mode Poisson draws, survivors, bad input.

Statistical tests fix their seed (secure mode cannot: it is unseeded by design) and state their
false-failure rate: the probability, over the choice of seed, that a correct sampler fails
them. Each noise test is paired with deliberately wrong samplers that must fail it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import stats

import privkit
from privkit.errors import InvalidParameterError
from privkit.events import SelfComposedDpEvent
from privkit.events.distributed import (
    SkellamDpEvent,
    rounded_norm_bound_sq,
    skellam_sensitivities,
)
from privkit.events.mechanisms import NeighboringRelation
from privkit.ledger import Ledger
from privkit.mechanisms import DistributedSkellam, SecureRandom, secure_sum
from privkit.mechanisms import distributed as dist
from privkit.mechanisms._distributed_poisson import exact_poisson
from privkit.mechanisms.distributed import (
    center_modular,
    conditional_round,
    hadamard_rotate,
    inverse_hadamard_rotate,
    skellam_noise,
)

#: p-value below which a distribution test fails: its false-failure rate for a correct sampler
#: (over seeds; the seeds are fixed, so a passing test passes every time).
LEVEL = 1e-3


def mech(**kw):
    args = {"l2_clip_norm": 1.0, "granularity": 1e-2, "noise_per_client": 50.0, "bits": 20,
            "dim": 100, "min_survivors": 3}
    args.update(kw)
    return DistributedSkellam(**args)


def words_of(seed):
    rng = np.random.default_rng(seed)
    return lambda k: rng.integers(0, 2**64, size=k, dtype=np.uint64)


def chi2_pvalue(x: np.ndarray, dist_: stats.rv_discrete) -> float:
    """Pearson's chi-square of integer draws against a pmf; bins with expected count < 5
    merged into the two tails."""
    x = np.asarray(x, dtype=np.int64)
    n = x.size
    lo, hi = int(dist_.ppf(1e-4)), int(dist_.ppf(1 - 1e-4))
    ks = np.arange(lo, hi + 1)
    expected = np.concatenate([[dist_.cdf(lo - 1)], dist_.pmf(ks), [dist_.sf(hi)]]) * n
    counts = np.bincount(np.clip(x - lo + 1, 0, hi - lo + 2), minlength=hi - lo + 3)
    keep = expected >= 5
    obs = np.concatenate([counts[keep], [counts[~keep].sum()]])
    exp = np.concatenate([expected[keep], [expected[~keep].sum()]])
    if exp[-1] < 5:
        obs[-2] += obs[-1]
        exp[-2] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


# ------------------------------------------------------------------ rotation
def test_hadamard_rotation_is_orthogonal_seeded_and_invertible():
    rng = np.random.default_rng(0)
    x = rng.normal(size=256)
    y = hadamard_rotate(x, rotation_seed=5)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-13)
    assert np.allclose(inverse_hadamard_rotate(y, rotation_seed=5), x, atol=1e-12)
    assert np.array_equal(y, hadamard_rotate(x, rotation_seed=5))  # public: reproducible
    assert not np.allclose(y, hadamard_rotate(x, rotation_seed=6))
    # a basis vector is spread evenly: every coordinate +-1/sqrt(d) (the point of rotating)
    e = np.zeros(256)
    e[3] = 1.0
    assert np.allclose(np.abs(hadamard_rotate(e, rotation_seed=1)), 1 / 16)
    # the matrix is H D / sqrt(d) with H Sylvester's Hadamard matrix
    h = np.array([[1.0]])
    while h.shape[0] < 8:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(9).integers(0, 2, size=8) * 2.0 - 1.0
    z = rng.normal(size=8)
    assert np.allclose(hadamard_rotate(z, rotation_seed=9), h @ (signs * z) / math.sqrt(8))


@pytest.mark.parametrize("bad", [np.zeros(3), np.zeros((2, 2)), np.zeros(0)])
def test_rotation_refuses_lengths_that_are_not_powers_of_two(bad):
    with pytest.raises(InvalidParameterError, match="^x must be"):
        hadamard_rotate(bad, rotation_seed=0)


# ------------------------------------------------------------------ conditional rounding
def test_conditional_rounding_is_unbiased_when_the_bound_is_loose():
    x = np.array([0.25, -1.5, 3.75, 0.0, 2.0])
    rng = np.random.default_rng(1)
    draws = np.stack([conditional_round(x, 10**6, rng=rng)[0] for _ in range(20000)])
    assert set(np.unique(draws[:, 3])) == {0} and set(np.unique(draws[:, 4])) == {2}
    assert np.all(np.abs(draws - x) < 1)
    # 20000 draws of a Bernoulli(f) shifted: 5 sigma of f(1-f) / n
    assert np.all(np.abs(draws.mean(0) - x) < 5 * 0.5 / math.sqrt(20000))


def _half_vector(d: int, a: int) -> np.ndarray:
    return np.full(d, a + 0.5)


def test_retry_probability_matches_the_exact_binomial_and_is_below_beta():
    """x = (a + 1/2, ...): each coordinate rounds to a or a + 1 with probability 1/2, so
    ||x~||^2 = d a^2 + (2a + 1) K with K ~ Binomial(d, 1/2): the probability that one try
    exceeds T is a binomial tail, which must be <= beta (Kairouz et al.'s bound) and match the
    observed rate of retries (false-failure rate < 1e-6: a 5-sigma band)."""
    d, a, beta = 64, 3, 0.5
    x = _half_vector(d, a)
    c = float(np.linalg.norm(x))
    t = rounded_norm_bound_sq(c, d, beta)
    kmax = (t - d * a * a) // (2 * a + 1)  # K <= kmax passes
    p_fail = float(stats.binom(d, 0.5).sf(kmax))
    assert 0.01 < p_fail <= beta
    rng = np.random.default_rng(2)
    tries = np.array([conditional_round(x, t, rng=rng)[1] for _ in range(20000)])
    first_fail = float(np.mean(tries > 1))
    assert abs(first_fail - p_fail) < 5 * math.sqrt(p_fail * (1 - p_fail) / tries.size)
    assert tries.mean() == pytest.approx(1 / (1 - p_fail), rel=0.05)
    # a mutant bound without Kairouz et al.'s slack (T = ||x||^2) would retry far more often
    assert float(stats.binom(d, 0.5).sf((int(c * c) - d * a * a) // (2 * a + 1))) > 0.4


@pytest.mark.parametrize("beta", [0.999, 0.5, 0.0])
def test_the_norm_bound_always_holds(beta):
    rng = np.random.default_rng(3)
    for trial in range(200):
        d = int(rng.choice([1, 2, 8, 64]))
        x = rng.normal(size=d) * rng.uniform(0.5, 30)
        t = rounded_norm_bound_sq(float(np.linalg.norm(x)) * (1 + 1e-12), d, beta)
        for tries in (0, 1, 100):
            v, used = conditional_round(x, t, rng=rng, max_tries=tries)
            assert int(v @ v) <= t, (trial, beta, tries)
            assert used <= tries + 1


def test_fallback_rounds_towards_zero_and_zeros_as_a_last_resort():
    x = np.array([2.5, -2.5])
    v, used = conditional_round(x, 8, rng=np.random.default_rng(0), max_tries=0)
    assert v.tolist() == [2, -2] and used == 1
    v, _ = conditional_round(x, 7, rng=np.random.default_rng(0), max_tries=0)
    assert v.tolist() == [0, 0]


def test_encoded_updates_respect_the_sensitivity():
    """With the noise off, every client's encoded vector is its rounded update: its squared
    norm (centred) is <= T for updates of any size, including non-finite ones."""
    m = mech(noise_per_client=1.0, granularity=0.05, beta=0.9, _noise=False)
    rng = np.random.default_rng(4)
    t = m.norm_bound_sq
    for scale in (1e-3, 0.3, 1.0, 50.0):
        for _ in range(20):
            v = center_modular(m.encode(rng.normal(size=100) * scale, rng=rng,
                                        rotation_seed=int(rng.integers(2**31))), m.bits)
            assert int(v @ v) <= t
    bad = np.full(100, np.nan)
    assert not center_modular(m.encode(bad, rng=rng, rotation_seed=1), m.bits).any()
    huge = np.full(100, 1e300)  # its float64 norm overflows; clipped all the same
    v = center_modular(m.encode(huge, rng=rng, rotation_seed=1), m.bits)
    assert 0.9 * m.scaled_clip**2 < int(v @ v) <= t


# ------------------------------------------------------------------ modular sums
def test_secure_sum_is_exact_under_wraparound():
    """1000 clients whose residues sit near +-m/2: the partial sums wrap hundreds of times,
    and the centred total is exactly the integer sum (Python integers as the reference)."""
    bits, m = 8, 256
    rng = np.random.default_rng(5)
    ints = rng.choice([-128, -127, 126, 127], size=(1000, 16)).astype(np.int64)
    ints[:, 0] = np.where(np.arange(1000) % 2, 127, -127)  # this column sums to 0 exactly
    enc = [np.mod(row, m).astype(np.uint64) for row in ints]
    total = secure_sum(enc, bits)
    ref = [sum(int(v) for v in col) % m for col in ints.T]
    assert total.tolist() == ref
    assert center_modular(total, bits)[0] == 0
    small = ints[:, 0][:, None] + np.zeros((1, 4), dtype=np.int64)
    assert center_modular(secure_sum([np.mod(r, m).astype(np.uint64) for r in small], bits),
                          bits).tolist() == [0, 0, 0, 0]


def test_secure_sum_at_62_bits_does_not_overflow():
    bits = 62
    m = 1 << bits
    vals = [np.array([m - 1, m // 2, 1], dtype=np.uint64)] * 5
    assert secure_sum(vals, bits).tolist() == [(5 * (m - 1)) % m, (5 * (m // 2)) % m, 5]
    assert center_modular(np.array([m - 1, m // 2], dtype=np.uint64), bits).tolist() == \
        [-1, -(m // 2)]


def test_decoded_sum_wraps_when_the_true_sum_leaves_the_range():
    """Wrap-around is the decoded sum shifted by a multiple of m, a utility failure."""
    m = mech(bits=4, granularity=1.0, l2_clip_norm=3.0, dim=1, min_survivors=1, beta=0.0,
             _noise=False)
    enc = [m.encode(np.array([3.0]), rng=np.random.default_rng(0), rotation_seed=0)] * 3
    total = center_modular(m.secure_sum(enc), m.bits)
    assert int(total[0]) in (9 - 16, -9 + 16)  # +-9 wrapped into [-8, 8)


# ------------------------------------------------------------------ round trip
def test_round_trip_without_noise_has_the_analysed_rounding_error():
    """Zero noise: decode(secure_sum(encode)) is the mean of the clipped updates up to the
    rounding: each client moves each rotated coordinate by < 1 (so the L2 error is at most
    gamma n sqrt(d) / divisor, always) and by variance <= 1/4 (so the mean squared error per
    coordinate is <= gamma^2 n / (4 divisor^2) in expectation; checked with a factor 1.5 over
    5 rotations and 10 x 128 coordinates, false-failure rate < 1e-6)."""
    n, gamma = 10, 0.01
    m = mech(granularity=gamma, dim=100, min_survivors=n, _noise=False)
    rng = np.random.default_rng(6)
    ups = [rng.normal(size=100) * rng.uniform(0.01, 0.5) for _ in range(n)]
    ups[0] = ups[0] * 100  # clipped
    clipped = [u * min(1.0, 1.0 / np.linalg.norm(u)) for u in ups]
    true = np.sum(clipped, axis=0) / n
    sq = []
    for seed in range(5):
        enc = [m.encode(u, rng=rng, rotation_seed=seed) for u in ups]
        est = m.decode(m.secure_sum(enc), survivors=n, divisor=n, rotation_seed=seed)
        err = est - true
        assert np.linalg.norm(err) <= gamma * n * math.sqrt(128) / n
        sq.append(float(err @ err) / 100)
    bound = gamma**2 * n / 4 / n**2
    assert np.mean(sq) <= 1.5 * bound
    assert np.mean(sq) > 0.05 * bound  # the rounding does happen


def test_round_trip_keeps_trees_numpy_and_torch():
    m = mech(dim=13, min_survivors=2, _noise=False)
    tree = {"w": np.full((3, 4), 0.05, np.float32), "b": [torch.full((1,), -0.1)]}
    g = torch.Generator().manual_seed(0)
    enc = [m.encode(tree, rng=g, rotation_seed=3) for _ in range(2)]
    out = m.decode(m.secure_sum(enc), survivors=2, divisor=2, rotation_seed=3, like=tree)
    assert out["w"].dtype == np.float32 and out["w"].shape == (3, 4)
    assert isinstance(out["b"][0], torch.Tensor) and out["b"][0].dtype == torch.float32
    assert np.allclose(out["w"], 0.05, atol=0.03) and abs(float(out["b"][0]) + 0.1) < 0.03
    flat = m.decode(m.secure_sum(enc), survivors=2, divisor=2, rotation_seed=3)
    assert flat.dtype == np.float64 and flat.shape == (13,)


def test_torch_generator_is_reproducible():
    m = mech()
    u = np.linspace(-0.1, 0.1, 100)
    a = m.encode(u, rng=torch.Generator().manual_seed(7), rotation_seed=1)
    b = m.encode(u, rng=torch.Generator().manual_seed(7), rotation_seed=1)
    c = m.encode(u, rng=torch.Generator().manual_seed(8), rotation_seed=1)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


# ------------------------------------------------------------------ the noise of the sum
def _noise_of_sum(m: DistributedSkellam, clients: int, reps: int, rng) -> np.ndarray:
    """The centred integer sum of ``clients`` zero updates (pure noise), ``reps`` rounds."""
    zero = np.zeros(m.dim)
    out = []
    for r in range(reps):
        enc = [m.encode(zero, rng=rng, rotation_seed=r) for _ in range(clients)]
        out.append(center_modular(m.secure_sum(enc), m.bits))
    return np.concatenate(out)


def _poisson_mu(size, mu, *, rng):
    return np.random.default_rng(rng.integers(2**62)).poisson(mu, size).astype(np.int64)


def _skellam_half(size, mu, *, rng):
    return skellam_noise(size, mu / 2, rng=rng)


def _centred_poisson(size, mu, *, rng):
    return np.random.default_rng(rng.integers(2**62)).poisson(mu, size).astype(np.int64) - \
        int(mu)


WRONG_SAMPLERS = {"poisson(mu)": _poisson_mu, "skellam(mu/2)": _skellam_half,
                  "poisson(mu) - mu": _centred_poisson}
N_CLIENTS, MU = 20, 3.0


def test_the_sum_of_the_shares_is_skellam_n_mu():
    """The decoded integer noise of 20 clients' Skellam(3) shares is Skellam(60): chi-square
    over 40 rounds x 1024 coordinates, false-failure rate LEVEL = 1e-3. The wrong samplers of
    the next test fail it: Poisson(mu) (p ~ 0), Skellam(mu/2) (p ~ 0) and Poisson(mu) - mu,
    which has the right mean and variance but is skewed (p ~ 1e-11 at this size)."""
    m = mech(noise_per_client=MU, dim=1024, min_survivors=N_CLIENTS)
    x = _noise_of_sum(m, N_CLIENTS, 40, np.random.default_rng(10))
    law = stats.skellam(N_CLIENTS * MU / 2, N_CLIENTS * MU / 2)
    p = chi2_pvalue(x, law)
    assert p > LEVEL, p
    assert x.var() == pytest.approx(N_CLIENTS * MU, rel=0.05)


@pytest.mark.parametrize("name", sorted(WRONG_SAMPLERS))
def test_wrong_noise_samplers_fail_the_test(name, monkeypatch):
    monkeypatch.setattr(dist, "skellam_noise", WRONG_SAMPLERS[name])
    m = mech(noise_per_client=MU, dim=1024, min_survivors=N_CLIENTS)
    x = _noise_of_sum(m, N_CLIENTS, 40, np.random.default_rng(10))
    p = chi2_pvalue(x, stats.skellam(N_CLIENTS * MU / 2, N_CLIENTS * MU / 2))
    assert p < LEVEL, (name, p)


def test_secure_mode_sum_is_skellam_n_mu():
    """Secure mode (unseeded by design): the same test on 20 rounds, false-failure rate 1e-4
    per run."""
    m = mech(noise_per_client=MU, dim=1024, min_survivors=N_CLIENTS)
    x = _noise_of_sum(m, N_CLIENTS, 20, SecureRandom())
    p = chi2_pvalue(x, stats.skellam(N_CLIENTS * MU / 2, N_CLIENTS * MU / 2))
    assert p > 1e-4, p


# ------------------------------------------------------------------ exact Poisson (secure mode)
@pytest.mark.parametrize("lam", [0.3, 7.5, 1234.25])
@pytest.mark.parametrize("first_bits", [64, 3])
def test_exact_poisson_inversion_has_the_poisson_law(lam, first_bits):
    """Exact inversion fed seeded 64-bit words (first_bits = 3 decides almost every draw in
    the refinement loop, with 67, 131, ... bits). Chi-square, false-failure rate 1e-3 each."""
    x = exact_poisson(lam, 20000 if first_bits == 64 else 4000, words_of(int(lam * 4)),
                      first_bits=first_bits)
    assert x.dtype == np.int64 and x.min() >= 0
    assert chi2_pvalue(x, stats.poisson(lam)) > LEVEL


def test_exact_poisson_test_has_power():
    x = exact_poisson(1234.25, 20000, words_of(1))
    assert chi2_pvalue(x, stats.poisson(1234.25 * 1.02)) < LEVEL


def test_large_means_are_split_into_exact_parts(monkeypatch):
    """A mean above the table limit is drawn as 2^j Poisson(mean / 2^j) (an exact division):
    with the limit lowered to 64, Poisson(1000.5) is 16 parts of 62.53125; chi-square as
    above (false-failure rate 1e-3), and a sampler that dropped a part would fail it."""
    from privkit.mechanisms import _distributed_poisson as dp

    monkeypatch.setattr(dp, "TABLE_MAX_LAMBDA", 64.0)
    x = exact_poisson(1000.5, 20000, words_of(3))
    assert chi2_pvalue(x, stats.poisson(1000.5)) > LEVEL
    assert chi2_pvalue(x, stats.poisson(1000.5 * 15 / 16)) < LEVEL


def test_secure_skellam_refuses_noise_beyond_its_range():
    with pytest.raises(InvalidParameterError, match="^mu must be"):
        skellam_noise(3, 2.0**42, rng=SecureRandom())
    with pytest.raises(InvalidParameterError, match="^noise_per_client must be"):
        mech(noise_per_client=2.0**42).encode(np.zeros(100), rng=SecureRandom(), rotation_seed=0)
    assert skellam_noise(3, 2.0**42, rng=np.random.default_rng(0)).shape == (3,)


# ------------------------------------------------------------------ survivors and events
def test_rounds_below_min_survivors_are_refused():
    m = mech(min_survivors=3)
    rng = np.random.default_rng(11)
    enc = [m.encode(np.zeros(100), rng=rng, rotation_seed=0) for _ in range(3)]
    with pytest.raises(InvalidParameterError, match="^survivors must be >= min_survivors = 3"):
        m.secure_sum(enc[:2])
    total = m.secure_sum(enc)
    with pytest.raises(InvalidParameterError, match="^survivors must be"):
        m.decode(total, survivors=2, divisor=3, rotation_seed=0)
    assert m.check_survivors(3) == 3
    assert m.decode(total, survivors=3, divisor=3, rotation_seed=0).shape == (100,)


def test_event_carries_the_enforced_sensitivities_and_honest_shares():
    m = mech(min_survivors=10, colluders=3, sampling_probability=0.2)
    ev = m.event()
    t = rounded_norm_bound_sq(100.0, 128, math.exp(-0.5))
    assert m.norm_bound_sq == t
    assert (ev.l2_sensitivity, ev.l1_sensitivity) == (skellam_sensitivities(t, 128)[0],
                                                      float(skellam_sensitivities(t, 128)[1]))
    assert ev.survivors == 7 and ev.noise_per_client == 50.0 and ev.sampling_probability == 0.2
    assert m.event(NeighboringRelation.REPLACE_ONE) == ev == m.event("zero-out")
    with pytest.raises(InvalidParameterError, match="^neighboring_relation must be"):
        m.event("add-remove")
    un = m.unamplified_event(4)
    assert isinstance(un, SelfComposedDpEvent) and un.count == 4
    assert un.event == SkellamDpEvent(50.0, 7, ev.l2_sensitivity, ev.l1_sensitivity)
    # the sampled event is dominated by the unsampled one (joint convexity): never above it
    assert privkit.epsilon(un, 1e-5, neighboring_relation="zero-out").epsilon >= \
        privkit.epsilon(SelfComposedDpEvent(ev, 4), 1e-5, neighboring_relation="zero-out").epsilon


def test_a_ledger_charges_the_mechanism_under_zero_out_only():
    m = mech(noise_per_client=5e3, min_survivors=50)
    led = Ledger.create(None, population_id="p", delta=1e-5, neighboring_relation="zero-out")
    led.spend(["c"], m, label="round", round=0)
    eps = led.epsilons()["c"]
    assert eps == pytest.approx(privkit.epsilon(m.event(), 1e-5,
                                                neighboring_relation="zero-out").epsilon)
    add_remove = Ledger.create(None, population_id="p", delta=1e-5)
    with pytest.raises(InvalidParameterError, match="neighboring_relation"):
        add_remove.spend(["c"], m, label="round", round=0)


def test_secure_random_round_trip():
    m = mech(noise_per_client=2.0, min_survivors=2)
    rng = SecureRandom()
    u = np.linspace(-0.08, 0.08, 100)
    enc = [m.encode(u, rng=rng, rotation_seed=4) for _ in range(2)]
    est = m.decode(m.secure_sum(enc), survivors=2, divisor=2, rotation_seed=4)
    # noise sd per coordinate sqrt(2 * 2) * gamma / 2 = 0.01; 8 sd
    assert np.abs(est - u).max() < 0.08


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("name, value", [
    ("l2_clip_norm", 0.0), ("l2_clip_norm", math.nan), ("granularity", -1.0),
    ("granularity", 1e-12), ("noise_per_client", 0.0), ("noise_per_client", 2.0**52),
    ("bits", 1), ("bits", 63), ("bits", 16.5), ("dim", 0), ("min_survivors", 0),
    ("colluders", 3), ("colluders", -1), ("beta", 1.0), ("beta", -0.1),
    ("sampling_probability", 0.0), ("max_rounding_tries", 0), ("_noise", 1),
])
def test_bad_parameters_are_refused_by_name(name, value):
    with pytest.raises(InvalidParameterError) as err:
        mech(**{name: value})
    assert err.value.name == name


def test_bad_calls_are_refused_by_name():
    m = mech(min_survivors=1)
    rng = np.random.default_rng(0)
    cases = [
        (lambda: m.encode(np.zeros(99), rng=rng, rotation_seed=0), "update"),
        (lambda: m.encode(np.zeros(100, np.int64), rng=rng, rotation_seed=0), "update"),
        (lambda: m.encode(np.zeros(100), rng=None, rotation_seed=0), "rng"),
        (lambda: m.encode(np.zeros(100), rng=np.random.RandomState(0), rotation_seed=0), "rng"),
        (lambda: m.encode(np.zeros(100), rng=rng, rotation_seed=-1), "rotation_seed"),
        (lambda: m.decode(np.zeros(64, np.uint64), survivors=1, divisor=1, rotation_seed=0),
         "modular_sum"),
        (lambda: m.decode(np.full(128, 1 << 20, np.uint64), survivors=1, divisor=1,
                          rotation_seed=0), "modular_sum"),
        (lambda: m.decode(np.zeros(128, np.float64), survivors=1, divisor=1, rotation_seed=0),
         "modular_sum"),
        (lambda: m.decode(np.zeros(128, np.uint64), survivors=1, divisor=0, rotation_seed=0),
         "divisor"),
        (lambda: m.decode(np.zeros(128, np.uint64), survivors=1, divisor=1, rotation_seed=0,
                          like=np.zeros(5)), "like"),
        (lambda: secure_sum([], 8), "encoded"),
        (lambda: secure_sum(np.zeros((2, 3), np.uint64), 8), "encoded"),
        (lambda: secure_sum([np.zeros(2, np.uint64), np.zeros(3, np.uint64)], 8), "encoded[1]"),
        (lambda: secure_sum([np.array([-1, 0])], 8), "encoded[0]"),
        (lambda: secure_sum([np.zeros(2, np.uint64)], 63), "bits"),
        (lambda: conditional_round(np.array([np.inf]), 4, rng=rng), "x"),
        (lambda: conditional_round(np.array([1.0]), -1, rng=rng), "norm_bound_sq"),
        (lambda: skellam_noise(3, -1.0, rng=rng), "mu"),
    ]
    for call, name in cases:
        with pytest.raises(InvalidParameterError) as err:
            call()
        assert err.value.name == name


def test_private_noise_knob_changes_no_claim():
    m = mech()
    quiet = dataclasses.replace(m, _noise=False)
    assert quiet.event() == m.event()
    assert "_noise" not in repr(quiet)
