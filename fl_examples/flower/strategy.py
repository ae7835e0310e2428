"""Flower strategies for privkit's FedProx and Upcycled-FL (``flwr.serverapp.strategy`` API).

:class:`PrivkitFedProx` is Flower's :class:`~flwr.serverapp.strategy.FedProx` with privkit's
round machinery: which clients train, and for how many epochs, come from the
:class:`~fl_examples.core.seeds.SeedTree` of ``seed`` (streams ``clients`` and ``stragglers`` of
the data round, never Python's global ``random``), the server averages with
p_i = |D_i| / sum_{j in S} |D_j| over the clients that replied (spec ``upcycled_fl.md``
section 2), and an optional privkit ledger charges every client sent work.

:class:`UpcycledFedProx` adds Upcycled-FL's even step (Algorithm 2): server round t is the
algorithm's iteration t; odd rounds are FedProx rounds (data round (t + 1) / 2), even rounds
send no train message and set ``w^t = w^{t-1} + c_m (w^{t-1} - w^{t-2})`` from the global
model the strategy kept from before the odd round. Even rounds charge nothing (Lemma 5.1).

Clients are found once, before the first round, by a ``query`` message to every node: each
answers its client index (``partition-id``) and |D_i| (:func:`fl_examples.flower.client.
roster_reply`). With the same seed, data and settings, a run matches
:func:`fl_examples.upcycled.run_algorithm` up to float rounding (see ``docs/flower.md``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, cast

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedProx
from flwr.supercore import log

from fl_examples.core.privacy import BudgetStop
from fl_examples.core.rounds import aggregate, sample_clients, straggler_epochs
from fl_examples.core.seeds import SeedTree
from fl_examples.flower.client import BATCH_ORDERS
from fl_examples.flower.privacy import ServerAccountant
from fl_examples.upcycled import UpcycledConfig, extrapolation
from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.flower import records as keys
from privkit.flower.settings import PrivacySettings
from privkit.ledger import Ledger

__all__ = ["PrivkitFedProx", "UpcycledFedProx"]


@dataclass(frozen=True)
class _Sent:
    """What a data round sent: its clients (sorted) and the model they got."""

    server_round: int
    clients: tuple[int, ...]
    arrays: ArrayRecord


class PrivkitFedProx(FedProx):
    """FedProx with seed-tree client sampling, |D_i| weighting and a privkit ledger.

    Args:
        num_clients: N, the clients (nodes) of the federation; client ids are 0..N-1.
        proximal_mu: FedProx mu >= 0 (0: FedAvg's local solver, stragglers kept).
        fraction_train: share of clients per data round; max(int(fraction * N), 1) train.
        stragglers: share of the sampled clients that run int(U * E) epochs, in [0, 1).
        local_epochs: the clients' local epochs E (sent to them, like the next three).
        batch_size: the clients' minibatch size.
        lr: the clients' learning rate.
        momentum: the clients' SGD momentum.
        seed: root of the seed tree (client subsets, stragglers, batch orders).
        privacy: the mechanism of a private run (clients need the matching mod).
        ledger: the privkit ledger to charge (required with ``privacy``).
        batch_order: ``joint`` (clients redraw the simulator's joint batch order: exact
            equivalence; clients learn the selected clients' sizes) or ``per-client``.
        fraction_evaluate: share of nodes asked to evaluate each round (0 turns it off).
        train_action: the ClientApp train function to call (message type ``train`` for
            ``default``, else ``train.<action>``), e.g. one registered with a privacy mod.
        roster_timeout: seconds to wait for all N nodes to connect and answer the roster query.
    """

    def __init__(self, num_clients: int, *, proximal_mu: float = 0.0,
                 fraction_train: float = 1.0, stragglers: float = 0.0, local_epochs: int = 20,
                 batch_size: int = 32, lr: float = 0.05, momentum: float = 0.5, seed: int = 0,
                 privacy: PrivacySettings | None = None, ledger: Ledger | None = None,
                 batch_order: str = "joint", fraction_evaluate: float = 1.0,
                 train_action: str = "default", roster_timeout: float = 600.0) -> None:
        n = _validate.positive_int("num_clients", num_clients)
        _validate.nonnegative("proximal_mu", proximal_mu)
        _validate.probability("fraction_train", fraction_train)
        s = _validate.real("stragglers", stragglers)
        if not 0 <= s < 1:
            raise InvalidParameterError("stragglers", stragglers, "in [0, 1)")
        _validate.positive_int("local_epochs", local_epochs)
        _validate.positive_int("batch_size", batch_size)
        _validate.positive("lr", lr)
        if not 0 <= _validate.real("momentum", momentum) < 1:
            raise InvalidParameterError("momentum", momentum, "in [0, 1)")
        fe = _validate.real("fraction_evaluate", fraction_evaluate)
        if not 0 <= fe <= 1:
            raise InvalidParameterError("fraction_evaluate", fraction_evaluate, "in [0, 1]")
        if batch_order not in BATCH_ORDERS:
            raise InvalidParameterError("batch_order", batch_order, "joint or per-client")
        if not (isinstance(train_action, str) and train_action.isidentifier()):
            raise InvalidParameterError("train_action", train_action, "a Python identifier")
        if (privacy is None) != (ledger is None):
            raise InvalidParameterError("ledger", ledger, "given exactly when privacy is")
        super().__init__(fraction_train=fraction_train, fraction_evaluate=fe,
                         min_train_nodes=1, min_evaluate_nodes=1 if fe > 0 else 0,
                         min_available_nodes=n, proximal_mu=float(proximal_mu))
        self.num_clients = n
        self.stragglers, self.local_epochs = s, int(local_epochs)
        self.batch_size, self.lr, self.momentum = int(batch_size), float(lr), float(momentum)
        self.tree = SeedTree(seed)
        self.batch_order = batch_order
        self.train_type = MessageType.TRAIN if train_action == "default" \
            else f"{MessageType.TRAIN}.{train_action}"
        self.roster_timeout = _validate.positive("roster_timeout", roster_timeout)
        self.accountant = None if privacy is None else ServerAccountant(privacy, ledger)  # type: ignore[arg-type]
        self.nodes: list[int] = []  # node id of client i
        self.sizes: list[int] = []  # |D_i|
        self.stopped: str | None = None  # why training stopped (privacy budget)
        self._sent: _Sent | None = None

    def data_round(self, server_round: int) -> int:
        """The data round (k-th round that touches client data) of a server round."""
        return server_round

    # -- roster ------------------------------------------------------------------------------
    def _ensure_roster(self, grid: Grid) -> None:
        if self.nodes:
            return
        deadline = time.monotonic() + self.roster_timeout
        while len(node_ids := sorted(grid.get_node_ids())) < self.num_clients:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(node_ids)} of {self.num_clients} nodes connected "
                                   f"within {self.roster_timeout:g} s")
            log(INFO, "Waiting for nodes: %d of %d connected", len(node_ids), self.num_clients)
            time.sleep(1.0)
        query = RecordDict({keys.CONFIG: ConfigRecord({keys.QUERY: keys.ROSTER})})
        replies = grid.send_and_receive(
            [Message(content=query, dst_node_id=nid, message_type=MessageType.QUERY)
             for nid in node_ids], timeout=self.roster_timeout)
        nodes: dict[int, tuple[int, int]] = {}
        for reply in replies:
            if reply.has_error():
                raise RuntimeError(f"node {reply.metadata.src_node_id} failed the roster query: "
                                   f"{reply.error.reason}")
            m = next(iter(reply.content.metric_records.values()))
            cid, size = int(cast(int, m[keys.PARTITION_ID])), int(cast(int, m[keys.NUM_EXAMPLES]))
            if not 0 <= cid < self.num_clients or cid in nodes:
                raise RuntimeError(f"node {reply.metadata.src_node_id} answered partition-id "
                                   f"{cid}: ids must be distinct and in [0, {self.num_clients})")
            nodes[cid] = (reply.metadata.src_node_id, size)
        if sorted(nodes) != list(range(self.num_clients)):
            missing = sorted(set(range(self.num_clients)) - set(nodes))
            raise RuntimeError(f"no node answered for client(s) {missing[:10]}")
        self.nodes = [nodes[c][0] for c in range(self.num_clients)]
        self.sizes = [nodes[c][1] for c in range(self.num_clients)]
        if self.accountant is not None:
            self.accountant.bind(self.sizes, proximal_mu=self.proximal_mu,
                                 batch_size=self.batch_size, momentum=self.momentum)
        log(INFO, "Roster: %d clients, |D_i| from %d to %d", self.num_clients, min(self.sizes),
            max(self.sizes))

    # -- train -------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample the data round's clients from the seed tree, charge them, send them work."""
        self._ensure_roster(grid)
        self._sent = None
        if self.stopped is not None or self.fraction_train == 0.0:
            return []
        r = self.data_round(server_round)
        sel = sample_clients(self.tree, r, self.num_clients, self.fraction_train)
        epochs, _ = straggler_epochs(self.tree, r, len(sel), self.stragglers, self.local_epochs)
        clients = [int(c) for c in sel]
        if self.accountant is not None:
            try:  # write-ahead: the ledger knows before any client does
                self.accountant.charge(clients, server_round=server_round,
                                       leaf_sizes=_leaf_sizes(arrays))
            except BudgetStop as stop:
                self.stopped = f"stopped before server round {server_round}: {stop}"
                log(WARNING, "%s", self.stopped)
                return []
        shared: dict[str, Any] = dict(config) | {
            keys.SERVER_ROUND: server_round, keys.PROXIMAL_MU: self.proximal_mu,
            keys.LR: self.lr, keys.BATCH_SIZE: self.batch_size, keys.MOMENTUM: self.momentum,
            keys.SEED: self.tree.seed, keys.DATA_ROUND: r, keys.BATCH_ORDER: self.batch_order}
        if self.batch_order == "joint":
            shared |= {keys.SELECTED: clients,
                       keys.SELECTED_SIZES: [self.sizes[c] for c in clients],
                       keys.SELECTED_EPOCHS: [int(e) for e in epochs]}
        if self.accountant is not None:
            shared |= self.accountant.settings.to_config()
        messages = []
        for c, e in zip(clients, epochs):
            own = ConfigRecord(shared | {keys.CLIENT: c, keys.CLIENT_SIZE: self.sizes[c],
                                         keys.LOCAL_EPOCHS: int(e)})
            content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: own})
            messages.append(Message(content=content, message_type=self.train_type,
                                    dst_node_id=self.nodes[c]))
        self._sent = _Sent(server_round, tuple(clients), arrays)
        log(INFO, "configure_train: data round %d, %d clients", r, len(clients))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the replies of this round's clients with weights |D_i| (float64 weights)."""
        valid, _ = self._check_and_log_replies(list(replies), is_train=True)
        sent = self._sent if self._sent is not None and \
            self._sent.server_round == server_round else None
        extra = self._privacy_metrics()
        if sent is None or not valid:
            return None, (MetricRecord(extra) if extra else None)
        client_of = {self.nodes[c]: c for c in sent.clients}
        names = list(sent.arrays.keys())
        global_model = keys.from_record(sent.arrays)
        got: dict[int, dict[str, np.ndarray]] = {}
        bits = 0
        for msg in valid:
            c = client_of.get(msg.metadata.src_node_id)
            if c is None or c in got:
                log(WARNING, "ignoring a reply from node %d: not sent work this round",
                    msg.metadata.src_node_id)
                continue
            record = next(iter(msg.content.array_records.values()))
            if self._is_rec:
                decoded = self._decode_rec(c, record, global_model)
                if decoded is None:
                    continue
                arrays, size = decoded
                bits += size
            else:
                if not self._echo_ok(c, msg):
                    continue
                arrays = keys.from_record(record)
            if list(arrays) != names or any(
                    arrays[k].shape != global_model[k].shape for k in names):
                log(WARNING, "ignoring client %d: arrays differ from the global model's", c)
                continue
            got[c] = arrays
        if not got:
            return None, (MetricRecord(extra) if extra else None)
        clients = sorted(got)
        stacked = {k: torch.from_numpy(np.stack([got[c][k] for c in clients])) for k in names}
        weights = torch.tensor([float(self.sizes[c]) for c in clients], dtype=torch.float64)
        new = aggregate(stacked, weights)
        metrics = self.train_metrics_aggr_fn(
            [_without_privkit_keys(m.content) for m in valid
             if client_of.get(m.metadata.src_node_id) in got], self.weighted_by_key)
        metrics[keys.CLIENTS] = len(clients)
        if self._is_rec:
            metrics[keys.UPLINK_BITS] = bits
        for k, v in extra.items():
            metrics[k] = v
        return keys.to_record(new), metrics

    @property
    def _is_rec(self) -> bool:
        return self.accountant is not None and self.accountant.settings.kind == "rec"

    def _decode_rec(self, client: int, record: ArrayRecord, global_model: dict[str, np.ndarray]
                    ) -> tuple[dict[str, np.ndarray], int] | None:
        """A DP-REC reply -> (w_bar + decoded update, message bits), or None if unusable."""
        from privkit.mechanisms.rec import RecMessage, decode

        assert self.accountant is not None
        try:
            if list(record) != [keys.REC_MESSAGE]:
                raise InvalidParameterError("arrays", list(record), f"[{keys.REC_MESSAGE!r}]")
            message = RecMessage.from_bytes(record[keys.REC_MESSAGE].numpy().tobytes())
            charged = self.accountant.rec_event([v.size for v in global_model.values()])
            if message.event() != charged:
                raise InvalidParameterError("message", message.event(), f"the charged {charged}")
            update = decode(message, {k: v.shape for k, v in global_model.items()})
        except InvalidParameterError as exc:
            log(WARNING, "ignoring client %d: bad DP-REC message (%s)", client, exc)
            return None
        out = {k: (w.astype(np.float64) + update[k].numpy()).astype(w.dtype)
               for k, w in global_model.items()}
        return out, message.size_bits()

    def _echo_ok(self, client: int, msg: Message) -> bool:
        """A private run's reply must echo its mechanism's parameter (the mod ran)."""
        if self.accountant is None:
            return True
        key, value = self.accountant.expected(client)
        m = next(iter(msg.content.metric_records.values()))
        got = m.get(key)
        if not isinstance(got, (int, float)) or not np.isclose(float(got), value, rtol=1e-12,
                                                                atol=0.0):
            log(WARNING, "ignoring client %d: its reply has %s=%r, the ledger charged %r "
                "(is the privkit mod installed?)", client, key, got, value)
            return False
        return True

    def _privacy_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.accountant is not None and self.accountant.bound:
            out |= self.accountant.metrics()
        if self.stopped is not None:
            out["privkit-budget-stopped"] = 1
        return out

    # -- evaluate ----------------------------------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Ask a seed-tree sample of clients (stream ``eval``; all with fraction 1) to evaluate."""
        if self.fraction_evaluate == 0.0:
            return []
        self._ensure_roster(grid)
        k = max(int(self.fraction_evaluate * self.num_clients), 1)
        rng = self.tree.numpy(server_round, "eval")
        chosen = np.sort(rng.choice(self.num_clients, size=k, replace=False))
        config[keys.SERVER_ROUND] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, [self.nodes[int(c)] for c in chosen],
                                        MessageType.EVALUATE)

    def summary(self) -> None:
        """Log the settings."""
        log(INFO, "\t├──> privkit: %d clients, seed %d, stragglers %.2f, E=%d, b=%d, lr=%g, "
            "momentum %g, batch order %s, privacy %s", self.num_clients, self.tree.seed,
            self.stragglers, self.local_epochs, self.batch_size, self.lr, self.momentum,
            self.batch_order,
            "none" if self.accountant is None else self.accountant.settings.kind)
        super().summary()


class UpcycledFedProx(PrivkitFedProx):
    """Upcycled-FL (Yin et al., Algorithm 2): FedProx odd rounds, server-only even rounds.

    Args:
        num_clients: N.
        proximal_mu: mu > 0 of the odd steps (mu = 0 makes every c_m = 0: even rounds keep
            the model).
        lam: lambda_m of the even step, c_m = mu / (mu + lambda_m); > 0 when mu > 0.
        lam_schedule: ``constant`` (the paper's experiments) or ``sqrt`` (lambda_m = lam sqrt m).
        **kwargs: the rest of :class:`PrivkitFedProx`.

    Server round t is iteration t of the algorithm; run ``2 M`` rounds for M data rounds.
    """

    def __init__(self, num_clients: int, *, proximal_mu: float = 1.0, lam: float = 0.42,
                 lam_schedule: str = "constant", **kwargs: Any) -> None:
        # UpcycledConfig validates (mu, lam, schedule) and extrapolation() reads them.
        self.upcycled = UpcycledConfig(mu=float(proximal_mu), lam=float(lam),
                                       lam_schedule=lam_schedule)
        super().__init__(num_clients, proximal_mu=proximal_mu, **kwargs)
        self._before_odd: ArrayRecord | None = None  # w^{2m-2}
        self._after_odd: ArrayRecord | None = None  # w^{2m-1}

    def data_round(self, server_round: int) -> int:
        """Odd server round 2m - 1 is data round m."""
        return (server_round + 1) // 2

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Odd rounds: keep w^{2m-2} and send FedProx work. Even rounds: send nothing."""
        if server_round % 2 == 0:
            self._ensure_roster(grid)
            self._sent = None
            self._after_odd = arrays
            return []
        self._before_odd = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Odd rounds: FedProx averaging. Even rounds: w^{2m-1} + c_m (w^{2m-1} - w^{2m-2})."""
        if server_round % 2 == 1:
            return super().aggregate_train(server_round, replies)
        if list(replies):
            log(WARNING, "even round %d: ignoring replies (no work was sent)", server_round)
        if self._after_odd is None or self._before_odd is None:
            return None, None
        c = extrapolation(self.upcycled, server_round // 2)
        w = keys.to_torch(self._after_odd)
        w_prev = keys.to_torch(self._before_odd)
        new = {k: w[k] + c * (w[k] - w_prev[k]) for k in w}
        metrics = MetricRecord({"privkit-extrapolation": c} | self._privacy_metrics())
        return keys.to_record(new), metrics

    def summary(self) -> None:
        """Log the settings."""
        log(INFO, "\t├──> Upcycled-FL: lambda %g (%s schedule)", self.upcycled.lam,
            self.upcycled.lam_schedule)
        super().summary()


def _leaf_sizes(arrays: ArrayRecord) -> list[int]:
    return [math.prod(a.shape) for a in arrays.values()]


def _without_privkit_keys(content: RecordDict) -> RecordDict:
    """A reply's records with privkit's echo metrics removed (they are not averaged)."""
    name, m = next(iter(content.metric_records.items()))
    kept = MetricRecord({k: v for k, v in m.items() if not k.startswith("privkit-")})
    return RecordDict({name: kept})
