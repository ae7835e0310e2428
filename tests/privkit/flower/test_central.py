"""ClientLevelDP: privkit's client-level DP-FedAvg around stock Flower strategies.

Most tests drive ``Strategy.start`` with an in-process grid (a function per node, no Ray), so
they take a fraction of a second; one module fixture runs the wrapper around stock ``FedAvg``
in Flower's ``run_simulation`` (Ray, about 20 s on two busy cores).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

EXTRA = "install the flower extra: pip install -e '.[flower]' from a checkout"
pytest.importorskip("flwr", reason=f"Flower is not installed; {EXTRA}")

from _flower_grid import LocalGrid  # noqa: E402
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx  # noqa: E402

import privkit  # noqa: E402
from privkit.errors import InvalidParameterError  # noqa: E402
from privkit.flower import POPULATION, ClientLevelDP  # noqa: E402
from privkit.ledger import Ledger  # noqa: E402

D = 20_000  # coordinates of the test model: the noise's stddev is estimated to ~0.5%


def replying(update_of):
    """A client returning the global model plus ``update_of(node_index, shape)``."""
    def client(i, msg):
        w = msg.content["arrays"]["w"].numpy()
        out = ArrayRecord({"w": Array((w + update_of(i, w.shape)).astype(np.float32))})
        return Message(RecordDict({"arrays": out, "metrics": MetricRecord(
            {"num-examples": 10, "train-loss": 0.5})}), reply_to=msg)
    return client


def zeros(i, shape):
    return np.zeros(shape)


def start(dp, grid, rounds, w0=None):
    """Run ``rounds`` rounds; returns (result, the global model after each round)."""
    models = {}

    def record(r, arrays):
        models[r] = arrays["w"].numpy().astype(np.float64)
        return None

    w0 = np.zeros(D, np.float32) if w0 is None else w0
    result = dp.start(grid, ArrayRecord({"w": Array(w0)}), num_rounds=rounds,
                      evaluate_fn=record)
    return result, models


def composed(q, z, rounds):
    return privkit.SelfComposedDpEvent(
        privkit.PoissonSampledDpEvent(q, privkit.GaussianDpEvent(z)), rounds)


def test_noise_of_the_mean_is_z_c_over_q_n():
    q, n, c, z = 0.5, 4, 1.0, 2.0
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=n, client_rate=q,
                       l2_clip_norm=c, noise_multiplier=z)
    grid = LocalGrid(n, replying(zeros))
    _, models = start(dp, grid, 3)
    want = z * c / (q * n)  # 1.0
    for r in (1, 2, 3):
        step = models[r] - models[r - 1]
        assert abs(step.mean()) < 5 * want / math.sqrt(D)
        assert step.std() == pytest.approx(want, rel=0.03)
    # the rounds are independent draws
    assert abs(np.corrcoef(models[1] - models[0], models[2] - models[1])[0, 1]) < 0.05


def test_update_is_clipped_to_c_before_the_sum():
    c = 0.5
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=2, client_rate=1.0,
                       l2_clip_norm=c, noise_multiplier=1e-9, seed=0)
    _, models = start(dp, LocalGrid(2, replying(lambda i, s: np.full(s, 1e6))), 1)
    step = models[1] - models[0]
    # two clients, each clipped to C in the same direction, divided by q N = 2: norm C
    assert np.linalg.norm(step) == pytest.approx(c, rel=1e-5)
    np.testing.assert_allclose(step, c / math.sqrt(D), rtol=1e-4)


def test_bad_replies_count_as_zero():
    def client(i, msg):
        if i == 0:  # a non-finite update
            return replying(lambda j, s: np.full(s, np.nan))(i, msg)
        if i == 1:  # another model
            arrays = ArrayRecord({"v": Array(np.zeros(3, np.float32))})
            return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(
                {"num-examples": 1})}), reply_to=msg)
        return replying(lambda j, s: np.full(s, 0.1 / math.sqrt(D)))(i, msg)  # norm 0.1

    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=3, client_rate=1.0,
                       l2_clip_norm=1.0, noise_multiplier=1e-9, seed=1)
    _, models = start(dp, LocalGrid(3, client), 1)
    assert np.linalg.norm(models[1] - models[0]) == pytest.approx(0.1 / 3, rel=1e-4)


def test_ledger_epsilon_is_privkit_epsilon_of_the_composed_events(tmp_path):
    q, z, rounds = 0.3, 1.1, 4
    ledger = Ledger.create(tmp_path / "ledger.jsonl", population_id="t", delta=1e-5)
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=5, client_rate=q,
                       l2_clip_norm=1.0, noise_multiplier=z, ledger=ledger)
    result, _ = start(dp, LocalGrid(5, replying(zeros)), rounds)
    for r in range(1, rounds + 1):
        want = float(privkit.epsilon(composed(q, z, r), 1e-5))
        assert result.train_metrics_clientapp[r]["privkit-epsilon"] == pytest.approx(
            want, rel=1e-9)
        assert result.train_metrics_clientapp[r]["privkit-delta"] == 1e-5
    replay = Ledger.open(tmp_path / "ledger.jsonl")
    assert [n for _, n in replay.composition(POPULATION).atoms] == [rounds]
    assert replay.epsilons([POPULATION])[POPULATION] == pytest.approx(
        float(privkit.epsilon(composed(q, z, rounds), 1e-5)), rel=1e-9)
    assert 0 < dp.epsilon() < float(privkit.epsilon(
        privkit.SelfComposedDpEvent(privkit.GaussianDpEvent(z), rounds), 1e-5))  # amplified


def test_max_epsilon_stops_before_the_round_that_would_exceed_it():
    q, z = 0.5, 1.0
    e2, e3 = (float(privkit.epsilon(composed(q, z, r), 1e-5)) for r in (2, 3))
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=4, client_rate=q,
                       l2_clip_norm=1.0, noise_multiplier=z, max_epsilon=(e2 + e3) / 2)
    grid = LocalGrid(4, replying(zeros))
    result, models = start(dp, grid, 4)
    metrics = result.train_metrics_clientapp
    assert [n for _, n in dp.ledger.composition(POPULATION).atoms] == [2]
    assert grid.train[2:] == [[], []]  # rounds 3 and 4 sent nothing
    assert metrics[2]["privkit-epsilon"] == pytest.approx(e2, rel=1e-9) and \
        "privkit-budget-stopped" not in metrics[2]
    assert metrics[3]["privkit-budget-stopped"] == 1 == metrics[4]["privkit-budget-stopped"]
    assert metrics[4]["privkit-epsilon"] == metrics[2]["privkit-epsilon"] <= dp.max_epsilon
    assert np.array_equal(models[4], models[2]) and "round 3" in dp.stopped


def test_a_ledger_budget_stops_too():
    ledger = Ledger.create(None, population_id="t", delta=1e-5, epsilon_budget=float(
        privkit.epsilon(composed(0.5, 1.0, 1), 1e-5)) * 1.01)
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=2, client_rate=0.5,
                       l2_clip_norm=1.0, noise_multiplier=1.0, ledger=ledger)
    result, _ = start(dp, LocalGrid(2, replying(zeros)), 2, np.zeros(4, np.float32))
    assert result.train_metrics_clientapp[2]["privkit-budget-stopped"] == 1
    assert "epsilon_budget" in dp.stopped


def test_noise_is_drawn_when_nobody_is_sampled():
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=2, client_rate=1e-3,
                       l2_clip_norm=1.0, noise_multiplier=1.0, seed=5)
    grid = LocalGrid(2, replying(zeros))
    _, models = start(dp, grid, 2, np.zeros(100, np.float32))
    assert grid.train == [[], []]  # Poisson sampling at q = 0.001: nobody, this seed
    for r in (1, 2):  # yet each round was released (noise / (q N)) and charged
        assert np.std(models[r] - models[r - 1]) == pytest.approx(500, rel=0.3)
    assert [n for _, n in dp.ledger.composition(POPULATION).atoms] == [2]


def test_server_optimiser_of_fedadam_sees_the_private_mean():
    # q = 1, updates inside the clip ball, noise ~ 0: the private mean is the plain mean, so
    # FedAdam behind ClientLevelDP takes FedAdam's own steps.
    def upd(i, s):
        return np.linspace(-1, 1, s[0]) * 1e-3 * (i + 1)

    kw = dict(fraction_evaluate=0.0, eta=0.05, min_available_nodes=2, min_train_nodes=2)
    w0 = np.linspace(0, 1, 50).astype(np.float32)
    plain, want = start(FedAdam(**kw), LocalGrid(2, replying(upd)), 3, w0)
    dp = ClientLevelDP(FedAdam(**kw), num_clients=2, client_rate=1.0, l2_clip_norm=1.0,
                       noise_multiplier=1e-9, seed=0)
    _, got = start(dp, LocalGrid(2, replying(upd)), 3, w0)
    assert np.abs(want[3] - want[0]).max() > 0.01  # Adam moved the model (FedAvg: 0.0045)
    np.testing.assert_allclose(got[3], want[3], atol=1e-5)


def test_fedprox_config_reaches_the_sampled_nodes():
    seen = []

    def client(i, msg):
        seen.append(msg.content["config"]["proximal-mu"])
        return replying(zeros)(i, msg)

    dp = ClientLevelDP(FedProx(proximal_mu=0.3, fraction_evaluate=0.0), num_clients=3,
                       client_rate=1.0, l2_clip_norm=1.0, noise_multiplier=1.0)
    start(dp, LocalGrid(3, client), 1, np.zeros(4, np.float32))
    assert seen == [0.3, 0.3, 0.3]


@pytest.mark.parametrize("kw, name", [
    ({"client_rate": 0.0}, "client_rate"), ({"client_rate": 1.5}, "client_rate"),
    ({"client_rate": float("nan")}, "client_rate"),
    ({"l2_clip_norm": 0.0}, "l2_clip_norm"), ({"l2_clip_norm": -1.0}, "l2_clip_norm"),
    ({"l2_clip_norm": float("nan")}, "l2_clip_norm"),
    ({"noise_multiplier": 0.0}, "noise_multiplier"),
    ({"noise_multiplier": float("nan")}, "noise_multiplier"),
    ({"noise_multiplier": float("inf")}, "noise_multiplier"),
    ({"num_clients": 0}, "num_clients"), ({"max_epsilon": float("nan")}, "max_epsilon"),
    ({"max_epsilon": 0.0}, "max_epsilon"), ({"delta": 1.0}, "delta"), ({"seed": -1}, "seed"),
    ({"ledger": "ledger.jsonl"}, "ledger"),
    ({"strategy": FedAvg(fraction_train=0.5)}, "strategy"), ({"strategy": object()}, "strategy"),
])
def test_bad_arguments_name_the_argument(kw, name):
    args = dict(strategy=FedAvg(), num_clients=3, client_rate=0.5, l2_clip_norm=1.0,
                noise_multiplier=1.0) | kw
    strategy = args.pop("strategy")
    with pytest.raises(InvalidParameterError, match=name):
        ClientLevelDP(strategy, **args)


def test_ledger_delta_must_agree():
    ledger = Ledger.create(None, population_id="t", delta=1e-6)
    with pytest.raises(InvalidParameterError, match="delta"):
        ClientLevelDP(FedAvg(), num_clients=3, client_rate=0.5, l2_clip_norm=1.0,
                      noise_multiplier=1.0, ledger=ledger, delta=1e-5)
    dp = ClientLevelDP(FedAvg(), num_clients=3, client_rate=0.5, l2_clip_norm=1.0,
                       noise_multiplier=1.0, ledger=ledger)
    assert dp.ledger.delta == 1e-6
    with pytest.raises(InvalidParameterError, match="ledger"):
        ClientLevelDP(FedAvg(), num_clients=3, client_rate=0.5, l2_clip_norm=1.0,
                      noise_multiplier=1.0, ledger=Ledger.create(
                          None, population_id="t", delta=1e-5,
                          neighboring_relation="REPLACE_ONE"))


# --------------------------------------------------------------------------- run_simulation


@pytest.fixture(scope="module")
def simulated():
    """Stock FedAvg behind ClientLevelDP in Flower's simulation engine (3 nodes, 3 rounds,
    max_epsilon between the second and the third round's epsilon), zero updates."""
    pytest.importorskip("ray", reason=f"Flower's simulation engine needs Ray; {EXTRA}")
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    q, n, c, z = 2 / 3, 3, 1.0, 0.8
    e2, e3 = (float(privkit.epsilon(composed(q, z, r), 1e-5)) for r in (2, 3))
    out = {}
    server = ServerApp()

    @server.main()
    def main(grid, context):
        dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0, min_available_nodes=n),
                           num_clients=n, client_rate=q, l2_clip_norm=c, noise_multiplier=z,
                           max_epsilon=(e2 + e3) / 2)
        models = {}

        def record(r, arrays):
            models[r] = arrays["w"].numpy().astype(np.float64)

        result = dp.start(grid, ArrayRecord({"w": Array(np.zeros(D, np.float32))}),
                          num_rounds=3, timeout=120, evaluate_fn=record)
        out.update(result=result, models=models, dp=dp)

    client = ClientApp()

    @client.train()
    def train(msg, context):
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord(
            {"num-examples": 10})}), reply_to=msg)

    run_simulation(server, client, num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    assert out, "the ServerApp failed (see the log above)"
    return out | {"q": q, "n": n, "c": c, "z": z, "eps": (e2, e3)}


def test_simulation_adds_the_noise_and_stops(simulated):
    s = simulated
    models, metrics = s["models"], s["result"].train_metrics_clientapp
    want = s["z"] * s["c"] / (s["q"] * s["n"])
    for r in (1, 2):
        assert np.std(models[r] - models[r - 1]) == pytest.approx(want, rel=0.03)
    assert np.array_equal(models[3], models[2])  # round 3 would exceed max_epsilon
    assert metrics[2]["privkit-epsilon"] == pytest.approx(s["eps"][0], rel=1e-9)
    assert metrics[3]["privkit-budget-stopped"] == 1
    assert [k for _, k in s["dp"].ledger.composition(POPULATION).atoms] == [2]


def test_upcycled_even_rounds_are_free_behind_the_wrapper():
    from fl_examples.flower import UpcycledFedProx
    from fl_examples.flower.client import roster_reply

    def client(i, msg):
        if msg.metadata.message_type == "query":
            return roster_reply(msg, client=i, num_examples=20 + i)
        return replying(lambda j, s: np.full(s, 0.01))(i, msg)

    inner = UpcycledFedProx(3, proximal_mu=1.0, lam=0.42, fraction_evaluate=0.0, seed=0)
    dp = ClientLevelDP(inner, num_clients=3, client_rate=1.0, l2_clip_norm=10.0,
                       noise_multiplier=1e-9, seed=2)
    result, models = start(dp, LocalGrid(3, client), 4, np.zeros(8, np.float32))
    assert [n for _, n in dp.ledger.composition(POPULATION).atoms] == [2]  # rounds 1 and 3
    np.testing.assert_allclose(models[1] - models[0], 0.01, rtol=1e-4)  # the private mean
    c = result.train_metrics_clientapp[2]["privkit-extrapolation"]  # the even step
    np.testing.assert_allclose(models[2] - models[1], c * (models[1] - models[0]), atol=1e-7)
    assert result.train_metrics_clientapp[2]["privkit-epsilon"] == \
        result.train_metrics_clientapp[1]["privkit-epsilon"]
    # the inner strategy saw one synthetic reply: no client count that would read "1"
    assert "privkit-clients" not in result.train_metrics_clientapp[1]


def test_more_nodes_than_num_clients_is_a_one_line_error_before_any_charge():
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=3, client_rate=0.5,
                       l2_clip_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(RuntimeError, match=r"4 nodes connected but num_clients=3.*nothing was "
                                           r"charged") as info:
        start(dp, LocalGrid(4, replying(zeros)), 1)
    assert "\n" not in str(info.value)
    assert dp.charged_rounds() == 0


def test_fewer_nodes_wait_as_long_as_stated_then_fail_in_one_line(caplog):
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=5, client_rate=0.5,
                       l2_clip_norm=1.0, noise_multiplier=1.0, node_timeout=0.2)
    with pytest.raises(RuntimeError, match=r"only 3 of num_clients=5 nodes connected within "
                                           r"0.2 s"):
        start(dp, LocalGrid(3, replying(zeros)), 1)
    assert dp.charged_rounds() == 0


def test_info_logs_say_nothing_about_who_was_sampled(caplog):
    """The sample is secret: the number of sampled nodes stays out of INFO logs."""
    import logging

    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=6, client_rate=0.5,
                       l2_clip_norm=1.0, noise_multiplier=1.0, seed=3)
    with caplog.at_level(logging.INFO, logger="flwr"):
        _, _ = start(dp, LocalGrid(6, replying(zeros)), 2, w0=np.zeros(10, np.float32))
    info = [r.getMessage() for r in caplog.records
            if r.levelno >= logging.INFO and "ClientLevelDP" in r.getMessage()]
    assert info and not any("sampled" in m for m in info)
    # the stock strategy's own counts (its proposed cohort of 6, the one synthetic reply)
    # would contradict the wrapper: they are not logged
    every = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not any(m.startswith(("configure_train: Sampled", "aggregate_train: Received"))
                   for m in every), every
    assert any("released the noisy sum" in m for m in every)


def test_adaptive_clipping_is_charged_as_one_joint_release_per_round():
    n, q, z = 4, 0.5, 1.0
    ac = privkit.AdaptiveClipping(0.5, count_stddev=0.5, sampling_probability=q)
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=n, client_rate=q,
                       l2_clip_norm=1.0, noise_multiplier=z, adaptive=ac)
    start(dp, LocalGrid(n, replying(lambda i, s: np.full(s, 0.01 * (i + 1)))), 3,
          w0=np.zeros(10, np.float32))
    z_eff = (z ** -2 + 1.0 ** -2) ** -0.5
    assert dp.charged_rounds() == 3
    assert dp.epsilon() == pytest.approx(
        privkit.epsilon(composed(q, z_eff, 3), dp.ledger.delta).epsilon, rel=1e-9)
    assert dp.clip_norm != 1.0  # the clip norm moved towards the quantile
    rep = dp.report()
    assert rep["adaptive_clipping"]["joint_noise_multiplier"] == pytest.approx(z_eff)
    with pytest.raises(InvalidParameterError, match="adaptive"):
        ClientLevelDP(FedAvg(), num_clients=n, client_rate=0.2, l2_clip_norm=1.0,
                      noise_multiplier=z, adaptive=ac)
    with pytest.raises(InvalidParameterError, match="adaptive"):
        ClientLevelDP(FedAvg(), num_clients=n, client_rate=q, l2_clip_norm=1.0,
                      noise_multiplier=z, adaptive=ac, clipping="client")


def test_client_side_clipping_needs_the_mod_and_the_server_still_bounds_c():
    """The ClientApp clips (ClientSideClippingMod); a reply without its confirmation counts
    as zero, and the server re-clips, so an unclipped reply cannot exceed C either."""
    from flwr.app import Context

    from privkit.flower import ClientSideClippingMod
    from privkit.flower.central import CLIENT_CLIP_KEY

    mod = ClientSideClippingMod()
    seen = []

    def client(i, msg):
        seen.append(msg.content.config_records["config"][CLIENT_CLIP_KEY])
        inner = replying(lambda j, s: np.full(s, 1e6))
        if i == 0:  # a client that skips the mod: no confirmation, its update counts as zero
            return inner(i, msg)
        return mod(msg, Context(run_id=1, node_id=i, node_config={}, state=RecordDict(),
                                run_config={}), lambda m, c: inner(i, m))

    c = 0.5
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=3, client_rate=1.0,
                       l2_clip_norm=c, noise_multiplier=1e-9, seed=0, clipping="client")
    _, models = start(dp, LocalGrid(3, client), 1)
    step = models[1] - models[0]
    assert seen == [c, c, c]
    # two confirmed clients, each clipped to C in the same direction, divided by q N = 3
    assert np.linalg.norm(step) == pytest.approx(2 * c / 3, rel=1e-5)
    rep = dp.report()
    assert rep["clipping"] == "client" and any("client-side" in a for a in rep["assumptions"])


def test_report_states_trust_randomness_and_the_unamplified_epsilon():
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=4, client_rate=0.5,
                       l2_clip_norm=1.0, noise_multiplier=1.0)
    start(dp, LocalGrid(4, replying(zeros)), 2, w0=np.zeros(10, np.float32))
    rep = dp.report()
    assert rep["trust"].startswith("trusted aggregator") and rep["charged_rounds"] == 2
    assert rep["randomness"]["source"] == "os_csprng"
    u = rep["epsilon_unamplified"]
    assert u["expected_participations"] == 1
    assert u["epsilon_at_expected"] == pytest.approx(
        privkit.epsilon(privkit.GaussianDpEvent(1.0), 1e-5).epsilon)


def test_a_mod_the_wrapper_does_not_expect_is_a_warning_not_silent_noise(caplog):
    """ClientSideClippingMod on the clients while the wrapper clips on the server: every reply
    is an error, counted as zero; the run releases noise only. That is a WARNING (once per
    reason), naming the error, never silent."""
    import logging

    from flwr.app import Context

    from privkit.flower import ClientSideClippingMod

    mod = ClientSideClippingMod()

    def client(i, msg):
        ctx = Context(run_id=1, node_id=i, node_config={}, state=RecordDict(), run_config={})
        return mod(msg, ctx, lambda m, c: replying(zeros)(i, m))

    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=3, client_rate=1.0,
                       l2_clip_norm=1.0, noise_multiplier=1.0, seed=0)
    with caplog.at_level(logging.DEBUG, logger="flwr"):
        start(dp, LocalGrid(3, client), 3, w0=np.zeros(10, np.float32))
    warns = [r.getMessage() for r in caplog.records
             if r.levelno == logging.WARNING and "ClientLevelDP" in r.getMessage()]
    assert len(warns) == 1, warns  # once per reason, later rounds at DEBUG
    assert "every reply counted as zero" in warns[0] and "l2_clip_norm" in warns[0]
    assert dp.charged_rounds() == 3


def test_a_round_with_usable_replies_warns_nothing(caplog):
    import logging

    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=3, client_rate=1.0,
                       l2_clip_norm=1.0, noise_multiplier=1.0, seed=0)
    with caplog.at_level(logging.DEBUG, logger="flwr"):
        start(dp, LocalGrid(3, replying(zeros)), 2, w0=np.zeros(10, np.float32))
    assert not [r for r in caplog.records
                if r.levelno >= logging.WARNING and "ClientLevelDP" in r.getMessage()]


def test_the_report_gives_replace_one_beside_add_remove_and_coins_are_keyed_by_node():
    q, z = 0.5, 1.0
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=4, client_rate=q,
                       l2_clip_norm=1.0, noise_multiplier=z, seed=7)
    start(dp, LocalGrid(4, replying(zeros)), 3, w0=np.zeros(10, np.float32))
    rep = dp.report()
    ro = privkit.epsilon(composed(q, z, 3), dp.ledger.delta,
                         neighboring_relation="REPLACE_ONE").epsilon
    assert rep["epsilon_replace_one"] == pytest.approx(ro, rel=1e-9)
    assert rep["epsilon_replace_one"] > rep["epsilon"]
    assert "stddev / C" in rep["noise_multiplier_note"]
    # seeded coins: a node's coin depends on its id alone, never on who else is connected
    from privkit.seeds import SeedTree

    few = SeedTree(7).uniforms(2, "poisson-clients", [11, 40])[:, 0]
    many = SeedTree(7).uniforms(2, "poisson-clients", [3, 11, 25, 40])[:, 0]
    assert list(few) == [many[1], many[3]]
