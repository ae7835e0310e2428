"""Banded MF / tree correlated noise: strategies, streaming against the dense C^-1 Z, the
covariance the factorisation implies (and mutants that must fail it), state size and
checkpoints, the b = 1 case against DP-FedAvg's aggregate, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.linalg import solve_triangular

from privkit.errors import InvalidParameterError
from privkit.mechanisms import (
    BandedToeplitzStrategy,
    BandMF,
    BandMFState,
    ClientLevelGaussian,
    NonFiniteUpdates,
    SecureRandom,
    TreeStrategy,
    gaussian_noise,
    l2_norm,
)
from privkit.mechanisms import _bandmf_strategies as strategies_module

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
STRATEGIES = [
    BandedToeplitzStrategy.identity(),
    BandedToeplitzStrategy.square_root(2),
    BandedToeplitzStrategy((1.5, -0.4, 0.3, 0.1, -0.05)),  # signed: the recurrence is generic
    TreeStrategy(),
]


def _prefix_matrix(t: int, momentum: float = 0.0) -> np.ndarray:
    i, j = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
    n = (i - j).astype(np.float64)
    if momentum == 0:
        return np.tril(np.ones((t, t)))
    return np.where(i >= j, (1 - momentum ** (n + 1)) / (1 - momentum), 0.0)


# --------------------------------------------------------------------------- strategies
def test_optimized_coefficients_are_deterministic_monotone_unit_norm_and_better():
    raw = strategies_module._optimized_coefficients.__wrapped__  # bypass the cache
    a, b = raw(8, 200, 0.0), raw(8, 200, 0.0)
    assert a == b
    s = BandedToeplitzStrategy(a)
    assert s.monotone and s.num_bands == 8
    assert s.column_norm == pytest.approx(1.0, rel=1e-12)
    sqrt = BandedToeplitzStrategy.square_root(8)
    ident = BandedToeplitzStrategy.identity()
    assert s.workload_error(200) < sqrt.workload_error(200) < ident.workload_error(200)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_workload_error_matches_the_dense_computation(momentum):
    t = 40
    a = _prefix_matrix(t, momentum)
    for strategy in (BandedToeplitzStrategy.optimized(5, t, momentum=momentum), TreeStrategy()):
        dense = np.linalg.norm(a @ np.linalg.inv(strategy.matrix(t))) / math.sqrt(t)
        assert strategy.workload_error(t, momentum=momentum) == pytest.approx(dense, rel=1e-10)


def test_the_momentum_optimum_is_better_for_the_momentum_workload():
    plain = BandedToeplitzStrategy.optimized(6, 300)
    mom = BandedToeplitzStrategy.optimized(6, 300, momentum=0.9)
    assert mom.workload_error(300, momentum=0.9) < plain.workload_error(300, momentum=0.9)
    assert plain.workload_error(300) < mom.workload_error(300)


def test_the_loss_gradient_matches_finite_differences():
    c = np.array([1.0, 0.7, 0.4, 0.35])
    den = strategies_module._workload_denominator(0.5)
    f, g = strategies_module._loss_and_gradient(c, 30, den)
    num = np.empty_like(c)
    for j in range(c.size):
        e = np.zeros_like(c)
        e[j] = 1e-6
        num[j] = (strategies_module._loss_and_gradient(c + e, 30, den)[0]
                  - strategies_module._loss_and_gradient(c - e, 30, den)[0]) / 2e-6
    np.testing.assert_allclose(g, num, rtol=1e-6)
    dense = np.linalg.norm(_prefix_matrix(30, 0.5) @ np.linalg.inv(
        BandedToeplitzStrategy(tuple(c)).matrix(30))) ** 2 * float(c @ c)
    assert f == pytest.approx(dense, rel=1e-12)


def test_tree_matrix_is_the_online_tree():
    t = 13
    c = TreeStrategy().matrix(t)
    decoder = _prefix_matrix(t) @ np.linalg.inv(c)  # which nodes each prefix sum adds
    np.testing.assert_allclose(decoder, np.round(decoder), atol=1e-12)
    assert set(np.unique(np.round(decoder))) <= {0.0, 1.0}
    assert [int(v) for v in np.round(decoder).sum(1)] == [k.bit_count() for k in range(1, t + 1)]


def test_toeplitz_matrix_is_banded_lower_triangular():
    c = BandedToeplitzStrategy((2.0, 1.0, 0.5)).matrix(6)
    assert c[3, 1] == 0.5 and c[3, 0] == 0.0 and c[2, 2] == 2.0 and not np.triu(c, 1).any()


# --------------------------------------------------------------------------- streaming
def _run_noise(mech: BandMF, like, rounds: int, rng) -> list:
    state, out = mech.initial_state(), []
    for _ in range(rounds):
        noise, state = mech.noise(like, state, rng=rng)
        out.append(noise)
    return out


def _flat(tree) -> np.ndarray:
    parts = []
    for k in sorted(tree):
        v = tree[k]
        parts.append((v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v)
                     .astype(np.float64).ravel())
    return np.concatenate(parts)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
def test_streaming_equals_dense_numpy(strategy):
    t, like = 11, {"a": np.zeros((3, 2)), "b": np.zeros(4)}
    mech = BandMF(strategy, l2_clip_norm=0.5, noise_multiplier=3.0)
    y = np.stack([_flat(n) for n in _run_noise(mech, like, t, np.random.default_rng(7))])
    replay = np.random.default_rng(7)
    z = np.stack([_flat(gaussian_noise(like, mech.stddev, rng=replay)) for _ in range(t)])
    dense = solve_triangular(strategy.matrix(t), z, lower=True)
    np.testing.assert_allclose(y, dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
def test_streaming_equals_dense_torch(strategy, device):
    t = 9
    like = {"w": torch.zeros(5, dtype=torch.float64, device=device),
            "v": torch.zeros((2, 2), dtype=torch.float64, device=device)}
    mech = BandMF(strategy, l2_clip_norm=1.0, noise_multiplier=2.0)
    out = _run_noise(mech, like, t, torch.Generator(device=device).manual_seed(3))
    assert out[0]["w"].device.type == torch.device(device).type
    y = np.stack([_flat(n) for n in out])
    replay = torch.Generator(device=device).manual_seed(3)
    z = np.stack([_flat(gaussian_noise(like, mech.stddev, rng=replay)) for _ in range(t)])
    dense = solve_triangular(strategy.matrix(t), z, lower=True)
    np.testing.assert_allclose(y, dense, rtol=1e-11, atol=1e-11)


def test_float32_leaves_get_float32_noise_from_the_float64_recurrence():
    mech = BandMF(BandedToeplitzStrategy.square_root(3), 1.0, 1.0)
    a = _run_noise(mech, {"w": np.zeros(4, np.float32)}, 5, np.random.default_rng(0))
    b = _run_noise(mech, {"w": np.zeros(4)}, 5, np.random.default_rng(0))
    assert a[-1]["w"].dtype == np.float32
    np.testing.assert_array_equal(a[-1]["w"], b[-1]["w"].astype(np.float32))


def test_secure_random_drives_the_same_recurrence():
    mech = BandMF(BandedToeplitzStrategy.square_root(3), 1.0, 1.0)
    out = _run_noise(mech, {"w": np.zeros(6)}, 4, SecureRandom())
    assert all(n["w"].shape == (6,) and np.isfinite(n["w"]).all() for n in out)


# --------------------------------------------------------------------------- covariance
#: False-failure rate of the covariance test for a correct generator (over seeds).
ALPHA = 1e-4


def _covariance_p_value(y: np.ndarray, strategy, stddev: float) -> float:
    """y: (T, n) noise of n independent coordinates. Whitened by the factorisation
    (W = C y / stddev must be i.i.d. N(0, 1)), the likelihood-ratio statistic for
    Cov(W) = I with known zero mean, n (tr S - log det S - T), is chi-square with
    T (T + 1) / 2 degrees of freedom (Bartlett-corrected); returns its p-value."""
    t, n = y.shape
    w = strategy.matrix(t) @ y / stddev
    s = w @ w.T / n
    stat = n * (np.trace(s) - np.linalg.slogdet(s)[1] - t)
    stat *= 1 - (2 * t * t + 3 * t - 1) / (6 * n * (t + 1))  # Bartlett's correction
    return float(stats.chi2.sf(stat, t * (t + 1) / 2))


def _forgetful(strategy, stddev, t, n, rng):
    """A wrong generator: independent noise each round (forgets the recurrence)."""
    c0 = strategy.matrix(1)[0, 0]
    return np.stack([rng.standard_normal(n) * stddev / c0 for _ in range(t)])


def _reversed_recurrence(strategy, stddev, t, n, rng):
    """A wrong generator: the recurrence with the past outputs in the wrong order."""
    c = strategy.coefficients
    ys: list[np.ndarray] = []
    for _ in range(t):
        y = rng.standard_normal(n) * stddev
        past = ys[-(len(c) - 1):] if len(c) > 1 else []
        for j, h in enumerate(past, start=1):  # oldest first: c_1 on y_(t-b+1), wrong
            y -= c[j] * h
        ys.append(y / c[0])
    return np.stack(ys)


@pytest.mark.parametrize("strategy", [BandedToeplitzStrategy.optimized(4, 10),
                                      BandedToeplitzStrategy((1.0, -0.6, 0.5)), TreeStrategy()],
                         ids=["optimized", "signed", "tree"])
def test_streaming_noise_has_the_implied_covariance(strategy):
    t, n = 10, 4000
    mech = BandMF(strategy, l2_clip_norm=1.5, noise_multiplier=0.8)
    y = np.stack([n_["w"] for n_ in _run_noise(mech, {"w": np.zeros(n)}, t,
                                               np.random.default_rng(11))])
    assert _covariance_p_value(y, strategy, mech.stddev) > ALPHA


@pytest.mark.parametrize("mutant", [_forgetful, _reversed_recurrence])
def test_a_wrong_generator_fails_the_covariance_test(mutant):
    strategy = BandedToeplitzStrategy.optimized(4, 10)
    y = mutant(strategy, 1.2, 10, 4000, np.random.default_rng(11))
    assert _covariance_p_value(y, strategy, 1.2) < ALPHA


def test_on_zero_updates_the_release_is_the_noise():
    mech = BandMF(BandedToeplitzStrategy.square_root(3), 1.0, 1.0)
    out, state = mech({"w": np.zeros((4, 3))}, mech.initial_state(), rng=np.random.default_rng(5))
    noise, _ = mech.noise({"w": np.zeros(3)}, mech.initial_state(), rng=np.random.default_rng(5))
    np.testing.assert_array_equal(out["w"], noise["w"])
    assert state.next_round == 1


# --------------------------------------------------------------------------- state
@pytest.mark.parametrize("bands", [1, 2, 5, 16])
def test_state_holds_b_minus_1_noise_trees_whatever_the_round(bands):
    mech = BandMF(BandedToeplitzStrategy.square_root(bands), 1.0, 1.0)
    like = {"w": np.zeros((3, 2)), "b": np.zeros(2)}  # d = 8
    state, rng = mech.initial_state(), np.random.default_rng(0)
    for t in range(1, 6 * bands + 3):
        _, state = mech.noise(like, state, rng=rng)
        assert len(state.history) == min(t, bands - 1) == mech.history_length(t)
        assert state.num_floats == 8 * min(t, bands - 1)


def test_tree_state_is_the_open_nodes():
    mech = BandMF(TreeStrategy(), 1.0, 1.0)
    state, rng = mech.initial_state(), np.random.default_rng(0)
    for t in range(1, 70):
        _, state = mech.noise({"w": np.zeros(2)}, state, rng=rng)
        assert len(state.history) == t.bit_count() <= t.bit_length()


@pytest.mark.parametrize("strategy", [BandedToeplitzStrategy.square_root(4), TreeStrategy()],
                         ids=["toeplitz", "tree"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_checkpointed_state_resumes_exactly(strategy, kind):
    if kind == "numpy":
        like = {"w": np.zeros(3), "b": np.zeros((2, 1), np.float32)}
        rng_a, rng_b = np.random.default_rng(4), np.random.default_rng(4)
    else:
        like = {"w": torch.zeros(3), "b": torch.zeros((2, 1), dtype=torch.float64)}
        rng_a, rng_b = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    mech = BandMF(strategy, 1.0, 1.0)
    straight = _run_noise(mech, like, 12, rng_a)
    state = mech.initial_state()
    for _ in range(7):
        _, state = mech.noise(like, state, rng=rng_b)
    tensors, meta = state.state_dict()
    assert set(meta) == {"next_round", "history"} and all(isinstance(v, int) for v in meta.values())
    # what a checkpoint holds: plain arrays (copies), re-read
    if kind == "numpy":
        saved = {k: np.array(v) for k, v in tensors.items()}
    else:
        saved = {k: v.clone().numpy() for k, v in tensors.items()}  # e.g. via safetensors
    state = mech.load_state(saved, dict(meta), like=like)
    for t in range(7, 12):
        noise, state = mech.noise(like, state, rng=rng_b)
        np.testing.assert_array_equal(_flat(noise), _flat(straight[t]))


@pytest.mark.parametrize("strategy", [BandedToeplitzStrategy.square_root(3), TreeStrategy()],
                         ids=["toeplitz", "tree"])
def test_states_are_values_the_output_never_aliases_them(strategy):
    """Editing a released noise in place, or reusing an old state, changes nothing."""
    mech = BandMF(strategy, 1.0, 1.0)
    like = {"w": np.zeros(4)}
    straight = _run_noise(mech, like, 6, np.random.default_rng(1))
    state, rng = mech.initial_state(), np.random.default_rng(1)
    for _ in range(3):
        noise, state = mech.noise(like, state, rng=rng)
        noise["w"] *= 100.0  # e.g. scaled by a learning rate in place
    again, _ = mech.noise(like, state, rng=np.random.default_rng(9))
    for t in range(3, 6):
        noise, state_next = mech.noise(like, state, rng=rng)
        if t == 3:
            replay, _ = mech.noise(like, state, rng=np.random.default_rng(9))
            np.testing.assert_array_equal(replay["w"], again["w"])  # the old state still works
        state = state_next
        np.testing.assert_array_equal(noise["w"], straight[t]["w"])


def test_load_state_refuses_what_does_not_fit():
    mech = BandMF(BandedToeplitzStrategy.square_root(3), 1.0, 1.0)
    like = {"w": np.zeros(2)}
    state = mech.initial_state()
    for _ in range(4):
        _, state = mech.noise(like, state, rng=np.random.default_rng(0))
    tensors, meta = state.state_dict()
    with pytest.raises(InvalidParameterError, match=r"meta\['history'\]"):
        mech.load_state(tensors, {**meta, "next_round": 1}, like=like)
    with pytest.raises(InvalidParameterError, match="tensors"):
        mech.load_state({**tensors, "history.9.0": np.zeros(2)}, meta, like=like)
    with pytest.raises(InvalidParameterError, match=r"history\.0\.0"):
        mech.load_state({**tensors, "history.0.0": np.zeros(3)}, meta, like=like)
    with pytest.raises(InvalidParameterError, match=r"history\.1\.0"):
        mech.load_state({**tensors, "history.1.0": np.zeros(2, np.float32)}, meta, like=like)
    with pytest.raises(InvalidParameterError, match="next_round"):
        mech.load_state(tensors, {**meta, "next_round": -1}, like=like)
    other = BandMF(TreeStrategy(), 1.0, 1.0)
    with pytest.raises(InvalidParameterError, match="state"):
        other.noise(like, state, rng=np.random.default_rng(0))  # 2 entries at round 4: not 1


# --------------------------------------------------------------------------- b = 1
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_identity_equals_dp_fedavgs_aggregate(kind):
    """b = 1: the same clipped sum and the same draws as ClientLevelGaussian, every round."""
    bandmf = BandMF(BandedToeplitzStrategy.identity(), l2_clip_norm=0.7, noise_multiplier=1.3)
    fedavg = ClientLevelGaussian(l2_clip_norm=0.7, noise_multiplier=1.3)
    data = np.random.default_rng(1).normal(size=(4, 3, 5))
    if kind == "numpy":
        rounds = [{"w": x} for x in data]
        rng_a, rng_b = np.random.default_rng(2), np.random.default_rng(2)
    else:
        rounds = [{"w": torch.from_numpy(x).float()} for x in data]
        rng_a, rng_b = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    state = bandmf.initial_state()
    for updates in rounds:
        ours, state = bandmf(updates, state, rng=rng_a)
        theirs = fedavg(updates, rng=rng_b)
        np.testing.assert_array_equal(_flat(ours), _flat(theirs))
    assert state.history == ()


# --------------------------------------------------------------------------- the aggregate
@pytest.mark.parametrize("device", DEVICES)
def test_each_client_contributes_at_most_the_clip_norm(device):
    mech = BandMF(BandedToeplitzStrategy.square_root(2), l2_clip_norm=1.0, noise_multiplier=1e-9)
    big = {"a": torch.full((3, 10), 7.0, device=device)}
    out, _ = mech(big, mech.initial_state(), rng=torch.Generator(device=device).manual_seed(0))
    assert float(l2_norm(out)) == pytest.approx(3.0, rel=1e-6)
    assert out["a"].device.type == torch.device(device).type and out["a"].shape == (10,)


def test_weights_nonfinite_and_empty_rounds():
    mech = BandMF(BandedToeplitzStrategy.identity(), l2_clip_norm=10.0, noise_multiplier=1e-12)
    s0 = mech.initial_state()
    u = np.array([[1.0, 0.0], [0.0, 2.0]])
    out, _ = mech({"w": u}, s0, rng=np.random.default_rng(0), weights=[0.5, 1.0])
    np.testing.assert_allclose(out["w"], [0.5, 2.0], atol=1e-9)
    bad = np.array([[np.nan, 1.0], [1.0, 1.0]])
    out, _ = mech({"w": bad}, s0, rng=np.random.default_rng(0))
    np.testing.assert_allclose(out["w"], [1.0, 1.0], atol=1e-9)  # the NaN client is zeros
    raising = BandMF(BandedToeplitzStrategy.identity(), 10.0, 1.0, NonFiniteUpdates.RAISE)
    with pytest.raises(InvalidParameterError):
        raising({"w": bad}, s0, rng=np.random.default_rng(0))
    empty = ClientLevelGaussian.stack([], like={"w": np.zeros(2)})
    out, s1 = mech(empty, s0, rng=np.random.default_rng(0))
    assert out["w"].shape == (2,) and s1.next_round == 1


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, name", [
    ({"strategy": "banded"}, "strategy"),
    ({"l2_clip_norm": math.nan}, "l2_clip_norm"),
    ({"noise_multiplier": 0.0}, "noise_multiplier"),
    ({"noise_multiplier": math.inf}, "noise_multiplier"),
    ({"nonfinite": "zero"}, "nonfinite"),
])
def test_bad_mechanism_arguments_are_named(kwargs, name):
    args = {"strategy": BandedToeplitzStrategy.identity(), "l2_clip_norm": 1.0,
            "noise_multiplier": 1.0, **kwargs}
    with pytest.raises(InvalidParameterError, match=name):
        BandMF(**args)


@pytest.mark.parametrize("call, name", [
    (lambda: BandedToeplitzStrategy(()), "coefficients"),
    (lambda: BandedToeplitzStrategy((0.0, 1.0)), r"coefficients\[0\]"),
    (lambda: BandedToeplitzStrategy((1.0, math.nan)), "coefficients"),
    (lambda: BandedToeplitzStrategy("abc"), "coefficients"),
    (lambda: BandedToeplitzStrategy.optimized(5, 4), "num_bands"),
    (lambda: BandedToeplitzStrategy.optimized(0, 4), "num_bands"),
    (lambda: BandedToeplitzStrategy.optimized(2, 10, momentum=1.0), "momentum"),
    (lambda: BandedToeplitzStrategy.square_root(0), "num_bands"),
    (lambda: BandedToeplitzStrategy.identity().matrix(0), "rounds"),
    (lambda: TreeStrategy().matrix(10**6), "rounds"),
    (lambda: BandMFState(-1), "next_round"),
    (lambda: BandMFState(0, [np.zeros(2)]), "history"),
])
def test_bad_strategy_and_state_arguments_are_named(call, name):
    with pytest.raises(InvalidParameterError, match=name):
        call()


def test_bad_call_arguments_are_named():
    mech = BandMF(BandedToeplitzStrategy.square_root(3), 1.0, 1.0)
    s0 = mech.initial_state()
    with pytest.raises(InvalidParameterError, match="rng"):
        mech.noise({"w": np.zeros(2)}, s0, rng=None)
    with pytest.raises(InvalidParameterError, match="state"):
        mech.noise({"w": np.zeros(2)}, None, rng=np.random.default_rng(0))
    _, s1 = mech.noise({"w": np.zeros(2)}, s0, rng=np.random.default_rng(0))
    with pytest.raises(InvalidParameterError, match=r"state\.history\[0\]"):
        mech.noise({"w": np.zeros(3)}, s1, rng=np.random.default_rng(0))
    with pytest.raises(InvalidParameterError, match="updates"):
        mech([{"w": np.zeros(2)}], s0, rng=np.random.default_rng(0))
    with pytest.raises(InvalidParameterError, match="weights"):
        mech({"w": np.zeros((2, 2))}, s0, rng=np.random.default_rng(0), weights=[2.0, 0.0])
