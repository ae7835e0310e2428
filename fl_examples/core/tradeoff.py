"""Privacy-utility trade-off across runs: ``privkit report tradeoff RUN_DIRS...``.

Reads the ``report.json`` of many runs (see :mod:`fl_examples.core.report`) of any bundled
trainer, typically a sweep over noise levels with several seeds each, and draws epsilon
against the final accuracy and loss, like Fig. 3 of the Upcycled-FL paper.

Metrics
    A private run publishes its metrics on the data set's public held-out set
    (``heldout_accuracy``, ``heldout_loss``; docs/epsilon-covers.md), so those are read
    wherever a report has them, for the non-private baselines of a private run too; older
    and non-private reports without them give the clients' test accuracy and training loss.
    The table's columns and the plot's axes name the metric (``held-out acc``, ``test
    acc``, ...; tagged per row when runs mix them). A regression (SCFL on ``linreg``) has no
    accuracy: its column shows ``-`` and the plot has no accuracy panel.

Grouping
    One :class:`RunPoint` per (run, algorithm). A *curve* is (algorithm, privacy kind,
    dataset); a *point* on it is one *setting*: the run's config without the keys in
    :data:`IGNORED_CONFIG_KEYS` (the seed, the device, evaluation/checkpoint cadence, ...).
    Runs that differ only in those keys -- in particular only in the seed -- are aggregated:
    mean over seeds, min-max range as error bars. So a sweep over ``noise`` x ``seed`` gives one
    curve per algorithm with one point per noise level, whatever the config key is called.
    The keys that vary along a curve are shown as the point's label (e.g. ``noise=1.5``).

Which privacy section
    ``privacy`` holds the epsilon (``epsilon_mean``, ``epsilon_max``) of every trainer but
    SCFL with gradient noise, which keeps its client gradients' epsilon in
    ``gradient_privacy`` (its ``privacy`` is the coded upload's MI-DP): that epsilon is the
    point's, with privacy kind ``gradient-dp`` and a note that the model also rests on the
    coded upload. The privacy kind is the config's ``privacy`` (Upcycled-FL's ``output``,
    ``record``, ...), MAPA's noise (``gaussian noise``, ``l2 noise``) or DP-REC's mechanism
    (``rec``, ``client_level_gaussian``).

Non-private algorithms
    An algorithm entry without ``privacy``, or whose ``privacy`` says ``non_private: true``
    (DP-REC's FedAvg reference), is kept with privacy kind ``"none"`` and epsilon = +inf; the
    plot draws it as a dashed horizontal reference line (mean over seeds, shaded min-max
    band). Private points whose epsilon is not finite (an accountant that returned inf, or
    NaN) cannot be placed on the x-axis: they stay in the table and are listed under the plot
    as omitted.

Guarantees
    Each point carries its report's ``guarantee``: ``proven``, ``simulation`` (a seeded run:
    the epsilon holds only against someone who does not know the seed) or ``not proven``; a
    row has the weakest of its runs'. A point is drawn with a filled marker only when it is
    proven; otherwise hollow.

MI-DP runs
    A trainer whose privacy is measured in mutual-information DP (SCFL's coded upload) writes
    ``privacy = {"measure": "mi_dp_nats", "mi_dp_nats_mean", "mi_dp_nats_max", ...}`` instead
    of epsilons. Such points carry ``measure = "mi_dp_nats"``; their table rows hold the value
    under ``mi_dp_nats`` (never ``epsilon``) and the plot's x axis reads "MI-DP (nats)". MI-DP
    and epsilon cannot share an axis: mixing them in one plot is refused, except that the
    MI-DP-only methods of an SCFL run with gradient noise (DP-CFL) stay in the table and are
    named under the plot. A sweep over the coding noise gives the shape of SCFL's Fig. 2
    (MI-DP against accuracy).

Numbers are never silently repaired: a NaN accuracy makes the mean NaN.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fl_examples.core.report import tidy_axis
from fl_examples.core.tradeoff_runs import (
    _EPSILON_CHOICES,
    GUARANTEES,
    RunPoint,
    _check_epsilon,
    load_runs,
)
from privkit.errors import InvalidParameterError

__all__ = [
    "IGNORED_CONFIG_KEYS",
    "RunPoint",
    "load_runs",
    "tradeoff_table",
    "format_table",
    "plot_tradeoff",
    "add_report_parser",
    "run_report",
]

#: Config keys that do not change the result distribution; runs differing only in these
#: (the seed above all) are aggregated into one point. ``compare`` only adds baselines to
#: a run; ``dataset_description`` can mention the seed.
IGNORED_CONFIG_KEYS = frozenset({
    "seed", "device", "eval_every", "checkpoint_every", "resume", "out", "compare",
    "dataset_description",
})

#: The metrics a point's accuracy and loss can be, and how the table and plot name them.
METRIC_NAMES = {"heldout_accuracy": "held-out accuracy", "test_accuracy": "test accuracy",
                "heldout_loss": "held-out loss", "train_loss": "train loss",
                "none": "accuracy (none: a regression)"}


# ---------------------------------------------------------------------------- aggregating


def _stats(values: Sequence[float]) -> tuple[float, float, float]:
    if any(math.isnan(v) for v in values):
        return math.nan, math.nan, math.nan
    if all(math.isinf(v) and v > 0 for v in values):
        return math.inf, math.inf, math.inf
    return math.fsum(values) / len(values), min(values), max(values)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)):
        return _canonical(value)
    return str(value)


def tradeoff_table(points: Sequence[RunPoint], *, epsilon: str = "mean",
                   ignore: Iterable[str] = IGNORED_CONFIG_KEYS) -> list[dict[str, Any]]:
    """Aggregate runs over seeds: one row per (algorithm, privacy kind, dataset, setting).

    ``epsilon`` picks each run's ``epsilon_mean`` or ``epsilon_max`` (over clients). Each row
    also has ``measure``: for MI-DP points (``"mi_dp_nats"``) the keys ``epsilon*`` below are
    named ``mi_dp_nats*`` instead. Each row
    has ``algorithm``, ``privacy``, ``dataset``, ``setting`` (the config keys that vary along
    the curve, as a dict) and ``label`` (the same as text), ``n_runs``, ``n_seeds``, ``seeds``,
    ``epsilon_stat``, then ``epsilon``, ``accuracy``, ``loss`` (means over runs) each with
    ``_lo``/``_hi`` (min/max over runs), ``accuracy_metric`` and ``loss_metric`` (which
    metric they are: ``heldout_accuracy`` / ``test_accuracy``, ``heldout_loss`` /
    ``train_loss``, or ``mixed``), ``proven`` (all runs proven), ``guarantee`` (the weakest
    over runs: ``proven``, ``simulation``, ``not proven``; ``-`` when not private), ``delta``
    (the common delta, or None / a list when they differ), ``notes`` (what the epsilon leaves
    out, e.g. SCFL's coded upload) and ``sources``. Rows are sorted by curve, then by
    epsilon.
    """
    _check_epsilon(epsilon)
    ignored = frozenset(ignore)
    groups: dict[tuple[Any, ...], list[RunPoint]] = {}
    settings: dict[tuple[Any, ...], dict[str, Any]] = {}
    for p in points:
        setting = {k: v for k, v in p.config.items() if k not in ignored}
        gkey = (p.algorithm, p.privacy, p.dataset, _canonical(setting), p.measure)
        groups.setdefault(gkey, []).append(p)
        settings[gkey] = setting

    # keys whose values differ between the points of one curve: the "noise" axis
    varying: dict[tuple[str, str, str], list[str]] = {}
    for gkey, setting in settings.items():
        curve = gkey[:3]
        keys = varying.setdefault(curve, [])
        for other_key, other in settings.items():
            if other_key[:3] != curve:
                continue
            for k in sorted(set(setting) | set(other)):
                if k not in keys and _canonical(setting.get(k)) != _canonical(other.get(k)):
                    keys.append(k)

    rows = []
    for gkey, runs in groups.items():
        alg, kind, dataset, _, measure = gkey
        keys = sorted(varying[gkey[:3]])
        setting = {k: settings[gkey].get(k) for k in keys}
        eps = _stats([r.value(epsilon) for r in runs])
        acc = _stats([r.accuracy for r in runs])
        loss = _stats([r.loss for r in runs])
        deltas = sorted({r.delta for r in runs if r.delta is not None})
        seeds = sorted(r.seed for r in runs if r.seed is not None)
        marks = {r.guarantee for r in runs}
        rows.append({
            "algorithm": alg, "privacy": kind, "dataset": dataset,
            "setting": setting, "label": ", ".join(f"{k}={_fmt_value(v)}"
                                                   for k, v in setting.items()),
            "n_runs": len(runs), "n_seeds": len(set(seeds)), "seeds": seeds,
            "epsilon_stat": epsilon, "measure": measure,
            measure: eps[0], f"{measure}_lo": eps[1], f"{measure}_hi": eps[2],
            "accuracy": acc[0], "accuracy_lo": acc[1], "accuracy_hi": acc[2],
            "loss": loss[0], "loss_lo": loss[1], "loss_hi": loss[2],
            "accuracy_metric": _common(r.accuracy_metric for r in runs),
            "loss_metric": _common(r.loss_metric for r in runs),
            "proven": all(r.proven for r in runs),
            "guarantee": next((g for g in (*GUARANTEES[::-1], "-") if g in marks), "-"),
            "delta": (deltas[0] if len(deltas) == 1 else (deltas or None)),
            "notes": sorted({r.note for r in runs if r.note}),
            "sources": sorted(str(r.source) for r in runs),
        })

    def order(row: dict[str, Any]) -> tuple[Any, ...]:
        e = row[row["measure"]]
        return (row["algorithm"], row["privacy"], row["dataset"],
                math.isnan(e), e if not math.isnan(e) else 0.0, row["label"])

    rows.sort(key=order)
    return rows


def _common(values: Iterable[str]) -> str:
    """The one value of ``values``, or ``"mixed"``."""
    found = set(values)
    return found.pop() if len(found) == 1 else "mixed"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


_SHORT = {"heldout_accuracy": ("held-out acc", "held-out"), "test_accuracy": ("test acc", "test"),
          "heldout_loss": ("held-out loss", "held-out"), "train_loss": ("train loss", "train"),
          "none": ("accuracy", "none")}


def _metric_title(rows: Sequence[Mapping[str, Any]], which: str, *, short: bool = True) -> str:
    """What the rows' accuracy (or loss) is: one metric's name, or ``which`` when they mix."""
    metrics = {r[f"{which}_metric"] for r in rows}
    if len(metrics) == 1 and (m := metrics.pop()) in METRIC_NAMES:
        return _SHORT[m][0] if short else METRIC_NAMES[m]
    if short:
        return which
    other = "test accuracy" if which == "accuracy" else "training loss"
    return f"{which}: held-out where the report has it, else the clients' {other}"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A readable text table of :func:`tradeoff_table` rows, its metric columns named by what
    they are (held-out or the clients' test accuracy; a value is tagged when rows mix)."""
    def rng(row: Mapping[str, Any], k: str, fmt: str) -> str:
        mean, lo, hi = row[k], row[f"{k}_lo"], row[f"{k}_hi"]
        if math.isinf(mean) or math.isnan(mean) or lo == hi:
            return format(mean, fmt)
        return f"{mean:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"

    def metric(row: Mapping[str, Any], k: str, mixed: bool) -> str:
        if row.get(f"{k}_metric") == "none":
            return "-"
        text = rng(row, k, ".4f")
        m = row.get(f"{k}_metric")
        return text + (f" ({_SHORT[m][1]})" if mixed and m in _SHORT else
                       " (mixed)" if mixed else "")

    stat = rows[0]["epsilon_stat"] if rows else "mean"
    measures = {r.get("measure", "epsilon") for r in rows if r["privacy"] != "none"}
    name = "MI-DP nats" if measures == {"mi_dp_nats"} else "epsilon"
    if len(measures) > 1:
        name = "epsilon | MI-DP nats"
    mixed = {k: len({r[f"{k}_metric"] for r in rows}) > 1 for k in ("accuracy", "loss")}
    header = ["algorithm", "privacy", "setting", "seeds", f"{name} ({stat})", "guarantee",
              _metric_title(rows, "accuracy"), _metric_title(rows, "loss")]
    body = []
    for r in rows:
        body.append([
            r["algorithm"], r["privacy"] + (f" [{r['dataset']}]" if r["dataset"] else ""),
            r["label"] or "-", str(r["n_runs"]), rng(r, r.get("measure", "epsilon"), ".3f")
            + (" nats" if len(measures) > 1 and r.get("measure") == "mi_dp_nats" else ""),
            {"not proven": "NOT PROVEN"}.get(r["guarantee"], r["guarantee"]),
            metric(r, "accuracy", mixed["accuracy"]), metric(r, "loss", mixed["loss"]),
        ])
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("values: mean over seeds [min, max]; epsilon inf = not private"
                 + ("; MI-DP (Cuff-Yu, nats) is not an epsilon" if "mi_dp_nats" in measures
                    else ""))
    metrics = {r[f"{k}_metric"] for r in rows for k in ("accuracy", "loss")}
    said = []
    if metrics & {"heldout_accuracy", "heldout_loss", "mixed"}:
        said.append("held-out: the data set's public held-out set (what a private run "
                    "publishes)")
    if metrics & {"test_accuracy", "train_loss", "mixed"}:
        said.append("test / train: the clients' own data (non-private or older reports)")
    if said:
        lines.append("; ".join(said))
    if any(r["guarantee"] == "simulation" for r in rows):
        lines.append("simulation: a seeded run; its epsilon holds only against someone who "
                     "does not know the seed (--secure-noise for a proven one)")
    lines += [f"note: {n}" for n in sorted({n for r in rows for n in r.get("notes", [])})]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- plotting


def _one_measure(rows: list[dict[str, Any]], points: Sequence[RunPoint]
                 ) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows to plot on one privacy axis, and the MI-DP rows left beside it.

    Epsilon and MI-DP (nats) cannot share an axis. Within an SCFL run with gradient noise the
    methods that send no client gradient (DP-CFL) have only the coded upload's MI-DP: such
    rows, from reports whose other algorithms have an epsilon, are left off the plot (and
    named under it). Otherwise a mix is refused.
    """
    private = [r for r in rows if r["privacy"] != "none"]
    if len({r["measure"] for r in private}) <= 1:
        return rows, []
    eps_sources = {s for r in private if r["measure"] == "epsilon" for s in r["sources"]}
    mi = [r for r in private if r["measure"] == "mi_dp_nats"]
    if all(set(r["sources"]) <= eps_sources for r in mi):
        return [r for r in rows if r not in mi], [
            f"{r['algorithm']} ({r['mi_dp_nats']:.3g} nats)" for r in mi]
    raise InvalidParameterError(
        "RUN_DIRS", sorted({str(p.source) for p in points}),
        "runs of one privacy measure: epsilon and MI-DP (nats) cannot share an axis")


#: Metadata a saved figure can carry, by format (matplotlib's keys per backend).
_METADATA_KEYS = {"png": ("Title", "Description"), "pdf": ("Title", "Subject"),
                  "svg": ("Title", "Description")}


def plot_tradeoff(points: Sequence[RunPoint], out_png: str | Path, *,
                  epsilon: str = "mean") -> Path:
    """Write the privacy-utility plot to ``out_png`` (atomically) and return its path.

    Left: accuracy, right: loss, each the held-out metric where the reports have it (the
    axis says which), against epsilon (``epsilon_mean`` or ``epsilon_max`` over clients,
    mean over seeds). Bars are min-max over seeds in both directions; one curve per
    (algorithm, privacy kind, dataset), sorted by epsilon; hollow markers where epsilon is not
    proven (a seeded simulation, or unproven settings); non-private algorithms as dashed
    horizontal lines. A panel with no finite value (the accuracy of a regression) is left out.
    The title and the PNG's ``Title`` / ``Description`` text say what is plotted.
    """
    _check_epsilon(epsilon)
    out = Path(out_png)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from privkit.ledger import atomic_write_bytes

    fmt = out.suffix.lstrip(".").lower()
    rows = tradeoff_table(points, epsilon=epsilon)
    rows, beside = _one_measure(rows, points)
    measure = next((r["measure"] for r in rows if r["privacy"] != "none"), "epsilon")
    panels = [k for k in ("accuracy", "loss")
              if any(math.isfinite(r[k]) for r in rows)] or ["loss"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels) + 0.4, 4.8),
                             squeeze=False, layout="constrained")
    axes = axes[0]
    try:
        supported = fig.canvas.get_supported_filetypes()
        if fmt not in supported:
            raise InvalidParameterError("out", str(out_png),
                                        f"a file name ending in .{', .'.join(sorted(supported))}")
        curves: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        for r in rows:
            curves.setdefault((r["algorithm"], r["privacy"], r["dataset"]), []).append(r)
        several_datasets = len({c[2] for c in curves}) > 1
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        omitted: list[str] = []
        with_data = dict.fromkeys(panels, False)
        marks: set[str] = set()
        finite_eps: list[float] = []
        for i, ((alg, kind, dataset), crows) in enumerate(curves.items()):
            color = colors[i % len(colors)]
            name = alg + (f" ({kind})" if kind != "none" else " (non-private)")
            if several_datasets:
                name += f" [{dataset}]"
            if kind == "none":
                for ax, k in zip(axes, panels):
                    for j, r in enumerate(crows):
                        if not math.isfinite(r[k]):
                            continue
                        label = name + (f" {r['label']}" if len(crows) > 1 else "")
                        ls = ("--", ":", "-.")[j % 3]
                        ax.axhline(r[k], color=color, ls=ls, lw=1.3, label=label)
                        if r[f"{k}_lo"] < r[f"{k}_hi"]:
                            ax.axhspan(r[f"{k}_lo"], r[f"{k}_hi"], color=color, alpha=0.12,
                                       lw=0)
                continue
            placed = [r for r in crows if math.isfinite(r[measure])]
            omitted += [f"{name} {r['label']}".strip() + f" ({measure} {r[measure]})"
                        for r in crows if not math.isfinite(r[measure])]
            if not placed:
                continue
            xs = [r[measure] for r in placed]
            finite_eps += ([r[f"{measure}_lo"] for r in placed]
                           + [r[f"{measure}_hi"] for r in placed])
            xerr = [[x - r[f"{measure}_lo"] for x, r in zip(xs, placed)],
                    [r[f"{measure}_hi"] - x for x, r in zip(xs, placed)]]
            for ax, k in zip(axes, panels):
                ys = [r[k] for r in placed]
                with_data[k] |= any(math.isfinite(y) for y in ys)
                yerr = [[y - r[f"{k}_lo"] for y, r in zip(ys, placed)],
                        [r[f"{k}_hi"] - y for y, r in zip(ys, placed)]]
                ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="-", color=color, capsize=3,
                            lw=1.5, elinewidth=1, label=name)
                for x, y, r in zip(xs, ys, placed):
                    ax.plot([x], [y], "o", ms=6, color=color,
                            mfc=color if r["guarantee"] == "proven" else "white", mec=color,
                            mew=1.5)
                    if len(placed) > 1 and r["label"] and k == panels[0]:
                        ax.annotate(r["label"], (x, y), textcoords="offset points",
                                    xytext=(4, 4), fontsize=7, color=color)
            marks |= {r["guarantee"] for r in placed}

        positive = [e for e in finite_eps if e > 0]
        log_x = bool(positive) and len(positive) == len(finite_eps) \
            and max(positive) / min(positive) > 30
        deltas = {r["delta"] for r in rows if r["privacy"] != "none"
                  and isinstance(r["delta"], float)} if measure == "epsilon" else set()
        delta_txt = f", δ = {deltas.pop():g}" if len(deltas) == 1 else ""
        for ax, k in zip(axes, panels):
            ax.set_xlabel(f"ε ({epsilon} over clients{delta_txt})" if measure == "epsilon"
                          else f"MI-DP, nats ({epsilon} over clients; coded upload only, "
                          "not an ε)")
            ax.set_ylabel(textwrap.fill(_metric_title(rows, k, short=False), 45)
                          + " (final)")
            ax.grid(alpha=0.3)
            if log_x and with_data[k]:
                ax.set_xscale("log")
            tidy_axis(ax, [r[k] for r in rows])
            if not (log_x and with_data[k]):
                tidy_axis(ax, finite_eps, "x")
        handles, labels = axes[0].get_legend_handles_labels()
        hollow = ("hollow marker: epsilon not proven" if "not proven" in marks else
                  "hollow marker: seeded simulation (not proven)" if "simulation" in marks
                  else None)
        if hollow:
            handles.append(Line2D([], [], ls="none", marker="o", mfc="white", mec="gray",
                                  mew=1.5))
            labels.append(hollow)
        if handles:
            axes[0].legend(handles, labels, fontsize=8)
        datasets = sorted({r["dataset"] for r in rows if r["dataset"]})
        title = ("privacy-utility trade-off" + (f" on {', '.join(datasets)}" if datasets
                                                else "")
                 + ": final " + " and ".join(_metric_title(rows, k, short=False).split(":")[0]
                                             for k in panels)
                 + f" against {'ε' if measure == 'epsilon' else 'MI-DP'}")
        fig.suptitle(textwrap.fill(title, 110) + "\n(mean over seeds; bars: min-max over "
                     "seeds)", fontsize=10)
        foot = [f"not plotted (MI-DP of the coded upload, not an ε): {', '.join(beside)}"] \
            if beside else []
        if omitted:
            what = "epsilon" if measure == "epsilon" else "MI-DP"
            foot.append(f"not plotted ({what} not finite): " + "; ".join(omitted))
        foot += [f"note: {n}" for n in sorted({n for r in rows for n in r["notes"]})]
        if foot:
            fig.supxlabel("\n".join(textwrap.fill(f, int(fig.get_figwidth() * 16))
                                    for f in foot), fontsize=7, color="gray", x=0.01,
                          ha="left")
        description = "; ".join(
            f"{r['algorithm']} ({r['privacy']}{', ' + r['label'] if r['label'] else ''}): "
            + (f"{measure} {r[measure]:.4g}" if r["privacy"] != "none" else "non-private")
            + f", {r['accuracy_metric']} {r['accuracy']:.4g}, {r['loss_metric']} "
            f"{r['loss']:.4g}" for r in rows)
        keys = _METADATA_KEYS.get(fmt)
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, dpi=110, metadata=dict(zip(keys, (title, description)))
                    if keys else None)
    finally:
        plt.close(fig)
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, buf.getvalue())
    return out


# ------------------------------------------------------------------------------------- CLI


def add_report_parser(sub: Any, parser_class: Any) -> None:
    """Register ``report tradeoff RUN_DIRS... [--out PNG] [--epsilon mean|max] [--json]``."""
    report = sub.add_parser("report", help="summaries across finished runs")
    rsub = report.add_subparsers(dest="report", required=True, parser_class=parser_class)
    t = rsub.add_parser(
        "tradeoff", help="privacy-utility plot: epsilon vs held-out accuracy / loss",
        description="Aggregate runs of any bundled trainer over seeds (runs whose configs "
                    "differ only in the seed, device, ... form one point) and plot epsilon "
                    "against the final held-out accuracy and loss (the clients' test accuracy "
                    "and training loss for reports without held-out metrics), one curve per "
                    "algorithm. Non-private algorithms are drawn as horizontal reference "
                    "lines; unproven epsilons (seeded simulations included) as hollow "
                    "markers.")
    t.add_argument("run_dirs", nargs="+", metavar="RUN_DIRS",
                   help="run directories (with report.json), report.json files, or "
                        "directories of run directories")
    t.add_argument("--out", default="tradeoff.png", help="plot file (default tradeoff.png)")
    t.add_argument("--epsilon", default="mean", choices=list(_EPSILON_CHOICES),
                   help="per-run epsilon: mean or max over clients (default mean)")
    t.add_argument("--json", action="store_true", help="print the table as JSON")


def run_report(args: argparse.Namespace) -> int:
    """Run ``report tradeoff``: load, print the table (text or JSON), write the plot."""
    which = getattr(args, "report", "tradeoff")
    if which != "tradeoff":
        raise InvalidParameterError("report", which, "'tradeoff'")
    epsilon = _check_epsilon(getattr(args, "epsilon", "mean"))
    run_dirs = getattr(args, "run_dirs", None)
    if not run_dirs or isinstance(run_dirs, (str, bytes)):
        raise InvalidParameterError("RUN_DIRS", run_dirs, "one or more run directories")
    out = getattr(args, "out", "tradeoff.png")
    if not isinstance(out, (str, Path)) or not str(out) or Path(out).is_dir():
        raise InvalidParameterError("out", out, "a file name for the plot, e.g. tradeoff.png")
    from fl_examples.core.outdir import check_out_file

    check_out_file(out)  # before reading anything: an unwritable --out is one line
    points = load_runs(run_dirs)
    rows = tradeoff_table(points, epsilon=epsilon)
    path = plot_tradeoff(points, out, epsilon=epsilon)
    if getattr(args, "json", False):
        print(json.dumps(_jsonable(rows), indent=1, allow_nan=False))
    else:
        print(format_table(rows))
        print(f"\n{len(points)} results from {len({p.source for p in points})} reports; "
              f"plot: {path}", file=sys.stdout)
    return 0
