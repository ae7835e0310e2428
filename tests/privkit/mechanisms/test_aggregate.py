"""Client-level DP-FedAvg aggregate: clip bound, noise scale, the event it emits, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

import privkit
from privkit.errors import InvalidParameterError
from privkit.events import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from privkit.mechanisms import AdaptiveClipping, ClientLevelGaussian, l2_norm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_noise_on_zero_updates_has_stddev_z_times_c():
    """Zero updates: the output is pure noise; its stddev is z C (chi-square test of variance)."""
    agg = ClientLevelGaussian(l2_clip_norm=2.5, noise_multiplier=0.7)
    rng = np.random.default_rng(1)
    draws = np.stack([agg({"w": np.zeros((4, 50))}, rng=rng)["w"] for _ in range(400)])
    x = draws.reshape(-1)
    n = x.size
    s2 = float(np.sum(x * x))  # mean is known to be 0
    target = agg.stddev**2
    assert agg.stddev == pytest.approx(1.75)
    p_low = stats.chi2.cdf(s2 / target, n)
    assert 1e-4 < p_low < 1 - 1e-4, (math.sqrt(s2 / n), agg.stddev)
    assert abs(float(x.mean())) < 5 * agg.stddev / math.sqrt(n)


def test_a_mutant_with_noise_per_client_would_fail_the_variance_test():
    """The variance test above detects K-fold noise (noise per client instead of once)."""
    agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1.0)
    rng = np.random.default_rng(2)
    k = 4
    x = rng.normal(0.0, math.sqrt(k) * agg.stddev, size=400 * 50)
    assert stats.chi2.cdf(float(np.sum(x * x)) / agg.stddev**2, x.size) > 1 - 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_each_client_contributes_at_most_c(device):
    """Sum with tiny noise: every client's share has norm <= C, over the whole tree."""
    c = 1.0
    agg = ClientLevelGaussian(l2_clip_norm=c, noise_multiplier=1e-12)
    g = torch.Generator(device=device).manual_seed(0)
    big = {"a": torch.full((3, 10), 7.0, device=device), "b": torch.full((3, 2), -3.0,
                                                                              device=device)}
    clipped = agg.clip(big)
    norms = [float(l2_norm({k: v[i] for k, v in clipped.items()})) for i in range(3)]
    assert max(norms) <= c
    assert min(norms) == pytest.approx(c, rel=1e-6)
    out = agg(big, rng=g)
    # three clipped rows in the same direction: the sum has norm 3C, not 3 * ||raw||
    assert float(l2_norm(out)) == pytest.approx(3 * c, rel=1e-6)
    assert out["a"].device.type == torch.device(device).type and out["a"].shape == (10,)


def test_small_updates_pass_unclipped_and_weights_scale_them():
    agg = ClientLevelGaussian(l2_clip_norm=10.0, noise_multiplier=1e-12)
    u = np.array([[1.0, 0.0], [0.0, 2.0]])
    out = agg({"w": u}, rng=np.random.default_rng(0), weights=[0.5, 1.0])
    np.testing.assert_allclose(out["w"], [0.5, 2.0], atol=1e-9)


def test_no_sampled_client_still_draws_noise():
    """K = 0: the release exists, so it is noise of the full scale, not zeros or an error."""
    agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1.0, sampling_probability=0.1)
    out = agg({"w": np.zeros((0, 1000))}, rng=np.random.default_rng(3))
    assert out["w"].shape == (1000,)
    assert 0.9 < float(np.std(out["w"])) < 1.1


def test_event_is_the_one_priced_and_amplification_only_when_sampled():
    sampled = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1.1,
                                  sampling_probability=0.05)
    assert sampled.event() == PoissonSampledDpEvent(0.05, GaussianDpEvent(1.1))
    full = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1.1)
    assert full.event() == GaussianDpEvent(1.1)
    assert sampled.neighboring_relation == privkit.NeighboringRelation.ADD_OR_REMOVE_ONE
    e_s = privkit.epsilon(SelfComposedDpEvent(sampled.event(), 100), 1e-5,
                          neighboring_relation=sampled.neighboring_relation).epsilon
    e_f = privkit.epsilon(SelfComposedDpEvent(full.event(), 100), 1e-5,
                          neighboring_relation=full.neighboring_relation).epsilon
    assert e_s < e_f / 5


def test_epsilon_matches_dp_accounting_directly():
    """The round event priced by privkit and by dp-accounting's PLD agree (privkit <= +1%)."""
    from dp_accounting.dp_event import GaussianDpEvent as DpaG
    from dp_accounting.dp_event import PoissonSampledDpEvent as DpaP
    from dp_accounting.dp_event import SelfComposedDpEvent as DpaS
    from dp_accounting.pld import pld_privacy_accountant

    agg = ClientLevelGaussian(l2_clip_norm=0.5, noise_multiplier=1.0, sampling_probability=0.05)
    ours = privkit.epsilon(SelfComposedDpEvent(agg.event(), 500), 1e-5,
                           neighboring_relation=agg.neighboring_relation).epsilon
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(DpaS(DpaP(0.05, DpaG(1.0)), 500))
    theirs = acc.get_epsilon(1e-5)
    assert theirs * 0.99 <= ours <= theirs * 1.01


def test_mean_divides_by_the_fixed_expected_count():
    out = ClientLevelGaussian.mean({"w": np.array([2.0, 4.0])}, expected_clients=2.0)
    np.testing.assert_allclose(out["w"], [1.0, 2.0])
    with pytest.raises(InvalidParameterError, match="expected_clients"):
        ClientLevelGaussian.mean({"w": np.ones(2)}, expected_clients=0.0)


@pytest.mark.parametrize("kwargs, name", [
    ({"l2_clip_norm": 0.0, "noise_multiplier": 1.0}, "l2_clip_norm"),
    ({"l2_clip_norm": -1.0, "noise_multiplier": 1.0}, "l2_clip_norm"),
    ({"l2_clip_norm": float("nan"), "noise_multiplier": 1.0}, "l2_clip_norm"),
    ({"l2_clip_norm": 1.0, "noise_multiplier": float("inf")}, "noise_multiplier"),
    ({"l2_clip_norm": 1.0, "noise_multiplier": 1.0, "sampling_probability": 0.0},
     "sampling_probability"),
    ({"l2_clip_norm": 1.0, "noise_multiplier": 1.0, "sampling_probability": 1.5},
     "sampling_probability"),
])
def test_bad_parameters_name_the_argument(kwargs, name):
    with pytest.raises(InvalidParameterError, match=name):
        ClientLevelGaussian(**kwargs)


def test_bad_updates_and_weights_name_the_argument():
    agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1.0)
    rng = np.random.default_rng(0)
    with pytest.raises(InvalidParameterError, match="client"):
        agg({"a": np.zeros((2, 3)), "b": np.zeros((3, 3))}, rng=rng)
    with pytest.raises(InvalidParameterError, match="weights"):
        agg({"a": np.zeros((2, 3))}, rng=rng, weights=[0.5, 1.5])
    with pytest.raises(InvalidParameterError, match="weights"):
        agg({"a": np.zeros((2, 3))}, rng=rng, weights=[0.5])
    with pytest.raises(InvalidParameterError):
        agg({"a": np.array([[np.nan, 0.0]])}, rng=rng)


def test_adaptive_clipping_moves_towards_the_quantile_and_prices_its_count():
    ac = AdaptiveClipping(target_quantile=0.5, learning_rate=0.2, count_stddev=1e-9,
                          sampling_probability=0.1)
    norms = np.linspace(0.1, 10.0, 100)  # median ~5
    c = 1.0
    rng = np.random.default_rng(0)
    for _ in range(200):
        c = ac.update(c, norms, expected_clients=100, rng=rng)
    assert 4.0 < c < 6.0
    assert ac.event() == PoissonSampledDpEvent(0.1, GaussianDpEvent(1e-9))
    with pytest.raises(InvalidParameterError, match="target_quantile"):
        AdaptiveClipping(target_quantile=1.0)
    with pytest.raises(InvalidParameterError, match="norms"):
        ac.update(1.0, [float("nan")], expected_clients=1, rng=rng)
