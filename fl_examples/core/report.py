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

Every figure says what it shows (:class:`FigureText`): a title with the data set, the seed
and the run's key settings, a privacy line for a private run (its epsilon, or SCFL's MI-DP in
nats, and whether the guarantee is a seeded simulation), the same in the PNG's ``Title`` and
``Description`` text chunks, and each private algorithm's epsilon in its legend entry. No
panel is drawn whose values are all NaN, and an axis whose data are one value gets a range
around it (:func:`tidy_axis`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import textwrap
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privkit.ledger import atomic_write_bytes

__all__ = ["EVALUATION_KEYS", "write_report", "plot_histories", "progress", "quiet",
           "is_quiet", "Column", "text_table", "FigureText", "figure_text", "legend_label",
           "privacy_summary", "epsilon_section", "midp_section", "save_figure", "tidy_axis",
           "finite_number"]

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
                 sections: Mapping[str, Any] | None = None, note: str | None = None,
                 settings: str | None = None) -> Path:
    """Write ``report.json`` (atomically) and the plots; returns the report path.

    ``algorithms`` maps each algorithm to its entry (keys starting with ``_`` are left out);
    ``sections`` are further top-level sections, after ``algorithms``; ``note`` (e.g. what a
    privacy number covers) is written under every plot; ``settings`` (the run's key settings,
    as text) goes in every plot's title after the data set and seed
    (:func:`figure_text`).
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
        plot_histories(out, {n: r.get("history", []) for n, r in algorithms.items()},
                       note=note, labels={n: legend_label(n, r) for n, r in algorithms.items()},
                       text=figure_text(config, algorithms, settings, note=note))
    return path


# ------------------------------------------------------------------ what a figure says


def epsilon_section(entry: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The (epsilon, delta) section of an algorithm's report entry, or None (non-private, or
    an MI-DP measure only): ``gradient_privacy`` where the trainer keeps the epsilon there
    (SCFL's DP-SGD on the client gradients; its ``privacy`` is the coded upload's MI-DP),
    else ``privacy`` when it holds an epsilon and is not marked ``non_private``."""
    for key in ("gradient_privacy", "privacy"):
        p = entry.get(key)
        if not isinstance(p, Mapping) or p.get("non_private") is True:
            continue
        eps = p.get("epsilon_max", p.get("epsilon_central"))
        if isinstance(eps, (int, float)) and not isinstance(eps, bool) \
                and p.get("measure", "epsilon") == "epsilon":
            return p
    return None


def midp_section(entry: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """An entry's MI-DP section (SCFL's coded upload, in nats: never an epsilon), or None."""
    p = entry.get("privacy")
    if isinstance(p, Mapping) and p.get("measure") == "mi_dp_nats":
        return p
    return None


def _epsilon(p: Mapping[str, Any]) -> float:
    return float(p.get("epsilon_max", p.get("epsilon_central")))


def epsilon_scope(p: Mapping[str, Any]) -> str:
    """What an epsilon section's number is: central, the population's, or a max over clients
    (or edges)."""
    if "epsilon_central" in p:
        return "central"
    if p.get("privacy_unit") == "client":
        return "the population's (every client's)"
    if "per_edge" in p:
        return "max over edges"
    return "max over clients"


def legend_label(name: str, entry: Mapping[str, Any]) -> str:
    """``name``, with the epsilon of a private run (every private figure says how private),
    or the MI-DP of SCFL's coded upload (in nats, not an epsilon)."""
    p = epsilon_section(entry)
    if p is not None:
        return f"{name} (ε ≤ {_epsilon(p):.3g}, δ = {p.get('delta', 0):.0e})"
    m = midp_section(entry)
    if m is not None and isinstance(m.get("mi_dp_nats_max"), (int, float)):
        return f"{name} (MI-DP ≤ {m['mi_dp_nats_max']:.3g} nats, not an ε)"
    return name


_GUARANTEE = {"simulation": "seeded simulation", "not proven": "NOT PROVEN"}


def _guarantee(p: Mapping[str, Any]) -> str:
    g = p.get("guarantee")
    if g in ("proven", "simulation", "not proven"):
        return str(g)
    return "proven" if p.get("proven") is True else "not proven"


def privacy_summary(algorithms: Mapping[str, Mapping[str, Any]]) -> str | None:
    """One line on how private a run's algorithms are (None: none is private), e.g.
    ``ε ≤ 4.85 (upcycled), 6.68 (fedavg): max over clients, δ = 1e-05; seeded simulation``."""
    eps = {n: p for n, r in algorithms.items() if (p := epsilon_section(r)) is not None}
    mi = {n: p for n, r in algorithms.items() if (p := midp_section(r)) is not None}
    parts = []
    if eps:
        scopes = {epsilon_scope(p) for p in eps.values()}
        deltas = {p.get("delta") for p in eps.values()}
        gradients = any("gradient_privacy" in algorithms[n] for n in eps)
        text = "ε ≤ " + ", ".join(f"{_epsilon(p):.3g} ({n})" for n, p in eps.items())
        what = [("client gradients, " if gradients else "") + (
            scopes.pop() if len(scopes) == 1 else "per algorithm")]
        if len(deltas) == 1 and isinstance(d := next(iter(deltas)), (int, float)):
            what.append(f"δ = {d:g}")
        parts.append(f"{text}: {', '.join(what)}")
    if mi:
        parts.append(("coded upload: " if eps else "") + "MI-DP ≤ " + ", ".join(
            f"{p['mi_dp_nats_max']:.3g} nats ({n})" for n, p in mi.items()
            if isinstance(p.get("mi_dp_nats_max"), (int, float))) + ", not an ε")
    if not parts:
        return None
    others = [n for n in algorithms if n not in eps and n not in mi]
    if others:
        parts.append(f"{', '.join(others)}: non-private")
    marks = {_guarantee(p) for p in (*eps.values(), *mi.values())}
    worst = next((g for g in ("not proven", "simulation") if g in marks), None)
    if worst is not None:
        parts.append(_GUARANTEE[worst])
    return "; ".join(parts)


@dataclass(frozen=True)
class FigureText:
    """What every figure of a run says: a title (data set, seed, key settings), the privacy
    line of a private run and a footnote; the PNG's metadata carries them too."""

    title: str
    privacy: str | None = None
    note: str | None = None

    def heading(self) -> str:
        return self.title + (f"\n{self.privacy}" if self.privacy else "")

    def metadata(self) -> dict[str, str]:
        """PNG text chunks: ``Title`` and ``Description`` (the privacy line and the note)."""
        desc = " ".join(x for x in (self.privacy, self.note) if x) or "non-private run"
        return {"Title": self.title, "Description": desc}


def figure_text(config: Mapping[str, Any], algorithms: Mapping[str, Mapping[str, Any]],
                settings: str | None = None, *, note: str | None = None) -> FigureText:
    """The :class:`FigureText` of a run: ``data set, seed N; settings`` and its privacy line
    (:func:`privacy_summary`)."""
    head = [str(config["dataset"])] if config.get("dataset") else []
    if config.get("seed") is not None:
        head.append(f"seed {config['seed']}")
    title = ", ".join(head) or "run"
    if settings:
        title += f"; {settings}"
    return FigureText(title, privacy_summary(algorithms), note)


def save_figure(fig: Any, path: str | Path, text: FigureText | None) -> Path:
    """Title (and privacy line), footnote, PNG metadata; save at ``path`` and close."""
    import matplotlib.pyplot as plt

    if text is not None:
        width = max(int(fig.get_figwidth() * 13), 50)  # characters of 9 pt text per line
        heading = "\n".join(textwrap.fill(line, width) for line in text.heading().split("\n"))
        fig.suptitle(heading, fontsize=9)
        if text.note:
            fig.supxlabel(textwrap.fill(text.note, int(width * 9 / 7)), fontsize=7, x=0.01,
                          ha="left")
    try:
        fig.savefig(path, dpi=110, metadata=text.metadata() if text is not None else None)
    finally:
        plt.close(fig)
    return Path(path)


def tidy_axis(ax: Any, values: Iterable[Any], axis: str = "y") -> None:
    """Give an axis whose data are (nearly) one value (a spread below 0.1% of it) a readable
    range around it, instead of matplotlib's span of a few parts in a million (or
    -0.04..0.04 around nothing) with an offset label."""
    vals = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return
    lo, hi = min(vals), max(vals)
    scale = max(abs(lo), abs(hi))
    if hi - lo > 1e-3 * scale and hi - lo > 1e-12:
        return
    pad = max(0.1 * scale, hi - lo) if scale > 0 else 1.0
    log = (ax.get_yscale() if axis == "y" else ax.get_xscale()) == "log"
    limits = (lo / 2, hi * 2) if log and lo > 0 else (lo - pad, hi + pad)
    (ax.set_ylim if axis == "y" else ax.set_xlim)(*limits)
    fmt = ax.yaxis if axis == "y" else ax.xaxis
    formatter = fmt.get_major_formatter()
    if hasattr(formatter, "set_useOffset"):
        formatter.set_useOffset(False)


#: The panels a history can have, in the order drawn: (key, title). A panel is drawn when
#: every history has its key (and not only NaN values); a private run's rows hold the held-out
#: metrics only (fl_examples.core.release).
PANELS = (("train_loss", "train loss"), ("heldout_loss", "held-out loss"),
          ("train_accuracy", "train accuracy"), ("test_accuracy", "test accuracy"),
          ("heldout_accuracy", "held-out accuracy"))


def finite_number(v: Any) -> bool:
    """Whether ``v`` is a finite int or float (not a bool, None or NaN)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _panels(histories: Mapping[str, list[Mapping[str, Any]]]) -> list[tuple[str, str]]:
    present = [h for h in histories.values() if h]
    out = []
    for key, title in PANELS:
        if not present or not all(key in h[0] for h in present):
            continue
        if any(finite_number(r.get(key)) for h in present for r in h):  # never an all-NaN panel
            out.append((key, title))
    if any(k == "train_loss" for k, _ in out):  # a non-private run: the held-out loss is
        out = [p for p in out if p[0] != "heldout_loss"]  # the fourth panel's companion
    return out


def plot_histories(
    out_dir: str | Path, histories: Mapping[str, list[Mapping[str, Any]]], *,
    note: str | None = None, labels: Mapping[str, str] | None = None,
    text: FigureText | None = None,
) -> list[Path]:
    """Loss and accuracy against each x axis the histories have, one line per algorithm
    (labelled by ``labels``, e.g. with its epsilon; :data:`PANELS` says which metrics),
    titled by ``text`` (:func:`figure_text`; else ``note`` alone is the footnote).

    Always iteration and wall time; also data rounds (``data_rounds``: the iterations that
    trained on client data, so client computation; Upcycled-FL's even iterations are free),
    simulated time (``simulated_time_s``, the
    asynchronous and straggler simulators) and bits communicated (``cumulative_bits``,
    log axis, drawn from each run's first evaluation with a positive count: round 0 sent
    nothing, which a log axis cannot place) when every history has that key. A panel whose
    values are all NaN (the accuracy of a regression) is not drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if text is None and note:
        text = FigureText("", None, note)
    written = []
    for x_key, x_label, fname, log_x in X_AXES:
        present = [h for h in histories.values() if h]
        if not present or not all(x_key in h[0] for h in present):
            continue
        panels = _panels(histories)
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(max(4.4 * len(panels), 6.4), 4.2),
                                 squeeze=False, layout="constrained")
        axes = axes[0]
        drawn: dict[str, list[Any]] = {key: [] for key, _ in panels}
        x_drawn: list[Any] = []
        for name, hist in histories.items():
            # a log axis cannot place 0: start at the first positive value (no invented
            # segment from the axis' edge)
            rows = [h for h in hist if not log_x or (finite_number(h[x_key]) and h[x_key] > 0)]
            if not rows:
                continue
            xs = [h[x_key] for h in rows]
            x_drawn += xs
            label = (labels or {}).get(name, name)
            for ax, (key, _) in zip(axes, panels):
                ys = [h[key] if finite_number(h.get(key)) else float("nan") for h in rows]
                drawn[key] += ys
                ax.plot(xs, ys, label=label, marker="o" if len(rows) == 1 else None)
        for ax, (key, title) in zip(axes, panels):
            ax.set_xlabel(x_label + ("\nlog axis: from each run's first evaluation above 0"
                                     if log_x else ""))
            if log_x:
                ax.set_xscale("log")
            ax.set_ylabel(title)
            ax.grid(alpha=0.3)
            tidy_axis(ax, drawn[key])
            if not log_x:  # e.g. wall times a few microseconds apart
                tidy_axis(ax, x_drawn, "x")
        axes[0].legend(fontsize=8)
        written.append(save_figure(fig, Path(out_dir) / fname, text))
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
