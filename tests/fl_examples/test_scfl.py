"""SCFL trainer: unbiasedness (Monte Carlo), arrival probabilities, errors, runs, resume, CLI."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest

from fl_examples.core.tradeoff import load_runs, plot_tradeoff, tradeoff_table
from fl_examples.scfl import (
    ScflConfig,
    ScflMethod,
    TimingModel,
    aggregate,
    client_gradient,
    makeup_term,
    server_gradient,
    time_to_loss,
    train,
)
from privkit.cli import main
from privkit.errors import InvalidParameterError
from privkit.mechanisms.coded import code_client_data, sum_uploads

# The spec's Monte Carlo setting (2.2): n = 3, l = (2, 3, 4), d = 2, o = 1, c = 6.
L = (2, 3, 4)
C, SIGMA, B, BS, P, KAPPA = 6, 0.5, (1, 2, 2), 3, np.array([0.5, 0.8, 1.0]), 0.5
DRAWS = 20_000


def _setting():
    rng = np.random.default_rng(11)
    xs = [rng.uniform(-0.7, 0.7, (li, 2)) for li in L]
    ys = [rng.normal(size=(li, 1)) for li in L]
    w = np.array([[0.8], [-0.9]])
    x, y = np.vstack(xs), np.vstack(ys)
    return xs, ys, w, x.T @ (x @ w - y)


def _monte_carlo():
    """(grad, [aggregate, g_s + g_o, client part, g_s alone], W) over DRAWS coding draws."""
    xs, ys, w, grad = _setting()
    rng = np.random.default_rng(2024)
    agg, server, clients, plain = [], [], [], []
    g_o = makeup_term(w, 3 * SIGMA**2)
    for _ in range(DRAWS):
        ups = {str(i): code_client_data(xs[i], ys[i], num_coded_rows=C, stddev=SIGMA,
                                        row_l2_bound=1.0, categorical_labels=False,
                                        label_l2_bound=10.0, rng=rng) for i in range(3)}
        cx, cy = sum_uploads(ups)
        g_s = server_gradient(cx, cy, w, rng.choice(C, BS, replace=False), BS)
        gi = [client_gradient(xs[i], ys[i], w, rng.choice(L[i], B[i], replace=False),
                              L[i] / B[i]) for i in range(3)]
        arrived = rng.random(3) < P
        agg.append(aggregate(gi, arrived, P, g_s, g_o, KAPPA))
        server.append(g_s + g_o)
        clients.append(aggregate(gi, arrived, P, g_s, g_o, 1.0))
        plain.append(g_s)  # the mutant without the make-up term
    return grad, [np.array(a)[..., 0] for a in (agg, server, clients, plain)], w


def _z(samples: np.ndarray, target: np.ndarray) -> np.ndarray:
    se = samples.std(axis=0, ddof=1) / math.sqrt(len(samples))
    return (samples.mean(axis=0) - target) / se


@pytest.fixture(scope="module")
def mc():
    return _monte_carlo()


def test_aggregate_unbiased_monte_carlo(mc):
    # 2e4 draws of coding, batches and arrivals; tolerance 4 standard errors per coordinate
    # (false-failure rate about 1e-4 for the 6 checks of this file).
    grad, (agg, *_), _ = mc
    assert np.all(np.abs(_z(agg, grad[:, 0])) < 4)


def test_server_part_with_makeup_unbiased(mc):
    grad, (_, server, _, _), _ = mc
    assert np.all(np.abs(_z(server, grad[:, 0])) < 4)


def test_sum_of_weighted_arrivals_unbiased(mc):
    grad, (_, _, clients, _), _ = mc
    assert np.all(np.abs(_z(clients, grad[:, 0])) < 4)


def test_without_makeup_the_check_fails_with_the_predicted_bias(mc):
    grad, (_, _, _, server), w = mc
    assert np.any(np.abs(_z(server, grad[:, 0])) > 4)   # the mutant is caught
    bias = server.mean(axis=0) - grad[:, 0]
    se = server.std(axis=0, ddof=1) / math.sqrt(DRAWS)
    assert np.all(np.abs(bias - 3 * SIGMA**2 * w[:, 0]) < 4 * se)  # bias = (sum sigma^2) W


# ------------------------------------------------------------------------------ timing
SPEC_TIMING = TimingModel(n_mac=1000, macr=np.array([1e5]), macr_server=1e6,
                          tau_u=np.array([0.1]), erasure=np.array([0.2]), t_down=0.05)


@pytest.mark.parametrize("deadline,expected", [(0.3, 0.0), (0.5, 0.96), (1.0, 0.9999872)])
def test_arrival_probability_closed_form_and_simulation(deadline, expected):
    p = float(SPEC_TIMING.arrival_probability(deadline, 16)[0])
    assert p == pytest.approx(expected, abs=1e-12)
    rng = np.random.default_rng(7)
    attempts = rng.geometric(1 - 0.2, size=100_000)
    arrived = SPEC_TIMING.times(16, attempts) <= deadline
    se = max(math.sqrt(p * (1 - p) / 1e5), 1e-5)
    assert abs(arrived.mean() - p) < 4 * se
    # the trainer's integer test N_i <= k_i is the same event
    assert np.array_equal(arrived, attempts <= SPEC_TIMING.max_attempts(deadline, 16)[0])


def test_draw_attempts_is_geometric():
    tm = TimingModel(1, np.ones(2), 1, np.ones(2), np.array([0.0, 0.5]), 0.0)
    a = np.array([tm.draw_attempts(np.random.default_rng(i)) for i in range(4000)])
    assert (a[:, 0] == 1).all() and a[:, 1].min() >= 1
    assert a[:, 1].mean() == pytest.approx(2.0, abs=4 * math.sqrt(2 / 4000))


# ------------------------------------------------------------------------------- runs
FAST = dict(dataset="digits:3", clients=8, num_coded_rows=60, rounds=12, eval_every=4)


def test_bad_inputs():
    for kwargs, name in [(dict(num_coded_rows=0), "num_coded_rows"),
                         (dict(stddev=-1.0), "stddev"), (dict(stddev=math.nan), "stddev"),
                         (dict(kappa=1.5), "kappa"), (dict(kappa=-0.1), "kappa"),
                         (dict(kappa=math.nan), "kappa"), (dict(psi=1.0), "psi")]:
        with pytest.raises(InvalidParameterError, match=name):
            ScflConfig(**(FAST | kwargs))
    with pytest.raises(InvalidParameterError, match="no client can arrive"):
        train(ScflConfig(**(FAST | dict(deadline=1e-4))), algorithms="scfl")
    with pytest.raises(InvalidParameterError, match="algorithms"):
        train(ScflConfig(**FAST), algorithms="scfl,bogus")


def test_slow_clients_are_excluded_with_a_warning():
    cfg = ScflConfig(**FAST)
    full = train(cfg, algorithms="scfl")["algorithms"]["scfl"]
    probs = np.array(full["arrival_probability"])
    assert (probs > 0).all() and not full["excluded_clients"]
    # a deadline between the fastest and the slowest minimum time excludes some clients
    tight = ScflConfig(**(FAST | dict(deadline=float(full["deadline_s"]) * 0.6)))
    with pytest.warns(UserWarning, match="excluded"):
        res = train(tight, algorithms="scfl")["algorithms"]["scfl"]
    assert res["excluded_clients"] and 0 < len(res["excluded_clients"]) < 8


def test_comparison_report_and_privacy(tmp_path: Path):
    cfg = ScflConfig(**FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the automatic deadline lets every client arrive
        res = train(cfg, algorithms="scfl,scfl-nomakeup,fl-pma,codedfedl,dp-cfl,cfl-fb",
                    out=tmp_path)
    body = json.loads((tmp_path / "report.json").read_text())
    algs = body["algorithms"]
    assert set(algs) == {m.value for m in ScflMethod}
    for entry in algs.values():
        assert all("simulated_time_s" in h for h in entry["history"])
        assert len(entry["arrivals_per_round"]) == 12
        assert entry["final"]["iteration"] == 12
    scfl = algs["scfl"]
    assert scfl["final"]["simulated_time_s"] == pytest.approx(12 * scfl["deadline_s"])
    assert "privacy" not in algs["fl-pma"] and algs["fl-pma"]["arrivals_per_round"] == [8] * 12
    assert algs["dp-cfl"]["arrivals_per_round"] == [0] * 12
    priv = scfl["privacy"]
    assert priv["measure"] == "mi_dp_nats" and len(priv["per_client"]) == 8
    assert "epsilon_mean" not in priv and priv["label_mode"] == "noisy"
    # what the number covers is in the report itself, not only on the command line
    assert "coded upload only" in body["privacy_scope"] and "unprotected" in priv["covers"]
    assert (tmp_path / "midp-scfl.json").exists() and (tmp_path / "curves_vs_simulated_time.png")
    # CodedFedL weights rows by sqrt(1 - p_i) < 1: a smaller MI-DP per client
    assert algs["codedfedl"]["privacy"]["mi_dp_nats_max"] < priv["mi_dp_nats_max"]
    # same data, timing and batches: FL-PMA waits for the slowest client every epoch
    assert algs["fl-pma"]["mean_epoch_s"] > scfl["mean_epoch_s"]
    assert algs["cfl-fb"]["mean_epoch_s"] > scfl["mean_epoch_s"]
    assert res["config"]["kappa_note"].startswith("kappa = 1/2")


def test_paper_label_mode_reports_full_disclosure():
    cfg = ScflConfig(**(FAST | dict(label_stddev=0.0, rounds=2)))
    priv = train(cfg, algorithms="scfl")["algorithms"]["scfl"]["privacy"]
    assert priv["labels_fully_disclosed"] and priv["label_mode"] == "paper_noiseless"
    cont = ScflConfig(**(FAST | dict(dataset="linreg:4,2", label_stddev=0.0, rounds=2)))
    priv = train(cont, algorithms="scfl")["algorithms"]["scfl"]["privacy"]
    assert priv["mi_dp_nats_max"] == math.inf


def test_makeup_term_helps_on_synthetic_regression():
    cfg = ScflConfig(dataset="linreg:6,2", clients=6, num_coded_rows=200, stddev=1.0,
                     rounds=150, eval_every=150, lr=1.0)
    res = train(cfg, algorithms="scfl,scfl-nomakeup")["algorithms"]
    assert res["scfl"]["history"][-1]["train_loss"] < res["scfl-nomakeup"]["history"][-1][
        "train_loss"]


def test_resume_is_exact(tmp_path: Path):
    cfg = ScflConfig(**(FAST | dict(checkpoint_every=4)))
    full = train(cfg, algorithms="scfl", out=tmp_path / "a")["algorithms"]["scfl"]
    from fl_examples.scfl.run import _setup, run_method

    sh = _setup(cfg, [ScflMethod.SCFL])
    run_method(ScflMethod.SCFL, sh, out=tmp_path / "b", stop_after=8)
    resumed = train(cfg, algorithms="scfl", out=tmp_path / "b", resume=True)["algorithms"]["scfl"]
    assert np.array_equal(full["_model"]["average"], resumed["_model"]["average"])
    def strip(hist):
        return [{k: v for k, v in h.items() if k != "wall_time_s"} for h in hist]

    assert strip(full["history"]) == strip(resumed["history"])
    assert full["arrivals_per_round"] == resumed["arrivals_per_round"]


def test_time_to_loss():
    hist = [{"train_loss": 3.0, "simulated_time_s": 0.0}, {"train_loss": 1.0,
                                                          "simulated_time_s": 2.0}]
    assert time_to_loss(hist, 1.5) == 2.0 and time_to_loss(hist, 0.5) is None


def test_cli_and_tradeoff_on_a_noise_sweep(tmp_path: Path, capsys):
    for s in ("0.5", "2"):
        code = main(["train", "scfl", "--dataset", "linreg:4,2", "--clients", "5", "--coded-rows",
                     "40", "--noise-stddev", s, "--rounds", "6", "--eval-every", "3",
                     "--algorithms", "scfl,fl-pma,codedfedl", "--out", str(tmp_path / s)])
        assert code == 0
    assert "MI-DP" in capsys.readouterr().out
    points = load_runs([tmp_path])
    rows = tradeoff_table(points)
    scfl = [r for r in rows if r["algorithm"] == "scfl"]
    assert [r["measure"] for r in scfl] == ["mi_dp_nats"] * 2 and "epsilon" not in scfl[0]
    assert scfl[0]["mi_dp_nats"] < scfl[1]["mi_dp_nats"] and scfl[0]["label"] == "stddev=2"
    assert plot_tradeoff(points, tmp_path / "t.png").exists()
    code = main(["report", "tradeoff", str(tmp_path), "--out", str(tmp_path / "t2.png")])
    assert code == 0 and "MI-DP nats" in capsys.readouterr().out
    # MI-DP and epsilon runs cannot share an axis: they are drawn side by side
    other = tmp_path / "eps" / "report.json"
    other.parent.mkdir()
    other.write_text(json.dumps({"config": {"privacy": "output"}, "algorithms": {"x": {
        "final": {"test_accuracy": 0.5, "train_loss": 1.0},
        "privacy": {"epsilon_mean": 1.0, "epsilon_max": 2.0, "proven": True}}}}))
    from PIL import Image

    mixed = plot_tradeoff(load_runs([tmp_path]), tmp_path / "t3.png")
    title = Image.open(mixed).text["Title"]
    assert "ε of the worst-off client" in title and "beside it MI-DP in nats" in title


def test_cli_bad_deadline_one_line(tmp_path: Path, capsys):
    code = main(["train", "scfl", "--dataset", "linreg:4,2", "--clients", "3", "--rounds", "2",
                 "--deadline", "1e-6", "--algorithms", "scfl", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "no client can arrive" in err


def _table_result(nats_max: float) -> dict:
    row = {"iteration": 3, "train_loss": 0.5, "test_accuracy": 0.75, "simulated_time_s": 1.0}
    return {"algorithms": {"scfl": {
        "history": [row], "arrivals_per_round": [4], "time_to_fl_pma_final_loss_s": None,
        "privacy": {"mi_dp_nats_mean": nats_max, "mi_dp_nats_max": nats_max,
                    "labels_fully_disclosed": False}}}}


def test_final_table_states_the_implied_delta_only_when_it_means_something():
    from fl_examples.scfl import final_table

    small = final_table(_table_result(0.02))
    assert "implies only (0, 0.2)-DP" in small  # sqrt(2 * 0.02) = 0.2
    large = final_table(_table_result(8.8))
    assert "implies no (epsilon, delta)-DP guarantee" in large
    assert "implies only" not in large
