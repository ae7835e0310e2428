"""REC's message layout: the update's leaves and shapes, its grouping, the seed and relation.

The update is flattened leaf by leaf (dict order, row-major) and split into groups by the
message's ``grouping`` (see :mod:`privkit.mechanisms.rec`); the layout id, a digest of the
shapes and grouping, lets the decoder refuse a message encoded for another layout.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from privkit.errors import InvalidParameterError
from privkit.events.mechanisms import as_relation

__all__ = ["SEED_BYTES"]

SEED_BYTES = 16
_GROUPINGS = ("whole", "per-tensor", "per-parameter")


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
    return as_relation(value)
