"""Secure aggregation's modular arithmetic: the exact sum modulo ``2^bits`` and its centring.

What SecAgg reveals (:func:`secure_sum`) and how the server reads it back as signed integers
(:func:`center_modular`), exact in uint64 / int64 for any number of clients. Apart from
:mod:`privkit.mechanisms.distributed` (which exports the public names) because it is integer
bookkeeping with no privacy in it: the noise is added before, by each client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from privkit.errors import InvalidParameterError
from privkit.events.distributed import check_bits

__all__ = ["secure_sum", "center_modular"]


def _residues(values: Any, bits: int, name: str) -> np.ndarray:
    a = np.asarray(values)
    if a.dtype.kind not in "ui":
        raise InvalidParameterError(name, a.dtype, "an integer array (values in [0, 2^bits))")
    if a.size and (a.min() < 0 or a.max() >= (1 << bits)):
        bad = a.min() if a.min() < 0 else a.max()
        raise InvalidParameterError(name, int(bad), f"values in [0, 2^{bits})")
    return a.astype(np.uint64)


def secure_sum(encoded: Sequence[Any], bits: int) -> np.ndarray:
    """What secure aggregation reveals: the exact sum of the clients' vectors modulo 2^bits.

    Every input holds residues in ``[0, 2^bits)``; the sum is taken in uint64 and reduced after
    each addition (two residues below 2^62 never overflow), so it is exact for any number of
    clients. Flower's SecAgg+ sums quantised vectors the same way (no noise of its own).

    Args:
        encoded: one integer array per surviving client, all of one shape (at least one).
        bits: the modulus exponent, 2..62.

    Example:
        >>> import numpy as np
        >>> secure_sum([np.array([7, 1], np.uint64), np.array([6, 0], np.uint64)], bits=3)
        array([5, 1], dtype=uint64)
    """
    b = check_bits(bits)
    if isinstance(encoded, np.ndarray) or not isinstance(encoded, Sequence) or not encoded:
        raise InvalidParameterError("encoded", type(encoded).__name__,
                                    "a non-empty list of per-client integer arrays")
    mask = np.uint64((1 << b) - 1)
    first = _residues(encoded[0], b, "encoded[0]")
    acc = first.copy()
    for i, e in enumerate(encoded[1:], start=1):
        r = _residues(e, b, f"encoded[{i}]")
        if r.shape != acc.shape:
            raise InvalidParameterError(f"encoded[{i}]", r.shape, f"shape {acc.shape}")
        acc += r
        acc &= mask
    return acc


def center_modular(values: Any, bits: int) -> np.ndarray:
    """Residues modulo 2^bits as the integers in ``[-2^(bits-1), 2^(bits-1))`` (int64).

    Example:
        >>> import numpy as np
        >>> center_modular(np.array([0, 3, 4, 7], np.uint64), bits=3)
        array([ 0,  3, -4, -1])
    """
    b = check_bits(bits)
    r = _residues(values, b, "values").astype(np.int64)
    half = 1 << (b - 1)
    return np.where(r >= half, r - (1 << b), r)
