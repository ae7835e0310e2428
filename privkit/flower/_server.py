"""What privkit's server-side DP strategy wrappers share (``ClientLevelDP``,
``BandedClientLevelDP``).

Both wrap a Flower message-API strategy, clip each reply's update on the server, add noise to
the sum, divide by a fixed public number and hand the inner strategy one synthetic reply
(the noisy model). :class:`ServerSideDP` holds the parts that do not depend on how clients
are chosen or how the noise is drawn: checking the inner strategy, the ledger (one id,
``population``, add or remove one client), the budget stop, the connected population, the
seed tree or SecureRandom, turning replies into clipped-ready updates, the synthetic reply,
and evaluation passed through.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from logging import DEBUG, INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

import privkit
from privkit import _validate
from privkit._rng import SecureRandom
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import BudgetExceededError, InvalidParameterError
from privkit.flower import records as keys
from privkit.ledger import Ledger
from privkit.seeds import SeedTree

__all__ = ["POPULATION", "DEFAULT_DELTA", "CLIENT_CLIP_KEY", "CLIENT_CLIPPED_KEY",
           "ServerSideDP"]

#: The ledger id charged every round: client-level DP gives every client the population's
#: guarantee.
POPULATION = "population"
#: delta of the ledger a wrapper creates when none is given.
DEFAULT_DELTA = 1e-5
#: The train config key that carries the clip norm to :class:`ClientSideClippingMod`.
CLIENT_CLIP_KEY = "privkit-client-clip-norm"
#: The reply metric by which :class:`ClientSideClippingMod` confirms it clipped the update.
CLIENT_CLIPPED_KEY = "privkit-client-clipped"


@dataclass(frozen=True)
class _Round:
    """A charged round: the global model sent, the nodes whose replies count, a message to
    reply to."""

    server_round: int
    arrays: ArrayRecord
    sampled: frozenset[int]
    template: Message


class ServerSideDP(Strategy):
    """Base of privkit's server-side client-level DP wrappers (not used on its own).

    Subclasses call :meth:`_wrap`, :meth:`_common` and :meth:`_make_ledger` from their
    constructor, then use the helpers below in ``configure_train`` / ``aggregate_train``.
    """

    #: How the population note of :meth:`_nodes` reads (what the divisor is).
    _population_note = "the population and the divisor must be the same"
    #: ``server`` or ``client`` (client-side clipping: :class:`ClientLevelDP` only).
    clipping = "server"
    clip_norm: float
    strategy: Strategy
    num_clients: int
    ledger: Ledger

    # -- construction ----------------------------------------------------------------------
    def _wrap(self, strategy: Any) -> None:
        """Check the inner strategy: a Flower strategy, not wrapped, without privacy."""
        if not isinstance(strategy, Strategy):
            raise InvalidParameterError("strategy", strategy,
                                        "a Flower strategy (flwr.serverapp.strategy.Strategy)")
        if isinstance(strategy, ServerSideDP):
            raise InvalidParameterError("strategy", strategy, "a strategy not already wrapped")

    def _no_own_privacy(self, strategy: Strategy) -> None:
        if getattr(strategy, "accountant", None) is not None:
            name = type(self).__name__
            raise InvalidParameterError("strategy", "a strategy with its own privacy settings",
                                        f"a strategy without privacy ({name} charges)")

    def _common(self, *, max_epsilon: Any, seed: Any, run_id: Any, node_timeout: Any) -> None:
        self.max_epsilon = None if max_epsilon is None else _validate.positive(
            "max_epsilon", max_epsilon)
        self.seed = None if seed is None else _validate.nonnegative_int("seed", seed)
        if not (isinstance(run_id, str) and run_id):
            raise InvalidParameterError("run_id", run_id, "a non-empty string")
        self.run_id = run_id
        self.node_timeout = _validate.positive("node_timeout", node_timeout)
        self.stopped: str | None = None  # why training stopped (privacy budget, rounds)
        self._round: _Round | None = None
        self._skipped: int | None = None  # a round the inner strategy sent nothing in

    #: The relation the wrapper's schedule satisfies, which its ledger prices under.
    neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE
    #: Why the schedule satisfies it (the refusal of another ledger says so).
    _relation_why = "client-level DP adds or removes a client"

    def _make_ledger(self, ledger: Any, delta: Any, population_id: str) -> Ledger:
        """The given ledger (checked), or a new in-memory one at ``delta``, under
        :attr:`neighboring_relation`."""
        rel = self.neighboring_relation
        if ledger is None:
            d = DEFAULT_DELTA if delta is None else _validate.delta("delta", delta)
            ledger = Ledger.create(None, population_id=population_id, delta=d,
                                   neighboring_relation=rel)
        elif not isinstance(ledger, Ledger):
            raise InvalidParameterError("ledger", ledger, "a privkit Ledger")
        elif delta is not None and _validate.delta("delta", delta) != ledger.delta:
            raise InvalidParameterError("delta", delta, f"the ledger's delta {ledger.delta:g}")
        if ledger.neighboring_relation != rel:
            raise InvalidParameterError(
                "ledger", ledger.neighboring_relation.name,
                f"a ledger for {rel.name} ({self._relation_why})")
        return ledger

    def epsilon_replace_one(self) -> float:
        """The population's epsilon with the same charges priced under replace-one (one
        client's data replaced by another's: the sensitivity doubled), at the ledger's
        delta; the trainers report it beside their headline too."""
        atoms = [privkit.SelfComposedDpEvent(a, n)
                 for a, n in self.ledger.composition(POPULATION).atoms]
        if not atoms:
            return 0.0
        return float(privkit.epsilon(privkit.ComposedDpEvent(atoms), self.ledger.delta,
                                     self.ledger.method,
                                     neighboring_relation=NeighboringRelation.REPLACE_ONE))

    # -- the budget ------------------------------------------------------------------------
    def epsilon(self) -> float:
        """The population's epsilon so far, at the ledger's delta."""
        return float(self.ledger.epsilons([POPULATION])[POPULATION])

    def _epsilon_after(self, event: Any) -> float:
        """The population's epsilon if ``event`` were charged once more (nothing changes)."""
        atoms = [privkit.SelfComposedDpEvent(a, n)
                 for a, n in self.ledger.composition(POPULATION).atoms]
        return float(privkit.epsilon(privkit.ComposedDpEvent(atoms + [event]),
                                     self.ledger.delta, self.ledger.method,
                                     neighboring_relation=self.ledger.neighboring_relation))

    def _stop(self, server_round: int, why: str) -> None:
        self.stopped = f"stopped before server round {server_round}: {why}"
        log(WARNING, "%s", self.stopped)

    def _over_budget(self, server_round: int, event: Any) -> bool:
        """Whether one more ``event`` would exceed ``max_epsilon`` or the ledger's budget;
        if so, training stops (said once, in the log and in :attr:`stopped`)."""
        over = bool(self.ledger.would_exceed([POPULATION], event)[0])
        eps_next = self._epsilon_after(event) if self.max_epsilon is not None else None
        if over or (eps_next is not None and eps_next > self.max_epsilon):  # type: ignore[operator]
            limit = (f"max_epsilon={self.max_epsilon:g}" if not over
                     else f"the ledger's epsilon_budget={self.ledger.epsilon_budget:g}")
            self._stop(server_round, f"one more round would exceed {limit} at delta "
                       f"{self.ledger.delta:g} (epsilon now {self.epsilon():.6g})")
            return True
        return False

    def _charge(self, server_round: int, event: Any, label: str) -> bool:
        """Write-ahead: charge ``event`` before any node hears of the round. False (and
        training stops) if the ledger refuses."""
        try:
            self.ledger.spend([POPULATION], event, label=label, round=int(server_round),
                              run_id=self.run_id)
        except BudgetExceededError as exc:
            self._stop(server_round, str(exc))
            return False
        return True

    # -- the round ------------------------------------------------------------------------
    def _rng(self, server_round: int, stream: str) -> Any:
        if self.seed is None:
            return SecureRandom()
        return SeedTree(self.seed).numpy(server_round, stream)

    def _nodes(self, grid: Grid) -> list[int]:
        """The connected nodes: exactly ``num_clients`` of them (the population the mean
        divides by). More is an error at once; fewer, a stated, bounded wait."""
        name, n = type(self).__name__, self.num_clients
        nodes = sorted(grid.get_node_ids())
        if len(nodes) < n:
            log(INFO, "%s: %d of num_clients=%d nodes connected; waiting up to %g s for the "
                "rest", name, len(nodes), n, self.node_timeout)
            deadline = time.monotonic() + self.node_timeout
            while len(nodes := sorted(grid.get_node_ids())) < n:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{name}: only {len(nodes)} of num_clients={n} nodes connected within "
                        f"{self.node_timeout:g} s (node_timeout); start the missing SuperNodes"
                        " or lower num_clients")
                time.sleep(0.5)
        if len(nodes) > n:
            raise RuntimeError(
                f"{name}: {len(nodes)} nodes connected but num_clients={n}: "
                f"{self._population_note}; set num_clients={len(nodes)} (nothing was charged)")
        return nodes

    @staticmethod
    def _by_node(messages: list[Message]) -> dict[int, Message]:
        """The inner strategy's train messages by destination node (one each)."""
        by_node: dict[int, Message] = {}
        for m in messages:
            nid = m.metadata.dst_node_id
            if nid in by_node:
                raise RuntimeError(f"the inner strategy sent node {nid} two train messages")
            by_node[nid] = m
        return by_node

    def _updates(self, replies: list[Message], sent: _Round) -> dict[str, np.ndarray]:
        """Each usable reply's update (float64) stacked on a leading client axis. A reply
        that failed, came from a node whose reply does not count, or has other array names,
        shapes or non-finite values contributes zero (it is left out)."""
        name = type(self).__name__
        glob = keys.from_record(sent.arrays)
        key = getattr(self.strategy, "arrayrecord_key", keys.ARRAYS)
        rows: list[dict[str, np.ndarray]] = []
        seen: set[int] = set()
        first_error: str | None = None
        for msg in replies:
            src = msg.metadata.src_node_id
            if msg.has_error():
                log(DEBUG, "%s: node %d replied with an error: %s", name, src,
                    msg.error.reason)
                first_error = first_error or str(msg.error.reason)
                continue
            if src not in sent.sampled or src in seen:
                log(DEBUG, "%s: ignoring a reply from node %d (not sent a train message, or "
                    "a second reply)", name, src)
                continue
            seen.add(src)
            if self.clipping == "client" and not _confirmed_clip(msg, self.clip_norm):
                log(DEBUG, "%s: node %d did not confirm client-side clipping to %g; its "
                    "update counts as zero", name, src, self.clip_norm)
                continue
            records = msg.content.array_records
            record = records.get(key) if key in records else (
                next(iter(records.values())) if len(records) == 1 else None)
            try:
                if record is None:
                    raise InvalidParameterError("arrays", list(records),
                                                f"one ArrayRecord ({key!r})")
                got = keys.from_record(record)
            except InvalidParameterError as exc:
                log(DEBUG, "%s: node %d's reply counts as zero: %s", name, src, exc)
                continue
            if list(got) != list(glob) or any(got[k].shape != glob[k].shape for k in glob):
                log(DEBUG, "%s: node %d's arrays differ from the global model's; its update "
                    "counts as zero", name, src)
                continue
            row = {k: got[k].astype(np.float64) - glob[k].astype(np.float64) for k in glob}
            if not all(np.isfinite(v).all() for v in row.values()):
                log(DEBUG, "%s: node %d's update is not finite; it counts as zero", name, src)
                continue
            rows.append(row)
        if replies and not rows:
            self._warn_all_zero(sent.server_round, first_error)
        return {k: (np.stack([r[k] for r in rows]) if rows
                    else np.zeros((0,) + v.shape, np.float64)) for k, v in glob.items()}

    def _warn_all_zero(self, server_round: int, first_error: str | None) -> None:
        """A round whose every reply counted as zero released noise only: say it once per
        reason at WARNING (a misconfiguration, such as ClientSideClippingMod on the clients
        while the wrapper clips on the server, would otherwise spend the budget on noise
        silently). It tells the server's log that some node was sampled that round, nothing
        about which (the trusted server knows that anyway); later rounds go to DEBUG."""
        why = (f"the first error: {first_error}" if first_error is not None else
               "no reply had a usable update (other arrays, non-finite values, or no "
               "client-side clipping confirmation)")
        warned = self.__dict__.setdefault("_warned_all_zero", set())
        level = DEBUG if why in warned else WARNING
        warned.add(why)
        log(level, "%s: round %d: every reply counted as zero, so the round released noise "
            "only (and was charged); %s. If every round looks like this, check the ClientApp "
            "(e.g. clipping='client' with ClientSideClippingMod, or the mod without the "
            "wrapper's clipping='client')", type(self).__name__, server_round, why)

    @staticmethod
    @contextlib.contextmanager
    def _inner_counts_hidden() -> Iterator[None]:
        """Hide the inner strategy's node-count lines while it configures or aggregates
        training for the wrapper: its "Sampled 20 nodes" is the cohort it proposed (the
        wrapper sends to a sample of it) and its "Received 1 results" is the wrapper's one
        synthetic reply; the wrapper logs what it really sent and released."""
        logger = logging.getLogger("flwr")
        hide = _InnerCounts()
        logger.addFilter(hide)
        try:
            yield
        finally:
            logger.removeFilter(hide)

    def _aggregate_mean(self, server_round: int, sent: _Round, mean: dict[str, np.ndarray]
                        ) -> tuple[ArrayRecord | None, dict[str, Any]]:
        """The inner strategy's ``aggregate_train`` of one synthetic reply, the model
        ``w + mean`` with weight 1; its metrics without a client count (it counted one)."""
        strategy = self.strategy
        glob = keys.from_record(sent.arrays)
        new = {k: (v.astype(np.float64) + mean[k]).astype(v.dtype) for k, v in glob.items()}
        weight_key = getattr(strategy, "weighted_by_key", keys.NUM_EXAMPLES)
        content = RecordDict({getattr(strategy, "arrayrecord_key", keys.ARRAYS):
                              keys.to_record(new),
                              keys.METRICS: MetricRecord({weight_key: 1})})
        synthetic = Message(content, reply_to=sent.template)
        with self._inner_counts_hidden():
            arrays, metrics = strategy.aggregate_train(server_round, [synthetic])
        return arrays, {k: v for k, v in dict(metrics or {}).items() if k != keys.CLIENTS}

    # -- evaluate (not private: passed through) ---------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """The inner strategy's evaluation (its metrics are not covered by the guarantee)."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        """The inner strategy's aggregation of evaluation replies."""
        return self.strategy.aggregate_evaluate(server_round, replies)


class _InnerCounts(logging.Filter):
    """Drops Flower strategies' INFO lines ``configure_train: Sampled N nodes (out of M)``
    and ``aggregate_train: Received N results and F failures`` (evaluation lines pass)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != INFO:
            return True
        text = record.getMessage()
        return not (text.startswith("configure_train: Sampled ")
                    or text.startswith("aggregate_train: Received "))


def _confirmed_clip(msg: Message, clip: float) -> bool:
    """Whether a reply carries :class:`ClientSideClippingMod`'s confirmation for ``clip``."""
    metrics = list(msg.content.metric_records.values())
    return len(metrics) == 1 and metrics[0].get(CLIENT_CLIPPED_KEY) == clip
