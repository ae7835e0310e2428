"""The randomized Hadamard rotation of distributed DP (public randomness, orthogonal).

The client rotates its clipped update before scaling and rounding it, so that every
coordinate of the rotated vector is small (a sum of random signs) and the rounding and the
modulus treat all coordinates alike; the server rotates the decoded sum back. Deterministic
given the public seed, and apart from :mod:`privkit.mechanisms.distributed` (which exports
the public names) because it is a plain linear map that knows nothing of noise or clipping.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError

__all__ = ["hadamard_rotate", "inverse_hadamard_rotate"]


def _fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalised fast Walsh-Hadamard transform of a float64 vector of length 2^k."""
    y = np.array(x, dtype=np.float64, copy=True)
    n = y.size
    h = 1
    while h < n:
        v = y.reshape(-1, 2, h)
        a = v[:, 0, :].copy()
        v[:, 0, :] += v[:, 1, :]
        v[:, 1, :] = a - v[:, 1, :]
        h *= 2
    return y


def _signs(rotation_seed: Any, d: int) -> np.ndarray:
    seed = _validate.nonnegative_int("rotation_seed", rotation_seed)
    bits = np.random.default_rng(seed).integers(0, 2, size=d)
    return bits.astype(np.float64) * 2.0 - 1.0


def _padded_vector(x: Any, name: str) -> np.ndarray:
    v = np.asarray(x, dtype=np.float64)
    if v.ndim != 1 or v.size == 0 or v.size & (v.size - 1):
        raise InvalidParameterError(name, v.shape, "a 1-D array whose length is a power of 2")
    return v


def hadamard_rotate(x: Any, rotation_seed: int) -> np.ndarray:
    """The randomized Hadamard rotation ``H D x / sqrt(d)`` (``D`` random signs from the public
    ``rotation_seed``, ``H`` the Walsh-Hadamard matrix): orthogonal, so norms are kept.

    Args:
        x: a 1-D float vector whose length ``d`` is a power of 2 (zero-pad first).
        rotation_seed: public shared randomness, an integer >= 0.

    Example:
        >>> import numpy as np
        >>> y = hadamard_rotate(np.array([3.0, 4.0, 0.0, 0.0]), rotation_seed=1)
        >>> round(float(np.linalg.norm(y)), 12)
        5.0
        >>> np.allclose(inverse_hadamard_rotate(y, rotation_seed=1), [3, 4, 0, 0])
        True
    """
    v = _padded_vector(x, "x")
    return _fwht(v * _signs(rotation_seed, v.size)) / math.sqrt(v.size)


def inverse_hadamard_rotate(y: Any, rotation_seed: int) -> np.ndarray:
    """The inverse of :func:`hadamard_rotate` with the same seed: ``D H y / sqrt(d)``."""
    v = _padded_vector(y, "y")
    return _signs(rotation_seed, v.size) * (_fwht(v) / math.sqrt(v.size))
