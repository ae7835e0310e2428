"""Client-level DP without Poisson sampling for any Flower strategy: banded MF around the
strategy's own cohort selection.

:class:`BandedClientLevelDP` wraps a strategy of Flower's message API (``FedAvg``,
``FedProx``, ``FedAdam``, ...) and lets it **choose its own cohort** each round (its
``configure_train``, with its own ``fraction_train`` and ``min_train_nodes``). Instead of
Poisson sampling whose outcome stays secret (what :class:`~privkit.flower.ClientLevelDP`
needs), it bounds how often and how close together one client takes part, and adds the
correlated noise of banded matrix factorization (:class:`privkit.mechanisms.BandMF`;
Choquette-Choo et al., "(Amplified) Banded Matrix Factorization", NeurIPS 2023), priced by
:mod:`privkit.accountants.bandmf` without amplification. Each training round (a *release*):

1. **Budget first.** Release ``t`` is charged ``bandmf_round_events(...)[t]``; if that would
   take the population over ``max_epsilon`` (or the ledger's ``epsilon_budget``), or the
   ``rounds`` releases the accounting priced are used up, training stops (nothing is sent
   from then on; ``privkit-budget-stopped`` = 1 in the round metrics).
2. **The inner strategy chooses the cohort** and configures its messages as it would alone.
3. **The participation schema is enforced** (``MinSeparation(min_separation=bands,
   max_participations=k)``, its :meth:`~privkit.accountants.MinSeparation.allows`): a chosen
   node that took part in one of the last ``bands - 1`` releases (two participations must be
   at least ``bands`` releases apart), or that has used up its ``k`` participations, is
   dropped from the round (its message is not sent). How many selections were dropped, for
   each reason, per round and in total, goes into the round metrics and the report.
4. **Charge** the round's event on the ledger (id ``population``) before any message leaves
   (a ``NoOpDpEvent`` charges nothing); the kept nodes' participation is recorded when their
   messages are sent (a node that then fails still counts as having taken part).
5. **Release.** Each reply's update (returned model minus the global model sent) is clipped to
   L2 norm ``C`` over all arrays and summed in float64; release ``t``'s correlated noise
   ``(C^-1 Z)_t`` is added (``BandMF``, streaming: the last ``bands - 1`` noise outputs are
   the state), and the sum is divided by ``cohort_size``, a **public number fixed before
   training** (by default the cohort the inner strategy is configured to choose:
   ``max(int(N fraction_train), min_train_nodes)``), never by the realised count of kept
   nodes or replies. Failed replies, replies from nodes not kept, and replies with other
   array names, shapes or non-finite values contribute zero.
6. **The inner strategy aggregates one synthetic reply**, the model ``w + mean`` with
   weight 1, as behind :class:`~privkit.flower.ClientLevelDP` (FedOpt strategies apply their
   server optimiser to the private mean: post-processing).

A round in which the inner strategy sends nothing (Upcycled-FL's even rounds) is not a
release: nothing is charged, no noise is drawn, and the separation counts releases, not
server rounds.

What the epsilon assumes (:meth:`BandedClientLevelDP.report` lists it): a trusted
aggregator that clips, sums, adds the noise and keeps the **noise state secret**
(:data:`~privkit.mechanisms.BANDMF_TRUST_ASSUMPTION`: the state is never put in the metrics,
logs or report); the participation schema, which this wrapper enforces; a cohort selection
that does not depend on the clients' data (stock strategies draw it at random; it need not
be secret, and the epsilon holds against the server, which knows who took part). The
relation is **zero-out** (dp-accounting's ``REPLACE_SPECIAL``): one node's data replaced by a
null update, the node keeping its rounds. The inner strategy picks a fixed-size cohort of a
fixed population, so an added node could push another out of a round and move its later
rounds: add/remove does not hold for this schedule, zero-out does (the report gives
replace-one beside it). The drop counts depend only on the cohort selection and the rule,
not on any client's data. Evaluation passes through to the inner strategy and is
not covered, and the clients' train metrics are not released, as for ``ClientLevelDP``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from logging import DEBUG, INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

import privkit
from privkit import _validate
from privkit.accountants.bandmf import (
    BandMFCalibration,
    MinSeparation,
    bandmf_assumptions,
    bandmf_event,
    bandmf_round_events,
    bandmf_sensitivity,
    calibrate_bandmf,
)
from privkit.accountants.rules import NeighboringRelation
from privkit.audit.canaries import CANARY_NOTE
from privkit.errors import InvalidParameterError
from privkit.events import NOISE_MULTIPLIER_NOTE, NoOpDpEvent
from privkit.flower import records as keys
from privkit.flower._server import ServerSideDP, _Round
from privkit.flower.central import _check_canaries
from privkit.ledger import Ledger
from privkit.mechanisms.aggregate import ClientLevelGaussian
from privkit.mechanisms.bandmf import BANDMF_TRUST_ASSUMPTION, BandedToeplitzStrategy, BandMF

__all__ = ["BandedClientLevelDP", "RoundDrops", "COHORT_ASSUMPTION"]

#: What the wrapper assumes of the inner strategy's cohort selection (every report states it).
COHORT_ASSUMPTION = (
    "the inner strategy's cohort selection does not depend on the clients' data (only on "
    "public information, earlier releases and its own randomness); it need not be secret")


@dataclass(frozen=True)
class RoundDrops:
    """The node selections dropped in one release.

    Attributes:
        server_round: Flower's server round.
        release: the 0-based release (row of the strategy matrix) the round was.
        selected: nodes the inner strategy chose.
        separation: of those, dropped for having taken part in one of the last
            ``bands - 1`` releases.
        participation_cap: dropped for having used up ``max_participations``.
    """

    server_round: int
    release: int
    selected: int
    separation: int
    participation_cap: int

    @property
    def kept(self) -> int:
        """Nodes that were sent their train message."""
        return self.selected - self.separation - self.participation_cap


class BandedClientLevelDP(ServerSideDP):
    """Client-level DP with banded MF around any Flower strategy's own cohort selection.

    See the module docstring for what happens each round and what the epsilon assumes.

    Args:
        strategy: the inner strategy; it chooses each round's cohort itself (any
            ``fraction_train``).
        num_clients: N, the connected nodes (the wrapper waits at most ``node_timeout``
            seconds for N of them; more is an error).
        bands: b >= 1, the bands of the strategy matrix and the enforced separation: a node
            takes part at most once in any b consecutive releases. ``1`` is DP-FedAvg's
            independent noise without amplification.
        rounds: T >= b, the releases the accounting covers (training rounds in which the
            inner strategy sends messages); training stops after T releases.
        l2_clip_norm: C > 0, the bound on one client's whole update (L2 over all arrays).
        noise_multiplier: z > 0; ``Z`` has i.i.d. N(0, (z C)^2) entries. Give this or
            ``target_epsilon``.
        target_epsilon: calibrate z (:func:`~privkit.accountants.calibrate_bandmf`) so that
            all T releases cost at most this at the ledger's delta.
        max_participations: k, the most releases one node takes part in; None: ceil(T / b),
            as many as the separation allows.
        cohort_size: the public number the noisy sum is divided by; None: what the inner
            strategy is configured to choose of N nodes, ``max(int(N fraction_train),
            min_train_nodes)`` (Flower's ``FedAvg`` family).
        factorization: a :class:`~privkit.mechanisms.BandedToeplitzStrategy` with ``bands``
            bands; None: ``BandedToeplitzStrategy.optimized(bands, rounds)``.
        ledger: the privacy ledger, as for :class:`~privkit.flower.ClientLevelDP`.
        delta: the target delta, as for :class:`~privkit.flower.ClientLevelDP`.
        max_epsilon: stop before a release would exceed it, as for
            :class:`~privkit.flower.ClientLevelDP`.
        seed: the noise from seed-tree stream ``noise`` of the server round, for experiments
            only; None: SecureRandom.
        run_id: the run's name in the ledger, as for :class:`~privkit.flower.ClientLevelDP`.
        node_timeout: seconds to wait for the N nodes, as for
            :class:`~privkit.flower.ClientLevelDP`.
        canaries: an audit's canary clients (:class:`privkit.audit.CanaryClients`) with a
            ``releases`` schedule the participation schema allows (at most k releases, b
            apart): extra rows of the clipped-update stack before the noise in those
            releases, scored from every released noisy sum. Under zero-out a canary is a
            client that keeps its releases and contributes its vector or zeros; the divisor
            ``cohort_size`` is unchanged and :meth:`report` says they were there.

    Raises:
        InvalidParameterError: a bad argument (named in the message).

    Examples:
        >>> from flwr.serverapp.strategy import FedAvg
        >>> dp = BandedClientLevelDP(FedAvg(fraction_train=0.1), num_clients=100, bands=8,
        ...                          rounds=200, l2_clip_norm=1.0, noise_multiplier=4.0)
        >>> dp.cohort_size, dp.participation
        (10, MinSeparation(min_separation=8, max_participations=25))
        >>> round(dp.epsilon_full_run, 3), dp.sensitivity.exact
        (5.68, True)
    """

    _population_note = ("the cohort_size divisor was derived for that many nodes and the "
                        "inner strategy chooses from all of them")
    #: The inner strategy's cohort has a fixed size: an added node could push another out of
    #: a round, so the schedule satisfies zero-out (a node's data replaced by a null update,
    #: the node keeping its rounds), not add/remove.
    neighboring_relation = NeighboringRelation.REPLACE_SPECIAL
    _relation_why = ("the inner strategy picks a fixed-size cohort of a fixed population, so "
                     "an added node could displace another: zero-out is the relation it "
                     "satisfies")

    def __init__(self, strategy: Strategy, *, num_clients: int, bands: int, rounds: int,
                 l2_clip_norm: float, noise_multiplier: float | None = None,
                 target_epsilon: float | None = None, max_participations: int | None = None,
                 cohort_size: int | None = None,
                 factorization: BandedToeplitzStrategy | None = None,
                 ledger: Ledger | None = None, delta: float | None = None,
                 max_epsilon: float | None = None, seed: int | None = None,
                 run_id: str = "flower", node_timeout: float = 30.0,
                 canaries: Any = None) -> None:
        self._wrap(strategy)
        self._no_own_privacy(strategy)
        self.strategy = strategy
        self.num_clients = _validate.positive_int("num_clients", num_clients)
        self.rounds = _validate.positive_int("rounds", rounds)
        self.bands = _validate.positive_int("bands", bands)
        if self.bands > self.rounds:
            raise InvalidParameterError("bands", bands, f"<= rounds ({self.rounds})")
        k_max = -(-self.rounds // self.bands)
        k = k_max if max_participations is None else _validate.positive_int(
            "max_participations", max_participations)
        self.participation = MinSeparation(min_separation=self.bands, max_participations=k)
        self.cohort_size = self._cohort_size(strategy, cohort_size)
        clip = _validate.positive("l2_clip_norm", l2_clip_norm)
        if (noise_multiplier is None) == (target_epsilon is None):
            raise InvalidParameterError(
                "noise_multiplier", noise_multiplier,
                "exactly one of noise_multiplier and target_epsilon (got "
                f"target_epsilon={target_epsilon!r})")
        z = None if noise_multiplier is None else _validate.positive(
            "noise_multiplier", noise_multiplier)
        target = None if target_epsilon is None else _validate.positive(
            "target_epsilon", target_epsilon)
        if factorization is None:
            factorization = BandedToeplitzStrategy.optimized(self.bands, self.rounds)
        elif not isinstance(factorization, BandedToeplitzStrategy):
            raise InvalidParameterError("factorization", type(factorization).__name__,
                                        "a privkit.mechanisms.BandedToeplitzStrategy")
        elif factorization.num_bands != self.bands:
            raise InvalidParameterError("factorization", f"{factorization.num_bands} bands",
                                        f"bands={self.bands} bands")
        self.factorization = factorization
        self._common(max_epsilon=max_epsilon, seed=seed, run_id=run_id,
                     node_timeout=node_timeout)
        self.ledger = self._make_ledger(ledger, delta, f"flower-banded-mf|{run_id}")
        self.calibration: BandMFCalibration | None = None
        if target is not None:
            self.calibration = calibrate_bandmf(
                factorization, target_epsilon=target, delta=self.ledger.delta,
                rounds=self.rounds, participation=self.participation,
                neighboring_relation=self.neighboring_relation)
            z = self.calibration.noise_multiplier
        assert z is not None
        self.mechanism = BandMF(factorization, clip, z)
        self.clip_norm = clip
        priced: dict[str, Any] = dict(strategy=factorization, noise_multiplier=z,
                                      rounds=self.rounds, participation=self.participation)
        self.sensitivity = bandmf_sensitivity(factorization, rounds=self.rounds,
                                              participation=self.participation)
        self.round_events = bandmf_round_events(**priced)
        self.run_event = bandmf_event(**priced)
        self.epsilon_full_run = float(privkit.epsilon(
            self.run_event, self.ledger.delta,
            neighboring_relation=self.neighboring_relation).epsilon)
        self.epsilon_full_run_replace_one = float(privkit.epsilon(
            self.run_event, self.ledger.delta,
            neighboring_relation=NeighboringRelation.REPLACE_ONE).epsilon)
        self.drops: list[RoundDrops] = []
        self.releases = 0  # releases charged so far (the next release's index)
        self._noise_state = self.mechanism.initial_state()  # secret: never published
        self._taken: dict[int, list[int]] = {}  # node -> its releases (the server's record)
        self.canaries = _check_canaries(canaries)
        if self.canaries is not None:
            rel = self.canaries.releases
            if rel is None or not self.participation.allows(list(rel)) or rel[-1] >= self.rounds:
                raise InvalidParameterError(
                    "canaries", f"releases={rel}", f"a schedule of releases < {self.rounds} "
                    f"that {self.participation} allows (the canaries are clients too)")

    def _cohort_size(self, strategy: Strategy, cohort_size: Any) -> int:
        """The public divisor: given, or what the inner strategy chooses of N nodes."""
        n = self.num_clients
        for attr in ("min_available_nodes", "min_train_nodes"):
            need = getattr(strategy, attr, None)
            if isinstance(need, int) and need > n:
                raise InvalidParameterError("strategy", f"{attr}={need}",
                                            f"<= num_clients ({n}); it would wait forever")
        if cohort_size is None:
            fraction = getattr(strategy, "fraction_train", None)
            least = getattr(strategy, "min_train_nodes", None)
            if not (isinstance(fraction, int | float) and isinstance(least, int)):
                raise InvalidParameterError(
                    "cohort_size", None, "a number of nodes (this strategy has no "
                    "fraction_train / min_train_nodes to derive the divisor from)")
            derived = max(int(n * fraction), least)
            if derived < 1:
                raise InvalidParameterError("strategy", f"fraction_train={fraction!r}",
                                            "a strategy that trains some nodes")
            return derived
        m = _validate.positive_int("cohort_size", cohort_size)
        if m > n:
            raise InvalidParameterError("cohort_size", m, f"<= num_clients ({n})")
        return m

    # -- what is spent -----------------------------------------------------------------------
    @property
    def noise_multiplier(self) -> float:
        """z: stddev of ``Z`` / the clip norm (the event's is z / sensitivity)."""
        return float(self.mechanism.noise_multiplier)

    @property
    def dropped_separation(self) -> int:
        """Selections dropped so far because the node took part too recently."""
        return sum(d.separation for d in self.drops)

    @property
    def dropped_cap(self) -> int:
        """Selections dropped so far because the node used up its participations."""
        return sum(d.participation_cap for d in self.drops)

    def _metrics(self, server_round: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "privkit-epsilon": self.epsilon(), "privkit-delta": float(self.ledger.delta),
            "privkit-noise-multiplier": self.noise_multiplier,
            "privkit-l2-clip-norm": self.clip_norm, "privkit-bands": self.bands,
            "privkit-cohort-size": self.cohort_size, "privkit-releases": self.releases}
        this = [d for d in self.drops if d.server_round == server_round]
        if this:
            out["privkit-dropped-separation"] = this[0].separation
            out["privkit-dropped-cap"] = this[0].participation_cap
        if self.stopped is not None:
            out["privkit-budget-stopped"] = 1
        return out

    # -- train -------------------------------------------------------------------------------
    def _catch_up(self) -> None:
        """A charged round whose replies were never aggregated (a loop other than
        ``Strategy.start``): draw its noise so that the state stays at the charged release."""
        sent = self._round
        if sent is not None and self._noise_state.next_round < self.releases:
            like = keys.from_record(sent.arrays)
            _, self._noise_state = self.mechanism.noise(
                like, self._noise_state, rng=self._rng(sent.server_round, "noise"))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Check the budget, let the inner strategy choose and configure, drop the nodes the
        schema does not allow, charge, send."""
        self._catch_up()
        self._round, self._skipped = None, None
        if self.stopped is not None:
            return []
        t = self.releases
        if t >= self.rounds:
            self._stop(server_round, f"the rounds={self.rounds} releases the accounting "
                       "priced are used up")
            return []
        event = self.round_events[t]
        free = isinstance(event, NoOpDpEvent)
        if not free and self._over_budget(server_round, event):
            return []
        nodes = self._nodes(grid)
        with self._inner_counts_hidden():  # the inner cohort is a proposal
            messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if not messages:  # the inner strategy trains nobody: not a release, free
            self._skipped = server_round
            return []
        by_node = self._by_node(messages)
        unknown = sorted(set(by_node) - set(nodes))
        if unknown:
            raise RuntimeError(f"the inner strategy sent train messages to {len(unknown)} "
                               "nodes that are not connected")
        kept, separation, cap = [], 0, 0
        k = self.participation.max_participations
        for nid in by_node:
            taken = self._taken.get(nid, [])
            if self.participation.allows([*taken, t]):
                kept.append(nid)
            elif len(taken) >= k:
                cap += 1
            else:
                separation += 1
        # write-ahead: the ledger knows before any node does
        if not free and not self._charge(server_round, event, "banded MF client-level sum"):
            return []
        for nid in kept:
            self._taken.setdefault(nid, []).append(t)
        self.drops.append(RoundDrops(server_round, t, len(by_node), separation, cap))
        self.releases = t + 1
        self._round = _Round(server_round, arrays, frozenset(kept), messages[0])
        log(INFO, "BandedClientLevelDP: round %d is release %d of %d; %d of %d chosen nodes "
            "dropped (separation %d, participation cap %d); epsilon %.4g at delta %g",
            server_round, t + 1, self.rounds, separation + cap, len(by_node), separation, cap,
            self.epsilon(), self.ledger.delta)
        log(DEBUG, "BandedClientLevelDP: round %d nodes sent %s", server_round, sorted(kept))
        return [by_node[nid] for nid in kept]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip, sum, add the release's correlated noise, divide by ``cohort_size``; the
        inner strategy aggregates the result."""
        replies = list(replies)
        sent = self._round if self._round is not None and \
            self._round.server_round == server_round else None
        if sent is None:
            if self._skipped == server_round:  # the inner strategy's own server-only step
                arrays, metrics = self.strategy.aggregate_train(server_round, replies)
                return arrays, MetricRecord(dict(metrics or {}) | self._metrics(server_round))
            return None, MetricRecord(self._metrics(server_round))
        updates = self._updates(replies, sent)
        release = self.releases - 1
        if self.canaries is not None:  # extra rows before the noise (an audit's canaries)
            clip = ClientLevelGaussian(self.clip_norm, self.noise_multiplier)
            updates = self.canaries.insert(updates, release=release, mechanism=clip)
        noisy, self._noise_state = self.mechanism(updates, self._noise_state,
                                                  rng=self._rng(server_round, "noise"))
        if self.canaries is not None:
            self.canaries.observe(noisy, release=release, mechanism=clip)
        self._round = None
        mean = ClientLevelGaussian.mean(noisy, self.cohort_size)
        arrays, inner = self._aggregate_mean(server_round, sent, mean)
        return arrays, MetricRecord(inner | self._metrics(server_round))

    # -- the run's privacy section ----------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """The privacy section of a run: the population's epsilon, the participation schema
        and what it assumes, the selections dropped to enforce it, the randomness, what is
        public. The noise state is never in it."""
        p = self.participation
        out: dict[str, Any] = {
            "mechanism": "client-level banded matrix factorization "
                         "(privkit.flower.BandedClientLevelDP)",
            "privacy_unit": "client", "epsilon": self.epsilon(),
            "delta": float(self.ledger.delta), "releases": self.releases,
            "rounds": self.rounds, "epsilon_full_run": self.epsilon_full_run,
            "neighboring_relation": "zero-out client (replace_special): one node's data "
                                    "replaced by a null update in the same rounds",
            "epsilon_replace_one": self.epsilon_replace_one(),
            "epsilon_full_run_replace_one": self.epsilon_full_run_replace_one,
            "noise_multiplier_note": NOISE_MULTIPLIER_NOTE,
            "noise_multiplier": self.noise_multiplier, "l2_clip_norm": self.clip_norm,
            "bands": self.bands,
            "factorization": {"kind": "banded Toeplitz",
                              "coefficients": list(self.factorization.coefficients)},
            "sensitivity": {"value": self.sensitivity.value, "exact": self.sensitivity.exact,
                            "method": self.sensitivity.method},
            "participation": {
                "schema": "MinSeparation", "min_separation": int(p.min_separation),
                "max_participations": int(p.max_participations),
                "enforced_by": "the server: a node chosen by the inner strategy that took "
                               "part too recently, or too often, is left out of the round"},
            "cohort": {"chosen_by": type(self.strategy).__name__,
                       "divisor": self.cohort_size,
                       "note": "the noisy sum is divided by this fixed, public number, "
                               "never by the number of nodes kept or of replies"},
            "dropped": {
                "separation": self.dropped_separation,
                "participation_cap": self.dropped_cap,
                "selected": sum(d.selected for d in self.drops),
                "per_round": [{"server_round": d.server_round, "release": d.release,
                               "selected": d.selected, "separation": d.separation,
                               "participation_cap": d.participation_cap}
                              for d in self.drops],
                "note": "counts depend only on the cohort selection and the rule, not on "
                        "the clients' data"},
            "num_clients": self.num_clients, "trust": BANDMF_TRUST_ASSUMPTION,
            "assumptions": [*bandmf_assumptions(p, self.neighboring_relation),
                            COHORT_ASSUMPTION],
            "randomness": {"source": "os_csprng" if self.seed is None else "seed",
                           "note": "noise from privkit's SecureRandom" if self.seed is None
                           else "seeded: a simulation; whoever knows the seed can "
                                "regenerate the noise"},
            "public": [f"N = {self.num_clients}", "which nodes exist (zero-out protects "
                       "what a node's data contributes, not whether it is in the "
                       "population)", f"the divisor cohort_size = "
                       f"{self.cohort_size}", f"b = {self.bands}, T = {self.rounds}, "
                       f"k = {p.max_participations} and the coefficients",
                       "the number of rounds", "the drop counts"]}
        if self.canaries is not None:
            out["canaries"] = self.canaries.describe()
            out["assumptions"].append(CANARY_NOTE)
        if self.calibration is not None:
            out["calibration"] = {"target_epsilon": self.calibration.target_epsilon,
                                  "epsilon": self.calibration.epsilon,
                                  "method": self.calibration.method}
        if self.stopped is not None:
            out["stopped"] = self.stopped
        return out

    def summary(self) -> None:
        """Log the DP settings, then the inner strategy's."""
        p = self.participation
        log(INFO, "\t├──> privkit banded MF client-level DP: b=%d, T=%d, each node at most "
            "%d times and >= %d releases apart, C=%g, z=%g, divisor %d of N=%d, delta %g, "
            "max_epsilon %s, noise %s", self.bands, self.rounds, p.max_participations,
            p.min_separation, self.clip_norm, self.noise_multiplier, self.cohort_size,
            self.num_clients, self.ledger.delta,
            "none" if self.max_epsilon is None else f"{self.max_epsilon:g}",
            "SecureRandom" if self.seed is None else f"seed {self.seed} (NOT secure)")
        log(INFO, "\t│\t└── assumes: %s", BANDMF_TRUST_ASSUMPTION)
        self.strategy.summary()

    def __repr__(self) -> str:
        return (f"BandedClientLevelDP({type(self.strategy).__name__}, num_clients="
                f"{self.num_clients}, bands={self.bands}, rounds={self.rounds}, "
                f"l2_clip_norm={self.clip_norm:g}, noise_multiplier={self.noise_multiplier:g})")
