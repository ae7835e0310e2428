"""privkit.torch's DP-SGD against Opacus (both grad-sample modes) and plain torch, same run.

Every contender gets the same module (the same initial parameters), the same data, clip C,
noise multiplier z and learning rate; Opacus is a bench-only dependency (``pip install
opacus``); privkit never imports it. Contenders are timed in turns, the order rotated every
round, each the same number of times, and every time is the **median** over rounds; the
1-minute load average is printed beside each ratio. ``--busy`` runs one busy-looping process
beside the measurement (the machine's other jobs keep running either way). Threads: torch's
default (printed), or ``--threads``.

Sections (``--sections``, default all):

- ``speed``: one training step on a fixed batch of B = 64 and 256 records of four models
  (an MLP; a CNN of three Conv2d + GroupNorm layers on 28 x 28 inputs; an embedding model;
  a 2-layer ``nn.TransformerEncoder``, batch first, on 32 tokens): ``privkit.torch.
  make_private`` (ghost path) against Opacus's ``hooks`` and ``ghost`` modes (Opacus's
  ``ModuleValidator.fix`` swaps ``nn.MultiheadAttention`` for its ``DPMultiheadAttention``)
  and the non-private step; and the **peak tensor memory** of one step: the running sum of
  the allocator's events recorded by the torch profiler (``profile_memory=True``) above what
  was allocated when the step started (deterministic for fixed draws, unlike the RSS).
- ``clients``: FedAvg rounds over K = 10 clients of 140 digits records (b = 14, 2 local
  epochs): ``privkit.torch.ClientsDpSgd`` training the 10 clients in one batched call,
  against Opacus looping over 10 private engines (set up before the clock starts) and
  against privkit looping over the clients one ``ClientsDpSgd`` run each; the time of the
  local training per round, for an MLP and a small CNN.
- ``accuracy``: paired seeds on digits (1400 records, 397 held out, b = 50, z = 1, C = 1,
  SGD with momentum, 280 steps): test accuracy of privkit and Opacus (``hooks``), and the
  time of a training epoch (Poisson batches, loading included).

    python bench/dpsgd.py [--busy] [--quick] [--sections speed,clients,accuracy]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from _timing import busy, interleaved, load, median, threads_line  # bench/ is on sys.path
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import privkit.torch as pt

N_TRAIN, BATCH, CLIP, Z, LR, MOMENTUM = 1400, 50, 1.0, 1.0, 0.5, 0.9
CLIENTS, CLIENT_BATCH, CLIENT_LR = 10, 14, 0.5
VOCAB, TOKENS = 2000, 32
SUMMARY: list[str] = []


def digits() -> tuple[torch.Tensor, ...]:
    """Digits features in [0, 1] (float32), labels; a fixed split: 1400 train, 397 test."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    xt = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    yt = torch.tensor(y[order], dtype=torch.int64)
    return xt[:N_TRAIN], yt[:N_TRAIN], xt[N_TRAIN:], yt[N_TRAIN:]


class MeanPool(nn.Module):
    """The mean over the sequence (dimension 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def make_model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(1000 + seed)  # the bench's own initialisation (privkit draws nothing here)
    if name == "mlp":
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    if name == "cnn8":  # digits, 8 x 8
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                             nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(32 * 2 * 2, 10))
    if name == "cnn":  # 1 x 28 x 28
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 3 * 3, 10))
    if name == "embedding":
        return nn.Sequential(nn.Embedding(VOCAB, 64), nn.LayerNorm(64), MeanPool(),
                             nn.Linear(64, 10))
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True)
        return nn.Sequential(nn.Embedding(VOCAB, 64),
                             nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                             MeanPool(), nn.Linear(64, 10))
    raise ValueError(name)


def batch(name: str, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic batch of b records for the speed section."""
    g = torch.Generator().manual_seed(b)
    y = torch.randint(0, 10, (b,), generator=g)
    if name == "mlp":
        return torch.rand(b, 64, generator=g), y
    if name == "cnn":
        return torch.rand(b, 1, 28, 28, generator=g), y
    return torch.randint(0, VOCAB, (b, TOKENS), generator=g), y


def accuracy(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((module(x).argmax(1) == y).float().mean())


# ------------------------------------------------------------------------------ contenders
def _opacus(module: nn.Module, loader: DataLoader, lr: float, momentum: float,
            mode: str = "hooks") -> tuple[nn.Module, Any, Any, DataLoader]:
    """Opacus's make_private: (module, optimizer, criterion, Poisson loader)."""
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = ModuleValidator.fix(module)  # nn.MultiheadAttention -> DPMultiheadAttention
        opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
        out = PrivacyEngine(accountant="prv").make_private(
            module=module, optimizer=opt, data_loader=loader, noise_multiplier=Z,
            max_grad_norm=CLIP, poisson_sampling=True, grad_sample_mode=mode,
            criterion=nn.CrossEntropyLoss())
    if mode == "ghost":
        return out[0], out[1], out[2], out[3]
    return out[0], out[1], nn.CrossEntropyLoss(), out[2]


def _opacus_step(module: nn.Module, opt: Any, criterion: Any) -> Callable[..., None]:
    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        opt.zero_grad()
        if len(yb):
            criterion(module(xb), yb).backward()
        opt.step()
    return step


def speed_contenders(name: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], None]]:
    """One step on the fixed batch (x, y), for each contender."""
    ds = TensorDataset(x, y)
    b = len(y)
    out: dict[str, Callable[[], None]] = {}
    m = make_model(name, 0)
    dp = pt.make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), dataset=ds,
                         expected_batch_size=b, max_grad_norm=CLIP, delta=1e-5,
                         noise_multiplier=Z, generator=torch.Generator().manual_seed(0))
    out["privkit"] = lambda: dp.step(x, y)
    for mode in ("hooks", "ghost"):
        torch.manual_seed(0)
        mod, opt, crit, _ = _opacus(make_model(name, 0), DataLoader(ds, batch_size=b), 0.1,
                                    0.0, mode)
        step = _opacus_step(mod, opt, crit)
        out[f"opacus {mode}"] = lambda step=step: step(x, y)  # type: ignore[misc]
    plain = make_model(name, 0)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    loss = nn.CrossEntropyLoss()

    def torch_step() -> None:
        opt.zero_grad()
        loss(plain(x), y).backward()
        opt.step()

    out["torch"] = torch_step
    return out


# ------------------------------------------------------------------------------ memory
def peak_tensor_mib(fn: Any) -> float:
    """Peak of the torch CPU tensor memory allocated while ``fn()`` runs, above what was
    allocated when it started (MiB): the running sum of the allocator's events recorded by
    the torch profiler (``profile_memory=True``), with Python's cycle collector paused.
    Deterministic for fixed draws, unlike the RSS."""
    import torch.profiler as tp

    gc.collect()  # no tensor of an earlier step freed by the cycle collector during this one
    gc.disable()
    try:
        with _quiet_stderr(), tp.profile(activities=[tp.ProfilerActivity.CPU],
                                         profile_memory=True) as prof:
            fn()
    finally:
        gc.enable()
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


# ------------------------------------------------------------------------------ speed
def speed(rounds: int) -> None:
    names = ["privkit", "opacus hooks", "opacus ghost", "torch"]
    print(f"\nspeed: one step on a fixed batch, median of {rounds} interleaved rounds "
          "(ms), and peak tensor memory of one step (MiB)")
    print(f"  {'model':<12}{'B':>4}  " + "".join(f"{n:>14}" for n in names)
          + "  | " + "".join(f"{n:>14}" for n in names))
    for name in ("mlp", "cnn", "embedding", "transformer"):
        for b in (64, 256):
            x, y = batch(name, b)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sides = speed_contenders(name, x, y)
                for fn in sides.values():  # warm-up: first calls, lazy imports
                    fn()
                    fn()
                t0 = time.perf_counter()
                sides["privkit"]()
                calls = max(1, min(20, int(0.05 / (time.perf_counter() - t0))))
                loads = [load()]
                times = interleaved(sides, rounds, calls)
                loads.append(load())
                mem = {n: peak_tensor_mib(fn) for n, fn in sides.items()}
            t = {n: median(v) for n, v in times.items()}
            print(f"  {name:<12}{b:>4}  " + "".join(f"{1e3 * t[n]:>14.2f}" for n in names)
                  + "  | " + "".join(f"{mem[n]:>14.2f}" for n in names))
            best_t = min(t["opacus hooks"], t["opacus ghost"])
            best_m = min(mem["opacus hooks"], mem["opacus ghost"])
            ratio_t, ratio_m, vs_torch = best_t / t["privkit"], best_m / mem["privkit"], \
                t["privkit"] / t["torch"]
            ok = ratio_t >= 1 and ratio_m >= 1 and (name not in ("mlp", "cnn") or vs_torch <= 2)
            line = (f"{name} B={b}: Opacus's best {ratio_t:.2f}x privkit's time "
                    f"(hooks {t['opacus hooks'] / t['privkit']:.2f}x, ghost "
                    f"{t['opacus ghost'] / t['privkit']:.2f}x), its best memory "
                    f"{ratio_m:.2f}x privkit's; privkit {vs_torch:.2f}x torch's time "
                    f"[load {loads[0]:.1f}-{loads[1]:.1f}]  {'OK' if ok else 'MISSED'}")
            print("    " + line)
            SUMMARY.append(line)
    print("  (targets: privkit's time and memory at or below Opacus's best mode, and at most "
          "2x torch's time for the MLP and the CNN)")


# ------------------------------------------------------------------------------ K clients
def clients(name: str, data: tuple[torch.Tensor, ...], rounds: int, local_epochs: int) -> None:
    """FedAvg rounds; the three contenders take turns round by round (local training
    timed)."""
    xtr, ytr, xte, yte = data
    n = N_TRAIN // CLIENTS
    xs, ys = xtr.reshape(CLIENTS, n, 64), ytr.reshape(CLIENTS, n)
    sizes = torch.full((CLIENTS,), n)
    q = pt.sampling_rates(sizes, CLIENT_BATCH)
    steps = pt.steps_for_epochs(sizes, local_epochs, CLIENT_BATCH)
    glob = make_model(name, 0)
    dp = pt.ClientsDpSgd(glob, l2_clip_norm=CLIP, noise_multiplier=Z)
    state: dict[str, dict[str, torch.Tensor]] = {
        k: {nm: v.detach().clone() for nm, v in glob.named_parameters()}
        for k in ("batched", "one at a time", "opacus")}
    torch.manual_seed(0)
    privs = [_opacus(make_model(name, 0),
                     DataLoader(TensorDataset(xs[i], ys[i]), batch_size=CLIENT_BATCH),
                     CLIENT_LR, 0.0) for i in range(CLIENTS)]
    loss_fn = nn.CrossEntropyLoss()
    done = {k: 0 for k in state}

    def batched() -> None:
        r = done["batched"]
        stacked = {k: v.expand(CLIENTS, *v.shape).clone() for k, v in state["batched"].items()}
        out = dp.run(stacked, pt.ClientBatch(xs, ys, sizes), steps=steps, sampling_rates=q,
                     client_keys=range(CLIENTS), rng=pt.ClientStreams(seed=0, round=r),
                     update=pt.LocalSgd(lr=CLIENT_LR))
        state["batched"] = {k: v.mean(0) for k, v in out.items()}
        done["batched"] += 1

    def one_at_a_time() -> None:
        r = done["one at a time"]
        new = []
        for i in range(CLIENTS):
            one = {k: v[None].clone() for k, v in state["one at a time"].items()}
            new.append(dp.run(one, pt.ClientBatch(xs[i:i + 1], ys[i:i + 1], sizes[i:i + 1]),
                              steps=steps[i:i + 1], sampling_rates=q[i:i + 1], client_keys=[i],
                              rng=pt.ClientStreams(seed=0, round=r),
                              update=pt.LocalSgd(lr=CLIENT_LR)))
        state["one at a time"] = {k: torch.cat([c[k] for c in new]).mean(0)
                                  for k in state["one at a time"]}
        done["one at a time"] += 1

    def opacus_loop() -> None:
        new = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for module, opt, _, loader in privs:
                with torch.no_grad():
                    for k, p in module._module.named_parameters():
                        p.copy_(state["opacus"][k])
                for _ in range(local_epochs):
                    for xb, yb in loader:
                        opt.zero_grad()
                        if len(yb):
                            loss_fn(module(xb), yb).backward()
                        opt.step()
                new.append({k: p.detach().clone() for k, p in module._module.named_parameters()})
        state["opacus"] = {k: torch.stack([c[k] for c in new]).mean(0) for k in state["opacus"]}

    sides = {"batched": batched, "one at a time": one_at_a_time, "opacus": opacus_loop}
    l0 = load()
    times = interleaved(sides, rounds)
    l1 = load()
    t = {k: median(v) for k, v in times.items()}
    acc = {}
    for label, key in (("privkit batched", "batched"), ("opacus", "opacus")):
        m = make_model(name, 0)
        with torch.no_grad():
            for k, p in m.named_parameters():
                p.copy_(state[key][k])
        acc[label] = accuracy(m, xte, yte)
    print(f"  {name}: {CLIENTS} clients x {n} records, b {CLIENT_BATCH}, {rounds} rounds of "
          f"{int(steps[0])} local steps; local training per round (median): privkit batched "
          f"{t['batched']:.3f} s, privkit one client at a time {t['one at a time']:.3f} s, "
          f"Opacus loop {t['opacus']:.3f} s")
    ratio = t["opacus"] / t["batched"]
    line = (f"{name}, {CLIENTS} clients batched: {ratio:.2f}x Opacus's loop, "
            f"{t['one at a time'] / t['batched']:.2f}x privkit one client at a time "
            f"[load {l0:.1f}-{l1:.1f}]  {'OK' if ratio >= 5 else 'MISSED'} (target >= 5x "
            "Opacus's loop)")
    print(f"    {line}; test accuracy privkit {acc['privkit batched']:.4f}, Opacus "
          f"{acc['opacus']:.4f} (one seed)")
    SUMMARY.append(line)


# ------------------------------------------------------------------------------ accuracy
class PrivkitSide:
    """privkit.torch.make_private on one model (seeded), trained an epoch at a time."""

    def __init__(self, name: str, data: tuple[torch.Tensor, ...], seed: int) -> None:
        self.module = make_model(name, seed)
        opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=MOMENTUM)
        self.dp = pt.make_private(
            self.module, opt, DataLoader(TensorDataset(data[0], data[1]), batch_size=BATCH),
            max_grad_norm=CLIP, delta=1e-5, noise_multiplier=Z,
            generator=torch.Generator().manual_seed(seed))

    def epoch(self) -> None:
        for xb, yb in self.dp.epoch():
            self.dp.step(xb, yb)


class OpacusSide:
    """opacus.PrivacyEngine.make_private (hooks) on the same model, the same settings."""

    def __init__(self, name: str, data: tuple[torch.Tensor, ...], seed: int) -> None:
        torch.manual_seed(seed)  # Opacus draws from torch's global generator
        self.module, opt, crit, self.loader = _opacus(
            make_model(name, seed), DataLoader(TensorDataset(data[0], data[1]),
                                               batch_size=BATCH), LR, MOMENTUM)
        self.step = _opacus_step(self.module, opt, crit)

    def epoch(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for xb, yb in self.loader:
                self.step(xb, yb)


def accuracy_section(name: str, data: tuple[torch.Tensor, ...], seeds: int, epochs: int
                     ) -> None:
    for cls in (PrivkitSide, OpacusSide):  # warm-up: first calls, lazy imports
        cls(name, data, 0).epoch()
    acc: dict[str, list[float]] = {"privkit": [], "opacus": []}
    times: dict[str, list[float]] = {"privkit": [], "opacus": []}
    l0 = load()
    for seed in range(seeds):  # paired seeds; the sides take turns epoch by epoch
        sides = {"privkit": PrivkitSide(name, data, seed), "opacus": OpacusSide(name, data, seed)}
        got = interleaved({k: s.epoch for k, s in sides.items()}, epochs)
        for k in sides:
            times[k] += got[k]
            acc[k].append(accuracy(sides[k].module, data[2], data[3]))
    l1 = load()
    diff = np.array(acc["privkit"]) - np.array(acc["opacus"])
    se = float(diff.std(ddof=1) / math.sqrt(seeds)) if seeds > 1 else float("nan")
    t = {k: median(v) for k, v in times.items()}
    steps = epochs * math.ceil(N_TRAIN / BATCH)
    print(f"  {name}: {seeds} paired seeds, {steps} steps (q {BATCH / N_TRAIN:.4f}, z {Z}, "
          f"C {CLIP}, lr {LR}, momentum {MOMENTUM}): test accuracy privkit "
          f"{np.mean(acc['privkit']):.4f}, Opacus {np.mean(acc['opacus']):.4f}, paired "
          f"difference {100 * diff.mean():+.2f} +- {100 * se:.2f} points (s.e.); an epoch "
          f"(median) privkit {1e3 * t['privkit']:.1f} ms, Opacus {1e3 * t['opacus']:.1f} ms: "
          f"{t['opacus'] / t['privkit']:.2f}x [load {l0:.1f}-{l1:.1f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, seeds and epochs")
    ap.add_argument("--busy", action="store_true",
                    help="run one busy-looping process beside the measurement")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--sections", default="speed,clients,accuracy")
    args = ap.parse_args()
    try:
        import opacus  # noqa: F401
    except ImportError:
        sys.exit("bench/dpsgd.py compares with Opacus: pip install opacus")
    if args.threads:
        torch.set_num_threads(args.threads)
    sections = args.sections.split(",")
    print(f"bench/dpsgd.py: torch {torch.__version__} with {torch.get_num_threads()} threads; "
          f"{threads_line()}; {'one busy-looping process added' if args.busy else 'no added load'}"
          f"; load average at the start {load():.2f}")
    with busy(1 if args.busy else 0):
        if "speed" in sections:
            speed(3 if args.quick else 7)
        data = digits()
        if "clients" in sections:
            print("\nclients: local training per FedAvg round (median over interleaved rounds)")
            for name in ("mlp", "cnn8"):
                clients(name, data, 3 if args.quick else 7, 2)
        if "accuracy" in sections:
            print("\naccuracy: privkit against Opacus (hooks), digits")
            for name in ("mlp", "cnn8"):
                accuracy_section(name, data, *((2, 2) if args.quick else (8, 10)))
    if SUMMARY:
        print("\nsummary:")
        for line in SUMMARY:
            print("  " + line)


if __name__ == "__main__":
    main()
