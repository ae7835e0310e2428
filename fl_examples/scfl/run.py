"""One SCFL method's run on the trainer skeleton, and what the methods of a comparison share.

Every method runs on the same data, coded uploads and timing draws (:class:`_Shared`); a step is
one epoch: the clients whose upload arrives before the deadline send their gradients, the
server adds the coded part, and the simulated clock advances by the epoch's length.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import privkit
from fl_examples.core.canaries import TrainerCanaries, canary_seed, privacy_notes
from fl_examples.core.dp_modes import (
    charge_entries,
    epsilon_section,
    grouped,
    replace_one_epsilons,
)
from fl_examples.core.privacy import BudgetStop
from fl_examples.core.release import Publication
from fl_examples.core.run import (
    TrainerRun,
    adopt_round_charges,
    checkpoint_dir,
    drive,
    open_ledger,
)
from fl_examples.core.seeds import SeedTree
from fl_examples.core.status import status
from fl_examples.scfl.config import BatchSampling, ScflConfig, ScflMethod, _enum
from fl_examples.scfl.data import RegressionData, load_data
from fl_examples.scfl.gradients import (
    client_gradient,
    dp_client_gradient,
    makeup_term,
    server_gradient,
)
from fl_examples.scfl.timing import TimingModel, _timing
from privkit._journal import canonical_json
from privkit.accountants.midp import COVERS, LabelMode, midp_coded_release, midp_per_client
from privkit.errors import InvalidParameterError
from privkit.events import event_to_dict
from privkit.ledger import Ledger, LedgerPointer, atomic_write_bytes
from privkit.mechanisms.coded import CodedUpload, client_rng, code_client_data, sum_uploads
from privkit.mechanisms.sampling import SecureRandom

__all__ = ["run_method"]


@dataclass
class _Shared:
    """Everything the methods of one comparison share."""

    cfg: ScflConfig
    data: RegressionData
    timing: TimingModel
    batches: np.ndarray  # nominal b_i
    coded: dict[str, tuple[np.ndarray, np.ndarray, list[Any]]]  # "plain"/"weighted" -> X~, Y~
    noise_var: float  # sum_i sigma_i^2
    eta: float
    x_all: np.ndarray
    y_all: np.ndarray
    labels_all: np.ndarray | None


def _deadline(cfg_value: float | None, timing: TimingModel, batch: np.ndarray,
              ok: np.ndarray) -> float:
    if cfg_value is not None:
        return float(cfg_value)
    # The slowest client's minimum time, nudged up so that its k_i is 1 despite rounding.
    return float(timing.min_time(batch)[ok].max()) * (1 + 1e-9)


def _check_deadline(name: str, deadline: float, timing: TimingModel, batch: np.ndarray,
                    method: ScflMethod, ids: tuple[str, ...]) -> np.ndarray:
    p = timing.arrival_probability(deadline, batch)
    if not (p > 0).any():
        fastest = float(timing.min_time(batch).min())
        raise InvalidParameterError(
            name, deadline, f"at least {fastest:.6g} s, the fastest client's minimum time "
            f"(compute + one upload + download): with this deadline no client can arrive "
            f"({method.value})")
    if not (p > 0).all():
        out = [ids[i] for i in np.flatnonzero(p == 0)]
        warnings.warn(f"{method.value}: {len(out)} client(s) can never meet {name} = "
                      f"{deadline:.4g} s and are excluded from the client part (it is then "
                      f"biased): {', '.join(out)}", stacklevel=3)
    return p


def _code(cfg: ScflConfig, data: RegressionData, weights: np.ndarray | None
          ) -> tuple[np.ndarray, np.ndarray, list[Any]]:
    """Every client's upload (optionally weighted rows, CodedFedL) and the server sum."""
    uploads: dict[str, CodedUpload] = {}
    secure = SecureRandom() if cfg.secure_coding or cfg.secure_noise else None
    mode = _enum(LabelMode, "label_mode", cfg.label_mode)
    for i, cid in enumerate(data.client_ids):
        # CodedFedL weights client i's rows by w_i = sqrt(1 - p_i); its bounds scale with w_i
        # (w_i = 0: only noise is uploaded; a tiny positive bound keeps the event valid).
        w = 1.0 if weights is None else float(weights[i])
        bound = max(w, 1e-12)
        rng = secure if secure is not None else client_rng(cfg.seed, cid)
        uploads[cid] = code_client_data(
            data.x[i] * w, data.y[i] * bound if data.categorical else data.y[i] * w,
            num_coded_rows=cfg.num_coded_rows, stddev=cfg.stddev, row_l2_bound=bound,
            label_mode=mode, label_stddev=cfg.label_stddev,
            label_l2_bound=bound * (1.0 if data.categorical else cfg.label_l2_bound),
            categorical_labels=data.categorical, rng=rng)
    cx, cy = sum_uploads(uploads)
    assert cy is not None
    return cx, cy, [uploads[c].event for c in data.client_ids]


@dataclass(frozen=True)
class _GradientDp:
    """Record-level DP on one method's client gradients: z, C, and each charged client's
    per-epoch event (clients with data that can arrive; Poisson rate q_i = min(1, b_i/l_i))."""

    noise_multiplier: float
    clip: float
    rates: tuple[float, ...]
    entries: tuple[tuple[str, Any], ...]  # (client id, event), in the ledger's write order
    calibrated: dict[str, Any] | None

    @staticmethod
    def event(q: float, z: float) -> Any:
        inner: Any = privkit.GaussianDpEvent(z)
        return inner if q >= 1 else privkit.PoissonSampledDpEvent(q, inner)

    @classmethod
    def plan(cls, cfg: ScflConfig, ids: tuple[str, ...], sizes: np.ndarray, batch: np.ndarray,
             charged: np.ndarray) -> _GradientDp:
        rates = tuple(float(min(1.0, b / n)) if n > 0 else 0.0 for b, n in zip(batch, sizes))
        calibrated = None
        z = cfg.gradient_noise_multiplier
        if z is None:
            # every charged client runs `rounds` epochs; the largest rate pays the most
            q_max = max((rates[i] for i in np.flatnonzero(charged)), default=1.0)
            target = float(cfg.gradient_noise_for_epsilon)  # type: ignore[arg-type]
            with status(f"calibrating the gradients' z to epsilon {target:g} (delta "
                        f"{cfg.delta:g}, {cfg.rounds} rounds, max over clients)") as line:
                z, eps, _ = privkit.calibrate_noise(
                    lambda x: privkit.SelfComposedDpEvent(cls.event(q_max, x), cfg.rounds),
                    target_epsilon=target, delta=cfg.delta)
                line.done(f"z = {z:.4g} (planned epsilon {eps:.4g})")
            calibrated = {"parameter": "gradient_noise_multiplier", "value": z,
                          "target_epsilon": target, "statistic": "max",
                          "planned_epsilon": eps}
        entries = grouped([(ids[i], cls.event(rates[i], float(z)))
                           for i in np.flatnonzero(charged)])
        return cls(float(z), float(cfg.gradient_clip), rates, tuple(entries), calibrated)


class _Run(TrainerRun):
    """One method's run (:class:`~fl_examples.core.run.TrainerRun`): model, running sum,
    simulated clock, history; a step is one epoch. No ledger: the privacy is the coded upload's
    MI-DP, fixed before training."""

    records_ledger = False

    def __init__(self, method: ScflMethod, sh: _Shared, ledger: Ledger | None = None,
                 audit: bool = False) -> None:
        self.method, self.sh, cfg = method, sh, sh.cfg
        self.algorithm, self.cfg = method.value, cfg
        d, o = sh.x_all.shape[1], sh.y_all.shape[1]
        self.w = np.zeros((d, o))
        self.w_sum = np.zeros((d, o))
        self.round = 0
        self.sim_time = 0.0
        self.wall = 0.0
        self.history: list[dict[str, Any]] = []
        self.arrivals: list[int] = []
        self.tree = SeedTree(cfg.seed)
        # a run with gradient noise is a private run: held-out metrics only, by default
        self.pub = Publication(private=cfg.gradient_dp, client_metrics=cfg.eval_client_data,
                               secure=cfg.secure_noise, seed=cfg.seed,
                               heldout=sh.data.description.get("heldout", "the test rows, "
                                                               "which no client trains on"))
        self.loss_key = self.pub.loss_key
        self.secure = SecureRandom() if cfg.secure_noise and cfg.gradient_dp else None
        sizes = sh.data.sizes
        self.has_data = sizes > 0
        if method is ScflMethod.CFL_FB:
            self.batch = sizes.copy()
            self.server_batch = cfg.num_coded_rows
            self.deadline = _deadline(cfg.fb_deadline, sh.timing, self.batch, self.has_data)
            name = "fb_deadline"
        else:
            self.batch = sh.batches
            self.server_batch = min(cfg.server_batch_size, cfg.num_coded_rows)
            self.deadline = _deadline(cfg.deadline, sh.timing, self.batch, self.has_data)
            name = "deadline"
        self.p = np.ones(len(sizes))
        if method in (ScflMethod.SCFL, ScflMethod.SCFL_NO_MAKEUP, ScflMethod.CFL_FB,
                      ScflMethod.CODEDFEDL_STYLE):
            self.p = _check_deadline(name, self.deadline, sh.timing, self.batch, method,
                                     sh.data.client_ids) * self.has_data
        key = "weighted" if method is ScflMethod.CODEDFEDL_STYLE else "plain"
        self.cx, self.cy, self.events = sh.coded[key] if method.coded else (None, None, [])
        # record-level DP on the client gradients (with a ledger), when configured
        self.ledger = ledger
        self.records_ledger = ledger is not None  # this run's checkpoints hold a pointer
        self.precharged: dict[int, set[str]] = {}
        self.dp = (_GradientDp.plan(cfg, sh.data.client_ids, sizes, self.batch,
                                    self.has_data & (self.p > 0))
                   if ledger is not None else None)
        # --audit-canaries: canary records of one charged client (the largest rate, then the
        # likeliest to arrive), in its released gradients
        self.canaries: TrainerCanaries | None = None
        self.audit_client: int | None = None
        if audit and cfg.audit_canaries and self.dp is not None:
            live = np.flatnonzero(self.has_data & (self.p > 0))
            rates = np.array(self.dp.rates)
            i = self.audit_client = int(live[np.lexsort((-self.p[live], -rates[live]))[0]])
            self.canaries = TrainerCanaries(
                cfg.audit_canaries, int(self.w.size), seed=canary_seed(cfg.seed, self.algorithm),
                noise_multiplier=self.dp.noise_multiplier,
                sampling_probability=float(rates[i]),
                where=f"canary records of client {sh.data.client_ids[i]} (the largest "
                      f"sampling rate, {rates[i]:.4g}; arrival probability {self.p[i]:.3g}), "
                      "each in its Poisson minibatches, scored in the epochs its gradient "
                      "arrives")

    # ---------------------------------------------------------------- the run protocol
    @property
    def position(self) -> int:
        return self.round

    def finished(self) -> bool:
        budget = self.cfg.time_budget
        return self.round >= self.cfg.rounds or (budget is not None and self.sim_time >= budget)

    def remaining(self) -> int:
        return self.cfg.rounds - self.round

    def report(self) -> dict[str, Any]:
        sh, method = self.sh, self.method
        entry: dict[str, Any] = {
            "history": self.history, "arrivals_per_round": self.arrivals,
            "deadline_s": self.deadline if method is not ScflMethod.FL_PMA else None,
            "arrival_probability": self.p.tolist(),
            "mean_epoch_s": self.sim_time / max(self.round, 1),
            "excluded_clients": [sh.data.client_ids[i] for i in np.flatnonzero(self.p == 0)],
            "_model": {"average": self.w_sum / max(self.round, 1), "last": self.w}}
        priv = _privacy(self)
        if priv is not None:
            entry["privacy"] = priv
        if self.canaries is not None:
            entry["_canaries"] = self.canaries
        if self.dp is not None:
            entry["gradient_privacy"] = _gradient_privacy(self) | self.pub.notes(
                proven_maths=True, public=[
                    "N and every client's record count l_i (sampling rates, weights)",
                    "which clients' gradients arrive (the simulated timing model, which "
                    "does not depend on the data)"],
                dataset_description=sh.data.description, extra_not_covered=[(
                    "the model and every metric computed from it", "the server's gradient "
                    "on the coded data enters every update: the coded upload is covered by "
                    "MI-DP (privacy.mi_dp_nats), not by this epsilon")])
            if self.canaries is not None:
                privacy_notes(entry["gradient_privacy"], self.canaries)
                entry["gradient_privacy"]["canaries"]["client"] = self.audit_client
        if self.stopped:
            entry["stopped"] = self.stopped
        return entry

    def adopt(self, pointer: LedgerPointer) -> None:
        """Charges after the checkpoint's pointer must be the write-ahead charges of the
        epochs up to the next checkpoint (adopted, not made twice); anything else is refused
        (:func:`~fl_examples.core.run.adopt_round_charges`)."""
        assert self.ledger is not None
        self.precharged = adopt_round_charges(
            self.ledger, pointer, run_id=self.algorithm, start=self.round,
            window=self.round + max(self.cfg.checkpoint_every, 1),
            charges=self._expected_charges, step_name="epoch",
            replays_identically=self.secure is None)

    def _expected_charges(self, t: int) -> list[tuple[int, str, int, str]]:
        assert self.dp is not None
        return [(t, cid, 1, canonical_json(event_to_dict(ev))) for cid, ev in self.dp.entries]

    def _charge(self, r: int) -> None:
        """Write-ahead: every client that may send a gradient in epoch r is charged first."""
        assert self.dp is not None and self.ledger is not None
        done = self.precharged.pop(r, set())
        todo = [(cid, ev) for cid, ev in self.dp.entries if cid not in done]
        if todo:
            charge_entries(self.ledger, todo, round_=r, run_id=self.algorithm,
                           label="record-level gradient")

    # ---------------------------------------------------------------- one epoch
    def _client_rows(self, rng: Any, i: int) -> tuple[np.ndarray, float]:
        size, b = int(self.sh.data.sizes[i]), int(self.batch[i])
        if b >= size:
            return np.arange(size), 1.0
        if _enum(BatchSampling, "batch_sampling", self.sh.cfg.batch_sampling) \
                is BatchSampling.BERNOULLI:
            u = rng.uniform(size) if isinstance(rng, SecureRandom) else rng.random(size)
            return np.flatnonzero(np.asarray(u) < b / size), size / b
        return rng.choice(size, b, replace=False), size / b

    def _server_rows(self, rng: np.random.Generator) -> tuple[np.ndarray, float]:
        c, b = self.sh.cfg.num_coded_rows, self.server_batch
        if b >= c:
            return np.arange(c), float(c)
        if _enum(BatchSampling, "batch_sampling", self.sh.cfg.batch_sampling) \
                is BatchSampling.BERNOULLI:
            return np.flatnonzero(rng.random(c) < b / c), float(b)
        return rng.choice(c, b, replace=False), float(b)

    def step(self) -> bool:
        start = time.perf_counter()
        sh, cfg, m = self.sh, self.sh.cfg, self.method
        r = self.round + 1
        n = len(sh.data.sizes)
        attempts = sh.timing.draw_attempts(self.tree.numpy(r, "arrivals"))
        t = sh.timing.times(self.batch, attempts)
        # the same draws for every method, or (gradient noise, secure) the OS CSPRNG's; each
        # client's minibatch from its own stream (a record added to one client never moves
        # another client's rows: the coupling record-level DP's accounting assumes)
        rows = [self._client_rows(self.secure if self.secure is not None
                                  else self.tree.numpy(r, f"batches/{i}"), i) for i in range(n)]
        w = self.w
        noise = None
        if self.dp is not None:
            try:
                self._charge(r)
            except BudgetStop as stop:
                self.stopped = f"stopped before epoch {r}: {stop}"
                return False
            shape = (n, *w.shape)
            noise = np.asarray(self.secure.gaussian(1.0, shape)) if self.secure is not None \
                else self.tree.numpy(r, "gradient-noise").normal(size=shape)
            noise *= self.dp.noise_multiplier * self.dp.clip
        g_o = makeup_term(w, sh.noise_var)
        g_s = None
        if m.coded:
            srows, bs = self._server_rows(self.tree.numpy(r, "server_batch"))
            g_s = server_gradient(self.cx, self.cy, w, srows, bs)

        def client_sum(arrived: np.ndarray, weights: np.ndarray) -> np.ndarray:
            out = np.zeros_like(w)
            for i in np.flatnonzero(arrived):
                if noise is None:
                    g_i = client_gradient(sh.data.x[i], sh.data.y[i], w, *rows[i])
                else:
                    assert self.dp is not None
                    g_i = dp_client_gradient(sh.data.x[i], sh.data.y[i], w, *rows[i],
                                             clip=self.dp.clip, noise=noise[i])
                    if i == self.audit_client:
                        g_i = self._plant(g_i, rows[i][1])
                out += weights[i] * g_i
            return out

        server_t = sh.timing.server_time(self.server_batch) if m.coded else 0.0
        if m is ScflMethod.FL_PMA:
            k = math.ceil((1 - cfg.psi) * n)
            order = np.lexsort((np.arange(n), t))  # by arrival time, ties by client index
            arrived = np.zeros(n, dtype=bool)
            arrived[order[:k]] = True
            arrived &= self.has_data
            total = sh.data.sizes[arrived].sum()
            g = client_sum(arrived, np.full(n, sh.x_all.shape[0] / max(total, 1)))
            epoch = float(t[order[k - 1]])
        elif m is ScflMethod.DP_CFL_STYLE:
            assert g_s is not None
            arrived = np.zeros(n, dtype=bool)
            g = g_s + (g_o if cfg.makeup else 0.0)
            epoch = server_t
        else:
            assert g_s is not None
            # t_i <= T  <=>  N_i <= k_i; the integer test matches the closed form exactly.
            arrived = (attempts <= sh.timing.max_attempts(self.deadline, self.batch)) \
                & (self.p > 0)
            if m is ScflMethod.CODEDFEDL_STYLE:
                g = client_sum(arrived, np.ones(n)) + g_s
            else:
                client = client_sum(arrived, 1.0 / np.where(self.p > 0, self.p, 1.0))
                make_up = g_o if m is not ScflMethod.SCFL_NO_MAKEUP else 0.0
                g = cfg.kappa * client + (1 - cfg.kappa) * (g_s + make_up)
            epoch = max(self.deadline, server_t)
        if cfg.l2_reg:
            g = g + cfg.l2_reg * w
        self.w_sum += w  # W^(r) enters the average before the update (paper's (1/R) sum)
        self.w = w - sh.eta * g
        self.round = r
        self.sim_time += epoch
        self.arrivals.append(int(arrived.sum()))
        self.wall += time.perf_counter() - start
        return True

    def _plant(self, g: np.ndarray, scale: float) -> np.ndarray:
        """The audit's canary records in the audited client's released gradient ``g =
        scale (clipped sum + noise)``: each canary taking part is one more per-example
        gradient of norm 2 C clipped to C, in the sum before the noise; the release is
        scored (in units of C: noise N(0, z^2))."""
        assert self.canaries is not None and self.dp is not None
        c = self.dp.clip
        take = self.canaries.begin(self.canaries.releases + 1, c)
        rows = self.canaries.rows(take, c)
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        clipped = rows * np.minimum(1.0, c / np.maximum(norms, 1e-300))
        out = g + scale * clipped.sum(0).reshape(g.shape)
        self.canaries.observe((out / scale).ravel())
        return out

    # ------------------------------------------------------------------ evaluation
    def _metrics(self, w: np.ndarray) -> dict[str, float]:
        """Losses (and accuracies, for class labels) of ``w``. The test rows are the held-out
        set (no client trains on them), ``heldout_*``; a run with gradient noise adds the
        clients' training data only with ``eval_client_data``."""
        sh = self.sh
        test_loss = float(0.5 * np.mean(np.sum((sh.data.x_test @ w - sh.data.y_test) ** 2,
                                               axis=1)))
        classes = sh.labels_all is not None and sh.data.labels_test is not None
        test_acc = float(np.mean(np.argmax(sh.data.x_test @ w, 1) == sh.data.labels_test)) \
            if classes else None
        out: dict[str, float] = {"heldout_loss": test_loss}
        if test_acc is not None:
            out["heldout_accuracy"] = test_acc
        if self.pub.evaluate_clients:
            res = sh.x_all @ w - sh.y_all
            out["train_loss"] = float(0.5 * np.mean(np.sum(res**2, axis=1)))
            out["test_loss"] = test_loss
            if classes:
                out["train_accuracy"] = float(np.mean(np.argmax(sh.x_all @ w, 1)
                                                      == sh.labels_all))
                out["test_accuracy"] = test_acc  # type: ignore[assignment]
        return out

    def evaluate(self) -> dict[str, Any]:
        avg = self.w_sum / self.round if self.round else self.w
        primary = avg if self.sh.cfg.output == "average" else self.w
        other = self.w if self.sh.cfg.output == "average" else avg
        metrics = self._metrics(primary)
        if not math.isfinite(metrics[self.loss_key]):
            raise FloatingPointError(f"{self.method.value}: training diverged at round "
                                     f"{self.round}; lower --lr")
        second = self._metrics(other)
        tag = "last" if self.sh.cfg.output == "average" else "average"
        row = {"iteration": self.round, **metrics,
               **{f"{tag}_{k}": val for k, val in second.items()},
               "simulated_time_s": self.sim_time, "wall_time_s": self.wall,
               "client_compute_s": 0.0,
               "arrivals": self.arrivals[-1] if self.arrivals else 0}
        self.history.append(row)
        return row

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        import torch

        tensors = {"w": torch.from_numpy(self.w), "w_sum": torch.from_numpy(self.w_sum)}
        if self.cx is not None:
            tensors["coded_x"] = torch.from_numpy(np.ascontiguousarray(self.cx))
            tensors["coded_y"] = torch.from_numpy(np.ascontiguousarray(self.cy))
        return tensors, {"arrivals": self.arrivals, "simulated_time_s": self.sim_time,
                         "wall_time_s": self.wall}

    def load_state(self, tensors: dict[str, Any], state: dict[str, Any]) -> None:
        self.w = tensors["w"].numpy().astype(np.float64)
        self.w_sum = tensors["w_sum"].numpy().astype(np.float64)
        if "coded_x" in tensors:  # the server's copy: clients never code twice
            self.cx = tensors["coded_x"].numpy().astype(np.float64)
            self.cy = tensors["coded_y"].numpy().astype(np.float64)
        self.round = int(state["round"])
        self.arrivals = list(state["arrivals"])
        self.sim_time, self.wall = float(state["simulated_time_s"]), float(state["wall_time_s"])


def _privacy(run: _Run) -> dict[str, Any] | None:
    if not run.events:
        return None
    nats = midp_per_client(run.events)
    first = midp_coded_release(run.events[int(np.argmax(nats))])
    return {"measure": "mi_dp_nats", "mi_dp_nats_mean": float(nats.mean()),
            "mi_dp_nats_max": float(nats.max()), "mi_dp_bits_mean": float(nats.mean()
                                                                          / math.log(2)),
            "per_client": nats.tolist(), "label_mode": first.label_mode.value,
            "labels_fully_disclosed": first.labels_fully_disclosed, "method": first.method,
            "covers": COVERS, "assumptions": list(first.assumptions),
            "implied": "only (0, sqrt(2 nats))-DP; not an epsilon"} | _coding_randomness(run)


def _coding_randomness(run: _Run) -> dict[str, Any]:
    """MI-DP rests on a secret G and secret noise: seeded coding is a simulation (the report
    records the seed, from which a reader regenerates both)."""
    cfg = run.cfg
    if cfg.secure_coding or cfg.secure_noise:
        return {"guarantee": "proven", "proven": True, "randomness": {
            "source": "os_csprng", "note": "G and the coding noise from the OS CSPRNG "
            "(--secure-coding or --secure-noise): not reproducible"}}
    note = ("seeded simulation: G and the coding noise come from the seed this report "
            "records, so a reader can regenerate them; the MI-DP holds only against someone "
            "who does not know the seed (--secure-coding or --secure-noise)")
    return {"guarantee": "simulation", "proven": False, "not_proven_because": note,
            "randomness": {"source": "seed", "seed": cfg.seed, "note": note}}


def _gradient_privacy(run: _Run) -> dict[str, Any]:
    """The client gradients' record-level epsilon, per client, from the run's ledger."""
    assert run.dp is not None and run.ledger is not None
    ids = list(run.sh.data.client_ids)
    eps = run.ledger.epsilons(ids)
    charged = [cid for cid, _ in run.dp.entries]
    out: dict[str, Any] = epsilon_section(run.ledger, ids) | {
        "mechanism": "record_level_dpsgd (client gradients)", "privacy_unit": "record",
        "neighboring_relation": "ADD_OR_REMOVE_ONE", "per_client": [eps[i] for i in ids],
        "noise_multiplier": run.dp.noise_multiplier, "l2_clip_norm": run.dp.clip,
        "sampling_rate_per_client": list(run.dp.rates),
        "charged_epochs": [int(sum(n for _, n in run.ledger.composition(c).atoms))
                           for c in charged],
        "charged_clients": charged,
        "assumptions": ["Poisson-sampled client minibatches whose outcome stays secret "
                        "(amplification used)", "add or remove one record",
                        "covers the per-epoch gradients only; the coded upload is priced "
                        "separately in MI-DP (the two are not combined)"]}
    ro = replace_one_epsilons(run.ledger, ids, out["delta"])  # l_i public: replace-one
    out["epsilon_replace_one_mean"] = float(ro.mean())
    out["epsilon_replace_one_max"] = float(ro.max())
    if run.dp.calibrated is not None:
        out["calibrated"] = run.dp.calibrated
    return out


def _setup(cfg: ScflConfig, methods: list[ScflMethod]) -> _Shared:
    data = load_data(cfg)
    d, o = data.x[0].shape[1], data.y[0].shape[1]
    timing = _timing(cfg, len(data.sizes), d, o)
    batches = np.minimum(cfg.client_batch_size, data.sizes)
    m = int(data.sizes.sum())
    coded: dict[str, Any] = {}
    if any(mm.coded and mm is not ScflMethod.CODEDFEDL_STYLE for mm in methods):
        coded["plain"] = _code(cfg, data, None)
    if ScflMethod.CODEDFEDL_STYLE in methods:
        ok = data.sizes > 0
        dl = _deadline(cfg.deadline, timing, batches, ok)
        p = _check_deadline("deadline", dl, timing, batches, ScflMethod.CODEDFEDL_STYLE,
                            data.client_ids)
        coded["weighted"] = _code(cfg, data, np.sqrt(1.0 - p))
    labels = np.concatenate(data.labels) if data.labels is not None else None
    return _Shared(cfg, data, timing, batches, coded, len(data.sizes) * cfg.stddev ** 2,
                   cfg.lr / m, np.vstack(data.x), np.vstack(data.y), labels)


def run_method(method: ScflMethod, sh: _Shared, *, out: Path | None = None,
               resume: bool = False, stop_after: int | None = None, audit: bool = False
               ) -> dict[str, Any]:
    """Run one method for ``cfg.rounds`` epochs; returns its report entry (and ``_model``).

    With gradient noise the method's ledger is ``OUT/ledger-<method>.jsonl`` (reopened,
    never reset, on resume); with ``audit`` (and ``cfg.audit_canaries``) it plants canary
    records (its entry's ``_canaries``; :mod:`fl_examples.core.canaries`)."""
    cfg = sh.cfg
    ledger = None
    if cfg.gradient_dp and method.uses_client_gradients:
        ledger = open_ledger(out, method.value,
                             population_id=f"{cfg.dataset}|seed={cfg.seed}|{method.value}",
                             delta=cfg.delta, resume=resume)
    run = _Run(method, sh, ledger, audit=audit)
    drive(run, checkpoints=checkpoint_dir(out, method.value),
          checkpoint_every=sh.cfg.checkpoint_every, eval_every=sh.cfg.eval_every,
          resume=resume, stop_after=stop_after)
    entry = run.report()
    if "privacy" in entry and out is not None:
        body = {"client_ids": list(sh.data.client_ids),
                "mi_dp_nats": entry["privacy"]["per_client"],
                "events": [event_to_dict(e) for e in run.events], "covers": COVERS}
        atomic_write_bytes(out / f"midp-{method.value}.json",
                           json.dumps(body, indent=1).encode("utf-8"))
    return entry
