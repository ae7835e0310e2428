"""What MAPA's uploads cost: their events, the budget stop, the ledger and the report section.

One upload of edge k is pure eps_k-DP (replace-one, sensitivity ``2 C_s / b``), or with
``amplification`` the Poisson-subsampled event under add/remove neighbours, or with the
Gaussian noise DP-SGD's ``PoissonSampledDpEvent(b / n_k, GaussianDpEvent(z))`` (add/remove one
record, composed on privkit's PLD; z given or calibrated by :func:`gaussian_noise_multiplier`).
Each edge's uploads compose on its ledger; the run stops before the first upload that would take any
edge over the budget, a stop computed from the schedule before anything is charged.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

import privkit
from fl_examples.core.asyncsim import Schedule
from fl_examples.core.dp_modes import replace_one_epsilons
from fl_examples.core.dpsgd import DpSgdSettings, round_event
from fl_examples.core.run import open_ledger
from fl_examples.core.status import status
from fl_examples.mapa.config import MapaConfig
from fl_examples.mapa.schedule import _mechanism
from privkit.accountants import rules
from privkit.accountants.amplification import (
    AMPLIFICATION_ASSUMPTION,
    PoissonSampledPureDpEvent,
    amplified_epsilon,
)
from privkit.errors import NumericalError
from privkit.events import NOISE_MULTIPLIER_NOTE, DpEvent, SelfComposedDpEvent
from privkit.ledger import Ledger

__all__ = ["AMPLIFICATION_ASSUMPTION", "GAUSSIAN_ASSUMPTION", "PoissonSampledPureDpEvent",
           "amplified_epsilon", "gaussian_noise_multiplier", "privacy_section"]

GAUSSIAN_ASSUMPTION = "Poisson-sampled minibatches whose outcome stays secret"
"""What the Gaussian mode's epsilon assumes (its events are Poisson-subsampled)."""


def _upload_event(cfg: MapaConfig, eps: float, dim: int) -> DpEvent:
    """The event of one upload at eps (independent of the clip: the noise scales with it)."""
    return _mechanism(1.0, cfg.batch, eps, cfg.noise).event(dim)


def _gaussian_event(batch: int, size: int, z: float) -> DpEvent:
    """One Gaussian-mode upload of an edge with ``size`` records: DP-SGD's step event
    ``PoissonSampledDpEvent(b / size, GaussianDpEvent(z))`` (the clip does not enter it)."""
    return round_event(int(size), 1, DpSgdSettings(1.0, z, batch)).event


def _sampling_probabilities(cfg: MapaConfig, sizes: np.ndarray) -> np.ndarray:
    """q_k = b / n_k of the Poisson sampler (1 for ``distinct``: every upload sees the edge)."""
    if cfg.batch_sampler != "poisson":
        return np.ones(len(sizes))
    return np.array([cfg.batch / int(n) for n in sizes], dtype=np.float64)


def _edge_events(cfg: MapaConfig, dim: int, sizes: np.ndarray, z: float | None = None
                 ) -> tuple[list[DpEvent], list[DpEvent]]:
    """(charged event, unamplified event) of one upload, per edge (``z``: the Gaussian
    mode's noise multiplier)."""
    if cfg.noise == "gaussian":
        assert z is not None
        events = [_gaussian_event(cfg.batch, int(n), z) for n in sizes.tolist()]
        return events, events
    eps, q = cfg.epsilons(), _sampling_probabilities(cfg, sizes)
    base = [_upload_event(cfg, float(e), dim) for e in eps.tolist()]
    if not cfg.amplification:
        return base, base
    # The amplified step's inner guarantee is the upload's replace-one epsilon (its event
    # states it: L2LaplaceDpEvent(eps), or for L1 noise LaplaceDpEvent(2 / eps), whose
    # add/remove reading 1 / z would assume a fixed divisor; PureDpEvent(eps) says eps).
    inner = [ev if isinstance(ev, privkit.L2LaplaceDpEvent) else privkit.PureDpEvent(float(e))
             for ev, e in zip(base, eps.tolist())]
    return [PoissonSampledPureDpEvent(float(qk), ev) for qk, ev in zip(q.tolist(), inner)], base


def _relation(cfg: MapaConfig) -> str:
    """The ledger's neighbouring relation (add/remove when amplified or Gaussian, else
    replace-one)."""
    return "ADD_OR_REMOVE_ONE" if cfg.amplification or cfg.noise == "gaussian" \
        else "REPLACE_ONE"


def _method(cfg: MapaConfig) -> str:
    """The ledger's accountant: optimal composition of pure steps, or privkit's AUTO (its
    PLD) for the Gaussian mode's subsampled Gaussians."""
    return "auto" if cfg.noise == "gaussian" else "optimal"


def _price(event: DpEvent, n: int, delta: float, relation: str, method: str = "optimal"
           ) -> float:
    """Epsilon of n uses of ``event`` under ``method`` (what the ledger replays)."""
    rel = getattr(rules.NeighboringRelation, relation)
    return privkit.epsilon(SelfComposedDpEvent(event, n), delta, method,
                           neighboring_relation=rel).epsilon


def _max_uploads(event: DpEvent, delta: float, budget: float, relation: str = "REPLACE_ONE",
                 method: str = "optimal") -> int:
    """The most uploads of ``event`` whose composition stays <= budget at delta."""
    def eps(n: int) -> float:
        return _price(event, n, delta, relation, method)

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
    cap = {ev: _max_uploads(ev, cfg.delta, cfg.epsilon_budget, _relation(cfg), _method(cfg))
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


DEFAULT_NOISE_MULTIPLIER = 1.0
"""z of the Gaussian mode when neither ``noise_multiplier`` nor ``noise_for_epsilon`` is set."""


def gaussian_noise_multiplier(cfg: MapaConfig, schedule: Schedule, sizes: np.ndarray
                              ) -> tuple[float, dict[str, Any] | None]:
    """(z, calibration record or None) of the Gaussian mode.

    With ``noise_for_epsilon`` = E, z is the smallest noise multiplier (to privkit's
    calibration precision, on the safe side) with which every edge's whole-run epsilon at
    ``delta`` is <= E, for the uploads the schedule makes (all of them: applied or dropped,
    each is released). Only edges that no other edge dominates (as many uploads or more and a
    sampling rate as high or higher) can bind, so z is the largest of theirs.
    """
    if cfg.noise_for_epsilon is None:
        z = DEFAULT_NOISE_MULTIPLIER if cfg.noise_multiplier is None else cfg.noise_multiplier
        return float(z), None
    counts = schedule.uploads_per_edge(schedule.num_events)
    with status(f"calibrating z to epsilon {cfg.noise_for_epsilon:g} (delta {cfg.delta:g}, "
                f"max over {len(counts)} edges, up to {int(counts.max(initial=0))} uploads "
                "each)") as line:
        z, planned = _calibrate(tuple(int(c) for c in counts.tolist()),
                                tuple(int(n) for n in sizes.tolist()),
                                float(cfg.noise_for_epsilon), float(cfg.delta), int(cfg.batch))
        line.done(f"z = {z:.4g} (planned epsilon {planned:.4g})")
    return z, {"parameter": "noise_multiplier", "value": z,
               "target_epsilon": cfg.noise_for_epsilon, "statistic": "max",
               "planned_epsilon_max": planned,
               "planned_uploads_max": int(counts.max()) if counts.size else 0}


@functools.lru_cache(maxsize=16)
def _calibrate(counts: tuple[int, ...], sizes: tuple[int, ...], target: float, delta: float,
               batch: int) -> tuple[float, float]:
    """(z, the largest planned edge epsilon at z) for :func:`gaussian_noise_multiplier`."""
    pairs = {(c, batch / n, n) for c, n in zip(counts, sizes) if c > 0}
    if not pairs:
        return DEFAULT_NOISE_MULTIPLIER, 0.0
    binding = [(c, n) for c, q, n in pairs
               if not any(c2 >= c and q2 >= q and (c2, q2) != (c, q) for c2, q2, _ in pairs)]

    def priced(z: float) -> float:
        return max(_price(_gaussian_event(batch, n, z), c, delta, "ADD_OR_REMOVE_ONE", "auto")
                   for c, n in binding)

    z = max(privkit.calibrate_noise(
        lambda x, c=c, n=n: SelfComposedDpEvent(_gaussian_event(batch, n, x), c),
        target_epsilon=target, delta=delta)[0] for c, n in binding)
    for _ in range(200):  # the ledger's replay is the authority: nudge z up until it agrees
        eps = priced(z)
        if eps <= target:
            return z, eps
        z *= 1.0 + 1e-4
    raise NumericalError(f"no noise multiplier near {z:g} meets epsilon {target:g}")


def _population(cfg: MapaConfig, algorithm: str) -> str:
    return f"{cfg.dataset}|edges={cfg.edges}|seed={cfg.seed}|{algorithm}"


def _open_ledger(cfg: MapaConfig, algorithm: str, out: Path | None,
                 resume: bool = False) -> Ledger:
    """A new ledger (in memory without ``out``), or with ``resume`` the run's existing one
    (which must hold these settings: population, delta, budget, method and relation)."""
    return open_ledger(out, algorithm, population_id=_population(cfg, algorithm),
                       delta=cfg.delta, resume=resume, check_settings=True,
                       epsilon_budget=cfg.epsilon_budget, method=_method(cfg),
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
    # each upload charged exactly once (seeded); with secure noise a release replayed after
    # a crash is charged again, so the ledger may hold more
    if not (np.array_equal(charged, uploads) or (cfg.secure_noise
                                                 and bool((charged >= uploads).all()))):
        raise RuntimeError("ledger charges differ from the uploads made")
    if cfg.noise == "gaussian":
        return _gaussian_section(run, per_edge, uploads)
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


def _gaussian_section(run: Any, per_edge: np.ndarray, uploads: np.ndarray) -> dict[str, Any]:
    """The privacy section of a Gaussian-mode run (record-level DP-SGD per upload)."""
    cfg = run.cfg
    out: dict[str, Any] = {
        "delta": cfg.delta,
        "method": f"privkit PLD (AUTO), per edge, at delta={cfg.delta:g}",
        "neighbouring_relation": "add/remove one record of the edge",
        "epsilon_assumption": GAUSSIAN_ASSUMPTION,
        "epsilon_mean": float(per_edge.mean()), "epsilon_max": float(per_edge.max()),
        "per_edge": per_edge.tolist(),
        "uploads_per_edge": uploads.tolist(),
        "uploads_min": int(uploads.min()), "uploads_mean": float(uploads.mean()),
        "uploads_max": int(uploads.max()),
        "noise": (f"Gaussian N(0, (z C_s)^2 I) on the sum of clipped per-example gradients, "
                  f"divided by the expected batch size b = {cfg.batch}; z = {run.z:.6g}"),
        "noise_multiplier": run.z,
        "noise_multiplier_note": NOISE_MULTIPLIER_NOTE,
        "clipping": "per-example L2 clip C_s (AUDP: --audp-clip; MAPA: its stage clip "
                    "C_s = b DeltaS_s / 2)",
        "batch_sampling": (f"Poisson: each record of edge k independently with probability "
                           f"q_k = b / n_k (q_k from {run.q.min():.4g} to {run.q.max():.4g})"),
        "event_per_upload": "PoissonSampledDpEvent(q_k, GaussianDpEvent(z))",
        "sampling_probability": {"min": float(run.q.min()), "max": float(run.q.max())},
        "amplified": True,
        "amplification": GAUSSIAN_ASSUMPTION + ": each upload is a Poisson-subsampled "
                         "Gaussian, composed with privkit's PLD",
        "proven": True,
    }
    # the edges' record counts n_k are public (they set q_k): replace-one keeps them fixed
    ro = replace_one_epsilons(run.ledger, [str(k) for k in range(cfg.edges)], cfg.delta)
    out["epsilon_replace_one_mean"] = float(ro.mean())
    out["epsilon_replace_one_max"] = float(ro.max())
    if run.calibration is not None:
        out["calibrated"] = run.calibration
    if run.stopped and run.events_done == run.end and run.end < run.sched.num_events:
        out["stopped"] = run.stopped
    return out
