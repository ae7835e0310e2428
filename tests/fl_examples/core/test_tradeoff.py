"""Tests of fl_examples.core.tradeoff: loading reports, aggregation over seeds, plot, CLI."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
from _quick_runs import RUNS, quick_runs

from fl_examples.core.tradeoff import (
    IGNORED_CONFIG_KEYS,
    add_report_parser,
    format_table,
    load_runs,
    plot_tradeoff,
    run_report,
    tradeoff_table,
)
from privkit.errors import InvalidParameterError

NOISES = [0.5, 1.0, 2.0]
SEEDS = [0, 1, 2]
ALGS = ["upcycled", "fedprox"]


def _eps(noise: float, seed: int) -> float:
    return 8.0 / noise + 0.1 * seed  # epsilon shrinks with noise, varies a little per seed


def _acc(alg: str, noise: float, seed: int) -> float:
    return (0.9 if alg == "upcycled" else 0.85) - 0.05 * noise + 0.01 * seed


def _loss(alg: str, noise: float, seed: int) -> float:
    return (0.3 if alg == "upcycled" else 0.35) + 0.1 * noise - 0.01 * seed


def _evaluation(acc: float, loss: float) -> dict:
    return {"iteration": 10, "train_loss": loss, "train_accuracy": acc, "test_accuracy": acc,
            "wall_time_s": 1.0, "client_compute_s": 0.5}


def _write(run_dir: Path, config: dict, algorithms: dict) -> Path:
    run_dir.mkdir(parents=True)
    body = {"config": config, "algorithms": {}}
    for name, (acc, loss, privacy) in algorithms.items():
        ev = _evaluation(acc, loss)
        entry = {"history": [_evaluation(0.1, 2.3), ev], "final": ev}
        if privacy is not None:
            entry["privacy"] = privacy
        body["algorithms"][name] = entry
    (run_dir / "report.json").write_text(json.dumps(body))
    return run_dir


def _privacy(eps: float, proven: bool = True) -> dict:
    return {"delta": 1e-5, "epsilon_mean": eps, "epsilon_max": 2 * eps, "method": "rdp",
            "proven": proven, "per_client": [eps, 2 * eps], "sensitivity": "clipped"}


@pytest.fixture()
def sweep(tmp_path: Path) -> list[Path]:
    """2 algorithms x 3 noise levels x 3 seeds (output perturbation), one non-private run
    and one objective-perturbation run with an unproven epsilon."""
    dirs = []
    for noise in NOISES:
        for seed in SEEDS:
            cfg = {"dataset": "synthetic:0.5,0.5", "privacy": "output", "noise": noise,
                   "seed": seed, "lr": 0.05, "device": "cpu" if seed else "cuda",
                   "dataset_description": f"synthetic seed {seed}"}
            algs = {a: (_acc(a, noise, seed), _loss(a, noise, seed),
                        _privacy(_eps(noise, seed))) for a in ALGS}
            dirs.append(_write(tmp_path / f"out_n{noise}_s{seed}", cfg, algs))
    dirs.append(_write(tmp_path / "nonprivate", {"dataset": "synthetic:0.5,0.5",
                                                 "privacy": "none", "seed": 0, "lr": 0.05},
                       {"upcycled": (0.95, 0.2, None)}))
    dirs.append(_write(tmp_path / "objective", {"dataset": "synthetic:0.5,0.5",
                                                "privacy": "objective", "noise": 1.0,
                                                "seed": 0, "lr": 0.05},
                       {"upcycled": (0.8, 0.5, _privacy(float("inf"), proven=False)
                                     | {"epsilon_mean": 3.0, "epsilon_max": "inf"})}))
    return dirs


def test_load_runs(sweep: list[Path]) -> None:
    # run directories and report.json files both work; a file given twice is read once
    points = load_runs([*sweep, sweep[0] / "report.json"])
    assert len(points) == 2 * 9 + 1 + 1
    p = next(p for p in points if p.source == sweep[1] / "report.json"
             and p.algorithm == "fedprox")
    assert (p.seed, p.privacy, p.dataset, p.proven) == (1, "output", "synthetic:0.5,0.5", True)
    assert p.epsilon_mean == pytest.approx(_eps(0.5, 1))
    assert p.epsilon_max == pytest.approx(2 * _eps(0.5, 1))
    assert p.accuracy == pytest.approx(_acc("fedprox", 0.5, 1))
    assert p.loss == pytest.approx(_loss("fedprox", 0.5, 1))
    assert (p.accuracy_metric, p.loss_metric) == ("test_accuracy", "train_loss")
    assert p.delta == 1e-5
    nonpriv = next(p for p in points if p.privacy == "none")
    assert math.isinf(nonpriv.epsilon_mean) and math.isinf(nonpriv.epsilon_max)
    obj = next(p for p in points if p.privacy == "objective")
    assert not obj.proven and obj.epsilon_mean == 3.0 and math.isinf(obj.epsilon_max)
    # a sweep directory above the run directories is expanded
    assert len(load_runs([sweep[0].parent])) == len(points)


def test_tradeoff_table_aggregates_over_seeds(sweep: list[Path]) -> None:
    rows = tradeoff_table(load_runs(sweep), epsilon="mean")
    out_rows = [r for r in rows if r["privacy"] == "output"]
    assert len(rows) == 2 * 3 + 2 and len(out_rows) == 6
    for alg in ALGS:
        curve = [r for r in out_rows if r["algorithm"] == alg]
        # one point per noise level, sorted by epsilon (most noise first)
        assert [r["setting"] for r in curve] == [{"noise": n} for n in sorted(NOISES)[::-1]]
        assert [r["label"] for r in curve] == [f"noise={n:g}" for n in sorted(NOISES)[::-1]]
        for r in curve:
            n = r["setting"]["noise"]
            assert (r["n_runs"], r["n_seeds"], r["seeds"]) == (3, 3, SEEDS)
            eps = [_eps(n, s) for s in SEEDS]
            acc = [_acc(alg, n, s) for s in SEEDS]
            loss = [_loss(alg, n, s) for s in SEEDS]
            assert r["epsilon"] == pytest.approx(sum(eps) / 3)
            assert (r["epsilon_lo"], r["epsilon_hi"]) == pytest.approx((min(eps), max(eps)))
            assert r["accuracy"] == pytest.approx(sum(acc) / 3)
            assert (r["accuracy_lo"], r["accuracy_hi"]) == pytest.approx(
                (min(acc), max(acc)))
            assert r["loss"] == pytest.approx(sum(loss) / 3)
            assert (r["loss_lo"], r["loss_hi"]) == pytest.approx(
                (min(loss), max(loss)))
            assert r["proven"] is True and r["delta"] == 1e-5 and r["epsilon_stat"] == "mean"
            assert r["guarantee"] == "proven" and r["accuracy_metric"] == "test_accuracy"
    nonpriv = next(r for r in rows if r["privacy"] == "none")
    assert math.isinf(nonpriv["epsilon"]) and nonpriv["accuracy"] == 0.95
    assert nonpriv["guarantee"] == "-"
    obj = next(r for r in rows if r["privacy"] == "objective")
    assert obj["proven"] is False and obj["epsilon"] == 3.0
    assert obj["guarantee"] == "not proven"

    # the default is each run's epsilon_max: the worst-off client's
    rows_max = tradeoff_table(load_runs(sweep))
    r = next(r for r in rows_max if r["algorithm"] == "upcycled" and r["privacy"] == "output"
             and r["setting"] == {"noise": 1.0})
    assert r["epsilon"] == pytest.approx(2 * sum(_eps(1.0, s) for s in SEEDS) / 3)
    assert r["epsilon_stat"] == "max"
    assert math.isinf(next(r for r in rows_max if r["privacy"] == "objective")["epsilon"])

    # ignoring fewer keys splits the points (device differs between seeds)
    split = tradeoff_table(load_runs(sweep), epsilon="mean",
                           ignore=IGNORED_CONFIG_KEYS - {"device"})
    assert len([r for r in split if r["privacy"] == "output"]) == 12
    with pytest.raises(InvalidParameterError, match="epsilon"):
        tradeoff_table(load_runs(sweep), epsilon="median")

    text = format_table(rows)
    assert "noise=0.5" in text and "fedprox" in text and "NOT PROVEN" in text
    assert "inf" in text
    header = text.splitlines()[0]  # the columns say which metric they hold
    assert "test acc" in header and "train loss" in header and "guarantee" in header
    assert "epsilon (mean over clients)" in header
    assert "epsilon (max over clients)" in format_table(rows_max).splitlines()[0]
    assert "worst-off client's" in format_table(rows_max)


def test_none_valued_settings_are_not_labels(tmp_path: Path) -> None:
    """A key that varies along a curve only by being unset in one run labels the other
    point, never ``key=None``."""
    base = {"dataset": "d", "privacy": "client", "seed": 0}
    a = _write(tmp_path / "a", base | {"noise": 1.0, "client_rate": None},
               {"x": (0.5, 1.0, _privacy(1.0))})
    b = _write(tmp_path / "b", base | {"noise": 2.0, "client_rate": 0.1},
               {"x": (0.4, 1.1, _privacy(0.5))})
    rows = tradeoff_table(load_runs([a, b]))
    assert [r["label"] for r in rows] == ["client_rate=0.1, noise=2", "noise=1"]
    assert rows[1]["setting"] == {"client_rate": None, "noise": 1.0}  # the JSON keeps it
    assert "None" not in format_table(rows)


def test_nan_accuracy_is_not_repaired(tmp_path: Path) -> None:
    cfg = {"dataset": "d", "privacy": "output", "noise": 1.0}
    a = _write(tmp_path / "a", cfg | {"seed": 0}, {"x": (0.5, 1.0, _privacy(1.0))})
    b = _write(tmp_path / "b", cfg | {"seed": 1}, {"x": (0.5, 1.0, _privacy(1.0))})
    body = json.loads((b / "report.json").read_text())
    body["algorithms"]["x"]["final"]["test_accuracy"] = None  # NaN as the writer stores it
    (b / "report.json").write_text(json.dumps(body))
    (row,) = tradeoff_table(load_runs([a, b]))
    assert math.isnan(row["accuracy"]) and row["loss"] == 1.0


def _drawn(monkeypatch) -> list[dict]:
    """What each figure saved from now on says: its title, axes' labels, legend."""
    from matplotlib.figure import Figure

    seen: list[dict] = []
    original = Figure.savefig

    def spy(fig, *a, **k):
        legend = fig.legends[0] if fig.legends else None
        seen.append({"title": fig.get_suptitle(),
                     "x": [ax.get_xlabel() for ax in fig.get_axes()],
                     "y": [ax.get_ylabel() for ax in fig.get_axes()],
                     "legend_title": legend.get_title().get_text() if legend else None,
                     "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
                     "axes_legends": [ax.get_legend() for ax in fig.get_axes()],
                     "annotations": [c.get_text() for ax in fig.get_axes()
                                     for c in ax.texts]})
        return original(fig, *a, **k)

    monkeypatch.setattr(Figure, "savefig", spy)
    return seen


def test_plot_written(sweep: list[Path], tmp_path: Path, monkeypatch) -> None:
    points = load_runs(sweep)
    seen = _drawn(monkeypatch)
    for which in ("mean", "max"):
        out = plot_tradeoff(points, tmp_path / "plots" / f"tradeoff_{which}.png", epsilon=which)
        data = out.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert plot_tradeoff(points, tmp_path / "default.png").is_file()
    mean, worst, default = seen
    assert default["x"] == worst["x"] and default["title"] == worst["title"]  # max by default
    # the x axis, the legend and the title name the statistic
    assert all("worst-off client (max over clients" in x for x in worst["x"])
    assert all("mean over clients" in x and "not the worst-off" in x for x in mean["x"])
    assert "max over clients" in worst["legend_title"]
    assert "mean over clients" in mean["legend_title"]
    assert "worst-off client" in worst["title"] and "mean over clients" in mean["title"]
    # the legend sits outside the data: on the figure, none on an axis
    assert worst["axes_legends"] == [None, None] and "upcycled (output)" in worst["legend"]
    from PIL import Image

    assert "worst-off" in Image.open(tmp_path / "default.png").text["Description"]
    with pytest.raises(InvalidParameterError, match="out"):
        plot_tradeoff(points, tmp_path / "tradeoff.notaformat")


@pytest.mark.parametrize(("mutate", "key"), [
    (lambda b: "{not json", "valid JSON"),
    (lambda b: json.dumps([1, 2]), "<top level>"),
    (lambda b: json.dumps({"algorithms": b["algorithms"]}), "config"),
    (lambda b: json.dumps({"config": b["config"], "algorithms": {}}), "algorithms"),
    (lambda b: json.dumps(b | {"config": b["config"] | {"seed": "zero"}}), "config.seed"),
    (lambda b: json.dumps(_set(b, ["algorithms", "x", "final"], None)), "algorithms.x.final"),
    (lambda b: json.dumps(_set(b, ["algorithms", "x", "final", "test_accuracy"], "high")),
     "algorithms.x.final.test_accuracy"),
    (lambda b: json.dumps(_set(b, ["algorithms", "x", "privacy", "epsilon_mean"], [1])),
     "algorithms.x.privacy.epsilon_mean"),
    (lambda b: json.dumps(_set(b, ["algorithms", "x", "privacy", "proven"], "yes")),
     "algorithms.x.privacy.proven"),
])
def test_malformed_report_names_path_and_key(tmp_path: Path, mutate, key: str) -> None:
    run = _write(tmp_path / "run", {"dataset": "d", "privacy": "output", "seed": 0},
                 {"x": (0.5, 1.0, _privacy(1.0))})
    path = run / "report.json"
    path.write_text(mutate(json.loads(path.read_text())))
    with pytest.raises(InvalidParameterError) as info:
        load_runs([run])
    assert str(path) in str(info.value) and key in str(info.value)


def _set(body: dict, keys: list[str], value: object) -> dict:
    d = body
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value
    return body


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="nowhere"):
        load_runs([tmp_path / "nowhere"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidParameterError, match="empty"):
        load_runs([tmp_path / "empty"])
    with pytest.raises(InvalidParameterError, match="RUN_DIRS"):
        load_runs([])


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # raise instead of exiting, to test
        raise ValueError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="privkit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_report_parser(sub, _Parser)
    return p


def test_cli_text_and_json(sweep: list[Path], tmp_path: Path, capsys) -> None:
    out = tmp_path / "t.png"
    args = _parser().parse_args(["report", "tradeoff", *map(str, sweep), "--out", str(out)])
    assert (args.command, args.report, args.epsilon_statistic, args.json) == (
        "report", "tradeoff", "max", False)
    assert run_report(args) == 0
    text = capsys.readouterr().out
    assert "upcycled" in text and "noise=2" in text and str(out) in text
    assert "epsilon (max over clients)" in text.splitlines()[0]
    assert out.stat().st_size > 20_000

    out.unlink()
    args = _parser().parse_args(["report", "tradeoff", *map(str, sweep), "--out", str(out),
                                 "--epsilon-statistic", "mean", "--json"])
    run_report(args)
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 8 and out.is_file()
    nonpriv = next(r for r in rows if r["privacy"] == "none")
    assert nonpriv["epsilon"] == "inf" and rows[0]["epsilon_stat"] == "mean"
    # the older spelling still works, with a one-line note naming the new flag
    old = _parser().parse_args(["report", "tradeoff", str(sweep[0]), "--epsilon", "mean"])
    assert old.epsilon_statistic == "mean"
    assert "--epsilon is now --epsilon-statistic" in capsys.readouterr().err

    assert _parser().parse_args(["report", "tradeoff", str(sweep[0])]).out == "tradeoff.png"
    with pytest.raises(ValueError):
        _parser().parse_args(["report", "tradeoff", str(sweep[0]), "--epsilon-statistic",
                              "median"])
    with pytest.raises(ValueError):
        _parser().parse_args(["report", "tradeoff"])


def test_cli_bad_input_names_argument(sweep: list[Path], tmp_path: Path) -> None:
    good = {"report": "tradeoff", "run_dirs": [str(sweep[0])], "out": str(tmp_path / "x.png"),
            "epsilon_statistic": "mean", "json": False}
    for change, name in [({"epsilon_statistic": "median"}, "epsilon_statistic"),
                         ({"run_dirs": []}, "RUN_DIRS"),
                         ({"out": str(tmp_path)}, "out"), ({"out": ""}, "out"),
                         ({"run_dirs": [str(tmp_path / "missing")]}, "missing")]:
        with pytest.raises(InvalidParameterError, match=name):
            run_report(argparse.Namespace(**(good | change)))


# ------------------------------------------------------- every trainer's report, read as is
def _entry(final: dict, privacy: dict | None = None, **more: dict) -> dict:
    entry = {"history": [final], "final": final} | more
    if privacy is not None:
        entry["privacy"] = privacy
    return entry


def test_a_non_private_section_is_not_private(tmp_path: Path) -> None:
    """DP-REC's FedAvg reference has a privacy section that says non_private: true."""
    final = {"iteration": 3, "heldout_accuracy": 0.8, "heldout_loss": 0.5,
             "train_loss": 0.4, "test_accuracy": 0.7}
    body = {"config": {"dataset": "digits", "seed": 0}, "algorithms": {
        "dprec": _entry(final, _privacy(6.0) | {"epsilon_central": 6.0, "mechanism": "rec",
                                                "guarantee": "simulation", "proven": False}),
        "fedavg": _entry(final, {"non_private": True, "epsilon_central": None})}}
    (tmp_path / "report.json").write_text(json.dumps(body))
    points = {p.algorithm: p for p in load_runs([tmp_path])}
    assert points["fedavg"].privacy == "none" and math.isinf(points["fedavg"].epsilon_mean)
    assert points["dprec"].privacy == "rec" and points["dprec"].guarantee == "simulation"
    # the held-out metrics, the non-private reference's too (it also has the clients')
    assert {p.accuracy_metric for p in points.values()} == {"heldout_accuracy"}
    assert points["fedavg"].accuracy == 0.8 and points["fedavg"].loss == 0.5


def test_scfl_gradient_epsilon_is_read_not_its_midp(tmp_path: Path, monkeypatch) -> None:
    final = {"iteration": 6, "heldout_accuracy": 0.3, "heldout_loss": 0.45}
    grad = _privacy(2.0) | {"guarantee": "simulation", "proven": False}
    midp = {"measure": "mi_dp_nats", "mi_dp_nats_mean": 23.5, "mi_dp_nats_max": 24.0,
            "proven": False, "guarantee": "simulation"}
    body = {"config": {"dataset": "digits:3", "seed": 0, "privacy": "coded-mi-dp+gradient-dp"},
            "algorithms": {"scfl": _entry(final, midp, gradient_privacy=grad),
                           "fl-pma": _entry(final, None, gradient_privacy=grad),
                           "dp-cfl": _entry(final, midp)}}
    (tmp_path / "report.json").write_text(json.dumps(body))
    points = {p.algorithm: p for p in load_runs([tmp_path])}
    for name in ("scfl", "fl-pma"):  # FL-PMA is private too (it was 'none ... inf')
        p = points[name]
        assert (p.privacy, p.measure, p.epsilon_mean) == ("gradient-dp", "epsilon", 2.0)
    assert points["scfl"].mi_dp_nats_max == 24.0 and "coded upload" in points["scfl"].note
    assert points["dp-cfl"].measure == "mi_dp_nats" and points["dp-cfl"].privacy == "coded-mi-dp"
    rows = tradeoff_table(list(points.values()))
    text = format_table(rows)
    assert "24 nats" in text and "note: scfl" in text and "held-out acc" in text
    # DP-CFL's MI-DP cannot share the epsilon axis: an MI-DP column beside the epsilon one
    seen = _drawn(monkeypatch)
    assert plot_tradeoff(list(points.values()), tmp_path / "t.png").is_file()
    (fig,) = seen
    assert len(fig["x"]) == 4  # (accuracy, loss) x (epsilon, MI-DP)
    assert [x.startswith("ε of the worst-off") for x in fig["x"]] == [True, False] * 2
    assert all(x.startswith("MI-DP, nats") for x in fig["x"][1::2])
    assert "dp-cfl (coded-mi-dp)" in fig["legend"] and "scfl (gradient-dp)" in fig["legend"]
    assert "beside it MI-DP" in fig["title"]


def test_mixed_metrics_are_tagged_and_a_regression_has_no_accuracy_panel(
        tmp_path: Path, monkeypatch) -> None:
    old = _write(tmp_path / "old", {"dataset": "d", "privacy": "output", "seed": 0,
                                    "noise": 1.0}, {"x": (0.5, 1.0, _privacy(1.0))})
    new = tmp_path / "new"
    new.mkdir()
    final = {"iteration": 3, "heldout_accuracy": 0.6, "heldout_loss": 0.9}
    (new / "report.json").write_text(json.dumps({
        "config": {"dataset": "d", "privacy": "output", "seed": 0, "noise": 2.0},
        "algorithms": {"x": _entry(final, _privacy(0.5))}}))
    rows = tradeoff_table(load_runs([old, new]))
    assert {r["accuracy_metric"] for r in rows} == {"test_accuracy", "heldout_accuracy"}
    text = format_table(rows)
    assert "accuracy" in text.splitlines()[0] and "(held-out)" in text and "(test)" in text

    reg = tmp_path / "reg"
    reg.mkdir()
    final = {"iteration": 3, "heldout_loss": 0.15}
    (reg / "report.json").write_text(json.dumps({
        "config": {"dataset": "linreg:4,2", "privacy": "output", "seed": 0},
        "algorithms": {"x": _entry(final, _privacy(1.0)), "y": _entry(final)}}))
    points = load_runs([reg])
    assert {p.accuracy_metric for p in points} == {"none"}
    assert "-" in format_table(tradeoff_table(points)).splitlines()[2].split()
    seen = []
    from matplotlib.figure import Figure

    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        [ax.get_ylabel() for ax in fig.get_axes()]) or original(fig, *a, **k))
    path = plot_tradeoff(points, tmp_path / "reg.png")
    assert seen == [["held-out loss (final)"]]  # one panel: no empty accuracy axes
    from PIL import Image

    meta = Image.open(path).text
    assert "held-out loss" in meta["Title"] and "x (output): epsilon 2" in meta["Description"]


# --------------------------------------------------- each trainer's quick run, end to end
@pytest.mark.parametrize("name", list(RUNS))
def test_report_tradeoff_reads_every_trainers_run(name: str, tmp_path: Path, capsys) -> None:
    from privkit.cli import main

    run = quick_runs()[name]
    body = json.loads((run / "report.json").read_text())
    out = tmp_path / "t.png"
    assert main(["report", "tradeoff", str(run), "--out", str(out), "--json"]) == 0
    rows = {r["algorithm"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(body["algorithms"]) and out.stat().st_size > 10_000
    for alg, entry in body["algorithms"].items():
        row, final = rows[alg], entry["final"]
        section = entry.get("gradient_privacy") or entry.get("privacy")
        private = section is not None and not section.get("non_private")
        if not private:
            assert row["privacy"] == "none" and row["epsilon"] == "inf", alg
        elif section.get("measure") == "mi_dp_nats":
            assert row["mi_dp_nats"] == pytest.approx(section["mi_dp_nats_max"])
        else:
            assert row["epsilon"] == pytest.approx(section["epsilon_max"]), alg
            assert row["guarantee"] == section["guarantee"]
        # held-out metrics wherever the report has them
        acc = "heldout_accuracy" if "heldout_accuracy" in final else (
            "test_accuracy" if "test_accuracy" in final else "none")
        assert row["accuracy_metric"] == acc
        if acc != "none":
            assert row["accuracy"] == pytest.approx(final[acc])
        loss = "heldout_loss" if "heldout_loss" in final else "train_loss"
        assert row["loss_metric"] == loss and row["loss"] == pytest.approx(final[loss])
    if RUNS[name]:  # a private run: its held-out metrics, and the text table says so
        assert {r["loss_metric"] for r in rows.values()} == {"heldout_loss"}
        assert main(["report", "tradeoff", str(run), "--out", str(out)]) == 0
        header = capsys.readouterr().out.splitlines()[0]
        assert "held-out loss" in header and "train loss" not in header
