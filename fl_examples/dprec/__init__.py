"""DP-REC (private, compressed FedAvg through relative entropy coding) and a DP-FedAvg baseline.

DP-REC (Triastcyn, Reisser & Louizos, arXiv 2111.05454, Algorithms 3-6): each round the server
makes ``clients_per_round`` independent uniform draws *with replacement* from the N clients.
Each drawn client trains locally from the global model, clips its update to ``l2_clip``, and
sends it through REC (:func:`privkit.mechanisms.rec.encode`: a fresh 128-bit seed plus one
``bits``-bit index per group). The server decodes every message and averages them
(FedAvg server step with ``server_lr``). No noise is added: the REC selection is the noise.

DP-FedAvg (McMahan et al. 2018, central DP): each round samples ``clients_per_round`` distinct
clients, clips each update to ``l2_clip``, and adds N(0, (2 C z)^2 I) to the *sum*
(replace-one sensitivity 2C), divided by the number of clients. Its noise multiplier z is
calibrated so that after ``rounds`` rounds its (replace-one, amplified) epsilon equals DP-REC's
central epsilon (:func:`calibrate_dpfedavg`).

Privacy: every client's *local* guarantee (its own messages composed, no amplification) is
charged on a per-algorithm :class:`privkit.ledger.Ledger` (``OUT/ledger-<alg>.jsonl``,
replace-one) before any message is encoded; the *central* guarantee (amplified by secret
sampling) is priced each round with :mod:`privkit.accountants.rec` (DP-REC: T |S'|
with-replacement draws at rate 1/N, Wang-Balle-Kasiviswanathan) or dp-accounting's RDP of
sampling without replacement (DP-FedAvg), and the run stops before a round that would take it
over ``epsilon_budget``.

Communication: DP-REC uplink is ``128 + M * bits`` per message; downlink is the float32 model
(``32 d`` bits) per participating client per round, or, with ``history_compression``, the
(seed, indices) messages of every round since that client last participated when that is
shorter (plus one flag bit; a first-time client also gets a 128-bit initialisation seed);
clients replay the server's deterministic FedAvg step. DP-FedAvg sends ``32 d`` bits each way.

Checkpoints (``checkpoint_every``): ``OUT/checkpoints/<alg>/`` holds the model, the server
state (seen seeds, downlink bookkeeping), bit counters, history and the ledger pointer; every
random stream of a round comes from the seed tree by round, so no generator state is needed.
``resume=True`` reopens the ledgers and continues from the latest checkpoint; charges of rounds
that were charged but not checkpointed (a crash after the write-ahead charge) are recognised
and adopted, never made twice, so the finished run equals an uninterrupted one bitwise except
for the wall-clock fields ``wall_time_s`` and ``client_compute_s``. An older checkpoint or an
older ledger than the other is refused (:meth:`fl_examples.dprec.run._Run.adopt`).

The package: :mod:`~fl_examples.dprec.config` (settings, data, model),
:mod:`~fl_examples.dprec.accounting` (central epsilons and DP-FedAvg's calibration) and
:mod:`~fl_examples.dprec.run` (one algorithm's run on the trainer skeleton); :func:`train` runs
DP-REC and its baseline and writes the report.

Run it as ``privkit train dprec --dataset digits --clients 100 --clients-per-round 10
--bits 8 --groups per-layer --l2-clip 0.5 --stddev 1.0 --rounds 200 --compare dpfedavg
--out DIR`` (add ``--checkpoint-every N``, and ``--resume`` after a crash).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fl_examples.core.report import Column, text_table, write_report
from fl_examples.dprec.accounting import (
    calibrate_dpfedavg,
    dpfedavg_central_epsilon,
    dprec_central_epsilon,
)
from fl_examples.dprec.config import ALGORITHMS, DPRecConfig, load_dataset
from fl_examples.dprec.run import run_algorithm
from privkit.errors import InvalidParameterError

__all__ = ["ALGORITHMS", "DPRecConfig", "train", "run_algorithm", "calibrate_dpfedavg",
           "dprec_central_epsilon", "dpfedavg_central_epsilon", "final_table", "load_dataset"]


def train(cfg: DPRecConfig, *, compare: tuple[str, ...] = ("dpfedavg",),
          out: str | Path | None = None, resume: bool = False) -> dict[str, Any]:
    """Run DP-REC and the ``compare`` baselines (DP-FedAvg at DP-REC's epsilon); write a report.

    ``resume=True`` continues each algorithm from its latest checkpoint in ``out`` (see
    :func:`run_algorithm`); the finished report equals that of an uninterrupted run except
    for the wall-clock fields ``wall_time_s`` and ``client_compute_s``.
    """
    for name in compare:
        if name not in ALGORITHMS:
            raise InvalidParameterError("compare", name, "dpfedavg")
    if resume and out is None:
        raise InvalidParameterError("resume", True, "used with an output directory")
    ds = load_dataset(cfg)
    out_path = Path(out) if out is not None else None
    results: dict[str, Any] = {"dprec": run_algorithm("dprec", cfg, ds, out=out_path,
                                                      resume=resume)}
    calibration: dict[str, Any] = {}
    if "dpfedavg" in compare:
        if cfg.dpfedavg_noise is not None:
            z = cfg.dpfedavg_noise
        else:
            eps_target = dprec_central_epsilon(cfg, ds.num_clients, cfg.rounds,
                                               results["dprec"]["privacy"]["num_groups"])
            z = calibrate_dpfedavg(eps_target, cfg, ds.num_clients)
            calibration = {"target_epsilon": eps_target, "noise_multiplier": z,
                           "planned_epsilon": dpfedavg_central_epsilon(z, cfg, ds.num_clients,
                                                                       cfg.rounds)}
        results["dpfedavg"] = run_algorithm("dpfedavg", cfg, ds, z=z, out=out_path,
                                            resume=resume)
        if calibration:
            results["dpfedavg"]["privacy"]["calibrated"] = calibration
    config = dataclasses.asdict(cfg) | {"compare": list(compare),
                                        "dataset_description": ds.description,
                                        "num_clients": ds.num_clients}
    if out_path is not None:
        write_report(out_path, config, results)
        _plot_vs_epsilon(out_path, results)
    return {"config": config, "algorithms": results}


def _plot_vs_epsilon(out: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for name, r in results.items():
        h = r["history"]
        ax.plot([x["epsilon"] for x in h], [x["test_accuracy"] for x in h], label=name)
    ax.set_xlabel("central epsilon (cumulative)")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves_vs_epsilon.png", dpi=110)
    plt.close(fig)


_COLUMNS = (Column("algorithm", 9), Column("rounds", 6), Column("test acc", 8, ".4f"),
            Column("uplink bits", 12, ".4g"), Column("downlink bits", 13, ".4g"),
            Column("eps central", 11, ".4g"), Column("eps local max", 13, ".4g"))


def final_table(result: dict[str, Any]) -> str:
    """Last evaluation, bits and epsilons of each algorithm."""
    algs = result["algorithms"]
    lines = text_table(_COLUMNS, [
        (name, r["history"][-1]["iteration"], r["history"][-1]["test_accuracy"],
         r["communication"]["uplink_bits"], r["communication"]["downlink_bits"],
         r["privacy"]["epsilon_central"], r["privacy"]["epsilon_max"])
        for name, r in algs.items()])
    if "dpfedavg" in algs:
        ratio = algs["dpfedavg"]["communication"]["uplink_bits"] / max(
            algs["dprec"]["communication"]["uplink_bits"], 1)
        gap = (algs["dpfedavg"]["history"][-1]["test_accuracy"]
               - algs["dprec"]["history"][-1]["test_accuracy"])
        lines.append(f"\nuplink compression vs float32 DP-FedAvg: {ratio:.0f}x; accuracy gap "
                     f"(DP-FedAvg - DP-REC) {gap:+.4f}")
    delta = result["config"]["delta"]
    lines.append(f"(epsilons at delta={delta:g}, replace-one; central = amplified by secret "
                 "sampling, local = no amplification)")
    return "\n".join(lines)
