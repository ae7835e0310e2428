"""DP-REC trainer: end to end from the CLI, report fields, calibration, budget stop, bad input."""

import json

import pytest

from fl_examples.dprec import (
    DPRecConfig,
    calibrate_dpfedavg,
    dpfedavg_central_epsilon,
    dprec_central_epsilon,
    train,
)
from privkit.accountants.rec import rec_run_event
from privkit.accountants.rules import NeighboringRelation
from privkit.cli import main
from privkit.errors import InvalidParameterError

SMALL = dict(clients=20, clients_per_round=4, rounds=3, bits=4, eval_every=1, lr=0.2,
             device="cpu")


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "dprec", "--dataset", "digits", "--clients", "20",
               "--clients-per-round", "4", "--bits", "4", "--groups", "per-layer",
               "--l2-clip", "0.5", "--stddev", "1.0", "--rounds", "3", "--eval-every", "1",
               "--compare", "dpfedavg", "--device", "cpu", "--out", str(out), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    rep = json.loads((out / "report.json").read_text())
    algs = rep["algorithms"]
    assert set(algs) == {"dprec", "dpfedavg"}
    for r in algs.values():
        comm = r["communication"]
        assert comm["uplink_bits"] > 0 and comm["downlink_bits"] > 0
        bits = [h["cumulative_bits"] for h in r["history"]]
        assert bits == sorted(bits) and bits[-1] == comm["uplink_bits"] + comm["downlink_bits"]
        assert r["privacy"]["epsilon_central"] > 0
    d = algs["dprec"]["communication"]["parameters"]
    # DP-REC: 12 messages of 128 + 2 groups x 4 bits; DP-FedAvg: float32 models
    assert algs["dprec"]["communication"]["uplink_bits"] == 12 * (128 + 2 * 4)
    assert algs["dpfedavg"]["communication"]["uplink_bits"] == 12 * 32 * d
    # same central epsilon (DP-FedAvg calibrated to DP-REC's), within the bisection tolerance
    e1, e2 = (algs[a]["privacy"]["epsilon_central"] for a in ("dprec", "dpfedavg"))
    assert e2 <= e1 * (1 + 1e-9) and e2 == pytest.approx(e1, rel=1e-3)
    assert (out / "curves_vs_bits.png").exists() and (out / "curves_vs_epsilon.png").exists()
    assert (out / "ledger-dprec.jsonl").exists()
    assert summary["dprec"]["communication"]["messages"] == 12


def test_central_epsilon_is_the_accountant_value():
    import privkit

    cfg = DPRecConfig(**SMALL)
    ev = rec_run_event(noise_multiplier=2.0, num_candidates=16, population_size=20, messages=12)
    want = privkit.epsilon(ev, cfg.delta, "rdp",
                           neighboring_relation=NeighboringRelation.REPLACE_ONE).epsilon
    assert dprec_central_epsilon(cfg, 20, 3) == pytest.approx(want, rel=1e-12)
    z = calibrate_dpfedavg(want, cfg, 20)
    assert dpfedavg_central_epsilon(z, cfg, 20, 3) <= want


def test_budget_stop_and_history_compression(tmp_path):
    cfg = DPRecConfig(**(SMALL | {"rounds": 6}))
    eps3 = dprec_central_epsilon(cfg, 20, 3)
    res = train(DPRecConfig(**(SMALL | {"rounds": 6, "epsilon_budget": eps3 * 1.0001})),
                compare=(), out=tmp_path / "b")
    p = res["algorithms"]["dprec"]["privacy"]
    assert p["rounds_run"] == 3 and "stopped before round 4" in p["stopped"]
    full = train(DPRecConfig(**(SMALL | {"history_compression": False})), compare=())
    comp = train(DPRecConfig(**SMALL), compare=())
    assert (comp["algorithms"]["dprec"]["communication"]["downlink_bits"]
            < full["algorithms"]["dprec"]["communication"]["downlink_bits"])


@pytest.mark.parametrize("kwargs, name", [
    ({"bits": 0}, "bits"), ({"bits": 30}, "bits"), ({"groups": "rows"}, "groups"),
    ({"model": "mlp"}, "model"), ({"l2_clip": -1.0}, "l2_clip"), ({"rounds": 0}, "rounds"),
])
def test_bad_config(kwargs, name):
    with pytest.raises(InvalidParameterError, match=name):
        DPRecConfig(**kwargs)


def test_cli_bad_input_exits_2(tmp_path, capsys):
    rc = main(["train", "dprec", "--bits", "30", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "bits" in capsys.readouterr().err
