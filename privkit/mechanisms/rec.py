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

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privkit import _validate
from privkit._rng import RngKind, SecureRandom, check_rng
from privkit.errors import InvalidParameterError
from privkit.events import RecDpEvent
from privkit.mechanisms._rec_layout import (
    SEED_BYTES,
    _check_grouping,
    _check_seed,
    _group_index,
    _layout_id,
    _relation,
    _shape_leaves,
    _update_leaves,
)
from privkit.mechanisms._rec_stream import (
    _block_normals,
    _key,
    _torch,
    candidate_normals,
    philox4x64_10,
)
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

#: Candidate-coordinates generated per chunk while encoding, per torch thread (bounds scratch
#: memory: about 100 bytes each; 2**18 keeps a chunk's int64 words in a core's L2 cache).
CHUNK_ELEMENTS = 1 << 18
#: decode computes groups of different sizes in one pass (padded to the widest) when there
#: are at most this many and the padding at most doubles the work or stays below
#: _SMALL_DECODE blocks (per-call overhead dominates such small passes).
_FEW_GROUPS, _SMALL_DECODE = 64, 1 << 14
_MAGIC = b"PKREC1"


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
