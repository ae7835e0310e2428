"""Upcycled-FL with its FedProx and FedAvg baselines (non-private).

Upcycled-FL (*Federated Learning with Reduced Information Leakage and Computation*,
Algorithm 2) alternates a data-touching odd iteration (a FedProx round: sampled clients
solve F_i(w) + mu/2 ||w - w_bar||^2 from w_bar, the server averages with p_i re-normalised
over the sampled clients) with a server-only even iteration

    w^{2m} = w^{2m-1} + c_m (w^{2m-1} - w^{2m-2}),   c_m = mu / (mu + lambda_m),

so half of the iterations touch no data and cost almost nothing. FedProx runs the odd
round every iteration; FedAvg does the same with mu = 0 and drops stragglers (FedProx keeps
their partial work). The k-th data round of every algorithm uses the same client subset,
stragglers and batch order (one seed tree).

Run it as ``privkit train upcycled --dataset synthetic:0.5,0.5 --mu 1 --lam 0.42
--rounds 160 --fraction 0.3 --stragglers 0.9 --algorithms upcycled,fedprox,fedavg --out DIR``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fl_examples.core.canaries import finish
from fl_examples.core.data import parse_dataset_spec
from fl_examples.core.epsilon_plot import ledger_epsilon_curves, plot_vs_epsilon
from fl_examples.core.privacy import clip_features
from fl_examples.core.release import check_heldout
from fl_examples.core.report import (
    Column,
    epsilon_scope,
    epsilon_section,
    figure_text,
    legend_label,
    text_table,
    write_report,
)
from fl_examples.upcycled.config import ALGORITHMS, UpcycledConfig, extrapolation
from fl_examples.upcycled.privacy import planned_releases
from fl_examples.upcycled.run import _Run as _Run
from fl_examples.upcycled.run import run_algorithm
from privkit.errors import InvalidParameterError

__all__ = ["ALGORITHMS", "UpcycledConfig", "run_algorithm", "train", "extrapolation",
           "final_table", "planned_releases"]


def train(cfg: UpcycledConfig, *, compare: tuple[str, ...] = (), out: str | Path | None = None,
          resume: bool = False, algorithm: str = "upcycled") -> dict[str, Any]:
    """Run ``algorithm`` (default Upcycled-FL) and the ``compare`` baselines; write the report.

    Baselines in a comparison with Upcycled-FL run ``iterations // 2`` rounds (the paper's
    80/80/160, the same number of data rounds) or ``iterations`` (private runs, the paper's
    privacy experiments): see ``UpcycledConfig.baseline_iterations``. With
    ``cfg.audit_canaries`` the main algorithm's run is audited: ``OUT/audit_scores.json``, and
    the result's (and the report's) ``audit`` block (:mod:`fl_examples.core.canaries`).
    """
    for name in (algorithm, *compare):
        if name not in ALGORITHMS:
            raise InvalidParameterError("compare", name, f"one of {', '.join(ALGORITHMS)}")
    ds = parse_dataset_spec(cfg.dataset, seed=cfg.seed)
    check_heldout(cfg.privacy != "none", ds.has_heldout, cfg.eval_client_data, cfg.dataset)
    if cfg.feature_norm is not None:
        ds = clip_features(ds, cfg.feature_norm)
    out_path = Path(out) if out is not None else None
    results: dict[str, Any] = {}
    audit: dict[str, Any] | None = None
    for name in dict.fromkeys((algorithm, *compare)):
        half = cfg.baseline_iterations == "half" or (
            cfg.baseline_iterations == "auto" and cfg.privacy == "none")
        iters = cfg.iterations if (name == "upcycled" or algorithm != "upcycled" or not half) \
            else max(cfg.iterations // 2, 1)
        # --audit-canaries: the main algorithm's releases only
        run_cfg = cfg if name == algorithm else dataclasses.replace(cfg, audit_canaries=0)
        res = run_algorithm(name, run_cfg, ds, iterations=iters, out=out_path, resume=resume)
        done = res["history"][-1]["iteration"] if res["history"] else 0
        results[name] = {"history": res["history"], "iterations": iters,
                         "data_rounds": (done + 1) // 2 if name == "upcycled" else done}
        if "privacy" in res:
            results[name]["privacy"] = res["privacy"]
        results[name]["_model"] = res["model"]
        if "_canaries" in res:
            p = res["privacy"]
            audit = finish(res["_canaries"], algorithm=name, accounted_epsilon=p["epsilon_max"],
                           delta=p["delta"], out=out_path)
    config = dataclasses.asdict(cfg) | {"algorithm": algorithm, "compare": list(compare),
                                        "dataset_description": ds.description,
                                        "num_clients": ds.num_clients} | _calibrated(results)
    sections = {"audit": audit} if audit is not None else None
    if out_path is not None:
        write_report(out_path, config, results, settings=_settings(config), sections=sections)
        _plot_vs_epsilon(out_path, config, results)
    return {"config": config, "algorithms": results, **(sections or {})}


def _settings(config: dict[str, Any]) -> str:
    """The key settings every figure's title names (after the data set and seed)."""
    c = config
    parts = [f"{c['iterations']} iterations", f"fraction {c['fraction']:g}",
             f"stragglers {c['stragglers']:g}", f"mu {c['mu']:g}", f"lambda {c['lam']:g}"]
    kind = c.get("privacy", "none")
    if kind == "none":
        return ", ".join(parts)
    noise = {"output": ("sigma", c.get("stddev")), "objective": ("alpha", c.get("alpha"))}.get(
        kind, ("z", c.get("noise_multiplier")))
    value = noise[1]
    if isinstance(value, dict):  # calibrated per algorithm
        value = ", ".join(f"{v:.3g}" for v in value.values())
    elif isinstance(value, (int, float)):
        value = f"{value:.3g}"
    text = f"{kind} privacy, {noise[0]} {value}"
    if kind == "client" and c.get("mechanism") == "bandmf":
        text = f"client privacy, {banded_mf_setting(c)}, {noise[0]} {value}"
    if kind in ("client", "record") and c.get("l2_clip_norm") is not None:
        text += f", clip {c['l2_clip_norm']:g}"
    if c.get("noise_for_epsilon") is not None:
        text += f" (calibrated to epsilon {c['noise_for_epsilon']:g})"
    return ", ".join([text, *parts])


#: What each banded-MF participation is called in a figure, and the relation it is priced
#: under (:attr:`fl_examples.core.banded.BandedPlan.neighboring_relation`).
_PARTICIPATION = {"minsep": ("min-separation participation", "zero-out"),
                  "cyclic": ("cyclic participation", "add/remove one client"),
                  "poisson": ("cyclic Poisson participation", "add/remove one client")}


def banded_mf_setting(config: dict[str, Any]) -> str:
    """A banded-MF run's mechanism, participation and neighbouring relation, as its figures'
    titles name them: ``banded MF (8 bands), min-separation participation (s = 8, client
    rate 0.1), zero-out relation``."""
    c = config
    bands = c.get("bands") or 4
    name, relation = _PARTICIPATION.get(c.get("participation") or "minsep",
                                        (str(c.get("participation")), "?"))
    if (c.get("participation") or "minsep") == "minsep":
        detail = f"s = {c.get('min_separation') or bands}"
    else:
        detail = f"{c.get('groups') or bands} groups"
    rate = c.get("client_rate") if c.get("client_rate") is not None else c.get("fraction")
    if isinstance(rate, (int, float)) and c.get("participation") != "cyclic":
        detail += f", client rate {rate:g}"
    return (f"banded MF ({bands} band{'s' if bands != 1 else ''}), {name} ({detail}), "
            f"{relation} relation")


def _plot_vs_epsilon(out: Path, config: dict[str, Any], results: dict[str, Any]) -> None:
    """``curves_vs_epsilon.png`` of a private run: held-out accuracy against the epsilon
    after each evaluated data round, replayed from each algorithm's ledger (max over
    clients; the population's at client level)."""
    curves = ledger_epsilon_curves(out, results, "data_rounds")
    if not curves:
        return
    p = epsilon_section(results[next(iter(curves))])
    assert p is not None
    plot_vs_epsilon(out, curves, text=figure_text(config, results, _settings(config)),
                    labels={n: legend_label(n, results[n]) for n in curves},
                    x_label=f"ε after each evaluation, cumulative ({epsilon_scope(p)}, "
                            f"δ = {p['delta']:g})")


def _calibrated(results: dict[str, Any]) -> dict[str, Any]:
    """The calibrated noise parameter, per algorithm, where the configuration left it to
    ``noise_for_epsilon``: the report's configuration holds the values the run used."""
    out: dict[str, dict[str, float]] = {}
    for name, r in results.items():
        cal = r.get("privacy", {}).get("calibrated")
        if cal:
            out.setdefault(cal["parameter"], {})[name] = cal["value"]
    return out


_COLUMNS = (Column("algorithm", 10), Column("iters", 6), Column("data rounds", 11),
            Column("train loss", 10, ".4f"), Column("train acc", 9, ".4f"),
            Column("test acc", 8, ".4f"), Column("wall s", 8, ".2f"),
            Column("client s", 8, ".2f"))
_METRICS = ("train_loss", "train_accuracy", "test_accuracy")
#: A private run's table: the held-out metrics (public data), not the clients'.
_PRIVATE_COLUMNS = (Column("algorithm", 10), Column("iters", 6), Column("data rounds", 11),
                    Column("heldout loss", 12, ".4f"), Column("heldout acc", 11, ".4f"),
                    Column("wall s", 8, ".2f"), Column("client s", 8, ".2f"))
_PRIVATE_METRICS = ("heldout_loss", "heldout_accuracy")


def _privacy_detail(p: dict[str, Any]) -> str:
    mech = p["mechanism"]
    if mech == "gaussian_output_perturbation":
        return f"sensitivity {p['sensitivity']} ({p['sensitivity_formula']})"
    if mech == "objective_perturbation":
        return f"alpha {p['alpha']:.4g}"
    if p.get("privacy_unit") == "client" and "bands" in p:
        who = {"minsep": f"cohorts of {p['cohort']}, min separation {p['min_separation']}",
               "cyclic": f"cyclic over {p['groups']} groups",
               "poisson": f"cyclic over {p['groups']} groups, Poisson q {p['client_rate']:g}"
               }[p["participation"]]
        short = (f"; {p['cohort_shortfall_rounds']} round(s) short of the cohort"
                 if p.get("cohort_shortfall_rounds") else "")
        return (f"banded MF: {p['bands']} bands, clip {p['l2_clip_norm']:g}, z "
                f"{p['noise_multiplier']:.4g}, {who}{short}")
    if p.get("aggregation") == "distributed":
        wrapped = p.get("wrapped_rounds", 0)
        return (f"distributed DP (secure aggregation, Skellam shares; zero-out): clip "
                f"{p['l2_clip_norm']:g}, {p['bits']} bits, granularity {p['granularity']:.3g}, "
                f"noise {p['noise_per_client']:.4g} per client for {p['min_survivors']} "
                f"survivors (z {p['noise_multiplier']:.4g}, {p['colluders']} colluder(s)), "
                f"shares scaled to the cohort (for max(n_min, (1 - f) n) survivors, f "
                f"{p['dropout_tolerance']:g}: mean {p['mean_noise_per_client']:.4g} per client, "
                f"mean released z {p['mean_released_noise_multiplier']:.4g}), q "
                f"{p['client_rate']:g}; rounding norm^2 <= {p['rounded_norm_bound_sq']}; "
                f"wrap-around <= {p['wrap_bound_per_round']:.1e} a round, {wrapped} round(s) "
                f"wrapped; {p['skipped_rounds']} round(s) skipped (fewer than "
                f"{p['min_survivors']} clients)")
    if p.get("privacy_unit") == "client":
        ac = p.get("adaptive_clipping")
        clip = (f"clip adaptive at the {ac['target_quantile']:g} quantile from "
                f"{p['l2_clip_norm']:g}" if ac else f"clip {p['l2_clip_norm']:g}")
        return f"client-level: {clip}, z {p['noise_multiplier']:.4g}, q {p['client_rate']:g}"
    return (f"record-level DP-SGD: clip {p['l2_clip_norm']:g}, z {p['noise_multiplier']:.4g}, "
            f"expected batch {p['expected_batch_size']}")


def _amount(p: dict[str, Any]) -> str:
    if p.get("privacy_unit") == "client" and "bands" in p:
        u = p["epsilon_unamplified"]
        against = ("no amplification, it holds against the server" if p["participation"]
                   != "poisson" else f"against the server, which knows the sample: "
                   f"{u['epsilon_whole_run']:.4g} for the whole run")
        return (f"eps {p['epsilon_max']:.4g} for every client (the population's; replace-one "
                f"{p['epsilon_replace_one']:.4g}; {against})")
    if p.get("aggregation") == "distributed":
        u = p["epsilon_unamplified"]
        k = u["expected_participations"]
        if p["released_rate"] >= 1:
            against = "every client in every round, no amplification: it holds against the " \
                      "server"
        else:
            against = (f"amplified at q' {p['released_rate']:.4g} against outsiders only; "
                       f"against the server, which knows the sample: "
                       f"{u['epsilon_at_expected']:.4g} for a client in {k} released "
                       f"round{'' if k == 1 else 's'} (the expected number), "
                       f"{u['epsilon_every_round']:.4g} in all {u['every_round']}")
        return (f"eps {p['epsilon_max']:.4g} for every client (the population's, zero-out; "
                f"replace-one {p['epsilon_replace_one']:.4g}; {against})")
    if p.get("privacy_unit") == "client":
        u = p["epsilon_unamplified"]
        k = u["expected_participations"]
        return (f"eps {p['epsilon_max']:.4g} for every client (the population's; replace-one "
                f"{p['epsilon_replace_one']:.4g}; against the server, which knows the sample, "
                f"no amplification: {u['epsilon_at_expected']:.4g} for a client in {k} "
                f"round{'' if k == 1 else 's'} (the expected number), "
                f"{u['epsilon_every_round']:.4g} in all {u['every_round']})")
    text = f"eps mean {p['epsilon_mean']:.4g}, max {p['epsilon_max']:.4g}"
    if "epsilon_replace_one_max" in p:
        text += f" (replace-one max {p['epsilon_replace_one_max']:.4g})"
    return text


def final_table(result: dict[str, Any]) -> str:
    """A short text table of each algorithm's last evaluation (and epsilon, if private): a
    private run shows its held-out metrics and says what its epsilon does not cover."""
    algs = result["algorithms"]
    private = any("privacy" in r for r in algs.values())
    cols, keys = (_PRIVATE_COLUMNS, _PRIVATE_METRICS) if private else (_COLUMNS, _METRICS)
    lines = text_table(cols, [
        (name, r["history"][-1]["iteration"], r["data_rounds"],
         *(r["history"][-1].get(k, float("nan")) for k in keys),
         r["history"][-1]["wall_time_s"], r["history"][-1]["client_compute_s"])
        for name, r in algs.items()])
    notes = []
    for name, r in algs.items():
        if "privacy" in r:
            p = r["privacy"]
            notes.append(f"{name}: {_amount(p)} at delta={p['delta']:g} [{p['method']}], "
                         f"{_privacy_detail(p)}{_mark(p)}"
                         + (f"\n  {p['stopped']}" if "stopped" in p else ""))
    if not notes:
        return "\n".join(lines)
    p0 = next(r["privacy"] for r in algs.values() if "privacy" in r)
    tail = ["", "privacy (upper bounds):", *notes]
    if p0.get("trust"):
        trust = str(p0["trust"])  # distributed DP's sentence names its own model
        tail.append(f"assumes {'' if trust.startswith('distributed') else 'a '}{trust}")
    tail.append("not covered by epsilon: " + "; ".join(
        f"{n['field']} ({n['reason'].split(':')[0]})" for n in p0.get("not_covered", [])))
    return "\n".join(lines + tail)


def _mark(p: dict[str, Any]) -> str:
    g = p.get("guarantee", "proven" if p.get("proven") else "not proven")
    return {"proven": "", "simulation": "  [seeded simulation]",
            "not proven": "  [NOT PROVEN]"}[g]
