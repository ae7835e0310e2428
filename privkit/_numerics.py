"""Log-space numerical kernels used by the accountants (float64 throughout).

Every function is vectorised (numpy broadcasting) and tested against mpmath
at extreme arguments in ``tests/privkit/test_numerics.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privkit._lazy import LazyModule

special = LazyModule("scipy.special")

__all__ = ["log_ndtr", "log_sub_exp", "logsumexp", "log1mexp", "log1mexp_scalar"]



def log_ndtr(x: Any) -> Any:
    """log Phi(x), accurate in both tails (scipy.special.log_ndtr)."""
    return special.log_ndtr(x)


def logsumexp(a: Any, **kwargs: Any) -> Any:
    """scipy.special.logsumexp."""
    return special.logsumexp(a, **kwargs)


def log1mexp(x: np.ndarray | float) -> np.ndarray | float:
    """log(1 - exp(x)) for x <= 0, accurate near 0 and for very negative x."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(divide="ignore"):
        out = np.where(x > -0.6931471805599453, np.log(-np.expm1(x)), np.log1p(-np.exp(x)))
    return out[()] if out.ndim == 0 else out


def log1mexp_scalar(x: float) -> float:
    """:func:`log1mexp` for one Python float (no numpy overhead); -inf at x = 0."""
    if x == 0.0:
        return -math.inf
    return math.log(-math.expm1(x)) if x > -0.6931471805599453 else math.log1p(-math.exp(x))


def log_sub_exp(a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray | float:
    """log(exp(a) - exp(b)) for a >= b; -inf where a == b (including both -inf)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.where(np.isneginf(b), -np.inf, b - a)
    out = np.where(np.isneginf(a), -np.inf, a + log1mexp(diff))
    return out[()] if out.ndim == 0 else out
