"""MAPA, AUDP and ASGD: asynchronous FL with per-upload pure-DP gradient noise.

Li, Yang, Ren, Zhao, *Asynchronous Federated Learning with Differential Privacy for Edge
Intelligence* (arXiv 1912.07902), rebuilt as spec ``mapa.md`` describes:

- **Simulator** (:mod:`fl_examples.core.asyncsim`): K edges with heterogeneous speeds, a FIFO
  buffer at the cloud, a simulated clock, staleness recorded per applied update, optional
  ``tau_max`` (staler uploads are dropped, already charged).
- **Edge step**: b *distinct* records of the edge's data (sampling without replacement: a record
  drawn twice would double the sensitivity), per-example gradients clipped to ``C_s``, averaged,
  plus privkit's :class:`~privkit.mechanisms.LaplaceGradientNoise` noise (L2-norm Laplace by
  default, per-coordinate L1 Laplace as an option) at the edge's epsilon_k with sensitivity
  ``DeltaS = 2 C_s / b``. One upload is pure epsilon_k-DP.
- **ASGD** (no privacy): ``gamma_t = 1 / (L (tau+1)^2 + sigma sqrt(t+1) / (R sqrt(b)))`` in the
  paper; by default (``step_schedule="auto"``) a constant ``lr``, with which it learns (the
  paper's step falls as 1/(tau+1)^2).
- **AUDP**: a fixed clip G (``DeltaS = 2G/b``) and
  ``gamma_t = 1 / (2 L (tau+1) + sqrt(Delta_b t))``.
- **MAPA**: Thm 3's first ``DeltaS = 2 sigma / (b sqrt(1 - sqrt(1 - delta)))`` (delta:
  ``theorem3_delta``, the paper's 1e-3 by default; a schedule constant, apart from the
  ``delta`` every epsilon is reported at, 1e-5 by default); per stage
  ``P = max{1, 8 Delta_b / (theta^2 b^2 DeltaS^2 (tau+1))}``, ``gamma = 1/(2 L P (tau+1))``,
  ``T_s = ceil(4 L P^2 (tau+1)^2 R / Delta_b)``; then ``DeltaS <- theta DeltaS``,
  ``C_s = b DeltaS / 2``. ``Delta_b = sigma^2/b + Delta_0``, where ``Delta_0`` is the true
  ``E||eta||^2`` of the chosen noise (``variance="sound"``, default) or the paper's 1-D Laplace
  value ``2 DeltaS^2 / eps_0^2`` (``variance="paper"``; it understates the L2 noise by
  d(d+1)/2). Here tau is ``tau_max`` when set, else K - 1 (the mean staleness of K always-busy
  edges).

Each edge's uploads are charged on a privkit :class:`~privkit.ledger.Ledger` (one pure-DP event
per upload, optimal composition, replace-one neighbours, no amplification) before their noise is
drawn; a budget stop ends the run before the first upload that would take any edge over
``epsilon_budget``. The authors' code adds non-DP noise at the cloud and applies one update
twice; neither happens here.

**Batch sampler and amplification.** ``batch_sampler="poisson"`` includes each of edge k's n_k
records independently with probability ``q_k = b / n_k`` and releases the clipped *sum* divided
by the fixed expected size b (so the batch size is never revealed by the denominator). The noise
is calibrated as before, to ``DeltaS = 2 C_s / b``: that is the replace-one sensitivity of
sum/b, and it bounds the add/remove sensitivity ``C_s / b``, so one upload is eps_k-DP under
either relation. ``amplification=True`` (Poisson only) prices each upload as
``eps' = log(1 + q_k (e^eps_k - 1))`` under add/remove neighbours (amplification by Poisson
subsampling: Li, Qardaji & Su, ASIACCS 2012; Balle, Barthe & Gaboardi, NeurIPS 2018, Thm 8),
composed optimally as pure steps; it assumes the sampler's outcome (which records entered which
batch) stays secret, and the report states that next to the amplified number and also gives
the unamplified one.

**Gaussian noise** (``noise="gaussian"``). Each upload is DP-SGD's release: a Poisson batch
(rate q_k = b / n_k), every example's gradient clipped to C (``clip`` for AUDP, MAPA's stage
clip C_s = theta^s ``clip``), summed, plus N(0, (z C)^2 I), divided by b. It is charged
``PoissonSampledDpEvent(q_k, GaussianDpEvent(z))`` under add/remove one record (the stage clip
changes C, never z, so every upload of an edge is the same event), and each edge's uploads
compose on privkit's PLD (method AUTO) at ``delta`` (default 1e-5); the epsilon assumes the
batches' membership stays secret. ``noise_for_epsilon`` calibrates z so that every edge ends
at most at that epsilon; ``noise_multiplier`` sets it. Both private algorithms then step with
the constant ``lr`` (``step_schedule="auto"``). MAPA's stages start at ``clip`` and their
lengths come from what a Gaussian upload's variance really is, ``min(sigma, C_s)^2 / b +
d (z C_s / b)^2``, and from the step the run takes (``T_s = ceil(R / (L lr^2 Delta_b))``;
:mod:`~fl_examples.mapa.schedule`). A MAPA run that ends inside its first stage says so (the
report's ``stage_note``, one line of the final table).

**Checkpoints.** With ``checkpoint_every = N`` and an output directory, the run's full state
(model, every edge's pulled model, in-flight gradients, ready flags, upload counters, DeltaS of
each pending job, history, ledger pointer) is saved after every N-th applied update and at the
end; ``resume=True`` continues from the latest checkpoint. Every random draw comes from a stream
keyed by (seed, edge, upload), so a resumed run is bitwise equal to an uninterrupted one. The
ledger is charged before noise is drawn, so a crash can leave charges after the checkpoint's
ledger pointer; on resume they are matched, spend call by spend call, against the charges the run
makes from the checkpoint up to its next checkpoint (same edges, upload numbers, events, model
version and cloud event) and adopted instead of charged twice. Anything else after the pointer
(spend a later checkpoint depends on) refuses the resume (``LedgerRollbackError``), and a ledger
that lacks the pointer's entry (an older ledger) is refused too (``LedgerMismatchError``).

The package: :mod:`~fl_examples.mapa.schedule` (the step-size and stage formulas),
:mod:`~fl_examples.mapa.config` (settings, data, model), :mod:`~fl_examples.mapa.privacy`
(events, budget stop, ledger, the report's privacy section), :mod:`~fl_examples.mapa.uploads`
(computing the noisy uploads), :mod:`~fl_examples.mapa.charges` (write-ahead charges and their
adoption on resume), :mod:`~fl_examples.mapa.run` (one algorithm's run on the trainer
skeleton) and :mod:`~fl_examples.mapa.report`; :func:`train` runs a comparison.

Run it as ``privkit train mapa --algorithms mapa,audp,asgd --clients 100 --upload-epsilon 1
--batch 24 --rounds 5000 --speed-dist lognormal:0,1 --out DIR``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from fl_examples.core.asyncsim import simulate
from fl_examples.core.canaries import check_fits, finish
from fl_examples.core.models import num_parameters
from fl_examples.core.release import check_heldout
from fl_examples.core.report import write_report
from fl_examples.core.run import ledger_path
from fl_examples.mapa.config import (
    ALGORITHMS,
    SAMPLERS,
    MapaConfig,
    _check_data,
    load_edges,
    make_model,
)
from fl_examples.mapa.privacy import (
    AMPLIFICATION_ASSUMPTION,
    GAUSSIAN_ASSUMPTION,
    PoissonSampledPureDpEvent,
    amplified_epsilon,
)
from fl_examples.mapa.report import (
    _comparison,
    _plot_extras,
    figure_settings,
    final_table,
    updates_to_loss,
)
from fl_examples.mapa.run import run_algorithm
from fl_examples.mapa.schedule import (
    MapaSchedule,
    Stage,
    asgd_step,
    audp_step,
    initial_sensitivity,
    noise_variance,
    step_rule,
)
from privkit.errors import InvalidParameterError

__all__ = [
    "ALGORITHMS", "SAMPLERS", "AMPLIFICATION_ASSUMPTION", "GAUSSIAN_ASSUMPTION", "MapaConfig",
    "Stage", "MapaSchedule", "PoissonSampledPureDpEvent", "amplified_epsilon",
    "initial_sensitivity", "noise_variance", "audp_step", "asgd_step", "step_rule",
    "load_edges", "make_model", "run_algorithm", "train", "updates_to_loss", "final_table",
]  # fmt: skip


def train(cfg: MapaConfig, *, algorithms: tuple[str, ...] = ALGORITHMS,
          out: str | Path | None = None, resume: bool = False) -> dict[str, Any]:
    """Run ``algorithms`` on one schedule and one data set (same seed); write the report.

    ``resume=True`` continues each algorithm from its latest checkpoint in ``out`` (see
    :func:`run_algorithm`). The report's only wall-clock fields are ``wall_time_s`` and
    ``client_compute_s`` (history rows, ``config.simulator.wall_time_s``); everything else is
    the same bitwise for a resumed run and an uninterrupted one.
    """
    if not algorithms:
        raise InvalidParameterError("algorithms", algorithms, "at least one algorithm")
    for name in algorithms:
        if name not in ALGORITHMS:
            raise InvalidParameterError("algorithms", name, f"among {', '.join(ALGORITHMS)}")
    private = [a for a in algorithms if a != "asgd"]
    for flag in ("secure_noise", "eval_client_data", "audit_canaries"):
        if getattr(cfg, flag) and not private:
            raise InvalidParameterError(flag, getattr(cfg, flag), "given only when a private "
                                        "algorithm (mapa, audp) runs")
    ds = load_edges(cfg.dataset, edges=cfg.edges, seed=cfg.seed)
    check_heldout(bool(private), ds.has_heldout, cfg.eval_client_data, cfg.dataset)
    _check_data(cfg, ds)
    model = make_model(cfg.model, ds)  # model/data mismatches fail before any ledger exists
    if cfg.audit_canaries:  # M canaries need M coordinates
        check_fits(cfg.audit_canaries, num_parameters(model))
    out_path = Path(out) if out is not None else None
    if out_path is not None and not resume:
        for name in algorithms:
            if name != "asgd" and ledger_path(out_path, name).exists():
                raise InvalidParameterError("out", str(out_path), f"a directory without "
                                            f"ledger-{name}.jsonl (use a new --out, or "
                                            "--resume)")
    t0 = time.perf_counter()
    schedule = simulate(cfg.edges, cfg.updates, cfg.timing(), seed=cfg.seed, tau_max=cfg.tau_max)
    sim_s = time.perf_counter() - t0
    results: dict[str, Any] = {}
    audit: dict[str, Any] | None = None
    for name in dict.fromkeys(algorithms):  # --audit-canaries: the first private algorithm
        results[name] = run_algorithm(name, cfg, out=out_path, dataset=ds, schedule=schedule,
                                      resume=resume, audit=name == next(iter(private), None))
        if "_canaries" in results[name]:
            p, can = results[name]["privacy"], results[name]["_canaries"]
            audit = finish(can, algorithm=f"{name} (edge {p['canaries']['edge']})",
                           accounted_epsilon=p["per_edge"][p["canaries"]["edge"]],
                           delta=p["delta"], out=out_path)
    public = {n: {k: v for k, v in r.items() if not k.startswith("_")}
              for n, r in results.items()}
    config = dataclasses.asdict(cfg) | {
        "algorithms": list(dict.fromkeys(algorithms)),
        "dataset_description": ds.description, "num_parameters": num_parameters(model),
        "train_sizes": {"min": int(ds.train_sizes.min()), "max": int(ds.train_sizes.max()),
                        "total": int(ds.train_sizes.sum())},
        "simulator": {"method": schedule.method, "wall_time_s": sim_s,
                      "speeds": {"min": float(schedule.speeds.min()),
                                 "median": float(np.median(schedule.speeds)),
                                 "max": float(schedule.speeds.max())}},
    }
    if cfg.noise == "gaussian":  # the z each private algorithm used (given or calibrated)
        config["noise_multiplier"] = {n: r["privacy"]["noise_multiplier"]
                                      for n, r in public.items() if "privacy" in r}
    comparison = _comparison(cfg, public)
    sections: dict[str, Any] = {"comparison": comparison}
    if audit is not None:
        sections["audit"] = audit
    if out_path is not None:
        write_report(out_path, config, public, sections=sections,
                     settings=figure_settings(config))
        end = max(r["cloud_events"] for r in public.values())
        _plot_extras(out_path, schedule, end, public.get("mapa", {}).get("stages"),
                     config=config, algorithms=public)
    return {"config": config, "algorithms": results, **sections}
