"""L2 clipping that survives floating point (spec ``mechanisms.md`` section 1).

clip_C(x) = x * min(1, C / ||x||_2), the Euclidean projection onto the ball of radius C, so
it is 1-Lipschitz. The float-safe algorithm:

1. Reject non-finite input first, naming the leaf (``min(1.0, nan)`` is 1.0, so a NaN norm
   would silently skip clipping).
2. Take the norm in float64 without overflow or underflow. For float32 and narrower dtypes
   the float64 squares are exact and their sum cannot overflow; float64 leaves whose sum of
   squares overflows or underflows fall back to s * ||x / s|| with s = max |x_i|.
3. If the norm is within the bound, return a copy unchanged; else factor = C / norm in
   float64 (rounded *down* when the multiplication runs in float32).
4. Scale, store in the leaf dtype, recompute the float64 norm of the *stored* values and,
   while it is over the bound, shrink the factor by (1 - 4 eps_dtype) (and by the observed
   overshoot) and rescale. Each further pass doubles the step (8 eps, 16 eps, ... up to
   halving): in the subnormal range the spacing is coarser than eps, and halving reaches
   the zero vector, so the loop always ends.

The bound checked in 3 and 4 is C * (1 - 2 (d + 8) 2**-53), not C: a float64 sum of d
squares has relative error below (d + 1) 2**-53 in any summation order, so the norm of the
returned values is <= C however it is computed in float64 (numpy, torch, ``math.fsum``),
not only in the order privkit uses. For float32 at d = 1e7 the margin is 2e-9 relative.

Guarantee: for float16, bfloat16, float32 and float64, numpy and torch (any device), the
float64 norm of what is returned is <= C. Inputs are never modified; outputs are new
objects, detached from any autograd graph.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError, NumericalError
from privkit.mechanisms.sampling import (
    _float_leaves,
    _is_tensor,
    _torch,
    _unflatten,
)
from privkit.mechanisms.sampling import _row_norms_f64 as _row_norms_fast

__all__ = ["clip_l2", "clip_per_example", "l2_norm", "row_l2_norms"]

#: Float64 norms below this may have lost precision to underflowing squares.
_TINY_F64 = 1e-150
#: Smallest factor applied in float32 arithmetic (float32's smallest normal is 2**-126).
_MIN_F32_FACTOR = 2.0**-125
_MAX_ITERATIONS = 4096
_NONFINITE = "finite (clipping cannot remove NaN or inf)"


# ---------------------------------------------------------------------------- leaf helpers
def _is_f64(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return x.dtype == np.float64
    return x.dtype == _torch().float64


def _eps(x: Any) -> float:
    if isinstance(x, np.ndarray):
        return float(np.finfo(x.dtype).eps)
    return float(_torch().finfo(x.dtype).eps)


def _rows(leaf: Any, b: int) -> Any:
    """The leaf as a (b, L) matrix (a view when possible), detached for torch."""
    if isinstance(leaf, np.ndarray):
        return leaf.reshape(b, -1) if leaf.size else leaf.reshape(b, 0)
    x = leaf.detach()
    return x.reshape(b, -1) if x.numel() else x.reshape(b, 0)


def _take(x2: Any, rows: np.ndarray | None) -> Any:
    if rows is None:
        return x2
    if isinstance(x2, np.ndarray):
        return x2[rows]
    return x2[_torch().from_numpy(rows).to(x2.device)]


def _to_host(values: list[Any]) -> list[np.ndarray]:
    """Float64 row-norm vectors to numpy, one host transfer per torch device."""
    out: list[Any] = list(values)
    by_device: dict[Any, list[int]] = {}
    for i, v in enumerate(values):
        if _is_tensor(v):
            by_device.setdefault(v.device, []).append(i)
    torch = _torch()
    for idx in by_device.values():
        host = torch.cat([values[i] for i in idx]).cpu().numpy()
        start = 0
        for i in idx:
            n = values[i].shape[0]
            out[i] = host[start : start + n]
            start += n
    return out


def _first_nonfinite(row: Any) -> float:
    if isinstance(row, np.ndarray):
        return float(row[~np.isfinite(row)][0])
    torch = _torch()
    return float(row[~torch.isfinite(row)][0].item())


def _norm_parts(
    x2s: list[Any],
    paths: list[str],
    row_names: bool,
    row_ids: np.ndarray | None = None,
    known: list[Any] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Overflow-safe float64 norms of the rows of several (b, L_l) matrices, jointly.

    Returns (m, r) with row norm = m * r, m = the largest per-leaf scale, so that the norm
    itself never has to be formed when it would overflow. Raises on a non-finite coordinate,
    naming the leaf (and the row, for per-example clipping). ``known``: row norms already
    computed by :func:`_scale_and_norm` (None entries are computed here).
    """
    known = known or [None] * len(x2s)
    fast = _to_host([_row_norms_fast(x2) if k is None else k for x2, k in zip(x2s, known)])
    scales, ratios = [], []
    for x2, path, v in zip(x2s, paths, fast):
        v = np.asarray(v, dtype=np.float64)
        s, r = v.copy(), np.ones_like(v)
        if _is_f64(x2):
            redo = np.flatnonzero(~((v >= _TINY_F64) & (v < math.inf)))
        else:
            redo = np.flatnonzero(~np.isfinite(v))
        if redo.size:
            sub = _take(x2, redo)
            if isinstance(sub, np.ndarray):
                amax = np.abs(sub).max(axis=1) if sub.shape[1] else np.zeros(redo.size)
            else:
                amax = (
                    sub.abs().amax(dim=1).double().cpu().numpy()
                    if sub.shape[1]
                    else (np.zeros(redo.size))
                )
            bad = np.flatnonzero(~np.isfinite(amax))
            if bad.size:
                i = int(bad[0])
                row = int(redo[i]) if row_ids is None else int(row_ids[redo[i]])
                name = f"{path}[{row}]" if row_names else path
                raise InvalidParameterError(name, _first_nonfinite(sub[i]), _NONFINITE)
            pos = amax > 0
            s[redo] = amax
            r[redo] = 0.0
            if pos.any():
                sel = np.flatnonzero(pos)
                if isinstance(sub, np.ndarray):
                    scaled = sub[sel].astype(np.float64) / amax[sel, None]
                    r[redo[sel]] = np.sqrt(np.einsum("ij,ij->i", scaled, scaled))
                else:
                    torch = _torch()
                    part = sub[torch.from_numpy(sel).to(sub.device)].double()
                    part /= torch.from_numpy(amax[sel]).to(sub.device)[:, None]
                    r[redo[sel]] = torch.linalg.vector_norm(part, dim=1).cpu().numpy()
        scales.append(s)
        ratios.append(r)
    b = x2s[0].shape[0] if x2s else 0
    if not scales:
        return np.zeros(b), np.zeros(b)
    s_all = np.stack(scales)
    r_all = np.stack(ratios)
    m = s_all.max(axis=0)
    safe = np.where(m > 0, m, 1.0)
    rel = (s_all / safe) * r_all
    return m, np.sqrt(np.einsum("ij,ij->j", rel, rel))


def _round_down_f32(f: np.ndarray) -> np.ndarray:
    f32 = f.astype(np.float32)
    up = f32.astype(np.float64) > f
    f32[up] = np.nextafter(f32[up], np.float32(0))
    return f32


def _scale(x2: Any, f: np.ndarray, div: np.ndarray | None = None, out: Any = None) -> Any:
    """Store x2 * f (one factor per row; (x2 / div) * f if ``div``) in x2's dtype.

    Float64 leaves multiply in float64; others in float32 with the factor rounded down to a
    float32 (torch computes 16-bit floats in float32 and rounds once), unless a factor is
    below float32's normal range, when the rows go through float64. ``div`` (the norm's
    scale) is used only when the factor alone would underflow float64, e.g. 1e200 clipped
    to 1e-250; those rows go through float64 in two steps.
    """
    b = x2.shape[0]
    if div is not None:
        if isinstance(x2, np.ndarray):
            res = ((x2.astype(np.float64) / div[:, None]) * f[:, None]).astype(x2.dtype)
        else:
            torch = _torch()
            dt = torch.from_numpy(div).to(x2.device)[:, None]
            ft = torch.from_numpy(f).to(x2.device)[:, None]
            res = ((x2.double() / dt) * ft).to(x2.dtype)
        if out is None:
            return res
        out[...] = res
        return out
    wide = _is_f64(x2) or bool((f < _MIN_F32_FACTOR).any())
    fac = f if wide else _round_down_f32(f)
    if isinstance(x2, np.ndarray):
        compute = np.float64 if wide else np.float32
        if x2.dtype == compute:
            return np.multiply(x2, fac.astype(compute)[:, None], out=out)
        res = np.multiply(x2, fac[:, None], dtype=compute).astype(x2.dtype)
        if out is None:
            return res
        out[...] = res
        return out
    torch = _torch()
    if wide and not _is_f64(x2):
        ft = torch.from_numpy(f).to(x2.device)[:, None]
        res = (x2.double() * ft).to(x2.dtype)
        return res if out is None else out.copy_(res)
    if b == 1:  # a Python scalar: torch applies it in the opmath type, exactly
        return torch.mul(x2, float(fac[0]), out=out)
    ft = torch.from_numpy(np.ascontiguousarray(fac)).to(x2.device)[:, None]
    if ft.dtype == x2.dtype:
        return torch.mul(x2, ft, out=out)
    res = torch.mul(x2, ft).to(x2.dtype)  # 16-bit floats: computed in float32, rounded once
    return res if out is None else out.copy_(res)


def _numpy_view(x2: Any) -> np.ndarray | None:
    """A zero-copy numpy view of a CPU array or tensor of a numpy float dtype, else None."""
    if isinstance(x2, np.ndarray):
        return x2
    torch = _torch()
    if x2.device.type == "cpu" and x2.dtype in (torch.float16, torch.float32, torch.float64):
        return x2.numpy()
    return None


#: Elements per chunk of the fused scale-and-norm pass (the stored chunk is re-read from cache).
_FUSED_CHUNK = 1 << 16


def _scale_and_norm(x2: Any, f: np.ndarray, div: np.ndarray | None, out: Any = None) -> Any:
    """:func:`_scale`, plus the float64 norm of the *stored* values when it comes cheaply.

    For one row on the CPU (whole-tree clipping) the scaling runs chunk by chunk in numpy and
    each stored chunk is measured while still in cache: one pass over memory instead of two.
    The norm is of the values as stored in the leaf dtype, so it is the spec's re-check.
    Returns (stored, row norms or None).
    """
    wide = _is_f64(x2) or bool((f < _MIN_F32_FACTOR).any())
    src = _numpy_view(x2)
    if x2.shape[0] != 1 or div is not None or src is None or (wide and not _is_f64(x2)):
        return _scale(x2, f, div, out=out), None
    if out is None:
        out = np.empty_like(x2) if isinstance(x2, np.ndarray) else _torch().empty_like(x2)
    dst = _numpy_view(out)
    assert dst is not None
    compute = np.float64 if wide else np.float32
    fac = compute(f[0] if wide else _round_down_f32(f)[0])
    src, dst = src[0], dst[0]
    acc = 0.0
    for i in range(0, src.size, _FUSED_CHUNK):
        chunk = dst[i : i + _FUSED_CHUNK]
        if src.dtype == compute:
            np.multiply(src[i : i + _FUSED_CHUNK], fac, out=chunk)
        else:
            chunk[...] = np.multiply(src[i : i + _FUSED_CHUNK], fac, dtype=compute)
        wide_chunk = chunk if chunk.dtype == np.float64 else chunk.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            acc += float(np.einsum("i,i->", wide_chunk, wide_chunk))
    return out, np.sqrt(np.array([acc]))


def _copy(x2: Any) -> Any:
    return x2.copy() if isinstance(x2, np.ndarray) else x2.clone()


def _assign_rows(y2: Any, rows: np.ndarray, values: Any) -> None:
    if isinstance(y2, np.ndarray):
        y2[rows] = values
    else:
        y2[_torch().from_numpy(rows).to(y2.device)] = values


def _clip_rows(x2s: list[Any], paths: list[str], bound: float, row_names: bool) -> list[Any]:
    """Clip every row of the (b, L_l) matrices jointly across leaves to float64 norm <= bound."""
    b = x2s[0].shape[0]
    d = sum(x2.shape[1] for x2 in x2s)
    target = bound * (1.0 - 2.0 * (d + 8) * 2.0**-53)
    m, r = _norm_parts(x2s, paths, row_names)
    with np.errstate(over="ignore"):
        need = np.flatnonzero(m * r > target)
    if need.size == 0:
        return [_copy(x2) for x2 in x2s]
    f = np.ones(b)
    div = None
    with np.errstate(under="ignore"):
        f[need] = (target / m[need]) / r[need]
    if (f[need] < 2.0**-1000).any():  # the factor itself would underflow: divide by m first
        div = np.ones(b)
        div[need] = m[need]
        f[need] = target / r[need]
    eps = max(_eps(x2) for x2 in x2s)
    ys, known = map(list, zip(*(_scale_and_norm(x2, f, div) for x2 in x2s)))
    rows = need
    for it in range(_MAX_ITERATIONS):
        sel = None if rows.size == b else rows
        stored_rows = [_take(y2, sel) for y2 in ys]
        m_y, r_y = _norm_parts(stored_rows, paths, row_names, sel, known if sel is None else None)
        with np.errstate(over="ignore"):
            stored = m_y * r_y
        over = stored > target
        if not over.any():
            return ys
        rows = rows[over]
        # Spec step: shrink by (1 - 4 eps). The step doubles on every further pass, which only
        # matters where subnormal spacing is coarser than eps (and ends at plain halving).
        step = min(0.5, 4.0 * eps * 2.0**it)
        f[rows] *= (1.0 - step) * np.minimum(1.0, target / stored[over])
        for i, (x2, y2) in enumerate(zip(x2s, ys)):
            if rows.size == b:
                ys[i], known[i] = _scale_and_norm(x2, f, div, out=y2)
            else:
                sub_div = None if div is None else div[rows]
                _assign_rows(y2, rows, _scale(_take(x2, rows), f[rows], sub_div))
    raise NumericalError("clipping did not converge")  # pragma: no cover - unreachable


# ---------------------------------------------------------------------------- public API
def l2_norm(tree: Any) -> float:
    """The L2 norm of all coordinates of ``tree``, in float64, without overflow.

    Raises:
        InvalidParameterError: naming the leaf if a coordinate is NaN or infinite, or if a
            leaf is not a floating array.
        NumericalError: if the norm itself exceeds the float64 range.

    Example:
        >>> import numpy as np
        >>> l2_norm({"w": np.array([3.0, 0.0]), "b": np.array([4.0], np.float32)})
        5.0
        >>> l2_norm(np.array([1e300, 1e300]))
        1.4142135623730952e+300
    """
    leaves, _ = _float_leaves(tree, "tree", allow_empty=True)
    if not leaves:
        return 0.0
    m, r = _norm_parts([_rows(leaf, 1) for _, leaf in leaves], [p for p, _ in leaves], False)
    with np.errstate(over="ignore"):
        norm = float(m[0] * r[0])
    if not math.isfinite(norm):
        raise NumericalError(f"the L2 norm of tree exceeds the float64 range ({m[0]} * {r[0]})")
    return norm


def row_l2_norms(rows: Any) -> np.ndarray:
    """The float64 L2 norm of each row of a 2-D array or tensor (e.g. K clients' flattened
    updates), as a numpy array of shape (K,): what adaptive clipping counts.

    Read in float64 without a float64 copy of ``rows`` (CPU data through numpy, in chunks;
    other devices by torch). A row with a NaN or infinite entry gets a NaN or infinite norm;
    float64 rows of huge values may overflow to inf (use :func:`l2_norm` for an overflow-safe
    norm of one tree).

    Raises:
        InvalidParameterError: ``rows`` is not a 2-D floating array or tensor.

    Example:
        >>> import numpy as np
        >>> row_l2_norms(np.array([[3.0, 4.0], [0.0, 1.0]], np.float32))
        array([5., 1.])
    """
    leaves, _ = _float_leaves(rows, "rows", allow_empty=True)
    if len(leaves) != 1 or leaves[0][0] != "rows" or len(tuple(leaves[0][1].shape)) != 2:
        raise InvalidParameterError("rows", getattr(rows, "shape", type(rows).__name__),
                                    "one 2-D floating array or tensor (K, d)")
    out = _row_norms_fast(rows)
    if not isinstance(out, np.ndarray):  # a device tensor's norms
        out = out.cpu().numpy()
    return np.asarray(out, dtype=np.float64)


def clip_l2(tree: Any, l2_clip_norm: float) -> Any:
    """Clip the whole tree jointly to L2 norm ``l2_clip_norm`` (one factor for all leaves).

    Args:
        tree: a numpy array, torch tensor or list/tuple/dict of them (float16, bfloat16,
            float32 or float64; any device).
        l2_clip_norm: C, finite and > 0.

    Returns:
        A new tree of the same structure, shapes, dtypes and devices whose float64 norm is
        <= C; a copy of the input if its norm is already (safely) within C. The input is
        never modified.

    Raises:
        InvalidParameterError: for a bad ``l2_clip_norm``, a non-floating leaf, a NaN or
            infinite coordinate (naming the leaf, e.g. ``tree['fc.weight']``), or a tree
            without any coordinate (nothing to clip is a mistake, not a release).

    Example:
        >>> import numpy as np
        >>> y = clip_l2({"w": np.array([3.0, 4.0], np.float32)}, 1.0)
        >>> y["w"].dtype, bool(l2_norm(y) <= 1.0), [round(float(v), 6) for v in y["w"]]
        (dtype('float32'), True, [0.6, 0.8])
    """
    bound = _validate.positive("l2_clip_norm", l2_clip_norm)
    leaves, spec = _float_leaves(tree, "tree", allow_empty=True)
    if not any(0 not in tuple(leaf.shape) for _, leaf in leaves):
        raise InvalidParameterError("tree", "no coordinate" if leaves else "an empty tree",
                                    "at least one coordinate to clip")
    x2s = [_rows(leaf, 1) for _, leaf in leaves]
    ys = _clip_rows(x2s, [p for p, _ in leaves], bound, row_names=False)
    return _unflatten(spec, (y.reshape(leaf.shape) for y, (_, leaf) in zip(ys, leaves)))


def clip_per_example(batch: Any, l2_clip_norm: float) -> Any:
    """Clip each example (row along dim 0) separately to L2 norm ``l2_clip_norm``.

    ``batch`` is an array or tensor of shape (b, ...), or a tree of them sharing the leading
    dimension b (e.g. per-sample gradients per parameter), in which case row i is clipped
    jointly over all leaves. Vectorised: the norms and scaling of all rows are computed
    together; only rows whose stored norm is still over the bound are rescaled.

    Returns:
        A new batch whose every row has float64 norm <= ``l2_clip_norm``.

    Raises:
        InvalidParameterError: for a bad ``l2_clip_norm``, a leaf without the common leading
            dimension, or a NaN or infinite coordinate (naming leaf and row, e.g.
            ``batch[3]``).

    Example:
        >>> import numpy as np
        >>> y = clip_per_example(np.array([[3.0, 4.0], [0.3, 0.4]]), 1.0)
        >>> np.linalg.norm(y, axis=1).round(6).tolist()
        [1.0, 0.5]
    """
    return _clip_per_example(batch, l2_clip_norm, "batch")


def _clip_per_example(batch: Any, l2_clip_norm: float, name: str) -> Any:
    """:func:`clip_per_example`, naming the batch ``name`` in errors (a caller's argument)."""
    bound = _validate.positive("l2_clip_norm", l2_clip_norm)
    leaves, spec = _float_leaves(batch, name, allow_empty=True)
    if not leaves:
        return _unflatten(spec, iter(()))
    b = None
    for path, leaf in leaves:
        shape = tuple(leaf.shape)
        if not shape:
            raise InvalidParameterError(path, shape, "an array of shape (b, ...)")
        if b is None:
            b = shape[0]
        elif shape[0] != b:
            raise InvalidParameterError(path, shape, f"leading dimension {b} (one row per example)")
    assert b is not None
    if b == 0:
        return _unflatten(
            spec,
            (_copy(leaf if isinstance(leaf, np.ndarray) else leaf.detach()) for _, leaf in leaves),
        )
    x2s = [_rows(leaf, b) for _, leaf in leaves]
    ys = _clip_rows(x2s, [p for p, _ in leaves], bound, row_names=True)
    return _unflatten(spec, (y.reshape(leaf.shape) for y, (_, leaf) in zip(ys, leaves)))
