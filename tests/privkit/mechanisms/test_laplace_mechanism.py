"""LaplaceGradientNoise (MAPA): sensitivity 2G/b, noise shapes and variances, events, plumbing."""

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy import stats

import privkit
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.events import (
    L2LaplaceDpEvent,
    ReplaceOneLaplaceDpEvent,
    SelfComposedDpEvent,
)
from privkit.mechanisms import LaplaceGradientNoise, NoiseShape

L1, L2 = NoiseShape.L1, NoiseShape.L2


# ------------------------------------------------------------ constants
def test_sensitivities_and_variances():
    m = LaplaceGradientNoise(l2_clip_norm=4.0, batch_size=8, epsilon=2.0)
    assert m.shape is L2 and m.sensitivity == 1.0 and m.alpha == 2.0
    assert m.l1_sensitivity(16) == 4.0
    assert m.noise_variance(10) == pytest.approx(10 * 11 / 4.0)  # d(d+1)/alpha^2
    m1 = LaplaceGradientNoise(4.0, 8, 2.0, L1)
    assert m1.noise_variance(10) == pytest.approx(2 * 10 * (math.sqrt(10) * 1.0 / 2.0) ** 2)
    # testbed constants (mapa.md 6): L2 has about half L1's variance, (d+1) vs 2d per coordinate
    assert m.noise_variance(4380) / m1.noise_variance(4380) == pytest.approx(4381 / 8760)


def test_events():
    m = LaplaceGradientNoise(1.0, 24, 1.0)
    assert m.event(4380) == L2LaplaceDpEvent(1.0, 4380)
    assert type(m.event(3)) is L2LaplaceDpEvent
    m1 = LaplaceGradientNoise(1.0, 24, 0.5, L1)
    # scale / (half the replace-one L1 bound), priced under replace-one only
    assert m1.event(4380) == ReplaceOneLaplaceDpEvent(4.0)
    assert isinstance(m1.event(1), dp_event.LaplaceDpEvent)
    for bad in (0, -1, 2.5, math.nan):
        with pytest.raises(InvalidParameterError, match="d"):
            m.event(bad)
        with pytest.raises(InvalidParameterError, match="d"):
            m.noise_variance(bad)


def test_priced_as_pure_dp():
    # eps_k = 1 per upload, 100 uploads, delta = 1e-5 (mapa.md 7): optimal 79.84, basic 100.
    up = LaplaceGradientNoise(1.0, 24, 1.0).event(4380)
    r = privkit.epsilon(SelfComposedDpEvent(up, 100), 1e-5)
    assert r.epsilon == pytest.approx(79.84132, abs=1e-4)
    assert privkit.epsilon(SelfComposedDpEvent(up, 100), 1e-5, "basic").epsilon == 100


def test_l1_event_priced_by_dp_accounting():
    """Under replace-one (its relation) the upload of scale b = 2 C_1 / eps costs eps; where
    dp-accounting's PLD answers (add/remove) the same noise against the doubled sensitivity
    is its Laplace of z / 2. Priced under add/remove, privkit refuses (C_1 would be read as
    the sensitivity: half the truth)."""
    mech = LaplaceGradientNoise(1.0, 24, 0.5, L1)
    ev = dp_event.SelfComposedDpEvent(mech.event(10), 20)
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.LaplaceDpEvent(
        mech.event(10).noise_multiplier / 2), 20))
    ours = privkit.epsilon(ev, 1e-5, "pld", neighboring_relation=mech.neighboring_relation)
    assert acc.get_epsilon(1e-5) == pytest.approx(ours.epsilon, rel=1e-6)
    assert ours.epsilon <= 10.0  # never above basic composition
    with pytest.raises(UnsupportedEventError, match="REPLACE_ONE"):
        privkit.epsilon(ev, 1e-5)


@pytest.mark.parametrize("field,bad", [
    ("l2_clip_norm", 0.0), ("l2_clip_norm", -1.0), ("l2_clip_norm", math.nan),
    ("l2_clip_norm", math.inf), ("batch_size", 0), ("batch_size", 1.5),
    ("epsilon", 0.0), ("epsilon", math.nan), ("epsilon", math.inf), ("epsilon", -2.0),
    ("shape", "l2"), ("_noise_scale", math.inf),
])
def test_bad_values_named(field, bad):
    kw = dict(l2_clip_norm=1.0, batch_size=4, epsilon=1.0)
    kw[field] = bad
    with pytest.raises(InvalidParameterError, match=field):
        LaplaceGradientNoise(**kw)


# ------------------------------------------------------------ __call__
def test_clips_rows_then_means():
    m = LaplaceGradientNoise(1.0, 3, 1.0, _noise_scale=0.0)
    grads = {"w": np.array([[3.0, 4.0], [0.3, 0.4], [0.0, -10.0]]),
             "b": np.array([0.0, 0.0, 0.0])}
    out = m(grads, rng=np.random.default_rng(0))
    assert out["w"].shape == (2,) and out["b"].shape == ()
    assert np.allclose(out["w"], [(0.6 + 0.3 + 0.0) / 3, (0.8 + 0.4 - 1.0) / 3], atol=1e-12)
    # row norm across leaves: [[3, 4], 12] has norm 13 -> scaled by 1/13
    joint = m({"w": np.array([[3.0, 4.0]] * 3), "b": np.array([12.0] * 3)},
              rng=np.random.default_rng(0))
    assert np.allclose(joint["w"], [3 / 13, 4 / 13]) and np.isclose(joint["b"], 12 / 13)


def test_mean_accumulated_in_float64():
    m = LaplaceGradientNoise(1e9, 4, 1.0, _noise_scale=0.0)
    rows = np.array([[1e8], [1.0], [-1e8], [1.0]], dtype=np.float32)  # float32 sums lose the 1s
    assert m(rows, rng=np.random.default_rng(0))[0] == np.float32(0.5)
    assert m(torch.from_numpy(rows), rng=np.random.default_rng(0)).item() == 0.5


@pytest.mark.parametrize("shape", [L2, L1])
def test_structure_dtype_device_preserved(shape):
    m = LaplaceGradientNoise(1.0, 5, 1.0, shape)
    grads = {"a": [torch.ones(5, 2, 3, dtype=torch.float16), torch.ones(5, dtype=torch.float64)],
             "n": np.ones((5, 4), np.float32)}
    for rng in (np.random.default_rng(0), torch.Generator().manual_seed(0)):
        out = m(grads, rng=rng)
        assert set(out) == {"a", "n"} and isinstance(out["a"], list)
        assert out["a"][0].shape == (2, 3) and out["a"][0].dtype == torch.float16
        assert out["a"][1].shape == () and out["a"][1].dtype == torch.float64
        assert out["a"][0].device == grads["a"][0].device
        assert isinstance(out["n"], np.ndarray) and out["n"].dtype == np.float32
        assert out["n"].shape == (4,)


@pytest.mark.parametrize("grads,what", [
    (np.ones((3, 2)), "rows [3]"),
    ({"a": np.ones((4, 2)), "b": np.ones((3,))}, "rows"),
    (np.ones(()), "0-d"),
    (np.ones((0, 2)), "rows [0]"),
    (np.ones((4, 0)), "coordinate"),
    ({}, "empty"),
])
def test_batch_mismatch_and_empty_named(grads, what):
    m = LaplaceGradientNoise(1.0, 4, 1.0)
    with pytest.raises(InvalidParameterError, match="per_example_grads") as exc:
        m(grads, rng=np.random.default_rng(0))
    assert what in str(exc.value)


def test_bad_inputs():
    m = LaplaceGradientNoise(1.0, 2, 1.0)
    with pytest.raises(InvalidParameterError):
        m(np.array([[1.0, math.nan], [0.0, 0.0]]), rng=np.random.default_rng(0))
    with pytest.raises(InvalidParameterError, match="per_example_grads"):
        m(np.ones((2, 2), dtype=np.int32), rng=np.random.default_rng(0))
    with pytest.raises(InvalidParameterError, match="rng"):
        m(np.ones((2, 2)), rng=None)


def squared_norms(m, grads, rng, k):
    out = np.empty(k)
    for i in range(k):
        out[i] = float(np.sum(np.asarray(m(grads, rng=rng), dtype=np.float64) ** 2))
    return out


@pytest.mark.parametrize("shape", [L2, L1])
def test_noise_variance_matches_monte_carlo(shape):
    # Zero gradients: the output is the noise. ||eta||^2 has relative sd <= 1 at d = 5, so
    # 4000 draws give a 1.6% standard error; 8% is 5 sd (false failure < 1e-6).
    m = LaplaceGradientNoise(2.0, 8, 0.7, shape)
    d = 5
    s2 = squared_norms(m, np.zeros((8, d)), np.random.default_rng(31), 4000)
    assert s2.mean() / m.noise_variance(d) == pytest.approx(1.0, rel=0.08)
    # the paper's 2 DeltaS^2/eps^2 understates it by d(d+1)/2 = 15 (L2):
    assert s2.mean() > 5 * 2 * m.sensitivity**2 / m.epsilon**2


def test_l2_noise_norm_is_gamma_and_l1_is_iid_laplace():
    m = LaplaceGradientNoise(1.0, 4, 2.0)  # alpha = 4
    r = np.sqrt(squared_norms(m, np.zeros((4, 3)), np.random.default_rng(8), 2000))
    assert stats.kstest(r, stats.gamma(a=3, scale=1 / 4).cdf).pvalue > 1e-3
    m1 = LaplaceGradientNoise(1.0, 4, 2.0, L1)
    x = m1(np.zeros((4, 20_000)), rng=np.random.default_rng(9))
    scale = m1.l1_sensitivity(20_000) / 2.0
    assert stats.kstest(x / scale, "laplace").pvalue > 1e-3


@pytest.mark.parametrize("shape", [L2, L1])
def test_numpy_and_torch_same_distribution(shape):
    m = LaplaceGradientNoise(1.0, 4, 1.0, shape)
    a = squared_norms(m, np.zeros((4, 3)), np.random.default_rng(5), 1500)
    b = squared_norms(m, torch.zeros(4, 3, dtype=torch.float64),
                      torch.Generator().manual_seed(5), 1500)
    assert stats.ks_2samp(a, b).pvalue > 1e-3


def test_noise_scale_multiplies_noise_not_privacy():
    base = LaplaceGradientNoise(1.0, 4, 1.0)
    half = LaplaceGradientNoise(1.0, 4, 1.0, _noise_scale=0.5)
    assert half.event(3) == base.event(3) and "_noise_scale" not in repr(half)
    assert half.noise_variance(3) == pytest.approx(0.25 * base.noise_variance(3))
    g = np.zeros((4, 3))
    assert np.allclose(half(g, rng=np.random.default_rng(1)),
                       0.5 * base(g, rng=np.random.default_rng(1)), rtol=1e-12)
