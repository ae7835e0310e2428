"""Canaries for any training loop: make them, insert them into a release, score them.

A canary is one more contribution of a known direction: a canary **client** whose update
is ``norm * direction`` (DP-FedAvg, :class:`~privkit.ClientLevelGaussian`, the Flower
wrappers) or a canary **example** whose per-example gradient is that vector (DP-SGD,
``privkit.torch.DpSgd.step(..., extra_gradients=)``). It is clipped like any other
contribution (a ``norm`` above the clip norm checks that clipping happens), and it never
touches a real client's data. Each canary is held in or out by a fair coin
(:attr:`Canaries.included`), secret until the scores are computed.

Threat models and scores:

* **White-box, every release** (the FL threat model: every noisy aggregate is published).
  :class:`WhiteBoxScorer` scores each release: the projection of ``release - known`` on each
  canary's direction, in units of the noise's standard deviation (``known``: what the
  auditor knows of the non-canary part, e.g. the real clients' clipped sum when the server
  audits itself; leaving it out is valid too, only noisier). It sums each canary's
  projections over the releases it was **eligible** for (a public schedule; default every
  release), divided by the square root of their number (``statistic="sum"``), or adds the
  per-release log-likelihood ratio of a Poisson-sampled canary (``statistic="llr"``, the
  Neyman-Pearson test when each canary takes part in a release with probability q). The
  canary's own Poisson draws are part of the mechanism's secret randomness: a score never
  uses them (using them would audit the unamplified guarantee).
* **Final model only** (Andrew et al., ICLR 2024): :func:`cosine_scores`, the cosine of the
  final model change with each canary's direction; their epsilon is an **estimate**
  (:func:`privkit.audit.runs.final_model_estimate`).

Modes: **one run** (many canaries in one run, fair coins: :func:`make_canaries`, then
:func:`~privkit.audit.one_run_bound` / :func:`~privkit.audit.gaussian_bound`) and **two runs**
(Nasr et al. 2023: the same run with and without one canary, many trials:
:func:`two_run_scores`, then :func:`~privkit.audit.gdp_bound`).

Examples:
    >>> import numpy as np
    >>> from privkit import ClientLevelGaussian
    >>> agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=0.5)
    >>> can = make_canaries(200, 1000, norm=1.0, seed=0)
    >>> scorer = WhiteBoxScorer(can, stddev=agg.stddev, l2_clip_norm=1.0)
    >>> rng = np.random.default_rng(1)
    >>> for _ in range(4):   # four rounds of 10 real clients, canary clients added
    ...     real = {"w": rng.normal(size=(10, 1000))}
    ...     known = clipped_sum(real, 1.0)              # the server's own clipped sum
    ...     noisy = agg(with_canaries(real, can), rng=rng)
    ...     scorer.add(noisy, known=known)
    >>> ins, outs = scorer.in_out()
    >>> round(float(ins.mean()), 1), round(float(outs.mean()), 1)   # sqrt(4) / 0.5 = 4
    (3.9, -0.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.mechanisms.sampling import _float_leaves, _unflatten

__all__ = ["Canaries", "make_canaries", "flatten", "canary_rows", "with_canaries",
           "clipped_sum", "WhiteBoxScorer", "CanaryClients", "cosine_scores",
           "two_run_scores", "KINDS", "STATISTICS", "CANARY_NOTE"]

#: What a report says when canaries took part (every wrapper's report with canaries).
CANARY_NOTE = ("canary clients took part: extra contributions of norm <= C, clipped and noised "
               "like every client, never touching a real client's data; they are not among "
               "num_clients and the divisor is unchanged. The accounted epsilon covers each "
               "canary as one more client; the run's model carries their (tiny) updates")

KINDS = ("dirac", "random")
"""``dirac``: each canary is one coordinate (distinct coordinates; Nasr et al.'s Dirac
canary); ``random``: a Gaussian direction normalised to unit length (nearly orthogonal to
the others in high dimension; a dense ``m x dim`` matrix)."""

STATISTICS = ("sum", "llr")
"""How :class:`WhiteBoxScorer` combines a canary's per-release projections."""


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


class WhiteBoxScorer:
    """Scores canaries from every released noisy sum (module docstring).

    Args:
        canaries: the :class:`Canaries` of the run.
        stddev: the noise's standard deviation on each coordinate of a release (``z C``).
        l2_clip_norm: C; an in-canary's shift in a release it takes part in is
            ``min(norm, C) / stddev`` noise units.
        sampling_probability: q, each canary's probability of taking part in a release
            (1: every eligible release).
        statistic: ``"sum"`` (default at q = 1) or ``"llr"`` (default for q < 1).

    Attributes:
        releases: how many releases were added.
    """

    def __init__(self, canaries: Canaries, *, stddev: float, l2_clip_norm: float,
                 sampling_probability: float = 1.0, statistic: str | None = None) -> None:
        if not isinstance(canaries, Canaries):
            raise InvalidParameterError("canaries", type(canaries).__name__,
                                        "privkit Canaries")
        self.canaries = canaries
        self.stddev = _validate.positive("stddev", stddev)
        self.l2_clip_norm = _validate.positive("l2_clip_norm", l2_clip_norm)
        self.sampling_probability = _validate.probability("sampling_probability",
                                                          sampling_probability)
        st = ("sum" if self.sampling_probability == 1.0 else "llr") if statistic is None \
            else statistic
        if st not in STATISTICS:
            raise InvalidParameterError("statistic", statistic, " or ".join(STATISTICS))
        self.statistic = st
        self.shift = min(canaries.norm, self.l2_clip_norm) / self.stddev
        self._total = np.zeros(canaries.m)
        self._count = np.zeros(canaries.m, dtype=np.int64)
        self.releases = 0

    def signals(self, release: Any, known: Any = None) -> np.ndarray:
        """``(m,)``: one release's projections on the canaries, in noise units."""
        v = release if isinstance(release, np.ndarray) and release.ndim == 1 else flatten(
            release, "release")
        if known is not None:
            k = known if isinstance(known, np.ndarray) and known.ndim == 1 else flatten(
                known, "known")
            if k.shape != v.shape:
                raise InvalidParameterError("known", k.shape, f"the release's shape {v.shape}")
            v = v - k
        return self.canaries.project(v) / self.stddev

    def add(self, release: Any, *, known: Any = None, eligible: Any = None) -> None:
        """Score one release (a tree or a flat vector: the noisy **sum**, before any division).

        Args:
            release: the released noisy sum.
            known: what the auditor knows of its non-canary part (same layout), or None.
            eligible: ``(m,)`` bool, the canaries this release could contain (a public
                schedule); default all.
        """
        x = self.signals(release, known)
        mask = np.ones(self.canaries.m, bool) if eligible is None else np.asarray(eligible)
        if mask.shape != (self.canaries.m,) or mask.dtype != bool:
            raise InvalidParameterError("eligible", getattr(mask, "shape", mask),
                                        f"a ({self.canaries.m},) bool mask")
        if self.statistic == "sum":
            part = x
        else:
            q, a = self.sampling_probability, self.shift
            # log(1 - q + q exp(a x - a^2/2)): the Poisson canary's log-likelihood ratio
            part = np.logaddexp(math.log1p(-q) if q < 1 else -np.inf,
                                math.log(q) + a * x - a * a / 2)
        self._total += np.where(mask, part, 0.0)
        self._count += mask
        self.releases += 1

    @property
    def scores(self) -> np.ndarray:
        """``(m,)``: the normalised sums (``"sum"``: unit variance for an out-canary) or the
        summed log-likelihood ratios (``"llr"``); 0 for a canary never eligible."""
        if self.statistic == "llr":
            return self._total.copy()
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self._count > 0, self._total / np.sqrt(self._count), 0.0)

    def in_out(self) -> tuple[np.ndarray, np.ndarray]:
        """``(in_scores, out_scores)`` by the canaries' coins."""
        return self.canaries.split(self.scores)


def cosine_scores(model_change: Any, canaries: Canaries) -> np.ndarray:
    """``(m,)``: the cosine of the final model change (a tree or flat vector: final minus
    initial parameters) with each canary's direction (Andrew et al., ICLR 2024).

    Examples:
        >>> c = make_canaries(2, 3, norm=1.0, seed=0, kind="random")
        >>> cosine_scores(c.vectors(np.array([True, False]))[0], c).round(3)[0]
        np.float64(1.0)
    """
    v = model_change if isinstance(model_change, np.ndarray) and model_change.ndim == 1 \
        else flatten(model_change, "model_change")
    n = float(np.linalg.norm(v))
    if not n > 0:
        raise InvalidParameterError("model_change", "a zero vector", "a non-zero change")
    return canaries.project(v) / n


def two_run_scores(run: Callable[[bool, np.random.Generator], float], trials: int, *,
                   seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two-run mode (Nasr et al. 2023): ``trials`` runs with the canary and ``trials``
    without, each on its own generator, every run's score from ``run(include, rng)``.

    Returns:
        ``(in_scores, out_scores)``, ``trials`` each: independent trials, the input of
        :func:`~privkit.audit.gdp_bound` and :func:`~privkit.audit.clopper_pearson_bound`.

    Examples:
        >>> def run(include, rng):   # one Gaussian release of a canary of sensitivity 1
        ...     return float(include) + rng.normal()
        >>> ins, outs = two_run_scores(run, 1000, seed=0)
        >>> round(float(ins.mean() - outs.mean()), 1)
        0.9
    """
    n = _validate.positive_int("trials", trials)
    s = _validate.nonnegative_int("seed", seed)
    if not callable(run):
        raise InvalidParameterError("run", run, "a callable run(include, rng) -> score")
    seqs = np.random.SeedSequence(s).spawn(2 * n)
    ins = np.array([float(run(True, np.random.default_rng(seqs[2 * i]))) for i in range(n)])
    outs = np.array([float(run(False, np.random.default_rng(seqs[2 * i + 1])))
                     for i in range(n)])
    return ins, outs


class CanaryClients:
    """Canary clients inside a server-side wrapper (:class:`privkit.flower.ClientLevelDP`,
    :class:`privkit.flower.BandedClientLevelDP`): extra rows of the clipped-update stack
    before the noise, scored white-box from every released noisy sum.

    The wrapper calls :meth:`insert` with the real replies' updates and :meth:`observe`
    with the noisy sum of each release; the canaries never reach a client. In a release the
    canaries may take part in (``releases``, a public schedule; default every release), each
    included canary takes part with the wrapper's sampling probability (Poisson, drawn from
    ``seed``'s own stream: part of the mechanism's secret randomness, never used in a
    score). The known part of a score is the real replies' clipped sum (the trusted server
    audits itself). ``num_clients`` and the divisor stay what they were: the canaries are
    extra contributions, and the wrapper's report says they were there
    (:data:`CANARY_NOTE`).

    Args:
        canaries: the :class:`Canaries` (``dim``: the model's flattened size).
        seed: the canaries' Poisson draws.
        releases: the 0-based releases the canaries may take part in (with
            ``BandedClientLevelDP`` they must satisfy its participation schema), or None.
        statistic: as for :class:`WhiteBoxScorer` (default ``sum`` at q = 1, ``llr`` below).

    Examples:
        >>> import numpy as np
        >>> from privkit import ClientLevelGaussian
        >>> agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1.0)
        >>> cc = CanaryClients(make_canaries(50, 20 * 8, norm=5.0, seed=0), seed=1)
        >>> rng = np.random.default_rng(2)
        >>> real = {"w": rng.normal(size=(3, 20, 8))}
        >>> stack = cc.insert(real, release=0, mechanism=agg)
        >>> cc.observe(agg(stack, rng=rng), release=0, mechanism=agg)
        >>> run = cc.canary_run(accounted_epsilon=4.38, delta=1e-5)
        >>> run.mode, len(run.in_scores) + len(run.out_scores)
        ('one-run', 50)
    """

    def __init__(self, canaries: Canaries, *, seed: int, releases: Any = None,
                 statistic: str | None = None) -> None:
        if not isinstance(canaries, Canaries):
            raise InvalidParameterError("canaries", type(canaries).__name__,
                                        "privkit Canaries")
        self.canaries = canaries
        self.seed = _validate.nonnegative_int("seed", seed)
        self._rng = np.random.default_rng(np.random.SeedSequence(self.seed))
        if releases is None:
            self.releases: tuple[int, ...] | None = None
        else:
            rel = sorted({_validate.nonnegative_int("releases", r) for r in releases})
            if not rel:
                raise InvalidParameterError("releases", releases, "at least one release")
            self.releases = tuple(rel)
        if statistic is not None and statistic not in STATISTICS:
            raise InvalidParameterError("statistic", statistic, " or ".join(STATISTICS))
        self.statistic = statistic
        self.scorer: WhiteBoxScorer | None = None
        self._pending: tuple[int, bool, np.ndarray] | None = None
        self._settings: dict[str, Any] = {}

    def eligible(self, release: int) -> bool:
        """Whether the canaries may take part in ``release``."""
        return self.releases is None or release in self.releases

    def insert(self, updates: Any, *, release: int, mechanism: Any) -> Any:
        """The stack with this release's canary rows appended (the wrapper's mechanism, a
        :class:`privkit.ClientLevelGaussian`, gives C, z and q)."""
        from privkit.mechanisms.aggregate import ClientLevelGaussian

        if not isinstance(mechanism, ClientLevelGaussian):
            raise InvalidParameterError("mechanism", type(mechanism).__name__,
                                        "the wrapper's ClientLevelGaussian")
        ok = self.eligible(release)
        known = clipped_sum(updates, float(mechanism.l2_clip_norm))
        take = self.canaries.poisson(float(mechanism.sampling_probability), self._rng)
        if not ok:
            take[:] = False
        self._pending = (release, ok, known)
        return with_canaries(updates, self.canaries, take) if take.any() else updates

    def observe(self, noisy_sum: Any, *, release: int, mechanism: Any) -> None:
        """Score the release's noisy **sum** (before the division by the cohort)."""
        if self._pending is None or self._pending[0] != release:
            raise InvalidParameterError("release", release, "the release insert() was called "
                                        "for, once")
        _, ok, known = self._pending
        self._pending = None
        c, z = float(mechanism.l2_clip_norm), float(mechanism.noise_multiplier)
        q = float(mechanism.sampling_probability)
        if self.scorer is None:
            self.scorer = WhiteBoxScorer(self.canaries, stddev=z * c, l2_clip_norm=c,
                                         sampling_probability=q, statistic=self.statistic)
            self._settings = {"noise_multiplier": z, "l2_clip_norm": c,
                              "sampling_probability": q}
        elif (self.scorer.stddev, self.scorer.l2_clip_norm) != (z * c, c):
            raise InvalidParameterError("mechanism", f"C={c:g}, z={z:g}", "the first "
                                        "release's C and z (a changing clip norm is not "
                                        "supported with canaries)")
        self.scorer.add(noisy_sum, known=known, eligible=np.full(self.canaries.m, ok))

    def describe(self) -> dict[str, Any]:
        """The report's section on the canaries (never the coins)."""
        return {**self.canaries.describe(), "seed_of_draws": self.seed,
                "releases": "every release" if self.releases is None else list(self.releases),
                "scored_releases": 0 if self.scorer is None else self.scorer.releases,
                "note": CANARY_NOTE}

    def canary_run(self, *, accounted_epsilon: float | None, delta: float) -> Any:
        """The scores so far as a :class:`privkit.audit.CanaryRun` (one-run, white-box)."""
        from privkit.audit.runs import CanaryRun

        if self.scorer is None:
            raise InvalidParameterError("canaries", "no release scored yet",
                                        "at least one observed release")
        ins, outs = self.scorer.in_out()
        return CanaryRun(ins, outs, "one-run", delta, accounted_epsilon=accounted_epsilon,
                         threat_model="white-box", statistic=self.scorer.statistic,
                         settings={**self._settings, "releases": self.scorer.releases,
                                   "canaries": self.describe()})
