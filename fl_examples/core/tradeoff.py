"""Privacy-utility trade-off across runs: ``privkit report tradeoff RUN_DIRS...``.

Reads the ``report.json`` of many runs (see :mod:`fl_examples.core.report`) of any bundled
trainer, typically a sweep over noise levels with several seeds each, and draws epsilon
against the final accuracy and loss, like Fig. 3 of the Upcycled-FL paper.

Which epsilon
    A run's epsilon differs between its clients; what the run can claim for every client is
    the worst-off client's, ``epsilon_max``. That is each point's number by default, on the
    x axis and in every table (``--epsilon-statistic max``); ``--epsilon-statistic mean``
    (``epsilon="mean"``) takes the mean over clients instead, which understates what some
    clients spent (a record-level run calibrated to max 8 has mean 3.15). The axis label,
    the legend's title, the figure's title and the table's column say which.

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
    The keys that vary along a curve are shown as the point's label (e.g. ``noise=1.5``; a
    key whose value is None there is left out of the label).

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
    and epsilon cannot share an axis: runs that carry both (SCFL with gradient noise: the
    client gradients' epsilon, DP-CFL's coded upload) are drawn side by side, an epsilon
    column of panels and an MI-DP column, each with the non-private references. A sweep over
    the coding noise gives the shape of SCFL's Fig. 2 (MI-DP against accuracy).

Numbers are never silently repaired: a NaN accuracy makes the mean NaN.

The pieces: :mod:`~fl_examples.core.tradeoff_runs` reads the reports,
:mod:`~fl_examples.core.tradeoff_rows` aggregates them into the table,
:mod:`~fl_examples.core.tradeoff_plot` draws it; this module is the command (and re-exports
their public names).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from fl_examples.core.tradeoff_plot import plot_tradeoff
from fl_examples.core.tradeoff_rows import (
    IGNORED_CONFIG_KEYS,
    STATISTIC_NAMES,
    format_table,
    tradeoff_table,
)
from fl_examples.core.tradeoff_runs import EPSILON_STATISTICS, RunPoint, _check_epsilon, load_runs
from privkit.errors import InvalidParameterError

__all__ = [
    "IGNORED_CONFIG_KEYS",
    "STATISTIC_NAMES",
    "RunPoint",
    "load_runs",
    "tradeoff_table",
    "format_table",
    "plot_tradeoff",
    "add_report_parser",
    "run_report",
]

# ------------------------------------------------------------------------------------- CLI


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def add_report_parser(sub: Any, parser_class: Any) -> None:
    """Register ``report tradeoff RUN_DIRS... [--out PNG] [--epsilon-statistic max|mean]
    [--json]`` (``--epsilon`` is the older spelling of ``--epsilon-statistic``)."""
    from fl_examples.commands import noted  # the trainers' one-line note for old spellings

    report = sub.add_parser("report", help="summaries across finished runs")
    rsub = report.add_subparsers(dest="report", required=True, parser_class=parser_class)
    t = rsub.add_parser(
        "tradeoff", help="privacy-utility plot: epsilon vs held-out accuracy / loss",
        description="Aggregate runs of any bundled trainer over seeds (runs whose configs "
                    "differ only in the seed, device, ... form one point) and plot epsilon (the "
                    "worst-off client's by default) against the final held-out accuracy and "
                    "loss (the clients' test accuracy and training loss for reports without "
                    "held-out metrics), one curve per "
                    "algorithm. Non-private algorithms are drawn as horizontal reference "
                    "lines; unproven epsilons (seeded simulations included) as hollow "
                    "markers.")
    t.add_argument("run_dirs", nargs="+", metavar="RUN_DIRS",
                   help="run directories (with report.json), report.json files, or "
                        "directories of run directories")
    t.add_argument("--out", default="tradeoff.png", help="plot file (default tradeoff.png)")
    t.add_argument("--epsilon-statistic", "--epsilon", default="max",
                   choices=list(EPSILON_STATISTICS), action=noted("--epsilon-statistic"),
                   help="each run's epsilon (MI-DP) over its clients: max, the worst-off "
                        "client's, what the run claims for every client (default), or mean "
                        "(understates what some clients spent); the axis, legend, title and "
                        "table say which")
    t.add_argument("--json", action="store_true", help="print the table as JSON")


def run_report(args: argparse.Namespace) -> int:
    """Run ``report tradeoff``: load, print the table (text or JSON), write the plot."""
    which = getattr(args, "report", "tradeoff")
    if which != "tradeoff":
        raise InvalidParameterError("report", which, "'tradeoff'")
    epsilon = _check_epsilon(getattr(args, "epsilon_statistic", "max"), "epsilon_statistic")
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
