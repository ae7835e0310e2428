"""The GPU numbers the issues ask for, with CPU numbers beside them, in one short run.

Run by ``bench/gpu_check.sh`` (which also runs the CUDA tests); on a machine without CUDA it
prints the CPU side only and says so. Each ratio compares two things timed in this run:

1. clip + Gaussian noise (``GaussianOutputPerturbation`` with a ``torch.Generator``) vs a bare
   ``x + randn_like(x)`` with the same generator, float32, 1e8 coordinates on the GPU (1e7 on
   the CPU);
2. one batched local round (``local_sgd``, logistic regression, E = 20) of 1000 and 10,000
   clients on the GPU, and of 1000 on the CPU (10,000 with ``--full``);
3. record-level DP-SGD local steps (per-example clipping and noise), when the trainers have
   them (``fl_examples.core.dpsgd``);
4. REC encoding (candidate coordinates per second) on the GPU and the CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import privkit
from fl_examples.core.local import local_sgd, pad_clients
from fl_examples.core.models import MultinomialLogReg
from privkit.mechanisms import rec


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best(fn: Callable[[], Any], device: str, repeat: int = 3) -> float:
    fn()  # warm-up
    sync(device)
    out = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out = min(out, time.perf_counter() - t0)
    return out


def clip_noise(device: str, n: int) -> None:
    x = torch.randn(n, device=device, dtype=torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)
    mech = privkit.GaussianOutputPerturbation(l2_clip_norm=1.0, stddev=2.0)
    t_mech = best(lambda: mech(x, rng=gen), device)
    t_bare = best(lambda: x + torch.randn(x.shape, generator=gen, device=device,
                                          dtype=x.dtype), device)
    print(f"  {device:>4} clip + noise, {n:.0e} float32: {t_mech * 1e3:8.1f} ms vs bare "
          f"randn + add {t_bare * 1e3:8.1f} ms: throughput ratio {t_bare / t_mech:.2f}")


def clients(k: int, device: str) -> Any:
    rng = np.random.default_rng(k)
    sizes = np.minimum(rng.lognormal(4, 2, k).astype(np.int64) + 50, 500)
    w = rng.normal(size=(20, 10))
    xs = [rng.normal(size=(n, 20)) for n in sizes]
    return pad_clients(xs, [np.argmax(x @ w, axis=1) for x in xs], device=device)


def batched_round(device: str, k: int) -> float:
    data = clients(k, device)
    model = MultinomialLogReg(20, 10)
    p = model.init(1, generator=torch.Generator(device=device).manual_seed(0), device=device)
    p = {n: t.expand(k, *t.shape[1:]).contiguous() for n, t in p.items()}
    epochs = torch.full((k,), 20, device=device)

    def run() -> Any:
        return local_sgd(model, p, p, data, epochs=epochs, batch_size=32, lr=0.05,
                         momentum=0.5, proximal_mu=0.1,
                         generator=torch.Generator(device=device).manual_seed(1))

    t = best(run, device, 1 if k >= 10_000 else 2)
    print(f"  {device:>4} one batched round, {k:>6} logreg clients (E=20, sizes <= 500): "
          f"{t:8.3f} s")
    return t


def dpsgd(device: str) -> None:
    if importlib.util.find_spec("fl_examples.core.dpsgd") is None:
        print(f"  {device:>4} DP-SGD local steps: not in this version of the trainers")
        return
    from fl_examples.core import dpsgd as mod

    t, what = mod.benchmark(device)
    print(f"  {device:>4} DP-SGD local steps ({what}): {t:8.3f} s")


def rec_encode(device: str, bits: int) -> float:
    upd = torch.randn(4096, device=device, dtype=torch.float64) * 0.01
    seed = bytes(range(16))

    def run() -> Any:
        return rec.encode(upd, l2_clip_norm=1.0, stddev=1.0, bits=bits, groups="chunks:64",
                          seed=seed, rng=np.random.default_rng(0))

    t = best(run, device, 2)
    rate = (1 << bits) * 4096 / t
    print(f"  {device:>4} REC encode, 4096 coordinates, K = 2^{bits}: {t:8.3f} s "
          f"({rate:.3g} candidate coordinates/s)")
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="also 10,000 clients on the CPU")
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 16)))
    cuda = torch.cuda.is_available()
    where = ("available: " + torch.cuda.get_device_name(0)) if cuda else \
        "not available: no GPU present, CPU numbers only"
    print(f"torch {torch.__version__}; CUDA {where}")
    print("\n1. clip + Gaussian noise vs bare randn_like + add")
    clip_noise("cpu", 10**7)
    if cuda:
        clip_noise("cuda", 10**8)
    print("\n2. one batched local round")
    t_cpu = batched_round("cpu", 1000)
    if a.full:
        batched_round("cpu", 10_000)
    if cuda:
        t_gpu = batched_round("cuda", 1000)
        batched_round("cuda", 10_000)
        print(f"  1000 clients: GPU {t_cpu / t_gpu:.1f}x faster than the CPU")
    print("\n3. record-level DP-SGD")
    dpsgd("cpu")
    if cuda:
        dpsgd("cuda")
    print("\n4. REC encoding")
    r_cpu = rec_encode("cpu", 12)
    if cuda:
        r_gpu = rec_encode("cuda", 12)
        rec_encode("cuda", 16)
        print(f"  K = 2^12: GPU {r_gpu / r_cpu:.1f}x the CPU's rate")


if __name__ == "__main__":
    main()
