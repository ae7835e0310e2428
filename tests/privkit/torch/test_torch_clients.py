"""privkit.torch.ClientsDpSgd: the batched path equals the per-client reference loop (same
draws), a client's update never depends on the other clients, per-client ledger charges
before any noise, the noise scale, SecureRandom and named errors."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from torch import nn

import privkit
import privkit.torch as pt
from privkit.errors import BudgetExceededError, InvalidParameterError
from privkit.ledger import Ledger

K, N = 5, 24
SIZES = torch.tensor([24, 9, 17, 5, 20])
STEPS = torch.tensor([3, 5, 0, 4, 2])
KEYS = [10, 3, 7, 99, 4]


def _stack(module, k, spread=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach().expand(k, *p.shape).clone()
            + spread * torch.randn(k, *p.shape, generator=g, dtype=p.dtype)
            for n, p in module.named_parameters()}


def _mlp(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def _data(dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(K, N, 5, generator=g, dtype=dtype)
    mask = torch.arange(N)[None, :] < SIZES[:, None]
    x = x * mask[..., None]  # zero padding, as a trainer pads
    return pt.ClientBatch(x, torch.randint(0, 3, (K, N), generator=g), SIZES)


def _kw(module, **over):
    kw = dict(steps=STEPS, sampling_rates=pt.sampling_rates(SIZES, 6), client_keys=KEYS,
              rng=pt.ClientStreams(seed=5, round=2),
              update=pt.LocalSgd(lr=0.3, momentum=0.5, proximal_mu=0.1),
              anchor={n: p.detach() for n, p in module.named_parameters()})
    kw.update(over)
    return kw


def _close(a, b, **tol):
    assert list(a) == list(b)
    for n in a:
        torch.testing.assert_close(a[n], b[n], **tol)


class _Scaled(nn.Module):
    """Its own parameter around a child: the torch.func fallback inside the client vmap."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(5))
        self.inner = nn.Linear(5, 3)

    def forward(self, x):
        return self.inner(torch.tanh(x * self.scale))


def _models():
    return {
        "cnn": lambda: nn.Sequential(nn.Unflatten(1, (1, 5)), nn.Conv1d(1, 4, 3, padding=1),
                                     nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                                     nn.LayerNorm(20), nn.Linear(20, 3)),
        "custom": lambda: nn.Sequential(_Scaled(), nn.ReLU(), nn.Linear(3, 3)),
    }


@pytest.mark.parametrize("method", [pt.GradMethod.GHOST, pt.GradMethod.FUNC])
@pytest.mark.parametrize("name", ["cnn", "custom"])
def test_batched_clients_equal_the_loop_for_other_layers(name, method):
    torch.manual_seed(0)
    net = _models()[name]().double()
    params, data = _stack(net, K), _data()
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.3, noise_multiplier=0.8, method=method)
    _close(dp.run(params, data, **_kw(net)), dp.reference_run(params, data, **_kw(net)),
           rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("method", [pt.GradMethod.GHOST, pt.GradMethod.FUNC])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_clients_equal_the_per_client_loop(dtype, method):
    net = _mlp(dtype)
    params, data = _stack(net, K), _data(dtype)
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.5, noise_multiplier=0.8, method=method)
    a = dp.run(params, data, **_kw(net))
    b = dp.reference_run(params, data, **_kw(net))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    _close(a, b, **tol)
    assert torch.equal(a["0.weight"][2], params["0.weight"][2])  # 0 steps: unchanged
    assert all(v.dtype == dtype for v in a.values())


def test_batched_clients_equal_the_loop_for_an_embedding_model():
    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(13, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    torch.manual_seed(0)
    net = Tokens().double()
    g = torch.Generator().manual_seed(2)
    data = pt.ClientBatch(torch.randint(0, 13, (K, N, 6), generator=g),
                          torch.randint(0, 3, (K, N), generator=g), SIZES)
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.2, noise_multiplier=1.1)
    _close(dp.run(_stack(net, K), data, **_kw(net)),
           dp.reference_run(_stack(net, K), data, **_kw(net)), rtol=1e-12, atol=1e-12)


def _logreg_clipped_sum(theta, x, y, factor):
    """A closed-form clipped sum (multinomial logistic regression, flat [W (3, 5); b (3)]):
    ||g_i||^2 = (||x_i||^2 + 1) ||r_i||^2, never materialising g_i."""
    k, b = x.shape[:2]
    w, bias = theta[:, :15].reshape(k, 3, 5), theta[:, 15:]
    r = torch.softmax(torch.einsum("kbf,kcf->kbc", x, w) + bias[:, None], -1)
    r = r - torch.nn.functional.one_hot(y, 3).to(r.dtype)
    sq = (x.double().pow(2).sum(2) + 1) * r.double().pow(2).sum(2)
    fr = r * factor(sq.sqrt()).to(r.dtype)[..., None]
    return torch.cat([torch.einsum("kbc,kbf->kcf", fr, x).reshape(k, 15), fr.sum(1)], 1)


def test_a_models_own_clipped_sum_equals_torch_func_and_the_loop():
    torch.manual_seed(0)
    net = nn.Linear(5, 3).double()
    params, data = _stack(net, K), _data()
    kw = _kw(net)
    own = pt.ClientsDpSgd(l2_clip_norm=0.5, noise_multiplier=0.8,
                          clipped_grad_sum=_logreg_clipped_sum)
    func = pt.ClientsDpSgd(net, l2_clip_norm=0.5, noise_multiplier=0.8)
    a = own.run(params, data, **kw)
    _close(a, func.run(params, data, **kw), rtol=1e-12, atol=1e-12)
    _close(a, own.reference_run(params, data, **kw), rtol=1e-12, atol=1e-12)


def test_a_clients_update_does_not_depend_on_the_other_clients():
    net = _mlp()
    params, data = _stack(net, K), _data()
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.5, noise_multiplier=0.8)
    kw = _kw(net)
    full = dp.run(params, data, **kw)
    for pick in ([3], [3, 1], [4, 3, 0]):  # alone, fewer, another order; narrower padding
        idx = torch.tensor(pick)
        width = int(SIZES[idx].max())
        sub = pt.ClientBatch(data.x[idx, :width], data.y[idx, :width], SIZES[idx])
        out = dp.run({n: v[idx] for n, v in params.items()}, sub,
                     **_kw(net, steps=STEPS[idx], sampling_rates=kw["sampling_rates"][idx],
                           client_keys=[KEYS[i] for i in pick]))
        for n in out:
            assert torch.equal(out[n], full[n][idx])
    moved = dp.run(params, data, **_kw(net, rng=pt.ClientStreams(seed=5, round=3)))
    assert not torch.equal(moved["0.weight"][0], full["0.weight"][0])


class _Log:
    def __init__(self):
        self.events = []


def _spy_draws(monkeypatch, log):
    """Log every client's draw of a step (its Poisson uniforms, then its noise)."""
    real = pt.ClientsDpSgd._client_draw

    def draw(gen, n, q, d, dtype):
        log.events.append(("noise", n))
        return real(gen, n, q, d, dtype)

    monkeypatch.setattr(pt.ClientsDpSgd, "_client_draw", staticmethod(draw))


class _SpyLedger(Ledger):
    """A Ledger (run refuses anything else) that logs its charges."""

    def __init__(self, log, budget=None):  # no Ledger.__init__: spend delegates
        self.log = log
        self.real = Ledger.create(None, population_id="spy", delta=1e-5, epsilon_budget=budget)

    def spend_many(self, charges, **kw):
        receipt = self.real.spend_many(charges, **kw)
        self.log.events += [("charge", tuple(ids), event, count) for ids, event, count in charges]
        return receipt


def test_each_client_is_charged_its_own_steps_before_any_noise(monkeypatch):
    log = _Log()
    _spy_draws(monkeypatch, log)
    net = _mlp()
    ledger = _SpyLedger(log)
    q = pt.sampling_rates(SIZES, 6)
    ids = ["a", "b", "c", "d", "e"]
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.5, noise_multiplier=0.8)
    dp.run(_stack(net, K), _data(), **_kw(net), ledger=ledger, client_ids=ids, round=7)
    kinds = [e[0] for e in log.events]
    assert kinds.count("noise") == int(STEPS.sum())  # one draw per client and step
    first_noise = kinds.index("noise")
    assert kinds[:first_noise] == ["charge"] * 4 and "charge" not in kinds[first_noise:]
    charged = {i: (ev, c) for _, grp, ev, c in log.events[:first_noise] for i in grp}
    assert set(charged) == {"a", "b", "d", "e"}  # client "c" has 0 steps
    for i, cid in enumerate(ids):
        if cid in charged:
            assert charged[cid] == (dp.step_event(float(q[i])), int(STEPS[i]))
    eps = ledger.real.epsilons()
    for i, cid in enumerate(ids):
        if cid in charged:
            want = privkit.epsilon(dp.client_event(float(q[i]), int(STEPS[i])), 1e-5).epsilon
            assert eps[cid] == pytest.approx(want, rel=1e-9)


def test_over_budget_nothing_is_charged_or_trained(monkeypatch):
    log = _Log()
    _spy_draws(monkeypatch, log)
    net = _mlp()
    ledger = _SpyLedger(log, budget=1.0)
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.5, noise_multiplier=0.8)
    with pytest.raises(BudgetExceededError, match="nothing was recorded"):
        dp.run(_stack(net, K), _data(), **_kw(net), ledger=ledger)
    assert log.events == [] and ledger.real.epsilons() == {}


def test_noise_per_client_has_stddev_lr_z_c_over_q_n():
    # zero gradients: client i moves by lr N(0, (z C / (q_i n_i))^2) per step; 2 clients with
    # 10050 coordinates each, chi-square at false-failure rate 1e-6 each; a mutant that divides
    # by n_i fails it
    net = nn.Linear(200, 50)
    sizes = torch.tensor([40, 100])
    data = pt.ClientBatch(torch.randn(2, 100, 200), torch.zeros(2, 100, dtype=torch.long),
                          sizes)
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.7, noise_multiplier=1.3,
                         loss_fn=lambda out, y: 0.0 * out.sum(1))
    params = _stack(net, 2, spread=0.0)
    q = pt.sampling_rates(sizes, 10)
    out = dp.run(params, data, steps=torch.tensor([1, 1]), sampling_rates=q, client_keys=[0, 1],
                 rng=pt.ClientStreams(seed=3), update=pt.LocalSgd(lr=0.5))
    for i in range(2):
        delta = torch.cat([(out[n][i] - params[n][i]).reshape(-1) for n in params]).double()
        sigma = 0.5 * 1.3 * 0.7 / (float(q[i]) * int(sizes[i]))
        m = delta.numel()
        stat = float((delta ** 2).sum()) / sigma**2
        assert stats.chi2.ppf(5e-7, m) <= stat <= stats.chi2.ppf(1 - 5e-7, m)
        wrong = stat * float(q[i]) ** 2  # the mutant divides by n_i instead of q_i n_i
        assert not stats.chi2.ppf(5e-7, m) <= wrong <= stats.chi2.ppf(1 - 5e-7, m)


def test_secure_random_trains_the_clients():
    net = _mlp()
    params, data = _stack(net, K), _data()
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.5, noise_multiplier=0.8)
    out = dp.run(params, data, **_kw(net, rng=privkit.SecureRandom()))
    assert all(bool(torch.isfinite(v).all()) for v in out.values())
    assert not torch.equal(out["0.weight"][0], params["0.weight"][0])
    with pytest.raises(InvalidParameterError, match="rng"):
        dp.reference_run(params, data, **_kw(net, rng=privkit.SecureRandom()))


def test_steps_and_rates_helpers():
    assert pt.steps_for_epochs([10, 45, 7], [2, 1, 0], 20).tolist() == [2, 3, 0]
    assert pt.sampling_rates([10, 40], 20).tolist() == [1.0, 0.5]
    dp = pt.ClientsDpSgd(nn.Linear(2, 2), l2_clip_norm=1.0, noise_multiplier=2.0)
    assert dp.step_event(1.0) == privkit.GaussianDpEvent(2.0)
    assert dp.client_event(0.5, 3) == privkit.gaussian_steps_event(2.0, 3, 0.5)
    with pytest.raises(InvalidParameterError, match="epochs"):
        pt.steps_for_epochs([10], [-1], 5)


def test_bad_arguments_are_named():
    net = _mlp()
    params, data = _stack(net, K), _data()
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.5, noise_multiplier=0.8)
    cases = [
        (dict(params={"x": params["0.weight"]}), "params"),
        (dict(data=pt.ClientBatch(data.x, data.y, torch.tensor([24, 9, 17, 5, 30]))),
         "data.sizes"),
        (dict(steps=torch.tensor([1, 1])), "steps"),
        (dict(steps=torch.tensor([1.0] * K)), "steps"),
        (dict(sampling_rates=torch.tensor([0.5, 0.5, 0.0, 0.5, 0.5])), "sampling_rates"),
        (dict(client_keys=[1, 1, 2, 3, 4]), "client_keys"),
        (dict(rng=torch.Generator()), "rng"),
        (dict(update=0.1), "update"),
        (dict(anchor=None), "anchor"),
        (dict(client_keys=[-1, 1, 2, 3, 4]), "client_keys"),
    ]
    for over, words in cases:
        kw = _kw(net)
        p, d = over.pop("params", params), over.pop("data", data)
        kw.update(over)
        with pytest.raises(InvalidParameterError, match=words):
            dp.run(p, d, **kw)
    with pytest.raises(InvalidParameterError, match="client_ids"):
        dp.run(params, data, **_kw(net), ledger=Ledger.create(None, population_id="p",
                                                               delta=1e-5), client_ids=["a"])
    for kw, words in [(dict(l2_clip_norm=math.inf), "l2_clip_norm"),
                      (dict(noise_multiplier=0.0), "noise_multiplier")]:
        args = dict(l2_clip_norm=1.0, noise_multiplier=1.0)
        args.update(kw)
        with pytest.raises(InvalidParameterError, match=words):
            pt.ClientsDpSgd(net, **args)
    with pytest.raises(InvalidParameterError, match="module"):
        pt.ClientsDpSgd(l2_clip_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(InvalidParameterError, match="momentum"):
        pt.LocalSgd(lr=0.1, momentum=1.0)


def test_dropout_trains_in_the_batched_form():
    # random layers draw from torch's global generator, differently per client
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 3))
    params, data = _stack(net, K, spread=0.0), _data(torch.float32)
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.5, noise_multiplier=0.8)
    out = dp.run(params, data, **_kw(net, anchor=None, update=pt.LocalSgd(lr=0.1)))
    assert all(bool(torch.isfinite(v).all()) for v in out.values())
