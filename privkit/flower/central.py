"""Client-level DP for any Flower strategy: Poisson client sampling, clipping, noise once.

:class:`ClientLevelDP` wraps a strategy of Flower's message API (``flwr.serverapp.strategy``:
``FedAvg``, ``FedProx``, ``FedAvgM``, ``FedAdam``, ``FedAdagrad``, ``FedYogi``, or the examples'
``PrivkitFedProx`` / ``UpcycledFedProx`` without their own privacy) and runs DP-FedAvg
(McMahan, Ramage, Talwar & Zhang, ICLR 2018) around it, with privkit's aggregate mechanism
:class:`privkit.ClientLevelGaussian`:

1. **Sampling.** Each round every connected node takes part independently with probability
   ``q`` (``client_rate``), drawn from privkit's :class:`~privkit.SecureRandom` (a seed tree
   only when ``seed`` is given). The sampled set is drawn before anything is sent and may be
   empty.
2. **Charge first.** One release of ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` for the
   whole population (ledger id ``population``: add or remove one whole client) is charged on a
   privkit :class:`~privkit.ledger.Ledger` before the round's messages leave. A round that
   would take the population over ``max_epsilon`` (or the ledger's own budget) is not run:
   the wrapper sends nothing from then on and says so in the round metrics.
3. **Inner strategy configures.** The inner strategy's ``configure_train`` runs as usual (its
   own state, e.g. FedAdam's current model, FedProx's ``proximal-mu``); it must address every
   connected node (``fraction_train=1.0``), and only the messages of the sampled nodes are
   sent. A round in which the inner strategy sends nothing (Upcycled-FL's even rounds) is
   post-processing: nothing is charged and its ``aggregate_train`` runs as it would alone.
4. **Release.** Each reply's update (returned model minus the global model sent) is clipped
   to L2 norm ``C`` over all arrays, the clipped updates are summed in float64 and
   ``N(0, (z C)^2)`` is added once per coordinate (also when no client was sampled or none
   replied), and the sum is divided by the fixed expected count ``q N``. A reply that failed,
   came from a node not sampled, or has other array names, shapes or non-finite values
   contributes zero (that only ever removes one client's own contribution).
5. **Inner strategy aggregates.** The inner strategy's ``aggregate_train`` gets **one
   synthetic reply**: the model ``w + mean`` with weight 1 (``weighted_by_key``). A weighted
   average of one reply is that reply, so FedAvg returns ``w + mean``, and FedOpt strategies
   see ``delta_t = mean`` and apply their server optimiser (Adam, Adagrad, Yogi, momentum) to
   the privatised update, which is post-processing.

What it does not cover (limits): the clients' reply metrics are not released (they are raw
client data; the synthetic reply carries only its weight), and evaluation
(``configure_evaluate`` / ``aggregate_evaluate`` pass through to the inner strategy) is not
private. Strategies whose aggregate of a single reply is not that reply (Krum, Bulyan,
trimmed means that need several replies, FedXgb) do not fit this design. The guarantee
assumes a **trusted aggregator** (the server sees the clipped updates, adds the noise itself
and releases only the noisy sum; secure aggregation alone would show it the exact sum:
:data:`privkit.mechanisms.aggregate.TRUST_ASSUMPTION`) and Poisson sampling whose outcome
stays secret from everyone but the server: against the server, which drew the sample, a
client that took part in k rounds has the unamplified epsilon
(:meth:`ClientLevelDP.epsilon_unamplified`). Nothing the wrapper logs at INFO or puts in the
round metrics depends on who was sampled (an inner privkit strategy's ``privkit-clients``,
which would count the one synthetic reply, is dropped); which nodes were sampled, and which
replies counted as zero, are logged at DEBUG only, the trusted server's own records; the
one exception is a WARNING (once per reason) when every reply of a round counted as zero,
which says that some node was sampled that round and why nothing it sent was used (a
misconfiguration that would otherwise spend the budget on noise silently).
Flower's ``Strategy.start`` has no early exit, so after a budget stop the remaining rounds
run without training.

Variants:

- **Adaptive clipping** (``adaptive=privkit.AdaptiveClipping(...)``, Andrew et al. 2021): the
  clip norm follows a quantile of the update norms through a noisy, centred count computed on
  the same sample as the sum; the two are one release, charged once a round as
  :meth:`privkit.AdaptiveClipping.round_event` (joint noise multiplier).
- **Client-side clipping** (``clipping="client"``): each ClientApp clips its own update with
  :class:`~privkit.flower.ClientSideClippingMod` (the clip norm travels in the train config as
  ``privkit-client-clip-norm``), so the server never receives an unclipped update; the server
  still re-clips every reply (a client that skips the mod cannot exceed C), refuses a reply
  without the mod's confirmation (it counts as zero) and adds the noise. It assumes the same
  trusted aggregator for the noise; with secure aggregation beneath it the server would see
  only the exact sum of clipped updates, not the individual ones. Not combined with adaptive
  clipping (the count needs the unclipped norms).

The population: ``num_clients`` is the number of nodes the wrapper samples from and divides
by. More connected nodes than that is a one-line error before anything is charged; fewer, and
the wrapper says how long it waits (``node_timeout``, 30 s by default) before it gives up with
a one-line error.

Round metrics (``train_metrics_clientapp`` of Flower's ``Result``): ``privkit-epsilon`` (the
population's epsilon after the round at ``privkit-delta``), ``privkit-delta``,
``privkit-noise-multiplier``, ``privkit-l2-clip-norm`` (the round's, with adaptive clipping),
``privkit-client-rate``, and ``privkit-budget-stopped`` = 1 once training stopped.
:meth:`ClientLevelDP.report` is the privacy section of a run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from logging import DEBUG, INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

import privkit
from privkit import _validate
from privkit._rng import SecureRandom
from privkit.audit.canaries import CANARY_NOTE
from privkit.errors import InvalidParameterError
from privkit.events import NOISE_MULTIPLIER_NOTE
from privkit.flower import records as keys
from privkit.flower._server import (
    CLIENT_CLIP_KEY,
    CLIENT_CLIPPED_KEY,
    DEFAULT_DELTA,
    POPULATION,
    ServerSideDP,
    _Round,
)
from privkit.ledger import Ledger
from privkit.mechanisms.aggregate import (
    TRUST_ASSUMPTION,
    AdaptiveClipping,
    ClientLevelGaussian,
    unamplified_event,
)
from privkit.seeds import SeedTree

__all__ = ["ClientLevelDP", "POPULATION", "DEFAULT_DELTA", "CLIENT_CLIP_KEY",
           "CLIENT_CLIPPED_KEY", "CLIENT_SIDE_ASSUMPTION"]

#: Where the clipping happens.
CLIPPING = ("server", "client")
#: What client-side clipping assumes (every report of that variant states it).
CLIENT_SIDE_ASSUMPTION = (
    "client-side clipping: each ClientApp clips its own update to C before it leaves (the "
    "server re-clips every reply, so C holds even for a client that does not); the server "
    "adds the noise to the sum, so it is still trusted with the sum before noise")


class ClientLevelDP(ServerSideDP):
    """Client-level DP-FedAvg around any Flower message-API strategy (module docstring).

    Args:
        strategy: the inner strategy; it must address every connected node each training
            round (``fraction_train=1.0``); this wrapper does the sampling.
        num_clients: N, the population; the noisy sum is divided by ``q N``. The wrapper
            waits (at most ``node_timeout`` seconds) until N nodes are connected.
        client_rate: q in (0, 1], each node's Poisson probability of joining a round.
        l2_clip_norm: C > 0, the bound on one client's whole update (L2 over all arrays).
        noise_multiplier: z > 0; the sum gets N(0, (z C)^2) per coordinate.
        ledger: a privkit ledger (file-backed: it survives restarts and never resets; its
            relation must be add-or-remove-one); None: a new in-memory ledger at ``delta``.
        delta: delta of the reported epsilons (default 1e-5); with ``ledger`` it must be the
            ledger's.
        max_epsilon: stop before the round that would take the population's epsilon above
            this (the ledger's own ``epsilon_budget`` is enforced as well).
        seed: draw the sampling and the noise from this seed tree (streams
            ``poisson-clients`` and ``noise`` of the server round) for reproducible
            experiments only: whoever knows the seed can remove the noise. None (default):
            privkit's SecureRandom (OS entropy).
        run_id: recorded with every charge.
        node_timeout: seconds to wait for ``num_clients`` nodes to connect (stated in the log
            when the wrapper starts waiting).
        adaptive: adaptive clipping (:class:`privkit.AdaptiveClipping`, its
            ``sampling_probability`` equal to ``client_rate``); ``l2_clip_norm`` is the initial
            clip norm. Charged jointly with the sum.
        clipping: ``server`` (default: the server clips each update) or ``client`` (the
            ClientApps clip with :class:`~privkit.flower.ClientSideClippingMod`; module
            docstring).
        canaries: an audit's canary clients (:class:`privkit.audit.CanaryClients`): extra
            rows of the clipped-update stack before the noise, each included canary
            Poisson-sampled at ``client_rate``, scored from every released noisy sum
            (``canaries.canary_run(...)`` after the run). ``num_clients`` and the divisor
            ``q N`` are unchanged: the canaries are extra contributions, and
            :meth:`report` says they were there. Not with ``adaptive``.

    Raises:
        InvalidParameterError: a bad argument (named in the message).

    Examples:
        >>> from flwr.serverapp.strategy import FedAdam
        >>> dp = ClientLevelDP(FedAdam(), num_clients=100, client_rate=0.1,
        ...                    l2_clip_norm=1.0, noise_multiplier=1.0, max_epsilon=8.0)
        >>> dp.mechanism.event().sampling_probability, dp.expected_clients
        (0.1, 10.0)
    """

    _population_note = "the sample and the divisor q N must cover the same population"

    def __init__(self, strategy: Strategy, *, num_clients: int, client_rate: float,
                 l2_clip_norm: float, noise_multiplier: float, ledger: Ledger | None = None,
                 delta: float | None = None, max_epsilon: float | None = None,
                 seed: int | None = None, run_id: str = "flower",
                 node_timeout: float = 30.0, adaptive: AdaptiveClipping | None = None,
                 clipping: str = "server", canaries: Any = None) -> None:
        self._wrap(strategy)
        fraction = getattr(strategy, "fraction_train", 1.0)
        if fraction != 1.0:
            raise InvalidParameterError(
                "strategy", f"fraction_train={fraction!r}",
                "fraction_train=1.0 (ClientLevelDP samples the clients at client_rate)")
        self._no_own_privacy(strategy)
        self.strategy = strategy
        self.num_clients = _validate.positive_int("num_clients", num_clients)
        self.client_rate = _validate.probability("client_rate", client_rate)
        self.mechanism = ClientLevelGaussian(
            _validate.positive("l2_clip_norm", l2_clip_norm),
            _validate.positive("noise_multiplier", noise_multiplier), self.client_rate)
        self._common(max_epsilon=max_epsilon, seed=seed, run_id=run_id,
                     node_timeout=node_timeout)
        self.ledger = self._make_ledger(ledger, delta, f"flower-client-level|{run_id}")
        if clipping not in CLIPPING:
            raise InvalidParameterError("clipping", clipping, "server or client")
        self.clipping = clipping
        if adaptive is not None:
            if not isinstance(adaptive, AdaptiveClipping):
                raise InvalidParameterError("adaptive", adaptive, "a privkit.AdaptiveClipping")
            if float(adaptive.sampling_probability) != self.client_rate:
                raise InvalidParameterError(
                    "adaptive", f"sampling_probability={adaptive.sampling_probability}",
                    f"client_rate {self.client_rate:g} (the count and the sum share a sample)")
            if clipping == "client":
                raise InvalidParameterError("adaptive", adaptive, "None with clipping='client' "
                                            "(the count needs the unclipped update norms)")
        self.adaptive = adaptive
        self.clip_norm = float(self.mechanism.l2_clip_norm)  # the round's (adaptive: moves)
        self.canaries = _check_canaries(canaries)
        if canaries is not None and adaptive is not None:
            raise InvalidParameterError("canaries", "canary clients", "None with adaptive "
                                        "clipping (the scores need one clip norm)")

    # -- properties ----------------------------------------------------------------------
    @property
    def expected_clients(self) -> float:
        """q N, the fixed number the noisy sum is divided by."""
        return self.client_rate * self.num_clients

    @property
    def event(self) -> Any:
        """The event charged per training round (with adaptive clipping, the sum and the
        count released together: :meth:`privkit.AdaptiveClipping.round_event`)."""
        if self.adaptive is not None:
            return self.adaptive.round_event(self.mechanism)
        return self.mechanism.event()

    @property
    def effective_noise_multiplier(self) -> float:
        """The round's Gaussian noise multiplier (z, or z_eff with adaptive clipping)."""
        z = float(self.mechanism.noise_multiplier)
        return self.adaptive.joint_noise_multiplier(z) if self.adaptive is not None else z

    def epsilon_unamplified(self, rounds: int) -> float:
        """The epsilon of a client that took part in ``rounds`` rounds, without amplification:
        what holds against the server, which knows the sample."""
        if rounds == 0:
            return 0.0
        return float(privkit.epsilon(unamplified_event(self.effective_noise_multiplier, rounds),
                                     self.ledger.delta).epsilon)

    def charged_rounds(self) -> int:
        """Training rounds charged on the ledger so far."""
        return int(sum(n for _, n in self.ledger.composition(POPULATION).atoms))

    def _metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "privkit-epsilon": self.epsilon(), "privkit-delta": float(self.ledger.delta),
            "privkit-noise-multiplier": float(self.mechanism.noise_multiplier),
            "privkit-l2-clip-norm": self.clip_norm,
            "privkit-client-rate": self.client_rate}
        if self.stopped is not None:
            out["privkit-budget-stopped"] = 1
        return out

    # -- train ---------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Check the budget, let the inner strategy configure, sample, charge, send."""
        self._round, self._skipped = None, None
        if self.stopped is not None:
            return []
        event = self.event
        if self._over_budget(server_round, event):
            return []
        nodes = self._nodes(grid)
        with self._inner_counts_hidden():  # the inner cohort is a proposal
            messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if not messages:  # the inner strategy trains nobody: post-processing, free
            self._skipped = server_round
            return []
        by_node = self._by_node(messages)
        missing = sorted(set(nodes) - set(by_node))
        if missing:
            raise RuntimeError(
                f"the inner strategy sent no train message to {len(missing)} of {len(nodes)} "
                "nodes: it must address every node (fraction_train=1.0; ClientLevelDP samples)")
        # each node's coin is its own: fresh OS entropy, or (seeded) keyed by the node id, so
        # an added node never moves another's coin (the add/remove coupling)
        u = np.asarray(SecureRandom().uniform(len(nodes)) if self.seed is None else
                       SeedTree(self.seed).uniforms(server_round, "poisson-clients",
                                                    nodes)[:, 0])
        sampled = [nid for nid, x in zip(nodes, u) if x < self.client_rate]
        # write-ahead: the ledger knows before any node does
        if not self._charge(server_round, event, "client-level DP-FedAvg sum"):
            return []
        if self.clipping == "client":
            for nid in sampled:
                _set_config(by_node[nid], CLIENT_CLIP_KEY, self.clip_norm)
        self._round = _Round(server_round, arrays, frozenset(sampled), messages[0])
        # the sample is secret: INFO says nothing about it (DEBUG: the server's own record)
        log(INFO, "ClientLevelDP: round %d charged (q=%g of %d nodes), epsilon %.4g at "
            "delta %g", server_round, self.client_rate, len(nodes), self.epsilon(),
            self.ledger.delta)
        log(DEBUG, "ClientLevelDP: round %d sampled nodes %s", server_round, sorted(sampled))
        return [by_node[nid] for nid in sampled]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip, sum, noise once, divide by q N; the inner strategy aggregates the result."""
        replies = list(replies)
        sent = self._round if self._round is not None and \
            self._round.server_round == server_round else None
        if sent is None:
            if self._skipped == server_round:  # the inner strategy's own server-only step
                arrays, metrics = self.strategy.aggregate_train(server_round, replies)
                return arrays, MetricRecord(dict(metrics or {}) | self._metrics())
            return None, MetricRecord(self._metrics())
        updates = self._updates(replies, sent)
        rng = self._rng(server_round, "noise")
        mech = dataclasses.replace(self.mechanism, l2_clip_norm=self.clip_norm)
        if self.adaptive is not None:  # the count, on the same sample: charged with the sum
            k = next(iter(updates.values())).shape[0]
            norms = np.sqrt(sum((v.reshape(k, -1) ** 2).sum(1) for v in updates.values())) \
                if k else np.zeros(0)
            self.clip_norm = self.adaptive.update(self.clip_norm, norms,
                                                  expected_clients=self.expected_clients,
                                                  rng=rng)
        release = self.charged_rounds() - 1 if self.canaries is not None else -1
        if self.canaries is not None:  # extra rows before the noise (an audit's canaries)
            updates = self.canaries.insert(updates, release=release, mechanism=mech)
        noisy = mech(updates, rng=rng)
        if self.canaries is not None:
            self.canaries.observe(noisy, release=release, mechanism=mech)
        mean = ClientLevelGaussian.mean(noisy, self.expected_clients)
        # the inner strategy counted one reply (the synthetic one): no real client count
        arrays, inner = self._aggregate_mean(server_round, sent, mean)
        log(INFO, "ClientLevelDP: round %d released the noisy sum over q N = %.4g (the "
            "replies' count stays with the server)", server_round, self.expected_clients)
        return arrays, MetricRecord(inner | self._metrics())

    # -- the run's privacy section ----------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """The privacy section of a run: the population's epsilon, what it assumes (trust,
        sampling, relation), the unamplified epsilon against the server, what is public."""
        rounds = self.charged_rounds()
        k = max(1, math.ceil(self.client_rate * rounds)) if rounds else 0
        m = self.mechanism
        out: dict[str, Any] = {
            "mechanism": "client-level DP-FedAvg (privkit.flower.ClientLevelDP)",
            "privacy_unit": "client", "epsilon": self.epsilon(),
            "delta": float(self.ledger.delta), "charged_rounds": rounds,
            "neighboring_relation": "add_or_remove_one client",
            "epsilon_replace_one": self.epsilon_replace_one(),
            "noise_multiplier_note": NOISE_MULTIPLIER_NOTE,
            "epsilon_unamplified": {
                "expected_participations": k, "epsilon_at_expected":
                self.epsilon_unamplified(k), "every_round": rounds,
                "epsilon_every_round": self.epsilon_unamplified(rounds),
                "note": "against the server, which knows the sample: a client in k rounds, "
                        "no amplification"},
            "noise_multiplier": float(m.noise_multiplier),
            "l2_clip_norm": float(m.l2_clip_norm), "client_rate": self.client_rate,
            "num_clients": self.num_clients, "expected_clients": self.expected_clients,
            "clipping": self.clipping, "trust": TRUST_ASSUMPTION,
            "assumptions": [TRUST_ASSUMPTION, "Poisson client sampling whose outcome stays "
                            "secret from everyone but the server"]
            + ([CLIENT_SIDE_ASSUMPTION] if self.clipping == "client" else []),
            "randomness": {"source": "os_csprng" if self.seed is None else "seed",
                           "note": "client sampling and noise from privkit's SecureRandom"
                           if self.seed is None else "seeded: a simulation; whoever knows "
                           "the seed can regenerate the noise"},
            "public": [f"N = {self.num_clients}", f"q = {self.client_rate:g} and the divisor "
                       f"q N = {self.expected_clients:g}", "the number of rounds"]}
        if self.adaptive is not None:
            out["adaptive_clipping"] = {
                "target_quantile": self.adaptive.target_quantile,
                "count_stddev": self.adaptive.count_stddev,
                "joint_noise_multiplier": self.effective_noise_multiplier,
                "final_clip_norm": self.clip_norm}
        if self.canaries is not None:
            out["canaries"] = self.canaries.describe()
            out["assumptions"].append(CANARY_NOTE)
        if self.stopped is not None:
            out["stopped"] = self.stopped
        return out

    def summary(self) -> None:
        """Log the DP settings, then the inner strategy's."""
        m = self.mechanism
        log(INFO, "\t├──> privkit client-level DP: q=%g of N=%d (expected %.4g), C=%g, z=%g, "
            "noise stddev of the mean %.4g, delta %g, max_epsilon %s, noise %s",
            self.client_rate, self.num_clients, self.expected_clients, m.l2_clip_norm,
            m.noise_multiplier, m.stddev / self.expected_clients, self.ledger.delta,
            "none" if self.max_epsilon is None else f"{self.max_epsilon:g}",
            "SecureRandom" if self.seed is None else f"seed {self.seed} (NOT secure)")
        log(INFO, "\t│\t└── assumes: %s", TRUST_ASSUMPTION)
        self.strategy.summary()

    def __repr__(self) -> str:
        m = self.mechanism
        return (f"ClientLevelDP({type(self.strategy).__name__}, num_clients={self.num_clients},"
                f" client_rate={self.client_rate:g}, l2_clip_norm={m.l2_clip_norm:g}, "
                f"noise_multiplier={m.noise_multiplier:g})")


def _check_canaries(canaries: Any) -> Any:
    """``canaries``, checked: :class:`privkit.audit.CanaryClients` or None."""
    if canaries is None:
        return None
    from privkit.audit.canaries import CanaryClients

    if not isinstance(canaries, CanaryClients):
        raise InvalidParameterError("canaries", type(canaries).__name__,
                                    "a privkit.audit.CanaryClients or None")
    return canaries


def _set_config(msg: Message, key: str, value: Any) -> None:
    """Add ``key: value`` to a train message's config (its single ConfigRecord)."""
    records = msg.content.config_records
    if not records:
        msg.content[keys.CONFIG] = ConfigRecord({key: value})
        return
    next(iter(records.values()))[key] = value
