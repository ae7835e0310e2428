"""privkit.torch.make_private: noise scale on the update, Poisson rate, charge-before-noise
order, epsilon, calibration, SecureRandom and named errors.

Statistical tests use fixed seeds; each states its false-failure rate, and each has a
deliberately wrong variant that must fail it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import privkit
import privkit.torch as pt
from privkit.errors import BudgetExceededError, InvalidParameterError
from privkit.ledger import Ledger


def _data(n=100, f=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, f, generator=g), torch.randint(0, 5, (n,), generator=g))


def _zero_loss(out, y):
    return 0.0 * out.sum(1)  # every per-example gradient is 0: the update is the noise


def _updates(dp, epochs=1):
    """(parameter change, realised batch size) of every step."""
    out = []
    for _ in range(epochs):
        for x, y in dp.epoch():
            before = torch.cat([p.detach().reshape(-1).clone() for p in dp.module.parameters()])
            dp.step(x, y)
            after = torch.cat([p.detach().reshape(-1) for p in dp.module.parameters()])
            out.append((after - before, len(y)))
    return out


def _variance_ok(samples, sigma, alpha=1e-6):
    """Two-sided chi-square test that i.i.d. N(0, sigma^2) samples have variance sigma^2 (the
    mean is known to be 0): false-failure rate alpha."""
    m = samples.numel()
    stat = float((samples.double() ** 2).sum()) / sigma**2
    return stats.chi2.ppf(alpha / 2, m) <= stat <= stats.chi2.ppf(1 - alpha / 2, m)


def _make(generator, z=1.3, clip=0.7, n=100, b=10, loss_fn=_zero_loss, **kw):
    torch.manual_seed(0)
    net = nn.Linear(200, 50)
    return pt.make_private(net, torch.optim.SGD(net.parameters(), lr=1.0), dataset=_data(n),
                           expected_batch_size=b, max_grad_norm=clip, delta=1e-5,
                           noise_multiplier=z, generator=generator, loss_fn=loss_fn, **kw)


@pytest.mark.parametrize("rng", ["torch", "secure"])
def test_noise_on_the_update_has_stddev_z_c_over_q_n(rng):
    # 3 steps, 10050 coordinates each; false-failure rate 3e-6 (1e-6 per step)
    gen = torch.Generator().manual_seed(5) if rng == "torch" else privkit.SecureRandom()
    dp = _make(gen, n=100, b=10)
    ups = _updates(dp)[:3]
    sigma = 1.3 * 0.7 / (0.1 * 100)
    assert all(_variance_ok(u, sigma) for u, _ in ups)
    # mutants: the noise without C, and the division by the realised batch size
    assert not all(_variance_ok(u / 0.7, sigma) for u, _ in ups)
    realised = [(u * (0.1 * 100) / max(size, 1), size) for u, size in ups]
    assert any(size != 10 for _, size in realised)  # the seed gives different sizes
    assert not all(_variance_ok(u, sigma) for u, size in realised)


@pytest.mark.parametrize("rng", ["torch", "secure"])
def test_the_empirical_poisson_rate_is_q(rng):
    # 400 steps over 1000 records at q = 0.03: the count is Binomial(400000, 0.03); 5 standard
    # deviations: false-failure rate 6e-7. A sampler at 1.1 q is 11 deviations off.
    gen = torch.Generator().manual_seed(11) if rng == "torch" else privkit.SecureRandom()
    n, q, steps = 1000, 0.03, 400
    sampler = pt.PoissonBatchSampler(n, q, steps, generator=gen)
    batches = list(sampler)
    assert len(batches) == steps == len(sampler)
    count = sum(len(b) for b in batches)
    sd = math.sqrt(n * steps * q * (1 - q))

    def ok(c):
        return abs(c - n * steps * q) <= 5 * sd

    assert ok(count)
    assert all(len(set(b)) == len(b) and all(0 <= i < n for i in b) for b in batches)
    wrong = pt.PoissonBatchSampler(n, 1.1 * q, steps, generator=gen)
    assert not ok(sum(len(b) for b in wrong))


def test_empty_batches_are_steps_with_noise_only():
    dp = _make(torch.Generator().manual_seed(3), n=50, b=1, loss_fn=None)
    ups = _updates(dp)
    sizes = [s for _, s in ups]
    assert len(ups) == 50 == dp.steps and 0 in sizes
    assert all(bool(u.abs().sum() > 0) for u, s in ups if s == 0)


class _Log:
    def __init__(self):
        self.events = []

    def charged(self):
        return sum(c for kind, c in self.events if kind == "charge")


class _SpyLedger(Ledger):
    """A Ledger (make_private refuses anything else) that logs its charges."""

    def __init__(self, log, budget=None):  # no Ledger.__init__: spend delegates
        self.log = log
        self.real = Ledger.create(None, population_id="spy", delta=1e-5, epsilon_budget=budget)

    def spend(self, ids, event, *, count=1, **kw):
        receipt = self.real.spend(ids, event, count=count, **kw)
        self.log.events.append(("charge", count))
        return receipt


class _SpyRandom(privkit.SecureRandom):
    log: _Log

    def gaussian(self, stddev, size=None):
        type(self).log.events.append(("noise", 1))
        return super().gaussian(stddev, size)


def _order(log):
    charged, steps, out = 0, 0, []
    for kind, c in log.events:
        if kind == "charge":
            charged += c
        else:
            steps += 1
            out.append(charged >= math.ceil(steps / 2))  # two leaves (weight, bias) per step
    return out


@pytest.mark.parametrize("per_epoch", [True, False])
def test_every_step_is_charged_before_its_noise_is_drawn(per_epoch):
    log = _Log()
    _SpyRandom.log = log
    ledger = _SpyLedger(log)
    dp = _make(_SpyRandom(), n=40, b=10, loss_fn=None, ledger=ledger, client_id="alice")
    if per_epoch:
        _updates(dp, epochs=2)
        assert [e for e in log.events if e[0] == "charge"] == [("charge", 4), ("charge", 4)]
    else:
        for x, y in dp.loader:  # batches outside epoch(): each step charges itself
            dp.step(x, y)
        assert [e for e in log.events if e[0] == "charge"] == [("charge", 1)] * 4
    order = _order(log)
    assert order and all(order)
    assert log.charged() >= dp.steps
    assert ledger.real.epsilons()["alice"] == pytest.approx(dp.epsilon().epsilon, rel=1e-9)


def test_the_torch_generators_draws_are_charged_first_and_are_gaussian_noises(monkeypatch):
    """With a torch.Generator, step() draws each parameter's noise through
    torch_gaussian_like (checked once a step, not per tensor): every draw still comes after
    its step's charge, and the draws are exactly gaussian_noise's."""
    from privkit.mechanisms.sampling import gaussian_noise, torch_gaussian_like
    from privkit.torch import private

    log = _Log()

    def spy(leaf, stddev, rng):
        log.events.append(("noise", 1))
        return torch_gaussian_like(leaf, stddev, rng)

    monkeypatch.setattr(private, "torch_gaussian_like", spy)
    ledger = _SpyLedger(log)
    dp = _make(torch.Generator().manual_seed(3), n=40, b=10, loss_fn=None, ledger=ledger,
               client_id="carol")
    _updates(dp, epochs=1)
    order = _order(log)
    assert len(order) == 2 * dp.steps and all(order)
    leaf = torch.zeros(3, 4)
    a = torch_gaussian_like(leaf, 0.7, torch.Generator().manual_seed(9))
    b = gaussian_noise({"w": leaf}, 0.7, rng=torch.Generator().manual_seed(9))["w"]
    assert torch.equal(a, b) and a.dtype == leaf.dtype


def test_the_order_check_catches_noise_before_the_charge():
    log = _Log()
    log.events = [("noise", 1), ("noise", 1), ("charge", 1)]
    assert not all(_order(log))


def test_over_budget_nothing_is_drawn_or_changed(monkeypatch):
    log = _Log()
    _SpyRandom.log = log
    dp = _make(_SpyRandom(), z=0.5, n=40, b=10, ledger=_SpyLedger(log, budget=0.5),
               client_id="bob")
    before = [p.detach().clone() for p in dp.module.parameters()]
    with pytest.raises(BudgetExceededError, match="bob"):
        next(iter(dp.epoch()))
    assert log.events == [] and dp.steps == 0
    assert all(torch.equal(a, p) for a, p in zip(before, dp.module.parameters()))


def test_epsilon_is_the_composed_step_events():
    dp = _make(torch.Generator().manual_seed(0), n=100, b=10, loss_fn=None)
    assert dp.epsilon().epsilon == 0.0
    _updates(dp, epochs=2)
    assert dp.steps == 20
    want = privkit.epsilon(privkit.gaussian_steps_event(1.3, 20, 0.1), 1e-5)
    assert dp.epsilon().epsilon == want.epsilon
    assert dp.event() == privkit.SelfComposedDpEvent(
        privkit.PoissonSampledDpEvent(0.1, privkit.GaussianDpEvent(1.3)), 20)
    assert dp.epsilon(1e-3).epsilon < want.epsilon


def test_target_epsilon_is_calibrated_and_met():
    torch.manual_seed(0)
    net = nn.Linear(200, 5)
    dp = pt.make_private(net, torch.optim.SGD(net.parameters(), lr=0.1),
                         DataLoader(_data(100), batch_size=25), max_grad_norm=1.0,
                         delta=1e-5, target_epsilon=2.0, epochs=3,
                         generator=torch.Generator().manual_seed(0))
    assert dp.sampling_probability == 0.25 and len(dp.loader) == dp.steps_per_epoch == 4
    want = privkit.calibrate_noise_multiplier(target_epsilon=2.0, delta=1e-5, steps=12,
                                              sampling_probability=0.25)
    assert dp.noise_multiplier == want.noise_multiplier
    _updates(dp, epochs=3)
    assert dp.epsilon().epsilon <= 2.0


def test_a_digits_model_learns_and_secure_mode_trains():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    ds = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    dp = pt.make_private(net, torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.5),
                         dataset=ds, expected_batch_size=64, max_grad_norm=1.0,
                         delta=1e-5, noise_multiplier=1.0, generator=privkit.SecureRandom())
    for _ in range(3):
        for xb, yb in dp.epoch():
            dp.step(xb, yb)
    with torch.no_grad():
        acc = float((net(ds.tensors[0]).argmax(1) == ds.tensors[1]).float().mean())
    assert acc > 0.5


def test_bad_arguments_are_named():
    net = nn.Linear(200, 5)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    base = dict(dataset=_data(), expected_batch_size=10, max_grad_norm=1.0, delta=1e-5,
                noise_multiplier=1.0, generator=torch.Generator())

    def call(**kw):
        args = dict(base)
        args.update(kw)
        return pt.make_private(net, opt, **{k: v for k, v in args.items() if v is not None})

    cases = [
        (dict(max_grad_norm=float("nan")), "max_grad_norm.*nan"),
        (dict(delta=0.0), "delta"),
        (dict(noise_multiplier=-1.0), "noise_multiplier.*-1.0"),
        (dict(target_epsilon=1.0), "noise_multiplier.*exactly one"),
        (dict(noise_multiplier=None, target_epsilon=1.0), "epochs"),
        (dict(dataset=None), "data_loader.*exactly one"),
        (dict(expected_batch_size=None), "expected_batch_size"),
        (dict(expected_batch_size=101), "expected_batch_size.*101"),
        (dict(generator=np.random.default_rng(0)), "generator"),
        (dict(client_id=None, ledger=Ledger.create(None, population_id="p", delta=1e-5)),
         "client_id"),
        (dict(method="ghost"), "method"),
    ]
    for kw, words in cases:
        with pytest.raises(InvalidParameterError, match=words):
            call(**kw)
    other = nn.Parameter(torch.zeros(3))
    with pytest.raises(InvalidParameterError, match="optimizer.*outside the module"):
        pt.make_private(net, torch.optim.SGD([*net.parameters(), other], lr=0.1), **base)
    with pytest.raises(InvalidParameterError, match="BatchNorm1d"):
        bn = nn.Sequential(nn.Linear(200, 5), nn.BatchNorm1d(5))
        pt.make_private(bn, torch.optim.SGD(bn.parameters(), lr=0.1), **base)
    with pytest.raises(InvalidParameterError, match="sampling_probability"):
        pt.PoissonBatchSampler(10, 1.5, 2, generator=torch.Generator())
