"""privkit's client mods behind stock Flower strategies (FedAvg, FedProx): settings from the
mod's constructor or documented config keys, and a one-line error naming a missing setting.

In-process (no Ray): ``Strategy.start`` with a grid that answers each message with the mod
wrapped around a ClientApp function.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("flwr", reason="install the flower extra: pip install -e '.[flower]'")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg, FedProx  # noqa: E402

from privkit.errors import InvalidParameterError  # noqa: E402
from privkit.flower import (  # noqa: E402
    DpSgdMod,
    MissingSettingError,
    ObjectivePerturbationMod,
    OutputPerturbationMod,
    PrivacySettings,
    RecMod,
)
from privkit.flower import records as keys  # noqa: E402

D = 5_000


def trainer(step=0.0, *, linear_term=False):
    """A ClientApp train function: the model plus ``step`` everywhere."""
    def app(msg, context):
        arrays = next(r for k, r in msg.content.array_records.items() if k != keys.LINEAR_TERM)
        w = arrays["w"].numpy()
        metrics = {"num-examples": 50}
        if linear_term:
            assert keys.LINEAR_TERM in msg.content.array_records
            metrics[keys.LINEAR_TERM_USED] = 1
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(w + np.float32(step))}),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)
    return app


class ModGrid:
    """Two nodes answering with ``mod(msg, context, app)``; keeps every reply."""

    def __init__(self, mod, app):
        self.mod, self.app, self.replies = mod, app, []

    def get_node_ids(self):
        return [11, 12]

    def send_and_receive(self, messages, *, timeout=None):
        # a copy per node, as the transport delivers it (FedAvg shares one RecordDict)
        out = [self.mod(copy.deepcopy(m), None, self.app) for m in messages]
        self.replies += out
        return out


def run(strategy, mod, app=None, rounds=1):
    grid = ModGrid(mod, app or trainer())
    result = strategy.start(grid, ArrayRecord({"w": Array(np.zeros(D, np.float32))}),
                            num_rounds=rounds)
    return result, grid.replies


def stock():
    return FedAvg(fraction_evaluate=0.0)


def test_output_mod_with_stock_fedavg_adds_its_noise():
    result, replies = run(stock(), OutputPerturbationMod(l2_clip_norm=1.0, stddev=1.0))
    assert replies and not any(r.has_error() for r in replies)
    for r in replies:
        out = r.content["arrays"]["w"].numpy()
        assert np.std(out) == pytest.approx(1.0, rel=0.05)
        # stddev / tau (the accountant doubles the sensitivity under replace-one)
        assert r.content["metrics"][keys.NOISE_MULTIPLIER] == 1.0
    assert np.std(result.arrays["w"].numpy()) == pytest.approx(1 / np.sqrt(2), rel=0.05)


def test_output_mod_refuses_a_noise_multiplier_whose_reading_changed():
    """privkit-fl 0.1 read it as stddev / (2 tau): the same number would halve the noise."""
    with pytest.raises(InvalidParameterError, match="stddev=1.0"):
        OutputPerturbationMod(l2_clip_norm=1.0, noise_multiplier=0.5)


def test_mods_built_from_settings_or_keywords_agree():
    s = PrivacySettings("output", l2_clip_norm=2.0, stddev=0.3, clip="update")
    assert OutputPerturbationMod(s).settings == OutputPerturbationMod(
        l2_clip_norm=2.0, stddev=0.3, clip="update").settings == s
    assert RecMod(l2_clip_norm=1.0, noise_multiplier=0.5).settings.stddev == 0.5


def test_rec_mod_with_stock_fedavg_sends_a_rec_message():
    _, replies = run(stock(), RecMod(l2_clip_norm=1.0, stddev=0.5, bits=6), trainer(0.01))
    assert replies and not any(r.has_error() for r in replies)
    assert all(list(r.content["arrays"]) == [keys.REC_MESSAGE] for r in replies)


def test_objective_mod_takes_sizes_from_its_constructor_and_mu_from_fedprox():
    mod = ObjectivePerturbationMod(alpha=20.0, allow_unproven=True, client_size=600)
    _, replies = run(FedProx(proximal_mu=1.0, fraction_evaluate=0.0), mod,
                     trainer(linear_term=True))
    assert replies and not any(r.has_error() for r in replies)
    assert all(r.content["metrics"][keys.STEP_EPSILON] > 0 for r in replies)


def _reason(mod, strategy=None, app=None):
    _, replies = run(strategy or stock(), mod, app)
    assert replies and all(r.has_error() for r in replies)
    reason = replies[0].error.reason
    assert "\n" not in reason and "KeyError" not in reason and not reason.startswith("'")
    return reason


@pytest.mark.parametrize("mod, strategy, missing", [
    (OutputPerturbationMod(), None, "missing setting privacy"),
    (ObjectivePerturbationMod(), None, "missing setting privacy"),
    (RecMod(), None, "missing setting privacy"),
    (OutputPerturbationMod(l2_clip_norm=1.0, stddev=1.0, sensitivity="paper"), None,
     "missing setting client_size"),
    (ObjectivePerturbationMod(alpha=20.0, allow_unproven=True), FedProx(fraction_evaluate=0.0),
     "missing setting client_size"),
    (ObjectivePerturbationMod(alpha=20.0, allow_unproven=True, client_size=100), None,
     "missing setting proximal_mu"),
    (OutputPerturbationMod(l2_clip_norm=1.0, stddev=1.0, noise_seed=3), None,
     "missing setting privkit-client"),
])
def test_a_missing_setting_is_one_line_naming_it(mod, strategy, missing):
    reason = _reason(mod, strategy, trainer(linear_term=isinstance(mod, ObjectivePerturbationMod)))
    assert missing in reason and reason.startswith(type(mod).__name__)


def test_settings_differing_from_the_message_are_refused():
    sent = PrivacySettings("output", l2_clip_norm=1.0, stddev=0.5)
    mod = OutputPerturbationMod(l2_clip_norm=1.0, stddev=0.7)
    msg = Message(RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(3, np.float32))}),
                              "config": ConfigRecord(sent.to_config())}),
                  dst_node_id=11, message_type="train")
    reply = mod(msg, None, trainer())
    assert reply.has_error() and "stddev=0.5" in reply.error.reason


@pytest.mark.parametrize("make, name", [
    (lambda: OutputPerturbationMod(stddev=1.0), "l2_clip_norm"),
    (lambda: OutputPerturbationMod(l2_clip_norm=1.0), "stddev"),
    (lambda: OutputPerturbationMod(l2_clip_norm=1.0, noise_multiplier=1.0, stddev=1.0),
     "noise_multiplier"),
    (lambda: OutputPerturbationMod(l2_clip_norm=1.0, noise_multiplier=1.0, sensitivity="paper"),
     "noise_multiplier"),
    (lambda: OutputPerturbationMod(l2_clip_norm=1.0, noise_multiplier=float("nan")),
     "noise_multiplier"),
    (lambda: OutputPerturbationMod(l2_clip_norm=1.0, stddev=1.0, sigma=2), "sigma"),
    (lambda: OutputPerturbationMod(l2_clip_norm=-1.0, stddev=1.0), "l2_clip_norm"),
    (lambda: OutputPerturbationMod(l2_clip_norm=1.0, stddev=1.0, client_size=0), "client_size"),
    (lambda: RecMod(PrivacySettings("output")), "settings"),
    (lambda: RecMod(PrivacySettings("rec"), bits=4), "settings"),
    (lambda: ObjectivePerturbationMod(allow_unproven=True), "alpha"),
])
def test_bad_constructor_arguments_name_the_argument(make, name):
    with pytest.raises((InvalidParameterError, MissingSettingError), match=name):
        make()


# ------------------------------------------------------------------- record-level DP-SGD
F, CLASSES = 2_000, 10


def dpsgd_trainer(client_size=40):
    """A ClientApp train function that honours the mod's request with privkit.torch on a
    plain ``nn.Linear`` (F features, ``client_size`` records of zeros, so the weight's
    gradients vanish and the bias's is clipped to C): what it releases in the weight is
    DP-SGD's noise alone."""
    import torch

    import privkit.torch as pt
    from privkit.flower import dpsgd_request

    net = torch.nn.Linear(F, CLASSES)

    def app(msg, context):
        req = dpsgd_request(msg)
        w = keys.to_torch(msg.content.array_records["arrays"])
        config = dict(msg.content.config_records["config"])
        metrics = {"num-examples": client_size}
        if req is not None:
            dp = pt.ClientsDpSgd(net, l2_clip_norm=req.l2_clip_norm,
                                 noise_multiplier=req.noise_multiplier)
            sizes = torch.tensor([client_size])
            steps = pt.steps_for_epochs(sizes, [int(config[keys.LOCAL_EPOCHS])],
                                        req.batch_size)
            out = dp.run({k: v[None] for k, v in w.items()},
                         pt.ClientBatch(torch.zeros(1, client_size, F),
                                        torch.zeros(1, client_size, dtype=torch.long), sizes),
                         steps=steps, sampling_rates=pt.sampling_rates(sizes, req.batch_size),
                         client_keys=[0], rng=pt.ClientStreams(seed=req.noise_seed),
                         update=pt.LocalSgd(lr=float(config[keys.LR])))
            w = {k: v[0] for k, v in out.items()}
            metrics[keys.DPSGD_STEPS] = int(steps[0])
        return Message(RecordDict({"arrays": keys.to_record(w),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)
    return app


def _dpsgd_run(mod, app):
    grid = ModGrid(mod, app)
    config = ConfigRecord({keys.LOCAL_EPOCHS: 4, keys.LR: 0.5, keys.MOMENTUM: 0.0,
                           keys.BATCH_SIZE: 10})
    zeros = {"weight": np.zeros((CLASSES, F), np.float32),
             "bias": np.zeros(CLASSES, np.float32)}
    FedAvg(fraction_evaluate=0.0).start(grid, keys.to_record(zeros), num_rounds=1,
                                        train_config=config)
    return grid.replies


def test_dpsgd_mod_noise_has_the_dpsgd_scale():
    """Zero gradients: the released model is -lr * sum of S steps of N(0, (zC)^2) / (q n), so
    each coordinate has stddev lr * sqrt(S) * z * C / b (b = q n). A swapped or dropped
    setting (clip for z, batch size for n) changes it."""
    n, b, z, c = 40, 10, 7.0, 0.3
    mod = DpSgdMod(l2_clip_norm=c, noise_multiplier=z, batch_size=b)
    replies = _dpsgd_run(mod, dpsgd_trainer(n))
    assert replies and not any(r.has_error() for r in replies)
    steps = 4 * (n // b)
    for r in replies:
        out = r.content["arrays"]["weight"].numpy()
        assert np.std(out) == pytest.approx(0.5 * np.sqrt(steps) * z * c / b, rel=0.03)
        assert r.content["metrics"][keys.DPSGD_STEPS] == steps
        assert r.content["metrics"][keys.NOISE_MULTIPLIER] == z
    a, b2 = (r.content["arrays"]["weight"].numpy() for r in replies)
    assert not np.array_equal(a, b2)  # OS-seeded: every client draws its own noise


def test_dpsgd_mod_refuses_a_client_app_that_ignores_it():
    reason = _reason(DpSgdMod(l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=8))
    assert "did not confirm" in reason and keys.DPSGD_STEPS in reason
    reason = _reason(DpSgdMod(l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=8,
                              noise_seed=1))
    assert "missing setting privkit-client" in reason


@pytest.mark.parametrize("kw, name", [
    (dict(l2_clip_norm=-1.0, noise_multiplier=1.0, batch_size=8), "l2_clip_norm"),
    (dict(l2_clip_norm=1.0, noise_multiplier=float("nan"), batch_size=8), "noise_multiplier"),
    (dict(l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=0), "batch_size"),
    (dict(l2_clip_norm=1.0, noise_multiplier=1.0, batch_size=8, noise_seed=-1), "noise_seed"),
])
def test_dpsgd_mod_bad_arguments_name_the_argument(kw, name):
    with pytest.raises(InvalidParameterError, match=name):
        DpSgdMod(**kw)


def test_dpsgd_request_prices_the_clients_round():
    """What a client that ran s steps on n records released: s Poisson-sampled Gaussians."""
    import privkit
    from privkit.flower import DpSgdRequest

    req = DpSgdRequest(l2_clip_norm=1.0, noise_multiplier=2.0, batch_size=10, noise_seed=3)
    assert req.round_event(40, 16) == privkit.SelfComposedDpEvent(
        privkit.PoissonSampledDpEvent(0.25, privkit.GaussianDpEvent(2.0)), 16)
    assert req.round_event(5, 3) == privkit.SelfComposedDpEvent(privkit.GaussianDpEvent(2.0), 3)
    with pytest.raises(InvalidParameterError, match="noise_seed"):
        DpSgdRequest(1.0, 1.0, 10, noise_seed=-1)


@pytest.mark.parametrize("field, value", [("l2-clip-norm", [1.0, 2.0]),
                                          ("noise-multiplier", "lots"),
                                          ("batch-size", 2.5), ("l2-clip-norm", -1.0)])
def test_a_malformed_dpsgd_record_is_refused_naming_its_entry(field, value):
    from privkit.flower import dpsgd_request

    record = {"l2-clip-norm": 1.0, "noise-multiplier": 1.0, "batch-size": 8, "noise-seed": 3}
    record[field] = value
    msg = Message(RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(3, np.float32))}),
                              keys.DPSGD: ConfigRecord(record)}),
                  dst_node_id=11, message_type="train")
    with pytest.raises(InvalidParameterError, match=f"{keys.DPSGD}\\['{field}'\\]"):
        dpsgd_request(msg)
