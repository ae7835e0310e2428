"""Held-out accuracy against the cumulative epsilon of a private run: ``curves_vs_epsilon.png``.

Every private trainer draws it (:func:`plot_vs_epsilon`). DP-REC and MAPA record the epsilon
at each evaluation in their history rows; Upcycled-FL and SCFL (with gradient noise) do not,
so :func:`ledger_epsilon_curves` replays the run's ledger round by round
(:func:`epsilon_by_round`): who was charged what in which round is public under the
relations these runs use (the population's single account at client level, each client's
participation at record level), so the curve is computed from public quantities only, with
the accountant, delta and relation the ledger itself prices with.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fl_examples.core.report import (
    FigureText,
    epsilon_section,
    finite_number,
    save_figure,
    tidy_axis,
)

__all__ = ["MAX_EPSILON_POINTS", "MAX_PLOTTED_EPSILON", "thin", "epsilon_by_round",
           "ledger_epsilon_curves", "plot_vs_epsilon"]

#: Most evaluations priced for a curve against epsilon replayed from a ledger (evenly
#: spread, the last one always included): each is an accountant call per client.
MAX_EPSILON_POINTS = 30

#: The largest epsilon drawn against: above it an epsilon promises nothing, and an axis
#: near the largest double cannot be ticked (matplotlib overflows). Such points stay in
#: report.json only.
MAX_PLOTTED_EPSILON = 1e100

_Y_KEYS = (("heldout_accuracy", "held-out accuracy"), ("heldout_loss", "held-out loss"),
           ("test_accuracy", "test accuracy (clients' test splits)"),
           ("train_loss", "train loss"))


def thin(rows: Sequence[Any], most: int = MAX_EPSILON_POINTS) -> list[Any]:
    """At most ``most`` of ``rows``, evenly spread, the first and last included."""
    n = len(rows)
    if n <= most:
        return list(rows)
    picks = sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})
    return [rows[i] for i in picks]


def epsilon_by_round(ledger_file: str | Path, rounds: Sequence[int]) -> list[float]:
    """For each r in ``rounds``: the largest epsilon over the ledger's clients of the charges
    recorded with round <= r, priced as the ledger prices (its accountant, delta and
    relation): the run's epsilon after round r, computed from its public record of who was
    charged what (the report's final epsilon is the last round's).

    A client whose composition is dominated by another's (the same events, no more of each;
    or the same Poisson-subsampled event at a rate and a count no larger) cannot be the
    largest, so it is not priced.
    """
    from collections import Counter

    import privkit
    from privkit.accountants.rules import flatten
    from privkit.events import event_from_dict
    from privkit.ledger import Ledger

    ledger = Ledger.open(ledger_file)
    spends = sorted((e for e in ledger.entries_since(ledger.origin())
                     if e.get("kind") == "spend"), key=lambda e: int(e.get("round") or 0))
    decoded: dict[str, Any] = {}
    atoms: dict[str, Counter[Any]] = {}
    non_private: set[str] = set()
    snapshots: dict[int, set[tuple[Any, ...]]] = {}
    i = 0
    for r in sorted(set(int(x) for x in rounds)):
        while i < len(spends) and int(spends[i].get("round") or 0) <= r:
            e = spends[i]
            key = json.dumps(e["event"], sort_keys=True)
            if key not in decoded:
                decoded[key] = event_from_dict(e["event"])
            comp = flatten(decoded[key], int(e.get("count", 1)))
            cid = str(e["client_id"])
            atoms.setdefault(cid, Counter()).update(dict(comp.atoms))
            if comp.non_private:
                non_private.add(cid)
            i += 1
        snapshots[r] = {(cid in non_private, tuple(sorted(c.items(), key=lambda t: repr(t[0]))))
                        for cid, c in atoms.items()}
    fronts = {r: _undominated(snap) for r, snap in snapshots.items()}
    priced: dict[tuple[Any, ...], float] = {}
    todo = {comp for front in fronts.values() for comp in front if not comp[0] and comp[1]}
    if todo:
        order = list(todo)
        events = [privkit.ComposedDpEvent([privkit.SelfComposedDpEvent(a, n) for a, n in c[1]])
                  for c in order]
        eps = privkit.epsilon_batch(events, ledger.delta, ledger.method,
                                    neighboring_relation=ledger.neighboring_relation)
        priced = dict(zip(order, (float(x) for x in eps)))
    out = []
    for r in rounds:
        front = fronts[int(r)]
        if any(c[0] for c in front):  # a non-private charge: no finite epsilon
            out.append(math.inf)
            continue
        out.append(max((priced[c] for c in front if c[1]), default=0.0))
    return out


def _atom_key(atom: Any) -> tuple[Any, float]:
    """(what the atom is apart from its sampling rate, the rate): Poisson-subsampled events
    of one inner event order by rate."""
    import privkit

    if isinstance(atom, privkit.PoissonSampledDpEvent):
        return ("poisson", atom.event), float(atom.sampling_probability)
    return ("plain", atom), 1.0


#: Largest group of multi-event compositions compared pairwise for dominance (beyond it all
#: are priced: the pairwise check would cost more than it saves).
_PAIRWISE = 200


def _undominated(snapshot: Iterable[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The compositions of ``snapshot`` (``(non_private, ((atom, count), ...))``) that no
    other one dominates. A non-private one is always kept (its epsilon is inf)."""
    keep: list[tuple[Any, ...]] = []
    single: dict[Any, list[tuple[float, int, tuple[Any, ...]]]] = {}
    multi: dict[tuple[Any, ...], list[tuple[list[tuple[float, int]], tuple[Any, ...]]]] = {}
    for c in snapshot:
        if c[0] or not c[1]:
            keep.append(c)
            continue
        parts = sorted(((_atom_key(a), n) for a, n in c[1]), key=lambda t: repr(t[0][0]))
        kinds = tuple(k for (k, _), _ in parts)
        if len(kinds) == 1:
            (kind, q), n = parts[0]
            single.setdefault(kind, []).append((q, n, c))
        else:
            multi.setdefault(kinds, []).append(([(q, n) for (_, q), n in parts], c))
    for group in single.values():  # a Pareto front on (rate, count): one sort, one sweep
        group.sort(key=lambda t: (-t[0], -t[1]))
        most = -1
        for _, n, c in group:
            if n > most:
                keep.append(c)
                most = n
    for kinds, group in multi.items():
        if len(group) > _PAIRWISE or len(set(kinds)) != len(kinds):
            keep += [c for _, c in group]
            continue
        for j, (vj, cj) in enumerate(group):
            covered = any(k != j and all(qa >= qb and na >= nb for (qa, na), (qb, nb)
                                         in zip(vk, vj)) and (vk != vj or k < j)
                          for k, (vk, _) in enumerate(group))
            if not covered:
                keep.append(cj)
    return keep


def ledger_epsilon_curves(out_dir: str | Path, algorithms: Mapping[str, Mapping[str, Any]],
                          round_key: str) -> dict[str, list[tuple[float, Mapping[str, Any]]]]:
    """Per private algorithm with a ledger in ``out_dir``: (epsilon after the row's round,
    row) for its evaluations (at most :data:`MAX_EPSILON_POINTS`), the round of a row being
    its ``round_key`` (:func:`epsilon_by_round`)."""
    from fl_examples.core.run import ledger_path
    from fl_examples.core.status import status

    todo = {n: (ledger_path(Path(out_dir), n), thin(r.get("history", [])))
            for n, r in algorithms.items()
            if epsilon_section(r) is not None and ledger_path(Path(out_dir), n).is_file()}
    todo = {n: v for n, v in todo.items() if v[1] and all(round_key in h for h in v[1])}
    if not todo:
        return {}
    points = sum(len(rows) for _, rows in todo.values())
    curves = {}
    with status(f"pricing epsilon at {points} evaluations for curves_vs_epsilon.png") as line:
        for name, (path, rows) in todo.items():
            eps = epsilon_by_round(path, [int(h[round_key]) for h in rows])
            curves[name] = list(zip(eps, rows))
        line.done("ε ≤ " + ", ".join(f"{c[-1][0]:.3g} ({n})" for n, c in curves.items()))
    return curves


def plot_vs_epsilon(out_dir: str | Path, curves: Mapping[str, Sequence[tuple[float, Any]]], *,
                    x_label: str, text: FigureText | None,
                    labels: Mapping[str, str] | None = None,
                    references: Mapping[str, Mapping[str, Any]] | None = None,
                    fname: str = "curves_vs_epsilon.png") -> Path | None:
    """``curves_vs_epsilon.png``: each private algorithm's held-out accuracy (held-out loss
    for a regression, which has no accuracy) against its cumulative epsilon at each
    evaluation (``curves``: name -> [(epsilon, history row)]), and each non-private
    reference's final value (``references``: name -> its last row) as a dashed line.
    Points whose epsilon is not finite or above :data:`MAX_PLOTTED_EPSILON` are left out
    (report.json holds them). Returns None when there is nothing to draw."""
    curves = {n: [(e, r) for e, r in c if finite_number(e) and abs(e) <= MAX_PLOTTED_EPSILON]
              for n, c in curves.items()}
    curves = {n: c for n, c in curves.items() if c}
    if not curves:
        return None
    key, y_label = next(((k, t) for k, t in _Y_KEYS if all(
        any(finite_number(r.get(k)) for _, r in c) for c in curves.values())), (None, None))
    if key is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    xs_all, ys_all = [], []
    for name, pts in curves.items():
        xs = [e for e, _ in pts]
        ys = [r[key] if finite_number(r.get(key)) else float("nan") for _, r in pts]
        xs_all += xs
        ys_all += ys
        ax.plot(xs, ys, "o-", ms=3, label=(labels or {}).get(name, name))
    for name, row in (references or {}).items():
        if finite_number(row.get(key)):
            ys_all.append(row[key])
            ax.axhline(row[key], color="grey", ls="--", lw=1.2,
                       label=f"{name} (non-private, final)")
    # wrapped to the figure's width: a long label (SCFL's) is never cut at both ends
    ax.set_xlabel(textwrap.fill(x_label, int(fig.get_figwidth() * 11)))
    ax.set_ylabel(y_label)
    ax.grid(alpha=0.3)
    tidy_axis(ax, xs_all, "x")
    tidy_axis(ax, ys_all)
    ax.legend(fontsize=8)
    return save_figure(fig, Path(out_dir) / fname, text)
