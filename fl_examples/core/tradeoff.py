"""Privacy-utility trade-off across runs: ``privkit report tradeoff RUN_DIRS...``.

Reads the ``report.json`` of many runs (see :mod:`fl_examples.core.report`), typically a
sweep over noise levels with several seeds each, and draws epsilon against final test
accuracy and train loss, like Fig. 3 of the Upcycled-FL paper.

Grouping
    One :class:`RunPoint` per (run, algorithm). A *curve* is (algorithm, privacy kind,
    dataset); a *point* on it is one *setting*: the run's config without the keys in
    :data:`IGNORED_CONFIG_KEYS` (the seed, the device, evaluation/checkpoint cadence, ...).
    Runs that differ only in those keys -- in particular only in the seed -- are aggregated:
    mean over seeds, min-max range as error bars. So a sweep over ``noise`` x ``seed`` gives one
    curve per algorithm with one point per noise level, whatever the config key is called.
    The keys that vary along a curve are shown as the point's label (e.g. ``noise=1.5``).

Non-private algorithms
    An algorithm entry without ``privacy`` (e.g. a non-private baseline) is kept, with privacy
    kind ``"none"`` and epsilon = +inf; the plot draws it as a dashed horizontal reference
    line (mean over seeds, shaded min-max band). Private points whose epsilon is not finite
    (an accountant that returned inf, or NaN) cannot be placed on the x-axis: they stay in the
    table and are listed under the plot as omitted.

Proven epsilons
    A point is drawn with a filled marker only when every run in it reports ``proven: true``;
    otherwise hollow, with the legend note "epsilon not proven". A missing ``proven`` counts
    as not proven.

MI-DP runs
    A trainer whose privacy is measured in mutual-information DP (SCFL's coded upload) writes
    ``privacy = {"measure": "mi_dp_nats", "mi_dp_nats_mean", "mi_dp_nats_max", ...}`` instead
    of epsilons. Such points carry ``measure = "mi_dp_nats"``; their table rows hold the value
    under ``mi_dp_nats`` (never ``epsilon``) and the plot's x axis reads "MI-DP (nats)". MI-DP
    and epsilon cannot share an axis: mixing them in one report is refused. A sweep over the
    coding noise gives the shape of SCFL's Fig. 2 (MI-DP against test accuracy).

Numbers are never silently repaired: a NaN accuracy makes the mean NaN.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

_EPSILON_CHOICES = ("mean", "max")
#: Privacy measures a report can carry: (epsilon, delta)-DP or MI-DP in nats.
MEASURES = ("epsilon", "mi_dp_nats")


@dataclass(frozen=True)
class RunPoint:
    """The final result of one algorithm in one run."""

    algorithm: str
    seed: int | None
    dataset: str
    privacy: str  # "output" | "objective" | ... ; "none" for an algorithm without privacy
    epsilon_mean: float  # +inf when not private
    epsilon_max: float
    proven: bool
    test_accuracy: float
    train_loss: float
    source: Path  # the report.json read
    delta: float | None = None
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    measure: str = "epsilon"  # "mi_dp_nats": epsilon_* are NaN, the value is in mi_dp_nats_*
    mi_dp_nats_mean: float = math.nan
    mi_dp_nats_max: float = math.nan

    @property
    def private(self) -> bool:
        return self.privacy != "none"

    def epsilon(self, which: str = "mean") -> float:
        _check_epsilon(which)
        return self.epsilon_mean if which == "mean" else self.epsilon_max

    def value(self, which: str = "mean") -> float:
        """The privacy number in this point's ``measure`` (epsilon or MI-DP nats)."""
        _check_epsilon(which)
        if self.measure == "mi_dp_nats":
            return self.mi_dp_nats_mean if which == "mean" else self.mi_dp_nats_max
        return self.epsilon(which)


# ---------------------------------------------------------------------------------- loading


def _check_epsilon(which: Any) -> str:
    if which not in _EPSILON_CHOICES:
        raise InvalidParameterError("epsilon", which, "'mean' or 'max'")
    return which


def _number(value: Any, where: str) -> float:
    """A report number: finite JSON number, null (NaN) or the strings 'inf'/'-inf'/'nan'."""
    if value is None:
        return math.nan
    if isinstance(value, bool):
        raise InvalidParameterError(where, value, "a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "-inf", "nan"):
        return float(value)
    raise InvalidParameterError(where, value, "a number (or null, 'inf', '-inf')")


def _report_files(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            if (p / "report.json").is_file():
                files.append(p / "report.json")
                continue
            found = sorted(p.rglob("report.json"))  # a sweep directory of run directories
            if not found:
                raise InvalidParameterError(
                    "run directory", str(p), "a run directory containing report.json "
                    "(or a directory with run directories below it)")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise InvalidParameterError("run directory", str(p),
                                        "an existing run directory or report.json file")
    unique: dict[Path, Path] = {}
    for f in files:
        unique.setdefault(f.resolve(), f)
    return list(unique.values())


def _load_file(path: Path) -> list[RunPoint]:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(str(path), type(exc).__name__, "a readable file") from exc
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(str(path), f"{exc.msg} at line {exc.lineno}",
                                    "valid JSON (a report.json)") from exc

    def key(name: str) -> str:
        return f"{path}: {name}"

    if not isinstance(body, dict):
        raise InvalidParameterError(key("<top level>"), type(body).__name__, "a JSON object")
    config = body.get("config")
    if not isinstance(config, dict):
        raise InvalidParameterError(key("config"), config, "a JSON object")
    algorithms = body.get("algorithms")
    if not isinstance(algorithms, dict) or not algorithms:
        raise InvalidParameterError(key("algorithms"), algorithms,
                                    "a non-empty JSON object of algorithm entries")
    seed = config.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidParameterError(key("config.seed"), seed, "an integer")
    dataset = config.get("dataset", "")
    if not isinstance(dataset, str):
        raise InvalidParameterError(key("config.dataset"), dataset, "a string")
    kind = config.get("privacy", "none")
    if kind is None:
        kind = "none"
    if not isinstance(kind, str):
        raise InvalidParameterError(key("config.privacy"), kind, "a string")

    points = []
    for name, entry in algorithms.items():
        where = f"algorithms.{name}"
        if not isinstance(entry, dict):
            raise InvalidParameterError(key(where), entry, "a JSON object")
        final = entry.get("final")
        if not isinstance(final, dict):
            raise InvalidParameterError(key(f"{where}.final"), final,
                                        "an evaluation object (was the run empty?)")
        # the held-out metrics (public data: what a private run publishes), else the
        # clients' test accuracy and training loss (older reports, non-private runs)
        acc_key = "heldout_accuracy" if "heldout_accuracy" in final else "test_accuracy"
        loss_key = "heldout_loss" if "heldout_loss" in final else "train_loss"
        if loss_key not in final:
            raise InvalidParameterError(key(f"{where}.final.{loss_key}"), None, "present")
        # a regression task (SCFL on linreg) has no accuracy
        test_acc = _number(final[acc_key], key(f"{where}.final.{acc_key}")) \
            if acc_key in final else math.nan
        loss = _number(final[loss_key], key(f"{where}.final.{loss_key}"))
        priv = entry.get("privacy")
        measure, mi_mean, mi_max = "epsilon", math.nan, math.nan
        if priv is None:
            run_kind, eps_mean, eps_max, proven, delta = "none", math.inf, math.inf, True, None
        else:
            if not isinstance(priv, dict):
                raise InvalidParameterError(key(f"{where}.privacy"), priv, "a JSON object")
            measure = priv.get("measure", "epsilon")
            if measure not in MEASURES:
                raise InvalidParameterError(key(f"{where}.privacy.measure"), measure,
                                            "'epsilon' or 'mi_dp_nats'")
            names = (("epsilon_mean", "epsilon_max") if measure == "epsilon"
                     else ("mi_dp_nats_mean", "mi_dp_nats_max"))
            for k in names:
                if k not in priv:
                    raise InvalidParameterError(key(f"{where}.privacy.{k}"), None, "present")
            lo_hi = [_number(priv[k], key(f"{where}.privacy.{k}")) for k in names]
            if measure == "epsilon":
                eps_mean, eps_max = lo_hi
            else:
                eps_mean = eps_max = math.nan  # an MI-DP run has no epsilon
                mi_mean, mi_max = lo_hi
            proven = priv.get("proven", False)
            if not isinstance(proven, bool):
                raise InvalidParameterError(key(f"{where}.privacy.proven"), proven,
                                            "true or false")
            delta = priv.get("delta")
            if delta is not None:
                delta = _number(delta, key(f"{where}.privacy.delta"))
            run_kind = kind if kind != "none" else "private"
        points.append(RunPoint(
            algorithm=str(name), seed=seed, dataset=dataset, privacy=run_kind,
            epsilon_mean=eps_mean, epsilon_max=eps_max, proven=proven,
            test_accuracy=test_acc, train_loss=loss, source=path, delta=delta,
            config=dict(config), measure=measure, mi_dp_nats_mean=mi_mean,
            mi_dp_nats_max=mi_max))
    return points


def load_runs(paths: Iterable[str | Path]) -> list[RunPoint]:
    """One :class:`RunPoint` per (run, algorithm).

    Each path is a run directory holding ``report.json``, a ``report.json`` file, or a
    directory with run directories somewhere below it (all their reports are read). A file
    given twice is read once. A missing or malformed file raises
    :class:`~privkit.errors.InvalidParameterError` naming the path and the offending key.
    """
    files = _report_files(paths)
    if not files:
        raise InvalidParameterError("RUN_DIRS", [], "at least one run directory")
    points: list[RunPoint] = []
    for f in files:
        points.extend(_load_file(f))
    return points


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
    ``epsilon_stat``, then ``epsilon``, ``test_accuracy``, ``train_loss`` (means over runs)
    each with ``_lo``/``_hi`` (min/max over runs), ``proven`` (all runs proven), ``delta``
    (the common delta, or None / a list when they differ) and ``sources``. Rows are sorted by
    curve, then by epsilon.
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
        acc = _stats([r.test_accuracy for r in runs])
        loss = _stats([r.train_loss for r in runs])
        deltas = sorted({r.delta for r in runs if r.delta is not None})
        seeds = sorted(r.seed for r in runs if r.seed is not None)
        rows.append({
            "algorithm": alg, "privacy": kind, "dataset": dataset,
            "setting": setting, "label": ", ".join(f"{k}={_fmt_value(v)}"
                                                   for k, v in setting.items()),
            "n_runs": len(runs), "n_seeds": len(set(seeds)), "seeds": seeds,
            "epsilon_stat": epsilon, "measure": measure,
            measure: eps[0], f"{measure}_lo": eps[1], f"{measure}_hi": eps[2],
            "test_accuracy": acc[0], "test_accuracy_lo": acc[1], "test_accuracy_hi": acc[2],
            "train_loss": loss[0], "train_loss_lo": loss[1], "train_loss_hi": loss[2],
            "proven": all(r.proven for r in runs),
            "delta": (deltas[0] if len(deltas) == 1 else (deltas or None)),
            "sources": sorted(str(r.source) for r in runs),
        })

    def order(row: dict[str, Any]) -> tuple[Any, ...]:
        e = row[row["measure"]]
        return (row["algorithm"], row["privacy"], row["dataset"],
                math.isnan(e), e if not math.isnan(e) else 0.0, row["label"])

    rows.sort(key=order)
    return rows


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A readable text table of :func:`tradeoff_table` rows."""
    def rng(row: Mapping[str, Any], k: str, fmt: str) -> str:
        mean, lo, hi = row[k], row[f"{k}_lo"], row[f"{k}_hi"]
        if math.isinf(mean) or math.isnan(mean) or lo == hi:
            return format(mean, fmt)
        return f"{mean:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"

    stat = rows[0]["epsilon_stat"] if rows else "mean"
    measures = {r.get("measure", "epsilon") for r in rows if r["privacy"] != "none"}
    name = "MI-DP nats" if measures == {"mi_dp_nats"} else "epsilon"
    if len(measures) > 1:
        name = "epsilon | MI-DP nats"
    header = ["algorithm", "privacy", "setting", "seeds", f"{name} ({stat})", "proven",
              "test acc", "train loss"]
    body = []
    for r in rows:
        body.append([
            r["algorithm"], r["privacy"] + (f" [{r['dataset']}]" if r["dataset"] else ""),
            r["label"] or "-", str(r["n_runs"]), rng(r, r.get("measure", "epsilon"), ".3f"),
            ("-" if r["privacy"] == "none" else ("yes" if r["proven"] else "NO")),
            rng(r, "test_accuracy", ".4f"), rng(r, "train_loss", ".4f"),
        ])
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("values: mean over seeds [min, max]; epsilon inf = not private"
                 + ("; MI-DP (Cuff-Yu, nats) is not an epsilon" if "mi_dp_nats" in measures
                    else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- plotting


def plot_tradeoff(points: Sequence[RunPoint], out_png: str | Path, *,
                  epsilon: str = "mean") -> Path:
    """Write the privacy-utility plot to ``out_png`` (atomically) and return its path.

    Left: test accuracy, right: train loss, against epsilon (``epsilon_mean`` or
    ``epsilon_max`` over clients, mean over seeds). Bars are min-max over seeds in both
    directions; one curve per (algorithm, privacy kind, dataset), sorted by epsilon; hollow
    markers where epsilon is not proven; non-private algorithms as dashed horizontal lines.
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
    measures = {r["measure"] for r in rows if r["privacy"] != "none"}
    if len(measures) > 1:
        raise InvalidParameterError(
            "RUN_DIRS", sorted({str(p.source) for p in points}),
            "runs of one privacy measure: epsilon and MI-DP (nats) cannot share an axis")
    measure = measures.pop() if measures else "epsilon"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
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
        # an axis whose values are all NaN (e.g. accuracy of a regression) gets no log scale
        with_data = {"test_accuracy": False, "train_loss": False}
        any_unproven = False
        finite_eps: list[float] = []
        for i, ((alg, kind, dataset), crows) in enumerate(curves.items()):
            color = colors[i % len(colors)]
            name = alg + (f" ({kind})" if kind != "none" else " (non-private)")
            if several_datasets:
                name += f" [{dataset}]"
            if kind == "none":
                for ax, k in zip(axes, ("test_accuracy", "train_loss")):
                    for j, r in enumerate(crows):
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
            for ax, k in zip(axes, ("test_accuracy", "train_loss")):
                ys = [r[k] for r in placed]
                with_data[k] |= any(math.isfinite(y) for y in ys)
                yerr = [[y - r[f"{k}_lo"] for y, r in zip(ys, placed)],
                        [r[f"{k}_hi"] - y for y, r in zip(ys, placed)]]
                ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="-", color=color, capsize=3,
                            lw=1.5, elinewidth=1, label=name)
                for x, y, r in zip(xs, ys, placed):
                    ax.plot([x], [y], "o", ms=6, color=color,
                            mfc=color if r["proven"] else "white", mec=color, mew=1.5)
                    if len(placed) > 1 and r["label"] and k == "test_accuracy":
                        ax.annotate(r["label"], (x, y), textcoords="offset points",
                                    xytext=(4, 4), fontsize=7, color=color)
            any_unproven |= not all(r["proven"] for r in placed)

        positive = [e for e in finite_eps if e > 0]
        log_x = bool(positive) and len(positive) == len(finite_eps) \
            and max(positive) / min(positive) > 30
        deltas = {r["delta"] for r in rows if r["privacy"] != "none"
                  and isinstance(r["delta"], float)} if measure == "epsilon" else set()
        delta_txt = f", delta = {deltas.pop():g}" if len(deltas) == 1 else ""
        for ax, title in zip(axes, ("test accuracy", "train loss")):
            ax.set_xlabel(f"epsilon ({epsilon} over clients{delta_txt})" if measure == "epsilon"
                          else f"MI-DP, nats ({epsilon} over clients; coded upload only, "
                          "not an epsilon)")
            ax.set_ylabel(title)
            ax.set_title(f"{title} vs privacy")
            ax.grid(alpha=0.3)
            if log_x and with_data["test_accuracy" if title == "test accuracy" else "train_loss"]:
                ax.set_xscale("log")
        handles, labels = axes[0].get_legend_handles_labels()
        if any_unproven:
            handles.append(Line2D([], [], ls="none", marker="o", mfc="white", mec="gray",
                                  mew=1.5))
            labels.append("hollow marker: epsilon not proven")
        if handles:
            axes[0].legend(handles, labels, fontsize=8)
        fig.suptitle("privacy-utility trade-off (mean over seeds; bars: min-max over seeds)",
                     fontsize=10)
        if omitted:
            what = "epsilon" if measure == "epsilon" else "MI-DP"
            fig.text(0.01, 0.01, f"not plotted ({what} not finite): " + "; ".join(omitted),
                     fontsize=7, color="gray")
        fig.tight_layout(rect=(0, 0.04 if omitted else 0, 1, 1))
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, dpi=110)
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
        "tradeoff", help="privacy-utility plot: epsilon vs test accuracy / train loss",
        description="Aggregate runs over seeds (runs whose configs differ only in the seed, "
                    "device, ... form one point) and plot epsilon against final test accuracy "
                    "and train loss, one curve per algorithm. Non-private runs are drawn as "
                    "horizontal reference lines; unproven epsilons as hollow markers.")
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
