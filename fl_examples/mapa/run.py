"""One MAPA / AUDP / ASGD run over a precomputed schedule: the trainer skeleton's protocol.

A step serves one cloud event of the schedule (:mod:`fl_examples.core.asyncsim`): an applied
upload updates the model with its step size (computing every pending upload first, if this
one is not ready: a flush), a dropped one (staler than ``tau_max``) is charged but changes
nothing; then the edge pulls the current model and starts its next upload. ``position`` counts
applied updates, so evaluations and checkpoints fall on the update grid, and a checkpoint is
named by the cloud events served.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_examples.core import checkpoint
from fl_examples.core.asyncsim import Schedule, simulate
from fl_examples.core.canaries import TrainerCanaries, canary_seed, privacy_notes
from fl_examples.core.data import FederatedDataset
from fl_examples.core.models import PerExampleModel, flatten, num_parameters
from fl_examples.core.release import Publication
from fl_examples.core.rounds import resolve_device
from fl_examples.core.run import TrainerRun, checkpoint_dir, drive
from fl_examples.mapa.charges import ChargesMixin, _Call
from fl_examples.mapa.config import ALGORITHMS, MapaConfig, _check_data, load_edges, make_model
from fl_examples.mapa.privacy import (
    _budget_stop,
    _edge_events,
    _open_ledger,
    _sampling_probabilities,
    gaussian_noise_multiplier,
)
from fl_examples.mapa.report import report_entry
from fl_examples.mapa.schedule import (
    MapaSchedule,
    asgd_step,
    audp_step,
    noise_variance,
    step_rule,
)
from fl_examples.mapa.uploads import _TAG_INIT, UploadsMixin, _Data, _evaluate, _pool
from privkit.errors import InvalidParameterError
from privkit.events import DpEvent
from privkit.ledger import Ledger

__all__ = ["run_algorithm"]

def _history_json(rows: list[dict[str, Any]], *, decode: bool = False) -> list[dict[str, Any]]:
    """History rows with non-finite floats as ``{"nonfinite": "nan"}`` (JSON has none), or back."""
    def enc(v: Any) -> Any:
        if decode and isinstance(v, dict) and set(v) == {"nonfinite"}:
            return float(v["nonfinite"])
        if not decode and isinstance(v, float) and not math.isfinite(v):
            return {"nonfinite": repr(v)}
        return v

    return [{k: enc(v) for k, v in row.items()} for row in rows]


def _config_json(cfg: MapaConfig) -> Any:
    """The configuration as a checkpoint stores it (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), allow_nan=False))


class _Run(UploadsMixin, ChargesMixin, TrainerRun):
    """One algorithm over a precomputed schedule (:class:`~fl_examples.core.run.TrainerRun`;
    see :mod:`fl_examples.mapa`): a step is one cloud event."""

    save_at_end = True  # the end of the run (or its budget stop) is always checkpointed
    keeps_earlier_spend = False  # without a checkpoint, foreign spend refuses the resume

    def __init__(self, algorithm: str, cfg: MapaConfig, model: PerExampleModel, data: _Data,
                 schedule: Schedule, ledger: Ledger | None, device: torch.device,
                 heldout: str | None = None, audit: bool = False) -> None:
        self.algorithm, self.cfg, self.model, self.data = algorithm, cfg, model, data
        self.sched, self.ledger, self.device = schedule, ledger, device
        self.private = algorithm != "asgd"
        self.pub = Publication(private=self.private, client_metrics=cfg.eval_client_data,
                               secure=cfg.secure_noise, seed=cfg.seed, heldout=heldout)
        self.loss_key = self.pub.loss_key
        self.dim = num_parameters(model)
        k = cfg.edges
        self.eps = cfg.epsilons()
        self.q = _sampling_probabilities(cfg, data.sizes)
        self.events = schedule.events_of_edge()
        # the Gaussian mode's noise multiplier z (given, or calibrated to the schedule)
        self.z, self.calibration = gaussian_noise_multiplier(cfg, schedule, data.sizes) \
            if cfg.noise == "gaussian" and self.private else (None, None)
        # per edge: the event each upload is charged, and its unamplified version
        self.edge_events, self.base_events = _edge_events(cfg, self.dim, data.sizes, self.z) \
            if self.private else ([], [])
        self.end, self.stopped = _budget_stop(cfg, schedule, self.edge_events) \
            if self.private else (schedule.num_events, None)
        tau = cfg.tau()
        self.step_rule = step_rule(cfg.step_schedule, algorithm, cfg.noise)
        self.mapa = MapaSchedule(
            sigma=cfg.sigma, batch=cfg.batch, delta=cfg.schedule_delta(),
            epsilon0=float(self.eps.min()),
            lipschitz=cfg.lipschitz, r0=cfg.r0, tau=tau, theta=cfg.theta, dim=self.dim,
            noise=cfg.noise, variance=cfg.variance, noise_multiplier=self._z_for_steps(),
            initial_clip=cfg.clip, step=cfg.stage_step()) if algorithm == "mapa" else None
        self.audp_clip = cfg.clip if cfg.noise == "gaussian" else cfg.audp_clip
        self.audp_delta_s = 2.0 * self.audp_clip / cfg.batch
        self.audp_delta_b = cfg.sigma**2 / cfg.batch + noise_variance(
            self.audp_delta_s, float(self.eps.min()), self.dim, batch=cfg.batch, noise=cfg.noise,
            variance=cfg.variance, noise_multiplier=self._z_for_steps())
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence(
            cfg.seed, spawn_key=(_TAG_INIT,)).generate_state(1, np.uint64)[0] >> 1))
        self.x = flatten(model.init(1, generator=gen))[0].to(device)
        self.pulled = self.x.repeat(k, 1)  # each edge's copy of the version it pulled
        self.grads = torch.zeros(k, self.dim, dtype=torch.float32, device=device)
        self.ready = np.zeros(k, dtype=bool)
        self.next_upload = np.zeros(k, dtype=np.int64)
        self.delta_s = np.full(k, self._delta_s_for(0))  # the DeltaS each pending job uses
        self.charged = np.zeros(k, dtype=np.int64)
        self.events_done = 0
        self.applied = 0
        self.history: list[dict[str, Any]] = []
        self.wall = self.compute = 0.0
        self.diverged: str | None = None
        self.flushes = 0
        self.precharged: deque[_Call] = deque()  # ledger charges adopted on resume
        self._json_cache: dict[DpEvent, str] = {}
        self._eps_cache: dict[tuple[DpEvent, int], float] = {}
        self._meta = {"noise": cfg.noise, "sampler": cfg.batch_sampler}
        if self.z is not None:
            self._meta["noise_multiplier"] = self.z
        # --audit-canaries (gaussian uploads): canary records of the edge with the most uploads
        self.canaries: TrainerCanaries | None = None
        self.audit_edge: int | None = None
        if audit and cfg.audit_canaries and self.private and self.z is not None:
            live = schedule.applied[:self.end].astype(bool)
            counts = np.bincount(schedule.edge[:self.end][live], minlength=k)
            e = self.audit_edge = int(np.argmax(counts))
            self.canaries = TrainerCanaries(
                cfg.audit_canaries, self.dim, seed=canary_seed(cfg.seed, algorithm),
                noise_multiplier=self.z, sampling_probability=float(self.q[e]),
                where=f"canary records of edge {e} (the edge with the most uploads, "
                      f"{int(counts[e])}), each in its Poisson batches with the edge's rate "
                      f"b / n = {float(self.q[e]):.4g}")

    def _z_for_steps(self) -> float | None:
        """z in the step-size formulas (ASGD never uses them with noise: any z will do)."""
        if self.cfg.noise != "gaussian":
            return None
        return self.z if self.z is not None else 1.0

    # -- per-update quantities ------------------------------------------------------------
    def _delta_s_for(self, version: int) -> float:
        """DeltaS sent with model ``version`` (the stage of the next update)."""
        if self.algorithm == "mapa":
            assert self.mapa is not None
            return self.mapa.for_update(version + 1).delta_s
        return self.audp_delta_s

    def step_size(self, t: int) -> float:
        """gamma of update t (1-based): ``lr`` (the constant rule) or the paper's formula."""
        cfg, tau = self.cfg, self.cfg.tau()
        if self.step_rule == "constant":
            return cfg.lr
        if self.algorithm == "mapa":
            assert self.mapa is not None
            return self.mapa.for_update(t).gamma
        if self.algorithm == "audp":
            return audp_step(t - 1, lipschitz=cfg.lipschitz, tau=tau, delta_b=self.audp_delta_b)
        return asgd_step(t - 1, lipschitz=cfg.lipschitz, tau=tau, sigma=cfg.asgd_sigma,
                         r0=cfg.r0, batch=cfg.batch)

    def _job_event(self, k: int, next_upload: np.ndarray | None = None) -> int:
        """Cloud event index of edge k's pending upload, or -1 if it is never made in this run."""
        ev = self.events[k]
        u = int((self.next_upload if next_upload is None else next_upload)[k])
        if u >= len(ev) or ev[u] >= self.end:
            return -1
        return int(ev[u])

    def _will_apply(self, k: int, next_upload: np.ndarray | None = None) -> bool:
        """Whether edge k's pending upload is applied in this run (so it must be computed)."""
        j = self._job_event(k, next_upload)
        return j >= 0 and bool(self.sched.applied[j])

    # -- the run protocol -----------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.applied

    def finished(self) -> bool:
        return self.diverged is not None or self.events_done >= self.end

    def remaining(self) -> int:
        return int(self.sched.applied[self.events_done:self.end].sum())

    def checkpoint_round(self) -> int:
        return self.events_done

    def begin(self) -> None:
        """The reference path (``batched=False``) computes every edge's first upload, on
        version 0, before the first cloud event."""
        if not self.cfg.batched and self.events_done == 0:
            start = time.perf_counter()
            for k in range(self.cfg.edges):
                if self._will_apply(k):
                    self._compute([k])
            self.wall += time.perf_counter() - start

    def step(self) -> bool:
        """Serve cloud event ``events_done``: apply the upload (flushing pending ones if it is
        not computed yet) or, if it is dropped, charge it; then the edge pulls the model."""
        start = time.perf_counter()
        j = self.events_done
        k = int(self.sched.edge[j])
        if self.sched.applied[j]:
            if not self.ready[k]:
                self._flush()
            t = int(self.sched.version[j])
            self.x.sub_(self.grads[k], alpha=self.step_size(t))
            self.applied = t
        else:
            self._charge([k])  # a dropped upload was still released
        self.events_done = j + 1
        self._pull(k)
        self.wall += time.perf_counter() - start
        return True

    def healthy(self) -> bool:
        """False once the model is not finite (recorded in the report as ``diverged``)."""
        if self.diverged is None and not bool(torch.isfinite(self.x).all()):
            self.diverged = f"non-finite model after update {self.applied}"
        return self.diverged is None

    def finish(self) -> None:
        if self.precharged:
            raise RuntimeError("charges adopted on resume were not all replayed")

    def evaluate(self) -> dict[str, Any]:
        """One history row: held-out metrics (public data), the edges' own metrics for the
        non-private ASGD (or with ``eval_client_data``), timings and the simulated clock."""
        row: dict[str, Any] = {"iteration": self.applied}
        d = self.data
        if d.x_heldout is not None:
            row["heldout_loss"], row["heldout_accuracy"] = _evaluate(
                self.model, self.x, d.x_heldout, d.y_heldout)
        if self.pub.evaluate_clients:
            row["train_loss"], row["train_accuracy"] = _evaluate(self.model, self.x, d.x, d.y)
            _, row["test_accuracy"] = _evaluate(self.model, self.x, d.x_test, d.y_test)
        last = self.events_done - 1
        row |= {"wall_time_s": self.wall, "client_compute_s": self.compute,
                "simulated_time_s": float(self.sched.done_s[last]) if last >= 0 else 0.0}
        if self.private and self.ledger is not None:
            row["epsilon_max"] = self._epsilon_max()
        self.history.append(row)
        return row

    def report(self) -> dict[str, Any]:
        """The report entry (``history``, privacy, staleness, ...) plus ``_model`` (the final
        flat parameters) and ``_ledger``, which the report leaves out."""
        res = report_entry(self)
        res["_model"] = self.x.detach().cpu()
        res["_ledger"] = self.ledger
        if self.canaries is not None and "privacy" in res:
            privacy_notes(res["privacy"], self.canaries)
            res["privacy"]["canaries"]["edge"] = self.audit_edge
            res["_canaries"] = self.canaries
        return res

    # -- checkpoints ----------------------------------------------------------------------
    def config_state(self) -> Any:
        return _config_json(self.cfg)

    def history_state(self) -> list[dict[str, Any]]:
        return _history_json(self.history)

    def load_history(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return _history_json(rows, decode=True)

    def save(self, directory: Path) -> None:
        """Checkpoint the whole state (named by the cloud events served, which only grow)."""
        if self.precharged:
            raise RuntimeError("charges adopted on resume were not all replayed before the "
                               "next checkpoint")
        super().save(directory)

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model, every edge's pulled model, in-flight gradients, ready flags, upload
        counters, DeltaS of each pending job and the wall-clock counters."""
        tensors = {"x": self.x, "pulled": self.pulled, "grads": self.grads}
        return tensors, {
            "events_done": self.events_done, "applied": self.applied,
            "ready": self.ready.tolist(), "next_upload": self.next_upload.tolist(),
            "delta_s": self.delta_s.tolist(), "charged": self.charged.tolist(),
            "flushes": self.flushes, "diverged": self.diverged,
            "wall_time_s": self.wall, "client_compute_s": self.compute,
        }

    def load_state(self, tensors: dict[str, Any], state: dict[str, Any]) -> None:
        k, d = self.cfg.edges, self.dim
        shapes = {"x": (d,), "pulled": (k, d), "grads": (k, d)}
        for name, shape in shapes.items():
            if name not in tensors or tuple(tensors[name].shape) != shape:
                raise checkpoint.CheckpointError(f"tensor {name!r} missing or not of shape "
                                                 f"{shape}")
        self.x, self.pulled, self.grads = tensors["x"], tensors["pulled"], tensors["grads"]
        self.events_done, self.applied = int(state["events_done"]), int(state["applied"])
        self.ready = np.array(state["ready"], dtype=bool)
        self.next_upload = np.array(state["next_upload"], dtype=np.int64)
        self.delta_s = np.array(state["delta_s"], dtype=np.float64)
        self.charged = np.array(state["charged"], dtype=np.int64)
        self.flushes, self.diverged = int(state["flushes"]), state["diverged"]
        self.wall, self.compute = float(state["wall_time_s"]), float(state["client_compute_s"])


def run_algorithm(algorithm: str, cfg: MapaConfig, *, out: Path | None = None,
                  dataset: FederatedDataset | None = None, schedule: Schedule | None = None,
                  resume: bool = False, audit: bool = False) -> dict[str, Any]:
    """Run one algorithm; returns its report entry (``history``, privacy, staleness, ...).
    With ``audit`` (and ``cfg.audit_canaries``) the run plants canary records (its entry's
    ``_canaries``; :mod:`fl_examples.core.canaries`).

    With ``out``, the ledger is ``out/ledger-<algorithm>.jsonl`` and checkpoints go to
    ``out/checkpoints/<algorithm>/`` every ``cfg.checkpoint_every`` applied updates;
    ``resume=True`` continues from the latest checkpoint (or, without one, restarts and adopts
    the charges a crashed first window left in the ledger).

    Raises:
        LedgerMismatchError: on resume, the ledger lacks the checkpoint's entry (older ledger).
        LedgerRollbackError: on resume, the checkpoint is older than the ledger's spend.
        CheckpointError: a checkpoint of another algorithm or configuration, or one whose
            ledger is missing.
    """
    if algorithm not in ALGORITHMS:
        raise InvalidParameterError("algorithms", algorithm, f"among {', '.join(ALGORITHMS)}")
    device = resolve_device(cfg.device)
    ds = dataset if dataset is not None else load_edges(cfg.dataset, edges=cfg.edges,
                                                         seed=cfg.seed)
    _check_data(cfg, ds)
    model = make_model(cfg.model, ds)
    if schedule is None:
        schedule = simulate(cfg.edges, cfg.updates, cfg.timing(), seed=cfg.seed,
                            tau_max=cfg.tau_max)
    run = _Run(algorithm, cfg, model, _pool(ds, device), schedule, None, device,
               heldout=ds.description.get("heldout") if ds.has_heldout else None, audit=audit)
    # opened once the run's settings hold (the Gaussian mode's z is calibrated by now)
    run.ledger = _open_ledger(cfg, algorithm, out, resume) if algorithm != "asgd" else None
    drive(run, checkpoints=checkpoint_dir(out, algorithm), checkpoint_every=cfg.checkpoint_every,
          eval_every=cfg.eval_every, resume=resume)
    return run.report()
