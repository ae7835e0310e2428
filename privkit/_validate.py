"""Validators that fail closed: NaN never passes, messages name the argument.

Each function returns the validated value converted to its canonical type
(``float`` or ``int``) and raises :class:`privkit.errors.InvalidParameterError`
otherwise. Comparisons are written so that NaN fails them (``not x > 0``
rather than ``x <= 0``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from privkit.errors import InvalidParameterError

__all__ = [
    "real",
    "positive",
    "nonnegative",
    "positive_or_inf",
    "nonnegative_or_inf",
    "delta",
    "probability",
    "positive_int",
    "nonnegative_int",
    "positive_array",
    "positive_int_array",
]


def real(name: str, value: Any) -> float:
    """Return ``value`` as a float; booleans, strings and None are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        # numpy 0-d arrays are accepted, anything else array-like is not.
        if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "fiu":
            return float(value)
        raise InvalidParameterError(name, value, "a real number")
    return float(value)


def positive(name: str, value: Any) -> float:
    """Finite and > 0."""
    x = real(name, value)
    if not (math.isfinite(x) and x > 0):
        raise InvalidParameterError(name, value, "finite and > 0")
    return x


def nonnegative(name: str, value: Any) -> float:
    """Finite and >= 0."""
    x = real(name, value)
    if not (math.isfinite(x) and x >= 0):
        raise InvalidParameterError(name, value, "finite and >= 0")
    return x


def positive_or_inf(name: str, value: Any) -> float:
    """> 0, +inf allowed (NaN refused)."""
    x = real(name, value)
    if not x > 0:
        raise InvalidParameterError(name, value, "> 0 (inf allowed)")
    return x


def nonnegative_or_inf(name: str, value: Any) -> float:
    """>= 0, +inf allowed (NaN refused)."""
    x = real(name, value)
    if not x >= 0:
        raise InvalidParameterError(name, value, ">= 0 (inf allowed)")
    return x


def delta(name: str, value: Any) -> float:
    """A delta strictly inside (0, 1)."""
    x = real(name, value)
    if not (0.0 < x < 1.0):
        raise InvalidParameterError(name, value, "in the open interval (0, 1)")
    return x


def probability(name: str, value: Any) -> float:
    """A sampling probability in (0, 1]."""
    x = real(name, value)
    if not (0.0 < x <= 1.0):
        raise InvalidParameterError(name, value, "in (0, 1]")
    return x


def _integer(name: str, value: Any, requirement: str) -> int:
    if isinstance(value, bool):
        raise InvalidParameterError(name, value, requirement)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        x = float(value)
        if math.isfinite(x) and x.is_integer():
            return int(x)
    raise InvalidParameterError(name, value, requirement)


def positive_int(name: str, value: Any) -> int:
    """An integer >= 1 (integral floats such as 1e3 are accepted)."""
    n = _integer(name, value, "an integer >= 1")
    if n < 1:
        raise InvalidParameterError(name, n, "an integer >= 1")  # 0, not 0.0 from a CLI float
    return n


def nonnegative_int(name: str, value: Any) -> int:
    """An integer >= 0."""
    n = _integer(name, value, "an integer >= 0")
    if n < 0:
        raise InvalidParameterError(name, n, "an integer >= 0")
    return n


def _as_float_array(name: str, value: Any) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidParameterError(name, value, "an array of real numbers") from None
    return arr


def _first_bad(arr: np.ndarray, ok: np.ndarray) -> Any:
    idx = np.flatnonzero(~ok.ravel())[0]
    return arr.ravel()[idx]


def positive_array(name: str, value: Any) -> np.ndarray:
    """A float64 array whose entries are all finite and > 0."""
    arr = _as_float_array(name, value)
    ok = np.isfinite(arr) & (arr > 0)
    if not ok.all():
        raise InvalidParameterError(name, _first_bad(arr, ok), "finite and > 0 in every entry")
    return arr


def positive_int_array(name: str, value: Any) -> np.ndarray:
    """An int64 array whose entries are all integers >= 1."""
    arr = _as_float_array(name, value)
    ok = np.isfinite(arr) & (arr >= 1) & (arr == np.floor(arr))
    if not ok.all():
        raise InvalidParameterError(name, _first_bad(arr, ok), "an integer >= 1 in every entry")
    return arr.astype(np.int64)
