"""One DP-REC, DP-FedAvg or FedAvg run on the trainer skeleton: a step is one round.

A round draws its clients (DP-REC: |S'| uniform draws with replacement; DP-FedAvg and FedAvg:
Poisson sampling, each client independently at rate q), charges the ledger before anything is
released, trains the clients locally from the global model, and aggregates: every update
REC-encoded and decoded and averaged (DP-REC), clipped, summed and noised once by
:class:`privkit.ClientLevelGaussian` and divided by the expected count q N
(:class:`~fl_examples.core.dp_modes.ClientDpPlan`, DP-FedAvg), or averaged as they are (FedAvg,
the non-private reference). The server step (lr, heavy-ball momentum) is the same for all.
The downlink is counted per participating client (the model, or DP-REC's message history
when shorter).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import privkit
from fl_examples.core.canaries import TrainerCanaries, canary_seed, for_plan, privacy_notes
from fl_examples.core.data import FederatedDataset, Split
from fl_examples.core.distributed import DistributedDpPlan
from fl_examples.core.dp_modes import POPULATION, ClientDpPlan, server_step
from fl_examples.core.local import local_sgd
from fl_examples.core.models import num_parameters
from fl_examples.core.release import Publication
from fl_examples.core.rounds import (
    broadcast,
    client_orders,
    evaluation_row,
    resolve_device,
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
from fl_examples.dprec.accounting import (
    dpfedavg_central_epsilon,
    dpfedavg_round_event,
    dprec_central_epsilon,
)
from fl_examples.dprec.config import (
    ADD_OR_REMOVE_ONE,
    ALGORITHMS,
    FLOAT_BITS,
    DPRecConfig,
    _model,
    check_relation,
    distributed_dpfedavg,
    relation_of,
)
from privkit._journal import canonical_json
from privkit._rng import SecureRandom
from privkit.accountants.rec import AMPLIFICATION_ASSUMPTION, RecDpEvent
from privkit.errors import InvalidParameterError
from privkit.events import NOISE_MULTIPLIER_NOTE, event_to_dict
from privkit.events.mechanisms import NeighboringRelation
from privkit.ledger import Ledger, LedgerPointer
from privkit.mechanisms import rec
from privkit.mechanisms.aggregate import TRUST_ASSUMPTION

__all__ = ["run_algorithm", "num_groups", "RELATION_NAMES"]

#: The report's name of each relation (the ``--relation`` value).
RELATION_NAMES = {"REPLACE_ONE": "replace-one", "ADD_OR_REMOVE_ONE": "add-remove",
                  "REPLACE_SPECIAL": "zero-out"}


def num_groups(cfg: DPRecConfig, ds: FederatedDataset) -> int:
    """M, the number of REC groups of the model under ``cfg.groups`` (1 when DP-REC does not
    run and the grouping is unset)."""
    if cfg.groups is None:
        return 1
    shapes = _model(cfg, ds).parameter_shapes()
    return len(rec._group_index(rec._check_grouping(cfg.groups), None,  # noqa: SLF001
                                [math.prod(s) for s in shapes.values()]))


class _Run(TrainerRun):
    """One algorithm's run (:class:`~fl_examples.core.run.TrainerRun`); a step is one round."""

    save_at_end = True  # the end of the run, or its budget stop, is always checkpointed

    def __init__(self, algorithm: str, cfg: DPRecConfig, ds: FederatedDataset,
                 ledger: Ledger | None, z: float | None, stddev: float | None = None,
                 distributed: DistributedDpPlan | None = None) -> None:
        cfg = cfg.resolved((algorithm,), check=False)
        self.algorithm, self.cfg, self.ds, self.z = algorithm, cfg, ds, z
        # DP-REC's sigma (the other algorithms have none)
        self.sigma = float(cfg.stddev if stddev is None else stddev) \
            if algorithm == "dprec" else None
        self.device = resolve_device(cfg.device)
        self.model = _model(cfg, ds)
        self.shapes = self.model.parameter_shapes()
        self.d = num_parameters(self.model)
        self.tree = SeedTree(cfg.seed)
        self.train = to_client_data(ds.padded(Split.TRAIN), self.device, torch.float32)
        self.test = to_client_data(ds.padded(Split.TEST), self.device, torch.float32)
        self.heldout = None if ds.x_heldout is None else to_client_data(
            ds.heldout_padded(), self.device, torch.float32)
        self.pub = Publication(private=algorithm != "fedavg",
                               client_metrics=cfg.eval_client_data, secure=cfg.secure_noise,
                               seed=cfg.seed, heldout=ds.description.get("heldout")
                               if ds.has_heldout else None)
        self.loss_key = self.pub.loss_key
        # the samples, REC selections and noise: the OS CSPRNG, or the seed tree (simulation)
        self.secure = SecureRandom() if cfg.secure_noise and algorithm != "fedavg" else None
        init = self.model.init(1, generator=self.tree.torch(0, "init", "cpu"), device=self.device)
        self.w = {k: v[0] for k, v in init.items()}
        self.ledger = ledger
        self.n = ds.num_clients
        self.q = cfg.client_rate_for(self.n)
        self.relation = None if algorithm == "fedavg" else relation_of(cfg, algorithm)
        # DP-FedAvg's aggregate and both Poisson-sampled algorithms' sampler (FedAvg uses
        # only the sampler, so its noise multiplier is a placeholder)
        self.plan = ClientDpPlan(self.n, self.q, cfg.l2_clip, z if z is not None else 1.0,
                                 server_lr=cfg.server_lr, server_momentum=cfg.server_momentum)
        if distributed is not None and algorithm == "dpfedavg":  # --aggregation distributed
            self.plan = distributed  # type: ignore[assignment]
        self._drawn: tuple[int, np.ndarray] | None = None  # the last round's sample
        self._eps_cache: dict[int, float] = {}
        self.server: dict[str, Any] = {}  # the server's momentum buffer ("momentum")
        self.round = 0
        self.history: list[dict[str, Any]] = []
        self.up = self.down = 0
        self.up_no_seed = 0
        self.messages = 0  # client messages sent (a count of the secret samples)
        self.wall = self.compute = 0.0
        self.seen_seeds: set[bytes] = set()
        self.last_seen: dict[int, int] = {}
        self.round_bits: list[int] = []  # message bits of each completed round (history)
        self.stopped: str | None = None
        self._budget_rounds: int | None = None
        # round -> clients whose charge for it is already in the ledger (adopted on resume)
        self.precharged: dict[int, set[str]] = {}
        self.num_groups = num_groups(cfg, ds)
        # --audit-canaries: canary clients in DP-FedAvg's noisy sums
        self.canaries: TrainerCanaries | None = for_plan(
            self.plan, cfg.audit_canaries, self.d, seed=canary_seed(cfg.seed, algorithm)) \
            if cfg.audit_canaries and algorithm == "dpfedavg" else None

    # -- the run protocol -------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.round

    def finished(self) -> bool:
        return self.round >= self.cfg.rounds

    def remaining(self) -> int:
        return self.cfg.rounds - self.round

    def draws(self, t: int) -> np.ndarray:
        """Round ``t``'s clients: DP-REC's |S'| draws with replacement, else a Poisson sample
        at rate q (sorted; possibly empty); from the OS CSPRNG with ``secure_noise``."""
        if self.algorithm == "dprec":
            if self.secure is not None:
                u = np.asarray(self.secure.uniform(self.cfg.clients_per_round))
                return np.minimum((u * self.n).astype(np.int64), self.n - 1)
            return self.tree.numpy(t, "rec-draws").integers(0, self.n,
                                                            size=self.cfg.clients_per_round)
        sel = self.plan.select(self.tree, t, self.secure)
        self._drawn = (t, sel)  # a distributed round's charge depends on its sample's size
        return sel

    @property
    def distributed(self) -> bool:
        """DP-FedAvg with distributed DP (:mod:`fl_examples.core.distributed`)."""
        return isinstance(self.plan, DistributedDpPlan)

    def charges(self, t: int) -> list[tuple[int, list[str]]]:
        """(count, client ids) of each ledger batch round ``t`` charges, in order. DP-REC: a
        client drawn c times in the round is charged c uses at once; DP-FedAvg: one release
        for the whole population every round, whoever was sampled (none for FedAvg)."""
        if self.algorithm == "dpfedavg" and self.distributed:
            # one release of the population, or nothing for a round skipped (a sample below
            # min_survivors); an OS-CSPRNG sample that is not this round's cannot be replayed
            if self._drawn is not None and self._drawn[0] == t:
                sel = self._drawn[1]
            elif self.secure is not None:
                return [(1, [POPULATION])]
            else:
                sel = self.draws(t)
            return [] if self.plan.skips(sel) else [(1, [POPULATION])]
        if self.algorithm == "dpfedavg":
            return [(1, [POPULATION])]
        if self.algorithm == "fedavg":
            return []
        counts: dict[int, int] = {}
        for c in self.draws(t).tolist():
            counts[int(c)] = counts.get(int(c), 0) + 1
        return [(cnt, [str(c) for c, n in counts.items() if n == cnt])
                for cnt in sorted(set(counts.values()))]

    def central_after(self, t: int) -> float:
        """The central epsilon after ``t`` rounds (0 for FedAvg, which charges nothing)."""
        if self.algorithm == "dprec":
            return dprec_central_epsilon(self.cfg, self.n, t, self.num_groups, self.sigma)
        if self.algorithm == "fedavg":
            return 0.0
        if self.distributed:  # released rounds so far; later rounds counted as released
            done = int(self.server.get("distributed", {}).get("released", 0))
            k = done + t - self.round if t >= self.round else min(done, t)
            if k not in self._eps_cache:
                self._eps_cache[k] = 0.0 if k == 0 else privkit.epsilon(
                    privkit.SelfComposedDpEvent(self.plan.round_event(), k), self.cfg.delta,
                    neighboring_relation=self.relation).epsilon
            return self._eps_cache[k]
        assert self.z is not None
        return dpfedavg_central_epsilon(self.z, self.cfg, self.n, t)

    def charge_event(self) -> Any:
        """The event each ledger charge records: one REC message (DP-REC, the client's own,
        no amplification) or one Poisson-sampled round of the aggregate (DP-FedAvg)."""
        if self.algorithm == "dprec":
            return RecDpEvent(self.sigma / self.cfg.l2_clip, 1 << self.cfg.bits,
                              self.num_groups, "REPLACE_ONE")
        if self.distributed:
            return self.plan.round_event()
        assert self.z is not None
        return dpfedavg_round_event(self.z, self.q, self.relation)

    def budget_rounds(self) -> int:
        """The most rounds whose central epsilon stays within the budget (epsilon grows with
        the rounds: bisection, computed once)."""
        if self._budget_rounds is None:
            budget = self.cfg.epsilon_budget
            lo, hi = 0, self.cfg.rounds
            if budget is not None and self.central_after(hi) > budget:
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if self.central_after(mid) <= budget else (lo, mid)
            else:
                lo = hi
            self._budget_rounds = lo
        return self._budget_rounds

    def step(self) -> bool:
        """One round; False (nothing charged, encoded or drawn) when the central epsilon after
        it would exceed the budget."""
        cfg, t = self.cfg, self.round + 1
        if cfg.epsilon_budget is not None and t > self.budget_rounds():
            self.stopped = (f"stopped before round {t}: central epsilon would be "
                            f"{self.central_after(t):.4g} > budget {cfg.epsilon_budget:g}")
            return False
        start = time.perf_counter()
        sel = self.draws(t)
        # Write-ahead: the round is charged before anything is released. Charges a crashed
        # run already wrote for this very round are not made twice (the round replays the
        # same draws, seeds and noise: see adopt).
        done = self.precharged.pop(t, set())
        assert self.ledger is not None or self.algorithm == "fedavg"
        for cnt, ids in self.charges(t):
            todo = [c for c in ids if c not in done]
            if todo and self.ledger is not None:
                self.ledger.spend(todo, self.charge_event(), count=cnt,
                                  label="client message" if self.algorithm == "dprec"
                                  else "aggregate release", round=t, run_id=self.algorithm)
        self._downlink(t, sorted({int(c) for c in sel.tolist()}))
        self.messages += len(sel)
        t0 = time.perf_counter()
        local = self._local(t, sel)
        self.compute += time.perf_counter() - t0
        if self.algorithm == "dpfedavg" and self.distributed:
            # each sampled client encodes its update with its own Skellam share, the server
            # decodes the modular sum / q N (a sample below min_survivors: skipped, nothing
            # sent); the uplink is bits per rotated coordinate
            self.w = self.plan.release(self.w, local, self.server, sel=sel,  # type: ignore[call-arg]
                                       data_round=t, tree=self.tree, secure=self.secure,
                                       canaries=self.canaries)
            self.up += 0 if self.plan.skips(sel) else (  # type: ignore[attr-defined]
                self.plan.bits * self.plan.padded_dim * len(sel))  # type: ignore[attr-defined]
        elif self.algorithm == "dpfedavg":
            # clip each update to C, one N(0, (z C)^2) draw on the sum (drawn also when no
            # client was sampled), / q N, then the server step
            noise = self.secure or self.tree.torch(t, "noise", self.device)
            self.w = self.plan.release(self.w, local, self.server, noise, canaries=self.canaries)
            self.up += FLOAT_BITS * self.d * len(sel)
        else:
            updates = [{k: (local[k][j] - self.w[k]).to(torch.float64) for k in self.w}
                       for j in range(len(sel))]
            if self.algorithm == "dprec":
                mean = self._dprec_aggregate(t, updates)
            else:
                mean = self._fedavg_aggregate(updates)
            if mean is not None:
                self._server_step(mean)
        self.round = t
        self.wall += time.perf_counter() - start
        return True

    def _local(self, t: int, sel: np.ndarray) -> dict[str, torch.Tensor]:
        """The selected clients' local models, stacked (no rows when none was selected).
        Under Poisson sampling (DP-FedAvg, FedAvg) each client's batch order comes from its
        own stream: its update never depends on who else was sampled."""
        if len(sel) == 0:
            return {k: v.unsqueeze(0)[:0] for k, v in self.w.items()}
        idx = torch.as_tensor(sel, device=self.device)
        cfg = self.cfg
        data = select(self.train, idx)
        kw: dict[str, Any] = {"generator": self.tree.torch(t, "batches", self.device)}
        if self.algorithm != "dprec":
            ep = torch.full((len(sel),), cfg.local_epochs, dtype=torch.long, device=self.device)
            kw = {"order": client_orders(self.tree, t, sel, data.sizes, ep, self.device)}
        return local_sgd(self.model, broadcast(self.w, len(sel)), self.w, data,
                         epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                         momentum=0.0, **kw)

    def _server_step(self, mean: dict[str, torch.Tensor]) -> None:
        """:func:`~fl_examples.core.dp_modes.server_step` (the step ClientDpPlan.release
        applies to DP-FedAvg's noisy mean) in float64, back in the model's dtype."""
        new = server_step({k: v.to(torch.float64) for k, v in self.w.items()}, mean,
                          self.server, lr=self.cfg.server_lr, momentum=self.cfg.server_momentum)
        self.w = {k: v.to(self.w[k].dtype) for k, v in new.items()}

    def receive(self, msg: rec.RecMessage) -> dict[str, Any]:
        """Server side of one message: refuse a seed seen before (shared candidates would
        correlate messages), then decode. The seen seeds are part of the checkpoint."""
        if msg.seed in self.seen_seeds:
            raise InvalidParameterError("message.seed", msg.seed.hex(),
                                        "a seed never seen before (message refused)")
        self.seen_seeds.add(msg.seed)
        return rec.decode(msg, self.shapes, device=self.device)

    def _dprec_aggregate(self, t: int, updates: list[dict[str, Any]]) -> dict[str, Any]:
        cfg = self.cfg
        seed_rng = self.tree.numpy(t, "rec-seeds")
        select_rng = self.tree.numpy(t, "rec-selection")
        total = {k: torch.zeros(s, dtype=torch.float64, device=self.device)
                 for k, s in self.shapes.items()}
        bits = 0
        for u in updates:
            if not all(bool(torch.isfinite(v).all()) for v in u.values()):
                u = {k: torch.zeros_like(v) for k, v in u.items()}  # said nowhere
            # secure: a fresh OS seed and the OS CSPRNG's selection (rec.encode's default)
            seed, pick = (None, None) if self.secure is not None else (
                seed_rng.bytes(rec.SEED_BYTES), select_rng)
            msg = rec.encode(u, l2_clip_norm=cfg.l2_clip, stddev=self.sigma, bits=cfg.bits,
                             groups=cfg.groups, seed=seed, rng=pick)
            dec = self.receive(rec.RecMessage.from_bytes(msg.to_bytes()))
            for k in total:
                total[k] += dec[k]
            bits += msg.size_bits()
            self.up_no_seed += msg.size_bits(include_seed=False)
        self.up += bits
        self.round_bits.append(bits)
        return {k: v / len(updates) for k, v in total.items()}

    def _fedavg_aggregate(self, updates: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The plain mean of the sampled clients' updates (None when no client was sampled)."""
        self.up += FLOAT_BITS * self.d * len(updates)
        if not updates:
            return None
        return {k: sum(u[k] for u in updates) / len(updates) for k in self.w}

    def _downlink(self, t: int, clients: list[int]) -> None:
        # the full server state: the model, and the momentum buffer when there is one
        full = FLOAT_BITS * self.d * (2 if self.cfg.server_momentum else 1)
        for c in clients:
            if self.algorithm == "dprec" and self.cfg.history_compression:
                last = self.last_seen.get(c)
                hist = sum(self.round_bits[(last or 1) - 1:t - 1])
                hist += 0 if last is not None else 8 * rec.SEED_BYTES  # init seed
                self.down += 1 + min(full, hist)
            else:
                self.down += full
            self.last_seen[c] = t

    def evaluate(self) -> dict[str, Any]:
        """One history row: held-out metrics, the clients' metrics for the non-private
        reference (or with ``eval_client_data``), bits, and the central epsilon so far."""
        row: dict[str, Any] = {"iteration": self.round}
        row |= evaluation_row(self.model, self.w, heldout=self.heldout, train=self.train,
                              test=self.test, evaluate_clients=self.pub.evaluate_clients)
        if not math.isfinite(row[self.loss_key]):
            raise FloatingPointError(f"{self.algorithm}: diverged at round {self.round}")
        row |= {"wall_time_s": self.wall, "client_compute_s": self.compute,
                "cumulative_bits": self.up + self.down, "uplink_bits": self.up,
                "downlink_bits": self.down}
        if self.algorithm != "fedavg":
            row["epsilon"] = self.central_after(self.round)
        self.history.append(row)
        return row

    # -- checkpoints ------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model, the server state (momentum buffer, seen seeds, downlink bookkeeping),
        bit counters and the noise. Every random stream is derived from the seed tree by
        round, so no generator state is needed."""
        tensors = {f"w.{k}": v for k, v in self.w.items()}
        if "momentum" in self.server:
            tensors |= {f"server_momentum.{k}": v for k, v in self.server["momentum"].items()}
        seeds = b"".join(sorted(self.seen_seeds))
        tensors["seen_seeds"] = torch.frombuffer(bytearray(seeds), dtype=torch.uint8).reshape(
            len(self.seen_seeds), rec.SEED_BYTES) if seeds else torch.zeros(
            (0, rec.SEED_BYTES), dtype=torch.uint8)
        return tensors, {
            "dpfedavg_noise": self.z, "stddev": self.sigma,
            "epsilon_central": self.central_after(self.round),
            "uplink_bits": self.up, "downlink_bits": self.down, "messages": self.messages,
            "uplink_bits_without_seeds": self.up_no_seed, "round_bits": self.round_bits,
            "last_seen": {str(c): r for c, r in sorted(self.last_seen.items())},
            "wall_time_s": self.wall, "client_compute_s": self.compute,
        } | DistributedDpPlan.state_json(self.server)

    def same_config(self, state: dict[str, Any]) -> bool:
        return (super().same_config(state) and state.get("dpfedavg_noise") == self.z
                and state.get("stddev") == self.sigma)

    def load_state(self, tensors: dict[str, Any], state: dict[str, Any]) -> None:
        self.w = {k: tensors[f"w.{k}"] for k in self.shapes}
        if f"server_momentum.{next(iter(self.shapes))}" in tensors:
            self.server["momentum"] = {k: tensors[f"server_momentum.{k}"] for k in self.shapes}
        self.seen_seeds = {bytes(row) for row in tensors["seen_seeds"].cpu().numpy()}
        self.round = int(state["round"])
        self.up, self.down = int(state["uplink_bits"]), int(state["downlink_bits"])
        self.messages = int(state["messages"])
        self.up_no_seed = int(state["uplink_bits_without_seeds"])
        self.round_bits = [int(b) for b in state["round_bits"]]
        self.last_seen = {int(c): int(r) for c, r in state["last_seen"].items()}
        self.wall, self.compute = float(state["wall_time_s"]), float(state["client_compute_s"])
        DistributedDpPlan.load_state_json(state, self.server)  # distributed: round counts

    def adopt(self, pointer: LedgerPointer) -> None:
        """Check the ledger against the state at ``pointer``; never lose or redo spend.

        Charges are written before a round releases anything, and checkpoints come every
        ``checkpoint_every`` rounds, so a crash can leave charges of up to that many rounds
        after the checkpoint's pointer (a round charged but not checkpointed). They must be
        exactly the charges those rounds make (same clients, counts, event, round and run,
        in order; a round may be cut between batches): they are adopted, the rounds replay
        with the same draws, seeds, selection and noise (all from the seed tree by round), and
        their charges are not made twice, so the resumed run ends bitwise equal to an
        uninterrupted one. Anything else (charges of a later round, i.e. a newer checkpoint
        existed, or another run's entries) is a rollback and is refused
        (:func:`~fl_examples.core.run.adopt_round_charges`).

        Raises:
            LedgerMismatchError: the ledger has no entry with the pointer's seq and hash (an
                older ledger than the checkpoint, or another one).
            LedgerRollbackError: spend recorded after the pointer that this state cannot
                account for.
        """
        assert self.ledger is not None
        event = canonical_json(event_to_dict(self.charge_event()))

        def charges(t: int) -> list[tuple[int, Any, Any, str]]:
            if self.secure is not None and self.algorithm == "dprec":
                return [(t, None, None, event)]  # the draws cannot be replayed: any client
            return [(t, cid, cnt, event) for cnt, ids in self.charges(t) for cid in ids]

        self.precharged = adopt_round_charges(
            self.ledger, pointer, run_id=self.algorithm, start=self.round,
            window=self.round + max(self.cfg.checkpoint_every, 1), charges=charges,
            replays_identically=self.secure is None)

    # -- report -----------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """History, privacy and communication sections (and ``_model``, the final parameters,
        which the report leaves out)."""
        cfg, algorithm = self.cfg, self.algorithm
        comm = {"uplink_bits": self.up, "downlink_bits": self.down,
                "float32_uplink_bits": FLOAT_BITS * self.d * self.messages,
                "messages": self.messages, "parameters": self.d}
        if algorithm == "dprec":
            comm |= {"uplink_bits_without_seeds": self.up_no_seed,
                     "bits_per_message": (8 * rec.SEED_BYTES + self.num_groups * cfg.bits),
                     "history_compression": cfg.history_compression}
        privacy = self._privacy() if algorithm != "fedavg" else {
            "non_private": True, "epsilon_central": None, "rounds_run": self.round,
            "client_rate": self.q, "note": "non-private reference: DP-FedAvg's Poisson "
            "sampling and server step, no clipping, no noise, nothing charged: every number "
            "it reports is computed without privacy"}
        out = {"history": self.history, "privacy": privacy, "communication": comm,
               "_model": {k: v.detach().cpu() for k, v in self.w.items()}}
        if self.canaries is not None:
            privacy_notes(privacy, self.canaries)
            out["_canaries"] = self.canaries
        return out

    def _not_covered(self) -> list[tuple[str, str]]:
        """What a private algorithm's report holds outside its epsilon (beside the
        timings): counts of the secret samples, and the server's own records."""
        sample = ("counts the clients in each round's secret sample" if self.algorithm ==
                  "dpfedavg" else "counts the distinct clients each round drew (the secret "
                  "draws)")
        items = [("downlink_bits, cumulative_bits, communication.downlink_bits", sample)]
        if self.algorithm == "dpfedavg":
            items.append(("uplink_bits, communication.uplink_bits, messages, "
                          "float32_uplink_bits", sample))
        items.append((f"OUT/ledger-{self.algorithm}.jsonl and the checkpoints",
                      "the server's own records of who took part when: against a reader of "
                      "them only the local (unamplified) epsilon holds"))
        return items

    def _privacy(self) -> dict[str, Any]:
        """The privacy section of DP-REC or DP-FedAvg: the central epsilon (the headline, also
        ``epsilon_max``), the local or unamplified one at public participation counts, and
        what the run treats as public and does not cover."""
        cfg, algorithm = self.cfg, self.algorithm
        assert self.ledger is not None and self.relation is not None
        relation = RELATION_NAMES[self.relation.name]
        central = self.central_after(self.round)
        privacy: dict[str, Any] = {
            "delta": cfg.delta, "neighboring_relation": self.relation.name,
            "relation": relation, "epsilon_central": central, "epsilon_max": central,
            "epsilon_mean": central, "per_client": [central] * self.n, "rounds_run": self.round,
            "epsilon_per_round": [h["epsilon"] for h in self.history],
        }
        public = [f"N = {self.n}: the number of clients", "the number of rounds"]
        if algorithm == "dprec":
            k_exp = max(1, math.ceil(self.round * cfg.clients_per_round / self.n))
            ev = self.charge_event()

            def local(k: int) -> float:
                return privkit.epsilon(privkit.SelfComposedDpEvent(ev, k), cfg.delta, "rdp",
                                       neighboring_relation=self.relation).epsilon

            privacy |= {
                "epsilon_local": {
                    "expected_messages": k_exp, "epsilon_at_expected": local(k_exp),
                    "note": "no amplification (against the server, which knows who was "
                            "drawn): a client's own messages composed, here at the expected "
                            "count T |S'| / N; the ledger holds each client's own"},
                "method": "rdp", "central_assumptions": [AMPLIFICATION_ASSUMPTION],
                "mechanism": "rec", "stddev": self.sigma,
                "noise_multiplier": self.sigma / cfg.l2_clip,
                "num_candidates": 1 << cfg.bits, "num_groups": self.num_groups,
                "relation_note": "replace-one only: the REC bound with with-replacement "
                                 "amplification is proven under replace-one (privkit spec)",
                "bound": "Theorem R (derived; privkit spec), with-replacement sampling "
                         "(Wang-Balle-Kasiviswanathan Thm 9)"}
            public.append(f"|S'| = {cfg.clients_per_round} draws per round")
        elif self.distributed:  # no trusted aggregator: the plan's own section
            rep = self.plan.report(self.ledger, self.n, self.server)  # type: ignore[call-arg]
            privacy |= {k: v for k, v in rep.items() if k not in (
                "per_client", "public", "delta", "epsilon_max", "epsilon_mean", "proven",
                "neighboring_relation", "assumptions")}
            privacy |= {"epsilon_ledger": rep["epsilon_max"], "trust_assumption": rep["trust"],
                        "central_assumptions": rep["assumptions"],
                        "epsilon_central_note": "released rounds composed (a skipped round "
                                                "charges nothing)"}
            public += rep["public"][1:-1]
        else:
            assert self.z is not None
            unamp = self.plan.unamplified(self.round, cfg.delta, self.relation)
            ev = self.charge_event()
            privacy |= {
                "epsilon_ledger": self.ledger.epsilons([POPULATION])[POPULATION]
                if self.round else 0.0,
                "epsilon_unamplified": unamp,
                "method": "privkit.epsilon (auto: smallest valid bound)",
                "trust": TRUST_ASSUMPTION, "trust_assumption": TRUST_ASSUMPTION,
                "central_assumptions": [
                    TRUST_ASSUMPTION, "Poisson client sampling at rate q whose outcome stays "
                    "secret from everyone but the server (amplification used)",
                    f"{relation}: neighbouring federations differ in one whole client"],
                "mechanism": "client_level_gaussian (DP-FedAvg)", "noise_multiplier": self.z,
                "noise_multiplier_note": NOISE_MULTIPLIER_NOTE,
                "event_noise_multiplier": float(getattr(ev, "event", ev).noise_multiplier),
                "noise_stddev_of_sum": self.z * cfg.l2_clip,
                "noise_stddev": self.z * cfg.l2_clip / (self.q * self.n),
                "l2_clip_norm": cfg.l2_clip, "client_rate": self.q,
                "expected_clients": self.q * self.n, "server_lr": cfg.server_lr,
                "server_momentum": cfg.server_momentum}
            if self.relation == ADD_OR_REMOVE_ONE and self.round:
                ro = NeighboringRelation.REPLACE_ONE
                privacy["epsilon_replace_one"] = privkit.epsilon(privkit.SelfComposedDpEvent(
                    dpfedavg_round_event(self.z, self.q, ro), self.round), cfg.delta,
                    neighboring_relation=ro).epsilon
            public.append(f"q = {self.q:g} and the divisor q N = {self.q * self.n:g}")
        privacy |= self.pub.notes(proven_maths=True, public=public,
                                  dataset_description=self.ds.description,
                                  extra_not_covered=self._not_covered())
        if self.stopped:
            privacy["stopped"] = self.stopped
        return privacy


def _open_ledger(algorithm: str, cfg: DPRecConfig, out: Path | None,
                 resume: bool = False) -> Ledger:
    """The run's ledger: ``OUT/ledger-<algorithm>.jsonl``, reopened (never reset) on resume;
    it records the relation, and a resume under another one is refused."""
    return open_ledger(
        out, algorithm, population_id=f"{cfg.dataset}|clients={cfg.clients}|seed={cfg.seed}|"
        f"{algorithm}", delta=cfg.delta, resume=resume,
        neighboring_relation=relation_of(cfg, algorithm))


def run_algorithm(algorithm: str, cfg: DPRecConfig, ds: FederatedDataset, *,
                  z: float | None = None, stddev: float | None = None,
                  out: Path | None = None, resume: bool = False,
                  stop_after: int | None = None,
                  distributed: DistributedDpPlan | None = None) -> dict[str, Any]:
    """Run one algorithm; returns history, communication and privacy sections (and
    ``_model``, the final parameters, which the report leaves out).

    ``z`` is DP-FedAvg's noise multiplier (the sum's noise stddev / C); ``stddev`` DP-REC's
    sigma (default ``cfg.stddev``). With ``out`` and ``cfg.checkpoint_every``, checkpoints go
    to ``out/checkpoints/<algorithm>/`` every that many rounds and at the end; ``resume=True``
    continues from the latest one (the ledger is reopened, never reset). ``stop_after`` ends
    the run after that many rounds (to test resuming). ``distributed``: DP-FedAvg's plan
    under ``aggregation="distributed"`` (built by :func:`fl_examples.dprec.train`; ``z`` is
    then its noise multiplier).
    """
    if algorithm not in ALGORITHMS:
        raise InvalidParameterError("algorithm", algorithm, "dprec, dpfedavg or fedavg")
    if algorithm == "dpfedavg" and z is None:
        raise InvalidParameterError("dpfedavg_noise", None, "given or calibrated")
    check_relation(cfg, algorithm)
    cfg = cfg.resolved((algorithm,), check=False).for_clients(ds.num_clients)
    if algorithm == "dpfedavg" and cfg.distributed:  # z: the released sum's guaranteed noise
        if distributed is None:
            distributed, _ = distributed_dpfedavg(cfg, ds, noise_multiplier=z)
        z = distributed.noise_multiplier
    ledger = None if algorithm == "fedavg" else _open_ledger(algorithm, cfg, out, resume)
    run = _Run(algorithm, cfg, ds, ledger, z, stddev, distributed)
    drive(run, checkpoints=checkpoint_dir(out, algorithm),
          checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval_every, resume=resume,
          stop_after=stop_after)
    return run.report()
