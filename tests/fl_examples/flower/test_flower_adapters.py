"""Flower adapters: strategy, mods and ledger in Flower's simulation engine, and equivalence
with privkit's batched simulator.

One ``run_simulation`` (Ray) serves the module through a module-scoped fixture (a plain, an
output-perturbation and a DP-REC run on the same three nodes); it takes about 20-30 s on two
CPU cores, most of it Ray and actor start-up.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

EXTRA = "install the flower extra: pip install -e '.[flower]' from a checkout"
pytest.importorskip("flwr", reason=f"Flower is not installed; {EXTRA}")
pytest.importorskip("ray", reason=f"Flower's simulation engine needs Ray; {EXTRA}")

from flwr.app import (  # noqa: E402
    ArrayRecord,
    ConfigRecord,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import ServerApp  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from fl_examples.flower import (  # noqa: E402
    PrivkitFedProx,
    UpcycledFedProx,
    initial_arrays,
    load_federated,
    make_client_app,
)
from fl_examples.flower.client import make_model  # noqa: E402
from fl_examples.upcycled import UpcycledConfig, run_algorithm  # noqa: E402
from privkit.errors import InvalidParameterError  # noqa: E402
from privkit.flower import (  # noqa: E402
    DpSgdMod,
    ObjectivePerturbationMod,
    OutputPerturbationMod,
    PrivacySettings,
    RecMod,
)
from privkit.flower import records as keys  # noqa: E402
from privkit.ledger import Ledger  # noqa: E402

SPEC, SEED, K, ROUNDS = "synthetic:0.5,0.5", 3, 3, 4
SOLVER = dict(local_epochs=2, batch_size=16, lr=0.05, momentum=0.5, seed=SEED)
DPSGD = dict(l2_clip_norm=1.0, noise_multiplier=0.8, batch_size=8)
BACKEND = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}


class RecordingGrid:
    """A Grid that records every message it sends (type and config) before passing it on,
    and every train reply's metrics."""

    def __init__(self, grid):
        self._grid, self.sent, self.train_replies = grid, [], []

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            config = m.content.config_records
            cfg = dict(next(iter(config.values()))) if config else {}
            self.sent.append((m.metadata.message_type, cfg))
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self.train_replies += [
            (r.error.reason if r.has_error() else dict(r.content["metrics"]))
            for r in replies if r.metadata.message_type.startswith("train")]
        return replies


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One simulation (Ray starts once): a plain run, then a private run, on the same nodes.

    The private run calls the ``train.private`` function, which the ClientApp registers with
    the output-perturbation mod; the plain run calls the plain ``train``.
    """
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # offline: no usage reports
    ds = load_federated(SPEC, SEED, K)
    path = tmp_path_factory.mktemp("flower") / "ledger.jsonl"
    ledger = Ledger.create(path, population_id="flower-test", delta=1e-3,
                           neighboring_relation="replace-one")  # output perturbation's 2 tau
    rec_ledger = Ledger.create(None, population_id="flower-rec", delta=1e-3)
    strategies = {
        "plain": UpcycledFedProx(K, proximal_mu=1.0, lam=0.42, fraction_train=0.67,
                                 stragglers=0.5, fraction_evaluate=0.0, **SOLVER),
        "private": UpcycledFedProx(
            K, proximal_mu=1.0, lam=0.42, fraction_train=1.0, fraction_evaluate=1.0,
            privacy=PrivacySettings("output", l2_clip_norm=10.0, stddev=0.01), ledger=ledger,
            train_action="private", **SOLVER),
        "rec": UpcycledFedProx(
            K, proximal_mu=1.0, lam=0.42, fraction_train=1.0, fraction_evaluate=0.0,
            privacy=PrivacySettings("rec", l2_clip_norm=1.0, stddev=0.5, bits=8),
            ledger=rec_ledger, train_action="rec", **SOLVER),
        "dpsgd": PrivkitFedProx(K, proximal_mu=1.0, fraction_train=1.0, fraction_evaluate=0.0,
                                train_action="dpsgd", **SOLVER),
    }
    out = {}
    app = ServerApp()

    @app.main()
    def main(grid, context):
        for name, strategy in strategies.items():
            rec = RecordingGrid(grid)
            result = strategy.start(
                grid=rec, initial_arrays=initial_arrays(make_model("logreg", ds), SEED),
                num_rounds=ROUNDS, timeout=120)
            out[name] = (result, rec, strategy)

    client = make_client_app(dataset=SPEC, seed=SEED, num_clients=K,
                             train_actions={"private": [OutputPerturbationMod()],
                                            "rec": [RecMod()],
                                            "dpsgd": [DpSgdMod(**DPSGD)]})
    run_simulation(app, client, num_supernodes=K, backend_config=BACKEND)
    assert set(out) == set(strategies), "the ServerApp failed (see the log above)"
    return out, path


@pytest.fixture(scope="module")
def private_run(runs):
    out, path = runs
    result, grid, strategy = out["private"]
    return result, grid, path, strategy


@pytest.fixture(scope="module")
def plain_run(runs):
    result, grid, _ = runs[0]["plain"]
    return result, grid


# --------------------------------------------------------------------------- simulations


def test_private_upcycled_run_completes(private_run):
    result, _, _, strategy = private_run
    assert strategy.sizes == load_federated(SPEC, SEED, K).train_sizes.tolist()
    final = {k: v.numpy() for k, v in result.arrays.items()}
    assert set(final) == {"weight", "bias"}
    assert all(np.isfinite(v).all() for v in final.values())
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3, 4]
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2, 3, 4]
    assert 0.0 <= result.evaluate_metrics_clientapp[4]["accuracy"] <= 1.0


def test_even_rounds_send_no_train_messages(private_run):
    _, grid, _, _ = private_run
    train = [cfg for kind, cfg in grid.sent if kind.split(".")[0] == "train"]
    assert {kind for kind, _ in grid.sent} == {"query", "train.private", "evaluate"}
    rounds = sorted(cfg[keys.SERVER_ROUND] for cfg in train)
    assert rounds == [1, 1, 1, 3, 3, 3]
    assert {cfg[keys.DATA_ROUND] for cfg in train if cfg[keys.SERVER_ROUND] == 3} == {2}
    # every train message carried the privacy settings the clients' mods apply
    assert all(cfg[keys.PRIVACY_PREFIX + "kind"] == "output" for cfg in train)


def test_ledger_charges_only_odd_rounds(private_run):
    result, _, path, _ = private_run
    entries = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    spends = [e for e in entries if "client_id" in e]
    assert sorted((e["client_id"], e["round"]) for e in spends) == sorted(
        (str(c), r) for c in range(K) for r in (1, 3))
    eps = {r: m["privkit-epsilon"] for r, m in result.train_metrics_clientapp.items()}
    assert all(e > 0 for e in eps[1]) and eps[2] == eps[1]  # the even round is free
    assert all(b > a for a, b in zip(eps[2], eps[3])) and eps[4] == eps[3]
    replay = Ledger.open(path).epsilons([str(c) for c in range(K)])
    assert eps[4] == pytest.approx([replay[str(c)] for c in range(K)], rel=1e-12)
    assert result.train_metrics_clientapp[4]["privkit-epsilon-max"] == pytest.approx(max(eps[4]))


def test_flower_matches_the_batched_simulator(plain_run):
    result, grid = plain_run
    assert not [kind for kind, _ in grid.sent if kind.split(".")[0] == "evaluate"]
    ds = load_federated(SPEC, SEED, K)
    cfg = UpcycledConfig(dataset=SPEC, mu=1.0, lam=0.42, iterations=ROUNDS, fraction=0.67,
                         stragglers=0.5, local_epochs=2, batch_size=16, lr=0.05, momentum=0.5,
                         seed=SEED, device="cpu")
    reference = run_algorithm("upcycled", cfg, ds, iterations=ROUNDS)["model"]
    for name, array in result.arrays.items():
        got, want = array.numpy(), reference[name].numpy()
        assert np.abs(want).max() > 0.05  # the model moved
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_rec_run_decodes_seed_and_indices(runs):
    result, grid, strategy = runs[0]["rec"]
    rounds = sorted(cfg[keys.SERVER_ROUND] for kind, cfg in grid.sent if kind == "train.rec")
    assert rounds == [1, 1, 1, 3, 3, 3]
    metrics = result.train_metrics_clientapp
    # 3 clients x (128-bit seed + 2 groups (weight, bias) x 8 bits) per odd round
    assert [metrics[r][keys.UPLINK_BITS] for r in (1, 3)] == [3 * 144, 3 * 144]
    assert metrics[1]["privkit-clients"] == 3
    eps = [metrics[r]["privkit-epsilon"] for r in (1, 2, 3, 4)]
    assert all(e > 0 for e in eps[0]) and eps[1] == eps[0] and eps[3] == eps[2] != eps[0]
    assert [n for _, n in strategy.accountant.ledger.composition("0").atoms] == [2]
    assert all(np.isfinite(v.numpy()).all() for v in result.arrays.values())


# --------------------------------------------------------------------------- mods, no Ray


def _message(content, kind="train"):
    meta = Metadata(run_id=1, message_id="m1", src_node_id=0, dst_node_id=7,
                    reply_to_message_id="", group_id="", created_at=time.time(), ttl=600.0,
                    message_type=kind)
    return Message(content=content, metadata=meta)


def _train_message(arrays, settings):
    config = {keys.SERVER_ROUND: 1, keys.PROXIMAL_MU: 1.0, keys.LR: 0.05, keys.BATCH_SIZE: 16,
              keys.MOMENTUM: 0.5, keys.CLIENT: 0, keys.CLIENT_SIZE: 100}
    if settings is not None:
        config |= settings.to_config()
    return _message(RecordDict({keys.ARRAYS: keys.to_record(arrays),
                                keys.CONFIG: ConfigRecord(config)}))


def _echo_app(msg, context):
    """A ClientApp that returns the global model unchanged (no training happened)."""
    return Message(RecordDict({keys.ARRAYS: msg.content[keys.ARRAYS],
                               keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 100})}),
                   reply_to=msg)


def _model(value=0.5):
    return {"weight": np.full((4, 3), value, np.float32), "bias": np.zeros(3, np.float32)}


@pytest.mark.parametrize("clip, model", [("update", _model()), ("model", _model(0.0))])
def test_unchanged_model_does_not_crash_clipping(clip, model):
    # clip="update": the update of an unchanged model is zero; clip="model": a zero model.
    settings = PrivacySettings("output", l2_clip_norm=1.0, stddev=0.1, clip=clip)
    reply = OutputPerturbationMod(noise_seed=0)(_train_message(model, settings), None, _echo_app)
    assert not reply.has_error()
    out = keys.from_record(reply.content[keys.ARRAYS])
    noise = np.concatenate([(out[k] - model[k]).ravel() for k in model])
    assert np.isfinite(noise).all() and 0.05 < noise.std() < 0.2  # N(0, 0.1^2) was added
    expected = settings.mechanism(100, proximal_mu=1.0, batch_size=16, momentum=0.5)
    assert reply.content[keys.METRICS][keys.NOISE_MULTIPLIER] == expected.noise_multiplier


def test_output_mod_clips_before_noise():
    settings = PrivacySettings("output", l2_clip_norm=1.0, stddev=1e-6)
    reply = OutputPerturbationMod(noise_seed=0)(_train_message(_model(3.0), settings), None,
                                                _echo_app)
    out = keys.from_record(reply.content[keys.ARRAYS])
    assert np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in out.values())) \
        == pytest.approx(1.0, abs=1e-4)


def test_mods_fail_closed_without_privacy_settings():
    called = []

    def app(msg, context):
        called.append(msg)
        return _echo_app(msg, context)

    for mod in (OutputPerturbationMod(), ObjectivePerturbationMod()):
        reply = mod(_train_message(_model(), None), None, app)
        assert reply.has_error() and "privacy" in reply.error.reason
    assert not called  # the model was never trained, so never released
    wrong = PrivacySettings("objective", alpha=20.0, allow_unproven=True)
    reply = OutputPerturbationMod()(_train_message(_model(), wrong), None, app)
    assert reply.has_error() and "objective" in reply.error.reason
    # other message types pass through untouched
    evaluate = _message(RecordDict({keys.ARRAYS: keys.to_record(_model()),
                                    keys.CONFIG: ConfigRecord({})}), kind="evaluate")
    reply = OutputPerturbationMod()(evaluate, None, _echo_app)
    assert not reply.has_error()
    assert np.array_equal(keys.from_record(reply.content[keys.ARRAYS])["weight"],
                          _model()["weight"])


def test_objective_mod_hands_the_linear_term_to_training():
    settings = PrivacySettings("objective", alpha=20.0, allow_unproven=True)
    seen = {}

    def app(msg, context):
        seen.update(keys.from_record(msg.content[keys.LINEAR_TERM]))
        reply = _echo_app(msg, context)
        reply.content[keys.METRICS][keys.LINEAR_TERM_USED] = 1
        return reply

    reply = ObjectivePerturbationMod(noise_seed=1)(_train_message(_model(), settings), None, app)
    assert not reply.has_error()
    assert {k: v.shape for k, v in seen.items()} == {"weight": (4, 3), "bias": (3,)}
    assert np.linalg.norm(np.concatenate([v.ravel() for v in seen.values()])) > 0
    assert reply.content[keys.METRICS][keys.STEP_EPSILON] > 0
    # an app that ignores the term does not get its model released
    ignored = ObjectivePerturbationMod()(_train_message(_model(), settings), None, _echo_app)
    assert ignored.has_error() and keys.LINEAR_TERM_USED in ignored.error.reason


def test_rec_mod_and_server_decoding_round_trip():
    from privkit.mechanisms.rec import RecMessage, decode

    settings = PrivacySettings("rec", l2_clip_norm=1.0, stddev=0.5, bits=6)
    w_bar = _model(0.5)

    def app(msg, context):  # "trains": w = w_bar + 0.1
        arrays = keys.to_record({k: v + np.float32(0.1) for k, v in w_bar.items()})
        return Message(RecordDict({keys.ARRAYS: arrays,
                                   keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 100})}),
                       reply_to=msg)

    reply = RecMod(noise_seed=3)(_train_message(w_bar, settings), None, app)
    assert not reply.has_error()
    record = reply.content.array_records[keys.ARRAYS]
    assert list(record) == [keys.REC_MESSAGE]
    payload = record[keys.REC_MESSAGE].numpy().tobytes()
    message = RecMessage.from_bytes(payload)
    assert reply.content[keys.METRICS][keys.UPLINK_BITS] == message.size_bits() == 128 + 2 * 6
    strategy = PrivkitFedProx(3, privacy=settings,
                              ledger=Ledger.create(None, population_id="p", delta=1e-3))
    decoded, bits = strategy._decode_rec(0, record, w_bar)
    expected = decode(message, {k: v.shape for k, v in w_bar.items()})
    for k in w_bar:
        np.testing.assert_allclose(decoded[k], w_bar[k] + expected[k].numpy(), rtol=1e-6)
    # a message priced otherwise than the charged event is refused
    other = PrivkitFedProx(3, privacy=PrivacySettings("rec", l2_clip_norm=2.0, stddev=0.5, bits=6),
                           ledger=Ledger.create(None, population_id="p", delta=1e-3))
    assert other._decode_rec(0, record, w_bar) is None


def test_settings_round_trip_and_validation():
    s = PrivacySettings("output", l2_clip_norm=2.0, stddev=0.5, sensitivity="paper",
                        clip="update")
    assert PrivacySettings.from_config(ConfigRecord(s.to_config())) == s
    assert PrivacySettings.from_config({"lr": 0.1}) is None
    for kw, name in [({"kind": "laplace"}, "privacy"), ({"kind": "output", "clip": "x"}, "clip"),
                     ({"kind": "output", "stddev": float("nan")}, "stddev")]:
        with pytest.raises(InvalidParameterError, match=name):
            PrivacySettings(**kw)


def test_strategy_validates_its_arguments():
    with pytest.raises(InvalidParameterError, match="ledger"):
        PrivkitFedProx(3, privacy=PrivacySettings("output"))
    with pytest.raises(InvalidParameterError, match="stragglers"):
        PrivkitFedProx(3, stragglers=1.0)
    with pytest.raises(InvalidParameterError, match="lam"):
        UpcycledFedProx(3, proximal_mu=1.0, lam=0.0)
    with pytest.raises(InvalidParameterError, match="batch_order"):
        UpcycledFedProx(3, batch_order="random")
    assert isinstance(initial_arrays(make_model("logreg", load_federated(SPEC, SEED, K)), 0),
                      ArrayRecord)


def test_central_evaluation_equals_weighted_federated_evaluation():
    """The server's evaluation on the union of the test splits is the clients' evaluation
    weighted by test size (so ``evaluation = "server"`` reports the same accuracy)."""
    import torch

    from fl_examples.core.data import Split
    from fl_examples.core.rounds import evaluate, to_client_data
    from fl_examples.flower import central_evaluate_fn

    ds = load_federated("digits@10", 0)
    model = make_model("logreg", ds)
    arrays = initial_arrays(model, 3)
    w = keys.to_torch(arrays)
    w = {k: v + 0.1 * torch.randn_like(v) for k, v in w.items()}  # not a trivial model
    arrays = keys.to_record({k: v.numpy() for k, v in w.items()})
    got = central_evaluate_fn(model, ds)(1, arrays)
    accs, losses, sizes = [], [], []
    for c in range(ds.num_clients):
        data = to_client_data(ds.padded(Split.TEST, clients=[c]), torch.device("cpu"),
                              torch.float32)
        loss, acc = evaluate(model, keys.to_torch(arrays), data)
        accs.append(acc), losses.append(loss), sizes.append(int(ds.test_sizes[c]))
    n = sum(sizes)
    assert got[keys.NUM_EXAMPLES] == n
    assert got["accuracy"] == pytest.approx(np.dot(accs, sizes) / n, abs=1e-12)
    assert got["loss"] == pytest.approx(np.dot(losses, sizes) / n, rel=1e-6)
    assert 0.0 < got["accuracy"] < 1.0


def test_dpsgd_mod_behind_a_strategy_runs_dpsgd_in_the_client_app(runs):
    """``train.dpsgd`` (the ClientApp's training behind DpSgdMod): every reply reports the
    DP-SGD steps epochs * ceil(n / b) and the noise multiplier, and the model stays finite."""
    from fl_examples.core.dpsgd import steps_per_client

    result, grid, strategy = runs[0]["dpsgd"]
    ds = load_federated(SPEC, SEED, K)
    want = steps_per_client(ds.train_sizes, [SOLVER["local_epochs"]] * K,
                            DPSGD["batch_size"]).tolist()
    assert want and min(want) > 0
    assert [t for t, _ in grid.sent].count("train.dpsgd") == K * ROUNDS
    replies = grid.train_replies
    assert len(replies) == K * ROUNDS and all(isinstance(m, dict) for m in replies), replies
    size_steps = dict(zip(ds.train_sizes.tolist(), want))
    for m in replies:
        assert m[keys.NOISE_MULTIPLIER] == 0.8
        assert m[keys.DPSGD_STEPS] == size_steps[m[keys.NUM_EXAMPLES]]
    w = keys.to_torch(result.arrays)
    assert all(bool(v.isfinite().all()) for v in w.values())
