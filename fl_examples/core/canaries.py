"""Canaries in a trainer's own releases: ``--audit-canaries M`` (docs/audit-runs.md, "In the
trainers").

A private run given ``audit_canaries = M > 0`` plants M white-box canaries in the releases of
its main private algorithm, scores them from those releases, and ends with an empirical
**lower** bound on epsilon beside its accounted (upper-bound) epsilon. The canaries are
:func:`privkit.audit.make_canaries` Dirac canaries (one model coordinate each, so their
scores are independent), each held in by a fair coin drawn from the run's seed; a canary's
vector has norm ``2 C`` (the mechanism must clip it to C, so a release that skipped clipping
shows too). They are extra contributions: never a real client's or record's data, not among
the clients, the divisor unchanged. The accounted epsilon covers each canary as one more unit
of the run's privacy (a client, or a record of the audited edge) and the real clients'
epsilon is that of a run with M extra contributions of the same sensitivity, which is the
epsilon printed (the report's ``privacy.canaries`` says they were there).

Where they go (:class:`TrainerCanaries`, one per audited run):

* **DP-FedAvg** (:meth:`fl_examples.core.dp_modes.ClientDpPlan.release`: upcycled ``--privacy
  client``, dprec's ``dpfedavg``): canary **clients**, one more row of the stacked updates
  per canary taking part, before the noise. Each included canary takes part in a data round
  with the run's Poisson rate q, like every client (its own stream, never used in a score:
  the amplified epsilon the run prints is for a client whose participation is secret). With
  adaptive clipping the rows enter the sum only, not the noisy count (the clip norm C_t is
  the released count's post-processing; the canary's vector is ``2 C_t``). Scores:
  :class:`privkit.audit.WhiteBoxScorer` on each release in units of C_t (noise stddev z, an
  in-canary's shift 1/z): the normalised sum at q = 1, the Poisson log-likelihood ratio
  below.
* **Distributed DP** (:meth:`fl_examples.core.distributed.DistributedDpPlan.release`:
  ``--aggregation distributed``, upcycled and dprec's ``dpfedavg``): canary **clients** that go
  through the clients' own encoder (:meth:`~fl_examples.core.distributed.DistributedDpPlan.
  canary_input`: clipped to C, the round's public rotation, scaled by 1/gamma, conditionally
  rounded with the canaries' own coins, wrapped modulo 2^bits) but add **no** noise share:
  their residues join the secure sum before the server decodes it. The priced noise is the
  honest clients' shares; a canary is one more unit of sensitivity, as the target client is
  under zero-out (in or out of a sum its contribution or nothing, never a noise share; its
  rounded vector within the same norm bound). A canary is never a survivor: a round whose
  cohort is below ``--min-survivors`` is skipped whatever the canaries (nothing released,
  nothing scored, no canary draw), and in a released round each included canary takes part
  with probability q' (the released rounds' rate the ledger amplifies at, ``released_rate``;
  q at q = 1, its own stream). Scores: as DP-FedAvg's, from the **decoded** sum (centred,
  unscaled, rotated back; before the divisor q N) in units of C, with z the released sum's
  guaranteed noise multiplier ``gamma sqrt((n_min - colluders) mu) / C`` (an in-canary's shift
  1/z; the shares are scaled to the cohort, so this is the sum's noise at
  ``dropout_tolerance`` 0 with no colluders, and more noise otherwise, which only weakens a
  score). The Steinke et al. bound assumes nothing but the coins; the Gaussian one-run bound
  assumes Gaussian scores, which here holds approximately: each decoded coordinate is a
  rotated (``1/sqrt(d)``-weighted) sum of ``d`` coordinates of Skellam noise of variance
  ``n mu_n`` (n shares of the cohort's ``mu_n``, at least ``(n_min - colluders) mu`` of it
  honest), near Gaussian (the rounding's error, under ``gamma^2 / 4`` a coordinate per
  contribution, is more noise).
  The canaries' rows add at most ``sqrt(M) C`` to the sum's norm: the plan's wrap-around
  bound is for the real cohort, ``privacy.canaries.wrap_bound_per_round`` the bound with the
  canaries in, the report's ``wrapped_rounds`` counts the rounds that wrapped (a wrapped
  release only weakens the scores: it is still a post-processing of the noisy sum).
* **Banded MF** (:meth:`fl_examples.core.banded.BandedDpPlan.release`): canary clients in a
  schedule the participation schema allows: ``minsep`` data rounds 1, 1 + s, ... (at most
  ceil(T / s) rounds, s apart), ``cyclic`` group 0's rounds (1, 1 + g, ...),
  ``poisson`` group 0's rounds with probability q each. The releases' correlated noise
  ``C^-1 Z`` is undone on the canaries' projections, ``d_t = sum_j c_j p_(t-j)`` (i.i.d.
  noise: the decorrelated releases the Gaussian mechanism ``C x + Z`` publishes), and each
  canary's score is its matched filter over them, ``sum_t w_t d_t / ||w||`` with ``w = C 1_S``
  the canary's pattern in the decorrelated releases (the likelihood-ratio statistic at fixed
  participation).
* **MAPA's Gaussian uploads** (``--noise gaussian``): canary **records** of one edge, the one
  with the most uploads in the run (public: the simulated schedule): in each of its
  computed uploads each included canary enters the Poisson batch with the edge's rate
  ``b / n_k``, as a per-example gradient of norm ``2 C_s`` clipped to the stage clip C_s,
  summed before the noise ``N(0, (z C_s)^2)``; scored like DP-FedAvg's in units of C_s. The
  accounted epsilon beside it is that edge's.
* **SCFL's gradient DP** (``--noise-multiplier`` / ``--noise-for-epsilon``): canary records
  of one client (the largest sampling rate, then the likeliest to arrive), in its Poisson
  minibatches, clipped to C and summed before the noise, scored in the epochs its gradient
  arrives (a gradient that does not arrive is not released); beside that client's epsilon.

Every score is computed from the released noisy values alone (and the canaries' own secret
draws, which no client's data touches): ``audit_scores.json``, the report's ``audit`` block
and the console's audit line are post-processing of the releases, covered by the run's
epsilon. The real clients' part of a release is then noise to the score (the library's
``known=``, the server's own clipped sum, would take it out, but such scores would give that
sum away on the canaries' coordinates, outside the epsilon); measured, it costs nothing at
q = 1 (docs/audit-runs.md, "In the trainers").

Refused (one line each, :func:`refusal`): a non-private run; record-level DP-SGD
(``ClientsDpSgd`` runs each client's steps inside the client, never releases them and takes no
extra per-example gradients); output and objective perturbation (a client's own noisy model
or objective: a canary would re-test one mechanism, which ``privkit audit gaussian`` /
``objective`` does); DP-REC (messages are REC selections, no additive noise to project on:
``privkit audit rec``); MAPA's pure-DP Laplace uploads (the Gaussian one-run bound assumes
Gaussian scores: ``privkit audit laplace-l2|laplace-l1``); SCFL without gradient noise (its
coded upload's MI-DP is no epsilon: ``privkit audit coded``); ``--checkpoint-every`` and
``--resume`` (the scores are not checkpointed: an audit run is one uninterrupted run).

A run whose lower bound exceeds its accounted epsilon contradicts its own accounting: it
writes its report, prints one error line and exits with status :data:`EXIT_EXCEEDED`
(:func:`audit_exit`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from privkit import _validate
from privkit.audit import (
    CanaryRun,
    WhiteBoxScorer,
    canary_rows,
    flatten,
    make_canaries,
)
from privkit.audit.canaries import CANARY_NOTE
from privkit.audit.runs import SCORES_FILE
from privkit.errors import InvalidParameterError

__all__ = ["TrainerCanaries", "EXIT_EXCEEDED", "CONFIDENCE", "NORM_FACTOR", "SCORES_NOTE",
           "refusal", "check_count", "check_fits", "canary_seed", "for_plan", "finish",
           "audit_exit", "describe_block", "decorrelated_scores", "privacy_notes"]

#: The exit status of a run whose audit contradicts its accounting (after its report).
EXIT_EXCEEDED = 3
#: The confidence of every bound of a trainer's audit: a correct run exits with
#: :data:`EXIT_EXCEEDED` with probability at most 2 % (two bounds at 99 % each), where the
#: papers' usual 95 % would flag up to one correct run in ten at a nearly tight audit
#: (q = 1, many canaries).
CONFIDENCE = 0.99
#: A canary's vector has this many times the clip norm (the mechanism must clip it).
NORM_FACTOR = 2.0
#: What the report says of the scores (they are covered).
SCORES_NOTE = (f"computed from the released noisy values alone and the canaries' own draws: "
               f"{SCORES_FILE}, report.json's audit block and the console's audit line are "
               "post-processing of the releases, covered by the epsilon")
_SEED_TAG = 0xA0D17


def canary_seed(seed: int, name: str) -> int:
    """The canaries' seed (directions, coins and Poisson draws) from a run's seed."""
    key = np.random.SeedSequence(int(seed), spawn_key=(_SEED_TAG, sum(map(ord, name))))
    return int(key.generate_state(1, np.uint64)[0] >> 2)


def refusal(m: int, reason: str) -> InvalidParameterError:
    """The one-line error refusing ``--audit-canaries M`` (``reason``: where and why)."""
    return InvalidParameterError("audit_canaries", m, f"left out {reason}")


def check_count(m: Any, *, checkpoint_every: int = 0) -> int:
    """``audit_canaries``: an integer >= 0 (0: no audit); > 0 refused with checkpoints."""
    n = _validate.nonnegative_int("audit_canaries", m)
    if n and checkpoint_every:
        raise refusal(n, "with --checkpoint-every (the canaries' scores are not checkpointed: "
                      "an audit run is one uninterrupted run)")
    return n


def check_fits(m: int, dim: int) -> None:
    """M Dirac canaries need M distinct coordinates of the model (checked before a run
    touches its output directory)."""
    if m > dim:
        raise InvalidParameterError("audit_canaries", m, f"at most {dim}, the model's "
                                    "parameters (one Dirac canary per coordinate)")


class TrainerCanaries:
    """M Dirac canaries in one run's releases (module docstring).

    Args:
        m: the number of canaries (<= ``dim``).
        dim: the flattened model's length.
        seed: :func:`canary_seed` of the run.
        noise_multiplier: z of the releases (noise stddev / C).
        sampling_probability: a canary's probability of taking part in an eligible release.
        where: what a canary is, for the report.
        strategy: banded MF's coefficients ``c_0 .. c_(b-1)`` (None: independent noise).
        eligible: ``eligible(t)`` for release t (1-based), the public schedule (None: all).
        details: more of what the report says about the canaries (:meth:`describe`).

    Attributes:
        coins: the canaries' own generator for what their encoding draws (distributed DP's
            rounding coins; never a client's stream, neither the inclusion coins nor the
            Poisson draws).

    Raises:
        InvalidParameterError: ``m`` above ``dim`` (named ``audit_canaries``).
    """

    def __init__(self, m: int, dim: int, *, seed: int, noise_multiplier: float,
                 sampling_probability: float = 1.0, where: str,
                 strategy: Any = None, eligible: Callable[[int], bool] | None = None,
                 details: Mapping[str, Any] | None = None) -> None:
        m = _validate.positive_int("audit_canaries", m)
        check_fits(m, dim)
        # the first two children are those of spawn(2): adding the third moved nothing
        s1, s2, s3 = np.random.SeedSequence(_validate.nonnegative_int("seed", seed)).spawn(3)
        self.canaries = make_canaries(m, dim, norm=1.0, seed=int(s1.generate_state(1)[0]))
        self._rng = np.random.default_rng(s2)
        self.coins = np.random.default_rng(s3)
        self.details = dict(details or {})
        self.z = _validate.positive("noise_multiplier", noise_multiplier)
        self.q = _validate.probability("sampling_probability", sampling_probability)
        self.where = where
        self.strategy = None if strategy is None else np.asarray(strategy, dtype=np.float64)
        self.eligible = eligible
        # noise units: a release divided by its clip norm has noise stddev z
        self.scorer = WhiteBoxScorer(self.canaries, stddev=self.z, l2_clip_norm=1.0,
                                     sampling_probability=self.q)
        self._signals: list[np.ndarray] = []  # banded MF: each release's projections
        self._eligible: list[bool] = []
        self._pending: tuple[int, bool, float] | None = None
        self.releases = 0

    @property
    def m(self) -> int:
        return self.canaries.m

    # -- a release -------------------------------------------------------------------------
    def take(self, release: int) -> np.ndarray:
        """``(m,)`` bool: the canaries in release ``release`` (1-based): included, eligible
        and Poisson-sampled (every canary's uniform is drawn, whatever its coin)."""
        ok = self.eligible is None or bool(self.eligible(release))
        take = self.canaries.poisson(self.q, self._rng)
        if not ok:
            take[:] = False
        return take

    def rows(self, take: np.ndarray, clip: float) -> np.ndarray:
        """``(k, dim)`` float64: the vectors of the canaries in ``take``, norm 2 C."""
        return self.canaries.vectors(take) * (NORM_FACTOR * float(clip))

    def begin(self, release: int, clip: float) -> np.ndarray:
        """Start release ``release`` (its clip norm C) and return which canaries take part."""
        if self._pending is not None:
            raise InvalidParameterError("release", release, "after the previous release was "
                                        "observed")
        take = self.take(release)
        ok = self.eligible is None or bool(self.eligible(release))
        self._pending = (release, ok, float(clip))
        return take

    def insert(self, updates: Mapping[str, Any], like: Mapping[str, Any], *, clip: float,
               release: int | None = None) -> dict[str, Any]:
        """The stacked updates (leaves ``(K, ...)``, torch) with this release's canary rows
        appended; ``like`` is one update's tree (the model: shapes, dtypes, device);
        ``release``: 1-based (default: the next one)."""
        import torch

        t = self.releases + 1 if release is None else release
        take = self.begin(t, clip)
        if not take.any():
            return dict(updates)
        rows = canary_rows(self.canaries, dict(like), take)
        f = NORM_FACTOR * float(clip)
        return {k: torch.cat([updates[k], rows[k] * f]) for k in updates}

    def observe(self, noisy_sum: Any, *, release: int | None = None) -> None:
        """Score release ``release``'s noisy **sum** (a tree or a flat vector; default: the
        release begun last)."""
        if self._pending is None or release not in (None, self._pending[0]):
            raise InvalidParameterError("release", release, "the release begin() was called "
                                        "for, once")
        _, ok, clip = self._pending
        self._pending = None
        flat = noisy_sum if isinstance(noisy_sum, np.ndarray) and noisy_sum.ndim == 1 \
            else flatten(noisy_sum, "noisy_sum")
        self.releases += 1
        if self.strategy is None:
            self.scorer.add(flat / clip, eligible=np.full(self.m, ok))
        else:
            self._signals.append(self.scorer.signals(flat / clip))
            self._eligible.append(ok)

    # -- scores ----------------------------------------------------------------------------
    @property
    def statistic(self) -> str:
        if self.strategy is not None:
            return "matched filter over the decorrelated releases (banded MF)"
        return self.scorer.statistic

    def scores(self) -> np.ndarray:
        """``(m,)``: each canary's score (higher: more likely in)."""
        if self.strategy is None:
            return self.scorer.scores
        return decorrelated_scores(np.array(self._signals).reshape(-1, self.m),
                                   np.array(self._eligible, dtype=bool), self.strategy)

    def canary_run(self, *, accounted_epsilon: float, delta: float) -> CanaryRun:
        """The scores as a one-run :class:`privkit.audit.CanaryRun` (white-box)."""
        if not self.releases:
            raise InvalidParameterError("audit_canaries", self.m, "used in a run with at least "
                                        "one release (this run released nothing)")
        ins, outs = self.canaries.split(self.scores())
        return CanaryRun(ins, outs, "one-run", delta, accounted_epsilon=accounted_epsilon,
                         threat_model="white-box", statistic=self.statistic,
                         settings={**self.describe(), "confidence": CONFIDENCE})

    def describe(self) -> dict[str, Any]:
        """What the report says about the canaries (never the coins)."""
        return {**self.canaries.describe(), "norm": f"{NORM_FACTOR:g} x the clip norm "
                "(clipped to it by the mechanism)", "where": self.where,
                "noise_multiplier": self.z, "sampling_probability": self.q,
                "releases": self.releases,
                "statistic": self.statistic, "note": CANARY_NOTE} | self.details


def for_plan(plan: Any, m: int, dim: int, *, seed: int) -> TrainerCanaries:
    """Canary clients for a client-level plan: DP-FedAvg's
    (:class:`~fl_examples.core.dp_modes.ClientDpPlan`: Poisson at q in every data round),
    banded MF's (:class:`~fl_examples.core.banded.BandedDpPlan`: the schedule its
    participation allows) or distributed DP's
    (:class:`~fl_examples.core.distributed.DistributedDpPlan`: Poisson at q' in every
    released round, encoded without a noise share; module docstring)."""
    from fl_examples.core.banded import BandedDpPlan
    from fl_examples.core.distributed import DistributedDpPlan

    if isinstance(plan, DistributedDpPlan):
        return TrainerCanaries(m, dim, seed=seed, noise_multiplier=plan.noise_multiplier,
                               sampling_probability=plan.released_rate,
                               where=f"canary clients in the secure sum of every released "
                                     f"round, Poisson-sampled at q' = "
                                     f"{plan.released_rate:.6g} (the rate a released round is "
                                     "charged at), each encoded like a client (clip, the "
                                     "round's rotation, scaling, conditional rounding, modulo "
                                     f"2^{plan.bits}) with no noise share (distributed DP)",
                               details=plan.canary_details(m))
    if not isinstance(plan, BandedDpPlan):
        return TrainerCanaries(m, dim, seed=seed, noise_multiplier=plan.noise_multiplier,
                               sampling_probability=plan.client_rate,
                               where="canary clients, Poisson-sampled at the run's client "
                                     "rate q in every data round (DP-FedAvg)")
    if plan.participation == "minsep":
        every, what = plan.separation, (f"data rounds 1, 1 + {plan.separation}, ... (min "
                                        f"separation {plan.separation}, at most "
                                        f"{plan.max_participations} rounds)")
    else:
        every, what = plan.groups, f"group 0's data rounds (1, 1 + {plan.groups}, ...)"
    q = plan.client_rate if plan.participation == "poisson" else 1.0
    if q < 1:
        what += f", each with probability q = {q:g}"
    return TrainerCanaries(m, dim, seed=seed, noise_multiplier=plan.noise_multiplier,
                           sampling_probability=q, strategy=plan.strategy.coefficients,
                           eligible=lambda t: (t - 1) % every == 0,
                           where=f"canary clients in {what} (banded MF, {plan.participation} "
                                 "participation)")


def decorrelated_scores(signals: np.ndarray, eligible: np.ndarray, coefficients: np.ndarray
                        ) -> np.ndarray:
    """Banded MF's matched-filter scores from each release's projections (noise units).

    ``signals`` ``(T, m)``: release t's projections ``p_t`` on the canaries; the decorrelated
    releases are ``d_t = sum_j c_j p_(t-j)`` (i.i.d. N(0, 1) noise); a canary taking part in
    the releases ``S`` (``eligible``) shows ``w = C 1_S`` in them; the score is
    ``sum_t w_t d_t / ||w||`` (N(0, 1) for a canary left out).

    Example (no noise: a canary's unit contribution in release 1 of 3, c = (1, 0.5); its
    decorrelated pattern is w = (1, 0.5, 0), its score ||w||):
        >>> p = np.array([[1.0], [0.0], [0.0]])
        >>> s = decorrelated_scores(p, np.array([True, False, False]), np.array([1.0, 0.5]))
        >>> round(float(s[0]), 4), round(1.25 ** 0.5, 4)
        (1.118, 1.118)
    """
    t, _ = signals.shape
    b = len(coefficients)
    d = np.zeros_like(signals)
    w = np.zeros(t)
    for j in range(min(b, t)):
        d[j:] += coefficients[j] * signals[: t - j]
        w[j:] += coefficients[j] * eligible[: t - j]
    norm = float(np.linalg.norm(w))
    if not norm > 0:
        return np.zeros(signals.shape[1])
    return np.asarray(w @ d / norm, dtype=np.float64)


# ------------------------------------------------------------------------ the run's end
def finish(canaries: TrainerCanaries, *, algorithm: str, accounted_epsilon: float,
           delta: float, out: str | Path | None) -> dict[str, Any]:
    """Save ``OUT/audit_scores.json`` (with an output directory) and return the report's
    ``audit`` block: the bounds recomputed from the saved scores, beside the accounted
    epsilon."""
    run = canaries.canary_run(accounted_epsilon=float(accounted_epsilon), delta=float(delta))
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        run.save(Path(out))
    return describe_block(run, algorithm=algorithm)


def describe_block(run: CanaryRun, *, algorithm: str) -> dict[str, Any]:
    """The ``audit`` block of a report from a :class:`~privkit.audit.CanaryRun`."""
    a = run.audit()
    best = a.best
    return {
        "algorithm": algorithm, "method": "one-run white-box canaries (Steinke, Nasr & "
        "Jagielski 2023; Gaussian one-run, Agrawal et al. 2026)",
        "m": int(run.in_scores.size + run.out_scores.size),
        "m_in": int(run.in_scores.size), "m_out": int(run.out_scores.size),
        "confidence": a.confidence, "joint_confidence": a.joint_confidence,
        "delta": float(run.delta), "accounted_epsilon": a.accounted_epsilon,
        "lower_bounds": {b.method: b.epsilon_lower_bound for b in a.bounds},
        "epsilon_lower_bound": best.epsilon_lower_bound, "best": best.method,
        "exceeded": a.exceeded, "line": a.summary(), "scores": SCORES_FILE,
        "statistic": run.statistic, "bounds": [b.to_dict() for b in a.bounds],
        "canaries": dict(run.settings)}


def audit_exit(block: Mapping[str, Any] | None, *, as_json: bool) -> int:
    """Print the audit's console line (unless ``as_json``: the block is in the JSON) and,
    when a lower bound exceeds the accounted epsilon, one error line on stderr; the exit
    status (0, or :data:`EXIT_EXCEEDED`)."""
    if block is None:
        return 0
    if not as_json:
        print(block["line"])
    if not block["exceeded"]:
        return 0
    print(f"privkit: error: audit: the empirical lower bound "
          f"{block['epsilon_lower_bound']:.4g} ({block['best']}, "
          f"{block['confidence']:.0%}) exceeds the accounted epsilon "
          f"{block['accounted_epsilon']:.4g} of {block['algorithm']}: the run leaks more than "
          f"its accounting says (a bug report; the report is written, exit status "
          f"{EXIT_EXCEEDED}; docs/audit-runs.md)", file=sys.stderr)
    return EXIT_EXCEEDED


def privacy_notes(privacy: dict[str, Any], canaries: TrainerCanaries) -> None:
    """Add the canaries to a private run's privacy section (in place): what they were and
    that their scores are covered."""
    privacy["canaries"] = canaries.describe() | {"scores": SCORES_NOTE}
