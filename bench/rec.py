"""REC benchmark: decode cost vs index, encode throughput, memory as K grows.

All numbers are measured in this run on this machine (best of ``--repeat``):

  B1 decode time of index 0 vs index K - 1 at K = 2**16 (one group of ``--dim`` coordinates);
     the ratio should be ~1 (each candidate has its own counter range: O(d_g) per decode).
  B2 encode throughput in candidate-coordinates per second (K * d per message) on CPU, and on
     CUDA when ``torch.cuda.is_available()``; the issue's target is >= 1e8/s on CPU. Beside it:
     the candidate stream alone (Philox words and Box-Muller, no selection), and bare
     ``torch.randn`` of the same number of float64 normals (an unpinned generator), measured
     in the same run, so the ratio shows the cost of the pinned counter-based stream. On CPU
     it runs with 1 torch thread and, if torch has more, with all of them.
  B3 peak resident-set growth of one encode as K grows (the chunk bounds it).
  B4 one message of the default ``privkit train dprec`` run (logistic regression on digits:
     650 parameters in 2 groups, K = 2**8): encode and decode time.

Run ``python bench/rec.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import functools
import resource
import time
from collections.abc import Callable

import numpy as np
import torch
from _timing import best_of  # noqa: E402  (bench/ is on sys.path when run)

from privkit.mechanisms import _rec_stream, rec


def _best_of_each(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Best time of each function, the functions interleaved (the load changes over time)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def bench_decode(dim: int, repeat: int) -> None:
    msg = rec.encode(np.full(dim, 0.01), l2_clip_norm=1.0, stddev=1.0, bits=16,
                     groups="whole", seed=1, rng=np.random.default_rng(0))
    times = {}
    for k in (0, (1 << 16) - 1):
        m = rec.RecMessage(**{**msg.__dict__, "indices": (k,)})
        times[k] = best_of(functools.partial(rec.decode, m, (dim,)), repeat)
    r = times[(1 << 16) - 1] / times[0]
    print(f"B1 decode, K=2^16, d={dim}: index 0 {times[0] * 1e3:.3f} ms, index K-1 "
          f"{times[(1 << 16) - 1] * 1e3:.3f} ms, ratio {r:.3f}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_encode(device: str, dim: int, bits: int, repeat: int) -> None:
    u = torch.full((dim,), 0.01, dtype=torch.float64, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    k = 1 << bits
    chunk = rec.CHUNK_ELEMENTS * max(1, torch.get_num_threads())
    kc = max(1, chunk // (4 * ((dim + 3) // 4)))
    blocks = (dim + 3) // 4
    gid = torch.zeros((1, 1, 1), dtype=torch.int64, device=device)

    def run() -> None:
        rec.encode(u, l2_clip_norm=1.0, stddev=1.0, bits=bits, groups="whole", seed=1, rng=g)
        _sync(device)

    def stream() -> None:  # the candidates alone, in the encoder's chunks
        for k0 in range(0, k, kc):
            ks = torch.arange(k0, min(k, k0 + kc), device=device).view(1, -1, 1)
            _rec_stream._block_normals((1, 2), gid, ks, blocks, dim)  # noqa: SLF001
        _sync(device)

    def bare() -> None:
        torch.randn(k * dim, dtype=torch.float64, device=device, generator=g)
        _sync(device)

    run()  # warm-up
    t, ts, tb = _best_of_each([run, stream, bare], repeat)
    n = k * dim
    print(f"B2 encode on {device}, {torch.get_num_threads()} thread(s), d={dim}, K=2^{bits}: "
          f"{t:.3f} s, {n / t:.3g} candidate-coordinates/s (target 1e8: {n / t / 1e8:.2f}x); "
          f"stream alone {n / ts:.3g}/s; bare torch.randn of the same normals {n / tb:.3g}/s; "
          f"encode / randn time ratio {t / tb:.2f}x")


def bench_memory(dim: int, max_bits: int) -> None:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for bits in range(8, max_bits + 1, 2):
        t0 = time.perf_counter()
        rec.encode(np.full(dim, 0.01), l2_clip_norm=1.0, stddev=1.0, bits=bits, groups="whole",
                   seed=1, rng=np.random.default_rng(0))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        dt = time.perf_counter() - t0
        print(f"B3 K=2^{bits:<2} d={dim}: peak RSS growth {(peak - base) / 1024:.1f} MiB "
              f"(chunk {rec.CHUNK_ELEMENTS} x {torch.get_num_threads()} thread(s) "
              f"candidate-coordinates), {dt:.2f} s")


def bench_trainer_message(repeat: int) -> None:
    gen = torch.Generator().manual_seed(0)
    u = {"w": 0.01 * torch.randn(64, 10, generator=gen, dtype=torch.float64),
         "b": 0.01 * torch.randn(10, generator=gen, dtype=torch.float64)}
    rng = np.random.default_rng(0)
    seeds = iter(range(1, 10**6))

    def enc() -> rec.RecMessage:
        return rec.encode(u, l2_clip_norm=0.5, stddev=1.0, bits=8, groups="per-tensor",
                          seed=next(seeds), rng=rng)

    msg = enc()
    te = best_of(enc, repeat)
    td = best_of(lambda: rec.decode(msg, {"w": (64, 10), "b": (10,)}), repeat)
    print(f"B4 default dprec message (650 parameters, 2 groups, K=2^8), "
          f"{torch.get_num_threads()} thread(s): encode {te * 1e3:.2f} ms "
          f"({650 * 256 / te:.3g} candidate-coordinates/s), decode {td * 1e3:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: 1 thread, then torch's default if larger)")
    a = p.parse_args()
    default = torch.get_num_threads()
    counts = [a.threads] if a.threads else sorted({1, default})
    print(f"torch {torch.__version__}, threads {counts}")
    torch.set_num_threads(counts[0])
    bench_memory(256, 14 if a.quick else 18)  # first: the peak RSS is process-wide
    bench_decode(1000, a.repeat)
    for n in counts:
        torch.set_num_threads(n)
        bench_encode("cpu", 1000, 10 if a.quick else 12, a.repeat)
        bench_trainer_message(a.repeat * 3)
    if torch.cuda.is_available():
        bench_encode("cuda", 10_000, 14, a.repeat)
        bench_encode("cuda", 100_000, 12, a.repeat)


if __name__ == "__main__":
    main()
