"""Seed trees: reproducible random streams keyed by (seed, round, stream name).

Every random stream a simulation uses (client subsets, stragglers, batch order,
initialisation, noise) is derived from ``(seed, round, stream name)`` with
:class:`numpy.random.SeedSequence`, never from a global generator. Two
algorithms run with the same seed therefore see the same client subsets and
stragglers in round t, whatever else they draw. A seeded stream is for
experiments: whoever knows the seed can regenerate the noise, so privacy
claims need :class:`privkit.SecureRandom` instead.

Example:
    >>> tree = SeedTree(7)
    >>> a = tree.numpy(3, "clients").integers(0, 100, 5)
    >>> b = SeedTree(7).numpy(3, "clients").integers(0, 100, 5)
    >>> bool((a == b).all())
    True
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from privkit import _validate

__all__ = ["SeedTree", "STREAMS"]

#: Stream names and their fixed ids (part of the reproducibility contract).
STREAMS = {"init": 0, "clients": 1, "stragglers": 2, "batches": 3, "noise": 4, "eval": 5}


def _stream_id(stream: str) -> int:
    if stream in STREAMS:
        return STREAMS[stream]
    return 1000 + zlib.crc32(stream.encode("utf-8"))  # stable across processes


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 words (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class SeedTree:
    """Deterministic generators keyed by (round, stream) under one root seed."""

    def __init__(self, seed: int) -> None:
        self.seed = _validate.nonnegative_int("seed", seed)

    def sequence(self, round_: int, stream: str) -> np.random.SeedSequence:
        return np.random.SeedSequence(self.seed, spawn_key=(int(round_), _stream_id(stream)))

    def numpy(self, round_: int, stream: str) -> np.random.Generator:
        """A fresh numpy Generator for this round and stream."""
        return np.random.default_rng(self.sequence(round_, stream))

    def uniforms(self, round_: int, stream: str, ids: Any, count: int = 1) -> np.ndarray:
        """``(len(ids), count)`` uniforms in [0, 1), row i keyed by ``ids[i]`` alone.

        Row i depends only on the seed, the round, the stream and the integer id ``ids[i]``
        (a counter-based hash, SplitMix64, no shared generator): a client's draws never
        depend on who else is drawn for, or on the population's size, so adding a client
        never moves another (the coupling the add/remove relation needs).

        Example:
            >>> t = SeedTree(0)
            >>> a = t.uniforms(1, "x", [3], 2)
            >>> b = t.uniforms(1, "x", [1, 3, 7], 2)
            >>> bool((a[0] == b[1]).all()), a.shape
            (True, (1, 2))
        """
        n = _validate.positive_int("count", count)
        keys = self.sequence(round_, stream).generate_state(n, np.uint64)
        words = _splitmix64(_splitmix64(np.asarray(ids, dtype=np.uint64).reshape(-1, 1))
                            ^ keys.reshape(1, -1))
        return (words >> np.uint64(11)).astype(np.float64) * 2.0**-53

    def torch(self, round_: int, stream: str, device: Any = "cpu") -> Any:
        """A fresh torch.Generator on ``device`` for this round and stream."""
        import torch

        g = torch.Generator(device=device)
        g.manual_seed(int(self.sequence(round_, stream).generate_state(1, np.uint64)[0] >> 1))
        return g
