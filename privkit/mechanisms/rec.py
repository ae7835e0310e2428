"""Relative entropy coding (REC) as a privacy mechanism: DP-REC's client encoder and decoder.

A client clips its update ``u`` to ``||u||_2 <= C`` (``l2_clip_norm``), picks a fresh 128-bit
seed ``R``, and for each group ``g`` of coordinates draws ``K = 2**bits`` candidates
``w_k = stddev * xi_k`` (``xi_k ~ N(0, I)``) from the public stream of ``(R, g, k)``. It
selects ``k*`` with probability proportional to ``q(w_k) / p(w_k)``, where
``q = N(u_g, stddev^2 I)`` and ``p = N(0, stddev^2 I)``, and sends only ``R`` and the indices.
The server regenerates ``w_{k*}`` from ``(R, g, k*)``. The sampling itself is the privacy
noise (Triastcyn, Reisser & Louizos, "DP-REC", arXiv 2111.05454, Algorithms 1-4); its Renyi-DP
is priced by :mod:`privkit.accountants.rec` through the event :meth:`RecMessage.event`.

Public API (small and stable): :func:`encode`, :func:`decode`, :class:`RecMessage`
(``to_bytes`` / ``from_bytes``, ``size_bits``, ``event``), :func:`candidate_normals`.

**Message format** ``privkit.rec/1``, stream ``philox4x64_10+bm53`` (part of the format):

* **Words.** Philox4x64-10 (Salmon, Moraes, Dror & Shaw, SC 2011; the Random123 round
  function and constants), keyed by the seed as two 64-bit words
  ``(int.from_bytes(seed[0:8], "little"), int.from_bytes(seed[8:16], "little"))``. Candidate
  ``k`` of group ``g`` uses blocks ``j = 1, 2, ...`` at counter ``(j, 0, g, k)`` (lowest word
  first); each block yields four 64-bit words, in order.
* **Normals.** Each word ``w`` gives ``x = ((w >> 11) + 0.5) * 2**-53`` in (0, 1); Box-Muller on
  consecutive pairs ``(x0, x1)``: ``sqrt(-2 ln x0) * (cos(2 pi x1), sin(2 pi x1))`` in float64.
  The candidate of a group of ``d_g`` coordinates is ``stddev`` times the first ``d_g`` normals.
* **Groups.** The update is flattened leaf by leaf (dict order, row-major) and split by the
  message's ``grouping``: ``whole`` (one group), ``per-tensor`` (one per leaf; alias
  ``per-layer``), ``per-parameter`` (one per coordinate), ``chunks:N`` (consecutive runs of N),
  or ``explicit`` (index sets given to both :func:`encode` and :func:`decode`).

The integer words are computed with 64-bit integer arithmetic in torch (wrapping products;
the high word of each 64 x 64-bit product from signed 32-bit limbs whose partial sums fit in
int64 exactly), identically on every device; a message therefore decodes to the same
integers everywhere. The float64 ``log``, ``cos`` and ``sin`` of another
math library (CPU libm vs CUDA) may differ in the last ulp, which is harmless post-processing;
on one device, decoding reproduces the encoder's candidate bit for bit. Tails are cut at about
8.6 sigma. Decoding any index costs O(d_g) (each candidate has its own counter range).

**Encoding** streams candidates in chunks: for each chunk it computes the logits
``l_k = <xi_k, u_g> / stddev`` (log q/p up to a constant; nothing is exponentiated) and keeps a
running Gumbel-max ``argmax_k (l_k + G_k)``, an exact sample of ``softmax(l)``. Memory is
O(chunk) whatever K is. A chunk is a grid (groups x candidates x blocks) whose counter words
broadcast, so Philox's first rounds run on the few distinct values; its normals are the very
values :func:`decode` produces (the same elementwise float64 operations), and the logits are
batched matrix-vector products of the 4 normals of each block with the matching strided
coordinates of the update, without assembling the candidates. The Gumbel noise comes from
the client's private selection generator ``rng``, never from the seed (otherwise ``k*``
would be a function of ``(u, R)``, which the server knows).

**Seeds.** By default both the seed and the selection randomness come from the OS CSPRNG
(:class:`privkit.SecureRandom`). ``seed=`` is for tests and fast simulation: it needs an
explicit ``numpy.random.Generator`` or ``torch.Generator`` as ``rng`` and is refused in secure
mode. Seeds must never repeat: messages that share candidates are correlated and their privacy
losses do not simply add.

**Size.** :meth:`RecMessage.size_bits` is exactly ``128 + M * bits`` (seed plus indices;
the header, i.e. format, stddev, grouping and layout, is shared round configuration and is
reported separately by :meth:`RecMessage.header_bits`). ``size_bits(entropy_coded=True)``
is the length of a two-part enumerative code of the indices (their histogram, then the index
sequence given the histogram), used only when shorter. Under REC each ``k*`` is marginally
uniform on ``{0, ..., K - 1}`` (the candidates are exchangeable), so entropy coding saves
little in expectation.

Examples:
    >>> import numpy as np, torch
    >>> u = {"w": torch.tensor([[0.3, -0.2], [0.1, 0.0]]), "b": torch.tensor([0.05])}
    >>> msg = encode(u, l2_clip_norm=0.5, stddev=1.0, bits=8, groups="per-tensor",
    ...              seed=b"0123456789abcdef", rng=np.random.default_rng(0))
    >>> len(msg.indices), msg.size_bits()
    (2, 144)
    >>> out = decode(msg, {"w": (2, 2), "b": (1,)})
    >>> out["w"].shape, out["b"].dtype
    (torch.Size([2, 2]), torch.float64)
    >>> round(msg.noise_multiplier, 6), msg.event().num_candidates
    (2.0, 256)
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privkit import _validate
from privkit._rng import RngKind, SecureRandom, check_rng
from privkit.accountants.rec import RecDpEvent
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import InvalidParameterError
from privkit.mechanisms.clipping import clip_l2

__all__ = [
    "FORMAT",
    "STREAM",
    "MIN_BITS",
    "MAX_BITS",
    "SEED_BYTES",
    "RecMessage",
    "encode",
    "decode",
    "candidate_normals",
    "philox4x64_10",
]

FORMAT = "privkit.rec/1"
STREAM = "philox4x64_10+bm53"
MIN_BITS, MAX_BITS = 1, 24
SEED_BYTES = 16

_MASK32 = (1 << 32) - 1
_MASK53 = (1 << 53) - 1
_MASK64 = (1 << 64) - 1
_PHILOX_M = (0xD2E7470EE14C6C93, 0xCA5A826395121157)
_PHILOX_W = (0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B)
_TWO_PI = 2.0 * math.pi
#: Candidate-coordinates generated per chunk while encoding, per torch thread (bounds scratch
#: memory: about 100 bytes each; 2**18 keeps a chunk's int64 words in a core's L2 cache).
CHUNK_ELEMENTS = 1 << 18
_GROUPINGS = ("whole", "per-tensor", "per-parameter")
#: decode computes groups of different sizes in one pass (padded to the widest) when there
#: are at most this many and the padding at most doubles the work or stays below
#: _SMALL_DECODE blocks (per-call overhead dominates such small passes).
_FEW_GROUPS, _SMALL_DECODE = 64, 1 << 14
_MAGIC = b"PKREC1"


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


# ------------------------------------------------------------------ layout helpers
def _is_shape(x: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Size):
        return True
    return isinstance(x, (tuple, list)) and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in x)


def _shape_leaves(shapes: Any) -> tuple[list[tuple[str, tuple[int, ...]]], Any]:
    """((path, shape) leaves, structure) of a shape tree (dict, list/tuple of shapes, shape)."""
    if _is_shape(shapes):
        shape = tuple(int(v) for v in shapes)
        if any(v < 0 for v in shape):
            raise InvalidParameterError("shapes", shapes, "non-negative dimensions")
        return [("", shape)], None
    if isinstance(shapes, Mapping):
        out, keys = [], []
        for key, sub in shapes.items():
            if not _is_shape(sub):
                raise InvalidParameterError(f"shapes[{key!r}]", sub, "a shape (tuple of ints)")
            out.append((str(key), tuple(int(v) for v in sub)))
            keys.append(key)
        return out, ("dict", keys)
    if isinstance(shapes, (list, tuple)):
        out = []
        for i, sub in enumerate(shapes):
            if not _is_shape(sub):
                raise InvalidParameterError(f"shapes[{i}]", sub, "a shape (tuple of ints)")
            out.append((str(i), tuple(int(v) for v in sub)))
        return out, ("list", len(shapes))
    raise InvalidParameterError("shapes", shapes, "a shape, a dict of shapes or a list of shapes")


def _update_leaves(update: Any) -> tuple[list[Any], Any, list[tuple[str, tuple[int, ...]]]]:
    """(leaves, structure, (path, shape) list) of an update tree."""
    torch = sys.modules.get("torch")

    def is_leaf(x: Any) -> bool:
        return isinstance(x, np.ndarray) or (torch is not None and isinstance(x, torch.Tensor))

    if is_leaf(update):
        return [update], None, [("", tuple(update.shape))]
    if isinstance(update, Mapping):
        items = list(update.items())
        struct_: Any = ("dict", [k for k, _ in items])
    elif isinstance(update, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(update)]
        struct_ = ("list", len(items))
    else:
        raise InvalidParameterError("update", type(update).__name__,
                                    "a torch tensor, numpy array, or a dict/list of them")
    leaves, shapes = [], []
    for key, leaf in items:
        if not is_leaf(leaf):
            raise InvalidParameterError(f"update[{key!r}]", type(leaf).__name__,
                                        "a torch tensor or numpy array")
        leaves.append(leaf)
        shapes.append((str(key), tuple(leaf.shape)))
    if not leaves:
        raise InvalidParameterError("update", "an empty tree", "at least one coordinate")
    return leaves, struct_, shapes


def _check_grouping(groups: Any) -> str:
    if isinstance(groups, str):
        name = groups.strip().lower()
        if name == "per-layer":
            name = "per-tensor"
        if name in _GROUPINGS:
            return name
        if name.startswith("chunks:"):
            try:
                size = int(name.split(":", 1)[1])
            except ValueError:
                size = 0
            if size >= 1:
                return f"chunks:{size}"
        raise InvalidParameterError(
            "groups", groups, "whole, per-tensor (per-layer), per-parameter, chunks:N, an int "
            "chunk size, or a sequence of index arrays partitioning the coordinates")
    if isinstance(groups, (int, np.integer)) and not isinstance(groups, bool):
        if groups >= 1:
            return f"chunks:{int(groups)}"
        raise InvalidParameterError("groups", groups, "a chunk size >= 1")
    return "explicit"


def _group_index(grouping: str, groups: Any, leaf_sizes: Sequence[int]) -> list[Any]:
    """The groups as index lists: a (start, stop) range or an int64 index array each."""
    d = int(sum(leaf_sizes))
    if d == 0:
        raise InvalidParameterError("update", "0 coordinates", "at least one coordinate")
    if grouping == "whole":
        return [(0, d)]
    if grouping == "per-tensor":
        out, start = [], 0
        for s in leaf_sizes:
            if s:
                out.append((start, start + s))
            start += s
        return out
    if grouping == "per-parameter":
        return [(i, i + 1) for i in range(d)]
    if grouping.startswith("chunks:"):
        size = int(grouping.split(":", 1)[1])
        return [(s, min(s + size, d)) for s in range(0, d, size)]
    if groups is None:
        raise InvalidParameterError("groups", None, "the explicit index sets this message "
                                    "was encoded with")
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise InvalidParameterError("groups", groups, "a non-empty sequence of index arrays")
    explicit: list[Any] = []
    seen = np.zeros(d, dtype=np.int64)
    for i, idx in enumerate(groups):
        arr = np.asarray(idx)
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
            raise InvalidParameterError(f"groups[{i}]", idx, "a non-empty 1-D integer array")
        if arr.min() < 0 or arr.max() >= d:
            raise InvalidParameterError(f"groups[{i}]", idx, f"indices in [0, {d})")
        np.add.at(seen, arr, 1)
        explicit.append(arr.astype(np.int64))
    if not (seen == 1).all():
        bad = int(np.flatnonzero(seen != 1)[0])
        raise InvalidParameterError(
            "groups", f"coordinate {bad} in {int(seen[bad])} groups",
            f"a partition of the {d} coordinates (each in exactly one group)")
    return explicit


def _layout_id(shapes: Sequence[tuple[str, tuple[int, ...]]], grouping: str,
               groups: list[Any]) -> str:
    body: dict[str, Any] = {"shapes": [[p, list(s)] for p, s in shapes], "grouping": grouping}
    if grouping == "explicit":
        body["groups"] = hashlib.sha256(b"".join(
            np.ascontiguousarray(g, dtype="<i8").tobytes() + b"|" for g in groups)).hexdigest()
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def _check_seed(seed: Any) -> bytes:
    if isinstance(seed, (bytes, bytearray)):
        if len(seed) != SEED_BYTES:
            raise InvalidParameterError("seed", f"{len(seed)} bytes", f"{SEED_BYTES} bytes")
        return bytes(seed)
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        s = int(seed)
        if 0 <= s < 1 << 128:
            return s.to_bytes(SEED_BYTES, "little")
    raise InvalidParameterError("seed", seed, "None, 16 bytes, or an int in [0, 2**128)")


def _relation(value: Any) -> Any:
    if isinstance(value, NeighboringRelation):
        return value
    if isinstance(value, str) and value.upper() in NeighboringRelation.__members__:
        return NeighboringRelation[value.upper()]
    raise InvalidParameterError("neighboring_relation", value,
                                "REPLACE_ONE or ADD_OR_REMOVE_ONE")


# ------------------------------------------------------------------ the message
@dataclass(frozen=True)
class RecMessage:
    """What a client sends: the seed and one index per group, plus the round's header.

    Attributes:
        seed: 16 bytes; keys the public candidate stream.
        indices: one index in ``[0, 2**bits)`` per group, in group order.
        bits: b, bits per index (K = 2**b candidates per group), 1 <= b <= 24.
        stddev: sigma, std of prior and target (parameter units).
        noise_multiplier: sigma / C (C the clip norm); the accountant's parameter.
        grouping: ``whole``, ``per-tensor``, ``per-parameter``, ``chunks:N`` or ``explicit``.
        layout: digest of the parameter shapes and grouping (decode refuses a mismatch).
        neighboring_relation: the relation the event is priced under (name).
        format, stream: the message format and stream ids (decode refuses unknown ones).
    """

    seed: bytes
    indices: tuple[int, ...]
    bits: int
    stddev: float
    noise_multiplier: float
    grouping: str
    layout: str
    neighboring_relation: str = "REPLACE_ONE"
    format: str = FORMAT
    stream: str = STREAM
    _meta: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_groups(self) -> int:
        return len(self.indices)

    @property
    def num_candidates(self) -> int:
        return 1 << self.bits

    def event(self) -> RecDpEvent:
        """The privacy event of this message (one use of REC, :mod:`privkit.accountants.rec`)."""
        return RecDpEvent(noise_multiplier=self.noise_multiplier,
                          num_candidates=self.num_candidates, num_groups=self.num_groups,
                          neighboring_relation=self.neighboring_relation)

    def size_bits(self, *, include_seed: bool = True, entropy_coded: bool = False) -> int:
        """Exact payload bits: 128 (seed) + M * bits, or the entropy-coded indices if shorter."""
        index_bits = self.num_groups * self.bits
        if entropy_coded:
            index_bits = min(index_bits, 1 + _enumerative_bits(self.indices, self.num_candidates))
        return index_bits + (8 * SEED_BYTES if include_seed else 0)

    @staticmethod
    def header_bits() -> int:
        """Bits of the header of :meth:`to_bytes` (shared round configuration)."""
        return 8 * _HEADER.size

    def to_bytes(self) -> bytes:
        """Wire encoding: a fixed header, the seed, then the indices packed ``bits`` each."""
        rel = 0 if self.neighboring_relation == "REPLACE_ONE" else 1
        grouping = self.grouping.encode()
        head = _HEADER.pack(_MAGIC, self.bits, rel, len(self.indices), self.stddev,
                            self.noise_multiplier, bytes.fromhex(self.layout))
        return (head + struct.pack("<B", len(grouping)) + grouping + self.seed
                + _pack_bits(self.indices, self.bits))

    @classmethod
    def from_bytes(cls, data: bytes) -> RecMessage:
        """Inverse of :meth:`to_bytes`; raises InvalidParameterError on malformed data."""
        try:
            magic, bits, rel, m, stddev, nm, layout = _HEADER.unpack_from(data, 0)
            pos = _HEADER.size
            (glen,) = struct.unpack_from("<B", data, pos)
            grouping = data[pos + 1: pos + 1 + glen].decode()
            pos += 1 + glen
            seed = data[pos: pos + SEED_BYTES]
            pos += SEED_BYTES
        except (struct.error, UnicodeDecodeError):
            raise InvalidParameterError("data", f"{len(data)} bytes", "a REC message") from None
        if magic != _MAGIC or len(seed) != SEED_BYTES or not MIN_BITS <= bits <= MAX_BITS:
            raise InvalidParameterError("data", data[:8], f"a {FORMAT} message")
        need = (m * bits + 7) // 8
        if len(data) != pos + need:
            raise InvalidParameterError("data", f"{len(data)} bytes", f"{pos + need} bytes")
        indices = _unpack_bits(data[pos:], bits, m)
        return cls(seed, indices, bits, stddev, nm, grouping, layout.hex(),
                   "REPLACE_ONE" if rel == 0 else "ADD_OR_REMOVE_ONE")


_HEADER = struct.Struct("<6sBBIdd8s")


def _pack_bits(values: Sequence[int], bits: int) -> bytes:
    acc = 0
    for i, v in enumerate(values):
        acc |= int(v) << (i * bits)
    return acc.to_bytes((len(values) * bits + 7) // 8, "little")


def _unpack_bits(data: bytes, bits: int, m: int) -> tuple[int, ...]:
    acc = int.from_bytes(data, "little")
    mask = (1 << bits) - 1
    return tuple((acc >> (i * bits)) & mask for i in range(m))


def _enumerative_bits(indices: Sequence[int], k: int) -> int:
    """Bits of a two-part enumerative code: the histogram, then the sequence given it."""
    m = len(indices)
    if m == 0:
        return 0
    counts = np.bincount(np.asarray(indices, dtype=np.int64), minlength=k)
    lg = math.lgamma
    hist = (lg(m + k) - lg(k) - lg(m + 1)) / math.log(2)  # log2 C(m + k - 1, k - 1)
    seq = (lg(m + 1) - sum(lg(c + 1) for c in counts if c)) / math.log(2)
    return math.ceil(hist) + math.ceil(seq)


# ------------------------------------------------------------------ encode / decode
def _flat_update(leaves: list[Any], device: Any) -> Any:
    torch = _torch()
    parts = []
    for i, leaf in enumerate(leaves):
        t = torch.as_tensor(leaf) if isinstance(leaf, np.ndarray) else leaf.detach()
        if not t.is_floating_point():
            raise InvalidParameterError(f"update[{i}]", t.dtype, "a floating-point tensor")
        parts.append(t.to(device=device, dtype=torch.float64).reshape(-1))
    flat = torch.cat(parts)
    if not bool(torch.isfinite(flat).all()):
        bad = int(torch.nonzero(~torch.isfinite(flat))[0, 0])
        raise InvalidParameterError("update", f"coordinate {bad} = {float(flat[bad])}",
                                    "finite in every coordinate (no NaN or inf)")
    return flat


def _gumbel(rng: Any, kind: RngKind, shape: tuple[int, int], device: Any) -> Any:
    """Standard Gumbel noise -log(-log U) from the private selection generator."""
    torch = _torch()
    n = shape[0] * shape[1]
    if kind is RngKind.TORCH:
        u = torch.rand(shape, generator=rng, dtype=torch.float64, device=rng.device)
        u = u.to(device)
    else:
        arr = rng.uniform(size=n) if kind is RngKind.SECURE else rng.random(n)
        u = torch.as_tensor(np.asarray(arr, dtype=np.float64).reshape(shape), device=device)
    return -torch.log(-torch.log(u))


def encode(
    update: Any,
    *,
    l2_clip_norm: float,
    stddev: float,
    bits: int,
    groups: Any = "per-tensor",
    seed: Any = None,
    rng: Any = None,
    neighboring_relation: Any = "REPLACE_ONE",
    chunk_elements: int | None = None,
    _target_scale: float = 1.0,
) -> RecMessage:
    """Clip ``update`` to ``l2_clip_norm`` and encode it with REC: the client side of DP-REC.

    Args:
        update: the client's update: a torch tensor, numpy array, or dict/list of them
            (float, finite). Encoding runs in float64 on the first tensor's device.
        l2_clip_norm: C, L2 clip norm of the whole update (parameter units), > 0.
        stddev: sigma, std of the prior and the target (parameter units), > 0.
        bits: b, bits per group index (K = 2**b candidates), integer in [1, 24].
        groups: ``"whole"``, ``"per-tensor"`` (or ``"per-layer"``), ``"per-parameter"``,
            ``"chunks:N"`` or an int N, or a sequence of integer index arrays that partition
            the flattened coordinates (then pass the same to :func:`decode`).
        seed: None (default: 16 bytes from the OS CSPRNG), or 16 bytes / an int below
            2**128 for tests and simulation (needs an explicit numpy/torch ``rng``).
        rng: the private selection generator: None or :class:`privkit.SecureRandom`
            (secure mode, the default), a ``numpy.random.Generator`` or a ``torch.Generator``.
        neighboring_relation: the relation the event states (``REPLACE_ONE`` by default).
        chunk_elements: candidate-coordinates per chunk (memory bound, about 100 bytes
            each), >= 1; None: :data:`CHUNK_ELEMENTS` times ``torch.get_num_threads()``.
        _target_scale: audit knob: the selection targets ``_target_scale * u`` while the
            event still claims ``u`` (values > 1 build a broken mechanism).

    Returns:
        The :class:`RecMessage` (seed, indices, header); ``message.event()`` is its privacy event.

    Raises:
        InvalidParameterError: bits outside [1, 24], groups that do not partition the
            coordinates, a NaN/inf update, a seed of the wrong type, a seed in secure mode,
            or another bad argument (each named).
    """
    torch = _torch()
    c = _validate.positive("l2_clip_norm", l2_clip_norm)
    sigma = _validate.positive("stddev", stddev)
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) \
            or not MIN_BITS <= bits <= MAX_BITS:
        raise InvalidParameterError("bits", bits, f"an integer in [{MIN_BITS}, {MAX_BITS}]")
    b = int(bits)
    chunk = (CHUNK_ELEMENTS * max(1, torch.get_num_threads()) if chunk_elements is None
             else _validate.positive_int("chunk_elements", chunk_elements))
    scale = _validate.positive("_target_scale", _target_scale)
    rel = _relation(neighboring_relation)
    if rng is None:
        rng = SecureRandom()
    kind = check_rng(rng)
    if seed is None:
        seed_bytes = _os_seed()
    else:
        if kind is RngKind.SECURE:
            raise InvalidParameterError(
                "seed", seed, "None in secure mode (the seed comes from the OS CSPRNG); pass a "
                "numpy or torch generator as rng to use a fixed seed")
        seed_bytes = _check_seed(seed)
    grouping = _check_grouping(groups)
    leaves, _, shapes = _update_leaves(update)
    index = _group_index(grouping, groups, [math.prod(s) for _, s in shapes])
    first = leaves[0]
    device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    flat = _flat_update(leaves, device)
    flat = clip_l2(flat, c)  # float-safe: the float64 norm of what is used is <= C
    target = flat * (scale / sigma)  # logits l_k = <xi_k, u_g> / sigma
    idx = _select(seed_bytes, target, index, 1 << b, rng, kind, chunk, device)
    msg = RecMessage(seed_bytes, tuple(int(i) for i in idx), b, sigma, sigma / c, grouping,
                     _layout_id(shapes, grouping, index), rel.name)
    return msg


def _os_seed() -> bytes:
    import secrets

    return secrets.token_bytes(SEED_BYTES)


def _buckets(index: list[Any]) -> dict[int, list[int]]:
    """Group ids by group size (groups of one size are processed together)."""
    out: dict[int, list[int]] = {}
    for g, ix in enumerate(index):
        size = ix[1] - ix[0] if isinstance(ix, tuple) else len(ix)
        out.setdefault(int(size), []).append(g)
    return out


def _gather(flat: Any, index: list[Any], gids: list[int], size: int) -> Any:
    """(len(gids), size) matrix of the coordinates of the given groups."""
    torch = _torch()
    if all(isinstance(index[g], tuple) for g in gids):
        starts = torch.tensor([index[g][0] for g in gids], dtype=torch.int64, device=flat.device)
        pos = starts[:, None] + torch.arange(size, device=flat.device)
    else:
        pos = torch.as_tensor(np.stack([_as_positions(index[g]) for g in gids]),
                              device=flat.device)
    return flat[pos]


def _as_positions(ix: Any) -> np.ndarray:
    return np.arange(ix[0], ix[1]) if isinstance(ix, tuple) else np.asarray(ix)


def _select(seed: bytes, target: Any, index: list[Any], k: int, rng: Any, kind: RngKind,
            chunk: int, device: Any) -> list[int]:
    """Running Gumbel-max over candidate chunks, batched over groups of equal size.

    A chunk is ``ng`` groups x ``kn`` candidates x ``blocks`` Philox blocks (at most
    ``chunk`` candidate-coordinates, counting the padding of a group's last block). Its
    normals come as 4 tensors, one per word of a block (:func:`_block_normals`), exactly the
    values :func:`candidate_normals` (and so :func:`decode`) gives; the logits
    ``<xi_k, u_g>`` are 4 batched matrix-vector products against the matching strided
    coordinates of the target (zero-padded), so no candidate is ever assembled.
    """
    torch = _torch()
    key = _key(seed)
    chosen = [0] * len(index)
    for size, gids in _buckets(index).items():
        blocks = (size + 3) // 4
        width = 4 * blocks
        tg = _gather(target, index, gids, size)  # (G, size)
        if width != size:
            tg = torch.nn.functional.pad(tg, (0, width - size))
        parts = [tg[:, i::4].unsqueeze(-1) for i in range(4)]  # (G, blocks, 1) each
        gid_t = torch.tensor(gids, dtype=torch.int64, device=device)
        per_pass = max(1, min(len(gids), chunk // width))
        for a in range(0, len(gids), per_pass):
            rows = gid_t[a:a + per_pass]
            ng = rows.shape[0]
            u = [p[a:a + ng].contiguous() for p in parts[:min(size, 4)]]
            kc = max(1, min(k, chunk // (width * ng)))
            best = torch.full((ng,), -math.inf, dtype=torch.float64, device=device)
            arg = torch.zeros(ng, dtype=torch.int64, device=device)
            for k0 in range(0, k, kc):
                kn = min(kc, k - k0)
                ks = torch.arange(k0, k0 + kn, dtype=torch.int64, device=device).view(1, kn, 1)
                z = _block_normals(key, rows.view(ng, 1, 1), ks, blocks, size)
                logits = torch.bmm(z[0], u[0])
                for zi, ui in zip(z[1:], u[1:]):
                    logits.baddbmm_(zi, ui)
                keys = logits.view(ng, kn) + _gumbel(rng, kind, (ng, kn), device)
                m, j = keys.max(dim=1)
                better = m > best
                best = torch.where(better, m, best)
                arg = torch.where(better, j + k0, arg)
            for g, v in zip(rows.tolist(), arg.tolist()):
                chosen[g] = int(v)
    return chosen


def decode(message: RecMessage, shapes: Any, *, groups: Any = None, device: Any = "cpu",
           dtype: Any = None) -> Any:
    """The update the server uses: candidate ``k*_g`` of every group, reassembled.

    Args:
        message: a :class:`RecMessage` (e.g. from :meth:`RecMessage.from_bytes`).
        shapes: the parameter shapes in the encoder's order: one shape, a dict of shapes
            (e.g. ``model.parameter_shapes()``) or a list of shapes.
        groups: the index arrays, only for ``grouping == "explicit"``.
        device: where to compute and return the tensors.
        dtype: output dtype (default float64).

    Returns:
        Tensors shaped like ``shapes`` (a dict for a dict, a list for a list), in parameter
        units (``stddev`` times the chosen candidates' normals).

    Raises:
        InvalidParameterError: unknown format or stream, indices out of range, or a layout
            (shapes, grouping) other than the encoder's.
    """
    torch = _torch()
    if not isinstance(message, RecMessage):
        raise InvalidParameterError("message", type(message).__name__, "a RecMessage")
    if message.format != FORMAT or message.stream != STREAM:
        raise InvalidParameterError("message.stream", f"{message.format}/{message.stream}",
                                    f"{FORMAT}/{STREAM}")
    if not MIN_BITS <= message.bits <= MAX_BITS:
        raise InvalidParameterError("message.bits", message.bits, "in [1, 24]")
    seed = _check_seed(message.seed)
    leaves, structure = _shape_leaves(shapes)
    grouping = _check_grouping(message.grouping) if message.grouping != "explicit" \
        else "explicit"
    sizes = [math.prod(s) for _, s in leaves]
    index = _group_index(grouping, groups, sizes)
    if _layout_id(leaves, grouping, index) != message.layout or len(index) != len(
            message.indices):
        raise InvalidParameterError("shapes", shapes, "the layout (shapes and groups) the "
                                    "message was encoded with")
    k = message.num_candidates
    if any(not 0 <= int(i) < k for i in message.indices):
        raise InvalidParameterError("message.indices", max(message.indices), f"in [0, {k})")
    dev = torch.device(device)
    flat = torch.empty(int(sum(sizes)), dtype=torch.float64, device=dev)
    buckets = _buckets(index)
    widest = max(buckets)
    blocks = sum(((size + 3) // 4) * len(gids) for size, gids in buckets.items())
    if len(buckets) > 1 and len(index) <= _FEW_GROUPS \
            and len(index) * ((widest + 3) // 4) <= max(2 * blocks, _SMALL_DECODE):
        # few groups: one pass, each group's stream cut to its size (a candidate's normals do
        # not depend on how many blocks are computed), instead of one pass per size
        z = candidate_normals(seed, range(len(index)), message.indices, widest, device=dev)
        for g, ix in enumerate(index):
            size = ix[1] - ix[0] if isinstance(ix, tuple) else len(ix)
            pos = slice(*ix) if isinstance(ix, tuple) else torch.as_tensor(ix, device=dev)
            flat[pos] = z[g, :size] * message.stddev
    else:
        for size, gids in buckets.items():
            z = candidate_normals(seed, gids, [message.indices[g] for g in gids], size,
                                  device=dev)
            pos = torch.as_tensor(np.stack([_as_positions(index[g]) for g in gids]),
                                  device=dev)
            flat[pos.reshape(-1)] = (z * message.stddev).reshape(-1)
    if dtype is not None:
        flat = flat.to(dtype)
    out, start = [], 0
    for (_, shape), n in zip(leaves, sizes):
        out.append(flat[start:start + n].reshape(shape))
        start += n
    if structure is None:
        return out[0]
    if structure[0] == "dict":
        return dict(zip(structure[1], out))
    return out
