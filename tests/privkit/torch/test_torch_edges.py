"""privkit.torch at its edges: parameters used outside their module (tied embeddings, a
weight reused by ``F.linear``) refused by name on the ghost path and exact with
``GradMethod.FUNC``; GroupNorm on (B, C) input and 0-dim parameters; recurrent layers;
non-finite examples (zeroed, or raised, never charged twice, never NaN weights); the
ledger's type. Every number is checked against per-example autograd, one example at a
time."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import privkit
import privkit.torch as pt
from privkit.errors import InvalidParameterError
from privkit.ledger import Ledger
from privkit.mechanisms import NonFiniteUpdates
from privkit.torch import _layers

GHOST, FUNC = pt.GradMethod.GHOST, pt.GradMethod.FUNC
ZERO, RAISE = NonFiniteUpdates.ZERO, NonFiniteUpdates.RAISE


def _rows(inputs, i):
    return tuple(x[i:i + 1] for x in inputs)


def _loop(module, inputs, y, loss_fn=None):
    """Per-example gradients ``{name: (B, *shape)}`` by autograd, one example at a time."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    loss_fn = loss_fn or pt.cross_entropy_per_example
    out = {n: [] for n, _ in module.named_parameters()}
    for i in range(y.shape[0]):
        module.zero_grad()
        loss_fn(module(*_rows(inputs, i)), y[i:i + 1]).sum().backward()
        for n, p in module.named_parameters():
            out[n].append(p.grad.clone() if p.grad is not None else torch.zeros_like(p))
    return {n: torch.stack(v) for n, v in out.items()}


def _norms(per):
    return torch.sqrt(sum(v.reshape(v.shape[0], -1).pow(2).sum(1) for v in per.values()))


def _clipped_loop(per, clip):
    """``sum_i f_i g_i`` with privkit's factors; a non-finite example contributes nothing."""
    norms = _norms(per).double()
    dtype = next(iter(per.values())).dtype
    f = pt.clip_factors(norms, clip, dtype).to(dtype)
    ok = torch.isfinite(norms)
    return {n: torch.einsum("b,b...->...", f[ok], v[ok]) for n, v in per.items()}, norms


def _assert_equal_to_loop(module, inputs, y, method, tol=1e-10, loss_fn=None):
    per = _loop(module, inputs, y, loss_fn)
    norms = _norms(per).double()
    clip = float(norms.median())  # some examples clipped, some not
    want, _ = _clipped_loop(per, clip)
    got = pt.clipped_grad_sum(module, inputs, y, l2_clip_norm=clip, method=method,
                              loss_fn=loss_fn)
    torch.testing.assert_close(got.norms, norms, rtol=tol, atol=tol)
    assert list(got.grads) == list(want)
    for n in want:
        torch.testing.assert_close(got.grads[n], want[n], rtol=tol, atol=tol)


# ------------------------------------------------------------------ tied and reused parameters
class TiedLm(nn.Module):
    """Input and output embedding tied the usual way: the output layer is F.linear(h, E)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids).mean(1)))
        return F.linear(h, self.emb.weight)


class TiedByAssignment(nn.Module):
    """``out.weight = emb.weight``: one Parameter registered under two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids).mean(1)))


class Reused(nn.Module):
    """A Linear whose weight is used again by F.linear elsewhere in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.b(F.linear(torch.tanh(self.a(x)), self.a.weight))


def _tied_cases():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (7, 3), generator=g)
    return {
        "tied_lm": (TiedLm, ids, torch.randint(0, 11, (7,), generator=g), "'emb.weight'"),
        "assigned": (TiedByAssignment, ids, torch.randint(0, 11, (7,), generator=g),
                     "'out.weight'.*shared with 'emb.weight'"),
        "reused": (Reused, torch.randn(7, 4, generator=g, dtype=torch.float64),
                   torch.randint(0, 3, (7,), generator=g), "'a.weight'"),
    }


TIED = _tied_cases()


@pytest.mark.parametrize("name", sorted(TIED))
def test_a_parameter_used_outside_its_module_is_refused_by_name_on_the_ghost_path(name):
    make, x, y, words = TIED[name]
    torch.manual_seed(0)
    net = make().double()
    for call in (lambda: pt.per_example_norms(net, x, y),
                 lambda: pt.clipped_grad_sum(net, x, y, l2_clip_norm=1.0)):
        with pytest.raises(InvalidParameterError, match=words) as err:
            call()
        assert "(use GradMethod.FUNC)" in str(err.value)


@pytest.mark.parametrize("name", sorted(TIED))
def test_func_gives_tied_parameters_the_sum_over_their_uses(name):
    make, x, y, _ = TIED[name]
    torch.manual_seed(0)
    _assert_equal_to_loop(make().double(), x, y, FUNC, tol=1e-6)


def test_a_tied_model_is_refused_by_the_clients_before_anything_is_charged():
    torch.manual_seed(0)
    net = Reused().double()
    k, n = 2, 6
    params = {nm: p.detach().expand(k, *p.shape).clone() for nm, p in net.named_parameters()}
    data = pt.ClientBatch(torch.randn(k, n, 4, dtype=torch.float64),
                          torch.randint(0, 3, (k, n)), torch.tensor([6, 4]))
    ledger = Ledger.create(None, population_id="p", delta=1e-5)
    dp = pt.ClientsDpSgd(net, l2_clip_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(InvalidParameterError, match="'a.weight'.*GradMethod.FUNC"):
        dp.run(params, data, steps=torch.tensor([2, 2]), sampling_rates=[0.5, 0.5],
               client_keys=[0, 1], rng=pt.ClientStreams(seed=0), update=pt.LocalSgd(lr=0.1),
               ledger=ledger)
    assert ledger.epsilons() == {}


class DetachedTie(nn.Module):
    """The output layer reads the embedding without its gradient: not a use to refuse."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)

    def forward(self, ids):
        return F.linear(torch.tanh(self.mix(self.emb(ids).mean(1))), self.emb.weight.detach())


class InPlaceScale(nn.Module):
    """A module of its own that scales its input in place: its input's gradient edge moves
    during the call, which must not look like a use outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return x.mul_(self.scale)


@pytest.mark.parametrize("case", ["detached", "twice"])
def test_uses_inside_the_module_are_not_refused(case):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if case == "detached":
        net, x = DetachedTie().double(), torch.randint(0, 11, (7, 3), generator=g)
        y = torch.randint(0, 11, (7,), generator=g)
    else:  # one Linear called twice, and the same Linear object at two places
        lin = nn.Linear(5, 5)
        net = nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh(), nn.Linear(5, 3)).double()
        x, y = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.arange(7) % 3
    _assert_equal_to_loop(net, x, y, GHOST)


def test_an_in_place_write_to_a_modules_input_is_refused_by_ghost_and_exact_with_func():
    # the write moves the input's gradient edge into the module's own call; torch.func
    # cannot follow it per module, and the whole model by FUNC can
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 5), InPlaceScale(), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.arange(7) % 3
    with pytest.raises(InvalidParameterError, match="'1.scale'.*in-place.*GradMethod.FUNC|"
                                                    "'1.scale'.*GradMethod.FUNC.*in-place"):
        pt.per_example_norms(net, x, y)
    _assert_equal_to_loop(net, x, y, FUNC)


# ------------------------------------------------------------------ GroupNorm (B, C), 0-dim
class Temperature(nn.Module):
    """A learned scalar temperature: a 0-dim parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.t = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.lin(x) * self.t


def _small(name):
    torch.manual_seed(0)
    if name == "groupnorm_2d":
        return nn.Sequential(nn.Linear(4, 6), nn.GroupNorm(2, 6), nn.Linear(6, 3)).double()
    return Temperature().double()


@pytest.mark.parametrize("method", [GHOST, FUNC])
@pytest.mark.parametrize("name", ["groupnorm_2d", "scalar"])
def test_group_norm_on_2d_input_and_0_dim_parameters(name, method):
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.arange(7) % 3
    net = _small(name)
    _assert_equal_to_loop(net, x, y, method)
    if name == "scalar":
        assert pt.per_example_grads(net, x, y)["t"].shape == (7,)


@pytest.mark.parametrize("method", [GHOST, FUNC])
@pytest.mark.parametrize("name", ["groupnorm_2d", "scalar"])
def test_clients_train_group_norm_2d_and_0_dim_parameters_as_the_loop(name, method):
    net = _small(name)
    k, n = 3, 8
    g = torch.Generator().manual_seed(3)
    params = {nm: p.detach().expand(k, *p.shape).clone() for nm, p in net.named_parameters()}
    data = pt.ClientBatch(torch.randn(k, n, 4, generator=g, dtype=torch.float64),
                          torch.randint(0, 3, (k, n), generator=g), torch.tensor([8, 5, 7]))
    kw = dict(steps=torch.tensor([3, 2, 1]), sampling_rates=[0.5, 0.6, 0.4], client_keys=[0, 1, 2],
              rng=pt.ClientStreams(seed=1), update=pt.LocalSgd(lr=0.2, momentum=0.5))
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.3, noise_multiplier=0.7, method=method)
    a, b = dp.run(params, data, **kw), dp.reference_run(params, data, **kw)
    for nm in a:
        torch.testing.assert_close(a[nm], b[nm], rtol=1e-11, atol=1e-12)


# ------------------------------------------------------------------ recurrent layers
class Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[1][0][-1])  # the final hidden state: (1, B, 5)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_an_lstm_gets_torch_func_on_the_default_path_and_says_so(caplog):
    torch.manual_seed(0)
    net = Lstm()  # float32: torch.func cannot follow the float64 CPU kernel's in-place writes
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(6, 7, 4, generator=g), torch.arange(6) % 3
    with caplog.at_level(logging.INFO, logger="privkit.torch"):
        _assert_equal_to_loop(net, x, y, GHOST, tol=1e-5)
        pt.per_example_norms(net, x, y)
    told = [r for r in caplog.records if "GradMethod.FUNC" in r.getMessage()]
    assert len(told) == 1 and "'rnn'" in told[0].getMessage() and "LSTM" in told[0].getMessage()
    data = TensorDataset(x, y)
    dp = pt.make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), dataset=data,
                         expected_batch_size=3, max_grad_norm=1.0, delta=1e-5,
                         noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    assert dp.method is FUNC
    for xb, yb in dp.epoch():
        dp.step(xb, yb)
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters())
    # a frozen recurrent layer has nothing to differentiate: the ghost path stays
    net.rnn.requires_grad_(False)
    assert pt.make_private(net, torch.optim.SGD(net.head.parameters(), lr=0.1), dataset=data,
                           expected_batch_size=3, max_grad_norm=1.0, delta=1e-5,
                           noise_multiplier=1.0,
                           generator=torch.Generator().manual_seed(0)).method is GHOST


@pytest.mark.parametrize("method", [GHOST, FUNC])
def test_the_clients_refuse_a_recurrent_layer_by_name(method):
    with pytest.raises(InvalidParameterError, match="'rnn'.*make_private.*LSTM"):
        pt.ClientsDpSgd(Lstm(), l2_clip_norm=1.0, noise_multiplier=1.0, method=method)


# ------------------------------------------------------------------ non-finite examples
class TokensScaled(nn.Module):
    """Embedding, LayerNorm and Linear; a float input per example scales the features (NaN
    there makes every layer's per-example values NaN for that example)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids, scale):
        return self.head(self.norm(self.emb(ids)).mean(1) * scale[:, None])


def _nonfinite_cases():
    g = torch.Generator().manual_seed(5)

    def randn(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    return {
        "mlp": (lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)),
                (randn(7, 4),)),
        "wide": (lambda: nn.Sequential(nn.Linear(8, 8), nn.Flatten(), nn.Linear(24, 3)),
                 (randn(7, 3, 8),)),
        "cnn": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4),
                                      nn.ReLU(), nn.Conv2d(4, 2, 3, groups=2), nn.Flatten(),
                                      nn.Linear(32, 3)), (randn(7, 2, 6, 6),)),
        "tokens": (TokensScaled, (torch.randint(0, 11, (7, 5), generator=g), randn(7))),
        "scalar": (Temperature, (randn(7, 4),)),
    }


NONFINITE = _nonfinite_cases()
Y7 = torch.tensor([0, 1, 2, 1, 0, 2, 1])


def _poison(inputs, row, value):
    """A copy of the inputs with example ``row``'s float input set to ``value``."""
    out = [x.clone() for x in inputs]
    j = next(i for i, x in enumerate(out) if x.is_floating_point())
    out[j][row] = value
    return tuple(out)


@pytest.mark.parametrize("method,materialise", [(GHOST, True), (GHOST, False), (FUNC, True)])
@pytest.mark.parametrize("name", sorted(NONFINITE))
def test_a_non_finite_example_contributes_zeros_and_the_others_are_unchanged(
        name, method, materialise, monkeypatch):
    monkeypatch.setattr(_layers, "ROUTE", "materialise" if materialise else "ghost")
    torch.manual_seed(0)
    make, inputs = NONFINITE[name]
    net = make().double()
    for row, value in [(2, float("nan")), (5, float("inf"))]:
        bad = _poison(inputs, row, value)
        per = _loop(net, bad, Y7)
        want, norms = _clipped_loop(per, 0.05)
        assert not bool(torch.isfinite(norms[row]))
        s = pt.clipped_grad_sum(net, bad, Y7, l2_clip_norm=0.05, method=method)
        for n in want:
            assert bool(torch.isfinite(s.grads[n]).all())
            torch.testing.assert_close(s.grads[n], want[n], rtol=1e-10, atol=1e-12)
        # its contribution alone is exactly 0 <= C: the sensitivity bound holds
        alone = pt.clipped_grad_sum(net, _rows(bad, row), Y7[row:row + 1],
                                    l2_clip_norm=0.05, method=method)
        assert all(not bool(v.any()) for v in alone.grads.values())
        with pytest.raises(InvalidParameterError, match=rf"inputs\[{row}\].*RAISE"):
            pt.clipped_grad_sum(net, bad, Y7, l2_clip_norm=0.05, method=method,
                                nonfinite=RAISE)


def test_a_padding_row_with_nan_is_left_out_and_never_raises():
    torch.manual_seed(0)
    make, inputs = NONFINITE["mlp"]
    net = make().double()
    w = torch.ones(7, dtype=torch.float64)
    w[3] = 0.0
    clean = pt.clipped_grad_sum(net, inputs, Y7, l2_clip_norm=0.1, weights=w)
    for policy in (ZERO, RAISE):
        s = pt.clipped_grad_sum(net, _poison(inputs, 3, float("nan")), Y7, l2_clip_norm=0.1,
                                weights=w, nonfinite=policy)
        for n in s.grads:
            torch.testing.assert_close(s.grads[n], clean.grads[n], rtol=1e-12, atol=1e-14)


def _dpsgd(nonfinite=ZERO, ledger=None):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    data = TensorDataset(torch.randn(20, 4, dtype=torch.float64), torch.arange(20) % 3)
    dp = pt.make_private(net, torch.optim.SGD(net.parameters(), lr=0.5), dataset=data,
                         expected_batch_size=5, max_grad_norm=0.5, delta=1e-5,
                         noise_multiplier=1.0, generator=torch.Generator().manual_seed(7),
                         ledger=ledger, client_id=None if ledger is None else "alice",
                         nonfinite=nonfinite)
    return dp, net


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def test_a_nan_row_in_a_step_is_zeroed_charged_once_and_the_weights_stay_finite():
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.arange(6) % 3
    bad = x.clone()
    bad[1, 2] = float("nan")
    keep = torch.arange(6) != 1
    ledger = Ledger.create(None, population_id="p", delta=1e-5)
    dp, net = _dpsgd(ledger=ledger)
    ref, ref_net = _dpsgd()  # the same weights and noise stream, the row never there
    dp.step(bad, y)
    ref.step(x[keep], y[keep])
    after = _flat(net)
    assert bool(torch.isfinite(after).all())
    torch.testing.assert_close(after, _flat(ref_net), rtol=1e-12, atol=1e-12)
    assert dp.steps == 1
    assert ledger.epsilons()["alice"] == pytest.approx(dp.epsilon().epsilon, rel=1e-9)
    one = privkit.epsilon(dp.step_event(), 1e-5).epsilon
    assert ledger.epsilons()["alice"] == pytest.approx(one, rel=1e-9)


def test_a_model_with_infinite_outputs_never_makes_the_weights_nan():
    dp, net = _dpsgd()
    with torch.no_grad():
        net[2].bias.fill_(float("inf"))  # every example's output is inf
    before = _flat(net)
    dp.step(torch.randn(5, 4, dtype=torch.float64), torch.arange(5) % 3)
    moved = _flat(net) - before
    weights = torch.cat([net[0].weight.reshape(-1), net[0].bias, net[2].weight.reshape(-1)])
    assert bool(torch.isfinite(weights).all()) and dp.steps == 1
    assert bool(moved[:-3].abs().sum() > 0)  # the step released noise


def test_raise_names_the_example_and_charges_nothing():
    ledger = Ledger.create(None, population_id="p", delta=1e-5)
    dp, net = _dpsgd(nonfinite=RAISE, ledger=ledger)
    before = _flat(net)
    x = torch.randn(6, 4, dtype=torch.float64)
    x[4, 0] = float("inf")
    with pytest.raises(InvalidParameterError, match=r"inputs\[4\].*NonFiniteUpdates.RAISE"):
        dp.step(x, torch.arange(6) % 3)
    assert dp.steps == 0 and ledger.epsilons() == {}
    assert torch.equal(_flat(net), before)
    dp.step(x[:4], torch.arange(4) % 3)  # a finite batch is one step, charged once
    assert dp.steps == 1
    assert ledger.epsilons()["alice"] == pytest.approx(dp.epsilon().epsilon, rel=1e-9)


K, N = 3, 10
SIZES = torch.tensor([10, 6, 8])


def _clients_data(nan_at=(), seed=9):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(K, N, 4, generator=g, dtype=torch.float64)
    for i, j in nan_at:
        x[i, j, 1] = float("nan")
    return pt.ClientBatch(x, torch.randint(0, 3, (K, N), generator=g), SIZES)


def _logreg_sum(theta, x, y, factor):
    """A closed-form clipped sum (flat [W (3, 4); b (3)]) that is not NaN-safe by itself."""
    k = x.shape[0]
    w, bias = theta[:, :12].reshape(k, 3, 4), theta[:, 12:]
    r = torch.softmax(torch.einsum("kbf,kcf->kbc", x, w) + bias[:, None], -1)
    r = r - F.one_hot(y, 3).to(r.dtype)
    sq = (x.pow(2).sum(2) + 1) * r.pow(2).sum(2)
    fr = r * factor(sq.sqrt()).to(r.dtype)[..., None]
    return torch.cat([torch.einsum("kbc,kbf->kcf", fr, x).reshape(k, 12), fr.sum(1)], 1)


def _clients(kind, nonfinite=ZERO):
    torch.manual_seed(0)
    net = nn.Linear(4, 3).double()
    if kind == "own":
        dp = pt.ClientsDpSgd(net, l2_clip_norm=0.3, noise_multiplier=0.8,
                             clipped_grad_sum=_logreg_sum, nonfinite=nonfinite)
    else:
        dp = pt.ClientsDpSgd(net, l2_clip_norm=0.3, noise_multiplier=0.8,
                             method=GHOST if kind == "ghost" else FUNC, nonfinite=nonfinite)
    params = {n: p.detach().expand(K, *p.shape).clone() for n, p in net.named_parameters()}
    kw = dict(steps=torch.tensor([4, 3, 0]), sampling_rates=[0.5, 0.6, 0.5],
              client_keys=[0, 1, 2], rng=pt.ClientStreams(seed=2), update=pt.LocalSgd(lr=0.3))
    return dp, params, kw


@pytest.mark.parametrize("kind", ["ghost", "func", "own"])
def test_clients_zero_a_nan_record_as_the_loop_does(kind):
    # client 0's record 2 and client 1's record 3 hold NaN, as do client 1's padding rows
    # (6..9) and client 2 (no steps); the loop leaves a sampled NaN record out
    nan_at = [(0, 2), (1, 3), (1, 7), (1, 9), (2, 0)]
    dp, params, kw = _clients(kind)
    data = _clients_data(nan_at)
    out = dp.run(params, data, **kw)
    assert all(bool(torch.isfinite(v).all()) for v in out.values())
    ref = dp.reference_run(params, data, **kw)
    for n in out:
        torch.testing.assert_close(out[n], ref[n], rtol=1e-11, atol=1e-12)
    # the padding rows never reach the sum, whatever they hold
    clean_pad = _clients_data([(0, 2), (1, 3)])
    padded = dp.run(params, clean_pad, **kw)
    for n in out:
        torch.testing.assert_close(out[n], padded[n], rtol=1e-12, atol=1e-14)


def test_clients_raise_on_a_nan_record_before_anything_is_charged():
    dp, params, kw = _clients("ghost", nonfinite=RAISE)
    ledger = Ledger.create(None, population_id="p", delta=1e-5)
    with pytest.raises(InvalidParameterError, match=r"data.x\[1, 3\].*RAISE"):
        dp.run(params, _clients_data([(1, 3)]), **kw, ledger=ledger)
    assert ledger.epsilons() == {}
    # padding rows, and clients without steps, are not records to refuse
    dp.run(params, _clients_data([(1, 8), (2, 1)]), **kw, ledger=ledger)
    assert sorted(ledger.epsilons()) == ["0", "1"]


def test_clients_raise_names_a_sampled_example_whose_gradient_is_not_finite():
    torch.manual_seed(0)
    net = nn.Linear(4, 3).double()
    with torch.no_grad():
        net.bias[0] = float("inf")  # finite records, infinite outputs
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.3, noise_multiplier=0.8, nonfinite=RAISE)
    params = {n: p.detach().expand(K, *p.shape).clone() for n, p in net.named_parameters()}
    kw = dict(steps=torch.tensor([1, 1, 1]), sampling_rates=[1.0, 1.0, 1.0],
              client_keys=[0, 1, 2], rng=pt.ClientStreams(seed=2), update=pt.LocalSgd(lr=0.3))
    with pytest.raises(InvalidParameterError, match=r"data.x\[0, 0\] \(step 1\).*RAISE"):
        dp.run(params, _clients_data(), **kw)
    out = pt.ClientsDpSgd(net, l2_clip_norm=0.3, noise_multiplier=0.8).run(
        params, _clients_data(), **kw)  # ZERO: every example left out, the noise applied
    assert bool(torch.isfinite(out["weight"]).all())
    assert bool(torch.isfinite(out["bias"][:, 1:]).all())
    assert not torch.equal(out["weight"], params["weight"])


# ------------------------------------------------------------------ named arguments
def test_the_nonfinite_policy_and_the_ledger_are_checked_up_front():
    net = nn.Linear(4, 3)
    data = TensorDataset(torch.randn(10, 4), torch.arange(10) % 3)
    base = dict(dataset=data, expected_batch_size=2, max_grad_norm=1.0, delta=1e-5,
                noise_multiplier=1.0, generator=torch.Generator())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(InvalidParameterError, match="^ledger .*privkit.ledger.Ledger"):
        pt.make_private(net, opt, **base, ledger=object(), client_id="a")
    with pytest.raises(InvalidParameterError, match="^nonfinite .*NonFiniteUpdates"):
        pt.make_private(net, opt, **base, nonfinite="zero")
    with pytest.raises(InvalidParameterError, match="^nonfinite"):
        pt.ClientsDpSgd(net, l2_clip_norm=1.0, noise_multiplier=1.0, nonfinite="raise")
    with pytest.raises(InvalidParameterError, match="^nonfinite"):
        pt.clipped_grad_sum(net, torch.randn(3, 4), torch.arange(3), l2_clip_norm=1.0,
                            nonfinite=None)
    dp, params, kw = _clients("ghost")
    with pytest.raises(InvalidParameterError, match="^ledger"):
        dp.run(params, _clients_data(), **kw, ledger=object())
