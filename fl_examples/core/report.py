"""The report every trainer writes: ``report.json`` plus PNG plots beside it, and its text table.

Format (shared by all trainers; later trainers add fields, never rename):

``config``
    everything needed to rerun, the seed included.
``algorithms``
    ``{name: {"history": [evaluation, ...], "final": evaluation, ...}}`` where an
    evaluation has ``iteration``, ``train_loss``, ``train_accuracy``,
    ``test_accuracy``, ``wall_time_s`` and ``client_compute_s``; simulators add
    ``simulated_time_s`` and compressing trainers ``cumulative_bits`` (each gets its
    own plot); private runs add
    ``privacy`` (``delta``, ``epsilon_mean``, ``epsilon_max``, ``method``,
    ``proven``, ``per_client``). Keys starting with ``_`` (the final model, say) stay out.
further sections
    after ``algorithms``, e.g. MAPA's ``comparison``.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privkit.ledger import atomic_write_bytes

__all__ = ["EVALUATION_KEYS", "write_report", "plot_histories", "progress", "quiet",
           "is_quiet", "Column", "text_table"]

_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("quiet", default=False)
_FALSE = ("", "0", "false", "no", "off")

EVALUATION_KEYS = ("iteration", "train_loss", "train_accuracy", "test_accuracy", "wall_time_s",
                   "client_compute_s")


X_AXES = (
    ("iteration", "iteration", "curves_vs_iteration.png", False),
    ("data_rounds", "data rounds (client computation)", "curves_vs_data_rounds.png", False),
    ("wall_time_s", "wall time (s)", "curves_vs_wall_time.png", False),
    ("simulated_time_s", "simulated time (s)", "curves_vs_simulated_time.png", False),
    ("cumulative_bits", "bits communicated, up + down (cumulative)", "curves_vs_bits.png", True),
)


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return _clean(obj.item())
    return obj


def write_report(out_dir: str | Path, config: Mapping[str, Any],
                 algorithms: Mapping[str, Mapping[str, Any]], *, plots: bool = True,
                 sections: Mapping[str, Any] | None = None, note: str | None = None) -> Path:
    """Write ``report.json`` (atomically) and the plots; returns the report path.

    ``algorithms`` maps each algorithm to its entry (keys starting with ``_`` are left out);
    ``sections`` are further top-level sections, after ``algorithms``; ``note`` (e.g. what a
    privacy number covers) is written under every plot.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    body: dict[str, Any] = {"config": _clean(dict(config)), "algorithms": {}}
    for name, run in algorithms.items():
        history = [_clean(dict(h)) for h in run.get("history", [])]
        entry = {k: _clean(v) for k, v in run.items()
                 if k != "history" and not k.startswith("_")}
        entry["history"] = history
        entry["final"] = history[-1] if history else None
        body["algorithms"][name] = entry
    body |= {k: _clean(v) for k, v in (sections or {}).items()}
    path = out / "report.json"
    atomic_write_bytes(path, json.dumps(body, indent=1, allow_nan=False).encode("utf-8"))
    if plots:
        plot_histories(out, {n: r.get("history", []) for n, r in algorithms.items()}, note=note,
                       labels={n: legend_label(n, r) for n, r in algorithms.items()})
    return path


def legend_label(name: str, entry: Mapping[str, Any]) -> str:
    """``name``, with the epsilon of a private run: every private figure says how private."""
    p = entry.get("privacy") or {}
    eps = p.get("epsilon_max", p.get("epsilon_central"))
    if isinstance(eps, (int, float)) and p.get("non_private") is not True:
        return f"{name} (ε ≤ {eps:.3g}, δ = {p.get('delta', 0):.0e})"
    return name


#: The panels a history can have, in the order drawn: (key, title). A panel is drawn when
#: every history has its key (and not only NaN values); a private run's rows hold the held-out
#: metrics only (fl_examples.core.release).
PANELS = (("train_loss", "train loss"), ("heldout_loss", "held-out loss"),
          ("train_accuracy", "train accuracy"), ("test_accuracy", "test accuracy"),
          ("heldout_accuracy", "held-out accuracy"))


def _panels(histories: Mapping[str, list[Mapping[str, Any]]]) -> list[tuple[str, str]]:
    present = [h for h in histories.values() if h]
    out = []
    for key, title in PANELS:
        if not present or not all(key in h[0] for h in present):
            continue
        values = [r.get(key) for h in present for r in h]
        if any(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            out.append((key, title))
    if any(k == "train_loss" for k, _ in out):  # a non-private run: the held-out loss is
        out = [p for p in out if p[0] != "heldout_loss"]  # the fourth panel's companion
    return out


def plot_histories(
    out_dir: str | Path, histories: Mapping[str, list[Mapping[str, Any]]], *,
    note: str | None = None, labels: Mapping[str, str] | None = None,
) -> list[Path]:
    """Loss and accuracy against each x axis the histories have, one line per algorithm
    (labelled by ``labels``, e.g. with its epsilon; :data:`PANELS` says which metrics).

    Always iteration and wall time; also data rounds (``data_rounds``: the iterations that
    trained on client data, so client computation; Upcycled-FL's even iterations are free),
    simulated time (``simulated_time_s``, the
    asynchronous and straggler simulators) and bits communicated (``cumulative_bits``,
    log axis) when every history has that key.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for x_key, x_label, fname, log_x in X_AXES:
        present = [h for h in histories.values() if h]
        if not present or not all(x_key in h[0] for h in present):
            continue
        panels = _panels(histories)
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6),
                                 squeeze=False)
        axes = axes[0]
        for name, hist in histories.items():
            if not hist:
                continue
            xs = [h[x_key] for h in hist]
            label = (labels or {}).get(name, name)
            for ax, (key, _) in zip(axes, panels):
                ax.plot(xs, [h[key] if h.get(key) is not None else float("nan") for h in hist],
                        label=label)
        for ax, (_, title) in zip(axes, panels):
            ax.set_xlabel(x_label)
            if log_x:
                ax.set_xscale("log")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.tight_layout()
        if note:
            fig.subplots_adjust(bottom=0.24)
            fig.text(0.01, 0.01, note, fontsize=8, ha="left", va="bottom", wrap=True)
        path = Path(out_dir) / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


@contextlib.contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """Within it (``on``), :func:`progress` bars are off and :func:`is_quiet` is true
    (``--quiet``)."""
    token = _QUIET.set(bool(on) or _QUIET.get())
    try:
        yield
    finally:
        _QUIET.reset(token)


def is_quiet() -> bool:
    """Whether non-essential output is off (inside :func:`quiet`)."""
    return _QUIET.get()


def progress_disabled() -> bool | None:
    """tqdm's ``disable``: True under :func:`quiet` or ``TQDM_DISABLE`` set (other than 0 /
    false / no / off), else None (a bar on a terminal only)."""
    env = os.environ.get("TQDM_DISABLE")
    if _QUIET.get() or (env is not None and env.strip().lower() not in _FALSE):
        return True
    return None


def progress(total: int, desc: str) -> Any:
    """A progress bar on a terminal, silent otherwise (CI logs stay readable), under
    :func:`quiet` and with ``TQDM_DISABLE=1`` in the environment (an explicit ``disable``
    would otherwise override tqdm's own reading of it)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=progress_disabled(),
                dynamic_ncols=True)


@dataclass(frozen=True)
class Column:
    """One column of :func:`text_table`: title, width and the format of its values."""

    title: str
    width: int
    fmt: str = ""


def text_table(columns: Sequence[Column], rows: Iterable[Sequence[Any]]) -> list[str]:
    """The lines of a plain text table: a header, then one line per row.

    The first column is left-aligned (the algorithm's name), the others right-aligned, each
    value formatted with its column's ``fmt``; columns are separated by one space.

    Example:
        >>> text_table([Column("algorithm", 9), Column("loss", 6, ".3f")], [("mapa", 0.5)])
        ['algorithm   loss', 'mapa       0.500']
    """
    first, *rest = columns
    lines = [" ".join([f"{first.title:<{first.width}}", *(f"{c.title:>{c.width}}"
                                                            for c in rest)])]
    for row in rows:
        name, *values = row
        lines.append(" ".join([format(name, f"<{first.width}"),
                               *(format(v, f">{c.width}{c.fmt}") for c, v in zip(rest, values))]))
    return lines
