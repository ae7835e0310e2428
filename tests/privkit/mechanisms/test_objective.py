"""ObjectivePerturbation: Thm C.2 epsilon, proven/unproven, the linear term's distribution."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

import privkit
from privkit.errors import InvalidParameterError
from privkit.events import ObjectivePerturbationDpEvent, SelfComposedDpEvent
from privkit.mechanisms import ObjectivePerturbation

VECTOR = dict(alpha=20.0, dataset_size=224, proximal_mu=0.1)  # upcycled_fl.md 4.1


def test_thm_c2_vector_and_event():
    op = ObjectivePerturbation(**VECTOR)
    assert (op.lipschitz, op.smoothness, op.rank) == (1.0, 0.25, 2)
    assert op.step_epsilon == pytest.approx(0.178571428571 + 0.03125, rel=1e-12)
    assert round(op.step_epsilon, 6) == 0.209821
    ev = op.event()
    assert type(ev) is ObjectivePerturbationDpEvent
    assert ev == ObjectivePerturbationDpEvent(
        epsilon=op.step_epsilon, alpha=20.0, lipschitz=1.0, smoothness=0.25, rank=2,
        dataset_size=224, proximal_mu=0.1, proven=True)
    run = SelfComposedDpEvent(ev, 40)
    assert privkit.epsilon(run, 1e-3, "basic").epsilon == pytest.approx(8.392857, abs=1e-6)
    assert privkit.epsilon(run, 1e-3, "optimal").epsilon == pytest.approx(4.35341, abs=1e-5)


def test_rank_enters_the_jacobian_term():
    # K-class softmax, r = 2(K-1): the floor term is 1.4 r u2 / (|D| mu).
    op = ObjectivePerturbation(**VECTOR, lipschitz=math.sqrt(2), smoothness=0.5, rank=4)
    expected = 2 * 20 * math.sqrt(2) / 224 + 1.4 * 4 * 0.5 / (224 * 0.1)
    assert op.step_epsilon == pytest.approx(expected, rel=1e-14)
    assert op.event().rank == 4


@pytest.mark.parametrize("flag", ["glm", "exact_solver"])
def test_unproven_refused_unless_allowed(flag):
    with pytest.raises(InvalidParameterError, match=flag):
        ObjectivePerturbation(**VECTOR, **{flag: False})
    op = ObjectivePerturbation(**VECTOR, **{flag: False}, allow_unproven=True)
    assert op.proven is False and op.event().proven is False
    assert op.step_epsilon == ObjectivePerturbation(**VECTOR).step_epsilon


def test_not_proven_mark_in_reports():
    unproven = ObjectivePerturbation(**VECTOR, glm=False, allow_unproven=True).event()
    report = privkit.epsilon(SelfComposedDpEvent(unproven, 40), 1e-3)
    marks = [a for a in report.assumptions if a.startswith("NOT PROVEN:")]
    assert len(marks) == 1 and "Thm C.2" in marks[0]
    assert report.epsilon == pytest.approx(4.35341, abs=1e-5)  # still priced
    proven = privkit.epsilon(SelfComposedDpEvent(ObjectivePerturbation(**VECTOR).event(), 40),
                             1e-3)
    assert not any(a.startswith("NOT PROVEN") for a in proven.assumptions)


def test_allow_unproven_on_a_proven_step_is_still_proven():
    op = ObjectivePerturbation(**VECTOR, allow_unproven=True)
    assert op.proven and op.event().proven


def test_condition_d_checked():
    # u2 <= 0.5 |D| mu: 0.25 <= 0.5 * 4 * 0.1 = 0.2 fails.
    with pytest.raises(InvalidParameterError, match="smoothness") as exc:
        ObjectivePerturbation(alpha=1.0, dataset_size=4, proximal_mu=0.1)
    assert "dataset_size" in str(exc.value)
    ObjectivePerturbation(alpha=1.0, dataset_size=5, proximal_mu=0.1)  # 0.25 <= 0.25


@pytest.mark.parametrize("field,bad", [
    ("alpha", 0.0), ("alpha", -1.0), ("alpha", math.nan), ("alpha", math.inf),
    ("dataset_size", 0), ("dataset_size", 3.5), ("proximal_mu", 0.0),
    ("proximal_mu", math.nan), ("lipschitz", -1.0), ("lipschitz", math.inf),
    ("smoothness", -0.1), ("smoothness", math.nan), ("rank", 0), ("glm", 1),
    ("exact_solver", None), ("allow_unproven", "yes"), ("_noise_scale", -1.0),
])
def test_bad_values_named(field, bad):
    kw = dict(VECTOR)
    kw[field] = bad
    with pytest.raises(InvalidParameterError, match=field):
        ObjectivePerturbation(**kw)


# ------------------------------------------------------------ linear term
def test_linear_term_structure_dtype_device():
    op = ObjectivePerturbation(**VECTOR)
    like = {"fc": [torch.zeros(2, 20, dtype=torch.float32), torch.zeros(2, dtype=torch.float64)],
            "n": np.zeros(3, np.float32)}
    out = op.linear_term(like, rng=torch.Generator().manual_seed(0))
    assert set(out) == {"fc", "n"} and isinstance(out["fc"], list)
    assert out["fc"][0].shape == (2, 20) and out["fc"][0].dtype == torch.float32
    assert out["fc"][1].dtype == torch.float64 and out["n"].dtype == np.float32
    params = dict(torch.nn.Linear(20, 2).named_parameters())
    n = op.linear_term(params, rng=np.random.default_rng(0))
    assert all(not v.requires_grad for v in n.values())


def norms(op, like, rng, k):
    out = []
    for _ in range(k):
        n = op.linear_term(like, rng=rng)
        leaves = [np.asarray(v, dtype=np.float64) for v in n.values()]
        out.append(math.sqrt(sum(float((v**2).sum()) for v in leaves)))
    return np.array(out)


def test_linear_term_norm_is_gamma_over_all_coordinates():
    # ||n|| ~ Gamma(d, scale 1/alpha) with d = every coordinate of every leaf (here 42).
    op = ObjectivePerturbation(**VECTOR)
    like = {"w": np.zeros((2, 20)), "b": np.zeros(2)}
    r = norms(op, like, np.random.default_rng(21), 2000)
    assert stats.kstest(r, stats.gamma(a=42, scale=1 / 20).cdf).pvalue > 1e-3
    # a per-tensor Gamma(20) radius (the authors' code) is caught:
    assert stats.kstest(r, stats.gamma(a=20, scale=1 / 20).cdf).pvalue < 1e-6


def test_linear_term_numpy_and_torch_same_distribution():
    op = ObjectivePerturbation(**VECTOR)
    a = norms(op, {"w": np.zeros(10)}, np.random.default_rng(3), 1500)
    b = norms(op, {"w": torch.zeros(10, dtype=torch.float64)}, torch.Generator().manual_seed(3),
              1500)
    assert stats.ks_2samp(a, b).pvalue > 1e-3


def test_noise_scale_multiplies_the_term():
    like = {"w": np.zeros(5)}
    base = ObjectivePerturbation(**VECTOR)
    half = ObjectivePerturbation(**VECTOR, _noise_scale=0.5)
    assert half.event() == base.event()
    a = base.linear_term(like, rng=np.random.default_rng(4))["w"]
    b = half.linear_term(like, rng=np.random.default_rng(4))["w"]
    assert np.allclose(b, 0.5 * a, rtol=1e-12)


def test_linear_term_bad_inputs():
    op = ObjectivePerturbation(**VECTOR)
    with pytest.raises(InvalidParameterError, match="like_tree"):
        op.linear_term({"w": np.zeros((0, 4))}, rng=np.random.default_rng(0))
    with pytest.raises(InvalidParameterError, match="like_tree"):
        op.linear_term(np.zeros(3, dtype=np.int64), rng=np.random.default_rng(0))
    with pytest.raises(InvalidParameterError, match="rng"):
        op.linear_term(np.zeros(3), rng=1)
