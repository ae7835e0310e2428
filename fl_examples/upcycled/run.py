"""One algorithm's run of Upcycled-FL, FedProx or FedAvg on the trainer skeleton."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from fl_examples.core.banded import BandedDpPlan
from fl_examples.core.canaries import TrainerCanaries, canary_seed, for_plan, privacy_notes
from fl_examples.core.data import FederatedDataset, Split
from fl_examples.core.distributed import DistributedDpPlan
from fl_examples.core.dp_modes import charge_entries
from fl_examples.core.dpsgd import client_streams, local_dpsgd
from fl_examples.core.local import local_sgd
from fl_examples.core.models import num_parameters
from fl_examples.core.privacy import (
    BudgetStop,
    PrivacyPlan,
)
from fl_examples.core.release import Publication
from fl_examples.core.rounds import (
    aggregate,
    broadcast,
    client_orders,
    evaluation_row,
    resolve_device,
    sample_clients,
    select,
    to_client_data,
)
from fl_examples.core.run import (
    TrainerRun,
    adopt_round_charges,
    checkpoint_dir,
    drive,
    open_ledger,
)
from fl_examples.core.seeds import SeedTree
from fl_examples.upcycled.config import ALGORITHMS, UpcycledConfig, _model, extrapolation
from fl_examples.upcycled.privacy import _privacy_plan, data_rounds, selection_epochs
from privkit._journal import canonical_json
from privkit._rng import SecureRandom
from privkit.errors import InvalidParameterError
from privkit.events import event_to_dict
from privkit.ledger import Ledger, LedgerPointer


class _Run(TrainerRun):
    """One algorithm's run (:class:`~fl_examples.core.run.TrainerRun`): the model pair
    ``w^{t-1}``, ``w^{t-2}`` and its history; a step is one iteration."""

    evaluate_first = False  # no row for the initial model: the history starts at eval_every

    def __init__(self, algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset,
                 device: torch.device, plan: PrivacyPlan | None = None,
                 ledger: Ledger | None = None, model: Any = None, *,
                 iterations: int | None = None, calibration: dict[str, Any] | None = None
                 ) -> None:
        if algorithm not in ALGORITHMS:
            raise InvalidParameterError("algorithm", algorithm, f"one of {', '.join(ALGORITHMS)}")
        self.algorithm, self.cfg, self.ds, self.device = algorithm, cfg, ds, device
        self.iterations = cfg.iterations if iterations is None else iterations
        self.calibration = calibration or {}
        self.tree = SeedTree(cfg.seed)
        self.model = model if model is not None else _model(cfg, ds)
        dtype = torch.float32
        self.train = to_client_data(ds.padded(Split.TRAIN), device, dtype)
        self.test = to_client_data(ds.padded(Split.TEST), device, dtype)
        self.heldout = None if ds.x_heldout is None else to_client_data(
            ds.heldout_padded(), device, dtype)
        self.pub = publication(cfg, ds)
        self.loss_key = self.pub.loss_key
        # the guarantee's randomness (client sample, minibatches, noise): the OS CSPRNG with
        # --secure-noise, else the seed tree (a seeded simulation)
        self.secure = SecureRandom() if cfg.secure_noise else None
        self.p = torch.as_tensor(ds.weights, dtype=torch.float64, device=device)
        init = self.model.init(1, generator=self.tree.torch(0, "init", "cpu"), device=device)
        self.w = {k: v[0] for k, v in init.items()}  # w^{t-1}
        self.w_prev = {k: v.clone() for k, v in self.w.items()}  # w^{t-2}
        self.iteration = 0
        self.history: list[dict[str, Any]] = []
        self.wall = 0.0
        self.compute = 0.0
        self.plan, self.ledger = plan, ledger
        self.stopped: str | None = None
        # data round -> clients whose charge for it is already in the ledger (adopted on resume)
        self.precharged: dict[int, set[str]] = {}
        # the server's state under client-level DP: clip norm (adaptive) and momentum buffer
        self.server: dict[str, Any] = {}
        # --audit-canaries: the canary clients planted in the releases (client level)
        self.canaries: TrainerCanaries | None = None

    # -- the run protocol -------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.iteration

    def finished(self) -> bool:
        return self.iteration >= self.iterations

    def remaining(self) -> int:
        return self.iterations - self.iteration

    def step(self) -> bool:
        """One iteration; False before a data round that would take a client over budget."""
        try:
            self._iterate()
        except BudgetStop as stop:
            self.stopped = (f"stopped before iteration {self.iteration + 1}: {stop}; "
                            f"budget {self.ledger.epsilon_budget}")
            return False
        return True

    def report(self) -> dict[str, Any]:
        result: dict[str, Any] = {"history": self.history,
                                  "model": {k: v.detach().cpu() for k, v in self.w.items()}}
        if self.plan is not None and self.ledger is not None:
            p = (self.plan.report(self.ledger, self.ds.num_clients, self.server)
                 if self.banded or self.distributed
                 else self.plan.report(self.ledger, self.ds.num_clients)
                 ) | self.calibration
            proven = bool(p.get("proven", True))
            public = self.plan.public() if hasattr(self.plan, "public") else [
                "n_i: every client's record count", "which clients take part in each round "
                "(the sampler is not secret under record-level DP)"]
            p |= self.pub.notes(proven_maths=proven, public=public,
                                dataset_description=self.ds.description,
                                not_proven_because=p.get("not_proven_because"))
            result["privacy"] = p
            if self.stopped:
                result["privacy"]["stopped"] = self.stopped
            if self.canaries is not None:
                privacy_notes(p, self.canaries)
                result["_canaries"] = self.canaries
        return result

    # -- one iteration ----------------------------------------------------------------------
    def data_round(self, t: int) -> int:
        return (t + 1) // 2 if self.algorithm == "upcycled" else t

    def _iterate(self) -> None:
        t = self.iteration + 1
        start = time.perf_counter()
        if self.algorithm == "upcycled" and t % 2 == 0:
            c = extrapolation(self.cfg, t // 2)
            new = {k: self.w[k] + c * (self.w[k] - self.w_prev[k]) for k in self.w}
        else:
            new = self._local_round(self.data_round(t))
        self.w_prev, self.w = self.w, new
        self.iteration = t
        self.wall += time.perf_counter() - start

    @property
    def client_level(self) -> bool:
        return getattr(self.plan, "kind", None) == "client"

    @property
    def banded(self) -> bool:
        """Client level with banded MF (:mod:`fl_examples.core.banded`)."""
        return isinstance(self.plan, BandedDpPlan)

    @property
    def distributed(self) -> bool:
        """Client level with distributed DP (:mod:`fl_examples.core.distributed`)."""
        return isinstance(self.plan, DistributedDpPlan)

    def _selection(self, r: int) -> tuple[Any, Any]:
        """(clients, local epochs) of data round ``r`` (FedAvg drops its stragglers).

        Under client-level DP the sample is Poisson; under client- and record-level DP
        every client's straggling is drawn on its own (:func:`selection_epochs`), so one
        client's work never depends on who else was sampled."""
        cfg = self.cfg
        if self.banded:  # the participation schema (reads who took part, never writes)
            sel = self.plan.select(self.tree, r, self.secure,  # type: ignore[union-attr]
                                   self.server)
        elif self.client_level:  # Poisson sampling at rate q
            sel = self.plan.select(self.tree, r, self.secure)  # type: ignore[union-attr]
        else:
            sel = sample_clients(self.tree, r, self.ds.num_clients, cfg.fraction)
        epochs, strag = selection_epochs(cfg, self.tree, r, sel)
        if self.algorithm == "fedavg":
            sel, epochs = sel[~strag], epochs[~strag]
        return sel, epochs

    def _charge(self, r: int, sel: Any, epochs: Any = None) -> torch.Generator:
        """Write-ahead charge of data round ``r`` (all or nothing; charges a crashed run
        already wrote for this very round are not made twice); returns its noise generator."""
        assert self.plan is not None and self.ledger is not None
        done = self.precharged.pop(r, set())
        if self.plan.kind in ("client", "record"):
            todo = [(c, e) for c, e in self.plan.entries(r, sel, epochs) if c not in done]
            if todo:
                charge_entries(self.ledger, todo, round_=r, run_id=self.algorithm,
                               label=f"{self.plan.kind}-level release")
        else:
            ids = [c for c in sel.tolist() if str(c) not in done]
            if ids:
                self.plan.charge(self.ledger, ids, round_=r, run_id=self.algorithm)
        if self.secure is not None:
            return self.secure
        return self.tree.torch(r, "noise", self.device)

    def _check_finite(self, local: dict[str, torch.Tensor], sel: Any, r: int) -> None:
        """Refuse a non-finite local model, naming the client. Only after its noise was
        drawn (objective perturbation, DP-SGD): the model is then the mechanism's output and
        the check post-processing; the round stays charged and nothing is released."""
        ok = torch.ones(len(sel), dtype=torch.bool, device=self.device)
        for v in local.values():
            ok &= torch.isfinite(v.reshape(len(sel), -1)).all(dim=1)
        if not bool(ok.all()):
            j = int(torch.nonzero(~ok)[0])
            raise InvalidParameterError(
                f"update of client {int(sel[j])} in data round {r}", "non-finite values",
                "finite (its noise was drawn, so the round stays charged; nothing was "
                "released; lower --lr)")

    def _local_round(self, r: int) -> dict[str, torch.Tensor]:
        plan = self.plan if self.ledger is not None else None
        if plan is not None and plan.kind == "client":
            return self._client_round(r)
        if plan is not None and plan.kind == "record":
            return self._record_round(r)
        cfg = self.cfg
        sel, epochs = self._selection(r)
        if len(sel) == 0:  # FedAvg with every sampled client a straggler
            return {k: v.clone() for k, v in self.w.items()}
        linear = noise = None
        if plan is not None and plan.kind == "objective":
            # The noise term enters the local objective: charge before training.
            noise = self._charge(r, sel)
            terms = [plan.mechanism(int(c)).linear_term(self.w, rng=noise) for c in sel]
            linear = {k: torch.stack([t[k] for t in terms]) for k in self.w}
        idx = torch.as_tensor(sel, device=self.device)
        data = select(self.train, idx)
        mu = 0.0 if self.algorithm == "fedavg" else cfg.mu
        t0 = time.perf_counter()
        local = local_sgd(
            self.model, broadcast(self.w, len(sel)), self.w, data,
            epochs=torch.as_tensor(epochs, device=self.device), batch_size=cfg.batch_size,
            lr=cfg.lr, momentum=cfg.momentum, proximal_mu=mu,
            generator=self.tree.torch(r, "batches", self.device), linear_term=linear,
        )
        if plan is not None and plan.kind == "objective":
            self._check_finite(local, sel, r)  # after the noise: post-processing
        if plan is not None and plan.kind == "output":
            # Output perturbation: a non-finite local model becomes zeros before it is
            # clipped (an error would say something about that client's data, outside the
            # guarantee); charged before any noise is drawn.
            local = _zero_nonfinite(local, len(sel))
            noise = self._charge(r, sel)
            released = [plan.mechanism(int(c))({k: v[j] for k, v in local.items()}, rng=noise)
                        for j, c in enumerate(sel)]
            local = {k: torch.stack([rel[k] for rel in released]) for k in local}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.compute += time.perf_counter() - t0
        return aggregate(local, self.p[idx])

    def _train(self, sel: Any, epochs: Any, r: int) -> dict[str, torch.Tensor]:
        """The sampled clients' local models from the global one (plain local SGD), each
        client's batch order from its own stream (it never depends on who else was
        sampled)."""
        cfg = self.cfg
        data = select(self.train, torch.as_tensor(sel, device=self.device))
        ep = torch.as_tensor(epochs, device=self.device)
        return local_sgd(
            self.model, broadcast(self.w, len(sel)), self.w, data,
            epochs=ep, batch_size=cfg.batch_size, lr=cfg.lr, momentum=cfg.momentum,
            proximal_mu=0.0 if self.algorithm == "fedavg" else cfg.mu,
            order=client_orders(self.tree, r, sel, data.sizes, ep, self.device))

    def _client_round(self, r: int) -> dict[str, torch.Tensor]:
        """Client-level DP-FedAvg: Poisson-sampled clients train; their clipped updates are
        summed and noised once; the server applies the noisy mean (K = 0 still releases)."""
        assert self.plan is not None
        sel, epochs = self._selection(r)
        t0 = time.perf_counter()
        if len(sel) and not (self.distributed and self.plan.skips(sel)):  # type: ignore[union-attr]
            local = self._train(sel, epochs, r)  # a non-finite update contributes zeros
        else:
            local = {k: v.unsqueeze(0)[:0] for k, v in self.w.items()}
        noise = self._charge(r, sel)  # after the updates are known finite, before any noise
        if self.banded:
            new = self.plan.release(self.w, local, self.server, noise,  # type: ignore[union-attr]
                                    sel=sel, data_round=r, canaries=self.canaries)
        elif self.distributed:  # each client's own noise share and stream (skips: no release)
            new = self.plan.release(self.w, local, self.server, noise,  # type: ignore[union-attr]
                                    sel=sel, data_round=r, tree=self.tree, secure=self.secure,
                                    canaries=self.canaries)
        else:
            new = self.plan.release(self.w, local, self.server, noise,  # type: ignore[union-attr]
                                    canaries=self.canaries)
        self.compute += time.perf_counter() - t0
        return new

    def _record_round(self, r: int) -> dict[str, torch.Tensor]:
        """Record-level DP-SGD: each sampled client is charged its round's steps, then trains
        with DP-SGD; the server averages (post-processing)."""
        cfg = self.cfg
        sel, epochs = self._selection(r)
        if len(sel) == 0:
            return {k: v.clone() for k, v in self.w.items()}
        self._charge(r, sel, epochs)  # the noise enters training: charge first
        idx = torch.as_tensor(sel, device=self.device)
        t0 = time.perf_counter()
        local = local_dpsgd(
            self.model, broadcast(self.w, len(sel)), self.w, select(self.train, idx),
            epochs=torch.as_tensor(epochs, device=self.device),
            settings=self.plan.settings,  # type: ignore[union-attr]
            lr=cfg.lr, momentum=cfg.momentum,
            proximal_mu=0.0 if self.algorithm == "fedavg" else cfg.mu, clients=sel,
            rng=self.secure or client_streams(cfg.seed, r))
        self._check_finite(local, sel, r)
        self.compute += time.perf_counter() - t0
        return aggregate(local, self.p[idx])

    def evaluate(self) -> dict[str, Any]:
        """One history row: the held-out metrics (public data), and the clients' training
        and test metrics unless the run is private (or with ``eval_client_data``)."""
        # data_rounds: the iterations that trained on client data (Upcycled-FL's odd ones), the
        # client computation spent so far (the x axis on which its claim is visible)
        row: dict[str, Any] = {"iteration": self.iteration,
                               "data_rounds": data_rounds(self.algorithm, self.iteration)}
        row |= evaluation_row(self.model, self.w, heldout=self.heldout, train=self.train,
                              test=self.test, evaluate_clients=self.pub.evaluate_clients)
        loss = row[self.loss_key]
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"{self.algorithm}: training diverged at iteration {self.iteration} "
                f"({self.loss_key.replace('_', ' ')} {loss}); lower --lr")
        row |= {"wall_time_s": self.wall, "client_compute_s": self.compute}
        self.history.append(row)
        return row

    # -- checkpoints ------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        tensors = {f"w.{k}": v for k, v in self.w.items()}
        tensors.update({f"w_prev.{k}": v for k, v in self.w_prev.items()})
        extra: dict[str, Any] = {"wall_time_s": self.wall, "client_compute_s": self.compute}
        if "momentum" in self.server:
            tensors.update({f"server_momentum.{k}": v for k, v in self.server["momentum"].items()})
        if "clip" in self.server:
            extra["server_clip"] = self.server["clip"]
        if self.banded:  # the noise state (secret) and who took part when
            t, e = self.plan.state_tensors(self.server)  # type: ignore[union-attr]
            tensors |= t
            extra |= e
        if self.distributed:  # released, skipped and wrapped rounds
            extra |= DistributedDpPlan.state_json(self.server)
        return tensors, extra

    def load_state(self, tensors: dict[str, Any], state: dict[str, Any]) -> None:
        names = list(self.model.parameter_shapes())  # the model's own order
        self.w = {k: tensors[f"w.{k}"] for k in names}
        self.w_prev = {k: tensors[f"w_prev.{k}"] for k in names}
        self.iteration = int(state["round"])
        self.wall, self.compute = float(state["wall_time_s"]), float(state["client_compute_s"])
        if f"server_momentum.{names[0]}" in tensors:
            self.server["momentum"] = {k: tensors[f"server_momentum.{k}"] for k in names}
        if "server_clip" in state:
            self.server["clip"] = float(state["server_clip"])
        if self.banded:
            self.plan.load_state_tensors(tensors, state, self.server,  # type: ignore[union-attr]
                                         self.w)
        if self.distributed:
            DistributedDpPlan.load_state_json(state, self.server)

    def _expected_charges(self, t: int) -> list[tuple[int, str, int, str]]:
        """(data round, client id, count, canonical event JSON) of each entry iteration ``t``
        charges, in order (none for an even Upcycled-FL iteration)."""
        assert self.plan is not None
        if self.algorithm == "upcycled" and t % 2 == 0:
            return []
        r = self.data_round(t)
        sel, epochs = self._selection(r)
        if self.plan.kind in ("client", "record"):
            return [(r, cid, 1, canonical_json(event_to_dict(ev)))
                    for cid, ev in self.plan.entries(r, sel, epochs)]
        groups: dict[Any, list[str]] = {}
        for c in sel.tolist():
            groups.setdefault(self.plan.mechanism(int(c)).event(), []).append(str(c))
        return [(r, cid, 1, canonical_json(event_to_dict(ev))) for ev, ids in groups.items()
                for cid in ids]

    def adopt(self, pointer: LedgerPointer) -> None:
        """Check the ledger against a restored state at ``pointer``; never lose or redo spend.

        The ledger may hold charges after the pointer only if they are the write-ahead charges
        of data rounds that the next checkpoint would have covered: a crash after charging and
        before that checkpoint. Replaying those rounds draws the same noise (the seed tree is
        part of the checkpointed configuration), so their charges are adopted rather than made
        twice, and the resumed run ends bitwise equal to an uninterrupted one. Anything else
        (a newer checkpoint existed, or another run's entries) is a rollback and is refused
        (:func:`~fl_examples.core.run.adopt_round_charges`).

        Raises:
            LedgerMismatchError: the ledger lacks the pointer's entry (an older ledger).
            LedgerRollbackError: the state is older than spend that later states depend on.
        """
        assert self.ledger is not None
        self.precharged = adopt_round_charges(
            self.ledger, pointer, run_id=self.algorithm, start=self.iteration,
            window=self.iteration + max(self.cfg.checkpoint_every, 1),
            charges=self._expected_charges, step_name="iteration",
            replays_identically=self.secure is None)


def publication(cfg: UpcycledConfig, ds: FederatedDataset) -> Publication:
    """The run's release policy (:mod:`fl_examples.core.release`)."""
    return Publication(private=cfg.privacy != "none", client_metrics=cfg.eval_client_data,
                       secure=cfg.secure_noise, seed=cfg.seed,
                       heldout=ds.description.get("heldout") if ds.has_heldout else None)


def _zero_nonfinite(local: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """The clients' models with every non-finite one replaced by zeros."""
    ok = torch.ones(k, dtype=torch.bool, device=next(iter(local.values())).device)
    for v in local.values():
        ok &= torch.isfinite(v.reshape(k, -1)).all(dim=1)
    if bool(ok.all()):
        return local
    return {n: torch.where(ok.reshape(k, *([1] * (v.dim() - 1))), v, torch.zeros_like(v))
            for n, v in local.items()}


def run_algorithm(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset, *,
                  iterations: int, out: Path | None = None, resume: bool = False,
                  stop_after: int | None = None) -> dict[str, Any]:
    """Run one algorithm for ``iterations``; returns ``{"history", "model"}``.

    With ``out``, checkpoints go to ``out/checkpoints/<algorithm>/`` every
    ``cfg.checkpoint_every`` iterations; ``resume=True`` continues from the latest one.
    ``stop_after`` ends the run early after that many iterations (to test resuming).
    """
    device = resolve_device(cfg.device)
    model = _model(cfg, ds)  # model/data mismatches fail before any ledger file is created
    plan, calibration = _privacy_plan(algorithm, cfg, ds, iterations)
    # --audit-canaries (client level): M must fit the model, checked before any ledger exists
    canaries = for_plan(plan, cfg.audit_canaries, num_parameters(model),
                        seed=canary_seed(cfg.seed, algorithm)) \
        if cfg.audit_canaries and plan is not None else None
    ledger = _open_ledger(algorithm, cfg, out, resume, plan.neighboring_relation) \
        if plan is not None else None
    run = _Run(algorithm, cfg, ds, device, plan, ledger, model, iterations=iterations,
               calibration=calibration)
    run.canaries = canaries
    drive(run, checkpoints=checkpoint_dir(out, algorithm),
          checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval_every, resume=resume,
          stop_after=stop_after)
    return run.report()


def _open_ledger(algorithm: str, cfg: UpcycledConfig, out: Path | None, resume: bool,
                 relation: Any) -> Ledger:
    """One ledger per (output directory, algorithm), under the relation the plan's
    sensitivity is for; reopened, never reset, by every run."""
    return open_ledger(out, algorithm, population_id=f"{cfg.dataset}|seed={cfg.seed}|{algorithm}",
                       delta=cfg.delta, resume=resume, reopen=True,
                       epsilon_budget=cfg.epsilon_budget, neighboring_relation=relation)
