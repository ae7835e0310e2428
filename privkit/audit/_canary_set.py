"""Canaries: make them, and put them into a release as extra contributions.

:class:`Canaries` (unit directions, their norm, each one's fair coin), :func:`make_canaries`,
and the rows they add to a stacked update (:func:`canary_rows`, :func:`with_canaries`), with
the flat layout (:func:`flatten`) and the clipped sum an auditor knows (:func:`clipped_sum`).
Apart from the scorers and the wrappers' glue in :mod:`privkit.audit.canaries` (which exports
the public names) because this is what a training loop calls before a release, and the
scorers what it calls after.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.mechanisms.sampling import _float_leaves, _unflatten

__all__ = ["Canaries", "make_canaries", "flatten", "canary_rows", "with_canaries",
           "clipped_sum", "KINDS"]

KINDS = ("dirac", "random")
"""``dirac``: each canary is one coordinate (distinct coordinates; Nasr et al.'s Dirac
canary); ``random``: a Gaussian direction normalised to unit length (nearly orthogonal to
the others in high dimension; a dense ``m x dim`` matrix)."""


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")


def flatten(tree: Any, name: str = "tree") -> np.ndarray:
    """A tree of arrays or tensors (a dict of parameters, say) as one float64 vector: leaves
    in the tree's order (dicts in insertion order), each flattened row-major, the layout
    :func:`canary_rows` and every privkit mechanism use.

    Examples:
        >>> flatten({"w": np.ones((2, 2)), "b": np.zeros(1)}).tolist()
        [1.0, 1.0, 1.0, 1.0, 0.0]
    """
    leaves, _ = _float_leaves(tree, name, allow_empty=False)
    torch = _torch()
    parts = []
    for _, leaf in leaves:
        if torch is not None and isinstance(leaf, torch.Tensor):
            parts.append(leaf.detach().to("cpu", torch.float64).reshape(-1).numpy())
        else:
            parts.append(np.asarray(leaf, dtype=np.float64).reshape(-1))
    return np.concatenate(parts)


@dataclasses.dataclass(frozen=True, eq=False)
class Canaries:
    """m canaries of one kind: unit directions, their norm, and each one's fair coin.

    Build with :func:`make_canaries`. Attributes:
        dim: the length of a flattened update (every canary lives there).
        norm: the L2 norm of a canary's vector before clipping (above the clip norm: the
            mechanism must clip it; the in-canaries' expected shift is ``min(norm, C)``).
        included: ``(m,)`` bool, the coins (True: held in).
        kind: one of :data:`KINDS`.
        seed: the seed the directions and coins came from.
        coordinates: ``(m,)`` the coordinate of each Dirac canary (None for random).
        matrix: ``(m, dim)`` unit rows of random canaries (None for Dirac).
    """

    dim: int
    norm: float
    included: np.ndarray
    kind: str
    seed: int
    coordinates: np.ndarray | None = None
    matrix: np.ndarray | None = None

    @property
    def m(self) -> int:
        """The number of canaries."""
        return int(self.included.size)

    def with_included(self, included: Any) -> Canaries:
        """The same canaries with other coins (e.g. all True for a two-run trial's in-run
        or for Andrew et al.'s final-model canaries)."""
        inc = np.broadcast_to(np.asarray(included, dtype=bool), (self.m,)).copy()
        return dataclasses.replace(self, included=inc)

    def vectors(self, take: Any = None) -> np.ndarray:
        """``(k, dim)`` float64: ``norm * direction`` of the canaries in ``take`` (a bool mask
        or indices; default the included ones)."""
        idx = self._indices(take)
        if self.coordinates is not None:
            out = np.zeros((idx.size, self.dim))
            out[np.arange(idx.size), self.coordinates[idx]] = self.norm
            return out
        assert self.matrix is not None
        return self.norm * self.matrix[idx]

    def project(self, vector: Any) -> np.ndarray:
        """``(m,)``: the inner product of a flat vector (or a tree, flattened) with each
        canary's unit direction."""
        v = vector if isinstance(vector, np.ndarray) and vector.ndim == 1 else flatten(
            vector, "vector")
        if v.shape != (self.dim,):
            raise InvalidParameterError("vector", v.shape, f"{self.dim} values (the canaries' "
                                        "dim), flattened as privkit.audit.flatten does")
        if self.coordinates is not None:
            return np.asarray(v[self.coordinates], dtype=np.float64)
        assert self.matrix is not None
        return np.asarray(self.matrix @ v, dtype=np.float64)

    def poisson(self, sampling_probability: float, rng: np.random.Generator) -> np.ndarray:
        """``(m,)`` bool: which canaries take part in one Poisson-sampled release (each
        included canary independently with probability q, drawn from ``rng`` for every
        canary so the draws do not reveal the coins)."""
        q = _validate.probability("sampling_probability", sampling_probability)
        u = rng.random(self.m)
        return self.included & (u < q)

    def split(self, scores: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(in_scores, out_scores)`` of an ``(m,)`` score vector by the coins."""
        s = np.asarray(scores, dtype=np.float64)
        if s.shape != (self.m,):
            raise InvalidParameterError("scores", s.shape, f"({self.m},), one per canary")
        return s[self.included], s[~self.included]

    def describe(self) -> dict[str, Any]:
        """What a report says about the canaries (not the coins)."""
        return {"m": self.m, "kind": self.kind, "dim": self.dim, "norm": self.norm,
                "seed": self.seed}

    def _indices(self, take: Any) -> np.ndarray:
        if take is None:
            return np.flatnonzero(self.included)
        t = np.asarray(take)
        if t.dtype == bool:
            if t.shape != (self.m,):
                raise InvalidParameterError("take", t.shape, f"a ({self.m},) bool mask")
            return np.flatnonzero(t)
        if t.ndim != 1 or (t.size and (t.min() < 0 or t.max() >= self.m)):
            raise InvalidParameterError("take", take, f"indices in [0, {self.m})")
        return t.astype(np.int64)


def make_canaries(m: int, dim: int, *, norm: float, seed: int, kind: str = "dirac"
                  ) -> Canaries:
    """m canaries in a ``dim``-dimensional update, each held in by a fair coin.

    Args:
        m: how many (>= 1; for ``dirac`` at most ``dim``).
        dim: the length of a flattened update (:func:`flatten`).
        norm: each canary's L2 norm, finite and > 0 (the clip norm C, or more to check
            that the mechanism clips).
        seed: the directions and the coins (keep it secret until the scores are computed).
        kind: ``"dirac"`` (default) or ``"random"`` (:data:`KINDS`).

    Examples:
        >>> c = make_canaries(3, 10, norm=2.0, seed=0)
        >>> c.m, c.kind, c.vectors(np.ones(3, bool)).sum(1).tolist()
        (3, 'dirac', [2.0, 2.0, 2.0])
    """
    n = _validate.positive_int("m", m)
    d = _validate.positive_int("dim", dim)
    nrm = _validate.positive("norm", norm)
    s = _validate.nonnegative_int("seed", seed)
    if kind not in KINDS:
        raise InvalidParameterError("kind", kind, " or ".join(KINDS))
    g_dir, g_coin = (np.random.default_rng(c) for c in np.random.SeedSequence(s).spawn(2))
    included = g_coin.random(n) < 0.5
    if kind == "dirac":
        if n > d:
            raise InvalidParameterError("m", n, f"at most dim = {d} Dirac canaries (one "
                                        "coordinate each)")
        return Canaries(d, nrm, included, kind, s,
                        coordinates=np.sort(g_dir.choice(d, n, replace=False)))
    mat = g_dir.standard_normal((n, d))
    mat /= np.linalg.norm(mat, axis=1, keepdims=True)
    return Canaries(d, nrm, included, kind, s, matrix=mat)


def canary_rows(canaries: Canaries, like: Any, take: Any = None) -> Any:
    """The canaries in ``take`` (default: the included ones) as a tree shaped like ``like``
    with a new leading axis: numpy or torch leaves of ``like``'s dtypes (and device).

    ``like`` is one update's tree (a model's parameters, a dict of arrays): for
    :meth:`privkit.torch.DpSgd.step`'s ``extra_gradients``, ``dict(module.named_parameters())``.

    Examples:
        >>> c = make_canaries(4, 5, norm=1.0, seed=0).with_included(True)
        >>> canary_rows(c, {"w": np.zeros((2, 2)), "b": np.zeros(1)})["w"].shape
        (4, 2, 2)
    """
    if not isinstance(canaries, Canaries):
        raise InvalidParameterError("canaries", type(canaries).__name__, "privkit Canaries")
    leaves, spec = _float_leaves(like, "like", allow_empty=False)
    sizes = [int(np.prod(tuple(leaf.shape))) for _, leaf in leaves]
    if sum(sizes) != canaries.dim:
        raise InvalidParameterError("like", f"{sum(sizes)} values", f"{canaries.dim} values "
                                    "(the canaries' dim)")
    rows = canaries.vectors(take)
    k = rows.shape[0]
    torch = _torch()
    out, start = [], 0
    for (_, leaf), size in zip(leaves, sizes):
        block = rows[:, start:start + size].reshape((k, *tuple(leaf.shape)))
        start += size
        if torch is not None and isinstance(leaf, torch.Tensor):
            out.append(torch.as_tensor(block, dtype=leaf.dtype, device=leaf.device))
        else:
            out.append(block.astype(leaf.dtype, copy=False))
    return _unflatten(spec, iter(out))


def with_canaries(updates: Any, canaries: Canaries, take: Any = None) -> Any:
    """``updates`` (a stacked tree, leaves ``(K, ...)``, as :class:`privkit.ClientLevelGaussian`
    takes) with one more row per canary in ``take`` (default: the included ones): canary
    clients, appended after the real ones, clipped and summed like them.

    Examples:
        >>> c = make_canaries(3, 4, norm=1.0, seed=0).with_included([True, False, True])
        >>> with_canaries({"w": np.zeros((5, 4))}, c)["w"].shape
        (7, 4)
    """
    leaves, spec = _float_leaves(updates, "updates", allow_empty=True)
    if not leaves:
        raise InvalidParameterError("updates", updates, "a tree with at least one array")
    like = _unflatten(spec, iter(leaf[0] if leaf.shape[0] else _zeros_row(leaf)
                                 for _, leaf in leaves))
    rows, _ = _float_leaves(canary_rows(canaries, like, take), "rows", allow_empty=True)
    torch = _torch()
    joined = [torch.cat([u, r.to(u.dtype)]) if torch is not None and isinstance(u, torch.Tensor)
              else np.concatenate([u, r.astype(u.dtype, copy=False)])
              for (_, u), (_, r) in zip(leaves, rows)]
    return _unflatten(spec, iter(joined))


def clipped_sum(updates: Any, l2_clip_norm: float) -> np.ndarray:
    """The sum of the rows of ``updates`` (a stacked tree, leaves ``(K, ...)``), each row
    clipped to L2 norm ``l2_clip_norm`` over all leaves and a row with NaN or inf counted as
    zeros, flattened as :func:`flatten` does, in float64: the non-canary part an auditor
    that sees the clipped updates knows (``known=`` of :meth:`WhiteBoxScorer.add`).

    It computes what :class:`privkit.ClientLevelGaussian` sums (up to float rounding; a
    score may use any known quantity) in one vectorised pass, cheaper than its checked
    ``clip``.

    Examples:
        >>> clipped_sum({"w": np.array([[3.0, 4.0], [0.3, 0.4]])}, 1.0).round(12).tolist()
        [0.9, 1.2]
    """
    c = _validate.positive("l2_clip_norm", l2_clip_norm)
    leaves, _ = _float_leaves(updates, "updates", allow_empty=True)
    if not leaves:
        raise InvalidParameterError("updates", updates, "a tree with at least one array")
    k = int(leaves[0][1].shape[0])
    torch = _torch()
    rows = []
    for _, leaf in leaves:
        width = int(np.prod(tuple(leaf.shape[1:])))
        if torch is not None and isinstance(leaf, torch.Tensor):
            rows.append(leaf.detach().to("cpu", torch.float64).reshape(k, width).numpy())
        else:
            rows.append(np.asarray(leaf, dtype=np.float64).reshape(k, width))
    x = np.concatenate(rows, axis=1) if len(rows) > 1 else rows[0]
    if k == 0:
        return np.zeros(x.shape[1])
    with np.errstate(invalid="ignore", over="ignore"):
        sq = np.einsum("kd,kd->k", x, x)
    ok = np.isfinite(sq)
    f = np.where(ok, np.minimum(1.0, c / np.sqrt(np.maximum(np.where(ok, sq, 1.0), 1e-300))),
                 0.0)
    return np.asarray(f @ np.where(ok[:, None], x, 0.0), dtype=np.float64)


def _zeros_row(leaf: Any) -> Any:
    torch = _torch()
    if torch is not None and isinstance(leaf, torch.Tensor):
        return leaf.new_zeros(tuple(leaf.shape[1:]))
    return np.zeros(leaf.shape[1:], dtype=leaf.dtype)
