"""BandedClientLevelDP: banded MF around a stock Flower strategy's own cohort selection.

Most tests drive ``Strategy.start`` with an in-process grid (a function per node, no Ray):
stock ``FedAvg`` with ``fraction_train < 1`` picks its cohorts itself (Python's ``random``,
seeded here), the wrapper drops what the participation schema does not allow. The last test
runs the wrapper in Flower's ``run_simulation`` (Ray, about 20 s on two busy cores).
"""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest

EXTRA = "install the flower extra: pip install -e '.[flower]' from a checkout"
pytest.importorskip("flwr", reason=f"Flower is not installed; {EXTRA}")

from _flower_grid import LocalGrid  # noqa: E402
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

import privkit  # noqa: E402
from privkit.accountants import MinSeparation, bandmf_assumptions, bandmf_event  # noqa: E402
from privkit.errors import InvalidParameterError  # noqa: E402
from privkit.events import NoOpDpEvent  # noqa: E402
from privkit.flower import POPULATION, BandedClientLevelDP, ClientLevelDP  # noqa: E402
from privkit.ledger import Ledger  # noqa: E402
from privkit.mechanisms import BANDMF_TRUST_ASSUMPTION, BandedToeplitzStrategy  # noqa: E402
from privkit.mechanisms.aggregate import unamplified_event  # noqa: E402


@pytest.fixture
def seeded_random():
    """Stock FedAvg draws its cohort with Python's global ``random``: seed it, then put the
    generator back as it was."""
    state = random.getstate()
    random.seed(20240531)
    yield
    random.setstate(state)


class ChoosingFedAvg(FedAvg):
    """Stock FedAvg that records the cohort it chose each round."""

    def __init__(self, **kw):
        super().__init__(fraction_evaluate=0.0, **kw)
        self.chosen = []

    def configure_train(self, server_round, arrays, config, grid):
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.chosen.append([m.metadata.dst_node_id for m in messages])
        return messages


def replying(update_of, seen=None):
    """A client returning the global model plus ``update_of(node_index, shape)``."""
    def client(i, msg):
        if seen is not None:
            seen(i, msg)
        w = msg.content["arrays"]["w"].numpy()
        out = ArrayRecord({"w": Array((w + update_of(i, w.shape)).astype(np.float32))})
        return Message(RecordDict({"arrays": out, "metrics": MetricRecord(
            {"num-examples": 10})}), reply_to=msg)
    return client


def zeros(i, shape):
    return np.zeros(shape)


def start(dp, grid, rounds, d=4):
    """Run ``rounds`` rounds; returns (result, the global model after each round)."""
    models = {}

    def record(r, arrays):
        models[r] = arrays["w"].numpy().astype(np.float64)

    result = dp.start(grid, ArrayRecord({"w": Array(np.zeros(d, np.float32))}),
                      num_rounds=rounds, evaluate_fn=record)
    return result, models


def prefix_epsilon(dp, releases):
    events = [e for e in dp.round_events[:releases] if not isinstance(e, NoOpDpEvent)]
    return float(privkit.epsilon(privkit.ComposedDpEvent(events), dp.ledger.delta))


# ------------------------------------------------------------------ the schema is enforced


@pytest.fixture(scope="module")
def cohorts():
    """12 nodes, stock FedAvg choosing 3 at random each round (fraction_train 0.25), b = 3,
    at most 5 participations, 40 releases, then one round more (stopped: T used up)."""
    state = random.getstate()
    random.seed(7)
    try:
        inner = ChoosingFedAvg(fraction_train=0.25, min_available_nodes=12)
        dp = BandedClientLevelDP(inner, num_clients=12, bands=3, rounds=40,
                                 max_participations=5, l2_clip_norm=1.0,
                                 noise_multiplier=2.0, seed=1)
        charged_when_sent = {}

        def seen(i, msg):  # what the ledger held when the node got its message
            r = msg.content["config"]["server-round"]
            charged_when_sent[r] = dp.epsilon()

        from flwr.supercore.task_identity import TaskIdentity

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(TaskIdentity, "_run_id", 1)
            mp.setattr(TaskIdentity, "_task_id", 1)
            mp.setattr(TaskIdentity, "_node_id", 0)
            grid = LocalGrid(12, replying(zeros, seen))
            result, models = start(dp, grid, 41)
    finally:
        random.setstate(state)
    return dict(dp=dp, inner=inner, grid=grid, result=result, models=models,
                charged_when_sent=charged_when_sent)


def test_no_node_takes_part_twice_within_b_rounds_nor_more_than_k_times(cohorts):
    dp, grid = cohorts["dp"], cohorts["grid"]
    taken = {}
    for release, nodes in enumerate(grid.train[:40]):
        for nid in nodes:
            taken.setdefault(nid, []).append(release)
    assert grid.train[40] == []  # the 41st round: T = 40 releases used up
    assert sum(map(len, taken.values())) > 40  # several nodes a round, many rounds each
    schema = MinSeparation(min_separation=3, max_participations=5)
    for rounds in taken.values():
        assert len(rounds) <= 5
        assert all(b - a >= 3 for a, b in zip(rounds, rounds[1:]))  # sorted: pairwise
        assert schema.allows(rounds)
    assert max(map(len, taken.values())) == 5  # the cap was reached
    assert "used up" in dp.stopped


def test_dropped_selections_are_counted_per_round_and_in_total(cohorts):
    dp, inner, grid = cohorts["dp"], cohorts["inner"], cohorts["grid"]
    metrics = cohorts["result"].train_metrics_clientapp
    assert len(inner.chosen) == 40 and all(len(c) == 3 for c in inner.chosen)
    taken = {}
    separation = cap = 0
    for r, (chosen, sent) in enumerate(zip(inner.chosen, grid.train)):
        assert set(sent) <= set(chosen)
        # recompute from what was sent: why each dropped node was dropped
        sep_r = sum(1 for n in chosen if n not in sent and len(taken.get(n, [])) < 5)
        cap_r = sum(1 for n in chosen if n not in sent and len(taken.get(n, [])) >= 5)
        assert sep_r + cap_r == len(chosen) - len(sent)
        d = dp.drops[r]
        assert (d.server_round, d.release, d.selected) == (r + 1, r, 3)
        assert (d.separation, d.participation_cap, d.kept) == (sep_r, cap_r, len(sent))
        assert metrics[r + 1]["privkit-dropped-separation"] == sep_r
        assert metrics[r + 1]["privkit-dropped-cap"] == cap_r
        for n in sent:
            taken.setdefault(n, []).append(r)
        separation, cap = separation + sep_r, cap + cap_r
    assert separation > 0 and cap > 0
    rep = dp.report()["dropped"]
    assert (rep["separation"], rep["participation_cap"], rep["selected"]) == \
        (separation, cap, 120) == (dp.dropped_separation, dp.dropped_cap, 120)
    assert len(rep["per_round"]) == 40


def test_the_ledger_charges_exactly_the_priced_event_before_each_release(cohorts):
    dp = cohorts["dp"]
    metrics = cohorts["result"].train_metrics_clientapp
    want = float(privkit.epsilon(bandmf_event(
        dp.factorization, noise_multiplier=2.0, rounds=40,
        participation=MinSeparation(3, 5)), 1e-5))
    assert dp.epsilon() == pytest.approx(want, rel=1e-9)
    assert dp.epsilon_full_run == pytest.approx(want, rel=1e-9)
    for r in (1, 2, 3, 10, 40):  # round r's charge was on the ledger when its nodes heard
        assert metrics[r]["privkit-epsilon"] == pytest.approx(prefix_epsilon(dp, r), rel=1e-9)
        if r in cohorts["charged_when_sent"]:
            assert cohorts["charged_when_sent"][r] == metrics[r]["privkit-epsilon"]
    assert metrics[41]["privkit-epsilon"] == metrics[40]["privkit-epsilon"]
    assert metrics[41]["privkit-budget-stopped"] == 1
    assert np.array_equal(cohorts["models"][41], cohorts["models"][40])


# ------------------------------------------------------------------ pricing


def test_one_band_is_unamplified_dp_fedavg(seeded_random):
    z, k = 1.3, 3
    dp = BandedClientLevelDP(FedAvg(fraction_evaluate=0.0, fraction_train=0.5), num_clients=4,
                             bands=1, rounds=8, max_participations=k, l2_clip_norm=1.0,
                             noise_multiplier=z, seed=0)
    assert dp.factorization.coefficients == (1.0,)  # the identity: independent noise
    start(dp, LocalGrid(4, replying(zeros)), 8)
    want = float(privkit.epsilon(unamplified_event(z, k), 1e-5))
    plain = ClientLevelDP(FedAvg(), num_clients=4, client_rate=0.5, l2_clip_norm=1.0,
                          noise_multiplier=z)
    assert dp.epsilon() == pytest.approx(want, rel=1e-9)
    assert dp.epsilon() == pytest.approx(plain.epsilon_unamplified(k), rel=1e-9)
    assert dp.ledger.composition(POPULATION).atoms == ((privkit.GaussianDpEvent(z), k),)


def test_target_epsilon_calibrates_the_whole_run():
    dp = BandedClientLevelDP(FedAvg(fraction_train=0.2), num_clients=20, bands=4, rounds=40,
                             l2_clip_norm=1.0, target_epsilon=4.0)
    assert 3.99 < dp.epsilon_full_run <= 4.0
    assert dp.report()["calibration"]["target_epsilon"] == 4.0
    assert dp.participation == MinSeparation(4, 10)


# ------------------------------------------------------------------ the noise


def test_noise_of_zero_updates_has_the_factorisation_covariance():
    """Zero updates: release t's noise is (C^-1 Z)_t, so the model steps have stddev
    z C ||row t of C^-1|| / cohort_size and the covariance z^2 C^2 (C^-1 C^-T)[t, t-1]
    between consecutive steps (20 000 coordinates: both estimated to about 1%)."""
    b, rounds, z, c, d = 4, 6, 2.0, 0.5, 20_000
    dp = BandedClientLevelDP(FedAvg(fraction_evaluate=0.0, fraction_train=0.5,
                                    min_train_nodes=1), num_clients=2, bands=b,
                             rounds=rounds, l2_clip_norm=c, noise_multiplier=z, seed=3)
    assert dp.cohort_size == 1
    _, models = start(dp, LocalGrid(2, replying(zeros)), rounds, d=d)
    steps = np.array([models[r] - models[r - 1] for r in range(1, rounds + 1)])
    inv = np.linalg.inv(dp.factorization.matrix(rounds))
    cov = (z * c) ** 2 * inv @ inv.T / dp.cohort_size ** 2
    for t in range(rounds):
        assert np.std(steps[t]) == pytest.approx(math.sqrt(cov[t, t]), rel=0.03)
        if t:
            got = float(np.mean(steps[t] * steps[t - 1]))
            assert got == pytest.approx(cov[t, t - 1], abs=0.03 * cov[t, t])
    assert abs(cov[1, 0]) > 0.1 * cov[1, 1]  # correlated: a wrong sampler would fail


def test_the_sum_is_clipped_and_divided_by_the_public_cohort_size():
    c = 0.5
    dp = BandedClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=3, bands=1,
                             rounds=2, l2_clip_norm=c, noise_multiplier=1e-9, seed=0,
                             cohort_size=2)
    _, models = start(dp, LocalGrid(3, replying(lambda i, s: np.full(s, 1e6))), 1)
    # three clipped updates (norm C, same direction) over the fixed divisor 2, not 3
    assert np.linalg.norm(models[1] - models[0]) == pytest.approx(3 * c / 2, rel=1e-6)


# ------------------------------------------------------------------ stopping


def test_max_epsilon_stops_before_the_release_that_would_exceed_it(seeded_random):
    kw = dict(num_clients=4, bands=2, rounds=10, l2_clip_norm=1.0, noise_multiplier=1.0)
    probe = BandedClientLevelDP(FedAvg(), **kw)
    e2, e3 = prefix_epsilon(probe, 2), prefix_epsilon(probe, 3)
    assert e2 < e3
    dp = BandedClientLevelDP(FedAvg(fraction_evaluate=0.0, fraction_train=0.5),
                             max_epsilon=(e2 + e3) / 2, **kw)
    grid = LocalGrid(4, replying(zeros))
    result, models = start(dp, grid, 4)
    metrics = result.train_metrics_clientapp
    assert dp.releases == 2 and grid.train[2:] == [[], []]
    assert metrics[2]["privkit-epsilon"] == pytest.approx(e2, rel=1e-9)
    assert "privkit-budget-stopped" not in metrics[2]
    assert metrics[3]["privkit-budget-stopped"] == 1 == metrics[4]["privkit-budget-stopped"]
    assert np.array_equal(models[4], models[2]) and "max_epsilon" in dp.stopped


def test_a_ledger_budget_stops_too(seeded_random):
    kw = dict(num_clients=4, bands=2, rounds=10, l2_clip_norm=1.0, noise_multiplier=1.0)
    e1 = prefix_epsilon(BandedClientLevelDP(FedAvg(), **kw), 1)
    with pytest.raises(InvalidParameterError, match="REPLACE_SPECIAL"):  # fixed cohorts
        BandedClientLevelDP(FedAvg(), ledger=Ledger.create(None, population_id="t",
                                                           delta=1e-5), **kw)
    ledger = Ledger.create(None, population_id="t", delta=1e-5, epsilon_budget=e1 * 1.01,
                           neighboring_relation="zero-out")
    dp = BandedClientLevelDP(FedAvg(fraction_evaluate=0.0, fraction_train=0.5),
                             ledger=ledger, **kw)
    result, _ = start(dp, LocalGrid(4, replying(zeros)), 2)
    assert dp.releases == 1 and result.train_metrics_clientapp[2]["privkit-budget-stopped"]
    assert "epsilon_budget" in dp.stopped


def test_rounds_without_train_messages_are_not_releases(seeded_random):
    class EveryOtherRound(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            return [] if server_round % 2 == 0 else super().configure_train(
                server_round, arrays, config, grid)

    dp = BandedClientLevelDP(EveryOtherRound(fraction_evaluate=0.0), num_clients=2, bands=2,
                             rounds=3, l2_clip_norm=1.0, noise_multiplier=1.0)
    grid = LocalGrid(2, replying(zeros))
    start(dp, grid, 5)
    assert dp.releases == 3 and dp.stopped is None
    # every node is chosen every odd round; b = 2 releases: each takes part in releases 0, 2
    assert [sorted(nodes) for nodes in grid.train] == [[1000, 1007], [], [], [], [1000, 1007]]
    assert [(d.server_round, d.separation) for d in dp.drops] == [(1, 0), (3, 2), (5, 0)]


# ------------------------------------------------------------------ inputs and the report


def _wrapped():
    return ClientLevelDP(FedAvg(), num_clients=4, client_rate=0.5, l2_clip_norm=1.0,
                         noise_multiplier=1.0)


@pytest.mark.parametrize("kw, name", [
    ({"bands": 0}, "bands"), ({"bands": 11}, "bands"), ({"bands": float("nan")}, "bands"),
    ({"bands": 2.5}, "bands"), ({"rounds": 0}, "rounds"),
    ({"rounds": float("inf")}, "rounds"), ({"num_clients": 0}, "num_clients"),
    ({"l2_clip_norm": 0.0}, "l2_clip_norm"), ({"l2_clip_norm": float("nan")}, "l2_clip_norm"),
    ({"l2_clip_norm": float("inf")}, "l2_clip_norm"),
    ({"noise_multiplier": float("nan")}, "noise_multiplier"),
    ({"noise_multiplier": float("inf")}, "noise_multiplier"),
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"noise_multiplier": None}, "noise_multiplier"),  # neither z nor a target
    ({"target_epsilon": 2.0}, "noise_multiplier"),  # both
    ({"noise_multiplier": None, "target_epsilon": float("nan")}, "target_epsilon"),
    ({"max_participations": 0}, "max_participations"),
    ({"cohort_size": 0}, "cohort_size"), ({"cohort_size": 5}, "cohort_size"),
    ({"strategy": FedAvg(min_available_nodes=5)}, "strategy"),
    ({"strategy": FedAvg(min_train_nodes=6)}, "strategy"),
    ({"strategy": FedAvg(fraction_train=0.0)}, "strategy"),
    ({"strategy": object()}, "strategy"), ({"strategy": _wrapped()}, "strategy"),
    ({"factorization": BandedToeplitzStrategy.square_root(3)}, "factorization"),
    ({"factorization": (1.0, 0.5)}, "factorization"),
    ({"delta": 1.0}, "delta"), ({"seed": -1}, "seed"),
    ({"max_epsilon": float("nan")}, "max_epsilon"), ({"ledger": "ledger.jsonl"}, "ledger"),
])
def test_bad_arguments_name_the_argument(kw, name):
    args = dict(strategy=FedAvg(), num_clients=4, bands=2, rounds=10, l2_clip_norm=1.0,
                noise_multiplier=1.0) | kw
    strategy = args.pop("strategy")
    with pytest.raises(InvalidParameterError, match=name):
        BandedClientLevelDP(strategy, **args)


def test_a_strategy_without_a_cohort_rule_needs_cohort_size():
    from flwr.serverapp.strategy import Strategy

    class Bare(Strategy):
        def configure_train(self, *a):
            return []

        aggregate_train = configure_evaluate = aggregate_evaluate = summary = configure_train

    with pytest.raises(InvalidParameterError, match="cohort_size"):
        BandedClientLevelDP(Bare(), num_clients=4, bands=2, rounds=10, l2_clip_norm=1.0,
                            noise_multiplier=1.0)
    assert BandedClientLevelDP(Bare(), num_clients=4, bands=2, rounds=10, l2_clip_norm=1.0,
                               noise_multiplier=1.0, cohort_size=3).cohort_size == 3


def _numbers(tree):
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _numbers(v)]
    if isinstance(tree, list | tuple):
        return [x for v in tree for x in _numbers(v)]
    return [float(tree)] if isinstance(tree, int | float) and not isinstance(tree, bool) else []


def _keys(tree):
    if isinstance(tree, dict):
        return [*tree, *(k for v in tree.values() for k in _keys(v))]
    if isinstance(tree, list):
        return [k for v in tree for k in _keys(v)]
    return []


def test_the_report_states_the_schema_and_never_holds_the_noise_state(seeded_random):
    dp = BandedClientLevelDP(FedAvg(fraction_evaluate=0.0, fraction_train=0.5),
                             num_clients=4, bands=3, rounds=10, l2_clip_norm=1.0,
                             noise_multiplier=1.0)
    result, _ = start(dp, LocalGrid(4, replying(zeros)), 5, d=6)
    rep = dp.report()
    json.dumps(rep)  # plain data
    secret = {float(v) for h in dp._noise_state.history for v in h["w"].ravel()}
    assert len(secret) == 2 * 6  # b - 1 noise outputs of 6 coordinates
    published = _numbers(rep) + _numbers([dict(m) for m in
                                          result.train_metrics_clientapp.values()])
    assert not secret & set(published)
    assert not [k for k in _keys(rep) if "state" in k or "history" in k]
    assert rep["trust"] == BANDMF_TRUST_ASSUMPTION
    assert rep["assumptions"][:-1] == list(bandmf_assumptions(MinSeparation(3, 4),
                                                             "zero-out"))
    assert rep["neighboring_relation"].startswith("zero-out")
    assert rep["epsilon_replace_one"] > rep["epsilon"] > 0
    assert rep["participation"] | {"enforced_by": None} == {
        "schema": "MinSeparation", "min_separation": 3, "max_participations": 4,
        "enforced_by": None}
    assert rep["randomness"]["source"] == "os_csprng"
    assert rep["neighboring_relation"].startswith("zero-out")
    assert rep["cohort"]["divisor"] == 2 and rep["releases"] == 5
    assert rep["epsilon"] == pytest.approx(prefix_epsilon(dp, 5), rel=1e-9)
    assert set(rep["dropped"]) >= {"separation", "participation_cap", "per_round"}
    assert "noise" not in repr(dp).replace("noise_multiplier", "")


# --------------------------------------------------------------------------- run_simulation


def test_in_flowers_simulation_engine():
    """Stock FedAvg choosing 3 of 6 nodes a round behind the wrapper in Flower's
    ``run_simulation`` (Ray; about 20 s on two busy cores): b = 2, 4 releases."""
    pytest.importorskip("ray", reason=f"Flower's simulation engine needs Ray; {EXTRA}")
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    n, out = 6, {}
    server = ServerApp()

    @server.main()
    def main(grid, context):
        dp = BandedClientLevelDP(FedAvg(fraction_train=0.5, fraction_evaluate=0.0,
                                        min_available_nodes=n), num_clients=n, bands=2,
                                 rounds=4, l2_clip_norm=1.0, noise_multiplier=1.0)
        result = dp.start(grid, ArrayRecord({"w": Array(np.zeros(8, np.float32))}),
                          num_rounds=4, timeout=120)
        out.update(result=result, dp=dp)

    client = ClientApp()

    @client.train()
    def train(msg, context):
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord(
            {"num-examples": 10})}), reply_to=msg)

    run_simulation(server, client, num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    assert out, "the ServerApp failed (see the log above)"
    dp = out["dp"]
    assert dp.releases == 4 and [d.selected for d in dp.drops] == [3] * 4
    assert all(MinSeparation(2, 2).allows(r) for r in dp._taken.values())
    assert sum(d.kept for d in dp.drops) == sum(map(len, dp._taken.values()))
    assert dp.epsilon() == pytest.approx(dp.epsilon_full_run, rel=1e-9)
    assert out["result"].train_metrics_clientapp[4]["privkit-releases"] == 4
