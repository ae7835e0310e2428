"""MAPA's report: each algorithm's entry, the updates-to-loss comparison, plots and the table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fl_examples.core.asyncsim import Schedule
from fl_examples.core.epsilon_plot import plot_vs_epsilon
from fl_examples.core.report import (
    Column,
    epsilon_section,
    figure_text,
    legend_label,
    save_figure,
    text_table,
    tidy_axis,
)
from fl_examples.mapa.config import MapaConfig
from fl_examples.mapa.privacy import privacy_section
from fl_examples.mapa.schedule import step_rule
from privkit.errors import InvalidParameterError

__all__ = ["TARGET_FRACTIONS", "report_entry", "updates_to_loss", "final_table",
           "figure_settings", "single_stage_note"]

TARGET_FRACTIONS = (0.95, 0.9, 0.75, 0.5)
"""Loss targets of the comparison, as fractions of the initial model's training loss."""


def report_entry(run: Any) -> dict[str, Any]:
    """The report entry of a finished MAPA run (history, updates, staleness, privacy)."""
    cfg, sched, end = run.cfg, run.sched, run.events_done
    hist = sched.staleness_histogram(end)
    applied_st = sched.staleness[:end][sched.applied[:end]]
    uploads = sched.uploads_per_edge(end)
    out: dict[str, Any] = {
        "history": run.history,
        "updates": run.applied,
        "cloud_events": end,
        "dropped_uploads": int((~sched.applied[:end]).sum()),
        "staleness_histogram": {str(s): c for s, c in hist.items()},
        "staleness_mean": float(applied_st.mean()) if applied_st.size else 0.0,
        "staleness_max": int(applied_st.max()) if applied_st.size else 0,
        "tau_in_step_sizes": cfg.tau(),
        "simulated_time_s": float(sched.done_s[end - 1]) if end else 0.0,
        "uploads_per_edge": uploads.tolist(),
        "gradient_batches": run.flushes,
        "step_size": _step_description(run),
    }
    if run.mapa is not None:
        out["stages"] = [s.to_dict() for s in run.mapa.stages_through(max(run.applied, 1))]
        if len(out["stages"]) == 1:  # the run ended inside stage 0: say so, and what follows
            out["stage_note"] = single_stage_note(run)
            out["stages_after_run"] = _planned(run.mapa, 2)
    if run.diverged:
        out["diverged"] = run.diverged
    if run.private:
        p = privacy_section(run, uploads)
        public = ["the edges, their record counts n_k and which edge uploads when (the "
                  "simulated schedule: record-level DP protects records, not participation)"]
        p |= run.pub.notes(proven_maths=bool(p.get("proven", True)), public=public,
                           dataset_description=getattr(run, "dataset_description", None))
        out["privacy"] = p
    return out


def _planned(schedule: Any, count: int) -> list[dict[str, Any]]:
    """The ``count`` stages after stage 0, as far as they are numbers (a schedule whose
    DeltaS or step size underflows further on stops there)."""
    out = []
    for i in range(1, count + 1):
        try:
            out.append(schedule.stage(i).to_dict())
        except InvalidParameterError:
            break
    return out


def single_stage_note(run: Any) -> str:
    """One line for a MAPA run that never left its first stage: the stage's length against
    the run's, the clip every update used, and whether MAPA was then AUDP."""
    cfg, first = run.cfg, run.mapa.stage(0)
    same_as_audp = (cfg.noise == "gaussian" and run.step_rule == "constant"
                    and step_rule(cfg.step_schedule, "audp", cfg.noise) == "constant")
    audp_clip = cfg.clip if cfg.noise == "gaussian" else cfg.audp_clip
    return (f"MAPA's schedule does not switch stage within this run: stage 0 lasts T_0 = "
            f"{first.length} updates, the run {run.applied}, so every update used the first "
            f"clip C_0 = {first.clip:.4g}"
            + (" and MAPA is AUDP here (the same clip, step, batches and noise)"
               if same_as_audp else f" (AUDP's fixed clip is {audp_clip:g})")
            )


def _step_description(run: Any) -> dict[str, Any]:
    cfg, tau = run.cfg, run.cfg.tau()
    head = {"schedule": run.step_rule, "requested": cfg.step_schedule}
    clip = {} if run.algorithm != "audp" else {"delta_s": run.audp_delta_s,
                                                 "clip": run.audp_clip}
    if run.step_rule == "constant":
        out = head | {"formula": "gamma_t = lr (constant)", "lr": cfg.lr} | clip
        if run.algorithm == "mapa":
            out["note"] = ("MAPA's stages (clip C_s, length T_s) follow the paper's schedule; "
                           "only the step is lr instead of the stage's gamma")
        return out
    if run.algorithm == "asgd":
        return head | {"formula": "1/(L (tau+1)^2 + sigma sqrt(t+1)/(R sqrt(b)))",
                       "L": cfg.lipschitz, "tau": tau, "sigma": cfg.asgd_sigma, "R": cfg.r0,
                       "b": cfg.batch}
    if run.algorithm == "audp":
        return head | {"formula": "1/(2 L (tau+1) + sqrt(Delta_b t))", "L": cfg.lipschitz,
                       "tau": tau, "delta_b": run.audp_delta_b, "variance": cfg.variance} | clip
    return head | {"formula": "1/(2 L P (tau+1)) per stage", "L": cfg.lipschitz, "tau": tau,
                   "theta": cfg.theta, "R": cfg.r0, "sigma": cfg.sigma,
                   "variance": cfg.variance}


def updates_to_loss(history: list[dict[str, Any]], target: float,
                    key: str = "train_loss") -> int | None:
    """The first evaluated update count whose loss (``key``) is <= target (None: never)."""
    for row in history:
        if row.get(key) is not None and row[key] <= target:
            return int(row["iteration"])
    return None


def comparison_loss(algs: dict[str, dict[str, Any]]) -> str:
    """The loss every algorithm's rows hold: the training loss, or (a private algorithm's
    rows hold only public-data metrics) the held-out loss."""
    rows = [r["history"][0] for r in algs.values() if r["history"]]
    return "train_loss" if all("train_loss" in h for h in rows) else "heldout_loss"


def _comparison(cfg: MapaConfig, algs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    first = next(iter(algs.values()))["history"]
    key = comparison_loss(algs)
    f0 = float(first[0][key])
    targets = [(f"{q:g} x initial loss", q * f0) for q in TARGET_FRACTIONS]
    if cfg.target_loss is not None:
        targets.append(("absolute", cfg.target_loss))
    rows = []
    for label, target in targets:
        need = {n: updates_to_loss(r["history"], target, key) for n, r in algs.items()}
        row: dict[str, Any] = {"target": label, "target_loss": target, "updates": need}
        m = need.get("mapa")
        for other in ("audp", "asgd"):
            o = need.get(other)
            if "mapa" in need and other in need:
                row[f"mapa_over_{other}"] = (m / o) if (m is not None and o) else None
        rows.append(row)
    best = {n: min(h[key] for h in r["history"]) for n, r in algs.items()}
    return {"loss": key, "initial_loss": f0, "targets": rows, f"best_{key}": best,
            "note": "updates are resolved to the evaluation grid (eval_every); a ratio < 1 "
                    "means MAPA needed fewer updates; None: a side never reached the target"}


def figure_settings(config: dict[str, Any]) -> str:
    """The key settings every MAPA figure's title names (after the data set and seed)."""
    c = config
    parts = [f"{c['edges']} edges", f"{c['updates']} updates", f"batch {c['batch']}"]
    if c["noise"] == "gaussian":
        z = c.get("noise_multiplier")
        zs = sorted({float(v) for v in z.values()}) if isinstance(z, dict) else []
        parts.append("Gaussian noise" + (f", z {', '.join(f'{v:.3g}' for v in zs)}" if zs
                                         else ""))
    else:
        eps = c["epsilon"]
        eps = (f"{min(eps):g}..{max(eps):g}" if isinstance(eps, (list, tuple))
               else f"{eps:g}")  # one per edge
        parts.append(f"{c['noise']} Laplace noise, upload epsilon {eps}"
                     + (" (amplified)" if c.get("amplification") else ""))
    if c.get("noise_for_epsilon") is not None:
        parts.append(f"calibrated to epsilon {c['noise_for_epsilon']:g}")
    parts.append(f"{c.get('step_schedule', 'auto')} steps")
    return ", ".join(parts)


#: The schedule figure's panels: (stage key, axis label in mathtext).
_SCHEDULE_PANELS = (
    ("delta_s", r"$\Delta S_s$ (sensitivity; clip $C_s = b\,\Delta S_s / 2$)"),
    ("gamma", r"$\gamma_s$ (step size)"),
    ("length", r"$T_s$ (updates in stage $s$)"),
)


def _plot_extras(out: Path, schedule: Schedule, end: int,
                 stages: list[dict[str, Any]] | None, *, config: dict[str, Any] | None = None,
                 algorithms: dict[str, dict[str, Any]] | None = None) -> None:
    """``staleness.png``, MAPA's ``schedule.png`` and, for a private run,
    ``curves_vs_epsilon.png`` (held-out accuracy against each private algorithm's epsilon
    after each evaluation, max over edges, from its history's ``epsilon_max``); every figure
    titled with the data set, seed, key settings and the run's epsilon."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    algs = algorithms or {}
    text = figure_text(config or {}, algs, figure_settings(config) if config else None)
    hist = schedule.staleness_histogram(end)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    if hist:
        ax.bar(list(hist), list(hist.values()), width=1.0)
    ax.set_xlabel(r"staleness $\tau$ (updates applied between an edge's pull and its "
                  "update's apply)")
    ax.set_ylabel("applied updates")
    ax.set_title(f"{schedule.num_edges} edges, {sum(hist.values())} applied updates",
                 fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    save_figure(fig, out / "staleness.png", text)
    mapa = algs.get("mapa") or {}
    if stages and len(stages) == 1:
        _plot_one_stage(out, stages[0], mapa.get("stages_after_run", []),
                        mapa.get("updates", 0), text)
    elif stages:
        fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), layout="constrained")
        idx = [s["index"] for s in stages]
        step = (algs.get("mapa") or {}).get("step_size", {})
        lr = stages[0].get("step")  # the lengths are for this constant step (Gaussian mode)
        panels = _SCHEDULE_PANELS if lr is None else (
            _SCHEDULE_PANELS[0], ("delta_b", r"$\Delta_b$ (variance bound of an upload)"),
            ("length", rf"$T_s$ (updates in stage $s$, for the step lr = {lr:g})"))
        for ax, (key, label) in zip(axes, panels):
            values = [float(s[key]) for s in stages]
            ax.plot(idx, values, "o-")
            spread = max(values) / min(values) if min(values) > 0 else 1.0
            if spread > 20:  # a log axis only where the values span decades
                ax.set_yscale("log")
            if len(values) <= 6:
                for i, v in zip(idx, values):
                    last = i == idx[-1] and len(idx) > 1  # leftwards, inside the axes
                    ax.annotate(f"{v:.4g}", (i, v), textcoords="offset points",
                                xytext=(-4 if last else 4, 6), fontsize=8,
                                ha="right" if last else "left")
            if key == "gamma" and step.get("schedule") == "constant":
                label += f"\n(the paper's; this run steps with lr = {step.get('lr', '?')})"
            ax.set_ylabel(label)
            ax.set_xlabel("stage $s$")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if len(idx) == 1:
                ax.set_xlim(idx[0] - 1, idx[0] + 1)
            ax.grid(alpha=0.3)
            tidy_axis(ax, values)
        save_figure(fig, out / "schedule.png", text)
    curves = {n: [(h["epsilon_max"], h) for h in r["history"] if "epsilon_max" in h]
              for n, r in algs.items()}
    curves = {n: c for n, c in curves.items() if c}
    if curves:
        p = epsilon_section(algs[next(iter(curves))])
        delta = f", δ = {p['delta']:g}" if p is not None else ""
        refs = {n: r["history"][-1] for n, r in algs.items()
                if n not in curves and r.get("history") and epsilon_section(r) is None}
        plot_vs_epsilon(out, curves, references=refs, text=text,
                        labels={n: legend_label(n, algs[n]) for n in curves},
                        x_label=f"ε after each evaluation, cumulative (max over edges{delta})")


def _plot_one_stage(out: Path, first: dict[str, Any], after: list[dict[str, Any]],
                    updates: int, text: Any) -> None:
    """``schedule.png`` of a run that never left stage 0: not three one-point panels but the
    clip C_s against the update number for stage 0 and the stages planned after it, the
    run's end marked, each stage's T_s and gamma_s written on it."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(7.6, 4.4), layout="constrained")
    stages = [first, *after]
    for st in stages:
        lo, hi = st["start"], st["start"] + st["length"]
        ax.hlines(st["clip"], lo, hi, lw=2.5, color="C0" if st["index"] == 0 else "C7",
                  ls="-" if st["index"] == 0 else "--")
        last = st is stages[-1]  # written leftwards from its end, inside the axes
        ax.annotate(f"stage {st['index']}: $C_{st['index']}$ = {st['clip']:.4g}, "
                    f"$T_{st['index']}$ = {st['length']}, "
                    + (f"$\\gamma$ = {st['gamma']:.3g}" if st.get("step") is None
                       else f"step lr = {st['step']:g}"),
                    (hi if last else lo, st["clip"]), textcoords="offset points",
                    xytext=(-2 if last else 2, 5), ha="right" if last else "left", fontsize=8)
    ax.axvline(max(updates, 1), color="C3", lw=1.5)
    ax.annotate(f"this run ends: update {updates}", (max(updates, 1), first["clip"] / 2),
                textcoords="offset points", xytext=(-4, 0), ha="right", fontsize=8,
                color="C3")
    end = stages[-1]["start"] + stages[-1]["length"]
    if end / max(min(updates, first["start"]), 1) > 50:  # stages span decades of updates
        ax.set_xscale("log")
    ax.set_xlim(1, end * 1.2)
    ax.set_yscale("log", base=2)
    ax.set_ylim(stages[-1]["clip"] / 2, first["clip"] * 2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("applied update $t$")
    ax.set_ylabel(r"clip $C_s = b\,\Delta S_s / 2$ (log axis)")
    ax.set_title("MAPA never left stage 0: every update used $C_0$ (dashed: the stages "
                 "planned after it)", fontsize=9)
    ax.grid(alpha=0.3)
    save_figure(fig, out / "schedule.png", text)


_COLUMNS = (Column("algorithm", 9), Column("updates", 7), Column("train loss", 10, ".4f"),
            Column("train acc", 9, ".4f"), Column("test acc", 8, ".4f"),
            Column("sim s", 9, ".1f"), Column("wall s", 7, ".2f"),
            Column("staleness mean", 14, ".1f"),
            Column("staleness max", 13))


_PRIVATE_COLUMNS = (Column("algorithm", 9), Column("updates", 7),
                    Column("heldout loss", 12, ".4f"), Column("heldout acc", 11, ".4f"),
                    Column("sim s", 9, ".1f"), Column("wall s", 7, ".2f"),
                    Column("staleness mean", 14, ".1f"), Column("staleness max", 13))


def final_table(result: dict[str, Any]) -> str:
    """A text table of each algorithm's last evaluation, privacy and the comparison (a run
    with a private algorithm shows held-out metrics: public data)."""
    algs = result["algorithms"]
    private = comparison_loss(algs) == "heldout_loss"
    cols, keys = ((_PRIVATE_COLUMNS, ("heldout_loss", "heldout_accuracy")) if private else
                  (_COLUMNS, ("train_loss", "train_accuracy", "test_accuracy")))
    lines = text_table(cols, [
        (name, r["updates"], *(r["history"][-1].get(k, float("nan")) for k in keys),
         r["simulated_time_s"], r["history"][-1]["wall_time_s"], r["staleness_mean"],
         r["staleness_max"]) for name, r in algs.items()])
    notes = []
    for name, r in algs.items():
        if "diverged" in r:
            notes.append(f"{name}: {r['diverged']}")
        if "privacy" in r and "noise_multiplier" in r["privacy"]:
            p = r["privacy"]
            notes.append(
                f"{name}: per-edge eps mean {p['epsilon_mean']:.4g}, max {p['epsilon_max']:.4g} "
                f"at delta={p['delta']:g} [{p['epsilon_assumption']}; add/remove one record; "
                f"privkit PLD]; Gaussian noise multiplier z = {p['noise_multiplier']:.4g}; "
                f"uploads per edge {p['uploads_min']}..{p['uploads_max']} (mean "
                f"{p['uploads_mean']:.1f})" + (f"\n  {p['stopped']}" if "stopped" in p else ""))
        elif "privacy" in r:
            p = r["privacy"]
            amp = (f" [{p['epsilon_assumption']}; unamplified: mean "
                   f"{p['epsilon_unamplified_mean']:.4g}, max {p['epsilon_unamplified_max']:.4g}]"
                   if p.get("amplified") else "")
            notes.append(
                f"{name}: per-edge eps mean {p['epsilon_mean']:.4g}, max {p['epsilon_max']:.4g} "
                f"at delta={p['delta']:g}{amp} (optimal composition; basic max "
                f"{p['epsilon_basic_max']:.4g}); the paper's per-update claim: eps = "
                f"{p['per_update_epsilon_paper']['max']:g}; uploads per edge "
                f"{p['uploads_min']}..{p['uploads_max']} (mean {p['uploads_mean']:.1f})"
                + (f"\n  {p['stopped']}" if "stopped" in p else ""))
    notes += [f"{name}: {r['stage_note']}" for name, r in algs.items() if "stage_note" in r]
    comp = result["comparison"]
    what = "a held-out" if comp.get("loss") == "heldout_loss" else "a training"
    cmp_lines = [f"updates to reach {what} loss (initial {comp['initial_loss']:.4f}):"]
    p0 = next((r["privacy"] for r in algs.values() if "privacy" in r), None)
    if p0 is not None:
        mark = {"simulation": "seeded simulation: the guarantee holds only against someone "
                "who does not know --seed", "proven": "batches and noise from the OS CSPRNG",
                "not proven": "NOT PROVEN"}[p0["guarantee"]]
        notes.append(f"({mark}; not covered by epsilon: "
                     + "; ".join(n["field"] for n in p0["not_covered"]) + ")")
    for row in comp["targets"]:
        need = ", ".join(f"{n} {v if v is not None else 'never'}"
                         for n, v in row["updates"].items())
        ratios = "; ".join(f"{k.replace('_over_', '/')} {v:.3g}" for k, v in row.items()
                           if k.startswith("mapa_over_") and v is not None)
        cmp_lines.append(f"  <= {row['target_loss']:.4f} ({row['target']}): {need}"
                         + (f"  [{ratios}]" if ratios else ""))
    return "\n".join(lines + ([""] + notes if notes else []) + [""] + cmp_lines)
