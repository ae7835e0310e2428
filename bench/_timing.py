"""Timing helper shared by the bench scripts (run as ``python bench/<name>.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` timed calls of ``fn``, in seconds (least disturbed by noise)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
