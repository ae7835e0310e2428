"""Coupling entries of ``privkit.torch``: ``make_private`` (one model, record-level DP-SGD)
and ``ClientsDpSgd`` (K clients batched) on their own, under add/remove one record, with
ghost clipping and ``torch.func`` per-example gradients on a small two-layer network."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

import privkit.torch.private as private
from privkit.torch import (
    ClientBatch,
    ClientsDpSgd,
    ClientStreams,
    GradMethod,
    LocalSgd,
    make_private,
    sampling_rates,
    steps_for_epochs,
)

from .harness import (
    ADD_REMOVE,
    D2,
    Entry,
    Tap,
    coupling_tests,
    spy_clients_dpsgd,
    toy_clients,
    with_record,
)

SETTINGS = st.fixed_dictionaries({
    "batch": st.sampled_from([2, 3]), "groups": st.integers(1, 2),
    "clip": st.sampled_from([0.05, 0.5, 5.0]),
    "method": st.sampled_from([GradMethod.GHOST, GradMethod.FUNC]),
    "momentum": st.sampled_from([0.0, 0.5]), "epochs": st.integers(1, 2),
    "clients": st.integers(1, 3), "target": st.integers(0, 2),
    "seed": st.integers(0, 10_000), "data": st.integers(0, 10_000)})


def network(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def run_private(s: dict[str, Any], tap: Tap) -> None:
    """``make_private`` on n = ``groups`` b + 1 records (so that one more record keeps the
    ``ceil(n / b)`` steps of an epoch and the divisor q n = b: public constants); D' appends
    one record. Release point: each step's clipped per-example gradient sum
    (``clipped_grad_sum``, before ``gaussian_noise`` and the division by q n), bound C.
    Coins: the Poisson uniforms and the noise share the generator, so the target's extra
    uniform shifts every later draw; D' gets D's coins for D's records (the target keeps its
    own) and D's noise. The clipped sums are coupled (D' steps with D's noisy gradient)."""
    b = s["batch"]
    n = s["groups"] * b + 1
    x, y = toy_clients(s["data"], [n])[0]
    if tap.side == D2:
        x, y = with_record((x, y), s["data"])
    tap.target = 0
    with pytest.MonkeyPatch.context() as mp:
        real_take, real_sum, real_noise = private.poisson_take, private.clipped_grad_sum, \
            private.gaussian_noise
        real_like = private.torch_gaussian_like

        def take(m: int, q: float, rng: Any) -> Any:
            def how(own: Any, ref: Any) -> Any:
                out = own.clone()
                out[:len(ref)] = ref
                return out

            t = tap.merge("poisson_take", real_take(m, q, rng), how)
            tap.ctx["hit"] = len(t) > n and bool(t[n])
            return t

        def clipped(module: Any, inputs: Any, targets: Any, **kw: Any) -> Any:
            got = real_sum(module, inputs, targets, **kw)
            tap.record("DpSgd.step", got.grads, s["clip"], key=(len(tap.releases),),
                       target=tap.ctx["hit"])
            return dataclasses.replace(got, grads=tap.couple("grads", lambda: got.grads))

        def noise(tree: Any, stddev: float, *, rng: Any) -> Any:
            return tap.couple("noise", lambda: real_noise(tree, stddev, rng=rng))

        def noise_like(leaf: Any, stddev: float, rng: Any) -> Any:  # the per-parameter draw
            return tap.couple("noise", lambda: real_like(leaf, stddev, rng))

        mp.setattr(private, "poisson_take", take)
        mp.setattr(private, "clipped_grad_sum", clipped)
        mp.setattr(private, "gaussian_noise", noise)
        mp.setattr(private, "torch_gaussian_like", noise_like)
        net = network(s["seed"])
        opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=s["momentum"])
        dp = make_private(net, opt, dataset=TensorDataset(torch.as_tensor(x),
                                                          torch.as_tensor(y)),
                          expected_batch_size=b, max_grad_norm=s["clip"], delta=1e-5,
                          noise_multiplier=1.0, method=s["method"],
                          generator=torch.Generator().manual_seed(s["seed"]))
        for _ in range(s["epochs"]):
            for xb, yb in dp.epoch():
                dp.step(xb, yb)


def run_clients(s: dict[str, Any], tap: Tap) -> None:
    """``ClientsDpSgd.run`` on ``clients`` clients with the same network; D' appends one
    record to client t (n_t = ``groups`` b + 1, so that its steps ``epochs ceil(n_i / b)``
    and its divisor q_i n_i = b stay: the rates are each run's own b / n_i, which only set
    the coins, coupled). Release point: each client's clipped per-example gradient sum at
    each step, bound C (``spy_clients_dpsgd``)."""
    b, k = s["batch"], s["clients"]
    rng = np.random.default_rng(s["data"])
    sizes = [int(v) for v in rng.integers(2, 7, k)]
    t = s["target"] % k
    sizes[t] = s["groups"] * b + 1
    data = toy_clients(s["data"], sizes)
    if tap.side == D2:
        data[t] = with_record(data[t], s["data"])
    width = max(len(yy) for _, yy in data)
    x = torch.zeros(k, width, 4)
    y = torch.zeros(k, width, dtype=torch.long)
    for i, (xx, yy) in enumerate(data):
        x[i, :len(yy)], y[i, :len(yy)] = torch.as_tensor(xx), torch.as_tensor(yy)
    keys = [5 + 11 * i for i in range(k)]
    tap.target = keys[t]
    net = network(s["seed"])
    params = {name: p.detach().expand(k, *p.shape).clone() for name, p in net.named_parameters()}
    with pytest.MonkeyPatch.context() as mp:
        spy_clients_dpsgd(mp, tap, target_key=keys[t], target_row=sizes[t], bound=s["clip"])
        dp = ClientsDpSgd(net, l2_clip_norm=s["clip"], noise_multiplier=1.0,
                          method=s["method"])
        own = [len(yy) for _, yy in data]
        dp.run(params, ClientBatch(x, y, torch.tensor(own)),
               steps=steps_for_epochs(own, s["epochs"], b),
               sampling_rates=sampling_rates(own, b), client_keys=keys,
               rng=ClientStreams(seed=s["seed"], round=1),
               update=LocalSgd(lr=0.5, momentum=s["momentum"], proximal_mu=0.1),
               anchor={name: p.detach() for name, p in net.named_parameters()})


WITNESS = {"batch": 2, "groups": 2, "clip": 0.05, "method": GradMethod.GHOST,
           "momentum": 0.5, "epochs": 2, "clients": 2, "target": 0, "seed": 0, "data": 0}

ENTRIES = [
    Entry("torch-make-private", ADD_REMOVE, SETTINGS, run_private, None, WITNESS),
    Entry("torch-clients-dpsgd", ADD_REMOVE, SETTINGS, run_clients, None, WITNESS),
]


test_coupling, test_witness_sees_the_target = coupling_tests(ENTRIES)
