"""Noise samplers over trees of arrays (spec ``mechanisms.md`` sections 2 and 4).

A *tree* is a numpy array, a torch tensor, or a list / tuple / dict of trees (e.g. a model's
parameters). Every sampler returns a noise tree of the same structure, shapes, dtypes and
devices; d is the total number of coordinates. Randomness is the explicit ``rng`` argument
(see :func:`privkit._rng.check_rng`):

- ``numpy.random.Generator``: draws in float64 with numpy, cast to the leaf dtype at the end
  (``torch.from_numpy(z).to(dtype).to(device)`` for torch leaves);
- ``torch.Generator``: draws on the generator's device with torch (float32 for float16 and
  bfloat16 leaves, then cast), no CPU round-trip;
- :class:`SecureRandom`: float64 throughout, sums of draws, cast at the end.

torch is optional: it is never imported here, only recognised when the caller already has it.
Outputs are never attached to an autograd graph.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from privkit import _validate
from privkit._rng import RngKind, SecureRandom, check_rng
from privkit.errors import InvalidParameterError

__all__ = [
    "SecureRandom",
    "gaussian_noise",
    "l2_laplace_noise",
    "l2_laplace_variance",
    "laplace_noise",
    "num_coordinates",
    "tree_map",
]

_NUMPY_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_FLOAT_REQUIREMENT = "a float16, bfloat16, float32 or float64 array or tensor"
#: Elements per float64 chunk when a norm is taken of a narrower dtype (a small float64
#: scratch copy, reused, instead of a float64 copy of the whole tensor).
_NORM_CHUNK_CPU = 1 << 18
_NORM_CHUNK_DEVICE = 1 << 24


# ---------------------------------------------------------------------------- trees
def _torch() -> Any:
    return sys.modules.get("torch")


def _is_tensor(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _is_leaf(x: Any) -> bool:
    return isinstance(x, np.ndarray) or _is_tensor(x)


# A structure spec: None for a leaf, else (kind, type, keys, child specs).
_Spec = Any


def _flatten(tree: Any, path: str, leaves: list[tuple[str, Any]]) -> _Spec:
    if _is_leaf(tree):
        leaves.append((path, tree))
        return None
    if isinstance(tree, dict):
        keys = list(tree)
        kids = [_flatten(tree[k], f"{path}[{k!r}]", leaves) for k in keys]
        return ("dict", type(tree), tuple(keys), tuple(kids))
    if isinstance(tree, (list, tuple)):
        kids = [_flatten(v, f"{path}[{i}]", leaves) for i, v in enumerate(tree)]
        return ("seq", type(tree), len(tree), tuple(kids))
    raise InvalidParameterError(
        path, tree, "a numpy array, a torch tensor, or a list/tuple/dict of them"
    )


def _unflatten(spec: _Spec, it: Iterator[Any]) -> Any:
    if spec is None:
        return next(it)
    kind, typ, keys, kids = spec
    values = [_unflatten(k, it) for k in kids]
    if kind == "dict":
        if typ is dict:
            return dict(zip(keys, values))
        try:
            return typ(zip(keys, values))  # OrderedDict and friends
        except TypeError:  # e.g. defaultdict: keep the mapping, drop the subclass
            return dict(zip(keys, values))
    if typ is list:
        return values
    if typ is tuple:
        return tuple(values)
    if hasattr(typ, "_fields"):  # namedtuple
        return typ(*values)
    return typ(values)


def _leaves(tree: Any, name: str) -> tuple[list[tuple[str, Any]], _Spec]:
    leaves: list[tuple[str, Any]] = []
    spec = _flatten(tree, name, leaves)
    return leaves, spec


def _leaf_size(leaf: Any) -> int:
    return int(leaf.size) if isinstance(leaf, np.ndarray) else int(leaf.numel())


def _check_float(path: str, leaf: Any) -> None:
    if isinstance(leaf, np.ndarray):
        ok = leaf.dtype in _NUMPY_FLOATS
    else:
        torch = _torch()
        ok = leaf.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    if not ok:
        raise InvalidParameterError(path, leaf.dtype, _FLOAT_REQUIREMENT)


def _float_leaves(
    tree: Any, name: str, *, allow_empty: bool = False
) -> tuple[list[tuple[str, Any]], _Spec]:
    """Flatten ``tree`` and check every leaf is a floating array; optionally refuse empties."""
    leaves, spec = _leaves(tree, name)
    if not leaves and not allow_empty:
        raise InvalidParameterError(name, tree, "a tree with at least one array or tensor")
    for path, leaf in leaves:
        _check_float(path, leaf)
        if not allow_empty and _leaf_size(leaf) == 0:
            raise InvalidParameterError(path, tuple(leaf.shape), "a non-empty array or tensor")
    return leaves, spec


def tree_map(fn: Callable[..., Any], *trees: Any) -> Any:
    """Apply ``fn`` leafwise over trees of the same structure; return the first tree's structure.

    Args:
        fn: called as ``fn(leaf_0, leaf_1, ...)`` with one leaf from each tree.
        *trees: one or more trees (numpy arrays / torch tensors in lists, tuples and dicts).

    Raises:
        InvalidParameterError: if no tree is given, a node is not a leaf or a container, or
            the trees differ in structure.

    Example:
        >>> import numpy as np
        >>> tree_map(lambda a, b: a + b, {"w": np.ones(2)}, {"w": np.ones(2)})
        {'w': array([2., 2.])}
    """
    if not trees:
        raise InvalidParameterError("trees", trees, "at least one tree")
    flat = [_leaves(t, f"trees[{i}]") for i, t in enumerate(trees)]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise InvalidParameterError(f"trees[{i}]", trees[i], "the structure of trees[0]")
    results = [fn(*leaves) for leaves in zip(*([leaf for _, leaf in f[0]] for f in flat))]
    return _unflatten(spec, iter(results))


def num_coordinates(tree: Any) -> int:
    """Total number of coordinates d over all leaves of ``tree`` (0 for an empty tree).

    Example:
        >>> import numpy as np
        >>> num_coordinates({"w": np.zeros((20, 2)), "b": np.zeros(2)})
        42
    """
    leaves, _ = _leaves(tree, "tree")
    return sum(_leaf_size(leaf) for _, leaf in leaves)


# ---------------------------------------------------------------------------- leaf helpers
def _draw_dtype(leaf: Any) -> Any:
    """The dtype fast torch draws use: the leaf's, but float32 for 16-bit floats."""
    torch = _torch()
    if isinstance(leaf, np.ndarray):
        return torch.float64 if leaf.dtype == np.float64 else torch.float32
    return leaf.dtype if leaf.dtype in (torch.float32, torch.float64) else torch.float32


def _from_f64(z: np.ndarray, leaf: Any) -> Any:
    """Cast a float64 numpy draw (flat or shaped) to the leaf's shape, dtype and device."""
    if isinstance(leaf, np.ndarray):
        return np.asarray(z).reshape(leaf.shape).astype(leaf.dtype, copy=False)
    torch = _torch()
    t = torch.from_numpy(np.ascontiguousarray(z).reshape(tuple(leaf.shape)))
    return t.to(dtype=leaf.dtype).to(device=leaf.device)


def _from_torch(z: Any, leaf: Any) -> Any:
    """Cast a torch draw to the leaf's dtype and device (numpy leaves go to the CPU)."""
    if isinstance(leaf, np.ndarray):
        return z.cpu().numpy().astype(leaf.dtype, copy=False)
    return z.to(dtype=leaf.dtype).to(device=leaf.device)


def _np_row_sumsq(a: np.ndarray, bfloat16: bool = False) -> np.ndarray:
    """Float64 sum of squares of each row of a (b, L) numpy array, chunked.

    ``bfloat16``: ``a`` holds the raw int16 bits of bfloat16 values (numpy has no bfloat16).
    einsum is used rather than BLAS: single-threaded and predictable on a busy machine.
    """
    b, length = a.shape
    if length == 0:
        return np.zeros(b)
    if a.dtype == np.float64:
        return np.einsum("ij,ij->i", a, a)

    def wide(c: np.ndarray) -> np.ndarray:
        if bfloat16:  # bfloat16 bits are the top half of a float32
            return (c.astype(np.int32) << 16).view(np.float32).astype(np.float64)
        return c.astype(np.float64)

    chunk = _NORM_CHUNK_CPU
    acc = np.zeros(b)
    if length >= chunk:
        for j in range(0, length, chunk):
            c = wide(a[:, j : j + chunk])
            acc += np.einsum("ij,ij->i", c, c)
    else:
        step = max(1, chunk // length)
        for i in range(0, b, step):
            c = wide(a[i : i + step])
            acc[i : i + step] = np.einsum("ij,ij->i", c, c)
    return acc


def _row_norms_f64(x2: Any) -> Any:
    """Float64 L2 norm of each row of a (b, L) array or tensor, without a float64 copy of it.

    Returns a numpy array for numpy input and CPU tensors (read through a zero-copy numpy
    view: one thread, no OpenMP regions, no float64 copy of the whole tensor), and a float64
    tensor on the device otherwise (no host synchronisation). For float32 and narrower dtypes
    the squares are exact in float64 and the sum cannot overflow, so a row's norm is finite
    exactly when its coordinates are. Float64 rows may overflow or underflow; callers that
    need a safe value check for that (see ``privkit.mechanisms.clipping``).
    """
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        if isinstance(x2, np.ndarray):
            return np.sqrt(_np_row_sumsq(x2))
        torch = _torch()
        x2 = x2.detach()
        if x2.device.type == "cpu":
            if x2.dtype == torch.bfloat16:
                return np.sqrt(_np_row_sumsq(x2.view(torch.int16).numpy(), bfloat16=True))
            return np.sqrt(_np_row_sumsq(x2.numpy()))
    b, length = x2.shape
    if length == 0:
        return torch.zeros(b, dtype=torch.float64, device=x2.device)
    if x2.dtype == torch.float64 or b * length <= _NORM_CHUNK_DEVICE:
        return torch.linalg.vector_norm(x2, dim=1, dtype=torch.float64)
    if length >= _NORM_CHUNK_DEVICE:
        parts = [
            torch.linalg.vector_norm(x2[:, j : j + _NORM_CHUNK_DEVICE], dim=1, dtype=torch.float64)
            for j in range(0, length, _NORM_CHUNK_DEVICE)
        ]
        return torch.linalg.vector_norm(torch.stack(parts, dim=1), dim=1)
    step = max(1, _NORM_CHUNK_DEVICE // length)
    return torch.cat(
        [torch.linalg.vector_norm(g, dim=1, dtype=torch.float64) for g in x2.split(step)]
    )


def _norm_f64(leaf: Any) -> Any:
    """Float64 L2 norm of one leaf: a numpy float64, or a 0-d float64 tensor on its device."""
    rows = leaf.reshape(1, -1) if _leaf_size(leaf) else leaf.reshape(1, 0)
    return _row_norms_f64(rows)[0]


def _as_floats(values: list[Any]) -> list[float]:
    """Bring float64 scalars (numpy or 0-d tensors, any device) to the host, one sync/device."""
    out: list[float | None] = [None] * len(values)
    by_device: dict[Any, list[int]] = {}
    for i, v in enumerate(values):
        if _is_tensor(v):
            by_device.setdefault(v.device, []).append(i)
        else:
            out[i] = float(v)
    torch = _torch()
    for idx in by_device.values():
        host = torch.stack([values[i] for i in idx]).cpu().tolist()
        for i, h in zip(idx, host):
            out[i] = float(h)
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------- samplers
def gaussian_noise(tree: Any, stddev: float, *, rng: Any) -> Any:
    """Gaussian noise N(0, stddev**2) per coordinate, shaped like ``tree``.

    Fast modes draw once per coordinate (numpy ``standard_normal`` in float64, or
    ``torch.normal`` on the generator's device in the leaf dtype, float32 for 16-bit leaves).
    Secure mode draws ``stddev * (Z1 + Z2 + Z3 + Z4) / 2`` in float64 from the OS CSPRNG.

    Args:
        tree: the tree whose structure, shapes, dtypes and devices the noise takes.
        stddev: absolute standard deviation, finite and > 0.
        rng: a ``numpy.random.Generator``, ``torch.Generator`` or :class:`SecureRandom`.

    Returns:
        A new tree of noise (the input is not modified; add it yourself).

    Raises:
        InvalidParameterError: for a bad ``stddev`` or ``rng``, an empty tree or leaf, or a
            non-floating leaf.

    Example:
        >>> import numpy as np
        >>> noise = gaussian_noise({"w": np.zeros(3, np.float32)}, 1.0,
        ...                        rng=np.random.default_rng(0))
        >>> noise["w"].dtype, noise["w"].shape
        (dtype('float32'), (3,))
    """
    stddev = _validate.positive("stddev", stddev)
    kind = check_rng(rng)
    leaves, spec = _float_leaves(tree, "tree")
    out = []
    for _, leaf in leaves:
        n = _leaf_size(leaf)
        if kind is RngKind.NUMPY:
            z = rng.standard_normal(n)
            z *= stddev
            out.append(_from_f64(z, leaf))
        elif kind is RngKind.SECURE:
            out.append(_from_f64(rng.gaussian(stddev, n), leaf))
        else:
            out.append(torch_gaussian_like(leaf, stddev, rng))
    return _unflatten(spec, iter(out))


def torch_gaussian_like(leaf: Any, stddev: float, rng: Any) -> Any:
    """:func:`gaussian_noise`'s draw for one leaf from a ``torch.Generator`` (the same values),
    without its checks: for a caller that validated ``stddev`` (finite, > 0), ``rng`` (a
    ``torch.Generator``) and ``leaf`` (a floating tensor) once and draws per leaf in a loop."""
    torch = _torch()
    z = torch.normal(0.0, stddev, size=tuple(leaf.shape), generator=rng, device=rng.device,
                     dtype=_draw_dtype(leaf))
    return _from_torch(z, leaf)


def _torch_laplace(shape: tuple[int, ...], scale: float, g: Any) -> Any:
    """Laplace(scale) from one float64 uniform per coordinate on the generator's device.

    With u in [0, 1) on the 2**-53 grid, t = 2u is exact; the top bit gives the sign and
    w = 1 - frac(t) in (0, 1] (exact, never 0) gives the magnitude -log(w) ~ Exp(1).
    """
    torch = _torch()
    t = torch.rand(shape, generator=g, device=g.device, dtype=torch.float64)
    t *= 2.0
    positive = t >= 1.0
    w = torch.where(positive, 2.0 - t, 1.0 - t)
    w.log_()
    w *= -scale
    return torch.where(positive, w, -w)


def laplace_noise(tree: Any, scale: float, *, rng: Any) -> Any:
    """I.i.d. Laplace(scale) noise per coordinate (the L1 mechanism), shaped like ``tree``.

    ``scale`` is the Laplace parameter b = Delta_1 / epsilon with Delta_1 the **L1**
    sensitivity; this is not the L2-norm Laplace (:func:`l2_laplace_noise`). Fast numpy
    mode uses ``Generator.laplace`` (float64); fast torch mode an exact inverse CDF from
    float64 uniforms on the generator's device; secure mode
    ``scale * (ln U1 cos(pi U2) + ln U3 cos(pi U4))`` from the OS CSPRNG.

    Example:
        >>> import numpy as np
        >>> laplace_noise([np.zeros(2)], 0.5, rng=np.random.default_rng(0))[0].shape
        (2,)
    """
    scale = _validate.positive("scale", scale)
    kind = check_rng(rng)
    leaves, spec = _float_leaves(tree, "tree")
    out = []
    for _, leaf in leaves:
        n = _leaf_size(leaf)
        if kind is RngKind.NUMPY:
            out.append(_from_f64(rng.laplace(0.0, scale, n), leaf))
        elif kind is RngKind.SECURE:
            out.append(_from_f64(rng.laplace(scale, n), leaf))
        else:
            out.append(_from_torch(_torch_laplace(tuple(leaf.shape), scale, rng), leaf))
    return _unflatten(spec, iter(out))


def l2_laplace_variance(d: int, alpha: float) -> float:
    """E||x||_2**2 = d (d + 1) / alpha**2 for the L2-norm Laplace of :func:`l2_laplace_noise`.

    Example:
        >>> l2_laplace_variance(1, 2.0)   # d = 1: Laplace(1/2), variance 2 b**2
        0.5
    """
    d = _validate.positive_int("d", d)
    alpha = _validate.positive("alpha", alpha)
    return d * (d + 1.0) / (alpha * alpha)


def _torch_seeded_numpy(g: Any) -> np.random.Generator:
    """A numpy Generator derived from the torch stream, for float64 gamma radii."""
    torch = _torch()
    seed = torch.randint(0, 2**62, (1,), generator=g, device=g.device)
    return np.random.default_rng(int(seed.item()))


def l2_laplace_noise(tree: Any, alpha: float, *, rng: Any) -> Any:
    """Noise with density proportional to exp(-alpha ||x||_2) over all d coordinates.

    x = r u with u uniform on the sphere S^{d-1} (a Gaussian over every coordinate of the
    tree, normalised; redrawn if its norm is 0) and r ~ Gamma(shape d, scale 1/alpha) drawn
    in float64 with numpy. For a torch.Generator the numpy generator is derived from the
    torch stream and the direction is drawn on the generator's device (float32, float64 for
    float64 leaves). Secure mode: r is a sum of 4 Gamma(d/4, 1/alpha) and the direction a
    normalised sum of 4 N(0, I). Pure epsilon-DP with epsilon = alpha * (L2 sensitivity); at
    d = 1 it is Laplace(1/alpha). E||x||**2 = d(d+1)/alpha**2 (:func:`l2_laplace_variance`).

    Args:
        tree: the tree whose structure, shapes, dtypes and devices the noise takes.
        alpha: the rate alpha = epsilon / Delta_2, finite and > 0.
        rng: a ``numpy.random.Generator``, ``torch.Generator`` or :class:`SecureRandom`.

    Example:
        >>> import numpy as np
        >>> x = l2_laplace_noise({"w": np.zeros((20, 2)), "b": np.zeros(2)}, 2.0,
        ...                      rng=np.random.default_rng(0))
        >>> sorted(x), x["w"].shape
        (['b', 'w'], (20, 2))
    """
    alpha = _validate.positive("alpha", alpha)
    kind = check_rng(rng)
    leaves, spec = _float_leaves(tree, "tree")
    d = sum(_leaf_size(leaf) for _, leaf in leaves)
    if kind is RngKind.NUMPY:
        radius = float(rng.gamma(shape=d, scale=1.0 / alpha))
    elif kind is RngKind.SECURE:
        radius = math.fsum(rng.gamma(d / 4.0, 1.0 / alpha, 4))
    else:
        radius = float(_torch_seeded_numpy(rng).gamma(shape=d, scale=1.0 / alpha))

    while True:
        if kind is RngKind.NUMPY:
            dirs = [rng.standard_normal(_leaf_size(leaf)) for _, leaf in leaves]
        elif kind is RngKind.SECURE:
            dirs = [rng.gaussian(1.0, _leaf_size(leaf)) for _, leaf in leaves]
        else:
            torch = _torch()
            dirs = [
                torch.randn(
                    tuple(leaf.shape), generator=rng, device=rng.device, dtype=_draw_dtype(leaf)
                )
                for _, leaf in leaves
            ]
        norms = _as_floats([_norm_f64(g) for g in dirs])
        norm = math.sqrt(math.fsum(v * v for v in norms))
        if norm > 0.0:
            break
    factor = radius / norm
    out = []
    for g, (_, leaf) in zip(dirs, leaves):
        g *= factor
        out.append(_from_torch(g, leaf) if kind is RngKind.TORCH else _from_f64(g, leaf))
    return _unflatten(spec, iter(out))
