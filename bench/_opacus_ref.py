"""Centralised DP-SGD on digits, by privkit's batched local DP-SGD and by Opacus, same settings.

Both get the same records (digits, one client), the same initial parameters (privkit's
init, copied into the ``nn.Module``), the same clip C, noise multiplier z, Poisson rate q,
number of steps, learning rate and momentum; only their random draws differ. Opacus is a
bench-only dependency (``pip install opacus``); privkit never imports it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from fl_examples.core.dpsgd import DpSgdSettings, client_streams, local_dpsgd
from fl_examples.core.local import pad_clients
from fl_examples.core.models import MLP, MultinomialLogReg

HIDDEN = 128


def digits_pooled(n_train: int = 1400, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Digits features in [0, 1], a fixed train/test split (n_train records to train)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = x / 16.0
    order = np.random.default_rng(seed).permutation(len(y))
    tr, te = order[:n_train], order[n_train:]
    return x[tr], y[tr], x[te], y[te]


def _model(name: str) -> Any:
    return MultinomialLogReg(64, 10) if name == "logreg" else MLP(64, HIDDEN, 10)


def _accuracy(model: Any, params: dict[str, torch.Tensor], x: np.ndarray, y: np.ndarray) -> float:
    xt = torch.as_tensor(x, dtype=torch.float32)[None]
    logits = model.forward(params, xt)[0]
    return float((logits.argmax(1).numpy() == y).mean())


def privkit_run(name: str, data: tuple[np.ndarray, ...], *, clip: float, z: float,
                batch: int, epochs: int, lr: float, momentum: float, seed: int
                ) -> tuple[float, float]:
    """(test accuracy, seconds) of privkit's DP-SGD (one client of the batched solver)."""
    xtr, ytr, xte, yte = data
    model = _model(name)
    p = model.init(1, generator=torch.Generator().manual_seed(1000 + seed))
    cd = pad_clients([xtr], [ytr])
    t0 = time.perf_counter()
    out = local_dpsgd(model, p, {k: v[0] for k, v in p.items()}, cd,
                      epochs=torch.tensor([epochs]), settings=DpSgdSettings(clip, z, batch),
                      lr=lr, momentum=momentum, proximal_mu=0.0, clients=[0],
                      rng=client_streams(seed, 1))
    secs = time.perf_counter() - t0
    return _accuracy(model, out, xte, yte), secs


def _module(name: str, init: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The same network as an nn.Module, with privkit's initial parameters (weights are
    stored (fan_in, fan_out) in privkit, (out, in) in nn.Linear)."""
    if name == "logreg":
        m = torch.nn.Linear(64, 10)
        with torch.no_grad():
            m.weight.copy_(init["weight"][0].T)
            m.bias.copy_(init["bias"][0])
        return m
    m = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(),
                            torch.nn.Linear(HIDDEN, 10))
    with torch.no_grad():
        m[0].weight.copy_(init["w1"][0].T)
        m[0].bias.copy_(init["b1"][0])
        m[2].weight.copy_(init["w2"][0].T)
        m[2].bias.copy_(init["b2"][0])
    return m


def opacus_run(name: str, data: tuple[np.ndarray, ...], *, clip: float, z: float,
               batch: int, epochs: int, lr: float, momentum: float, seed: int
               ) -> tuple[float, float, float]:
    """(test accuracy, seconds, Opacus's own epsilon at delta 1e-5) with Opacus."""
    import warnings

    from opacus import PrivacyEngine

    xtr, ytr, xte, yte = data
    n = len(ytr)
    if n % batch:
        raise ValueError("use n divisible by the batch size, so both sample at q = b / n")
    init = _model(name).init(1, generator=torch.Generator().manual_seed(1000 + seed))
    module = _module(name, init)
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    ds = torch.utils.data.TensorDataset(torch.as_tensor(xtr, dtype=torch.float32),
                                        torch.as_tensor(ytr, dtype=torch.int64))
    loader = torch.utils.data.DataLoader(ds, batch_size=batch)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="prv")
        module, opt, loader = engine.make_private(
            module=module, optimizer=opt, data_loader=loader, noise_multiplier=z,
            max_grad_norm=clip, poisson_sampling=True)
        loss_fn = torch.nn.CrossEntropyLoss()
        t0 = time.perf_counter()
        for _ in range(epochs):
            for xb, yb in loader:
                opt.zero_grad()
                if len(yb):
                    loss_fn(module(xb), yb).backward()
                opt.step()
        secs = time.perf_counter() - t0
        eps = float(engine.get_epsilon(1e-5))
    with torch.no_grad():
        pred = module(torch.as_tensor(xte, dtype=torch.float32)).argmax(1).numpy()
    return float((pred == yte).mean()), secs, eps


def steps(n: int, batch: int, epochs: int) -> int:
    return epochs * math.ceil(n / batch)
