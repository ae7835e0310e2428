"""What MAPA's uploads cost: their events, the budget stop, the ledger and the report section.

One upload of edge k is pure eps_k-DP (replace-one, sensitivity ``2 C_s / b``), or with
``amplification`` the Poisson-subsampled event under add/remove neighbours. Each edge's uploads
compose optimally on its ledger; the run stops before the first upload that would take any
edge over the budget, a stop computed from the schedule before anything is charged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import privkit
from fl_examples.core.asyncsim import Schedule
from fl_examples.core.run import open_ledger
from fl_examples.mapa.config import MapaConfig
from fl_examples.mapa.schedule import _mechanism
from privkit.accountants import rules
from privkit.accountants.amplification import (
    AMPLIFICATION_ASSUMPTION,
    PoissonSampledPureDpEvent,
    amplified_epsilon,
)
from privkit.events import DpEvent, SelfComposedDpEvent
from privkit.ledger import Ledger

__all__ = ["AMPLIFICATION_ASSUMPTION", "PoissonSampledPureDpEvent", "amplified_epsilon",
           "privacy_section"]

def _upload_event(cfg: MapaConfig, eps: float, dim: int) -> DpEvent:
    """The event of one upload at eps (independent of the clip: the noise scales with it)."""
    return _mechanism(1.0, cfg.batch, eps, cfg.noise).event(dim)


def _sampling_probabilities(cfg: MapaConfig, sizes: np.ndarray) -> np.ndarray:
    """q_k = b / n_k of the Poisson sampler (1 for ``distinct``: every upload sees the edge)."""
    if cfg.batch_sampler != "poisson":
        return np.ones(len(sizes))
    return np.array([cfg.batch / int(n) for n in sizes], dtype=np.float64)


def _edge_events(cfg: MapaConfig, dim: int, sizes: np.ndarray) -> tuple[list[DpEvent],
                                                                        list[DpEvent]]:
    """(charged event, unamplified event) of one upload, per edge."""
    eps, q = cfg.epsilons(), _sampling_probabilities(cfg, sizes)
    base = [_upload_event(cfg, float(e), dim) for e in eps.tolist()]
    if not cfg.amplification:
        return base, base
    return [PoissonSampledPureDpEvent(float(qk), ev) for qk, ev in zip(q.tolist(), base)], base


def _relation(cfg: MapaConfig) -> str:
    """The ledger's neighbouring relation (add/remove when amplified, else replace-one)."""
    return "ADD_OR_REMOVE_ONE" if cfg.amplification else "REPLACE_ONE"


def _price(event: DpEvent, n: int, delta: float, relation: str) -> float:
    """Optimal-composition epsilon of n uses of ``event`` (what the ledger replays)."""
    rel = getattr(rules.NeighboringRelation, relation)
    return privkit.epsilon(SelfComposedDpEvent(event, n), delta, "optimal",
                           neighboring_relation=rel).epsilon


def _max_uploads(event: DpEvent, delta: float, budget: float, relation: str = "REPLACE_ONE"
                 ) -> int:
    """The most uploads of ``event`` whose optimal composition stays <= budget at delta."""
    def eps(n: int) -> float:
        return _price(event, n, delta, relation)

    if eps(1) > budget:
        return 0
    lo, hi = 1, 2
    while eps(hi) <= budget:
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eps(mid) <= budget else (lo, mid)
    return lo


def _budget_stop(cfg: MapaConfig, schedule: Schedule, events: list[DpEvent]
                 ) -> tuple[int, str | None]:
    """(number of cloud events to run, stop message or None), before anything is charged."""
    n = schedule.num_events
    if cfg.epsilon_budget is None:
        return n, None
    cap = {ev: _max_uploads(ev, cfg.delta, cfg.epsilon_budget, _relation(cfg))
           for ev in dict.fromkeys(events)}
    limit = np.array([cap[ev] for ev in events])
    over = np.flatnonzero(schedule.upload >= limit[schedule.edge])
    if over.size == 0:
        return n, None
    j = int(over[0])
    k = int(schedule.edge[j])
    return j, (f"stopped before upload {int(schedule.upload[j]) + 1} of edge {k} (cloud event "
               f"{j + 1}, {int(schedule.applied[:j].sum())} updates applied): its epsilon at "
               f"delta={cfg.delta:g} would exceed the budget {cfg.epsilon_budget:g}")


def _population(cfg: MapaConfig, algorithm: str) -> str:
    return f"{cfg.dataset}|edges={cfg.edges}|seed={cfg.seed}|{algorithm}"


def _open_ledger(cfg: MapaConfig, algorithm: str, out: Path | None,
                 resume: bool = False) -> Ledger:
    """A new ledger (in memory without ``out``), or with ``resume`` the run's existing one
    (which must hold these settings: population, delta, budget, method and relation)."""
    return open_ledger(out, algorithm, population_id=_population(cfg, algorithm),
                       delta=cfg.delta, resume=resume, check_settings=True,
                       epsilon_budget=cfg.epsilon_budget, method="optimal",
                       neighboring_relation=_relation(cfg))


def privacy_section(run: Any, uploads: np.ndarray) -> dict[str, Any]:
    """The ``privacy`` section of a private run's report entry (``run``: a MAPA run)."""
    assert run.ledger is not None
    cfg = run.cfg
    ids = [str(k) for k in range(cfg.edges)]
    eps_map = run.ledger.epsilons(ids)
    per_edge = np.array([eps_map[i] for i in ids])
    charged = np.array([int(sum(n for _, n in run.ledger.composition(i).atoms))
                        for i in ids])
    if not np.array_equal(charged, uploads):  # each upload charged exactly once
        raise RuntimeError("ledger charges differ from the uploads made")
    basic = uploads * run.eps
    poisson = cfg.batch_sampler == "poisson"
    if poisson:
        sampling = (f"Poisson: each record of edge k independently with probability "
                    f"q_k = b / n_k (q_k from {run.q.min():.4g} to {run.q.max():.4g}); the "
                    f"clipped sum is divided by b = {cfg.batch} (the batch size stays "
                    "hidden)")
    else:
        sampling = f"{cfg.batch} distinct records per upload (without replacement)"
    out: dict[str, Any] = {
        "delta": cfg.delta,
        "method": "optimal composition (pure-DP, per edge)",
        "neighbouring_relation": (
            "add/remove (the amplification bound's relation; the noise is calibrated to "
            "2 C_s / b, which bounds the add/remove sensitivity C_s / b)"
            if cfg.amplification else "replace-one (sensitivity 2 C_s / b)"),
        "epsilon_mean": float(per_edge.mean()), "epsilon_max": float(per_edge.max()),
        "per_edge": per_edge.tolist(),
        "epsilon_basic_mean": float(basic.mean()), "epsilon_basic_max": float(basic.max()),
        "per_update_epsilon_paper": {"min": float(run.eps.min()),
                                     "max": float(run.eps.max()),
                                     "statement": "each update t is eps_k(t)-DP (the "
                                                  "paper's claim, no composition)"},
        "uploads_per_edge": uploads.tolist(),
        "uploads_min": int(uploads.min()), "uploads_mean": float(uploads.mean()),
        "uploads_max": int(uploads.max()),
        "noise": {"l2": "L2-norm Laplace, density ~ exp(-eps ||eta|| / DeltaS)",
                  "l1": "i.i.d. Laplace(sqrt(d) DeltaS / eps) per coordinate"}[cfg.noise],
        "clipping": "per-example L2 clip C_s = b DeltaS_s / 2 (always)",
        "batch_sampling": sampling,
        "amplified": cfg.amplification,
        "amplification": (
            AMPLIFICATION_ASSUMPTION + ": each upload priced as eps' = log(1 + q_k "
            "(e^eps_k - 1)) (Balle, Barthe & Gaboardi 2018, Thm 8), composed optimally"
            if cfg.amplification else
            "none (" + ("--amplification not requested" if poisson else
                        "a fixed-size batch of distinct records") + "; each upload is "
            "charged its full eps_k)"),
        "proven": True,
    }
    if cfg.amplification:
        # the unamplified bound: n_k pure eps_k steps (valid under either relation)
        unamp = np.array([run._epsilon(run.base_events[k], int(n), "REPLACE_ONE")
                          if n else 0.0 for k, n in enumerate(uploads.tolist())])
        amp_step = np.array([ev.epsilon for ev in run.edge_events])
        out |= {
            "epsilon_assumption": AMPLIFICATION_ASSUMPTION,
            "epsilon_unamplified_mean": float(unamp.mean()),
            "epsilon_unamplified_max": float(unamp.max()),
            "per_edge_unamplified": unamp.tolist(),
            "per_upload_epsilon_amplified": {"min": float(amp_step.min()),
                                             "max": float(amp_step.max())},
            "sampling_probability": {"min": float(run.q.min()),
                                     "max": float(run.q.max())},
        }
    if cfg.variance == "paper":
        out["variance_note"] = ("Delta_0 = 2 DeltaS^2/eps^2 (paper) understates the noise's "
                                "E||eta||^2 by " + ("d(d+1)/2" if cfg.noise == "l2"
                                                    else "d^2") + " (step sizes only; the "
                                "privacy guarantee is unaffected)")
    if run.stopped and run.events_done == run.end and run.end < run.sched.num_events:
        out["stopped"] = run.stopped
    return out
