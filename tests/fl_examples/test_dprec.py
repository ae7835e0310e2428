"""DP-REC trainer: end to end from the CLI, report fields, calibration, budget stop, bad input."""

import json

import pytest
import torch

from fl_examples.dprec import (
    DPRecConfig,
    calibrate_dpfedavg,
    dpfedavg_central_epsilon,
    dprec_central_epsilon,
    load_dataset,
    run_algorithm,
    train,
)
from privkit.accountants.rec import rec_run_event
from privkit.accountants.rules import NeighboringRelation
from privkit.cli import main
from privkit.errors import InvalidParameterError
from privkit.mechanisms import aggregate, rec

SMALL = dict(clients=20, clients_per_round=4, rounds=3, bits=4, eval_every=1, lr=0.2,
             device="cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()  # small models: several threads only spin
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "dprec", "--dataset", "digits", "--clients", "20",
               "--clients-per-round", "4", "--bits", "4", "--groups", "per-layer",
               "--clip", "0.5", "--stddev", "1.0", "--rounds", "3", "--eval-every", "1",
               "--algorithms", "dprec,dpfedavg", "--device", "cpu", "--out", str(out), "--json"])
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
    # DP-FedAvg: Poisson-sampled (rate 4/20), one float32 model per participation
    fa = algs["dpfedavg"]["communication"]
    assert fa["uplink_bits"] == fa["messages"] * 32 * d and fa["messages"] >= 0
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


def _spy(monkeypatch, module, name, log, tag):
    real = getattr(module, name)

    def spy(*args, **kwargs):
        log.append(tag)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


@pytest.mark.parametrize("algorithm", ["dprec", "dpfedavg"])
def test_budget_for_k_rounds_stops_before_round_k_plus_1_draws(algorithm, tmp_path,
                                                               monkeypatch):
    """A central budget that allows exactly k = 2 rounds: round 3 charges, encodes and draws
    nothing (spies on the REC encoder and the Gaussian sampler), and the stop says why."""
    k, z = 2, 2.0
    cfg = DPRecConfig(**(SMALL | {"rounds": 6}))
    ds = load_dataset(cfg)
    n = ds.num_clients
    eps = (dprec_central_epsilon(cfg, n, k) if algorithm == "dprec"
           else dpfedavg_central_epsilon(z, cfg, n, k))
    nxt = (dprec_central_epsilon(cfg, n, k + 1) if algorithm == "dprec"
           else dpfedavg_central_epsilon(z, cfg, n, k + 1))
    budget = (eps + nxt) / 2
    log: list[str] = []
    _spy(monkeypatch, rec, "encode", log, "encode")
    _spy(monkeypatch, aggregate, "gaussian_noise", log, "noise")
    res = run_algorithm(algorithm, DPRecConfig(**(SMALL | {"rounds": 6,
                                                           "epsilon_budget": budget})),
                        ds, z=z if algorithm == "dpfedavg" else None, out=tmp_path)
    p = res["privacy"]
    assert p["rounds_run"] == k and p["epsilon_central"] == eps <= budget
    assert f"stopped before round {k + 1}" in p["stopped"] and "budget" in p["stopped"]
    want = ["encode"] * (k * 4) if algorithm == "dprec" else ["noise"] * k
    assert log == want  # nothing encoded or drawn for round k + 1
    ledger = (tmp_path / f"ledger-{algorithm}.jsonl").read_text().splitlines()[1:]
    assert max(json.loads(e)["round"] for e in ledger) == k  # nothing charged for it


def test_history_compression_saves_downlink():
    full = train(DPRecConfig(**(SMALL | {"history_compression": False})), compare=())
    comp = train(DPRecConfig(**SMALL), compare=())
    assert (comp["algorithms"]["dprec"]["communication"]["downlink_bits"]
            < full["algorithms"]["dprec"]["communication"]["downlink_bits"])


@pytest.mark.parametrize("kwargs, name", [
    ({"bits": 0}, "bits"), ({"bits": 30}, "bits"), ({"groups": "rows"}, "groups"),
    ({"model": "mlp"}, "model"), ({"l2_clip": -1.0}, "l2_clip"), ({"rounds": 0}, "rounds"),
    ({"checkpoint_every": -1}, "checkpoint_every"),
])
def test_bad_config(kwargs, name):
    with pytest.raises(InvalidParameterError, match=name):
        DPRecConfig(**kwargs)


@pytest.mark.parametrize("args, name", [(["--bits", "30"], "bits"),
                                        (["--checkpoint-every", "-1"], "--checkpoint-every"),
                                        (["--threads", "0"], "--threads")])
def test_cli_bad_input_exits_2(args, name, tmp_path, capsys):
    rc = main(["train", "dprec", *args, "--out", str(tmp_path / "x")])
    assert rc == 2
    assert name in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing written
