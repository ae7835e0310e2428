"""The figures every trainer writes: epsilon in the title, legend and PNG metadata, a curve
against epsilon for every private run, no empty panel, no degenerate axis, no invented
segment on a log axis, readable maths labels (fl_examples.core.report, .epsilon_plot)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _quick_runs import FIGURES, RUNS, quick_runs
from PIL import Image

import privkit
from fl_examples.core.epsilon_plot import epsilon_by_round, thin
from fl_examples.core.report import legend_label, plot_histories, privacy_summary, tidy_axis
from fl_examples.mapa import MapaConfig
from privkit.ledger import Ledger


def _figures(run: Path) -> dict[str, list]:
    return {p.name: FIGURES[str(p.resolve())] for p in sorted(run.glob("*.png"))}


def _report(run: Path) -> dict:
    return json.loads((run / "report.json").read_text())


def _epsilon_section(entry: dict) -> dict | None:
    p = entry.get("gradient_privacy") or entry.get("privacy")
    if not p or p.get("non_private") or p.get("measure") == "mi_dp_nats":
        return None
    return p


@pytest.mark.parametrize("name", list(RUNS))
def test_every_figure_names_data_seed_and_how_private(name: str) -> None:
    run = quick_runs()[name]
    body = _report(run)
    config = body["config"]
    figures = _figures(run)
    assert figures, "no figure written"
    for png in figures:
        meta = Image.open(run / png).text
        assert meta["Title"].startswith(f"{config['dataset']}, seed {config['seed']}; "), png
        private = [a for a, e in body["algorithms"].items() if _epsilon_section(e)]
        for alg in private:  # every private algorithm's epsilon, in every figure
            eps = _epsilon_section(body["algorithms"][alg])
            value = eps.get("epsilon_max", eps.get("epsilon_central"))
            assert f"{value:.3g} ({alg})" in meta["Description"], (png, alg)
        if private:
            assert "ε ≤" in meta["Description"]
        if name == "scfl-coded":  # MI-DP only: in nats, never called an epsilon
            assert "MI-DP ≤" in meta["Description"] and "ε ≤" not in meta["Description"]
        if not private and name != "scfl-coded":
            assert meta["Description"] == "non-private run"


def test_legends_carry_epsilon_or_midp() -> None:
    body = _report(quick_runs()["scfl-gradient"])
    algs = body["algorithms"]
    assert "ε ≤" in legend_label("scfl", algs["scfl"])  # the gradients' epsilon
    assert "ε ≤" in legend_label("fl-pma", algs["fl-pma"])
    assert "MI-DP ≤" in legend_label("dp-cfl", algs["dp-cfl"])
    dprec = _report(quick_runs()["dprec"])["algorithms"]
    assert legend_label("fedavg", dprec["fedavg"]) == "fedavg"  # non_private: true
    line = privacy_summary(dprec)
    assert "central" in line and "fedavg: non-private" in line
    assert "seeded simulation" in line


@pytest.mark.parametrize("name", [n for n, private in RUNS.items() if private])
def test_every_private_run_has_a_curve_against_epsilon(name: str) -> None:
    run = quick_runs()[name]
    body = _report(run)
    (ax,) = _figures(run)["curves_vs_epsilon.png"]
    assert "ε" in ax.xlabel and "cumulative" in ax.xlabel
    assert ax.ylabel in ("held-out accuracy", "held-out loss")
    if name == "scfl-regression":
        assert ax.ylabel == "held-out loss"  # no accuracy in a regression
    private = {a: p for a, e in body["algorithms"].items() if (p := _epsilon_section(e))}
    curves = [line for line in ax.lines if len(line[0]) > 2 or line[0] != (0.0, 1.0)]
    finals = sorted(p.get("epsilon_max", p.get("epsilon_central")) for p in private.values())
    ends = sorted(xs[-1] for xs, _ in curves)
    assert ends == pytest.approx(finals, rel=1e-9)  # the last point is the report's epsilon
    for xs, ys in curves:
        assert list(xs) == sorted(xs)  # the cumulative epsilon never decreases
        assert any(math.isfinite(y) for y in ys)


def test_the_epsilon_curve_takes_the_max_over_clients_and_public_rounds(tmp_path) -> None:
    ledger = Ledger.create(tmp_path / "l.jsonl", population_id="p", delta=1e-5)
    a = privkit.PoissonSampledDpEvent(0.1, privkit.GaussianDpEvent(1.0))
    b = privkit.PoissonSampledDpEvent(0.3, privkit.GaussianDpEvent(1.0))
    c = privkit.GaussianDpEvent(30.0)
    plan = {1: [("x", a, 3), ("y", b, 1), ("v", a, 1), ("w", a, 2)],
            2: [("x", a, 3), ("v", c, 1), ("w", c, 1)],
            3: [("y", b, 2), ("z", a, 1), ("w", b, 9), ("u", a, 1), ("u", c, 2)]}
    for r, spends in plan.items():
        for cid, ev, n in spends:
            ledger.spend([cid], privkit.SelfComposedDpEvent(ev, n), label="t", round=r)
    got = epsilon_by_round(tmp_path / "l.jsonl", [0, 1, 2, 3])
    want = [0.0]
    for r in (1, 2, 3):
        comps: dict[str, list] = {}
        for rr in range(1, r + 1):
            for cid, ev, n in plan[rr]:
                comps.setdefault(cid, []).append(privkit.SelfComposedDpEvent(ev, n))
        want.append(max(privkit.epsilon(privkit.ComposedDpEvent(c), 1e-5).epsilon
                        for c in comps.values()))
    assert got == pytest.approx(want, rel=1e-12)
    assert got[-1] == pytest.approx(max(ledger.epsilons().values()), rel=1e-12)
    assert thin(list(range(100)), 5) == [0, 25, 50, 74, 99]


@pytest.mark.parametrize("name", list(RUNS))
def test_no_empty_panel_and_no_degenerate_axis(name: str) -> None:
    for png, axes in _figures(quick_runs()[name]).items():
        for ax in axes:
            finite = [y for _, ys in ax.lines for y in ys if math.isfinite(y)]
            assert finite or ax.bars, (png, ax.ylabel)  # never an all-NaN panel
            for lo, hi, scale in ((*ax.ylim, ax.yscale), (*ax.xlim, ax.xscale)):
                span = (math.log10(hi) - math.log10(lo)) if scale == "log" else hi - lo
                size = 1.0 if scale == "log" else max(abs(lo), abs(hi))
                assert span > 1e-3 * size, (png, ax.ylabel, lo, hi)
            if ax.xscale == "log":  # no invented segment from the axis' edge to x = 0
                assert all(x > 0 for xs, _ in ax.lines for x in xs), png
    if name == "scfl-regression":  # no accuracy panel for a regression
        assert not any("accuracy" in ax.ylabel
                       for axes in _figures(quick_runs()[name]).values() for ax in axes)


def test_dprec_bits_start_at_the_first_evaluation_that_sent_bits() -> None:
    run = quick_runs()["dprec"]
    body = _report(run)
    axes = _figures(run)["curves_vs_bits.png"]
    assert all(ax.xscale == "log" and "first evaluation above 0" in ax.xlabel for ax in axes)
    firsts = sorted(min(xs) for xs, _ in axes[0].lines)
    want = sorted(next(h["cumulative_bits"] for h in a["history"] if h["cumulative_bits"] > 0)
                  for a in body["algorithms"].values())
    assert firsts == want
    assert body["algorithms"]["dprec"]["history"][0]["cumulative_bits"] == 0  # not drawn


def test_mapa_schedule_has_maths_labels_and_readable_axes(tmp_path, monkeypatch) -> None:
    # the quick runs never leave stage 0: one panel, the clip against the update number
    for name in ("mapa-pure", "mapa-gaussian"):
        assert "stage_note" in _report(quick_runs()[name])["algorithms"]["mapa"]
        (ax,) = _figures(quick_runs()[name])["schedule.png"]
        assert ax.xlabel == "applied update $t$" and ax.xscale == "log"
        assert r"$C_s = b\,\Delta S_s / 2$" in ax.ylabel and "DeltaS_s" not in ax.ylabel
    # a run with several stages: three panels against the stage
    from matplotlib.figure import Figure

    from fl_examples.core.asyncsim import simulate
    from fl_examples.mapa.report import _plot_extras
    from fl_examples.mapa.schedule import MapaSchedule

    seen = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, *a, **k: seen.append(
        (str(path), [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.get_axes()]))
        or original(fig, path, *a, **k))
    sched = MapaSchedule(sigma=30, batch=24, delta=1e-3, epsilon0=1, lipschitz=10, r0=50,
                         tau=3, theta=0.5, dim=4380, variance="paper")
    stages = [sched.stage(i).to_dict() for i in range(4)]
    _plot_extras(tmp_path, simulate(4, 20, MapaConfig().timing(), seed=0), 20, stages)
    (axes,) = [a for path, a in seen if path.endswith("schedule.png")]
    labels = [y for _, y in axes]
    assert labels[0].startswith(r"$\Delta S_s$") and r"$C_s = b\,\Delta S_s / 2$" in labels[0]
    assert labels[1].startswith(r"$\gamma_s$") and labels[2].startswith("$T_s$")
    assert all(x == "stage $s$" for x, _ in axes)
    assert "DeltaS_s" not in " ".join(labels)  # no ASCII pseudo-maths


def test_scfl_footnote_says_plainly_when_midp_implies_nothing() -> None:
    run = quick_runs()["scfl-coded"]
    body = _report(run)
    top = body["algorithms"]["scfl"]["privacy"]["mi_dp_nats_max"]
    assert math.sqrt(2 * top) > 1
    scope = body["privacy_scope"]
    assert "coded upload only" in scope and "implies nothing" in scope
    assert f"largest is {top:.3g} nats" in scope and "no (epsilon, delta)-DP guarantee" in scope
    assert "sqrt(2 nats))-DP" not in scope  # the old, misleading phrasing
    meta = Image.open(run / "curves_vs_iteration.png").text
    assert "no (epsilon, delta)-DP guarantee at all" in meta["Description"]


def test_plot_histories_skips_all_nan_panels_and_widens_flat_axes(tmp_path, monkeypatch) -> None:
    from matplotlib.figure import Figure

    seen: list[list] = []
    original = Figure.savefig

    def savefig(fig, *a, **k):
        seen.append([(ax.get_ylabel(), ax.get_ylim()) for ax in fig.get_axes()])
        return original(fig, *a, **k)

    monkeypatch.setattr(Figure, "savefig", savefig)
    rows = [{"iteration": i, "heldout_loss": 0.5, "heldout_accuracy": math.nan,
             "wall_time_s": 0.1 * i} for i in range(3)]
    plot_histories(tmp_path, {"a": rows})
    for panels in seen:
        assert [label for label, _ in panels] == ["held-out loss"]
        (_, (lo, hi)), = panels
        assert lo < 0.5 < hi and hi - lo > 0.05  # a flat loss gets a readable range


def test_tidy_axis_leaves_real_spreads_alone() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0.2, 0.8])
    before = ax.get_ylim()
    tidy_axis(ax, [0.2, 0.8])
    assert ax.get_ylim() == before
    ax.set_ylim(3.781164, 3.781165)
    tidy_axis(ax, [3.7811649, 3.7811648])
    lo, hi = ax.get_ylim()
    assert hi - lo > 0.3
    plt.close(fig)


def test_a_long_x_label_is_wrapped_inside_the_figure(tmp_path, monkeypatch) -> None:
    """SCFL's x label (the client gradients' epsilon, what it leaves out) is longer than the
    figure is wide: it is wrapped, never cut at both ends."""
    from matplotlib.figure import Figure

    from fl_examples.core.epsilon_plot import plot_vs_epsilon

    seen = []
    original = Figure.savefig

    def spy(fig, *a, **k):
        fig.canvas.draw()
        label = fig.get_axes()[0].xaxis.label
        seen.append((label.get_text(), label.get_window_extent(), fig.bbox))
        return original(fig, *a, **k)

    monkeypatch.setattr(Figure, "savefig", spy)
    text = ("client gradients' ε after each evaluation, cumulative (max over clients, "
            "δ = 1e-05; the coded upload is not in it)")
    rows = [{"heldout_accuracy": 0.5}, {"heldout_accuracy": 0.6}]
    assert plot_vs_epsilon(tmp_path, {"a": [(1.0, rows[0]), (2.0, rows[1])]}, x_label=text,
                           text=None) is not None
    ((drawn, box, fig),) = seen
    assert drawn.replace("\n", " ") == text and "\n" in drawn
    assert fig.x0 <= box.x0 and box.x1 <= fig.x1
