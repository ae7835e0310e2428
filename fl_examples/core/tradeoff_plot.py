"""The plot of ``privkit report tradeoff``: privacy against the final metrics, per curve.

:func:`plot_tradeoff` draws the rows of :func:`fl_examples.core.tradeoff_rows.tradeoff_table`.
One column of panels per privacy measure: epsilon and MI-DP (nats) cannot share an axis,
so runs that carry both (SCFL: the client gradients' epsilon, the coded upload's MI-DP) get
an epsilon column and an MI-DP column side by side, each with the non-private references.
One row of panels per metric (accuracy, loss) with a finite value. The legend sits outside
the data, to the right of the panels, titled with the statistic the x axis shows.
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fl_examples.core.report import tidy_axis
from fl_examples.core.tradeoff_rows import STATISTIC_NAMES, _metric_title, tradeoff_table
from fl_examples.core.tradeoff_runs import MEASURES, RunPoint, _check_epsilon
from privkit.errors import InvalidParameterError

__all__ = ["plot_tradeoff"]

#: Inches of a figure's width kept for the legend, right of the panels.
_LEGEND_W = 3.2

#: Metadata a saved figure can carry, by format (matplotlib's keys per backend).
_METADATA_KEYS = {"png": ("Title", "Description"), "pdf": ("Title", "Subject"),
                  "svg": ("Title", "Description")}


def x_label(measure: str, statistic: str, delta: str = "") -> str:
    """The x axis of a ``measure`` column, naming the statistic over clients it shows."""
    if measure == "epsilon":
        return (f"ε of the worst-off client (max over clients{delta})" if statistic == "max"
                else f"ε, mean over clients (not the worst-off client's{delta})")
    return (f"MI-DP, nats, {STATISTIC_NAMES[statistic]} (coded upload only, not an ε)")


def _measures(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The privacy measures of the private rows, epsilon first (``["epsilon"]`` if none)."""
    found = {r["measure"] for r in rows if r["privacy"] != "none"}
    return [m for m in MEASURES if m in found] or ["epsilon"]


def plot_tradeoff(points: Sequence[RunPoint], out_png: str | Path, *,
                  epsilon: str = "max") -> Path:
    """Write the privacy-utility plot to ``out_png`` (atomically) and return its path.

    Accuracy and loss, each the held-out metric where the reports have it (the axis says
    which), against each run's privacy number over its clients: ``epsilon="max"`` (the
    default) the worst-off client's, ``"mean"`` the mean over clients; mean over seeds. The
    x axis, the legend's title and the figure's title say which. Bars are min-max over seeds
    in both directions; one curve per (algorithm, privacy kind, dataset), sorted by the
    privacy number, each point labelled with its setting (None-valued settings left out);
    hollow markers where epsilon is not proven (a seeded simulation, or unproven settings);
    non-private algorithms as dashed horizontal lines in every panel. Epsilon and MI-DP
    (nats) get a column of panels each, side by side. A metric with no finite value (the
    accuracy of a regression) has no panel. The title and the PNG's ``Title`` /
    ``Description`` text say what is plotted.
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
    measures = _measures(rows)
    metrics = [k for k in ("accuracy", "loss")
               if any(math.isfinite(r[k]) for r in rows)] or ["loss"]
    both = len(measures) > 1
    nrows, ncols = (len(metrics), len(measures)) if both else (1, len(metrics))
    fig, grid = plt.subplots(nrows, ncols, figsize=(5.4 * ncols + _LEGEND_W, 4.4 * nrows + 0.6),
                             squeeze=False, layout="constrained")
    cells = [(grid[i][j], metrics[i], measures[j]) for i in range(nrows)
             for j in range(ncols)] if both else \
        [(grid[0][j], metrics[j], measures[0]) for j in range(ncols)]
    try:
        supported = fig.canvas.get_supported_filetypes()
        if fmt not in supported:
            raise InvalidParameterError("out", str(out_png),
                                        f"a file name ending in .{', .'.join(sorted(supported))}")
        curves: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
        for r in rows:
            curves.setdefault((r["algorithm"], r["privacy"], r["dataset"], r["measure"]),
                              []).append(r)
        several_datasets = len({c[2] for c in curves}) > 1
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        omitted: list[str] = []
        with_data = {(k, m): False for _, k, m in cells}
        marks: set[str] = set()
        finite_x: dict[str, list[float]] = {m: [] for m in measures}
        legend: dict[str, Any] = {}
        for i, ((alg, kind, dataset, measure), crows) in enumerate(curves.items()):
            color = colors[i % len(colors)]
            name = alg + (f" ({kind})" if kind != "none" else " (non-private)")
            if several_datasets:
                name += f" [{dataset}]"
            if kind == "none":
                for ax, k, _ in cells:
                    for j, r in enumerate(crows):
                        if not math.isfinite(r[k]):
                            continue
                        label = name + (f" {r['label']}" if len(crows) > 1 and r["label"]
                                        else "")
                        line = ax.axhline(r[k], color=color, ls=("--", ":", "-.")[j % 3],
                                          lw=1.3)
                        legend.setdefault(label, line)
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
            finite_x[measure] += ([r[f"{measure}_lo"] for r in placed]
                                  + [r[f"{measure}_hi"] for r in placed])
            xerr = _bars(xs, placed, measure)
            first = next(c for c in cells if c[2] == measure)
            for ax, k, m in cells:
                if m != measure:
                    continue
                ys = [r[k] for r in placed]
                with_data[(k, m)] |= any(math.isfinite(y) for y in ys)
                yerr = _bars(ys, placed, k)
                line = ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="-", color=color,
                                   capsize=3, lw=1.5, elinewidth=1)
                legend.setdefault(name, line)
                labelled: set[tuple[float, float]] = set()
                for x, y, r in zip(xs, ys, placed):
                    ax.plot([x], [y], "o", ms=6, color=color,
                            mfc=color if r["guarantee"] == "proven" else "white", mec=color,
                            mew=1.5)
                    if len(placed) > 1 and r["label"] and ax is first[0] \
                            and (x, y) not in labelled:  # one label where points coincide
                        labelled.add((x, y))
                        last = x == max(xs) and x > min(xs)  # the rightmost reads leftwards
                        ax.annotate(textwrap.fill(r["label"], 32), (x, y),
                                    textcoords="offset points", xytext=(-4 if last else 4, 4),
                                    fontsize=7, color=color, ha="right" if last else "left")
            marks |= {r["guarantee"] for r in placed}

        deltas = {r["delta"] for r in rows if r["privacy"] != "none"
                  and r["measure"] == "epsilon" and isinstance(r["delta"], float)}
        delta_txt = f", δ = {deltas.pop():g}" if len(deltas) == 1 else ""
        for ax, k, m in cells:
            positive = [e for e in finite_x[m] if e > 0]
            log_x = bool(positive) and len(positive) == len(finite_x[m]) \
                and max(positive) / min(positive) > 30
            ax.set_xlabel(textwrap.fill(x_label(m, epsilon, delta_txt), 60))
            ax.set_ylabel(textwrap.fill(_metric_title(rows, k, short=False), 45) + " (final)")
            ax.grid(alpha=0.3)
            if log_x and with_data[(k, m)]:
                ax.set_xscale("log")
            tidy_axis(ax, [r[k] for r in rows])
            if not (log_x and with_data[(k, m)]):
                tidy_axis(ax, finite_x[m], "x")
        handles, labels = list(legend.values()), list(legend)
        hollow = ("hollow marker: epsilon not proven" if "not proven" in marks else
                  "hollow marker: seeded simulation (not proven)" if "simulation" in marks
                  else None)
        if hollow:
            handles.append(Line2D([], [], ls="none", marker="o", mfc="white", mec="gray",
                                  mew=1.5))
            labels.append(hollow)
        if handles:  # outside the data, to the right of the panels
            fig.legend(handles, [textwrap.fill(t, 34) for t in labels], fontsize=8,
                       loc="outside right upper",
                       title=textwrap.fill(_legend_title(measures, epsilon), 34),
                       title_fontsize=8)
        datasets = sorted({r["dataset"] for r in rows if r["dataset"]})
        title = ("privacy-utility trade-off" + (f" on {', '.join(datasets)}" if datasets
                                                else "")
                 + ": final " + " and ".join(_metric_title(rows, k, short=False).split(":")[0]
                                             for k in metrics)
                 + " against " + _against(measures, epsilon))
        panels_w = fig.get_figwidth() - _LEGEND_W  # centred over the panels, beside the legend
        fig.suptitle(textwrap.fill(title, int(panels_w * 12)) + "\n(mean over seeds; bars: "
                     "min-max over seeds)", fontsize=10, x=panels_w / 2 / fig.get_figwidth())
        foot = []
        if omitted:
            foot.append("not plotted (privacy number not finite): " + "; ".join(omitted))
        foot += [f"note: {n}" for n in sorted({n for r in rows for n in r["notes"]})]
        if foot:
            fig.supxlabel("\n".join(textwrap.fill(f, int(fig.get_figwidth() * 16))
                                    for f in foot), fontsize=7, color="gray", x=0.01,
                          ha="left")
        description = f"privacy number per run: {STATISTIC_NAMES[epsilon]}; " + "; ".join(
            f"{r['algorithm']} ({r['privacy']}{', ' + r['label'] if r['label'] else ''}): "
            + (f"{r['measure']} {r[r['measure']]:.4g}" if r["privacy"] != "none"
               else "non-private")
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


def _bars(values: Sequence[float], rows: Sequence[dict[str, Any]], key: str
          ) -> list[list[float]]:
    """Error bars from each value down to its row's ``key_lo`` and up to ``key_hi``; a mean
    of equal values can round a hair outside them, which is no bar (never a negative one)."""
    return [[max(0.0, v - r[f"{key}_lo"]) for v, r in zip(values, rows)],
            [max(0.0, r[f"{key}_hi"] - v) for v, r in zip(values, rows)]]


def _legend_title(measures: Sequence[str], statistic: str) -> str:
    what = " and ".join("ε" if m == "epsilon" else "MI-DP" for m in measures)
    return f"{what}: {STATISTIC_NAMES[statistic]}"


def _against(measures: Sequence[str], statistic: str) -> str:
    """What the x axes are, for the title."""
    parts = []
    for m in measures:
        if m == "epsilon":
            parts.append("ε of the worst-off client (max over clients)" if statistic == "max"
                         else "ε, mean over clients (not the worst-off client's)")
        else:
            parts.append(f"MI-DP in nats ({STATISTIC_NAMES[statistic]}; coded upload, "
                         "not an ε)")
    return ", beside it ".join(parts)
