"""Canary clients inside privkit.flower's server wrappers (CanaryClients).

Driven with an in-process grid (a function per node answers, no Ray), as the Flower tests do.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("flwr", reason="Flower is not installed; pip install -e '.[flower]'")

from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

import privkit  # noqa: E402
from privkit.audit import CanaryClients, make_canaries  # noqa: E402
from privkit.audit.canaries import CANARY_NOTE  # noqa: E402
from privkit.errors import InvalidParameterError  # noqa: E402
from privkit.flower import BandedClientLevelDP, ClientLevelDP  # noqa: E402

D = 400


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """Flower's messages read the run id of the current task; outside a run there is none."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)


class Grid:
    """``n`` nodes answering in-process: each returns the global model plus ``update``."""

    def __init__(self, n, update):
        self.ids, self.update = [1000 + 7 * i for i in range(n)], update

    def get_node_ids(self):
        return list(self.ids)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for msg in messages:
            w = msg.content["arrays"]["w"].numpy()
            arrays = ArrayRecord({"w": Array((w + self.update(w.shape)).astype(np.float32))})
            out.append(Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(
                {"num-examples": 10})}), reply_to=msg))
        return out


def start(dp, n, rounds, update=lambda s: np.zeros(s)):
    models = {}

    def record(r, arrays):
        models[r] = arrays["w"].numpy().astype(np.float64)

    dp.start(Grid(n, update), ArrayRecord({"w": Array(np.zeros(D, np.float32))}),
             num_rounds=rounds, evaluate_fn=record)
    return models


def test_client_level_dp_adds_canary_rows_before_the_noise_and_keeps_the_divisor():
    can = make_canaries(100, D, norm=5.0, seed=1)  # above C: clipped by the wrapper
    cc = CanaryClients(can, seed=2)
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=4, client_rate=1.0,
                       l2_clip_norm=1.0, noise_multiplier=1e-9, seed=0, canaries=cc)
    models = start(dp, 4, 2)
    step = models[1] - models[0]
    # zero real updates: the step is the included canaries, each clipped to C, over q N = 4
    np.testing.assert_allclose(step, can.vectors().sum(0) / can.norm / 4, atol=1e-6)
    rep = dp.report()
    assert rep["canaries"]["m"] == 100 and CANARY_NOTE in rep["assumptions"]
    assert rep["expected_clients"] == 4.0  # num_clients and the divisor unchanged
    run = cc.canary_run(accounted_epsilon=dp.epsilon(), delta=dp.ledger.delta)
    assert run.settings["releases"] == 2 and run.mode == "one-run"
    # scores in noise units: an in-canary moved each of 2 releases by C / (z C)
    assert run.in_scores.mean() == pytest.approx(math.sqrt(2) / 1e-9, rel=1e-6)


def test_client_level_dp_with_sampling_audits_below_its_epsilon():
    z, q = 1.0, 0.5
    cc = CanaryClients(make_canaries(D, D, norm=1.0, seed=3), seed=4)
    dp = ClientLevelDP(FedAvg(fraction_evaluate=0.0), num_clients=6, client_rate=q,
                       l2_clip_norm=1.0, noise_multiplier=z, seed=5, canaries=cc)
    rng = np.random.default_rng(0)
    start(dp, 6, 5, update=lambda s: rng.normal(0.0, 0.1, s))
    run = cc.canary_run(accounted_epsilon=dp.epsilon(), delta=dp.ledger.delta)
    assert run.statistic == "llr" and run.settings["sampling_probability"] == q
    audit = run.audit()
    assert not audit.exceeded, audit.lines()
    assert run.in_scores.mean() > run.out_scores.mean()


def test_banded_wrapper_inserts_canaries_only_in_their_releases():
    can = make_canaries(50, D, norm=1.0, seed=6)
    cc = CanaryClients(can, seed=7, releases=[0, 2])
    dp = BandedClientLevelDP(FedAvg(fraction_train=1.0, fraction_evaluate=0.0), num_clients=3,
                             bands=2, rounds=4, l2_clip_norm=1.0, noise_multiplier=1e-9,
                             seed=0, canaries=cc)
    models = start(dp, 3, 4)
    steps = [models[r] - models[r - 1] for r in (1, 2, 3, 4)]
    want = can.vectors().sum(0) / dp.cohort_size
    np.testing.assert_allclose(steps[0], want, atol=1e-5)
    np.testing.assert_allclose(steps[2], want, atol=1e-5)
    assert np.abs(steps[1]).max() < 1e-5 and np.abs(steps[3]).max() < 1e-5
    assert dp.report()["canaries"]["releases"] == [0, 2]


def test_canary_schedules_and_settings_the_wrappers_refuse():
    kw = dict(num_clients=3, bands=2, rounds=4, l2_clip_norm=1.0, noise_multiplier=1.0)
    can = make_canaries(5, D, norm=1.0, seed=0)
    for releases in (None, [0, 1], [0, 2, 4]):  # every release, too close, past the run
        with pytest.raises(InvalidParameterError, match="canaries"):
            BandedClientLevelDP(FedAvg(), canaries=CanaryClients(can, seed=0,
                                                                 releases=releases), **kw)
    with pytest.raises(InvalidParameterError, match="canaries"):
        ClientLevelDP(FedAvg(), num_clients=3, client_rate=1.0, l2_clip_norm=1.0,
                      noise_multiplier=1.0, canaries=object())
    with pytest.raises(InvalidParameterError, match="canaries"):
        ClientLevelDP(FedAvg(), num_clients=3, client_rate=0.5, l2_clip_norm=1.0,
                      noise_multiplier=1.0, canaries=CanaryClients(can, seed=0),
                      adaptive=privkit.AdaptiveClipping(0.5, sampling_probability=0.5))
