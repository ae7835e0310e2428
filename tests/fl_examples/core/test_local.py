"""Tests of fl_examples.core.local: the batched local solver against the per-client loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_examples.core import local as local_module
from fl_examples.core.local import (
    ClientData,
    batch_orders,
    local_sgd,
    local_sgd_reference,
    pad_clients,
)
from fl_examples.core.models import MLP, BatchedModel, MultinomialLogReg
from privkit.errors import InvalidParameterError

F_, C_ = 5, 3
SIZES = [23, 7, 1, 0, 15, 40, 10]  # heterogeneous, one empty client, one exact multiple of 5
EPOCHS = [3, 2, 4, 5, 0, 1, 2]  # stragglers, one with 0 epochs
MODELS = [MultinomialLogReg(F_, C_), MLP(F_, 8, C_)]
IDS = ["logreg", "mlp"]
# CUDA joins when present (parametrised, never skipped).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _data(sizes=SIZES, dtype=torch.float64, seed: int = 0) -> ClientData:
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, F_)) for n in sizes]
    ys = [rng.integers(0, C_, n) for n in sizes]
    return pad_clients(xs, ys, dtype=dtype)


def _setup(model: BatchedModel, dtype=torch.float64, sizes=SIZES):
    data = _data(sizes, dtype)
    params = model.init(len(sizes), generator=_gen(1), dtype=dtype)
    w_bar = {k: torch.full(v.shape[1:], 0.3, dtype=dtype) for k, v in params.items()}
    return data, params, w_bar


def _run(solver, model, params, w_bar, data, seed=5, **kw):
    kw = {"epochs": torch.tensor(EPOCHS), "batch_size": 5, "lr": 0.1, **kw}
    return solver(model, params, w_bar, data, generator=_gen(seed), **kw)


def _max_diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("mu", [0.0, 0.7])
@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_batched_equals_reference_float64(model: BatchedModel, mu: float) -> None:
    data, params, w_bar = _setup(model)
    got = _run(local_sgd, model, params, w_bar, data, proximal_mu=mu)
    ref = _run(local_sgd_reference, model, params, w_bar, data, proximal_mu=mu)
    assert _max_diff(got, ref) < 1e-10
    assert _max_diff(got, params) > 0.1  # it did train


@pytest.mark.parametrize("chunk_elements", [1, 700])
def test_chunking_does_not_change_the_result(monkeypatch, chunk_elements: int) -> None:
    """Minibatches are laid out in chunks of steps; any chunk length gives the same result."""
    model = MLP(F_, 8, C_)
    data, params, w_bar = _setup(model)
    whole = _run(local_sgd, model, params, w_bar, data, proximal_mu=0.3)
    monkeypatch.setattr(local_module, "_CHUNK_ELEMENTS", chunk_elements)
    assert _max_diff(_run(local_sgd, model, params, w_bar, data, proximal_mu=0.3), whole) < 1e-13


def test_padding_content_is_never_read() -> None:
    """NaN features and out-of-range labels on padding rows change nothing."""
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model)
    x = torch.where(data.mask[..., None], data.x, float("nan"))
    y = torch.where(data.mask, data.y, -7)
    dirty = ClientData(x, y, data.mask, data.sizes)
    got = _run(local_sgd, model, params, w_bar, dirty, proximal_mu=0.1)
    assert all(torch.isfinite(v).all() for v in got.values())
    clean = _run(local_sgd, model, params, w_bar, data, proximal_mu=0.1)
    assert _max_diff(got, clean) == 0
    assert (
        _max_diff(got, _run(local_sgd_reference, model, params, w_bar, dirty, proximal_mu=0.1))
        < 1e-10
    )


@pytest.mark.parametrize("device", DEVICES)
def test_runs_on_the_tensors_device(device: str) -> None:
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model)
    on = {k: v.to(device) for k, v in params.items()}
    data_on = ClientData(*(t.to(device) for t in data))
    wb_on = {k: v.to(device) for k, v in w_bar.items()}
    kw = {"epochs": torch.tensor(EPOCHS, device=device), "batch_size": 5, "lr": 0.1}
    gen = torch.Generator(device=device).manual_seed(5)
    got = local_sgd(model, on, wb_on, data_on, generator=gen, proximal_mu=0.2, **kw)
    assert all(v.device.type == torch.device(device).type for v in got.values())
    gen = torch.Generator(device=device).manual_seed(5)
    ref = local_sgd_reference(model, on, wb_on, data_on, generator=gen, proximal_mu=0.2, **kw)
    assert _max_diff(got, ref) < 1e-10


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_batched_equals_reference_float32(model: BatchedModel) -> None:
    data, params, w_bar = _setup(model, torch.float32)
    got = _run(local_sgd, model, params, w_bar, data, proximal_mu=0.2)
    ref = _run(local_sgd_reference, model, params, w_bar, data, proximal_mu=0.2)
    assert _max_diff(got, ref) < 1e-5


@pytest.mark.parametrize(("momentum", "batch_size"), [(0.0, 3), (0.9, 1), (0.5, 64)])
def test_batched_equals_reference_other_settings(momentum: float, batch_size: int) -> None:
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model)
    kw = {"momentum": momentum, "batch_size": batch_size, "proximal_mu": 0.1, "lr": 0.05}
    got = _run(local_sgd, model, params, w_bar, data, **kw)
    assert _max_diff(got, _run(local_sgd_reference, model, params, w_bar, data, **kw)) < 1e-10


def test_matches_hand_written_momentum_and_prox() -> None:
    """One client, full batch (order-free): PyTorch heavy ball on F + mu/2 ||w - w_bar||^2."""
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model, sizes=[6])
    lr, m, mu = 0.2, 0.5, 0.3
    got = _run(
        local_sgd,
        model,
        params,
        w_bar,
        data,
        epochs=torch.tensor([3]),
        batch_size=6,
        lr=lr,
        momentum=m,
        proximal_mu=mu,
    )
    w = {k: v.clone() for k, v in params.items()}
    buf = {k: torch.zeros_like(v) for k, v in w.items()}
    for _ in range(3):
        g = model.grad(w, data.x, data.y, data.mask)
        for k in w:
            buf[k] = m * buf[k] + g[k] + mu * (w[k] - w_bar[k])
            w[k] = w[k] - lr * buf[k]
    assert _max_diff(got, w) < 1e-12


def test_stragglers_with_zero_epochs_and_empty_clients_unchanged() -> None:
    model = MLP(F_, 8, C_)
    data, params, w_bar = _setup(model)
    got = _run(local_sgd, model, params, w_bar, data, proximal_mu=0.5)
    for i in (3, 4):  # size 0 with 5 epochs; size 15 with 0 epochs
        assert all(torch.equal(got[k][i], params[k][i]) for k in got)
    zero = _run(local_sgd, model, params, w_bar, data, epochs=0)
    assert _max_diff(zero, params) == 0


def test_fewer_epochs_is_a_prefix_of_more_epochs() -> None:
    """A straggler's result is the full client's trajectory stopped early (same batch order)."""
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model, sizes=[12])
    full = batch_orders(data.sizes, torch.tensor([3]), generator=_gen(9))
    short = full._replace(order=full.order[:24])
    kw = {"batch_size": 5, "lr": 0.1}
    a = local_sgd(model, params, w_bar, data, epochs=torch.tensor([2]), order=short, **kw)
    b = local_sgd_reference(model, params, w_bar, data, epochs=torch.tensor([2]), order=short, **kw)
    c = local_sgd(model, params, w_bar, data, epochs=torch.tensor([3]), order=full, **kw)
    assert _max_diff(a, b) < 1e-12 and _max_diff(a, c) > 0


def test_seed_determinism_and_order_argument() -> None:
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model)
    a = _run(local_sgd, model, params, w_bar, data, seed=3)
    b = _run(local_sgd, model, params, w_bar, data, seed=3)
    c = _run(local_sgd, model, params, w_bar, data, seed=4)
    assert _max_diff(a, b) == 0 and _max_diff(a, c) > 1e-6
    order = batch_orders(data.sizes, torch.tensor(EPOCHS), generator=_gen(3))
    d = local_sgd(
        model, params, w_bar, data, epochs=torch.tensor(EPOCHS), batch_size=5, lr=0.1, order=order
    )
    assert _max_diff(a, d) == 0


def test_batch_orders_are_permutations() -> None:
    sizes, epochs = torch.tensor([4, 0, 7, 1]), torch.tensor([2, 3, 3, 0])
    o = batch_orders(sizes, epochs, generator=_gen(0))
    assert o.order.numel() == 4 * 2 + 7 * 3 and o.offsets.tolist() == [0, 8, 8, 29]
    perms = [o.permutation(2, e, 7).tolist() for e in range(3)]
    assert all(sorted(p) == list(range(7)) for p in perms)
    assert len({tuple(p) for p in perms}) > 1  # fresh order per epoch
    assert sorted(o.permutation(0, 1, 4).tolist()) == [0, 1, 2, 3]


def test_w_bar_broadcast_forms_agree() -> None:
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model)
    k = len(SIZES)
    forms = [w_bar, {n: t[None] for n, t in w_bar.items()}]
    forms.append({n: t.expand(k, *t.shape).clone() for n, t in w_bar.items()})
    outs = [_run(local_sgd, model, params, wb, data, proximal_mu=1.0) for wb in forms]
    assert _max_diff(outs[0], outs[1]) == 0 and _max_diff(outs[0], outs[2]) == 0


def test_proximal_term_pulls_towards_w_bar() -> None:
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model)
    start = {k: v.clone() for k, v in params.items()}  # start away from w_bar

    def dist(mu: float) -> torch.Tensor:
        out = _run(
            local_sgd,
            model,
            start,
            w_bar,
            data,
            proximal_mu=mu,
            lr=0.01,
            batch_size=20,
            epochs=torch.tensor([20] * len(SIZES)),
        )
        return sum(((out[k] - w_bar[k]) ** 2).flatten(1).sum(1) for k in out).sqrt()

    d0, d1, d_big = dist(0.0), dist(1.0), dist(50.0)
    trained = torch.tensor(SIZES) > 0
    assert torch.all(d1[trained] < d0[trained]) and torch.all(d_big[trained] < d1[trained])
    assert torch.all(d_big[trained] < 0.05 * d0[trained])  # mu large: w stays near w_bar
    # The one-sample client runs full-batch GD to the exact prox point, which for convex F_i
    # lies within ||grad F_i(w_bar)|| / mu of w_bar.
    full = {k: v.expand(len(SIZES), *v.shape) for k, v in w_bar.items()}
    g = model.grad(full, data.x, data.y, data.mask)
    bound = sum((v**2).flatten(1).sum(1) for v in g.values()).sqrt() / 50.0
    assert SIZES[2] == 1 and d_big[2] <= bound[2] * 1.001


def test_loss_decreases_on_separable_problem() -> None:
    g = _gen(0)
    k, n = 4, 60
    y = torch.randint(0, 2, (k, n), generator=g)
    x = torch.randn(k, n, 2, generator=g, dtype=torch.float64) * 0.5
    x[..., 0] += 3.0 * (2 * y - 1)  # linearly separable on feature 0
    data = ClientData(x, y, torch.ones(k, n, dtype=torch.bool), torch.full((k,), n))
    for model in (MultinomialLogReg(2, 2), MLP(2, 16, 2)):
        p = model.init(k, generator=_gen(1), dtype=torch.float64)
        before = model.loss(p, x, y, data.mask)
        out = local_sgd(
            model,
            p,
            p,
            data,
            epochs=torch.tensor([5, 5, 5, 1]),
            batch_size=10,
            lr=0.1,
            generator=_gen(2),
        )
        after = model.loss(out, x, y, data.mask)
        assert torch.all(after < 0.5 * before) and torch.all(after < 0.1)
        acc = (model.forward(out, x).argmax(-1) == y).double().mean()
        assert acc == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shapes_dtypes_devices_preserved_and_inputs_untouched(dtype: torch.dtype) -> None:
    model = MLP(F_, 8, C_)
    data, params, w_bar = _setup(model, dtype)
    keep = {k: v.clone() for k, v in params.items()}
    out = _run(local_sgd, model, params, w_bar, data, proximal_mu=0.1)
    assert list(out) == list(params)
    for k in out:
        assert out[k].shape == params[k].shape and out[k].dtype == dtype
        assert out[k].device == params[k].device and out[k].is_contiguous()
        assert torch.equal(params[k], keep[k])


def _bad_cases():
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model)
    k = len(SIZES)
    ep = torch.tensor(EPOCHS)
    base = {"epochs": ep, "batch_size": 5, "lr": 0.1, "generator": _gen(0)}
    short = ClientData(data.x, data.y[:, :-1], data.mask, data.sizes)
    wrong_mask = ClientData(data.x, data.y, ~data.mask, data.sizes)
    big_label = ClientData(data.x, data.y + C_, data.mask, data.sizes)
    too_big = ClientData(data.x, data.y, data.mask, data.sizes + 100)
    bad_params = {"weight": params["weight"][:, :2], "bias": params["bias"]}
    bad_wbar = {"weight": w_bar["weight"], "bias": torch.zeros(2, C_, dtype=torch.float64)}
    cases = [
        ({"lr": -0.1}, None, "lr"),
        ({"lr": 0.0}, None, "lr"),
        ({"lr": float("nan")}, None, "lr"),
        ({"proximal_mu": -1.0}, None, "proximal_mu"),
        ({"proximal_mu": float("inf")}, None, "proximal_mu"),
        ({"momentum": 1.0}, None, "momentum"),
        ({"momentum": -0.5}, None, "momentum"),
        ({"batch_size": 0}, None, "batch_size"),
        ({"batch_size": 2.0}, None, "batch_size"),
        ({"epochs": ep - 3}, None, "epochs"),
        ({"epochs": -1}, None, "epochs"),
        ({"epochs": ep[:-1]}, None, "epochs"),
        ({"epochs": ep.double()}, None, "epochs"),
        ({"generator": None}, None, "generator"),
        ({}, ("data", short), "y"),
        ({}, ("data", wrong_mask), "mask"),
        ({}, ("data", big_label), "y"),
        ({}, ("data", too_big), "sizes"),
        ({}, ("data", ClientData(data.x[..., :2], data.y, data.mask, data.sizes)), "x"),
        ({}, ("data", (data.x, data.y)), "data"),
        ({}, ("params", bad_params), "params['weight']"),
        ({}, ("params", {"w": params["weight"]}), "params"),
        ({}, ("params", {n: t.float() for n, t in params.items()}), "params['weight']"),
        ({}, ("w_bar", bad_wbar), "w_bar['bias']"),
    ]
    for kw, swap, name in cases:
        args = {"params": params, "w_bar": w_bar, "data": data}
        if swap:
            args[swap[0]] = swap[1]
        yield model, args, {**base, **kw}, name
    assert k == len(EPOCHS)


@pytest.mark.parametrize("solver", [local_sgd, local_sgd_reference])
def test_bad_inputs_raise_naming_the_argument(solver) -> None:
    for model, args, kw, name in _bad_cases():
        with pytest.raises(InvalidParameterError) as info:
            solver(model, args["params"], args["w_bar"], args["data"], **kw)
        assert info.value.name == name, (name, str(info.value))


def test_order_must_match_sizes_and_epochs() -> None:
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model)
    other = batch_orders(data.sizes.flip(0), torch.tensor(EPOCHS).flip(0), generator=_gen(0))
    with pytest.raises(InvalidParameterError, match="order"):
        local_sgd(
            model,
            params,
            w_bar,
            data,
            epochs=torch.tensor(EPOCHS),
            batch_size=5,
            lr=0.1,
            order=other,
        )


def test_params_requiring_grad_and_no_grad_context() -> None:
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model)
    leaf = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    a = _run(local_sgd, model, leaf, w_bar, data)
    assert not any(v.requires_grad for v in a.values())
    with torch.no_grad():
        b = _run(local_sgd_reference, model, leaf, w_bar, data)
    assert _max_diff(a, b) < 1e-10


def test_generator_and_order_are_exclusive() -> None:
    model = MultinomialLogReg(F_, C_)
    data, params, w_bar = _setup(model)
    order = batch_orders(data.sizes, torch.tensor(EPOCHS), generator=_gen(0))
    with pytest.raises(InvalidParameterError, match="generator"):
        _run(local_sgd, model, params, w_bar, data, order=order)
    with pytest.raises(InvalidParameterError, match="order"):
        local_sgd(model, params, w_bar, data, epochs=1, batch_size=5, lr=0.1, order=order)


def test_batch_orders_validates_and_checks_generator_device() -> None:
    g = _gen(0)
    with pytest.raises(InvalidParameterError, match="sizes"):
        batch_orders(torch.tensor([3.0]), torch.tensor([1]), generator=g)
    with pytest.raises(InvalidParameterError, match="epochs"):
        batch_orders(torch.tensor([3, 2]), torch.tensor([1]), generator=g)
    with pytest.raises(InvalidParameterError, match="epochs"):
        batch_orders(torch.tensor([3, 2]), torch.tensor([1, -1]), generator=g)
    with pytest.raises(InvalidParameterError, match="sizes"):
        batch_orders(torch.tensor([-3, 2]), torch.tensor([1, 1]), generator=g)
    empty = batch_orders(torch.tensor([0, 4]), torch.tensor([3, 0]), generator=g)
    assert empty.order.numel() == 0 and empty.offsets.tolist() == [0, 0]


def test_linear_term_batched_equals_reference_and_shifts_gradient():
    from fl_examples.core.local import local_sgd, local_sgd_reference, pad_clients
    from fl_examples.core.models import MultinomialLogReg

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in (7, 4, 9)]
    ys = [torch.randint(0, 2, (n,), generator=g) for n in (7, 4, 9)]
    data = pad_clients(xs, ys, dtype=torch.float64)
    m = MultinomialLogReg(3, 2)
    p = m.init(3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lin = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in p.items()}
    kw = dict(epochs=torch.tensor([2, 1, 0]), batch_size=3, lr=0.1, proximal_mu=0.3)
    a = local_sgd(m, p, p, data, generator=torch.Generator().manual_seed(2), linear_term=lin,
                  **kw)
    b = local_sgd_reference(m, p, p, data, generator=torch.Generator().manual_seed(2),
                            linear_term=lin, **kw)
    c = local_sgd(m, p, p, data, generator=torch.Generator().manual_seed(2), **kw)
    for k in p:
        torch.testing.assert_close(a[k], b[k], atol=1e-10, rtol=0)
        assert not torch.equal(a[k][0], c[k][0])  # the term changes the solve
        assert torch.equal(a[k][2], p[k][2])  # a client with 0 epochs is untouched
    with pytest.raises(InvalidParameterError, match="linear_term"):
        local_sgd(m, p, p, data, generator=torch.Generator().manual_seed(2),
                  linear_term={"weight": lin["weight"]}, **kw)
