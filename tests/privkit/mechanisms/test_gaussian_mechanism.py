"""GaussianOutputPerturbation: sensitivity modes (upcycled_fl.md 3.2), events, noise, plumbing."""

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

import privkit
from privkit.errors import InvalidParameterError
from privkit.events import SelfComposedDpEvent
from privkit.mechanisms import (
    GaussianOutputPerturbation,
    Sensitivity,
    Solver,
    trainable_parameters,
)

SC = Sensitivity.STRONGLY_CONVEX


def strongly_convex(**kw):
    base = dict(l2_clip_norm=10.0, stddev=1.0, sensitivity_mode=SC,
                dataset_size=224, lipschitz=1.0, strong_convexity=0.1)
    base.update(kw)
    return GaussianOutputPerturbation(**base)


# ------------------------------------------------------------ sensitivity
def test_default_is_clip_replace_one():
    m = GaussianOutputPerturbation(l2_clip_norm=1.5, stddev=6.0)
    assert m.sensitivity_mode is Sensitivity.CLIP_REPLACE_ONE
    assert m.sensitivity == 3.0 and m.contribution_bound == 1.5
    assert m.stddev == 6.0
    # stddev / C; priced under replace-one only (2C), and still dp-accounting's Gaussian
    assert m.event() == privkit.events.ReplaceOneGaussianDpEvent(4.0)
    assert isinstance(m.event(), dp_event.GaussianDpEvent)
    with pytest.raises(privkit.errors.UnsupportedEventError, match="REPLACE_ONE"):
        privkit.epsilon(m.event(), 1e-5)  # under add/remove tau would be the sensitivity


def test_paper_mode_vector():
    # upcycled_fl.md 3.1: M = 40, tau = 10, sigma = 0.8, |D| = 224, delta = 1e-3.
    m = GaussianOutputPerturbation.from_stddev(
        10.0, 0.8, sensitivity_mode=Sensitivity.PAPER, dataset_size=224)
    assert m.sensitivity == pytest.approx(10 / 224, rel=1e-15)
    assert m.noise_multiplier == pytest.approx(17.92, rel=1e-12)
    assert m.stddev == pytest.approx(0.8, rel=1e-12)
    run = SelfComposedDpEvent(m.event(), 40)
    assert privkit.epsilon(run, 1e-3, "exact").epsilon == pytest.approx(0.892186, abs=2e-6)
    assert privkit.epsilon(run, 1e-3, "moments").epsilon == pytest.approx(1.374104, abs=2e-6)


def test_strongly_convex_vector():
    # u1 = 1, rho = 0.1, |D| = 224: Delta = 2/22.4 = 0.08929; exact 2.0490, closed form 2.8728.
    m = GaussianOutputPerturbation.from_stddev(
        10.0, 0.8, sensitivity_mode=SC, dataset_size=224, lipschitz=1.0, strong_convexity=0.1)
    assert m.sensitivity == pytest.approx(2 / 22.4, rel=1e-14)
    assert round(m.sensitivity, 5) == 0.08929
    run = SelfComposedDpEvent(m.event(), 40)
    rel = m.neighboring_relation
    assert privkit.epsilon(run, 1e-3, "exact", neighboring_relation=rel).epsilon == \
        pytest.approx(2.0490, abs=5e-5)
    assert privkit.epsilon(run, 1e-3, "moments", neighboring_relation=rel).epsilon == \
        pytest.approx(2.8728, abs=5e-5)


@pytest.mark.parametrize("kw,expected", [
    (dict(solver=Solver.EXACT), 2 / (224 * 0.1)),
    (dict(solver=Solver.FULL_BATCH_GD), 2 / (224 * 0.1)),
    (dict(solver=Solver.MINIBATCH_SGD, batch_size=32), 2 / (32 * 0.1)),
    (dict(solver=Solver.CERTIFIED, certified_error=0.01), 2 / (224 * 0.1) + 0.02),
    (dict(solver=Solver.CERTIFIED, certified_error=0.0), 2 / (224 * 0.1)),
    (dict(l2_clip_norm=0.01), 0.02),  # min(2 tau, bound)
    (dict(solver=Solver.MINIBATCH_SGD, batch_size=1, l2_clip_norm=5.0), 10.0),
])
def test_strongly_convex_solver_bounds(kw, expected):
    m = strongly_convex(**kw)
    assert m.sensitivity == pytest.approx(expected, rel=1e-14)
    assert m.stddev == pytest.approx(m.noise_multiplier * m.sensitivity / 2, rel=1e-15)


def test_from_stddev_round_trips():
    m = GaussianOutputPerturbation.from_stddev(2.0, 3.0)
    assert m.noise_multiplier == 1.5 and m.stddev == 3.0
    with pytest.raises(InvalidParameterError, match="stddev"):
        GaussianOutputPerturbation.from_stddev(2.0, -1.0)
    with pytest.raises(InvalidParameterError, match="stddev"):
        GaussianOutputPerturbation.from_stddev(2.0, math.nan)


# ------------------------------------------------------------ validation
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, -math.inf, "1", None, True])
@pytest.mark.parametrize("field", ["l2_clip_norm", "stddev", "noise_multiplier"])
def test_bad_scalars_named(field, bad):
    kw = dict(l2_clip_norm=1.0, stddev=1.0) if field != "noise_multiplier" else dict(
        l2_clip_norm=1.0, noise_multiplier=1.0, sensitivity_mode=Sensitivity.PAPER,
        dataset_size=3)
    kw[field] = bad
    with pytest.raises(InvalidParameterError,
                       match="stddev" if bad is None and field != "l2_clip_norm" else field):
        GaussianOutputPerturbation(**kw)


@pytest.mark.parametrize("missing", ["dataset_size", "lipschitz", "strong_convexity"])
def test_strongly_convex_missing_field_named(missing):
    with pytest.raises(InvalidParameterError, match=missing):
        strongly_convex(**{missing: None})


def test_missing_solver_fields_named():
    with pytest.raises(InvalidParameterError, match="batch_size"):
        strongly_convex(solver=Solver.MINIBATCH_SGD)
    with pytest.raises(InvalidParameterError, match="certified_error"):
        strongly_convex(solver=Solver.CERTIFIED)
    with pytest.raises(InvalidParameterError, match="dataset_size"):
        GaussianOutputPerturbation(1.0, 1.0, Sensitivity.PAPER)


def test_unused_fields_refused():
    with pytest.raises(InvalidParameterError, match="dataset_size"):
        GaussianOutputPerturbation(1.0, 1.0, dataset_size=10)
    with pytest.raises(InvalidParameterError, match="lipschitz"):
        GaussianOutputPerturbation(1.0, 1.0, Sensitivity.PAPER, dataset_size=10, lipschitz=1.0)
    with pytest.raises(InvalidParameterError, match="batch_size"):
        strongly_convex(batch_size=4)
    with pytest.raises(InvalidParameterError, match="solver"):
        GaussianOutputPerturbation(1.0, 1.0, solver=Solver.MINIBATCH_SGD)


@pytest.mark.parametrize("field,bad", [
    ("dataset_size", 0), ("dataset_size", 2.5), ("lipschitz", math.nan),
    ("strong_convexity", -0.1), ("strong_convexity", math.inf),
])
def test_bad_strongly_convex_values_named(field, bad):
    with pytest.raises(InvalidParameterError, match=field):
        strongly_convex(**{field: bad})


def test_bad_solver_values_named():
    with pytest.raises(InvalidParameterError, match="batch_size"):
        strongly_convex(solver=Solver.MINIBATCH_SGD, batch_size=225)  # > dataset_size
    with pytest.raises(InvalidParameterError, match="certified_error"):
        strongly_convex(solver=Solver.CERTIFIED, certified_error=math.nan)
    with pytest.raises(InvalidParameterError, match="sensitivity_mode"):
        GaussianOutputPerturbation(1.0, 1.0, "paper")
    with pytest.raises(InvalidParameterError, match="solver"):
        strongly_convex(solver="exact")
    with pytest.raises(InvalidParameterError, match="_noise_scale"):
        GaussianOutputPerturbation(1.0, 1.0, _noise_scale=math.nan)


def test_frozen():
    m = GaussianOutputPerturbation(1.0, stddev=2.0)
    with pytest.raises(AttributeError):
        m.noise_multiplier = 0.1


# ------------------------------------------------------------ __call__
def test_clips_whole_tree_then_adds_noise():
    tree = {"w": np.full((3, 4), 10.0), "b": [np.full(2, -10.0)]}
    silent = GaussianOutputPerturbation(1.0, stddev=2.0, _noise_scale=0.0)
    out = silent(tree, rng=np.random.default_rng(0))
    flat = np.concatenate([out["w"].ravel(), out["b"][0]])
    assert np.linalg.norm(flat) == pytest.approx(1.0, rel=1e-12)
    assert np.allclose(out["w"], 10.0 / math.sqrt(14 * 100))
    small = {"w": np.full(4, 0.1)}
    assert np.array_equal(silent(small, rng=np.random.default_rng(0))["w"], small["w"])
    assert tree["w"][0, 0] == 10.0  # input untouched


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_structure_and_dtype_preserved(dtype):
    m = GaussianOutputPerturbation(1.0, stddev=2.0)
    tree = {"a": np.ones((2, 3), dtype), "b": (np.ones(4, dtype), [np.ones((1,), dtype)])}
    out = m(tree, rng=np.random.default_rng(1))
    assert set(out) == {"a", "b"} and isinstance(out["b"], tuple) and isinstance(out["b"][1], list)
    pairs = [(tree["a"], out["a"]), (tree["b"][0], out["b"][0]),
             (tree["b"][1][0], out["b"][1][0])]
    for x, y in pairs:
        assert isinstance(y, np.ndarray) and y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("rng_kind", ["numpy", "torch"])
def test_torch_structure_dtype_device_preserved(dtype, rng_kind):
    m = GaussianOutputPerturbation(1.0, stddev=1.0)
    tree = [torch.ones(2, 3, dtype=dtype), {"b": torch.zeros(5, dtype=dtype)}]
    rng = np.random.default_rng(2) if rng_kind == "numpy" else torch.Generator().manual_seed(2)
    out = m(tree, rng=rng)
    assert isinstance(out, list) and isinstance(out[1], dict)
    for x, y in [(tree[0], out[0]), (tree[1]["b"], out[1]["b"])]:
        assert isinstance(y, torch.Tensor)
        assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
        assert torch.isfinite(y.float()).all()


def test_trainable_parameters_only_and_no_autograd_history():
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    net[2].bias.requires_grad_(False)
    params = trainable_parameters(net)
    assert list(params) == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight"]
    assert all(p is dict(net.named_parameters())[k] for k, p in params.items())
    assert not any("running" in k for k in params)  # buffers never included
    out = GaussianOutputPerturbation(1.0, stddev=2.0)(params,
                                                      rng=torch.Generator().manual_seed(0))
    assert list(out) == list(params)
    assert all(not v.requires_grad and v.grad_fn is None for v in out.values())


def test_trainable_parameters_refuses():
    with pytest.raises(InvalidParameterError, match="module"):
        trainable_parameters({"w": torch.ones(2)})
    frozen = torch.nn.Linear(2, 1).requires_grad_(False)
    with pytest.raises(InvalidParameterError, match="module"):
        trainable_parameters(frozen)


def test_realised_noise_has_the_right_scale():
    # 40 000 coordinates: the sample variance has relative sd sqrt(2/n) = 0.7%; 4% is > 5 sd.
    m = GaussianOutputPerturbation(l2_clip_norm=3.0, stddev=4.2)
    x = np.random.default_rng(5).standard_normal(40_000)  # norm ~ 200 > tau: clipped
    clipped = x * (3.0 / np.linalg.norm(x))
    for rng in (np.random.default_rng(6), torch.Generator().manual_seed(6)):
        xin = x if isinstance(rng, np.random.Generator) else torch.from_numpy(x)
        out = np.asarray(m(xin, rng=rng))
        resid = out - clipped
        assert abs(resid.mean()) < 5 * m.stddev / 200
        assert resid.var() / m.stddev**2 == pytest.approx(1.0, rel=0.04)


def test_noise_scale_multiplies_noise_not_privacy():
    x = np.zeros(40_000)
    half = GaussianOutputPerturbation(1.0, stddev=2.0, _noise_scale=0.5)
    assert half.event() == privkit.events.ReplaceOneGaussianDpEvent(2.0) and half.stddev == 2.0
    assert "_noise_scale" not in repr(half)
    out = half(x, rng=np.random.default_rng(3))
    assert out.var() / (0.5 * 2.0) ** 2 == pytest.approx(1.0, rel=0.04)


def test_numpy_and_torch_paths_same_distribution():
    # Two-sample KS at fixed seeds; false-failure rate 1e-3 per seed pair.
    m = GaussianOutputPerturbation(1.0, stddev=2.6)
    a = m(np.zeros(5000), rng=np.random.default_rng(11))
    b = m(torch.zeros(5000, dtype=torch.float64), rng=torch.Generator().manual_seed(11))
    c = m(torch.zeros(5000, dtype=torch.float32), rng=np.random.default_rng(12))
    assert stats.ks_2samp(a, b.numpy()).pvalue > 1e-3
    assert stats.ks_2samp(a, c.numpy()).pvalue > 1e-3
    assert stats.kstest(a / m.stddev, "norm").pvalue > 1e-3


def test_same_seed_same_output():
    m = GaussianOutputPerturbation(1.0, stddev=2.0)
    x = np.ones(10)
    assert np.array_equal(m(x, rng=np.random.default_rng(7)), m(x, rng=np.random.default_rng(7)))


@pytest.mark.parametrize("tree", [
    np.zeros(0), {"a": np.zeros((0, 3))}, [], {}, torch.zeros(0),
])
def test_empty_tree_refused(tree):
    with pytest.raises(InvalidParameterError, match="tree"):
        GaussianOutputPerturbation(1.0, stddev=2.0)(tree, rng=np.random.default_rng(0))


def test_bad_inputs_refused():
    m = GaussianOutputPerturbation(1.0, stddev=2.0)
    with pytest.raises(InvalidParameterError, match="tree"):
        m(np.arange(3), rng=np.random.default_rng(0))  # integer leaves
    with pytest.raises(InvalidParameterError):
        m({"w": np.array([1.0, math.nan])}, rng=np.random.default_rng(0))
    with pytest.raises(InvalidParameterError):
        m(torch.tensor([math.inf, 1.0]), rng=np.random.default_rng(0))
    for bad_rng in (None, 0, np.random.RandomState(0)):
        with pytest.raises(InvalidParameterError, match="rng"):
            m(np.ones(3), rng=bad_rng)


# ------------------------------------------------------------ interop
def test_dp_accounting_prices_the_event():
    m = GaussianOutputPerturbation.from_stddev(
        10.0, 0.8, sensitivity_mode=Sensitivity.PAPER, dataset_size=224)
    run = dp_event.SelfComposedDpEvent(m.event(), 40)
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(run)
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(run)
    exact = privkit.epsilon(run, 1e-3, "exact").epsilon
    assert exact <= pld.get_epsilon(1e-3) <= exact * 1.01  # pessimistic PLD: above, close
    assert pld.get_epsilon(1e-3) == pytest.approx(privkit.epsilon(run, 1e-3, "pld").epsilon,
                                                  rel=1e-5)
    assert rdp.get_epsilon(1e-3) >= exact
