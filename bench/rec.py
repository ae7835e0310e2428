"""REC benchmark: decode cost vs index, encode throughput, memory as K grows.

All numbers are measured in this run on this machine (best of ``--repeat``):

  B1 decode time of index 0 vs index K - 1 at K = 2**16 (one group of ``--dim`` coordinates);
     the ratio should be ~1 (each candidate has its own counter range: O(d_g) per decode).
  B2 encode throughput in candidate-coordinates per second (K * d per message) on CPU, and on
     CUDA when ``torch.cuda.is_available()``; the issue's target is >= 1e8/s on CPU.
     The baseline beside it is bare ``torch.randn`` of the same number of float64 normals
     (an unpinned generator), so the ratio shows the cost of the pinned counter-based stream.
  B3 peak traced memory of one encode as K grows (numpy/torch CPU allocations via
     tracemalloc are not seen, so the peak resident set growth is reported with the chunk size).

Run ``python bench/rec.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import torch

from privkit.mechanisms import rec


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_decode(dim: int, repeat: int) -> None:
    msg = rec.encode(np.full(dim, 0.01), l2_clip_norm=1.0, stddev=1.0, bits=16,
                     groups="whole", seed=1, rng=np.random.default_rng(0))
    times = {}
    for k in (0, (1 << 16) - 1):
        m = rec.RecMessage(**{**msg.__dict__, "indices": (k,)})
        times[k] = _best(lambda m=m: rec.decode(m, (dim,)), repeat)
    r = times[(1 << 16) - 1] / times[0]
    print(f"B1 decode, K=2^16, d={dim}: index 0 {times[0] * 1e3:.3f} ms, index K-1 "
          f"{times[(1 << 16) - 1] * 1e3:.3f} ms, ratio {r:.3f}")


def bench_encode(device: str, dim: int, bits: int, repeat: int) -> None:
    u = torch.full((dim,), 0.01, dtype=torch.float64, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    k = 1 << bits

    def run() -> None:
        rec.encode(u, l2_clip_norm=1.0, stddev=1.0, bits=bits, groups="whole", seed=1, rng=g)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    run()  # warm-up
    t = _best(run, repeat)

    def bare() -> None:
        torch.randn(k * dim, dtype=torch.float64, device=device, generator=g)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    tb = _best(bare, repeat)
    rate = k * dim / t
    print(f"B2 encode on {device}, d={dim}, K=2^{bits}: {t:.3f} s, {rate:.3g} "
          f"candidate-coordinates/s (target 1e8: {rate / 1e8:.2f}x); bare torch.randn of the "
          f"same normals {k * dim / tb:.3g}/s, ratio {t / tb:.1f}x")


def bench_memory(dim: int, max_bits: int) -> None:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for bits in range(8, max_bits + 1, 2):
        t0 = time.perf_counter()
        rec.encode(np.full(dim, 0.01), l2_clip_norm=1.0, stddev=1.0, bits=bits, groups="whole",
                   seed=1, rng=np.random.default_rng(0))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        dt = time.perf_counter() - t0
        print(f"B3 K=2^{bits:<2} d={dim}: peak RSS growth {(peak - base) / 1024:.1f} MiB "
              f"(chunk {rec.CHUNK_ELEMENTS} candidate-coordinates), {dt:.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    bench_memory(256, 14 if a.quick else 18)  # first: the peak RSS is process-wide
    bench_decode(1000, a.repeat)
    bench_encode("cpu", 1000, 10 if a.quick else 12, a.repeat)
    if torch.cuda.is_available():
        bench_encode("cuda", 10_000, 14, a.repeat)
        bench_encode("cuda", 100_000, 12, a.repeat)


if __name__ == "__main__":
    main()
