"""Coupling entries of privkit's Flower wrappers, driven in-process (a grid of functions, no
Ray): ``ClientLevelDP`` under add/remove one node (with and without adaptive clipping) and
``BandedClientLevelDP`` under zero-out (its stated relation). Each node holds a few rows and
returns one softmax-regression gradient step from the model it was sent."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

pytest.importorskip("flwr", reason="Flower is not installed (the flower extra)")

from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from privkit.flower import BandedClientLevelDP, ClientLevelDP  # noqa: E402
from privkit.flower._server import ServerSideDP  # noqa: E402
from privkit.mechanisms.aggregate import AdaptiveClipping, ClientLevelGaussian  # noqa: E402
from privkit.mechanisms.bandmf import BandMF  # noqa: E402

from .harness import (  # noqa: E402
    ADD_REMOVE,
    D2,
    ZERO_OUT,
    Entry,
    Tap,
    Violation,
    coupling_tests,
    opposite,
    spy_adaptive_count,
    spy_client_sum,
    toy_clients,
)

FEATURES, CLASSES = 4, 2


def node_ids(n: int) -> list[int]:
    return [1000 + 7 * i for i in range(n)]


class Grid:
    """Nodes ``ids`` answered in-process by ``client(i, message)``, i the node's index."""

    def __init__(self, ids: list[int], client: Any) -> None:
        self.ids, self.client = list(ids), client

    def get_node_ids(self) -> list[int]:
        return list(self.ids)

    def send_and_receive(self, messages: Any, *, timeout: Any = None) -> list[Message]:
        return [self.client(self.ids.index(m.metadata.dst_node_id), m) for m in messages]


def node(data: list[tuple[np.ndarray, np.ndarray]]) -> Any:
    """Node i returns the model it was sent plus one gradient step on its own rows."""
    def client(i: int, msg: Message) -> Message:
        w = msg.content["arrays"]["w"].numpy().astype(np.float64)
        x, y = data[i]
        logits = x @ w.reshape(FEATURES, CLASSES)
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        grad = x.T @ (p - np.eye(CLASSES)[y]) / len(y)
        out = ArrayRecord({"w": Array((w - 2.0 * grad.reshape(-1)).astype(np.float32))})
        return Message(RecordDict({"arrays": out, "metrics": MetricRecord(
            {"num-examples": len(y)})}), reply_to=msg)
    return client


def track_replies(mp: pytest.MonkeyPatch, tap: Tap) -> None:
    """The round's contributors: the nodes whose replies ``_updates`` stacked, in order."""
    real = ServerSideDP._updates

    def updates(self: Any, replies: Any, sent: Any) -> Any:
        out = real(self, replies, sent)
        tap.ctx["ids"] = [m.metadata.src_node_id for m in replies
                          if not m.has_error() and m.metadata.src_node_id in sent.sampled]
        tap.ctx["round"] = sent.server_round
        return out

    mp.setattr(ServerSideDP, "_updates", updates)


def _start(dp: Any, grid: Grid, rounds: int) -> None:
    dp.start(grid, ArrayRecord({"w": Array(np.zeros(FEATURES * CLASSES, np.float32))}),
             num_rounds=rounds, evaluate_fn=lambda r, arrays: None)


# ------------------------------------------------------------------------- ClientLevelDP
CENTRAL = st.fixed_dictionaries({
    "nodes": st.integers(2, 4), "q": st.sampled_from([0.5, 0.8, 1.0]),
    "clip": st.sampled_from([0.05, 0.5, 5.0]), "adaptive": st.booleans(),
    "position": st.integers(0, 4), "rounds": st.integers(2, 3),
    "seed": st.integers(0, 10_000), "data": st.integers(0, 10_000)})


def run_central(s: dict[str, Any], tap: Tap) -> None:
    """``ClientLevelDP(FedAvg)`` with ``seed`` (coins keyed by node id), add/remove one node:
    D' has one more node, whose id sorts at ``position`` among the others' (so a coin drawn
    from one stream in node order, rather than keyed by id, would move), ``num_clients``
    N + 1. Release point
    ``ClientLevelGaussian.__call__`` (the clipped replies' sum before the noise and the
    division by q N), bound C (the round's C with adaptive clipping, whose count is checked
    too, and the pair against 1 / z_eff). Pinned: the divisor q N
    (``ClientLevelDP.expected_clients``)."""
    data = toy_clients(s["data"], [6] * s["nodes"], features=FEATURES, classes=CLASSES)
    ids = node_ids(len(data))
    tap.target = 1000 + 7 * (s["position"] % (len(data) + 1)) - 3
    if tap.side == D2:
        data = data + [opposite(toy_clients(s["data"] + 1, [6], features=FEATURES)[0])]
        ids = ids + [tap.target]
    adaptive = AdaptiveClipping(0.5, count_stddev=0.5, sampling_probability=s["q"]) \
        if s["adaptive"] else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TaskIdentity, "_run_id", 1)
        mp.setattr(TaskIdentity, "_task_id", 1)
        mp.setattr(TaskIdentity, "_node_id", 0)
        track_replies(mp, tap)
        expected = s["q"] * s["nodes"]  # D's q N
        mp.setattr(ClientLevelDP, "expected_clients", property(lambda self: expected))
        group = joint = None
        if adaptive is not None:
            def group() -> Any:
                return tap.ctx["round"]

            def joint() -> float:  # 1 / the z_eff each round is charged at
                return 1.0 / tap.ctx["dp"].effective_noise_multiplier

            spy_adaptive_count(mp, tap, ids=lambda: tap.ctx["ids"], target=tap.target,
                               group=group, joint=joint)
        spy_client_sum(mp, tap, ClientLevelGaussian, ids=lambda: tap.ctx["ids"],
                       target=tap.target,
                       bound=(lambda m: m.l2_clip_norm) if adaptive else (lambda m: s["clip"]),
                       group=group, joint=joint)
        dp = tap.ctx["dp"] = ClientLevelDP(
            FedAvg(fraction_evaluate=0.0), num_clients=len(data), client_rate=s["q"],
            l2_clip_norm=s["clip"], noise_multiplier=1.0, seed=s["seed"], adaptive=adaptive)
        _start(dp, Grid(ids, node(data)), s["rounds"])


# ------------------------------------------------------------------------- banded
BANDED = st.fixed_dictionaries({
    "nodes": st.integers(3, 5), "fraction": st.sampled_from([0.4, 0.7]),
    "bands": st.sampled_from([1, 2]), "clip": st.sampled_from([0.05, 0.5]),
    "target": st.integers(0, 4), "rounds": st.integers(2, 3),
    "seed": st.integers(0, 10_000), "data": st.integers(0, 10_000)})


def run_banded(s: dict[str, Any], tap: Tap) -> None:
    """``BandedClientLevelDP(FedAvg(fraction_train))`` (stock FedAvg picks the cohorts with
    Python's ``random``, seeded alike in both runs), zero-out: node ``target mod N`` keeps
    its place; in D' its rows are turned away and its reply's row is zeroed at the release
    point ``BandMF.__call__`` (the clipped replies' sum before the correlated noise and the
    division by the public cohort size), bound C per release; the schema check asks that the
    target's releases fit the priced ``MinSeparation``."""
    data = toy_clients(s["data"], [6] * s["nodes"], features=FEATURES, classes=CLASSES)
    t = s["target"] % len(data)
    tap.target = 1000 + 7 * t
    if tap.side == D2:
        data[t] = opposite(data[t])
    state = random.getstate()
    random.seed(s["seed"])
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(TaskIdentity, "_run_id", 1)
            mp.setattr(TaskIdentity, "_task_id", 1)
            mp.setattr(TaskIdentity, "_node_id", 0)
            track_replies(mp, tap)
            spy_client_sum(mp, tap, BandMF, ids=lambda: tap.ctx["ids"], target=tap.target,
                           bound=lambda m: s["clip"], zero_target=True)
            dp = BandedClientLevelDP(
                FedAvg(fraction_train=s["fraction"], fraction_evaluate=0.0),
                num_clients=len(data), bands=s["bands"], rounds=s["rounds"],
                l2_clip_norm=s["clip"], noise_multiplier=1.0, seed=s["seed"])
            tap.ctx["dp"] = dp
            _start(dp, Grid(node_ids(len(data)), node(data)), s["rounds"])
    finally:
        random.setstate(state)


def banded_schema(s: dict[str, Any], d: Tap, d2: Tap) -> list[Violation]:
    """The target's releases (0-based) in D' fit the wrapper's priced MinSeparation."""
    rounds = [r.key[0] - 1 for r in d2.releases if r.target]
    schema = d2.ctx["dp"].participation
    return [] if schema.allows(rounds) else [Violation(
        "schema", -1, "participation", tuple(rounds), 0, 0, f"(does not fit {schema})")]


ENTRIES = [
    Entry("flower-client-level", ADD_REMOVE, CENTRAL, run_central,
          lambda s: ClientLevelDP.neighboring_relation,
          {"nodes": 2, "q": 1.0, "clip": 0.05, "adaptive": True, "position": 0, "rounds": 2,
           "seed": 0, "data": 0}),
    Entry("flower-banded", ZERO_OUT, BANDED, run_banded,
          lambda s: BandedClientLevelDP.neighboring_relation,
          {"nodes": 3, "fraction": 0.7, "bands": 2, "clip": 0.05, "target": 0, "rounds": 3,
           "seed": 3, "data": 0}, banded_schema),
]


test_coupling, test_witness_sees_the_target = coupling_tests(ENTRIES)
