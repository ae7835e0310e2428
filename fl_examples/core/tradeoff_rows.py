"""The table of ``privkit report tradeoff``: runs aggregated over seeds, one row per point.

:func:`tradeoff_table` groups :class:`~fl_examples.core.tradeoff_runs.RunPoint` s into curves
and points (module doc of :mod:`fl_examples.core.tradeoff`); :func:`format_table` writes the
rows as text, its columns named by what they hold (which metric, which statistic over a run's
clients: the worst-off client's by default).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fl_examples.core.tradeoff_runs import GUARANTEES, RunPoint, _check_epsilon

__all__ = ["IGNORED_CONFIG_KEYS", "STATISTIC_NAMES", "METRIC_NAMES", "tradeoff_table",
           "format_table"]

#: Config keys that do not change the result distribution; runs differing only in these
#: (the seed above all) are aggregated into one point. ``compare`` only adds baselines to
#: a run; ``dataset_description`` can mention the seed.
IGNORED_CONFIG_KEYS = frozenset({
    "seed", "device", "eval_every", "checkpoint_every", "resume", "out", "compare",
    "dataset_description",
})

#: How the plot and the tables name each statistic over a run's clients.
STATISTIC_NAMES = {"max": "max over clients (the worst-off client's)",
                   "mean": "mean over clients (not the worst-off client's)"}

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


def tradeoff_table(points: Sequence[RunPoint], *, epsilon: str = "max",
                   ignore: Iterable[str] = IGNORED_CONFIG_KEYS) -> list[dict[str, Any]]:
    """Aggregate runs over seeds: one row per (algorithm, privacy kind, dataset, setting).

    ``epsilon`` picks each run's ``epsilon_max`` (over clients: the worst-off client's, the
    default) or ``epsilon_mean``. Each row
    also has ``measure``: for MI-DP points (``"mi_dp_nats"``) the keys ``epsilon*`` below are
    named ``mi_dp_nats*`` instead. Each row
    has ``algorithm``, ``privacy``, ``dataset``, ``setting`` (the config keys that vary along
    the curve, as a dict) and ``label`` (the same as text, None-valued keys left out),
    ``n_runs``, ``n_seeds``, ``seeds``,
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
                                                   for k, v in setting.items()
                                                   if v is not None),
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

    stat = rows[0]["epsilon_stat"] if rows else "max"
    measures = {r.get("measure", "epsilon") for r in rows if r["privacy"] != "none"}
    name = "MI-DP nats" if measures == {"mi_dp_nats"} else "epsilon"
    if len(measures) > 1:
        name = "epsilon | MI-DP nats"
    mixed = {k: len({r[f"{k}_metric"] for r in rows}) > 1 for k in ("accuracy", "loss")}
    header = ["algorithm", "privacy", "setting", "seeds", f"{name} ({stat} over clients)",
              "guarantee",
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
    lines.append(f"{name}: each run's {STATISTIC_NAMES[stat]}"
                 + ("; --epsilon-statistic mean for the mean" if stat == "max" else
                    "; the default --epsilon-statistic max gives the worst-off client's"))
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
