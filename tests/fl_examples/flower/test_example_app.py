"""The example app (``fl_examples/flower/app``): its default run config is client-level DP
calibrated to epsilon <= 8 at delta 1e-5 on 100 clients."""

from __future__ import annotations

from pathlib import Path

import pytest

EXTRA = "install the flower extra: pip install 'privkit[flower]'"
pytest.importorskip("flwr", reason=f"Flower is not installed; {EXTRA}")
tomllib = pytest.importorskip("tomllib", reason="reading the app's pyproject needs Python 3.11")

from flwr.app import Context, RecordDict  # noqa: E402

import privkit  # noqa: E402
from fl_examples.flower import ClientLevelDP, PrivkitFedProx, load_federated  # noqa: E402
from fl_examples.flower.app import server_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
APP = ROOT / "fl_examples" / "flower" / "app"


def app_config(**overrides):
    cfg = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    return cfg | overrides


def context(**overrides):
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                   run_config=app_config(**overrides))


def test_default_config_is_client_level_dp_within_epsilon_8():
    rc = app_config()
    assert rc["privacy"] == "client" and rc["reference"] is True and rc["delta"] == 1e-5
    assert load_federated(rc["dataset"], rc["seed"], rc["num-clients"]).num_clients == 100
    dp = server_app.strategy_from_config(context())
    assert isinstance(dp, ClientLevelDP) and isinstance(dp.strategy, PrivkitFedProx)
    assert dp.strategy.fraction_train == 1.0 and dp.client_rate == rc["fraction"]
    rounds = server_app.data_rounds(rc["algorithm"], rc["num-rounds"])
    eps = float(privkit.epsilon(privkit.SelfComposedDpEvent(dp.event, rounds), 1e-5))
    assert 7.9 < eps <= rc["target-epsilon"] == 8.0
    assert dp.max_epsilon == 8.0  # a rerun on the same ledger stops instead of exceeding
    reference = server_app.strategy_from_config(context(), "none")
    assert type(reference) is PrivkitFedProx and reference.fraction_train == rc["fraction"]


def test_upcycled_calibrates_for_its_odd_rounds_only():
    dp = server_app.strategy_from_config(context(algorithm="upcycled", **{"num-rounds": 7}))
    assert server_app.data_rounds("upcycled", 7) == 4
    assert float(privkit.epsilon(privkit.SelfComposedDpEvent(dp.event, 4), 1e-5)) <= 8.0
    fixed = server_app.strategy_from_config(context(**{"noise-multiplier": 2.0}))
    assert fixed.mechanism.noise_multiplier == 2.0 and fixed.max_epsilon is None
