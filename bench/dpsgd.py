"""privkit.torch's DP-SGD against Opacus in the same run (one torch thread, CPU).

Both sides get the same module (the same initial parameters for a given seed), the same
digits training set (1400 records, 64 features; 397 held out), the same clip C, noise
multiplier z, Poisson rate q = b / n, number of steps, learning rate and momentum; only their
random draws differ. Opacus is a bench-only dependency (``pip install opacus``, its default
``hooks`` grad-sample mode, Poisson sampling); privkit never imports it.

Sections:

- ``single``: one data set, a plain loop: ``privkit.torch.make_private`` (ghost clipping)
  against ``opacus.PrivacyEngine.make_private``, for an MLP and a small CNN. Test accuracy
  (mean over paired seeds, with the paired difference and its standard error) and the time
  of the training loops (sum over seeds); then the time of one step on a fixed batch of b
  records (best of repeats, the two sides alternated) and the peak memory of a training loop.
- ``clients``: FedAvg over K = 10 clients (140 records each, b = 14): each round trains the
  10 clients with ``privkit.torch.ClientsDpSgd`` (one batched call) against Opacus looping
  over the same 10 clients (one private module each, set up before the clock starts); the
  time of the local training, and the final test accuracy of both.

Memory is the peak of the torch CPU tensor memory allocated during one training epoch, above
what was allocated when it started, from the allocator's events in the torch profiler
(``profile_memory=True``): deterministic for fixed draws (the resident set size moves with
the C allocator's caching by more than these models need).

    python bench/dpsgd.py            # about 3 minutes on a busy 2-core machine
    python bench/dpsgd.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import privkit.torch as pt

N_TRAIN, BATCH, CLIP, Z, LR, MOMENTUM = 1400, 50, 1.0, 1.0, 0.5, 0.9
CLIENTS, CLIENT_BATCH, CLIENT_LR = 10, 14, 0.5


def digits() -> tuple[torch.Tensor, ...]:
    """Digits features in [0, 1] (float32), labels; a fixed split: 1400 train, 397 test."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    xt = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    yt = torch.tensor(y[order], dtype=torch.int64)
    return xt[:N_TRAIN], yt[:N_TRAIN], xt[N_TRAIN:], yt[N_TRAIN:]


def make_model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(1000 + seed)  # the bench's own initialisation (privkit draws nothing here)
    if name == "mlp":
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                         nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 2 * 2, 10))


def accuracy(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((module(x).argmax(1) == y).float().mean())


# ------------------------------------------------------------------------------ one data set
def _opacus_private(module: nn.Module, loader: DataLoader, lr: float, momentum: float
                    ) -> tuple[nn.Module, Any, DataLoader]:
    from opacus import PrivacyEngine

    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(accountant="prv").make_private(
            module=module, optimizer=opt, data_loader=loader, noise_multiplier=Z,
            max_grad_norm=CLIP, poisson_sampling=True)


class PrivkitSide:
    """privkit.torch.make_private on one model (seeded), trained an epoch at a time."""

    def __init__(self, name: str, data: tuple[torch.Tensor, ...], seed: int) -> None:
        self.module = make_model(name, seed)
        opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=MOMENTUM)
        self.dp = pt.make_private(
            self.module, opt, DataLoader(TensorDataset(data[0], data[1]), batch_size=BATCH),
            max_grad_norm=CLIP, delta=1e-5, noise_multiplier=Z,
            generator=torch.Generator().manual_seed(seed))

    def epoch(self) -> float:
        t0 = time.perf_counter()
        for xb, yb in self.dp.epoch():
            self.dp.step(xb, yb)
        return time.perf_counter() - t0

    def step(self, xb: torch.Tensor, yb: torch.Tensor) -> None:
        self.dp.step(xb, yb)


class OpacusSide:
    """opacus.PrivacyEngine.make_private on the same model, the same settings."""

    def __init__(self, name: str, data: tuple[torch.Tensor, ...], seed: int) -> None:
        torch.manual_seed(seed)  # Opacus draws from torch's global generator
        self.module, self.opt, self.loader = _opacus_private(
            make_model(name, seed), DataLoader(TensorDataset(data[0], data[1]),
                                               batch_size=BATCH), LR, MOMENTUM)
        self.loss_fn = nn.CrossEntropyLoss()

    def step(self, xb: torch.Tensor, yb: torch.Tensor) -> None:
        self.opt.zero_grad()
        if len(yb):
            self.loss_fn(self.module(xb), yb).backward()
        self.opt.step()

    def epoch(self) -> float:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for xb, yb in self.loader:
                self.step(xb, yb)
        return time.perf_counter() - t0


def step_times(name: str, data: tuple[torch.Tensor, ...], repeat: int) -> tuple[float, float]:
    """Best-of-``repeat`` seconds of one step on a fixed batch of b records (the two sides
    alternated, 5 steps a block)."""
    xb, yb = data[0][:BATCH], data[1][:BATCH]
    sides = (PrivkitSide(name, data, 0), OpacusSide(name, data, 0))
    best = [math.inf, math.inf]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(repeat):
            for i, side in enumerate(sides):
                t0 = time.perf_counter()
                for _ in range(5):
                    side.step(xb, yb)
                best[i] = min(best[i], (time.perf_counter() - t0) / 5)
    return best[0], best[1]


def peak_tensor_mib(fn: Any) -> float:
    """Peak of the torch CPU tensor memory allocated while ``fn()`` runs, above what was
    allocated when it started (MiB): the running sum of the allocator's events recorded by
    the torch profiler (``profile_memory=True``). Deterministic for fixed draws, unlike RSS."""
    import torch.profiler as tp

    with _quiet_stderr(), tp.profile(activities=[tp.ProfilerActivity.CPU],
                                     profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak / 2**20


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The profiler's C++ layer logs its start and stop on file descriptor 2: hide them."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def memory(name: str, data: tuple[torch.Tensor, ...]) -> tuple[float, float]:
    """Peak tensor memory of one training epoch of each side (after a warm-up epoch)."""
    out = []
    for cls in (PrivkitSide, OpacusSide):
        side = cls(name, data, 1)
        side.epoch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.append(peak_tensor_mib(side.epoch))
    return out[0], out[1]


def single(name: str, data: tuple[torch.Tensor, ...], seeds: int, epochs: int,
           repeat: int) -> dict[str, float]:
    for cls in (PrivkitSide, OpacusSide):  # warm-up: first calls, lazy imports
        cls(name, data, 0).epoch()
    acc: dict[str, list[float]] = {"privkit": [], "opacus": []}
    times: dict[str, list[float]] = {"privkit": [], "opacus": []}
    for seed in range(seeds):  # paired seeds; the sides alternate epoch by epoch
        sides = {"privkit": PrivkitSide(name, data, seed), "opacus": OpacusSide(name, data, seed)}
        for _ in range(epochs):
            for k, side in sides.items():
                times[k].append(side.epoch())
        for k, side in sides.items():
            acc[k].append(accuracy(side.module, data[2], data[3]))
    diff = np.array(acc["privkit"]) - np.array(acc["opacus"])
    se = float(diff.std(ddof=1) / math.sqrt(seeds)) if seeds > 1 else float("nan")
    total = {k: sum(v) for k, v in times.items()}
    fastest = {k: min(v) for k, v in times.items()}
    s_ours, s_theirs = step_times(name, data, repeat)
    m_ours, m_theirs = memory(name, data)
    steps = epochs * math.ceil(N_TRAIN / BATCH)
    print(f"{name}: {seeds} paired seeds, {steps} steps (q {BATCH / N_TRAIN:.4f}, z {Z}, "
          f"C {CLIP}, lr {LR}, momentum {MOMENTUM})")
    print(f"  test accuracy     privkit {np.mean(acc['privkit']):.4f}  opacus "
          f"{np.mean(acc['opacus']):.4f}  paired difference {100 * diff.mean():+.2f} +- "
          f"{100 * se:.2f} points (s.e.)")
    print(f"  training epochs   privkit {total['privkit']:.2f} s  opacus {total['opacus']:.2f} s"
          f"  ratio {total['opacus'] / total['privkit']:.2f}x (fastest epoch: "
          f"{fastest['opacus'] / fastest['privkit']:.2f}x)")
    print(f"  one step (b={BATCH}) privkit {1e3 * s_ours:.3f} ms  opacus {1e3 * s_theirs:.3f} ms"
          f"  ratio {s_theirs / s_ours:.2f}x")
    print(f"  peak tensor memory of an epoch  privkit {m_ours:.2f} MiB  opacus "
          f"{m_theirs:.2f} MiB  ratio {m_theirs / m_ours:.2f}x")
    return {"diff": float(diff.mean()), "loop": total["opacus"] / total["privkit"],
            "step": s_theirs / s_ours,
            "memory": m_theirs / m_ours}


# ------------------------------------------------------------------------------ K clients
def clients(name: str, data: tuple[torch.Tensor, ...], rounds: int, local_epochs: int
            ) -> dict[str, float]:
    """FedAvg rounds; the sides alternate round by round (local training timed)."""
    xtr, ytr, xte, yte = data
    n = N_TRAIN // CLIENTS
    xs, ys = xtr.reshape(CLIENTS, n, 64), ytr.reshape(CLIENTS, n)
    sizes = torch.full((CLIENTS,), n)
    q = pt.sampling_rates(sizes, CLIENT_BATCH)
    steps = pt.steps_for_epochs(sizes, local_epochs, CLIENT_BATCH)
    glob = make_model(name, 0)
    dp = pt.ClientsDpSgd(glob, l2_clip_norm=CLIP, noise_multiplier=Z)
    ours = {k: v.detach().clone() for k, v in glob.named_parameters()}
    torch.manual_seed(0)
    privs = [_opacus_private(make_model(name, 0),
                             DataLoader(TensorDataset(xs[i], ys[i]), batch_size=CLIENT_BATCH),
                             CLIENT_LR, 0.0) for i in range(CLIENTS)]
    theirs = {k: v.detach().clone() for k, v in make_model(name, 0).named_parameters()}
    loss_fn = nn.CrossEntropyLoss()
    t_ours, t_theirs = [], []
    for r in range(rounds):
        stacked = {k: v.expand(CLIENTS, *v.shape).clone() for k, v in ours.items()}
        t0 = time.perf_counter()
        out = dp.run(stacked, pt.ClientBatch(xs, ys, sizes), steps=steps, sampling_rates=q,
                     client_keys=range(CLIENTS), rng=pt.ClientStreams(seed=0, round=r),
                     update=pt.LocalSgd(lr=CLIENT_LR))
        t_ours.append(time.perf_counter() - t0)
        ours = {k: v.mean(0) for k, v in out.items()}
        new, spent = [], 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for module, opt, loader in privs:
                with torch.no_grad():
                    for k, p in module._module.named_parameters():
                        p.copy_(theirs[k])
                t0 = time.perf_counter()
                for _ in range(local_epochs):
                    for xb, yb in loader:
                        opt.zero_grad()
                        if len(yb):
                            loss_fn(module(xb), yb).backward()
                        opt.step()
                spent += time.perf_counter() - t0
                new.append({k: p.detach().clone() for k, p in module._module.named_parameters()})
        t_theirs.append(spent)
        theirs = {k: torch.stack([c[k] for c in new]).mean(0) for k in theirs}
    final = {}
    for label, w in (("privkit", ours), ("opacus", theirs)):
        m = make_model(name, 0)
        with torch.no_grad():
            for k, p in m.named_parameters():
                p.copy_(w[k])
        final[label] = accuracy(m, xte, yte)
    print(f"{name}, {CLIENTS} clients x {n} records, b {CLIENT_BATCH}, {rounds} FedAvg rounds "
          f"of {int(steps[0])} local steps")
    print(f"  local training    privkit batched {sum(t_ours):.2f} s  opacus loop "
          f"{sum(t_theirs):.2f} s  ratio {sum(t_theirs) / sum(t_ours):.2f}x (fastest round: "
          f"{min(t_theirs) / min(t_ours):.2f}x)")
    print(f"  test accuracy     privkit {final['privkit']:.4f}  opacus {final['opacus']:.4f}  "
          "(one seed)")
    return {"clients": sum(t_theirs) / sum(t_ours)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer seeds, epochs and rounds")
    args = ap.parse_args()
    try:
        import opacus  # noqa: F401
    except ImportError:
        sys.exit("bench/dpsgd.py compares with Opacus: pip install opacus")
    torch.set_num_threads(1)
    data = digits()
    seeds, epochs, repeat, rounds = (2, 2, 10, 2) if args.quick else (8, 10, 30, 6)
    ratios = {}
    for name in ("mlp", "cnn"):
        ratios[name] = single(name, data, seeds, epochs, repeat)
    for name in ("mlp", "cnn"):
        ratios[name].update(clients(name, data, rounds, 2))
    print("\nsummary (Opacus's time or memory / privkit's; accuracy difference in points; "
          "targets: |accuracy| <= 1, epochs and step >= 1.5x, memory >= 1x, 10 clients >= 5x):")
    for name, r in ratios.items():
        met = [abs(100 * r["diff"]) <= 1, r["loop"] >= 1.5, r["step"] >= 1.5,
               r["memory"] >= 1, r["clients"] >= 5]
        print(f"  {name}: accuracy {100 * r['diff']:+.2f}  epochs {r['loop']:.2f}x  step "
              f"{r['step']:.2f}x  memory {r['memory']:.2f}x  10 clients {r['clients']:.2f}x  "
              f"({sum(met)} of 5 targets met)")


if __name__ == "__main__":
    main()
