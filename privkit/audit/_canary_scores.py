"""Scoring canaries: white-box from every release, from the final model, or in two runs.

:class:`WhiteBoxScorer` (each release's projection on each canary, summed or as a
log-likelihood ratio), :func:`cosine_scores` (the final model change, Andrew et al.) and
:func:`two_run_scores` (Nasr et al.'s trials with and without the canary). Apart from making
and inserting the canaries (``privkit.audit._canary_set``) because it runs after a release,
on what was published; the public names are exported from :mod:`privkit.audit.canaries`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from privkit import _validate
from privkit.audit._canary_set import Canaries, flatten
from privkit.errors import InvalidParameterError

__all__ = ["WhiteBoxScorer", "cosine_scores", "two_run_scores", "STATISTICS"]

STATISTICS = ("sum", "llr")
"""How :class:`WhiteBoxScorer` combines a canary's per-release projections."""


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
        >>> from privkit.audit import make_canaries
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
