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

from typing import Any

import numpy as np

from privkit import _validate
from privkit.audit._canary_scores import (
    STATISTICS,
    WhiteBoxScorer,
    cosine_scores,
    two_run_scores,
)
from privkit.audit._canary_set import (
    KINDS,
    Canaries,
    canary_rows,
    clipped_sum,
    flatten,
    make_canaries,
    with_canaries,
)
from privkit.errors import InvalidParameterError

__all__ = ["Canaries", "make_canaries", "flatten", "canary_rows", "with_canaries",
           "clipped_sum", "WhiteBoxScorer", "CanaryClients", "cosine_scores",
           "two_run_scores", "KINDS", "STATISTICS", "CANARY_NOTE"]

#: What a report says when canaries took part (every wrapper's report with canaries).
CANARY_NOTE = ("canary clients took part: extra contributions of norm <= C, clipped and noised "
               "like every client, never touching a real client's data; they are not among "
               "num_clients and the divisor is unchanged. The accounted epsilon covers each "
               "canary as one more client; the run's model carries their (tiny) updates")


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
