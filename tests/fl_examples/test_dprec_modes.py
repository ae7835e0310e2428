"""DP-REC trainer's privacy modes: client-level DP-FedAvg (ClientLevelGaussian, Poisson
sampling, add-remove or replace-one), the non-private FedAvg reference, DP-REC's calibration."""

import json

import dp_accounting
import numpy as np
import pytest
import torch

from fl_examples.dprec import (
    DPRecConfig,
    calibrate_dpfedavg,
    calibrate_dprec,
    dpfedavg_central_epsilon,
    dprec_central_epsilon,
    load_dataset,
    run_algorithm,
    train,
)
from fl_examples.dprec.run import _Run, num_groups
from privkit.cli import main
from privkit.errors import InvalidParameterError
from privkit.ledger import Ledger
from privkit.mechanisms import aggregate

SMALL = dict(clients=20, clients_per_round=4, rounds=3, bits=4, eval_every=1, lr=0.2,
             device="cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _dpa_epsilon(event, delta, relation):
    acc = dp_accounting.pld.PLDAccountant(relation, value_discretization_interval=1e-4)
    return acc.compose(event).get_epsilon(delta)


@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_dpfedavg_epsilon_is_dp_accountings_for_the_same_noise(relation):
    """DP-FedAvg's central epsilon against dp-accounting's PLD on the events written out by
    hand: the noise is N(0, (z C)^2) on the sum, so PoissonSampled(q, Gaussian(z)) in
    dp-accounting's convention (sensitivity 1 under add-remove, 2 under replace-one)."""
    cfg = DPRecConfig(**(SMALL | {"client_rate": 0.2, "relation": relation}))
    z, rounds = 1.3, 40
    got = dpfedavg_central_epsilon(z, cfg, 20, rounds)
    rel = (dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE if relation == "add-remove"
           else dp_accounting.NeighboringRelation.REPLACE_ONE)
    ev = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        0.2, dp_accounting.GaussianDpEvent(z)), rounds)
    want = _dpa_epsilon(ev, cfg.delta, rel)
    assert want * 0.99 <= got <= want * 1.01
    if relation == "replace-one":  # replace one client: more than adding or removing one
        add_remove = DPRecConfig(**(SMALL | {"client_rate": 0.2}))
        assert got > dpfedavg_central_epsilon(z, add_remove, 20, rounds) * 1.2


def test_dpfedavg_run_charges_the_population_once_per_round(tmp_path):
    """One aggregate release per round, whoever was sampled (an empty round too), priced by
    the ledger exactly as the report's central epsilon; the event is ClientLevelGaussian's."""
    cfg = DPRecConfig(**(SMALL | {"rounds": 5, "client_rate": 0.05}))  # often nobody
    ds = load_dataset(cfg)
    res = run_algorithm("dpfedavg", cfg, ds, z=1.5, out=tmp_path)
    led = Ledger.open(tmp_path / "ledger-dpfedavg.jsonl")
    lines = (tmp_path / "ledger-dpfedavg.jsonl").read_text().splitlines()[1:]
    rounds = [json.loads(x)["round"] for x in lines]
    assert rounds == [1, 2, 3, 4, 5]
    p = res["privacy"]
    eps = led.epsilons()["population"]
    assert p["epsilon_central"] == pytest.approx(eps, rel=1e-9)
    assert p["epsilon_central"] == pytest.approx(dpfedavg_central_epsilon(1.5, cfg, 20, 5),
                                                 rel=1e-9)
    ev = json.loads(lines[0])["event"]
    want = aggregate.ClientLevelGaussian(cfg.l2_clip, 1.5, 0.05).event()
    assert ev["sampling_probability"] == want.sampling_probability
    assert ev["event"]["noise_multiplier"] == want.event.noise_multiplier
    assert p["trust_assumption"] == aggregate.TRUST_ASSUMPTION
    assert p["relation"] == "add-remove" and p["client_rate"] == 0.05
    # the participation counts come from the Poisson sample, not from a fixed count
    assert res["communication"]["messages"] == sum(
        len(_Run("dpfedavg", cfg, ds, None, 1.5).draws(t))
        for t in range(1, 6))


def test_empty_round_still_draws_the_noise(monkeypatch):
    """Every round draws the noise once, also a round with no sampled client (the release
    exists), and with nobody sampled the noise alone moves the model."""
    cfg = DPRecConfig(**(SMALL | {"rounds": 4, "client_rate": 0.01}))  # 0.2 expected
    ds = load_dataset(cfg)
    run = _Run("dpfedavg", cfg, ds, None, 0.01)
    sizes = [len(run.draws(t)) for t in range(1, 5)]
    assert 0 in sizes  # this seed has empty rounds
    calls = []
    real = aggregate.gaussian_noise
    monkeypatch.setattr(aggregate, "gaussian_noise",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    res = run_algorithm("dpfedavg", cfg, ds, z=0.01)
    assert len(calls) == 4 and res["communication"]["messages"] == sum(sizes)
    if sum(sizes) == 0:
        w0 = run_algorithm("fedavg", cfg, ds)["_model"]  # FedAvg: nobody, nothing moves
        assert any(not torch.equal(res["_model"][k], w0[k]) for k in w0)


def _without_dprec(**over):
    """SMALL without DP-REC's own settings (given for a run without DP-REC they are refused)."""
    return DPRecConfig(**({k: v for k, v in SMALL.items() if k != "bits"} | over))


def test_settings_of_an_algorithm_that_does_not_run_are_refused():
    with pytest.raises(InvalidParameterError, match="bits must be given only when DP-REC runs"):
        train(DPRecConfig(**SMALL), algorithm="fedavg", compare=())
    with pytest.raises(InvalidParameterError,
                       match="stddev must be left out with --noise-for-epsilon"):
        train(DPRecConfig(**(SMALL | {"epsilon": 4.0, "stddev": 2.0})))
    with pytest.raises(InvalidParameterError, match="dpfedavg_noise must be given only"):
        train(DPRecConfig(**(SMALL | {"dpfedavg_noise": 2.0})), compare=())
    with pytest.raises(InvalidParameterError, match="clients must be given only when "
                                                     "--dataset digits"):
        train(DPRecConfig(**(SMALL | {"dataset": "synthetic:iid"})))


def test_fedavg_reference_is_not_private_and_charges_nothing(tmp_path):
    cfg = _without_dprec()
    res = train(cfg, algorithm="fedavg", compare=(), out=tmp_path)
    p = res["algorithms"]["fedavg"]["privacy"]
    assert p["non_private"] is True and p["epsilon_central"] is None
    assert not (tmp_path / "ledger-fedavg.jsonl").exists()
    assert all("epsilon" not in h for h in res["algorithms"]["fedavg"]["history"])


def test_replace_one_is_dprecs_only_relation():
    cfg = DPRecConfig(**(SMALL | {"relation": "add-remove"}))
    with pytest.raises(InvalidParameterError, match="relation"):
        train(cfg, compare=("dpfedavg",))
    res = train(_without_dprec(relation="add-remove"), algorithm="dpfedavg",
                compare=())  # DP-FedAvg alone: allowed
    assert res["algorithms"]["dpfedavg"]["privacy"]["relation"] == "add-remove"
    rep = train(DPRecConfig(**(SMALL | {"relation": "replace-one"})), compare=("dpfedavg",))
    assert {r["privacy"]["relation"] for r in rep["algorithms"].values()} == {"replace-one"}


def test_epsilon_calibrates_both_algorithms_to_the_target():
    cfg = DPRecConfig(**(SMALL | {"epsilon": 4.0, "rounds": 4}))
    res = train(cfg, compare=("dpfedavg",))
    for name in ("dprec", "dpfedavg"):
        p = res["algorithms"][name]["privacy"]
        assert 4.0 * 0.99 <= p["epsilon_central"] <= 4.0, name
        assert p["calibrated"]["target_epsilon"] == 4.0
    ds = load_dataset(cfg)
    n, g = ds.num_clients, num_groups(cfg, ds)
    sigma = calibrate_dprec(4.0, cfg, n, g)
    assert dprec_central_epsilon(cfg, n, cfg.rounds, g, sigma) <= 4.0
    assert dprec_central_epsilon(cfg, n, cfg.rounds, g, sigma * 0.99) > 4.0  # smallest sigma
    z = calibrate_dpfedavg(4.0, cfg, n)
    assert dpfedavg_central_epsilon(z, cfg, n, cfg.rounds) <= 4.0
    assert dpfedavg_central_epsilon(z * 0.999, cfg, n, cfg.rounds) > 4.0


def test_unreachable_dprec_epsilon_names_epsilon():
    cfg = DPRecConfig(**(SMALL | {"clients_per_round": 50, "rounds": 200}))
    with pytest.raises(InvalidParameterError, match="epsilon"):
        calibrate_dprec(1e-3, cfg, 20, 2)


def test_server_momentum_survives_resume(tmp_path):
    """Heavy-ball server momentum is part of the checkpoint: stop after 2 rounds, resume,
    and the final model equals an uninterrupted run's."""
    cfg = DPRecConfig(**(SMALL | {"rounds": 4, "server_momentum": 0.9, "checkpoint_every": 2,
                                  "client_rate": 0.5}))
    ds = load_dataset(cfg)
    whole = run_algorithm("dpfedavg", cfg, ds, z=1.0, out=tmp_path / "a")
    run_algorithm("dpfedavg", cfg, ds, z=1.0, out=tmp_path / "b", stop_after=2)
    resumed = run_algorithm("dpfedavg", cfg, ds, z=1.0, out=tmp_path / "b", resume=True)
    for k, v in whole["_model"].items():
        assert torch.equal(v, resumed["_model"][k]), k
    no_mom = run_algorithm("dpfedavg", DPRecConfig(**(SMALL | {"rounds": 4,
                                                              "client_rate": 0.5})), ds, z=1.0)
    assert any(not torch.equal(no_mom["_model"][k], v) for k, v in whole["_model"].items())


@pytest.mark.parametrize("kwargs,name", [
    ({"client_rate": 0.0}, "client_rate"), ({"client_rate": 1.5}, "client_rate"),
    ({"client_rate": float("nan")}, "client_rate"),
    ({"server_momentum": 1.0}, "server_momentum"), ({"server_momentum": -0.1},
                                                    "server_momentum"),
    ({"epsilon": 0.0}, "epsilon"), ({"epsilon": float("inf")}, "epsilon"),
    ({"relation": "replace"}, "relation"),
])
def test_bad_mode_settings_name_the_argument(kwargs, name):
    with pytest.raises(InvalidParameterError, match=name):
        DPRecConfig(**(SMALL | kwargs))


@pytest.mark.parametrize("args,flag", [
    (["--client-rate", "0"], "--client-rate"), (["--client-rate", "2"], "--client-rate"),
    (["--server-momentum", "1"], "--server-momentum"),
    (["--noise-for-epsilon", "-1"], "--noise-for-epsilon"),
    (["--relation", "add-remove"], "--relation"),  # DP-REC runs by default
])
def test_cli_bad_mode_flags_exit_2(args, flag, tmp_path, capsys):
    rc = main(["train", "dprec", "--clients", "20", "--clients-per-round", "4", "--rounds",
               "2", "--device", "cpu", "--out", str(tmp_path / "x")] + args)
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err


def test_poisson_rate_matches_q():
    cfg = DPRecConfig(**(SMALL | {"client_rate": 0.3, "rounds": 400}))
    ds = load_dataset(cfg)
    run = _Run("dpfedavg", cfg, ds, None, 1.0)
    sizes = np.array([len(run.draws(t)) for t in range(1, 401)])
    # 400 rounds x 20 clients at q = 0.3: mean 6, standard error of the mean ~0.1
    assert abs(sizes.mean() - 6.0) < 0.5 and sizes.min() < 6 < sizes.max()
