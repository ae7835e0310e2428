"""Mechanism benchmark: clipping and noise against bare ``randn`` in the same run.

Every ratio compares numbers measured in this run on this machine; the two sides are
interleaved (bare, privkit, bare, privkit, ...) and the best of ``--repeat`` is kept, so a
noisy machine moves both. Run ``python bench/mechanisms.py`` (``--sizes 1e7`` to skip 1e8).

Workloads (float32 unless stated):
  W1 clip + Gaussian noise: ``y = clip_l2(x, C); y.add_(gaussian_noise(y, s, rng=g))`` with a
     torch.Generator, vs bare ``x + torch.randn_like(x)``. Throughput ratio, target >= 0.7.
  W2 L2-norm Laplace ``l2_laplace_noise(x, alpha, rng=g)`` vs bare ``torch.randn_like(x)``.
  W3 secure-mode Gaussian (float64, 4 OS-CSPRNG draws per coordinate) vs numpy
     ``Generator.standard_normal``: cost per coordinate, target <= 8x.
  CUDA: W1 and W2 again on the GPU when torch.cuda.is_available().
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from privkit.mechanisms.clipping import clip_l2
from privkit.mechanisms.sampling import SecureRandom, gaussian_noise, l2_laplace_noise

CLIP = 1.0
STDDEV = 1.0
ALPHA = 2.0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def race(
    bare: Callable[[], Any], ours: Callable[[], Any], repeat: int, device: str = "cpu"
) -> tuple[float, float]:
    """Best-of-``repeat`` seconds of each side, measured alternately after one warm-up."""
    best = [math.inf, math.inf]
    for fn in (bare, ours):
        fn()
    for _ in range(repeat):
        for i, fn in enumerate((bare, ours)):
            _sync(device)
            t0 = time.perf_counter()
            out = fn()
            _sync(device)
            best[i] = min(best[i], time.perf_counter() - t0)
            del out
    return best[0], best[1]


def available_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return 0


def row(name: str, n: int, device: str, t_bare: float, t_ours: float, note: str) -> None:
    print(
        f"{name:<24} n={n:.0e} {device:<4} bare {t_bare * 1e3:9.1f} ms   privkit "
        f"{t_ours * 1e3:9.1f} ms   {note}"
    )


def torch_workloads(n: int, device: str, repeat: int) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    torch.manual_seed(0)
    x = torch.randn(n, device=device, generator=g) * 10.0  # ||x|| >> C: clipping is active

    def clip_and_noise() -> torch.Tensor:
        y = clip_l2(x, CLIP)
        return y.add_(gaussian_noise(y, STDDEV, rng=g))

    t_bare, t_ours = race(lambda: x + torch.randn_like(x), clip_and_noise, repeat, device)
    row(
        "W1 clip + gaussian",
        n,
        device,
        t_bare,
        t_ours,
        f"throughput ratio {t_bare / t_ours:.2f} (target >= 0.7)",
    )

    t_bare, t_ours = race(
        lambda: torch.randn_like(x), lambda: l2_laplace_noise(x, ALPHA, rng=g), repeat, device
    )
    row(
        "W2 l2-laplace vs randn",
        n,
        device,
        t_bare,
        t_ours,
        f"throughput ratio {t_bare / t_ours:.2f}",
    )


def secure_workload(n: int, repeat: int) -> None:
    rng = np.random.default_rng(0)
    secure = SecureRandom()
    t_bare, t_ours = race(
        lambda: rng.standard_normal(n), lambda: secure.gaussian(STDDEV, n), repeat
    )
    row(
        "W3 secure gaussian",
        n,
        "cpu",
        t_bare,
        t_ours,
        f"{t_ours / n * 1e9:.1f} ns/coord = {t_ours / t_bare:.1f}x numpy standard_normal "
        f"(target <= 8x)",
    )
    z = np.zeros(n, dtype=np.float32)
    t_bare, t_ours = race(
        lambda: rng.standard_normal(n), lambda: gaussian_noise(z, STDDEV, rng=secure), repeat
    )
    row(
        "W3 gaussian_noise secure",
        n,
        "cpu",
        t_bare,
        t_ours,
        f"{t_ours / t_bare:.1f}x (float32 output, includes the cast)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="1e7,1e8",
        help="comma-separated float32 sizes for W1/W2 (1e8 needs ~2.5 GB)",
    )
    parser.add_argument("--secure-size", type=float, default=4e6)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    print(
        f"torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}"
    )
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for size in (int(float(s)) for s in args.sizes.split(",")):
        need = 6 * 4 * size  # x, bare outputs, y, noise and scratch, float32
        if need > 0.8 * available_bytes():
            print(
                f"skipping n={size:.0e}: needs ~{need / 2**30:.1f} GiB, "
                f"{available_bytes() / 2**30:.1f} GiB available"
            )
            continue
        for device in devices:
            torch_workloads(size, device, args.repeat)
    secure_workload(int(args.secure_size), args.repeat)


if __name__ == "__main__":
    main()
