"""A conventional CLI: --version, usage on bare ``privkit``, ``python -m privkit``, help and
defaults on every option, --json and --quiet on demo, TQDM_DISABLE, missing extras in one line,
readable epsilon reports naming the relation priced, and the run's files' modes."""

import argparse
import importlib.metadata
import io
import json
import os
import stat
import subprocess
import sys

import pytest

import privkit
from privkit import cli
from privkit.cli import main


def run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's --help / --version / usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ --version, bare, -m
def test_version_prints_the_version_and_exits_0(capsys):
    code, out, err = run(["--version"], capsys)
    assert code == 0 and err == ""
    assert out.strip() == f"privkit {cli.version()}"
    assert cli.DISTRIBUTION == "privkit-fl"
    assert cli.version() == importlib.metadata.version(cli.DISTRIBUTION)


def test_version_falls_back_to_the_package_attribute(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(cli.importlib.metadata, "version", missing)
    assert cli.version() == privkit.__version__


def test_bare_privkit_prints_the_usage_and_the_commands_and_exits_2(capsys):
    code, out, err = run([], capsys)
    assert code == 2 and out == ""
    assert err.startswith("usage: privkit")
    for command in ("epsilon", "calibrate", "demo", "train", "report", "audit", "ledger"):
        assert f"\n    {command} " in err


def test_python_dash_m_privkit(tmp_path):
    def py(*args):
        return subprocess.run([sys.executable, "-m", "privkit", *args], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path, check=False)

    v = py("--version")
    assert v.returncode == 0 and v.stdout.strip() == f"privkit {cli.version()}"
    bare = py()
    assert bare.returncode == 2 and "usage: privkit" in bare.stderr and "Traceback" not in \
        bare.stderr
    e = py("epsilon", "pure", "--epsilon", "1", "--steps", "2", "--delta", "1e-5", "--json")
    assert e.returncode == 0 and 0 < json.loads(e.stdout)["epsilon"] <= 2.0


# ------------------------------------------------------------------------- help texts
def _parsers(parser=None, path=()):
    parser = cli._build_parser() if parser is None else parser
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


COMMANDS = [path for path, _ in _parsers()]
#: Commands whose options are checked elsewhere (none: every command is covered here).
ELSEWHERE: set[tuple[str, ...]] = set()


def test_the_walk_sees_every_command():
    assert {("epsilon", "gaussian"), ("calibrate", "gaussian"), ("demo",),
            ("train", "upcycled"), ("train", "scfl"), ("report", "tradeoff"),
            ("ledger", "verify"), ("midp", "coded"), ("audit",)} <= set(COMMANDS)


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "privkit")
def test_every_command_help_exits_0(path, capsys):
    code, out, _ = run([*path, "--help"], capsys)
    assert code == 0 and out.startswith("usage: privkit")


@pytest.mark.parametrize("path", [p for p in COMMANDS if p not in ELSEWHERE],
                         ids=lambda p: " ".join(p) or "privkit")
def test_every_option_has_help_text_and_shows_its_default(path):
    parser = dict(_parsers())[path]
    assert parser.formatter_class is cli.HelpFormatter
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.dest == "help":
            continue
        shown = formatter._expand_help(action) if action.help else ""
        assert shown.strip(), f"{path}: {action.option_strings or action.dest} has no help"
        if action.option_strings and action.nargs != 0 and action.default not in (
                None, argparse.SUPPRESS):
            assert "default" in shown.lower(), (path, action.option_strings, shown)


def test_defaults_and_dataset_syntax_in_the_trainer_help(capsys):
    _, upcycled, _ = run(["train", "upcycled", "--help"], capsys)
    flat = " ".join(upcycled.split())
    assert "(default: 1.0)" in flat  # --mu
    assert "digits[:K]" in flat and "K classes per client" in flat
    assert "@CLIENTS[/MAXSIZE]" in flat and "femnist:DIR" in flat
    _, scfl, _ = run(["train", "scfl", "--help"], capsys)
    assert "linreg[:D,O[,NOISE]]" in " ".join(scfl.split())
    _, train, _ = run(["train", "--help"], capsys)
    assert "synthetic:ALPHA,BETA[:PRESET]" in train and "...@CLIENTS[/MAXSIZE]" in train
    _, cal, _ = run(["calibrate", "gaussian", "--help"], capsys)
    assert "--target-epsilon TARGET_EPSILON\n" in cal and "(default: auto)" in cal


def test_the_dataset_help_matches_the_parser():
    """Every form the --dataset help names is accepted by the parser."""
    from fl_examples.core.data import parse_dataset_spec

    for spec in ("synthetic:0.5,0.5", "synthetic:1,1:fedprox", "synthetic:iid:released",
                 "digits", "digits:3", "digits:iid", "digits:3@7", "synthetic:0.5,0.5@40/20",
                 "breast_cancer", "breast_cancer:4"):
        assert parse_dataset_spec(spec, seed=0).num_clients >= 1, spec


# ------------------------------------------------------------------ demo --json, --quiet
def test_demo_json_no_train_is_one_object(capsys):
    code, out, err = run(["demo", "--no-train", "--json"], capsys)
    assert code == 0
    obj = json.loads(out)  # exactly one JSON object: nothing else on stdout
    assert obj["training"] is None and len(obj["epsilons"]) >= 6
    row = obj["epsilons"][0]
    assert set(row) == {"setting", "method", "delta", "epsilon", "seconds"}
    assert row["delta"] == 1e-5 and row["epsilon"] > 0


def _small_demo(monkeypatch):
    """The demo's comparison, 2 iterations of 1 epoch (fast)."""
    import fl_examples.upcycled as upcycled

    real = upcycled.UpcycledConfig
    monkeypatch.setattr(upcycled, "UpcycledConfig",
                        lambda **kw: real(**(kw | {"iterations": 2, "local_epochs": 1})))


def test_demo_json_with_training_is_one_object(monkeypatch, tmp_path, capsys):
    _small_demo(monkeypatch)
    code, out, _ = run(["demo", "--json", "--out", str(tmp_path / "d")], capsys)
    assert code == 0
    obj = json.loads(out)
    assert set(obj["training"]["algorithms"]) == {"upcycled", "fedprox", "fedavg"}
    assert obj["training"]["algorithms"]["upcycled"]["iteration"] == 2
    assert obj["training"]["report"].endswith("report.json")
    assert (tmp_path / "d" / "report.json").exists()


@pytest.mark.parametrize("argv", [["--quiet", "demo"], ["demo", "--quiet"], ["demo", "-q"]])
def test_demo_quiet_prints_only_the_tables(argv, monkeypatch, tmp_path, capsys):
    _small_demo(monkeypatch)
    code, out, _ = run([*argv, "--out", str(tmp_path / "d")], capsys)
    assert code == 0
    assert "setting" in out and "upcycled" in out and "fedprox" in out  # the tables
    assert "privkit demo:" not in out and "'auto' is the tightest" not in out
    assert "Upcycled-FL vs FedProx" not in out and "report and plots in" not in out


def test_train_quiet_turns_the_progress_bar_off(monkeypatch, tmp_path, capsys):
    from fl_examples.core import report

    seen = []
    real = report.progress_disabled

    def spy():
        seen.append(real())
        return seen[-1]

    monkeypatch.setattr(report, "progress_disabled", spy)
    argv = ["train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--epochs", "1",
            "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert seen and all(s is True for s in seen)
    out = capsys.readouterr().out
    assert "upcycled" in out and "report:" not in out  # the table stays, the chatter goes
    seen.clear()
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert seen and all(s is None for s in seen)  # a bar on a terminal only (tqdm decides)
    assert "report:" in capsys.readouterr().out


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("value, disabled", [("1", True), ("true", True), ("0", False),
                                             (None, False)])
def test_progress_bars_honour_tqdm_disable(value, disabled, monkeypatch):
    import tqdm.auto

    from fl_examples.core import report

    made = []
    real = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm",
                        lambda **kw: made.append(real(file=_Terminal(), **kw)) or made[-1])
    if value is None:
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
    else:
        monkeypatch.setenv("TQDM_DISABLE", value)
    bar = report.progress(3, "x")
    assert bool(bar.disable) is disabled  # on a terminal: shown unless TQDM_DISABLE says not
    bar.close()
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    with report.quiet():
        assert report.progress_disabled() is True
    assert report.progress_disabled() is None


# --------------------------------------------------------------------- missing extras
_BLOCK = """
import importlib.abc, sys
class _Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Missing())
for name in list(sys.modules):
    if name.split(".")[0] == {blocked!r}:
        sys.modules[name] = None  # imported already (by a dependency): missing now
from privkit.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("blocked, argv", [
    ("sklearn", ["train", "upcycled", "--dataset", "digits:3", "--rounds", "2"]),
    ("tqdm", ["train", "scfl", "--rounds", "2", "--clients", "3"]),
    ("safetensors", ["train", "upcycled", "--rounds", "2", "--checkpoint-every", "1"]),
    ("matplotlib", ["demo"]),
    ("tqdm", ["demo", "--json"]),
])
def test_a_missing_extra_module_is_one_line_naming_the_extra(blocked, argv, tmp_path):
    code = _BLOCK.format(blocked=blocked, argv=[*argv, "--epochs", "1", "--out",
                                                str(tmp_path / "o")]
                         if argv[1:2] == ["upcycled"] else [*argv, "--out", str(tmp_path / "o")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, check=False,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(err) == 1, proc.stderr
    assert "pip install -e '.[examples]'" in err[0] and repr(blocked) in err[0]
    if argv == ["demo", "--json"]:
        assert proc.stdout == ""  # no half JSON object


def test_a_missing_extra_raised_while_building_the_parser_is_one_line(monkeypatch, capsys):
    def broken(sub, parser_class):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    commands = cli._load_commands()
    monkeypatch.setattr(cli, "_load_commands",
                        lambda: commands | {"report": commands["report"].__class__(
                            broken, commands["report"].run)})
    code, out, err = run(["report", "tradeoff", "x"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "pip install -e '.[examples]'" in err and "'matplotlib'" in err


def test_another_missing_module_is_not_called_a_missing_extra(monkeypatch):
    """A module outside the extra (a bug, another package) is not hidden behind it."""
    commands = cli._load_commands()

    def run_(args):
        raise ModuleNotFoundError("No module named 'nonexistent_mod'", name="nonexistent_mod")

    monkeypatch.setattr(cli, "_load_commands",
                        lambda: commands | {"demo": commands["demo"].__class__(None, run_)})
    with pytest.raises(ModuleNotFoundError):
        main(["demo"])


# ---------------------------------------------------------------------- epsilon reports
def test_epsilon_report_float_and_one_line_str():
    r = privkit.epsilon(privkit.gaussian_steps_event(1.0, 100), delta=1e-5)
    assert float(r) == r.epsilon == pytest.approx(91.8173, abs=1e-4)
    text = str(r)
    assert "\n" not in text and "91.8173" in text and "delta=1e-05" in text
    assert "exact" in text and "neighbouring relation: add_or_remove_one" in text
    assert r.to_dict()["neighboring_relation"] == "ADD_OR_REMOVE_ONE"


def test_a_replace_one_mechanism_report_names_replace_one():
    mech = privkit.GaussianOutputPerturbation(l2_clip_norm=1.0, stddev=8.0)
    assert mech.neighboring_relation.name == "REPLACE_ONE"
    ev = privkit.SelfComposedDpEvent(mech.event(), 10)
    r = privkit.epsilon(ev, 1e-5, neighboring_relation=mech.neighboring_relation)
    assert "neighbouring relation: replace_one" in str(r)
    assert "add_or_remove_one" not in r.summary()
    # stddev 8 against the replace-one sensitivity 2: the add/remove Gaussian of z = 4
    g = privkit.SelfComposedDpEvent(privkit.GaussianDpEvent(4.0), 10)
    assert r.epsilon == pytest.approx(privkit.epsilon(g, 1e-5).epsilon, rel=1e-12)
    assert privkit.epsilon(ev, 1e-5, neighboring_relation="REPLACE_ONE") == r
    paper = privkit.GaussianOutputPerturbation(
        l2_clip_norm=1.0, noise_multiplier=2.0, sensitivity_mode=privkit.Sensitivity.PAPER,
        dataset_size=10)
    assert paper.neighboring_relation.name == "ADD_OR_REMOVE_ONE"  # Thm C.1's add-one
    lap = privkit.LaplaceGradientNoise(l2_clip_norm=1.0, batch_size=10, epsilon=1.0)
    assert lap.neighboring_relation.name == "REPLACE_ONE"


def test_the_cli_prints_the_relation_it_priced(capsys):
    base = ["epsilon", "gaussian", "--noise-multiplier", "1.1", "--steps", "100",
            "--sampling-probability", "0.01", "--delta", "1e-5"]
    code, out, _ = run([*base, "--relation", "replace-one"], capsys)
    assert code == 0 and "neighbouring relation: replace_one" in out
    assert "add_or_remove_one" not in out
    code, out, _ = run([*base, "--relation", "replace-one", "--json"], capsys)
    replace = json.loads(out)
    code, out, _ = run([*base, "--json"], capsys)
    add = json.loads(out)
    assert replace["neighboring_relation"] == "REPLACE_ONE" and replace["relation"] == \
        "replace-one"
    assert add["neighboring_relation"] == "ADD_OR_REMOVE_ONE"
    assert replace["epsilon"] != add["epsilon"]  # sampled: the relation changes the number


# ----------------------------------------------------------------------- file modes
def test_report_json_has_the_plots_mode(tmp_path):
    from fl_examples.core.report import write_report

    old = os.umask(0o022)
    try:
        path = write_report(tmp_path, {"seed": 0}, {"a": {"history": [
            {"iteration": 1, "train_loss": 1.0, "train_accuracy": 0.5, "test_accuracy": 0.5,
             "wall_time_s": 0.1, "client_compute_s": 0.1}]}})
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes["report.json"] == 0o644
    assert modes["curves_vs_iteration.png"] == modes["report.json"]
    assert path == tmp_path / "report.json"


def test_files_written_atomically_and_ledgers_follow_the_umask(tmp_path):
    from privkit.ledger import Ledger, atomic_write_bytes

    old = os.umask(0o027)
    try:
        atomic_write_bytes(tmp_path / "f.json", b"{}")
        Ledger.create(tmp_path / "ledger.jsonl", population_id="p", delta=1e-5)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "ledger.jsonl").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "ledger.jsonl.head").stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
