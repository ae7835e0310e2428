"""SCFL with record-level DP-SGD noise on the client gradients: clipping, charges, epsilon,
resume, bad input, and that it still learns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from dp_accounting.dp_event import GaussianDpEvent as DpaG
from dp_accounting.dp_event import PoissonSampledDpEvent as DpaP
from dp_accounting.dp_event import SelfComposedDpEvent as DpaS
from dp_accounting.pld import pld_privacy_accountant

from fl_examples.scfl import ScflConfig, ScflMethod, dp_client_gradient, train
from fl_examples.scfl.run import _setup, run_method
from privkit.cli import main
from privkit.errors import InvalidParameterError
from privkit.ledger import Ledger

FAST = dict(dataset="digits:3", clients=8, num_coded_rows=60, rounds=12, eval_every=4,
            batch_sampling="bernoulli", gradient_clip=0.5)


def _dpa(q: float, z: float, steps: int, delta: float) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(DpaS(DpaP(q, DpaG(z)) if q < 1 else DpaG(z), steps))
    return acc.get_epsilon(delta)


def _influence(grad_fn) -> float:
    """How far replacing one record by an extreme one moves a client's gradient."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-0.1, 0.1, (10, 4))
    y = rng.normal(size=(10, 2)) * 0.01
    w = np.zeros((4, 2))
    rows = np.arange(10)
    base = grad_fn(x, y, w, rows)
    x2, y2 = x.copy(), y.copy()
    x2[3], y2[3] = 0.7, 50.0  # a record with a huge residual
    return float(np.linalg.norm(grad_fn(x2, y2, w, rows) - base))


def test_each_record_moves_the_gradient_by_at_most_2c_over_q():
    clip, scale = 0.5, 2.0
    noise = np.zeros((4, 2))

    def ours(x, y, w, rows):
        return dp_client_gradient(x, y, w, rows, scale, clip, noise)

    assert _influence(ours) <= scale * 2 * clip * (1 + 1e-9)

    def clip_the_sum(x, y, w, rows):  # a mutant: clips the batch's summed gradient
        xb = x[rows]
        g = xb.T @ (xb @ w - y[rows])
        return scale * g * min(1.0, clip * len(rows) / np.linalg.norm(g))

    assert _influence(clip_the_sum) > scale * 2 * clip


def test_charges_every_epoch_and_dp_accounting_agrees(tmp_path: Path):
    cfg = ScflConfig(**FAST, gradient_noise_multiplier=1.2)
    res = train(cfg, algorithms="scfl,dp-cfl", out=tmp_path)["algorithms"]
    p = res["scfl"]["gradient_privacy"]
    assert p["charged_epochs"] == [12] * len(p["charged_clients"])
    assert "gradient_privacy" not in res["dp-cfl"]  # DP-CFL sends no client gradient
    assert not (tmp_path / "ledger-dp-cfl.jsonl").exists()
    led = Ledger.open(tmp_path / "ledger-scfl.jsonl")
    eps = led.epsilons(p["charged_clients"])
    for cid, q in zip(p["charged_clients"], p["sampling_rate_per_client"]):
        theirs = _dpa(q, 1.2, 12, 1e-5)
        assert theirs * 0.99 <= eps[cid] <= theirs * 1.01
    assert p["epsilon_max"] == pytest.approx(max(eps.values()))
    assert "coded upload is priced separately" in " ".join(p["assumptions"])
    report = (tmp_path / "report.json").read_text()
    assert "record-level (epsilon, delta)-DP" in report


def test_calibration_meets_the_target_for_every_client():
    cfg = ScflConfig(**FAST, gradient_noise_for_epsilon=4.0)
    p = train(cfg, algorithms="fl-pma")["algorithms"]["fl-pma"]["gradient_privacy"]
    assert p["epsilon_max"] <= 4.0
    assert p["epsilon_max"] > 3.9
    assert p["calibrated"]["target_epsilon"] == 4.0


def test_resume_does_not_charge_twice(tmp_path: Path):
    cfg = ScflConfig(**(FAST | dict(checkpoint_every=4)), gradient_noise_multiplier=1.0)
    full = train(cfg, algorithms="scfl", out=tmp_path / "a")["algorithms"]["scfl"]
    sh = _setup(cfg, [ScflMethod.SCFL])
    run_method(ScflMethod.SCFL, sh, out=tmp_path / "b", stop_after=6)
    again = train(cfg, algorithms="scfl", out=tmp_path / "b", resume=True)["algorithms"]["scfl"]
    assert np.array_equal(full["_model"]["average"], again["_model"]["average"])
    assert again["gradient_privacy"]["charged_epochs"] == full["gradient_privacy"][
        "charged_epochs"]
    assert again["gradient_privacy"]["epsilon_max"] == pytest.approx(
        full["gradient_privacy"]["epsilon_max"])


def test_noise_makes_a_difference_and_still_learns():
    base = dict(dataset="digits", clients=20, rounds=60, eval_every=60)
    plain = train(ScflConfig(**base, batch_sampling="bernoulli"),
                  algorithms="scfl")["algorithms"]["scfl"]["history"][-1]["heldout_accuracy"]
    noisy = train(ScflConfig(**base, batch_sampling="bernoulli",
                             gradient_noise_for_epsilon=8.0),
                  algorithms="scfl")["algorithms"]["scfl"]["history"][-1]["heldout_accuracy"]
    assert noisy != plain
    assert noisy > 0.6, (noisy, plain)  # 10 classes: chance is 0.1


@pytest.mark.parametrize("kwargs, name", [
    (dict(gradient_noise_multiplier=0.0), "gradient_noise_multiplier"),
    (dict(gradient_noise_multiplier=float("nan")), "gradient_noise_multiplier"),
    (dict(gradient_noise_for_epsilon=-1.0), "gradient_noise_for_epsilon"),
    (dict(gradient_noise_multiplier=1.0, gradient_clip=0.0), "gradient_clip"),
    (dict(gradient_noise_multiplier=1.0, batch_sampling="fixed"), "batch_sampling"),
    (dict(gradient_noise_multiplier=1.0, gradient_noise_for_epsilon=2.0),
     "gradient_noise_for_epsilon"),
])
def test_bad_settings_name_the_argument(kwargs, name):
    with pytest.raises(InvalidParameterError, match=name):
        ScflConfig(**({"dataset": "digits:3", "batch_sampling": "bernoulli"} | kwargs))


@pytest.mark.parametrize("flags, needle", [
    (["--noise-multiplier", "0"], "--noise-multiplier"),
    (["--noise-multiplier", "1", "--batch-sampling", "fixed"], "--batch-sampling"),
    (["--noise-multiplier", "1", "--clip", "-1"], "--clip"),
    (["--noise-for-epsilon", "inf"], "--noise-for-epsilon"),
])
def test_cli_names_the_flag(tmp_path, capsys, flags, needle):
    rc = main(["train", "scfl", "--dataset", "digits:3", "--clients", "8", "--rounds", "2",
               "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err, err
