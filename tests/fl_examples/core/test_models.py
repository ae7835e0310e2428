"""Tests of fl_examples.core.models: shapes, init, losses, closed-form gradients, flat layout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fl_examples.core.models import (
    MLP,
    BatchedModel,
    MultinomialLogReg,
    PerExampleModel,
    flatten,
    masked_mean_cross_entropy,
    num_parameters,
    split_flat,
    unflatten,
)
from privkit.errors import InvalidParameterError

MODELS = [MultinomialLogReg(6, 4), MLP(6, 5, 4)]
IDS = ["logreg", "mlp"]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(k: int = 3, b: int = 7, f: int = 6, c: int = 4, seed: int = 1):
    g = _gen(seed)
    x = torch.randn(k, b, f, generator=g, dtype=torch.float64)
    y = torch.randint(0, c, (k, b), generator=g)
    mask = torch.arange(b) < torch.tensor([b, 3, 1])[:k, None]
    return x, y, mask


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_protocol_shapes_and_dtype(model: BatchedModel) -> None:
    assert isinstance(model, BatchedModel)
    for dtype in (torch.float32, torch.float64):
        p = model.init(3, generator=_gen(), dtype=dtype)
        assert list(p) == list(model.parameter_shapes())
        for name, shape in model.parameter_shapes().items():
            assert p[name].shape == (3, *shape) and p[name].dtype == dtype
        x = torch.randn(3, 7, 6, dtype=dtype)
        out = model.forward(p, x)
        assert out.shape == (3, 7, 4) and out.dtype == dtype
    assert num_parameters(model) == model.num_parameters == flatten(p).shape[1]


def test_paper_sizes() -> None:
    assert MultinomialLogReg(20, 10).num_parameters == 210
    assert MLP().num_parameters == 784 * 196 + 196 + 196 * 10 + 10 == 155_830


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_init_is_seeded_and_clients_differ(model: BatchedModel) -> None:
    a = model.init(2, generator=_gen(5))
    b = model.init(2, generator=_gen(5))
    first = next(iter(model.parameter_shapes()))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[first][0], a[first][1])


def test_logreg_init_matches_authors_scale() -> None:
    p = MultinomialLogReg(200, 50).init(2, generator=_gen())
    assert torch.all(p["bias"] == 0)
    assert abs(p["weight"].std().item() - 0.01) < 0.001


def test_mlp_init_is_nn_linear_default_range() -> None:
    p = MLP(100, 30, 10).init(2, generator=_gen())
    assert p["w1"].abs().max() <= 1 / math.sqrt(100) and p["b1"].abs().max() <= 0.1
    assert p["w2"].abs().max() <= 1 / math.sqrt(30) and p["b2"].abs().max() <= 1 / math.sqrt(30)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_forward_matches_single(model: BatchedModel) -> None:
    p = model.init(3, generator=_gen(), dtype=torch.float64)
    x, _, _ = _batch()
    out = model.forward(p, x)
    for i in range(3):
        single = model.forward_single({k: v[i] for k, v in p.items()}, x[i])
        torch.testing.assert_close(out[i], single, atol=1e-12, rtol=0)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_loss_is_masked_mean_cross_entropy_once(model: BatchedModel) -> None:
    p = model.init(3, generator=_gen(), dtype=torch.float64)
    x, y, mask = _batch()
    y = torch.where(mask, y, 99)  # labels on padding rows must be ignored
    loss = model.loss(p, x, y, mask)
    for i in range(3):
        n = int(mask[i].sum())
        logits = model.forward_single({k: v[i] for k, v in p.items()}, x[i, :n])
        expected = F.cross_entropy(logits, y[i, :n])  # logits in, one softmax only
        torch.testing.assert_close(loss[i], expected, atol=1e-12, rtol=0)


def test_empty_client_loss_is_zero() -> None:
    loss = masked_mean_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3), torch.zeros(2, 3))
    assert loss.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_closed_form_grad_matches_autograd(model: BatchedModel) -> None:
    p = model.init(3, generator=_gen(), dtype=torch.float64)
    p = {k: v.requires_grad_(True) for k, v in p.items()}
    x, y, mask = _batch()
    y = torch.where(mask, y, 99)
    auto = torch.autograd.grad(model.loss(p, x, y, mask).sum(), list(p.values()))
    closed = model.grad({k: v.detach() for k, v in p.items()}, x, y, mask)
    for (name, g), a in zip(closed.items(), auto):
        torch.testing.assert_close(g, a, atol=1e-12, rtol=0, msg=name)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_solver_kernel_matches_grad(model: BatchedModel) -> None:
    """prepare_minibatches + gradient_accumulator (flat layout) == grad, with momentum beta."""
    p = model.init(3, generator=_gen(), dtype=torch.float64)
    x, y, mask = _batch()
    m = mask.double()
    weights = m / m.sum(-1, keepdim=True)
    x_filled = torch.where(mask[..., None], x, x[:, :1])  # filler rows: some real row
    chunk = model.prepare_minibatches(x_filled[None], torch.where(mask, y, 0)[None], weights[None])
    theta = flatten(p)
    prev = torch.randn(theta.shape, generator=_gen(3), dtype=torch.float64)
    out = prev.clone()
    model.gradient_accumulator(theta, out)(tuple(c[0] for c in chunk), 0.5)
    expected = 0.5 * prev + flatten(model.grad(p, x, y, mask))
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def test_flatten_unflatten_roundtrip_and_views() -> None:
    model = MLP(6, 5, 4)
    p = model.init(2, generator=_gen())
    flat = flatten(p)
    assert flat.shape == (2, model.num_parameters)
    back = unflatten(flat, model.parameter_shapes())
    assert all(torch.equal(back[k], p[k]) for k in p)
    flat.zero_()
    assert torch.all(back["w2"] == 0)  # views, documented


def test_logreg_flat_block_is_augmented_matrix() -> None:
    model = MultinomialLogReg(3, 2)
    p = model.init(1, generator=_gen())
    a = flatten(p).view(1, 4, 2)
    assert torch.equal(a[:, :3], p["weight"]) and torch.equal(a[:, 3], p["bias"])


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: MultinomialLogReg(0, 3), "num_features"),
        (lambda: MultinomialLogReg(3, 2.0), "num_classes"),
        (lambda: MultinomialLogReg(3, 2, init_std=float("nan")), "init_std"),
        (lambda: MLP(4, True, 2), "hidden"),
        (lambda: MultinomialLogReg(3, 2).init(0, generator=_gen()), "num_clients"),
        (lambda: MLP(3, 2, 2).init(2, generator=_gen(), dtype=torch.int64), "dtype"),
        (lambda: MultinomialLogReg(3, 2).forward({}, torch.zeros(2, 3)), "x"),
        (lambda: unflatten(torch.zeros(2, 7), MultinomialLogReg(3, 2).parameter_shapes()), "flat"),
        (lambda: flatten({"a": torch.zeros(2, 3), "b": torch.zeros(3)}), "params['b']"),
    ],
)
def test_bad_inputs_name_the_argument(make, name: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        make()
    assert info.value.name == name


# ------------------------------------------------------------ per-example gradients (flat)


def _per_example_autograd(model, theta, x, y):
    """(m, b, d) by autograd, one example at a time (the reference)."""
    out = torch.empty(*x.shape[:2], theta.shape[1], dtype=theta.dtype)
    for j in range(x.shape[0]):
        for i in range(x.shape[1]):
            flat = theta[j].clone().requires_grad_(True)
            loss = F.cross_entropy(model.flat_logits(flat, x[j, i:i + 1]), y[j, i:i + 1])
            (g,) = torch.autograd.grad(loss, flat)
            out[j, i] = g
    return out


def test_logreg_per_example_gradients_match_autograd() -> None:
    m = MultinomialLogReg(5, 3)
    assert isinstance(m, PerExampleModel)
    g = _gen(4)
    theta = torch.randn(4, m.num_parameters, generator=g, dtype=torch.float64)
    x = torch.randn(4, 6, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (4, 6), generator=g)
    per = m.per_example_grads(theta, x, y)
    torch.testing.assert_close(per, _per_example_autograd(m, theta, x, y), rtol=0, atol=1e-12)
    torch.testing.assert_close(m.mean_grads(theta, x, y), per.mean(1), rtol=0, atol=1e-12)
    mask = torch.rand(4, 6, generator=g) < 0.5
    want = (per * mask[:, :, None]).sum(1) / 9
    torch.testing.assert_close(m.mean_grads(theta, x, y, mask, 9), want, rtol=0, atol=1e-12)


def test_flat_logits_are_the_single_model_forward() -> None:
    m = MultinomialLogReg(5, 3)
    flat = torch.randn(m.num_parameters, generator=_gen(5), dtype=torch.float64)
    x = torch.randn(7, 5, generator=_gen(6), dtype=torch.float64)
    params = split_flat(flat, m.parameter_shapes())
    assert params["weight"].data_ptr() == flat.data_ptr()  # views, no copy
    assert torch.equal(m.flat_logits(flat, x), m.forward_single(params, x))
    stacked = unflatten(flat[None], m.parameter_shapes())
    assert all(torch.equal(stacked[k][0], params[k]) for k in params)
