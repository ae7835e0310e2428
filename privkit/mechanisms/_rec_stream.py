"""The public candidate stream of REC: Philox4x64-10 words and the normals made from them.

Part of the message format ``privkit.rec/1`` (stream ``philox4x64_10+bm53``, see
:mod:`privkit.mechanisms.rec`): candidate ``k`` of group ``g`` uses blocks ``j = 1, 2, ...``
at counter ``(j, 0, g, k)`` under the key made from the message's seed; each 64-bit word
becomes a uniform in (0, 1) and consecutive pairs become normals by Box-Muller. The integer
words are computed with 64-bit integer arithmetic in torch (wrapping products; the high word
of each product from signed 32-bit limbs), identically on every device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError

__all__ = ["philox4x64_10", "candidate_normals"]

_MASK32 = (1 << 32) - 1
_MASK53 = (1 << 53) - 1
_MASK64 = (1 << 64) - 1
_PHILOX_M = (0xD2E7470EE14C6C93, 0xCA5A826395121157)
_PHILOX_W = (0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B)
_TWO_PI = 2.0 * math.pi


def _torch() -> Any:
    import torch

    return torch


def _signed(x: int) -> int:
    """A uint64 value as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


# ------------------------------------------------------------------ the stream
def _limbs(a: int) -> tuple[int, int, int]:
    """``(a_s, A1, A0)``: ``a`` as a signed int64 value and its signed 32-bit limbs,
    ``a_s = A1 * 2**32 + A0`` with ``-2**31 <= A0 < 2**31``."""
    a_s = _signed(a)
    a0 = ((a_s + (1 << 31)) & _MASK32) - (1 << 31)
    return a_s, (a_s - a0) >> 32, a0


_LIMBS = {m: _limbs(m) for m in _PHILOX_M}


def _check_limbs() -> None:
    """:func:`_mulhilo`'s int64 intermediates are exact for the Philox multipliers: with
    ``|B0| < 2**32`` and ``|B1| <= 2**31``, ``|A0 B0| < 2**63`` and the middle sum
    ``|A1 B0| + |A0 B1| + 2**31 < 2**63`` (both multipliers have |A1| < 2**30)."""
    for a, (_, a1, a0) in _LIMBS.items():
        if not (abs(a0) << 32 < 1 << 63
                and (abs(a1) << 32) + (abs(a0) << 31) + (1 << 31) < 1 << 63):
            raise RuntimeError(f"Philox multiplier {a:#x}: limbs overflow int64")


_check_limbs()


class _Pool:
    """Free int64 scratch tensors by shape: the Philox rounds reuse them instead of allocating."""

    def __init__(self) -> None:
        self._free: dict[Any, list[Any]] = {}

    def take(self, like: Any) -> Any:
        """A scratch tensor shaped like ``like`` (contents undefined)."""
        free = self._free.get((like.shape, like.device))
        return free.pop() if free else _torch().empty(like.shape, dtype=like.dtype,
                                                      device=like.device)

    def give(self, t: Any) -> None:
        self._free.setdefault((t.shape, t.device), []).append(t)


def _mulhilo(a: int, b: Any, pool: _Pool | None = None, own: bool = False) -> tuple[Any, Any]:
    """(hi, lo) 64-bit words of the 128-bit product of the Philox multiplier ``a`` and ``b``.

    ``b`` is an int64 tensor of uint64 bit patterns or a Python int; words come back in the
    same form. ``lo`` is one wrapping int64 product. For ``hi``, with the signed limbs
    ``a_s = A1 2**32 + A0`` (:func:`_limbs`) and ``b_s = B1 2**32 + B0`` (``B1 = b >> 32``
    arithmetic, ``B0 = b & (2**32 - 1)``), every partial product and the middle sum fit in
    int64 exactly (:func:`_check_limbs`), so
    ``floor(a_s b_s / 2**64) = A1 B1 + ((A1 B0 + A0 B1 + ((A0 B0) >> 32)) >> 32)``, and the
    unsigned high word is that plus ``b_s`` (as ``a_s < 0``) plus ``a_s`` where ``b_s < 0``,
    modulo 2**64: 16 elementwise operations. Scratch comes from ``pool``; with ``own`` the
    caller gives up ``b``, which becomes ``lo`` in place.
    """
    if isinstance(b, int):
        p = a * (b & _MASK64)
        return _signed(p >> 64), _signed(p)
    torch = _torch()
    pool = pool or _Pool()
    a_s, a1, a0 = _LIMBS[a]
    b0, b1, p = pool.take(b), pool.take(b), pool.take(b)
    torch.bitwise_and(b, _MASK32, out=b0)
    torch.bitwise_right_shift(b, 32, out=b1)
    torch.mul(b0, a0, out=p)
    p >>= 32
    b0 *= a1
    b0 += p
    torch.mul(b1, a0, out=p)
    b0 += p
    b0 >>= 32
    b1 *= a1
    b1 += b0  # floor(a_s b_s / 2**64)
    if a_s < 0:
        b1 += b
    torch.bitwise_right_shift(b, 63, out=p)  # all ones where b_s < 0
    p &= a_s
    b1 += p
    pool.give(b0)
    if own:
        pool.give(p)
        return b1, b.mul_(a_s)
    torch.mul(b, a_s, out=p)
    return b1, p


def _holds(big: Any, small: Any) -> bool:
    """Whether a tensor of shape ``big`` can hold ``op(big, small)`` in place (broadcasting)."""
    return len(small) <= len(big) and all(
        b == a or b == 1 for a, b in zip(reversed(big), reversed(small)))


def _xor3(h: Any, c: Any, k: int, pool: _Pool, own: bool) -> Any:
    """``h ^ c ^ k``; ``h`` (a fresh :func:`_mulhilo` word) holds the result in place when
    it can. ``c`` is not modified; with ``own`` it goes back to ``pool`` afterwards."""
    ks = _signed(k)
    if isinstance(c, int):
        if isinstance(h, int):
            return _signed(h ^ c ^ ks)
        h ^= _signed(c ^ ks)
        return h
    if isinstance(h, int):
        return c ^ _signed(h ^ ks)
    if _holds(h.shape, c.shape):
        h ^= c
    else:
        h = h ^ c
    if own:
        pool.give(c)
    h ^= ks
    return h


def philox4x64_10(counter: Sequence[Any], key: tuple[int, int]) -> list[Any]:
    """Philox4x64-10 of counters ``(c0, c1, c2, c3)`` under a 128-bit key.

    Words are uint64 values held as int64 bit patterns: each counter word is an int64 tensor
    or a Python int, and the tensors broadcast against each other (a word that depends on
    fewer indices is computed on fewer elements; the caller's tensors are not modified).
    Returns the 4 output words, tensors of the broadcast shape (Python ints if every input is
    an int). Matches Random123's KAT: counter 0, key 0 gives 16554d9eca36314c
    db20fe9d672d0fdc d7e772cee186176b 7e68b68aec7ba23b.

    Examples:
        >>> import torch
        >>> z = torch.zeros(1, dtype=torch.int64)
        >>> [hex(int(w) & (2**64 - 1)) for w in philox4x64_10([z, z, z, z], (0, 0))][0]
        '0x16554d9eca36314c'
    """
    c0, c1, c2, c3 = (_signed(int(c)) if isinstance(c, (int, np.integer)) else c
                      for c in counter)
    k0, k1 = key
    pool = _Pool()
    for r in range(10):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK64, (k1 + _PHILOX_W[1]) & _MASK64
        own = r > 0  # after round 0 every word is this function's own scratch
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0, pool, own)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2, pool, own)
        c0, c1, c2, c3 = _xor3(hi1, c1, k0, pool, own), lo1, _xor3(hi0, c3, k1, pool, own), lo0
    return [c0, c1, c2, c3]


def _key(seed: bytes) -> tuple[int, int]:
    return int.from_bytes(seed[:8], "little"), int.from_bytes(seed[8:16], "little")


def _uniform53(w: Any) -> Any:
    """``((w >> 11) + 0.5) * 2**-53`` in float64 (logical shift), in (0, 1); ``w`` (a
    Philox output word) is overwritten."""
    torch = _torch()
    w >>= 11
    w &= _MASK53
    return w.to(torch.float64).add_(0.5).mul_(2.0**-53)


def _box_muller(w0: Any, w1: Any, *, sine: bool = True) -> tuple[Any, Any]:
    """Box-Muller of the word pair: ``(r cos t, r sin t)`` with ``r = sqrt(-2 ln x0)``,
    ``t = 2 pi x1`` (float64; the sine is skipped when ``sine`` is False)."""
    torch = _torch()
    r = torch.log(_uniform53(w0)).mul_(-2.0).sqrt_()
    t = _uniform53(w1).mul_(_TWO_PI)
    z0 = torch.cos(t).mul_(r)
    return z0, (t.sin_().mul_(r) if sine else None)


def _block_normals(key: tuple[int, int], g: Any, k: Any, blocks: int, used: int) -> list[Any]:
    """Normals of blocks ``j = 1..blocks`` of candidates ``(g, k)``: 4 float64 tensors of the
    broadcast shape of ``g``, ``k`` and the blocks (last axis); tensor ``i`` holds normal
    ``4 (j - 1) + i`` of each candidate. ``used`` (normals needed per candidate) skips the
    transforms of a one-block candidate's unused words (those entries are None)."""
    torch = _torch()
    shape = (1,) * (max(g.dim(), k.dim()) - 1) + (blocks,)
    j = torch.arange(1, blocks + 1, dtype=torch.int64, device=g.device).view(shape)
    w = philox4x64_10([j, 0, g, k], key)
    need = 4 if blocks > 1 else used
    z0, z1 = _box_muller(w[0], w[1], sine=need >= 2)
    z2, z3 = _box_muller(w[2], w[3], sine=need >= 4) if need >= 3 else (None, None)
    return [z0, z1, z2, z3]


def candidate_normals(seed: bytes, groups: Any, candidates: Any, dim: int, *,
                      device: Any = "cpu") -> Any:
    """Standard normals of candidates ``(g, k)``: shape ``(n, dim)``, float64, on ``device``.

    ``groups`` and ``candidates`` are equal-length 1-D integer sequences or tensors (group g,
    candidate k for each row). Row i is ``xi_{k_i}`` of group ``g_i`` (the message format's
    stream); the candidate is ``stddev`` times it. Cost O(n * dim), whatever the k.

    Examples:
        >>> seed = (0x0123456789abcdef).to_bytes(8, "little") + \\
        ...        (0xfedcba9876543210).to_bytes(8, "little")
        >>> [round(v, 12) for v in candidate_normals(seed, [0], [5], 2)[0].tolist()]
        [-1.457720897711, -0.398638729424]
    """
    torch = _torch()
    dev = torch.device(device)
    g = torch.as_tensor(groups, dtype=torch.int64, device=dev).reshape(-1)
    k = torch.as_tensor(candidates, dtype=torch.int64, device=dev).reshape(-1)
    if g.shape != k.shape:
        raise InvalidParameterError("candidates", tuple(k.shape), f"of shape {tuple(g.shape)}")
    d = _validate.positive_int("dim", dim)
    blocks = (d + 3) // 4
    n = g.shape[0]
    z = _block_normals(_key(seed), g[:, None], k[:, None], blocks, 4)
    return torch.stack(z, dim=-1).reshape(n, 4 * blocks)[:, :d]
