"""Client-level DP-FedAvg aggregate: clip bound, noise scale, the event it emits, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dp_accounting.dp_event import GaussianDpEvent as DpaG
from dp_accounting.dp_event import PoissonSampledDpEvent as DpaP
from dp_accounting.dp_event import SelfComposedDpEvent as DpaS
from dp_accounting.pld import pld_privacy_accountant
from scipy import stats

import privkit
from privkit.errors import InvalidParameterError
from privkit.events import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from privkit.events.mechanisms import NeighboringRelation
from privkit.mechanisms import (
    AdaptiveClipping,
    ClientLevelGaussian,
    NonFiniteUpdates,
    floating_state,
    l2_norm,
    unamplified_event,
)

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
    with pytest.raises(InvalidParameterError, match=r"updates\['a'\]\[0\]"):
        ClientLevelGaussian(1.0, 1.0, nonfinite=NonFiniteUpdates.RAISE)(
            {"a": np.array([[np.nan, 0.0]])}, rng=rng)
    with pytest.raises(InvalidParameterError, match="nonfinite"):
        ClientLevelGaussian(1.0, 1.0, nonfinite="zero")


def test_a_non_finite_update_contributes_zeros_and_no_error():
    """The default: an error naming the client would reveal that it was sampled."""
    agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1e-12)
    ups = {"a": np.array([[np.nan, 1.0], [3.0, 4.0]]), "b": np.array([[0.0], [0.0]])}
    out = agg(ups, rng=np.random.default_rng(0))
    np.testing.assert_allclose(out["a"], [0.6, 0.8], atol=1e-9)  # only the finite client
    t = {"a": torch.tensor([[1.0, float("inf")], [0.0, 2.0]])}
    out_t = agg(t, rng=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out_t["a"], torch.tensor([0.0, 1.0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_finite_rows_whose_sum_overflows_are_kept_and_every_bad_row_is_zeroed(backend):
    """The finiteness check sums each row first: a row of finite entries whose float32 sum
    overflows must still count as finite (clipped, not zeroed), and a row with inf, -inf
    and NaN together (a sum of NaN) or one infinity is zeroed."""
    big = np.float32(3e38)
    rows = np.array([[big, big, 0.0],  # finite, sum overflows to inf
                     [np.inf, -np.inf, 1.0],  # sum NaN
                     [0.0, 3.0, 4.0],
                     [1.0, np.nan, 0.0],
                     [-big, -big, -big]], dtype=np.float32)
    agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1e-30)
    leaf = rows if backend == "numpy" else torch.from_numpy(rows)
    rng = np.random.default_rng(0) if backend == "numpy" else torch.Generator().manual_seed(0)
    clipped = np.asarray(agg.clip({"u": leaf})["u"], dtype=np.float64)
    norms = np.linalg.norm(clipped, axis=1)
    np.testing.assert_allclose(norms[[0, 2, 4]], 1.0, rtol=1e-6)  # kept and clipped
    assert norms[1] == 0.0 and norms[3] == 0.0  # zeroed
    out = np.asarray(agg({"u": leaf}, rng=rng)["u"], dtype=np.float64)
    np.testing.assert_allclose(out, clipped.sum(0), atol=1e-6)


@pytest.mark.parametrize("shape", [(0, 3), (1, 5), (7,), (20, 610), (3, 4, 5), (2000, 9)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_the_float64_row_sum_is_exactly_torchs(shape, dtype):
    """The sum over the client axis (numpy, buffered float64) equals torch's float64 sum bit
    for bit, contiguous or not."""
    from privkit.mechanisms.aggregate import _sum_rows

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    for leaf in (x, x.transpose(0, -1).contiguous().transpose(0, -1) if x.dim() > 1 else x):
        ref = leaf.to(torch.float64).sum(0)
        got = _sum_rows(leaf, None)
        assert got.dtype == torch.float64 and got.shape == ref.shape
        assert torch.equal(got, ref)


def test_a_list_of_per_client_trees_is_refused_and_stack_builds_the_tree():
    agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1.0)
    rng = np.random.default_rng(0)
    per_client = [{"w": np.ones((3, 2)), "b": np.ones(3)} for _ in range(3)]
    with pytest.raises(InvalidParameterError, match=r"stack\(list_of_trees\)"):
        agg(per_client, rng=rng)  # the leaves share a leading size 3: rows are not clients
    with pytest.raises(InvalidParameterError, match="stack"):
        agg.clip(tuple(per_client))
    stacked = ClientLevelGaussian.stack(per_client)
    assert stacked["w"].shape == (3, 3, 2) and stacked["b"].shape == (3, 3)
    assert agg(stacked, rng=rng)["w"].shape == (3, 2)
    tt = ClientLevelGaussian.stack([{"w": torch.ones(2)}, {"w": torch.zeros(2)}])
    assert tt["w"].shape == (2, 2) and isinstance(tt["w"], torch.Tensor)
    empty = ClientLevelGaussian.stack([], like={"w": torch.zeros(2, 5)})
    assert empty["w"].shape == (0, 2, 5)
    assert agg(empty, rng=torch.Generator().manual_seed(0))["w"].shape == (2, 5)
    with pytest.raises(InvalidParameterError, match="like"):
        ClientLevelGaussian.stack([])
    with pytest.raises(InvalidParameterError, match="structure"):
        ClientLevelGaussian.stack([{"w": np.ones(2)}, {"v": np.ones(2)}])
    with pytest.raises(InvalidParameterError, match="shape"):
        ClientLevelGaussian.stack([{"w": np.ones(2)}, {"w": np.ones(3)}])
    with pytest.raises(InvalidParameterError, match="floating_state"):
        ClientLevelGaussian.stack([{"w": np.ones(2), "n": np.array([1])}] * 2)
    state = {"w": torch.ones(2), "num_batches_tracked": torch.tensor(3)}
    assert list(floating_state(state)) == ["w"]
    assert len(ClientLevelGaussian.stack([floating_state(state)] * 2)["w"]) == 2


def test_replace_one_prices_the_same_noise_against_twice_the_sensitivity():
    agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=2.0, sampling_probability=0.1)
    ev = agg.event(NeighboringRelation.REPLACE_ONE)
    assert ev == agg.event() == PoissonSampledDpEvent(0.1, GaussianDpEvent(2.0))
    ro = privkit.epsilon(ev, 1e-5, neighboring_relation=NeighboringRelation.REPLACE_ONE).epsilon
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    ref = PLDAccountant(NeighboringRelation.REPLACE_ONE)  # stddev 2C against sensitivity 2C
    ref.compose(ev)
    assert ro == pytest.approx(ref.get_epsilon(1e-5), rel=2e-3)
    assert ro > privkit.epsilon(ev, 1e-5).epsilon
    e = privkit.epsilon(unamplified_event(1.0, 5), 1e-5).epsilon
    assert e == pytest.approx(11.48, abs=0.01)  # q 0.05, z 1, T 100: a client in 5 rounds


def test_adaptive_clipping_moves_towards_the_quantile():
    ac = AdaptiveClipping(target_quantile=0.5, learning_rate=0.2, count_stddev=1e-9,
                          sampling_probability=0.1)
    norms = np.linspace(0.1, 10.0, 100)  # median ~5
    c = 1.0
    rng = np.random.default_rng(0)
    for _ in range(200):
        c = ac.update(c, norms, expected_clients=100, rng=rng)
    assert 4.0 < c < 6.0
    with pytest.raises(InvalidParameterError, match="target_quantile"):
        AdaptiveClipping(target_quantile=1.0)
    # a non-finite norm counts as above the clip norm (no error that would name a client)
    ac2 = AdaptiveClipping(target_quantile=0.5, learning_rate=1.0, count_stddev=1e-12)
    up = ac2.update(1.0, [float("nan"), 0.5], expected_clients=2, rng=rng)
    assert up == pytest.approx(1.0)  # one of two below: fraction 1/2 = the target


def test_adaptive_clipping_is_one_release_with_the_sum_and_priced_jointly():
    """The issue's run: q 0.02 over 1000 clients, z 1.1, count stddev qN/20 = 1, 10 rounds.
    The count and the sum use the same sample: one Gaussian with sensitivities (C, 1/2)."""
    q, z, rounds = 0.02, 1.1, 10
    mech = ClientLevelGaussian(1.0, z, q)
    ac = AdaptiveClipping(0.5, count_stddev=q * 1000 / 20, sampling_probability=q)
    z_eff = (z ** -2 + (2 * 1.0) ** -2) ** -0.5
    ev = ac.round_event(mech)
    assert ev == PoissonSampledDpEvent(q, GaussianDpEvent(pytest.approx(z_eff, rel=1e-12)))
    ours = privkit.epsilon(SelfComposedDpEvent(ev, rounds), 1e-5).epsilon
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(DpaS(DpaP(q, DpaG(z_eff)), rounds))
    theirs = acc.get_epsilon(1e-5)
    assert ours >= theirs * (1 - 1e-3)
    # the old charge (two independently sampled events) was below the joint price
    separate = privkit.epsilon(privkit.ComposedDpEvent([
        SelfComposedDpEvent(mech.event(), rounds),
        SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(2.0)), rounds)]),
        1e-5).epsilon
    assert separate < theirs * 0.9
    # the same event under replace-one; pricing it there doubles both sensitivities
    ro = ac.round_event(mech, NeighboringRelation.REPLACE_ONE)
    assert ro == ac.round_event(mech)
    assert privkit.epsilon(ro, 1e-5, neighboring_relation=NeighboringRelation.REPLACE_ONE
                           ).epsilon > privkit.epsilon(ro, 1e-5).epsilon
    with pytest.raises(InvalidParameterError, match="sampling_probability"):
        ac.round_event(ClientLevelGaussian(1.0, z, 0.5))


def test_adaptive_clipping_sensitivity_of_the_joint_release_is_one_over_z_eff():
    """Pre-noise, scaled by each part's noise: adding one client moves the pair by <= 1/z_eff."""
    rng = np.random.default_rng(3)
    c, z, sb = 1.0, 0.8, 0.7
    ac = AdaptiveClipping(0.5, count_stddev=sb)
    mech = ClientLevelGaussian(c, z)
    for _ in range(50):
        ups = rng.normal(size=(6, 4)) * rng.uniform(0.1, 3.0, size=(6, 1))

        def release(rows, ups=ups):
            clipped = mech.clip({"u": ups[rows]})["u"]
            norms = np.linalg.norm(ups[rows], axis=1)
            count = np.where(norms <= c, 0.5, -0.5).sum()
            return np.concatenate([clipped.sum(0) / (z * c), [count / sb]])

        move = np.linalg.norm(release(list(range(6))) - release(list(range(5))))
        assert move <= 1 / ac.joint_noise_multiplier(z) * (1 + 1e-9)


def test_adaptive_clipping_refuses_a_joint_noise_its_count_cannot_leave_room_for():
    ac = AdaptiveClipping(0.5, count_stddev=0.5)  # the count alone: multiplier 1.0
    with pytest.raises(InvalidParameterError, match="noise_multiplier"):
        ac.sum_noise_multiplier(1.0)
    assert ac.sum_noise_multiplier(0.5) == pytest.approx((0.5 ** -2 - 1.0) ** -0.5)
