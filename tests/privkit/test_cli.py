"""The privkit CLI: JSON output, readable text, one-line errors with exit 2."""

import json
import subprocess
import sys
import warnings

import pytest

from privkit.cli import main


def run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_epsilon_gaussian_json(capsys):
    code, out, _ = run(["epsilon", "gaussian", "--noise-multiplier", "1", "--steps", "100",
                        "--delta", "1e-5", "--json"], capsys)
    assert code == 0
    obj = json.loads(out)
    assert obj["epsilon"] == pytest.approx(91.8173, abs=1e-4)
    assert obj["delta"] == 1e-5 and obj["method"] == "exact"


def test_epsilon_gaussian_methods_and_sampling(capsys):
    code, out, _ = run(["epsilon", "gaussian", "--noise-multiplier", "1.1", "--steps", "1e3",
                        "--sampling-probability", "0.01", "--delta", "1e-5", "--method", "rdp",
                        "--json"], capsys)
    assert code == 0 and json.loads(out)["epsilon"] == pytest.approx(1.7118, abs=2e-4)


def test_epsilon_pure_json(capsys):
    code, out, _ = run(["epsilon", "pure", "--epsilon", "1", "--steps", "100", "--delta", "1e-5",
                        "--json"], capsys)
    assert code == 0 and json.loads(out)["epsilon"] == pytest.approx(79.84132, rel=1e-6)


def test_calibrate_json(capsys):
    code, out, _ = run(["calibrate", "gaussian", "--target-epsilon", "1", "--delta", "1e-5",
                        "--steps", "100", "--json"], capsys)
    obj = json.loads(out)
    assert code == 0 and obj["epsilon"] <= 1.0 and obj["noise_multiplier"] > 0


def test_calibrate_by_epochs_is_calibrate_by_the_equivalent_steps(capsys):
    common = ["calibrate", "gaussian", "--target-epsilon", "3", "--delta", "1e-5", "--json"]
    outs = [json.loads(run(common + extra, capsys)[1]) for extra in (
        ["--steps", "200", "--sampling-probability", "0.01"],
        ["--epochs", "2", "--sampling-probability", "0.01"],
        ["--epochs", "2", "--batch-size", "100", "--dataset-size", "10000"])]
    assert len({o["noise_multiplier"] for o in outs}) == 1
    assert [(o["steps"], o["sampling_probability"]) for o in outs] == [(200, 0.01)] * 3
    assert outs[1]["epochs"] == 2 and "epochs" not in outs[0]
    code, text, _ = run(common[:-1] + ["--epochs", "2", "--sampling-probability", "0.01"],
                        capsys)
    assert code == 0 and text.splitlines()[0].rstrip().endswith("; 200 steps at q=0.01")
    assert text.splitlines()[1].strip().startswith("- z = stddev / C")


def test_epsilon_by_epochs_is_epsilon_of_the_equivalent_steps(capsys):
    """``privkit epsilon gaussian`` takes a run as ``calibrate`` does: --steps or --epochs,
    --sampling-probability or --batch-size with --dataset-size (q = B / N, the faithful rate:
    Opacus's loader would use 1 / ceil(N / B))."""
    common = ["epsilon", "gaussian", "--noise-multiplier", "1.0", "--delta", "1e-5", "--json"]
    outs = [json.loads(run(common + extra, capsys)[1]) for extra in (
        ["--steps", "120", "--sampling-probability", repr(64 / 1500)],
        ["--epochs", "5", "--sampling-probability", repr(64 / 1500)],
        ["--epochs", "5", "--batch-size", "64", "--dataset-size", "1500"])]
    assert [(o["steps"], o["sampling_probability"]) for o in outs] == [(120, 64 / 1500)] * 3
    assert len({o["epsilon"] for o in outs}) == 1
    assert outs[0]["epsilon"] == pytest.approx(3.22685, abs=1e-5)
    assert outs[2]["epochs"] == 5 and "epochs" not in outs[0]
    opacus = json.loads(run(common + ["--steps", "120", "--sampling-probability",
                                      repr(1 / 24)], capsys)[1])  # q = 1 / len(loader)
    assert opacus["epsilon"] == pytest.approx(3.15105, abs=1e-5)
    code, text, _ = run(common[:-1] + ["--epochs", "5", "--batch-size", "64",
                                       "--dataset-size", "1500"], capsys)
    assert code == 0 and text.splitlines()[0].endswith("; 120 steps at q=0.0426667")
    code, text, _ = run(common[:-1] + ["--steps", "120"], capsys)  # a run by steps: as before
    assert code == 0 and "steps at q" not in text


def test_calibrate_with_the_relation_epsilon_uses(capsys):
    common = ["--delta", "1e-5", "--sampling-probability", "0.05", "--json"]
    cal = json.loads(run(["calibrate", "gaussian", "--target-epsilon", "2", "--steps", "100",
                          "--relation", "replace-one", *common], capsys)[1])
    assert cal["relation"] == "replace-one"
    eps = json.loads(run(["epsilon", "gaussian", "--noise-multiplier",
                          repr(cal["noise_multiplier"]), "--steps", "100", "--relation",
                          "replace-one", *common], capsys)[1])
    assert eps["epsilon"] == cal["epsilon"] <= 2.0
    assert eps["neighboring_relation"] == "REPLACE_ONE"
    _, text, _ = run(["calibrate", "gaussian", "--target-epsilon", "2", "--steps", "100",
                      "--relation", "replace-one", *common[:-1]], capsys)
    assert "neighbouring relation: replace_one" in text


def test_calibrate_steps(capsys):
    code, out, _ = run(["calibrate", "steps", "--noise-multiplier", "1.1", "--target-epsilon",
                        "2", "--delta", "1e-5", "--batch-size", "50", "--dataset-size", "1000",
                        "--json"], capsys)
    obj = json.loads(out)
    assert code == 0 and obj["epsilon"] <= 2.0 and obj["sampling_probability"] == 0.05
    assert obj["epochs"] == obj["steps"] / 20
    again = json.loads(run(["epsilon", "gaussian", "--noise-multiplier", "1.1", "--steps",
                            str(obj["steps"] + 1), "--sampling-probability", "0.05", "--delta",
                            "1e-5", "--json"], capsys)[1])
    assert again["epsilon"] > 2.0


def test_text_output_mentions_assumptions(capsys):
    code, out, _ = run(["epsilon", "gaussian", "--noise-multiplier", "1.1", "--steps", "100",
                        "--sampling-probability", "0.01", "--delta", "1e-5"], capsys)
    assert code == 0 and "eps <=" in out and "Poisson" in out


@pytest.mark.parametrize("args,name", [
    (["epsilon", "gaussian", "--noise-multiplier", "nan", "--steps", "10", "--delta", "1e-5"],
     "--noise-multiplier"),
    (["epsilon", "gaussian", "--noise-multiplier", "-1", "--steps", "10", "--delta", "1e-5"],
     "--noise-multiplier"),
    (["epsilon", "gaussian", "--noise-multiplier", "1", "--steps", "2.5", "--delta", "1e-5"],
     "steps"),
    (["epsilon", "gaussian", "--noise-multiplier", "1", "--steps", "10", "--delta", "1"],
     "delta"),
    (["epsilon", "gaussian", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5",
      "--sampling-probability", "0"], "--sampling-probability"),
    (["epsilon", "pure", "--epsilon", "inf", "--steps", "10", "--delta", "1e-5"], "epsilon"),
    (["calibrate", "gaussian", "--target-epsilon", "0", "--delta", "1e-5", "--steps", "10"],
     "--target-epsilon"),
    (["epsilon", "gaussian", "--noise-multiplier", "abc", "--steps", "10", "--delta", "1e-5"],
     "noise-multiplier"),
    (["epsilon", "gaussian", "--steps", "10", "--delta", "1e-5"], "noise-multiplier"),
    (["calibrate", "gaussian", "--target-epsilon", "8", "--delta", "1e-5", "--steps", "10",
      "--epochs", "3"], "--epochs"),
    (["epsilon", "gaussian", "--noise-multiplier", "1", "--delta", "1e-5", "--steps", "10",
      "--epochs", "3"], "--epochs"),
    (["epsilon", "gaussian", "--noise-multiplier", "1", "--delta", "1e-5"], "--epochs"),
    (["epsilon", "gaussian", "--noise-multiplier", "1", "--delta", "1e-5", "--epochs", "nan"],
     "--epochs"),
    (["epsilon", "gaussian", "--noise-multiplier", "1", "--delta", "1e-5", "--epochs", "2",
      "--batch-size", "700", "--dataset-size", "600"], "--batch-size"),
    (["epsilon", "gaussian", "--noise-multiplier", "1", "--delta", "1e-5", "--epochs", "2",
      "--batch-size", "70"], "--dataset-size"),
    (["calibrate", "gaussian", "--target-epsilon", "8", "--delta", "1e-5"], "--epochs"),
    (["calibrate", "gaussian", "--target-epsilon", "8", "--delta", "1e-5", "--epochs", "nan"],
     "--epochs"),
    (["calibrate", "gaussian", "--target-epsilon", "8", "--delta", "1e-5", "--epochs", "2",
      "--batch-size", "700", "--dataset-size", "600"], "--batch-size"),
    (["calibrate", "gaussian", "--target-epsilon", "8", "--delta", "1e-5", "--epochs", "2",
      "--batch-size", "70"], "--dataset-size"),
    (["calibrate", "gaussian", "--target-epsilon", "8", "--delta", "1e-5", "--epochs", "2",
      "--sampling-probability", "0.1", "--batch-size", "70"], "--batch-size"),
    (["calibrate", "gaussian", "--target-epsilon", "8", "--delta", "1e-5", "--steps", "10",
      "--relation", "sideways"], "--relation"),
    (["calibrate", "steps", "--noise-multiplier", "nan", "--target-epsilon", "8", "--delta",
      "1e-5"], "--noise-multiplier"),
    (["calibrate", "steps", "--noise-multiplier", "0.1", "--target-epsilon", "0.5", "--delta",
      "1e-5"], "--target-epsilon"),
    (["calibrate", "steps", "--noise-multiplier", "1", "--target-epsilon", "8", "--delta",
      "1e-5", "--batch-size", "0", "--dataset-size", "10"], "--batch-size"),
])
def test_bad_input_one_line_exit_2(args, name, capsys):
    try:
        code = main(args)
    except SystemExit as exc:  # argparse-level errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert name in err


def test_demo_and_console_script(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "privkit.cli", "demo", "--out",
                           str(tmp_path / "demo")], capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "epsilon" in proc.stdout and "exact" in proc.stdout and "pld" in proc.stdout
    assert "upcycled" in proc.stdout and "fedprox" in proc.stdout and "fedavg" in proc.stdout
    assert (tmp_path / "demo" / "report.json").exists()
    assert (tmp_path / "demo" / "curves_vs_iteration.png").exists()


def test_train_upcycled_cli(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "upcycled", "--dataset", "digits:3", "--rounds", "4",
                 "--epochs", "2", "--algorithms", "upcycled,fedprox,fedavg", "--device", "cpu",
                 "--seed", "1", "--out", str(out), "--json"])
    assert code == 0
    obj = json.loads(capsys.readouterr().out)
    assert set(obj) == {"upcycled", "fedprox", "fedavg"}
    assert obj["upcycled"]["iteration"] == 4 and obj["fedprox"]["iteration"] == 2
    assert json.loads((out / "report.json").read_text())["config"]["seed"] == 1


@pytest.mark.parametrize("args,name", [
    (["--mu", "-1"], "mu"), (["--lam", "-0.5"], "lam"), (["--fraction", "0"], "fraction"),
    (["--stragglers", "1"], "stragglers"), (["--rounds", "0"], "rounds"),
    (["--dataset", "imagenet"], "dataset"), (["--algorithms", "upcycled,scaffold"], "algorithms"),
    (["--rounds", "2.5"], "rounds"), (["--device", "tpu"], "device"),
])
def test_train_bad_input_one_line_exit_2(args, name, tmp_path, capsys):
    code = main(["train", "upcycled", "--out", str(tmp_path / "x"), *args])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and name in err


@pytest.mark.parametrize("factor, why", [(None, "more than 100 x its first value"),
                                         ("inf", "training diverged at round")])
def test_a_diverging_trainer_prints_one_line_and_exits_1(factor, why, capsys, tmp_path):
    argv = ["train", "scfl", "--dataset", "digits", "--clients", "5", "--coded-rows", "50",
            "--lr", "1e9", "--rounds", "30", "--algorithms", "fl-pma", "--out", str(tmp_path)]
    with warnings.catch_warnings():  # without a loss limit, numpy overflows on the way to inf
        warnings.simplefilter("ignore", RuntimeWarning)
        assert main(argv + (["--max-loss-factor", factor] if factor else [])) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "diverged" in err[0] and "lower --lr" in err[0], err
    assert why in err[0]


def test_threads_option_defaults_per_trainer_and_is_restored(tmp_path):
    import torch

    from fl_examples import cli as fl_cli
    from privkit.cli import _build_parser

    parser = _build_parser()
    for trainer in ("upcycled", "mapa", "scfl", "dprec"):  # one thread unless --threads
        assert parser.parse_args(["train", trainer, "--out", "x"]).threads == 1
    assert parser.parse_args(["train", "scfl", "--out", "x", "--threads", "3"]).threads == 3
    before = torch.get_num_threads()
    seen = []
    args = parser.parse_args(["train", "upcycled", "--out", str(tmp_path), "--threads", "1"])
    args._train_command = lambda a: seen.append(torch.get_num_threads()) or 0
    assert fl_cli.run_train(args) == 0
    assert seen == [1] and torch.get_num_threads() == before


# A finder that makes the named top-level packages fail to import, as if not installed.
_BLOCK = """
import importlib.abc, sys
class _Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Missing())
from privkit.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("blocked", [("fl_examples",), ("torch",)],
                         ids=["no-trainers", "no-torch"])
@pytest.mark.parametrize("argv", [["train", "upcycled", "--rounds", "2"],
                                  ["report", "tradeoff", "runs"], ["demo"]],
                         ids=["train", "report", "demo"])
def test_commands_without_the_examples_extra_print_one_line_and_exit_2(blocked, argv,
                                                                        tmp_path):
    if blocked == ("torch",) and argv[0] == "report":
        argv = ["report", "tradeoff", str(tmp_path)]  # report needs no torch: a real error
    code = _BLOCK.format(blocked=set(blocked), argv=[*argv, "--out", str(tmp_path / "o")]
                         if argv[0] != "report" else argv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(err) == 1
    if argv[0] == "report" and blocked == ("torch",):
        assert ".[examples]" not in err[0]  # installed: the report's own argument error
        return
    assert "pip install -e '.[examples]' from a checkout" in err[0] and repr(argv[0]) in err[0]
    assert "pip install privkit" not in err[0] and "'privkit[" not in err[0]
    if argv[0] == "demo":
        assert proc.stdout == ""  # said at once, before the epsilon table


def test_no_registered_commands_print_one_line_and_exit_2(monkeypatch, capsys):
    import privkit.cli as cli

    monkeypatch.setattr(cli.importlib.metadata, "entry_points", lambda **kw: [])
    assert main(["train", "upcycled", "--out", "x"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (
        "privkit: 'train' needs the bundled trainers: pip install -e '.[examples]' from a "
        "checkout of privkit")
    assert main(["demo", "--no-train"]) == 0  # the epsilon table needs no trainer
    assert main(["epsilon", "pure", "--epsilon", "1", "--steps", "2", "--delta", "1e-5"]) == 0
    with pytest.raises(SystemExit):
        main(["--help"])  # the help still lists train and report
    assert "train" in capsys.readouterr().out
