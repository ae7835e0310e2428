"""DistributedDP and DistributedDpMod: distributed DP on Flower's own SecAgg+.

Most tests run Flower's real SecAgg+ protocol (``SecAggPlusWorkflow`` in ``DefaultWorkflow``,
``secaggplus_mod`` on the clients: key agreement, Shamir shares, masks, dropout recovery)
in-process: :class:`SecAggGrid` answers each message with a legacy ClientApp and a Context per
node, so a round takes a fraction of a second. One module fixture runs the same app in
Flower's ``run_simulation`` (Ray, about 20 s on two busy cores).

The clients' updates are functions of their node ids and their noise comes from seeded streams
(``noise_seed``), so the test recomputes each survivor's residues and checks that the sum the
server decodes is exactly their sum modulo 2^bits: updates and noise shares of the survivors
(a node that dropped out after masking included), nothing of the others.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import numpy as np
import pytest

EXTRA = "install the flower extra: pip install -e '.[flower]' from a checkout"
pytest.importorskip("flwr", reason=f"Flower is not installed; {EXTRA}")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.client import ClientApp, NumPyClient  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.common import ndarrays_to_parameters  # noqa: E402
from flwr.common.secure_aggregation.ndarrays_arithmetic import (  # noqa: E402
    factor_combine,
    factor_extract,
    parameters_mod,
    parameters_multiply,
)
from flwr.common.secure_aggregation.quantization import dequantize, quantize  # noqa: E402
from flwr.server import LegacyContext, ServerConfig  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow  # noqa: E402

from privkit.errors import InvalidParameterError, PrivkitError  # noqa: E402
from privkit.flower import (  # noqa: E402
    DistributedDP,
    DistributedDpMod,
    modular_sum_from_secaggplus,
    secaggplus_parameters,
    secaggplus_workflow,
)
from privkit.flower.distributed import (  # noqa: E402
    POPULATION,
    client_noise_stream,
    released_rate,
)
from privkit.ledger import Ledger  # noqa: E402
from privkit.mechanisms import DistributedSkellam  # noqa: E402
from privkit.mechanisms.distributed import secure_sum  # noqa: E402

DIM = 50
NOISE_SEED = 123


def update_of(node_id: int) -> np.ndarray:
    """A node's update: a fixed function of its id (the test recomputes it)."""
    return 0.05 * np.random.default_rng(node_id % 2**32).normal(size=DIM)


def mechanism(bits: int = 20, min_survivors: int = 3, noise: float = 400.0
              ) -> DistributedSkellam:
    return DistributedSkellam(l2_clip_norm=1.0, granularity=1e-3, noise_per_client=noise,
                              bits=bits, dim=DIM, min_survivors=min_survivors)


class _Client(NumPyClient):
    def __init__(self, node_id: int, pid: int, fail_fit: set[tuple[int, int]]) -> None:
        self.node_id, self.pid, self.fail_fit = node_id, pid, fail_fit

    def fit(self, parameters: Any, config: Any) -> Any:
        if (int(config["privkit-server-round"]), self.pid) in self.fail_fit:
            raise RuntimeError("dropped out before masking")
        w = parameters[0]
        return [(w + update_of(self.node_id)).astype(w.dtype)], 10, {"train-loss": 0.5}


def client_app(fail_fit: set[tuple[int, int]] = frozenset(),
               fail_unmask: set[tuple[int, int]] = frozenset(), *,
               mods_order: str = "right", own: DistributedSkellam | None = None) -> ClientApp:
    """The ClientApp under test: ``fail_fit`` (round, partition) raise while training (before
    masking), ``fail_unmask`` in SecAgg+'s unmask stage (after their masked vectors were
    sent)."""

    def dropper(msg: Message, ctx: Context, call_next: Any) -> Message:
        cfg = msg.content.config_records.get("secaggplus_configs")
        pid = int(ctx.node_config["partition-id"])
        if cfg is not None and cfg.get("stage") == "unmask" and \
                (int(msg.metadata.group_id), pid) in fail_unmask:
            raise RuntimeError("dropped out after masking")
        return call_next(msg, ctx)

    mod = DistributedDpMod(own, noise_seed=NOISE_SEED)
    mods = [dropper, secaggplus_mod, mod] if mods_order == "right" else [dropper, mod,
                                                                          secaggplus_mod]

    def client_fn(context: Context) -> Any:
        return _Client(context.node_id, int(context.node_config["partition-id"]),
                       set(fail_fit)).to_client()

    return ClientApp(client_fn=client_fn, mods=mods)


class SecAggGrid:
    """A legacy Grid answered in-process by ``app`` with one Context per node (its SecAgg+
    state persists across stages); each message is delivered as a copy (Flower serialises
    it), and an exception in the app is an error reply, as Flower's runtime makes it."""

    class _Run:
        run_id = 1

    def __init__(self, n: int, app: ClientApp) -> None:
        self.ids = [4000 + 17 * i for i in range(n)]
        self.app, self.run = app, self._Run()
        self.errors: list[str] = []  # the reasons of the error replies
        self.contexts = {nid: Context(run_id=1, node_id=nid, node_config={"partition-id": i},
                                      state=RecordDict(), run_config={})
                         for i, nid in enumerate(self.ids)}

    def get_node_ids(self) -> list[int]:
        return list(self.ids)

    def send_and_receive(self, messages: Any, *, timeout: Any = None) -> list[Message]:
        out = []
        for m in messages:  # a copy each: the workflow shares one content between messages,
            m = copy.deepcopy(m)  # which Flower's transport serialises apart
            try:
                out.append(self.app(m, self.contexts[m.metadata.dst_node_id]))
            except Exception as exc:  # noqa: BLE001 - the runtime's behaviour
                self.errors.append(str(exc))
                out.append(Message(Error(code=0, reason=str(exc)), reply_to=m))
        return out


def run_rounds(grid: Any, dp: DistributedDP, rounds: int, *,
               workflow: Any = None) -> dict[int, np.ndarray]:
    """Run ``rounds`` SecAgg+ rounds; returns the global model after each (0: initial)."""
    models: dict[int, np.ndarray] = {}
    inner = dp.strategy

    def record(r: int, params: Any, config: Any) -> None:
        models[r] = np.array(params[0], dtype=np.float64)
        return None

    inner.evaluate_fn = record
    ctx = LegacyContext(context=Context(run_id=1, node_id=0, node_config={},
                                        state=RecordDict(), run_config={}),
                        config=ServerConfig(num_rounds=rounds), strategy=dp)
    wf = workflow or secaggplus_workflow(int(dp.mechanism.bits))
    DefaultWorkflow(fit_workflow=wf)(grid, ctx)
    return models


def fedavg(n: int) -> FedAvg:
    return FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_available_clients=n,
                  min_fit_clients=2,
                  initial_parameters=ndarrays_to_parameters([np.zeros(DIM, np.float32)]))


def encoded(dp: DistributedDP, server_round: int, nodes: list[int]) -> np.ndarray:
    """The survivors' residues summed modulo 2^bits, recomputed from their ids and streams."""
    seed = dp.rounds[server_round]["rotation_seed"]
    return secure_sum([dp.mechanism.encode(update_of(nid), rng=client_noise_stream(
        NOISE_SEED, server_round, nid), rotation_seed=seed) for nid in nodes],
        int(dp.mechanism.bits))


# --------------------------------------------------------------------------- the arithmetic
@pytest.mark.parametrize("bits", [2, 8, 16, 20, 31])
def test_secaggplus_quantisation_carries_residues_exactly(bits: int) -> None:
    """Flower's own quantise / weight / dequantise code (masks cancel in Z_M and are left
    out) under secaggplus_parameters: the strategy's vector inverts to the exact sum modulo
    2^bits, for edge residues and many clients."""
    p = secaggplus_parameters(bits)
    m, t, c = p["modulus_range"], p["quantization_range"], p["clipping_range"]
    rng = np.random.default_rng(bits)
    for n in (k for k in (2, 3, 7, 100) if k < m):  # SecAgg+ needs n < 2^bits
        ys = [rng.integers(0, m, 64, dtype=np.uint64) for _ in range(n)]
        ys[0][:2] = [0, m - 1]
        ys[1][:2] = [m - 1, m - 1]
        vecs = []
        for y in ys:  # the client side of secaggplus_mod, weight 1
            q_ratio = round(1 / p["max_weight"] * t)
            x = parameters_multiply([y.astype(np.float64) - c], q_ratio / t)
            vecs.append(factor_combine(q_ratio, quantize(x, c, t)))
        total = parameters_mod([np.sum([v[i].astype(np.int64) for v in vecs], axis=0)
                                for i in range(2)], m)
        qt, recon = factor_extract(total)  # the server side of SecAggPlusWorkflow
        agg = dequantize(recon, c, t)[0]
        agg += -(n - 1) * c
        agg *= t / qt
        assert np.array_equal(modular_sum_from_secaggplus(agg, n, bits),
                              secure_sum(ys, bits))


def test_a_vector_that_is_not_an_exact_sum_is_refused() -> None:
    """The inversion checks what it returns: SecAgg+'s default quantisation (floats in
    [-8, 8] scaled to 2^22), or a wrong survivors count, is not taken for a modular sum."""
    with pytest.raises(PrivkitError, match="secaggplus_parameters"):
        modular_sum_from_secaggplus(np.array([0.123, -3.7]), 3, 16)
    m, t = 1 << 8, 255
    v = (np.array([5.0, 9.0]) - 3 * t / 2) * (t / ((3 * t) % m))
    with pytest.raises(PrivkitError):
        modular_sum_from_secaggplus(v, 4, 8)
    with pytest.raises(InvalidParameterError, match="bits"):
        secaggplus_parameters(32)


def test_released_rate_is_the_trainers() -> None:
    """One function prices a released round in the trainers and in Flower (the library's);
    its value is checked against the conditional inclusion probability in the trainer tests."""
    from fl_examples.core.distributed import released_rate as trainers
    from privkit.accountants.distributed import released_rate as library

    assert released_rate is library and trainers is library
    assert round(released_rate(2000, 0.05, 78), 5) == 0.05011


# --------------------------------------------------------------------------- in-process SecAgg+
def test_decoded_sum_is_exactly_the_survivors_updates_and_noise() -> None:
    """Round 1: node 0 drops out before masking, node 1 after (its masked vector is in the
    sum; SecAgg+ recovers its mask): 4 survivors >= 3, released, and the modular sum is
    exactly the survivors' residues (updates and noise shares). Round 2: three drop out before
    masking, 2 survivors < 3: refused, nothing released, the model unchanged, the round
    charged (before its messages left)."""
    grid = SecAggGrid(5, client_app(fail_fit={(1, 0), (2, 0), (2, 2), (2, 3)},
                                    fail_unmask={(1, 1)}))
    dp = DistributedDP(fedavg(5), num_clients=5, client_rate=1.0, mechanism=mechanism(),
                       seed=7)
    models = run_rounds(grid, dp, 2)
    r1, r2 = dp.rounds[1], dp.rounds[2]
    assert r1["status"] == "released" and r1["survivors"] == 4
    assert r1["nodes"] == sorted(grid.ids[1:])  # node 1 dropped after masking: counted
    # exact: the survivors' updates and noise, nothing of node 0
    assert np.array_equal(dp.last_modular_sum, encoded(dp, 1, r1["nodes"]))
    want = dp.mechanism.decode(dp.last_modular_sum, survivors=4, divisor=5.0,
                               rotation_seed=r1["rotation_seed"])
    np.testing.assert_allclose(models[1] - models[0], want, atol=1e-6)
    true_mean = sum(update_of(nid) for nid in r1["nodes"]) / 5
    assert np.abs(models[1] - models[0] - true_mean).max() < 0.05  # noise ~ gamma sqrt(4 mu)/5
    assert r2 == {"status": "refused", "survivors": 2}
    np.testing.assert_array_equal(models[2], models[1])
    assert [k for _, k in dp.ledger.composition(POPULATION).atoms] == [2]  # both charged


def test_noise_disabled_the_sum_is_the_survivors_rounded_updates() -> None:
    """With the noise off (the mechanism's test switch, on both ends), the decoded sum is the
    survivors' rounded updates, exactly in integers."""
    quiet = DistributedSkellam(l2_clip_norm=1.0, granularity=1e-3, noise_per_client=400.0,
                               bits=20, dim=DIM, min_survivors=3, _noise=False)
    grid = SecAggGrid(4, client_app(own=quiet))
    dp = DistributedDP(fedavg(4), num_clients=4, client_rate=1.0, mechanism=quiet, seed=3)
    run_rounds(grid, dp, 1)
    r = dp.rounds[1]
    assert r["status"] == "released" and r["survivors"] == 4
    assert np.array_equal(dp.last_modular_sum, encoded(dp, 1, r["nodes"]))


def test_a_cohort_below_min_survivors_is_skipped_and_not_charged() -> None:
    """Poisson sampling at q = 0.3 of 4 nodes with min_survivors 3: a round whose cohort is
    smaller sends nothing and charges nothing; a released round is charged at q' > q."""
    grid = SecAggGrid(4, client_app())
    dp = DistributedDP(fedavg(4), num_clients=4, client_rate=0.3, mechanism=mechanism(), seed=1)
    run_rounds(grid, dp, 6)
    status = [dp.rounds[r]["status"] for r in range(1, 7)]
    assert "skipped" in status
    assert dp.charged_rounds() == status.count("released") + status.count("refused")
    assert dp.mechanism.sampling_probability == released_rate(4, 0.3, 3) > 0.3


def test_the_mod_must_run_inside_secaggplus_mod() -> None:
    """Outside secaggplus_mod (the wrong order, or without it) the mod refuses, naming the
    order; the node's reply is an error, SecAgg+ counts it as dropped, nothing is summed."""
    grid = SecAggGrid(4, client_app(mods_order="wrong"))
    dp = DistributedDP(fedavg(4), num_clients=4, client_rate=1.0, mechanism=mechanism(), seed=2)
    run_rounds(grid, dp, 1)
    assert dp.rounds[1] == {"status": "sent"} and dp.last_modular_sum is None
    assert grid.errors and all("mods=[secaggplus_mod, DistributedDpMod()]" in e
                               for e in grid.errors)
    app = ClientApp(client_fn=lambda c: _Client(1, 0, set()).to_client(),
                    mods=[DistributedDpMod()])
    from flwr.app.message_type import MessageType
    from flwr.common import FitIns
    from flwr.compat.common import recorddict_compat as compat

    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(
        [np.zeros(DIM)]), {}), True)
    msg = Message(content, dst_node_id=1, message_type=MessageType.TRAIN)
    with pytest.raises(PrivkitError, match="inside Flower's secaggplus_mod"):
        app(msg, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                         run_config={}))


def test_secaggplus_configured_otherwise_is_refused_by_the_clients() -> None:
    """Stock SecAgg+ quantisation (floats clipped to [-8, 8] on a 2^22 grid) would not carry
    the residues: every client refuses, naming the parameter; nothing is released."""
    grid = SecAggGrid(4, client_app())
    dp = DistributedDP(fedavg(4), num_clients=4, client_rate=1.0, mechanism=mechanism(), seed=2)
    run_rounds(grid, dp, 1, workflow=SecAggPlusWorkflow(num_shares=1.0,
                                                         reconstruction_threshold=0.5))
    assert dp.last_modular_sum is None and dp.rounds[1] == {"status": "sent"}
    assert len(grid.errors) == 4 and all("SecAgg+'s max_weight is 1000.0" in e
                                         for e in grid.errors)


def test_report_states_trust_relation_bits_and_both_epsilons() -> None:
    grid = SecAggGrid(3, client_app())
    dp = DistributedDP(fedavg(3), num_clients=3, client_rate=1.0,
                       mechanism=mechanism(min_survivors=2), seed=4)
    run_rounds(grid, dp, 2)
    rep = dp.report()
    assert rep["charged_rounds"] == rep["released_rounds"] == 2
    assert "honest-but-curious" in rep["trust"] and "SecAgg+" in rep["assumptions"][1]
    assert rep["neighboring_relation"].startswith("zero-out")
    assert rep["epsilon_replace_one"] > rep["epsilon"] > 0
    # every node in every round: the unamplified epsilon is the same composition
    assert rep["epsilon_unamplified"]["epsilon_every_round"] == pytest.approx(rep["epsilon"])
    assert rep["bits"] == 20 and rep["min_survivors"] == 2 and rep["wrap_bound_per_round"] < 1e-6


@pytest.mark.parametrize("kw, name", [
    ({"mechanism": mechanism(bits=40)}, "mechanism"),
    ({"mechanism": mechanism(min_survivors=1)}, "mechanism"),
    ({"mechanism": mechanism(min_survivors=9)}, "mechanism"),
    ({"client_rate": 0.0}, "client_rate"),
    ({"ledger": Ledger.create(None, population_id="x", delta=1e-5)}, "ledger"),
])
def test_bad_arguments_name_the_argument(kw: dict[str, Any], name: str) -> None:
    args = dict(num_clients=5, client_rate=1.0, mechanism=mechanism()) | kw
    with pytest.raises(InvalidParameterError) as err:
        DistributedDP(fedavg(5), **args)
    assert err.value.name == name


# --------------------------------------------------------------------------- run_simulation
@pytest.fixture(scope="module")
def simulated() -> dict[str, Any]:
    """The same app in Flower's simulation engine: 4 SuperNodes, 1 round, partition 0 drops
    out before masking, partition 1 after."""
    pytest.importorskip("ray", reason=f"Flower's simulation engine needs Ray; {EXTRA}")
    from flwr.server import ServerApp
    from flwr.simulation import run_simulation

    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    out: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def main(grid: Any, context: Any) -> None:
        dp = DistributedDP(fedavg(4), num_clients=4, client_rate=1.0, mechanism=mechanism(),
                           seed=11)
        ctx = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=dp)
        DefaultWorkflow(fit_workflow=secaggplus_workflow(20))(grid, ctx)
        out["dp"] = dp

    run_simulation(server, client_app(fail_fit={(1, 0)}, fail_unmask={(1, 1)}),
                   num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    assert out, "the ServerApp failed (see the log above)"
    return out


def test_in_flowers_simulation_engine(simulated: dict[str, Any]) -> None:
    dp = simulated["dp"]
    r = dp.rounds[1]
    assert r["status"] == "released" and r["survivors"] == 3
    assert np.array_equal(dp.last_modular_sum, encoded(dp, 1, r["nodes"]))
