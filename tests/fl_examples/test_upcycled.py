"""Upcycled-FL / FedProx / FedAvg trainer: the even step, equivalences, resume, report, errors."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from fl_examples.core.data import parse_dataset_spec
from fl_examples.upcycled import UpcycledConfig, _Run, extrapolation, run_algorithm, train
from privkit.errors import InvalidParameterError

FAST = dict(dataset="digits:3", local_epochs=2, batch_size=16, lr=0.05, device="cpu",
            fraction=0.3, stragglers=0.5, seed=3)


@pytest.fixture(scope="module")
def digits():
    return parse_dataset_spec("digits:3", seed=3)


def test_even_step_is_the_formula_exactly(digits):
    cfg = UpcycledConfig(mu=0.5, lam=0.21, iterations=4, **FAST)
    run = _Run("upcycled", cfg, digits, torch.device("cpu"))
    run.step()  # odd: data
    w1 = {k: v.clone() for k, v in run.w.items()}
    w0 = {k: v.clone() for k, v in run.w_prev.items()}
    run.step()  # even: extrapolation
    c = 0.5 / (0.5 + 0.21)
    assert extrapolation(cfg, 1) == c
    for k in w1:
        assert torch.equal(run.w[k], w1[k] + c * (w1[k] - w0[k]))
    assert run.compute > 0  # the odd step trained; the even step added no client time
    before = run.compute
    run.step()
    run.step()
    assert run.compute > before


def test_sqrt_schedule_decreases_c():
    cfg = UpcycledConfig(mu=1.0, lam=0.42, lam_schedule="sqrt", **FAST)
    assert extrapolation(cfg, 1) > extrapolation(cfg, 4) > extrapolation(cfg, 16)


def test_c_zero_upcycled_equals_fedprox_with_repeated_models(digits):
    cfg = UpcycledConfig(mu=0.0, lam=0.0, iterations=6, **FAST)
    up = run_algorithm("upcycled", cfg, digits, iterations=6)
    fp = run_algorithm("fedprox", cfg, digits, iterations=3)
    for k in up["model"]:
        assert torch.equal(up["model"][k], fp["model"][k])
    # evaluations at even upcycled iterations repeat the previous odd one
    h = up["history"]
    assert h[1]["train_loss"] == h[0]["train_loss"]


def test_algorithms_differ_and_fedavg_drops_stragglers(digits):
    cfg = UpcycledConfig(mu=1.0, lam=0.42, iterations=4, **FAST)
    a = run_algorithm("fedprox", cfg, digits, iterations=2)["model"]
    b = run_algorithm("fedavg", cfg, digits, iterations=2)["model"]
    assert not torch.equal(a["weight"], b["weight"])


def test_same_seed_same_run_and_report(tmp_path, digits):
    cfg = UpcycledConfig(mu=1.0, lam=0.42, iterations=4, **FAST)
    r1 = train(cfg, compare=("fedprox", "fedavg"), out=tmp_path / "a")
    r2 = train(cfg, compare=("fedprox", "fedavg"), out=tmp_path / "b")
    for name in ("upcycled", "fedprox", "fedavg"):
        for k, v in r1["algorithms"][name]["_model"].items():
            assert torch.equal(v, r2["algorithms"][name]["_model"][k])
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    assert rep["config"]["seed"] == 3 and rep["config"]["dataset"] == "digits:3"
    assert set(rep["algorithms"]) == {"upcycled", "fedprox", "fedavg"}
    assert rep["algorithms"]["upcycled"]["iterations"] == 4
    assert rep["algorithms"]["fedprox"]["iterations"] == 2  # half, as in the paper
    final = rep["algorithms"]["upcycled"]["final"]
    for key in ("iteration", "train_loss", "train_accuracy", "test_accuracy", "wall_time_s",
                "client_compute_s"):
        assert key in final
    assert (tmp_path / "a" / "curves_vs_iteration.png").stat().st_size > 1000
    assert (tmp_path / "a" / "curves_vs_wall_time.png").stat().st_size > 1000
    # against client computation: Upcycled-FL's 4 iterations are 2 data rounds, FedProx's 2
    assert (tmp_path / "a" / "curves_vs_data_rounds.png").stat().st_size > 1000
    hist = {n: r1["algorithms"][n]["history"] for n in ("upcycled", "fedprox")}
    assert [(h["iteration"], h["data_rounds"]) for h in hist["upcycled"]][-1] == (4, 2)
    assert [(h["iteration"], h["data_rounds"]) for h in hist["fedprox"]][-1] == (2, 2)


def test_resume_in_a_new_process_is_bitwise_equal(tmp_path, digits):
    cfg = UpcycledConfig(mu=1.0, lam=0.42, iterations=6, checkpoint_every=1, **FAST)
    straight = run_algorithm("upcycled", cfg, digits, iterations=6)["model"]
    script = textwrap.dedent(f"""
        import sys, torch
        from fl_examples.core.data import parse_dataset_spec
        from fl_examples.upcycled import UpcycledConfig, run_algorithm
        from pathlib import Path
        cfg = UpcycledConfig(mu=1.0, lam=0.42, iterations=6, checkpoint_every=1, **{FAST!r})
        ds = parse_dataset_spec("digits:3", seed=3)
        stop = int(sys.argv[1])
        res = run_algorithm("upcycled", cfg, ds, iterations=6, out=Path(sys.argv[2]),
                            resume=True, stop_after=stop)
        torch.save(res["model"], sys.argv[3])
    """)
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-c", script, "3", str(out), str(tmp_path / "m1.pt")],
                   check=True, timeout=300)
    subprocess.run([sys.executable, "-c", script, "99", str(out), str(tmp_path / "m2.pt")],
                   check=True, timeout=300)
    resumed = torch.load(tmp_path / "m2.pt", weights_only=True)
    for k in straight:
        assert torch.equal(straight[k], resumed[k])


@pytest.mark.parametrize("kwargs,name", [
    (dict(mu=-1.0), "mu"), (dict(lam=-0.1), "lam"), (dict(mu=1.0, lam=0.0), "lam"),
    (dict(fraction=0.0), "fraction"), (dict(fraction=1.5), "fraction"),
    (dict(stragglers=1.0), "stragglers"), (dict(stragglers=-0.1), "stragglers"),
    (dict(iterations=0), "iterations"), (dict(lr=float("nan")), "lr"),
    (dict(model="rnn"), "model"), (dict(lam_schedule="exp"), "lam_schedule"),
])
def test_bad_config(kwargs, name):
    base = dict(FAST) | {"mu": 1.0, "lam": 0.42}
    base.update(kwargs)
    with pytest.raises(InvalidParameterError, match=name):
        UpcycledConfig(**base)


def test_unknown_dataset_and_algorithm():
    with pytest.raises(InvalidParameterError, match="dataset"):
        train(UpcycledConfig(**(FAST | {"dataset": "imagenet"})))
    with pytest.raises(InvalidParameterError, match="compare"):
        train(UpcycledConfig(**FAST), compare=("scaffold",))


def test_cnn_model_trains_on_digits(tmp_path):
    cfg = UpcycledConfig(**(FAST | {"model": "cnn", "iterations": 2, "local_epochs": 1}))
    res = train(cfg, out=tmp_path)
    assert res["algorithms"]["upcycled"]["history"][-1]["iteration"] == 2
    with pytest.raises(InvalidParameterError, match="model"):
        train(UpcycledConfig(**(FAST | {"model": "cnn", "dataset": "breast_cancer",
                                        "iterations": 2})))


def _sent140tok_dir(root):
    words = ["good", "bad", "happy", "sad", "day", "awful", "great"]
    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", 6), ("test", 2)):
        users = {}
        for u in ("u1", "u2", "u3"):
            idx = torch.randint(len(words), (n, 4), generator=gen).tolist()
            x = [[str(j), "Mon", "NO_QUERY", u, " ".join(words[i] for i in row), split]
                 for j, row in enumerate(idx)]
            users[u] = {"x": x, "y": [int("good" in r[4] or "great" in r[4]) for r in x]}
        obj = {"users": list(users), "num_samples": [len(r["y"]) for r in users.values()],
               "user_data": users}
        (root / split).mkdir(parents=True)
        (root / split / "data.json").write_text(json.dumps(obj))
    return root


def test_lstm_model_trains_on_sent140_tokens(tmp_path):
    data = _sent140tok_dir(tmp_path / "sent140")
    cfg = UpcycledConfig(dataset=f"sent140tok:{data}", model="lstm", iterations=2,
                         local_epochs=1, device="cpu", fraction=1.0, stragglers=0.0)
    res = train(cfg, out=tmp_path / "out")
    hist = res["algorithms"]["upcycled"]["history"]
    assert hist[-1]["iteration"] == 2 and all(torch.isfinite(torch.tensor(h["train_loss"]))
                                              for h in hist)
    assert res["config"]["dataset_description"]["vocab_size"] == 9
    assert res["algorithms"]["upcycled"]["_model"]["embedding"].shape == (9, 300)
    with pytest.raises(InvalidParameterError, match="model"):
        train(UpcycledConfig(**(FAST | {"model": "lstm", "dataset": "synthetic:0.5,0.5",
                                        "iterations": 2})))
