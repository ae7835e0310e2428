"""Tests of fl_examples.core.deep_models: CNN and stacked LSTM under the batched solver."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_examples.core.deep_models import CNN, PooledCNN, StackedLSTM
from fl_examples.core.local import ClientData, local_sgd, local_sgd_reference, pad_clients
from fl_examples.core.models import BatchedModel, PerExampleModel, flatten, num_parameters
from privkit.errors import InvalidParameterError

S_, VOCAB, L_ = 6, 20, 4
CNN_M = CNN(image_size=S_, channels=2, hidden=(8, 4), num_classes=3)
LSTM_M = StackedLSTM(
    vocab_size=VOCAB, embedding_dim=5, hidden=6, layers=2, num_classes=3, seq_len=L_
)
MODELS = [CNN_M, LSTM_M]
IDS = ["cnn", "lstm"]
SIZES = [9, 4, 1, 0, 6]  # heterogeneous, one empty client
EPOCHS = [2, 3, 1, 2, 0]  # stragglers, one with 0 epochs


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _features(model: BatchedModel, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(model, StackedLSTM):
        return rng.integers(0, model.vocab_size, size=(n, model.seq_len)).astype(float)
    return rng.normal(size=(n, model.num_features))


def _data(model: BatchedModel, sizes=SIZES, seed: int = 0) -> ClientData:
    rng = np.random.default_rng(seed)
    xs = [_features(model, n, rng) for n in sizes]
    ys = [rng.integers(0, model.num_classes, n) for n in sizes]
    return pad_clients(xs, ys, dtype=torch.float64)


def _max_diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_protocol_and_shapes(model: BatchedModel) -> None:
    assert isinstance(model, BatchedModel)
    p = model.init(3, generator=_gen(0), dtype=torch.float64)
    assert list(p) == list(model.parameter_shapes())
    for name, shape in model.parameter_shapes().items():
        assert p[name].shape == (3, *shape) and p[name].dtype == torch.float64
    assert flatten(p).shape == (3, num_parameters(model)) == (3, model.num_parameters)
    x = _data(model, [5, 5, 5]).x
    assert model.forward(p, x).shape == (3, 5, model.num_classes)
    single = {k: v[1] for k, v in p.items()}
    assert model.forward_single(single, x[1]).shape == (5, model.num_classes)
    torch.testing.assert_close(model.forward(p, x)[1], model.forward_single(single, x[1]))
    y = torch.zeros(3, 5, dtype=torch.long)
    assert model.loss(p, x, y, torch.ones(3, 5, dtype=torch.bool)).shape == (3,)


def test_default_sizes_follow_the_spec() -> None:
    cnn = CNN()
    assert cnn.num_features == 784 and cnn.hidden == (1000, 100) and cnn.channels == 3
    # conv 3*9+3, 2352*1000+1000, 1000*100+100, 100*10+10
    assert cnn.num_parameters == 30 + 2_353_000 + 100_100 + 1_010
    lstm = StackedLSTM(vocab_size=100)
    assert (lstm.num_features, lstm.embedding_dim, lstm.hidden, lstm.layers) == (25, 300, 128, 2)
    ref = nn.LSTM(300, 128, num_layers=2)
    n_ref = 100 * 300 + sum(t.numel() for t in ref.parameters()) + 128 * 2 + 2
    assert lstm.num_parameters == n_ref


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_init_is_reproducible_and_default_scaled(model: BatchedModel) -> None:
    a = model.init(2, generator=_gen(3), dtype=torch.float64)
    b = model.init(2, generator=_gen(3), dtype=torch.float64)
    assert _max_diff(a, b) == 0
    assert not torch.equal(a[next(iter(a))][0], a[next(iter(a))][1])  # clients differ
    bounds = (
        {"conv_w": 1 / 3, "conv_b": 1 / 3, "w1": 72**-0.5, "w3": 4**-0.5}
        if isinstance(model, CNN)
        else {"w_ih0": 6**-0.5, "w_hh1": 6**-0.5, "out_b": 6**-0.5}
    )
    for name, bound in bounds.items():
        assert a[name].abs().max() <= bound
        assert a[name].abs().max() > 0.5 * bound


# --------------------------------------------------------------------------- against nn


def test_cnn_matches_torch_nn() -> None:
    m = CNN_M
    p = {k: v[0] for k, v in m.init(1, generator=_gen(1), dtype=torch.float64).items()}
    net = nn.Sequential(
        nn.Unflatten(1, (1, S_, S_)),
        nn.Conv2d(1, 2, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(2 * S_ * S_, 8),
        nn.ReLU(),
        nn.Linear(8, 4),
        nn.ReLU(),
        nn.Linear(4, 3),
    ).double()
    with torch.no_grad():
        net[1].weight.copy_(p["conv_w"])
        net[1].bias.copy_(p["conv_b"])
        for j, layer in zip((1, 2, 3), (net[4], net[6], net[8])):
            layer.weight.copy_(p[f"w{j}"].T)
            layer.bias.copy_(p[f"b{j}"])
    x = torch.randn(7, S_ * S_, generator=_gen(2), dtype=torch.float64)
    torch.testing.assert_close(m.forward_single(p, x), net(x), rtol=0, atol=1e-12)


def test_lstm_matches_torch_nn() -> None:
    m = LSTM_M
    p = {k: v[0] for k, v in m.init(1, generator=_gen(1), dtype=torch.float64).items()}
    emb = nn.Embedding(VOCAB, 5).double()
    lstm = nn.LSTM(5, 6, num_layers=2, batch_first=True).double()
    fc = nn.Linear(6, 3).double()
    with torch.no_grad():
        emb.weight.copy_(p["embedding"])
        for layer in range(2):
            for kind in ("ih", "hh"):
                getattr(lstm, f"weight_{kind}_l{layer}").copy_(p[f"w_{kind}{layer}"].T)
                getattr(lstm, f"bias_{kind}_l{layer}").copy_(p[f"b_{kind}{layer}"])
        fc.weight.copy_(p["out_w"].T)
        fc.bias.copy_(p["out_b"])
    ids = torch.randint(0, VOCAB, (7, L_), generator=_gen(2))
    out, _ = lstm(emb(ids))
    torch.testing.assert_close(
        m.forward_single(p, ids.double()), fc(out[:, -1]), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_grad_matches_autograd_per_client(model: BatchedModel) -> None:
    data = _data(model)
    p = model.init(len(SIZES), generator=_gen(4), dtype=torch.float64)
    x = torch.where(data.mask[..., None], data.x, torch.nan) if isinstance(model, CNN) else data.x
    g = model.grad(p, x, data.y, data.mask)
    for i, n in enumerate(SIZES):
        q = {k: v[i].clone().requires_grad_(True) for k, v in p.items()}
        if n == 0:
            assert all(g[k][i].abs().max() == 0 for k in g)
            continue
        F.cross_entropy(model.forward_single(q, data.x[i, :n]), data.y[i, :n]).backward()
        for k in q:
            torch.testing.assert_close(g[k][i], q[k].grad, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- solver


@pytest.mark.parametrize("mu", [0.0, 0.7])
@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_batched_local_sgd_equals_reference_float64(model: BatchedModel, mu: float) -> None:
    data = _data(model)
    params = model.init(len(SIZES), generator=_gen(1), dtype=torch.float64)
    w_bar = {k: torch.full(v.shape[1:], 0.05, dtype=torch.float64) for k, v in params.items()}
    kw = {"epochs": torch.tensor(EPOCHS), "batch_size": 4, "lr": 0.1, "proximal_mu": mu}
    got = local_sgd(model, params, w_bar, data, generator=_gen(5), **kw)
    ref = local_sgd_reference(model, params, w_bar, data, generator=_gen(5), **kw)
    assert _max_diff(got, ref) < 1e-9
    assert _max_diff(got, params) > 1e-3  # it did train
    for i, (n, e) in enumerate(zip(SIZES, EPOCHS)):
        if n * e == 0:  # no work: parameters unchanged
            assert all(torch.equal(got[k][i], params[k][i]) for k in got)


def _toy_task(model: BatchedModel, k: int, n: int, seed: int) -> ClientData:
    """Two classes, told by the first pixel (CNN) or by the last token, 1 or 2 (LSTM)."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for _ in range(k):
        x = _features(model, n, rng)
        y = (rng.random(n) < 0.5).astype(int)
        if isinstance(model, StackedLSTM):
            x[:, -1] = 1 + y
        else:
            x[:, 0] = 3.0 * (2 * y - 1) + 0.1 * rng.normal(size=n)
        xs.append(x)
        ys.append(y)
    return pad_clients(xs, ys, dtype=torch.float32)


@pytest.mark.parametrize(("model", "lr"), [(CNN_M, 0.1), (LSTM_M, 1.0)], ids=IDS)
def test_loss_decreases_on_learnable_task(model: BatchedModel, lr: float) -> None:
    data = _toy_task(model, k=3, n=64, seed=0)
    p = model.init(3, generator=_gen(0))
    before = model.loss(p, data.x, data.y, data.mask)
    out = local_sgd(
        model, p, p, data, epochs=10, batch_size=16, lr=lr, momentum=0.5, generator=_gen(1)
    )
    after = model.loss(out, data.x, data.y, data.mask)
    assert (after < 0.4 * before).all(), (before, after)
    acc = (model.forward(out, data.x).argmax(-1) == data.y).double().mean()
    assert acc > 0.95


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (lambda: CNN(image_size=0), "image_size"),
        (lambda: CNN(channels=2.5), "channels"),
        (lambda: CNN(hidden=(10, 0)), "hidden"),
        (lambda: CNN(hidden=5), "hidden"),
        (lambda: CNN(num_classes=True), "num_classes"),
        (lambda: StackedLSTM(vocab_size=0), "vocab_size"),
        (lambda: StackedLSTM(10, embedding_dim=-1), "embedding_dim"),
        (lambda: StackedLSTM(10, hidden=0), "hidden"),
        (lambda: StackedLSTM(10, layers=0), "layers"),
        (lambda: StackedLSTM(10, num_classes=1.0), "num_classes"),
        (lambda: StackedLSTM(10, seq_len=0), "seq_len"),
        (lambda: CNN_M.init(0, generator=_gen(0)), "num_clients"),
        (lambda: LSTM_M.init(1, generator=_gen(0), dtype=torch.int64), "dtype"),
        (lambda: CNN_M.forward(CNN_M.init(1, generator=_gen(0)), torch.zeros(1, 2, 5)), "x"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(factory, name: str) -> None:
    with pytest.raises(InvalidParameterError, match=name) as info:
        factory()
    assert info.value.name == name


def test_hidden_list_is_normalised_to_tuple() -> None:
    m = CNN(image_size=4, hidden=[3])
    assert m.hidden == (3,) and hash(m) == hash(CNN(image_size=4, hidden=(3,)))


# ------------------------------------------------------------ MAPA's pooled CNN


def test_pooled_cnn_is_the_testbed_network() -> None:
    m = PooledCNN()
    assert num_parameters(m) == m.num_parameters == 4380 and m.num_features == 784
    p = {k: v[0] for k, v in m.init(1, generator=_gen(1), dtype=torch.float64).items()}
    net = nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 10, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(10, 10, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(160, 10),
    ).double()
    with torch.no_grad():
        net[1].weight.copy_(p["conv1_w"])
        net[1].bias.copy_(p["conv1_b"])
        net[4].weight.copy_(p["conv2_w"])
        net[4].bias.copy_(p["conv2_b"])
        net[8].weight.copy_(p["fc_w"].T)
        net[8].bias.copy_(p["fc_b"])
    x = torch.randn(5, 784, generator=_gen(2), dtype=torch.float64)
    torch.testing.assert_close(m.forward_single(p, x), net(x), rtol=0, atol=1e-12)


def test_pooled_cnn_init_spec() -> None:
    p = PooledCNN().init(1, generator=_gen(3))
    for name in ("conv1_b", "conv2_b", "fc_b"):
        assert not p[name].any()  # biases start at 0 and draw nothing
    assert float(p["fc_w"].std()) == pytest.approx(0.01, rel=0.1)
    assert float(p["conv1_w"].std()) == pytest.approx(1 / 5, rel=0.2)  # N(0, 1/fan_in), 25
    assert float(p["conv2_w"].std()) == pytest.approx(1 / 250**0.5, rel=0.1)
    again = PooledCNN().init(1, generator=_gen(3))
    assert all(torch.equal(p[k], again[k]) for k in p)
    with pytest.raises(InvalidParameterError, match="image_size"):
        PooledCNN(image_size=12)


@pytest.mark.parametrize("model", [PooledCNN(image_size=16, channels=2, num_classes=3), CNN_M],
                         ids=["pooled", "cnn"])
def test_functional_per_example_gradients_match_autograd(model) -> None:
    assert isinstance(model, PerExampleModel)
    g = _gen(7)
    theta = flatten(model.init(3, generator=g, dtype=torch.float64))
    x = torch.randn(3, 4, model.num_features, generator=g, dtype=torch.float64)
    y = torch.randint(0, model.num_classes, (3, 4), generator=g)
    per = model.per_example_grads(theta, x, y)
    assert per.shape == (3, 4, num_parameters(model))
    for j in range(3):
        for i in range(4):
            flat = theta[j].clone().requires_grad_(True)
            loss = F.cross_entropy(model.flat_logits(flat, x[j, i:i + 1]), y[j, i:i + 1])
            (want,) = torch.autograd.grad(loss, flat)
            torch.testing.assert_close(per[j, i], want, rtol=1e-10, atol=1e-12)
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(model.mean_grads(theta, x, y, mask, 4),
                               (per * mask[:, :, None]).sum(1) / 4, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(model.mean_grads(theta, x, y), per.mean(1))
