"""Timing helpers shared by the bench scripts (run as ``python bench/<name>.py``).

- :func:`interleaved`: contenders timed in turns (the order rotated every round), each the same
  number of times, so that a load that changes during the run hits all of them alike; the
  same statistic (:func:`median`) for every contender.
- :func:`busy`: an added load for the duration of a measurement (busy-looping processes,
  started and stopped here), for a ``--busy`` option.
- :func:`load`: the 1-minute load average, printed beside each ratio.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` timed calls of ``fn``, in seconds (least disturbed by noise)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def interleaved(contenders: Mapping[str, Callable[[], object]], rounds: int, calls: int = 1,
                before: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each contender: ``rounds`` rounds, each timing ``calls``
    consecutive calls of every contender in turn (the order rotated by one every round);
    ``before()`` runs untimed before each timed block (e.g. clearing memos for cold calls).
    Every contender is timed ``rounds`` times."""
    names = list(contenders)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = contenders[name]
            if before is not None:
                before()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name].append((time.perf_counter() - t0) / calls)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def load() -> float:
    """The 1-minute load average (every process on the machine counts)."""
    return os.getloadavg()[0]


@contextlib.contextmanager
def busy(procs: int) -> Iterator[None]:
    """``procs`` busy-looping processes for the duration (none if 0)."""
    started = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(procs)]
    try:
        if started:
            time.sleep(0.5)  # let them reach the scheduler
        yield
    finally:
        for p in started:
            p.kill()
        for p in started:
            p.wait()


def threads_line() -> str:
    """What the BLAS / torch threads are (environment variables, or the defaults)."""
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                      "MKL_NUM_THREADS") if k in os.environ}
    return (f"{os.cpu_count()} cores; BLAS threads: "
            f"{', '.join(f'{k}={v}' for k, v in env.items()) if env else 'defaults'}")
