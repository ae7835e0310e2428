"""DP-REC (private, compressed FedAvg through relative entropy coding), DP-FedAvg and FedAvg.

DP-REC (Triastcyn, Reisser & Louizos, arXiv 2111.05454, Algorithms 3-6): each round the server
makes ``clients_per_round`` independent uniform draws *with replacement* from the N clients.
Each drawn client trains locally from the global model, clips its update to ``l2_clip``, and
sends it through REC (:func:`privkit.mechanisms.rec.encode`: a fresh 128-bit seed plus one
``bits``-bit index per group). The server decodes every message and averages them, then takes
its step (``server_lr``, ``server_momentum``). No noise is added: the REC selection is the
noise.

DP-FedAvg (McMahan et al. 2018, central client-level DP): each round every client joins
independently with probability q (``client_rate``, default ``clients_per_round / N``; the
outcome stays secret); :class:`privkit.ClientLevelGaussian` clips each sampled client's
update to ``l2_clip``, adds N(0, (z C)^2 I) once to the sum (also when nobody was sampled),
and the sum is divided by the fixed expected count q N, never the realised one
(:class:`~fl_examples.core.dp_modes.ClientDpPlan`). FedAvg (``fedavg`` in ``--algorithms``) is the
non-private reference: the same sampling and server step, no clipping, no noise.

Noise: with ``epsilon`` both DP-REC's sigma and DP-FedAvg's z are calibrated so that the run
ends at that central epsilon; otherwise DP-REC uses ``stddev`` and DP-FedAvg is calibrated to
DP-REC's central epsilon (``dpfedavg_noise`` fixes z either way).

Privacy and relations: DP-REC charges every drawn client's message on its ledger
(``OUT/ledger-dprec.jsonl``) before it is encoded (the *local* guarantee: its own messages
composed, no amplification); its *central* guarantee (amplified by secret sampling with
replacement: T |S'| draws at rate 1/N, Wang-Balle-Kasiviswanathan) is proven under
**replace-one** only, so DP-REC refuses ``relation="add-remove"``. DP-FedAvg charges one
release of the whole population per round (``OUT/ledger-dpfedavg.jsonl``, id ``population``,
event ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``) under **add-remove** one client by
default, or replace-one (sensitivity 2C: ``GaussianDpEvent(z / 2)``); it assumes
:data:`privkit.mechanisms.aggregate.TRUST_ASSUMPTION` (a trusted aggregator or secure
aggregation). Each ledger records its relation; a resume under another relation is refused.
A run stops before a round that would take its central epsilon over ``epsilon_budget``.

Communication: DP-REC uplink is ``128 + M * bits`` per message; downlink is the float32 server
state (``32 d`` bits, twice that with server momentum) per participating client per round, or,
with ``history_compression``, the (seed, indices) messages of every round since that client
last participated when that is shorter (plus one flag bit; a first-time client also gets a
128-bit initialisation seed); clients replay the server's deterministic step. DP-FedAvg and
FedAvg send ``32 d`` bits up per sampled client and the state down.

Checkpoints (``checkpoint_every``): ``OUT/checkpoints/<alg>/`` holds the model, the server
state (momentum buffer, seen seeds, downlink bookkeeping), bit counters, history and the
ledger pointer; every random stream of a round comes from the seed tree by round, so no
generator state is needed. ``resume=True`` reopens the ledgers and continues from the latest
checkpoint; charges of rounds that were charged but not checkpointed (a crash after the
write-ahead charge) are recognised and adopted, never made twice, so the finished run equals
an uninterrupted one bitwise except for the wall-clock fields ``wall_time_s`` and
``client_compute_s``. An older checkpoint or an older ledger than the other is refused
(:meth:`fl_examples.dprec.run._Run.adopt`).

The package: :mod:`~fl_examples.dprec.config` (settings, relations, data, model),
:mod:`~fl_examples.dprec.accounting` (central epsilons and the calibrations) and
:mod:`~fl_examples.dprec.run` (one algorithm's run on the trainer skeleton); :func:`train` runs
DP-REC and its baselines and writes the report.

Run it as ``privkit train dprec --noise-for-epsilon 8 --algorithms dprec,dpfedavg,fedavg
--out DIR`` (the defaults: digits over 100 clients; see ``docs/trainers/dprec.md`` for the
measured table and the paper-like settings); add ``--checkpoint-every N``, and ``--resume``
after a crash.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fl_examples.core.canaries import check_fits, finish
from fl_examples.core.epsilon_plot import plot_vs_epsilon
from fl_examples.core.models import num_parameters
from fl_examples.core.release import check_heldout
from fl_examples.core.report import Column, figure_text, legend_label, text_table, write_report
from fl_examples.core.status import status
from fl_examples.dprec.accounting import (
    calibrate_dpfedavg,
    calibrate_dprec,
    dpfedavg_central_epsilon,
    dprec_central_epsilon,
)
from fl_examples.dprec.config import (
    ALGORITHMS,
    RELATIONS,
    DPRecConfig,
    _model,
    check_relation,
    distributed_dpfedavg,
    load_dataset,
)
from fl_examples.dprec.run import num_groups, run_algorithm
from privkit.errors import InvalidParameterError
from privkit.mechanisms.aggregate import TRUST_ASSUMPTION

__all__ = ["ALGORITHMS", "RELATIONS", "DPRecConfig", "train", "run_algorithm",
           "calibrate_dpfedavg", "calibrate_dprec", "dprec_central_epsilon",
           "dpfedavg_central_epsilon", "final_table", "load_dataset"]


def train(cfg: DPRecConfig, *, compare: tuple[str, ...] = ("dpfedavg",),
          out: str | Path | None = None, resume: bool = False,
          algorithm: str = "dprec") -> dict[str, Any]:
    """Run ``algorithm`` (default DP-REC) and the ``compare`` baselines; write a report.

    Noise: with ``cfg.epsilon`` DP-REC's sigma and DP-FedAvg's z are both calibrated to it;
    else DP-REC uses ``cfg.stddev`` and DP-FedAvg is calibrated to DP-REC's planned central
    epsilon (``cfg.dpfedavg_noise`` fixes z). ``resume=True`` continues each algorithm from
    its latest checkpoint in ``out`` (see :func:`run_algorithm`); the finished report equals
    that of an uninterrupted run except for the wall-clock fields ``wall_time_s`` and
    ``client_compute_s``.

    Raises:
        InvalidParameterError: an unknown algorithm (naming ``compare`` or ``algorithm``), a
            relation DP-REC has no proof for (naming ``relation``), an unreachable epsilon.
    """
    if algorithm not in ALGORITHMS:
        raise InvalidParameterError("algorithm", algorithm, "dprec, dpfedavg or fedavg")
    for name in compare:
        if name not in ALGORITHMS:
            raise InvalidParameterError("compare", name, "dprec, dpfedavg or fedavg")
    names = list(dict.fromkeys((algorithm, *compare)))
    for name in names:
        check_relation(cfg, name)
    cfg = cfg.resolved(tuple(names))  # refuses settings of algorithms that do not run
    if resume and out is None:
        raise InvalidParameterError("resume", True, "used with an output directory")
    ds = load_dataset(cfg)
    cfg = cfg.for_clients(ds.num_clients)  # clients_per_round: min(30, N) unless given
    check_heldout(bool(set(names) & {"dprec", "dpfedavg"}), ds.has_heldout,
                  cfg.eval_client_data, cfg.dataset)
    n = ds.num_clients
    groups = num_groups(cfg, ds)
    if cfg.audit_canaries:  # M canaries need M coordinates, checked before any ledger exists
        check_fits(cfg.audit_canaries, num_parameters(_model(cfg, ds)))
    out_path = Path(out) if out is not None else None
    sigma, calibrated = cfg.stddev, {}
    if cfg.epsilon is not None and "dprec" in names:
        with status(f"calibrating DP-REC's noise to central epsilon {cfg.epsilon:g} (delta "
                    f"{cfg.delta:g}, {cfg.rounds} rounds)") as line:
            sigma = calibrate_dprec(cfg.epsilon, cfg, n, groups)
            line.done(f"stddev = {sigma:.4g}")
        calibrated["dprec"] = {
            "parameter": "stddev", "value": sigma, "target_epsilon": cfg.epsilon,
            "planned_epsilon": dprec_central_epsilon(cfg, n, cfg.rounds, groups, sigma)}
    plan = None
    if cfg.distributed and "dpfedavg" in names:  # no trusted aggregator: Skellam shares
        target = None if cfg.dpfedavg_noise is not None else (
            cfg.epsilon if cfg.epsilon is not None
            else dprec_central_epsilon(cfg, n, cfg.rounds, groups, sigma))
        what = (f"calibrating DP-FedAvg's noise shares to central epsilon {target:.4g} (delta "
                f"{cfg.delta:g}, {cfg.rounds} rounds)" if target is not None else
                "building DP-FedAvg's distributed DP")
        with status(what) as line:
            plan, cal = distributed_dpfedavg(cfg, ds, noise_multiplier=cfg.dpfedavg_noise,
                                             target=target)
            line.done(f"{plan.noise_per_client:.4g} per client for {plan.min_survivors} "
                      f"survivors, scaled to each cohort (for max(n_min, (1 - f) n) "
                      f"survivors, f {plan.dropout_tolerance:g}), {plan.bits} bits (z "
                      f"{plan.noise_multiplier:.4g})")
        if cal:
            calibrated["dpfedavg"] = cal["calibrated"] | {
                "target": "--noise-for-epsilon" if cfg.epsilon is not None
                else "DP-REC's central epsilon"}
    z = cfg.dpfedavg_noise if plan is None else plan.noise_multiplier
    if z is None and "dpfedavg" in names:
        target = (cfg.epsilon if cfg.epsilon is not None
                  else dprec_central_epsilon(cfg, n, cfg.rounds, groups, sigma))
        with status(f"calibrating DP-FedAvg's z to central epsilon {target:.4g} (delta "
                    f"{cfg.delta:g}, {cfg.rounds} rounds)") as line:
            z = calibrate_dpfedavg(target, cfg, n)
            line.done(f"z = {z:.4g}")
        calibrated["dpfedavg"] = {
            "parameter": "noise_multiplier", "value": z, "target_epsilon": target,
            "target": "--noise-for-epsilon" if cfg.epsilon is not None
            else "DP-REC's central epsilon",
            "planned_epsilon": dpfedavg_central_epsilon(z, cfg, n, cfg.rounds)}
    results: dict[str, Any] = {}
    audit: dict[str, Any] | None = None
    for name in names:
        results[name] = run_algorithm(name, cfg, ds, z=z if name == "dpfedavg" else None,
                                      stddev=sigma if name == "dprec" else None, out=out_path,
                                      resume=resume,
                                      distributed=plan if name == "dpfedavg" else None)
        if name in calibrated:
            results[name]["privacy"]["calibrated"] = calibrated[name]
        if "_canaries" in results[name]:
            p = results[name]["privacy"]
            audit = finish(results[name]["_canaries"], algorithm=name,
                           accounted_epsilon=p["epsilon_central"], delta=p["delta"],
                           out=out_path)
    config = dataclasses.asdict(cfg) | {"algorithm": algorithm, "compare": list(compare),
                                        "dataset_description": ds.description,
                                        "num_clients": n}
    # the values the run used (calibrated ones included)
    if "dprec" in names:
        config["stddev"] = sigma
    if "dpfedavg" in names:
        config["dpfedavg_noise"] = z
    sections = {"audit": audit} if audit is not None else None
    if out_path is not None:
        write_report(out_path, config, results, settings=_settings(config), sections=sections)
        _plot_vs_epsilon(out_path, results, config)
    return {"config": config, "algorithms": results, **(sections or {})}


def _settings(config: dict[str, Any]) -> str:
    """The key settings every figure's title names (after the data set and seed)."""
    c = config
    names = [c["algorithm"], *c.get("compare", [])]
    parts = [f"{c['num_clients']} clients, {c['clients_per_round']} per round",
             f"{c['rounds']} rounds", f"clip {c['l2_clip']:g}"]
    if c.get("epsilon") is not None:
        parts.append(f"noise calibrated to central epsilon {c['epsilon']:g}")
    if "dprec" in names and c.get("stddev") is not None:
        parts.append(f"DP-REC sigma {c['stddev']:.3g}, {c['bits']} bits per group")
    if "dpfedavg" in names and c.get("dpfedavg_noise") is not None:
        parts.append(f"DP-FedAvg z {c['dpfedavg_noise']:.3g}")
    return ", ".join(parts)


def _plot_vs_epsilon(out: Path, results: dict[str, Any],
                     config: dict[str, Any] | None = None) -> None:
    """``curves_vs_epsilon.png``: each private algorithm's held-out accuracy against its
    central epsilon after each evaluated round (the history's ``epsilon``), FedAvg's final
    one as the non-private reference."""
    curves = {name: [(x["epsilon"], x) for x in r["history"] if x.get("epsilon") is not None]
              for name, r in results.items()}
    curves = {name: h for name, h in curves.items() if h}  # FedAvg has no epsilon
    if not curves:
        return
    fedavg = results.get("fedavg")
    refs = {"fedavg": fedavg["history"][-1]} if fedavg and fedavg["history"] else {}
    delta = next((r["privacy"].get("delta") for n, r in results.items() if n in curves), None)
    plot_vs_epsilon(out, curves, references=refs,
                    text=figure_text(config or {}, results, _settings(config)
                                     if config else None),
                    labels={n: legend_label(n, results[n]) for n in curves},
                    x_label="central ε after each evaluation, cumulative"
                            + (f" (δ = {delta:g})" if delta is not None else ""))


_COLUMNS = (Column("algorithm", 9), Column("rounds", 6), Column("heldout acc", 11),
            Column("uplink bits", 12), Column("downlink bits", 13), Column("eps central", 11),
            Column("eps local", 9), Column("relation", 11))


def _g(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"


def _accuracy(row: dict[str, Any]) -> str:
    acc = row.get("heldout_accuracy", row.get("test_accuracy"))
    return "-" if acc is None else f"{acc:.4f}"


def final_table(result: dict[str, Any]) -> str:
    """Last evaluation, bits, epsilons and relation of each algorithm (held-out accuracy:
    public data; a private algorithm's local epsilon at the expected participation)."""
    algs = result["algorithms"]
    rows = []
    for name, r in algs.items():
        p = r["privacy"]
        local = p.get("epsilon_local", p.get("epsilon_unamplified", {})).get(
            "epsilon_at_expected")
        rows.append((name, str(r["history"][-1]["iteration"]), _accuracy(r["history"][-1]),
                     _g(r["communication"]["uplink_bits"]),
                     _g(r["communication"]["downlink_bits"]), _g(p.get("epsilon_central")),
                     _g(local), p.get("relation", "-")))
    lines = text_table(_COLUMNS, rows)
    if "dpfedavg" in algs and "dprec" in algs:
        ratio = algs["dpfedavg"]["communication"]["uplink_bits"] / max(
            algs["dprec"]["communication"]["uplink_bits"], 1)
        a, b = (algs[k]["history"][-1].get("heldout_accuracy") for k in ("dpfedavg", "dprec"))
        gap = f"{a - b:+.4f}" if a is not None and b is not None else "-"
        lines.append(f"\nuplink compression vs float32 DP-FedAvg: {ratio:.0f}x; held-out "
                     f"accuracy gap (DP-FedAvg - DP-REC) {gap}")
    delta = result["config"]["delta"]
    lines.append(f"(epsilons at delta={delta:g}; neighbours differ in one whole client, under "
                 "the relation shown; central = amplified by secret sampling, local = no "
                 "amplification, against the server that knows the sample, for a client at "
                 "the expected participation)")
    if "dpfedavg" in algs:
        trust = algs["dpfedavg"]["privacy"].get("trust_assumption", TRUST_ASSUMPTION)
        lines.append(f"(DP-FedAvg assumes {'' if trust.startswith('distributed') else 'a '}"
                     f"{trust})")
    priv = [r["privacy"] for n, r in algs.items() if n != "fedavg"]
    if priv:
        p0 = priv[0]
        mark = {"simulation": "seeded simulation: the guarantee holds only against someone "
                "who does not know --seed", "proven": "noise and samples from the OS CSPRNG",
                "not proven": "NOT PROVEN"}[p0["guarantee"]]
        lines.append(f"({mark}; not covered by epsilon: " + "; ".join(
            n["field"] for n in p0["not_covered"]) + ")")
    if "fedavg" in algs:
        lines.append("(fedavg is the non-private reference: nothing it reports is covered)")
    return "\n".join(lines)
