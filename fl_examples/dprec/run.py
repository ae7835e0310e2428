"""One DP-REC or DP-FedAvg run on the trainer skeleton: a step is one round.

A round draws its clients (with replacement for DP-REC), charges them on the ledger before
anything is released, trains them locally from the global model, and aggregates: every update
REC-encoded and decoded (DP-REC), or clipped, summed and noised (DP-FedAvg). The downlink is
counted per participating client (the model, or the message history when shorter).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_examples.core.data import FederatedDataset, Split
from fl_examples.core.local import local_sgd
from fl_examples.core.models import num_parameters
from fl_examples.core.rounds import (
    broadcast,
    evaluate,
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
from fl_examples.dprec.accounting import dpfedavg_central_epsilon, dprec_central_epsilon
from fl_examples.dprec.config import ALGORITHMS, FLOAT_BITS, REPLACE_ONE, DPRecConfig, _model
from privkit._journal import canonical_json
from privkit.accountants.rec import AMPLIFICATION_ASSUMPTION, RecDpEvent
from privkit.errors import InvalidParameterError
from privkit.events import GaussianDpEvent, event_to_dict
from privkit.ledger import Ledger, LedgerPointer
from privkit.mechanisms import rec, sampling

__all__ = ["run_algorithm"]


class _Run(TrainerRun):
    """One algorithm's run (:class:`~fl_examples.core.run.TrainerRun`); a step is one round."""

    save_at_end = True  # the end of the run, or its budget stop, is always checkpointed

    def __init__(self, algorithm: str, cfg: DPRecConfig, ds: FederatedDataset,
                 ledger: Ledger, z: float | None) -> None:
        self.algorithm, self.cfg, self.ds, self.z = algorithm, cfg, ds, z
        self.device = resolve_device(cfg.device)
        self.model = _model(cfg, ds)
        self.shapes = self.model.parameter_shapes()
        self.d = num_parameters(self.model)
        self.tree = SeedTree(cfg.seed)
        self.train = to_client_data(ds.padded(Split.TRAIN), self.device, torch.float32)
        self.test = to_client_data(ds.padded(Split.TEST), self.device, torch.float32)
        init = self.model.init(1, generator=self.tree.torch(0, "init", "cpu"), device=self.device)
        self.w = {k: v[0] for k, v in init.items()}
        self.ledger = ledger
        self.n = ds.num_clients
        self.round = 0
        self.history: list[dict[str, Any]] = []
        self.up = self.down = 0
        self.up_no_seed = 0
        self.wall = self.compute = 0.0
        self.seen_seeds: set[bytes] = set()
        self.last_seen: dict[int, int] = {}
        self.round_bits: list[int] = []  # message bits of each completed round (history)
        self.epsilon = 0.0
        self.stopped: str | None = None
        # round -> clients whose charge for it is already in the ledger (adopted on resume)
        self.precharged: dict[int, set[str]] = {}
        self.num_groups = len(rec._group_index(  # noqa: SLF001
            rec._check_grouping(cfg.groups), None,  # noqa: SLF001
            [math.prod(s) for s in self.shapes.values()]))

    # -- the run protocol -------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.round

    def finished(self) -> bool:
        return self.round >= self.cfg.rounds

    def remaining(self) -> int:
        return self.cfg.rounds - self.round

    def draws(self, t: int) -> np.ndarray:
        k = self.cfg.clients_per_round
        if self.algorithm == "dprec":
            return self.tree.numpy(t, "rec-draws").integers(0, self.n, size=k)
        return sample_clients(self.tree, t, self.n, min(k, self.n) / self.n)

    def charges(self, t: int) -> list[tuple[int, list[str]]]:
        """(count, client ids) of each ledger batch round ``t`` charges, in order: a client
        drawn c times in the round (with replacement) is charged c uses at once."""
        counts: dict[int, int] = {}
        for c in self.draws(t).tolist():
            counts[int(c)] = counts.get(int(c), 0) + 1
        return [(cnt, [str(c) for c, n in counts.items() if n == cnt])
                for cnt in sorted(set(counts.values()))]

    def central_after(self, t: int) -> float:
        if self.algorithm == "dprec":
            return dprec_central_epsilon(self.cfg, self.n, t, self.num_groups)
        assert self.z is not None
        return dpfedavg_central_epsilon(self.z, self.cfg, self.n, t)

    def local_event(self) -> Any:
        if self.algorithm == "dprec":
            return RecDpEvent(self.cfg.stddev / self.cfg.l2_clip, 1 << self.cfg.bits,
                              self.num_groups, "REPLACE_ONE")
        assert self.z is not None
        return GaussianDpEvent(self.z)

    def step(self) -> bool:
        """One round; False (nothing charged, encoded or drawn) when the central epsilon after
        it would exceed the budget."""
        cfg, t = self.cfg, self.round + 1
        eps_next = self.central_after(t)
        if cfg.epsilon_budget is not None and eps_next > cfg.epsilon_budget:
            self.stopped = (f"stopped before round {t}: central epsilon would be "
                            f"{eps_next:.4g} > budget {cfg.epsilon_budget:g}")
            return False
        start = time.perf_counter()
        sel = self.draws(t)
        # Write-ahead: every participating client is charged before anything is released.
        # Charges a crashed run already wrote for this very round are not made twice (the
        # round replays the same draws, seeds and noise: see adopt).
        done = self.precharged.pop(t, set())
        for cnt, ids in self.charges(t):
            todo = [c for c in ids if c not in done]
            if todo:
                self.ledger.spend(todo, self.local_event(), count=cnt, label="client message",
                                  round=t, run_id=self.algorithm)
        self._downlink(t, sorted({int(c) for c in sel.tolist()}))
        idx = torch.as_tensor(sel, device=self.device)
        data = select(self.train, idx)
        t0 = time.perf_counter()
        local = local_sgd(self.model, broadcast(self.w, len(sel)), self.w, data,
                          epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                          momentum=0.0, generator=self.tree.torch(t, "batches", self.device))
        self.compute += time.perf_counter() - t0
        updates = [{k: (local[k][j] - self.w[k]).to(torch.float64) for k in self.w}
                   for j in range(len(sel))]
        if self.algorithm == "dprec":
            delta = self._dprec_aggregate(t, updates)
        else:
            delta = self._dpfedavg_aggregate(t, updates)
        self.w = {k: (self.w[k].to(torch.float64) + cfg.server_lr * delta[k]).to(self.w[k].dtype)
                  for k in self.w}
        self.round, self.epsilon = t, eps_next
        self.wall += time.perf_counter() - start
        return True

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
            seed = seed_rng.bytes(rec.SEED_BYTES)
            msg = rec.encode(u, l2_clip_norm=cfg.l2_clip, stddev=cfg.stddev, bits=cfg.bits,
                             groups=cfg.groups, seed=seed, rng=select_rng)
            dec = self.receive(rec.RecMessage.from_bytes(msg.to_bytes()))
            for k in total:
                total[k] += dec[k]
            bits += msg.size_bits()
            self.up_no_seed += msg.size_bits(include_seed=False)
        self.up += bits
        self.round_bits.append(bits)
        return {k: v / len(updates) for k, v in total.items()}

    def _dpfedavg_aggregate(self, t: int, updates: list[dict[str, Any]]) -> dict[str, Any]:
        from privkit.mechanisms.clipping import clip_l2

        cfg = self.cfg
        assert self.z is not None
        total = {k: torch.zeros(s, dtype=torch.float64, device=self.device)
                 for k, s in self.shapes.items()}
        for u in updates:
            cu = clip_l2(u, cfg.l2_clip)
            for k in total:
                total[k] += cu[k]
        sd = 2.0 * cfg.l2_clip * self.z  # replace-one sensitivity of the sum: 2C
        noise = sampling.gaussian_noise(total, sd, rng=self.tree.torch(t, "noise", self.device))
        self.up += FLOAT_BITS * self.d * len(updates)
        return {k: (v + noise[k]) / len(updates) for k, v in total.items()}

    def _downlink(self, t: int, clients: list[int]) -> None:
        full = FLOAT_BITS * self.d
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
        loss, acc = evaluate(self.model, self.w, self.train)
        _, test_acc = evaluate(self.model, self.w, self.test)
        if not math.isfinite(loss):
            raise FloatingPointError(f"{self.algorithm}: diverged at round {self.round}")
        row = {"iteration": self.round, "train_loss": loss, "train_accuracy": acc,
               "test_accuracy": test_acc, "wall_time_s": self.wall,
               "client_compute_s": self.compute, "cumulative_bits": self.up + self.down,
               "uplink_bits": self.up, "downlink_bits": self.down, "epsilon": self.epsilon}
        self.history.append(row)
        return row

    # -- checkpoints ------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model, the server state (seen seeds, downlink bookkeeping), bit counters and
        the DP-FedAvg noise. Every random stream is derived from the seed tree by round, so no
        generator state is needed."""
        tensors = {f"w.{k}": v for k, v in self.w.items()}
        seeds = b"".join(sorted(self.seen_seeds))
        tensors["seen_seeds"] = torch.frombuffer(bytearray(seeds), dtype=torch.uint8).reshape(
            len(self.seen_seeds), rec.SEED_BYTES) if seeds else torch.zeros(
            (0, rec.SEED_BYTES), dtype=torch.uint8)
        return tensors, {
            "dpfedavg_noise": self.z, "epsilon_central": self.epsilon,
            "uplink_bits": self.up, "downlink_bits": self.down,
            "uplink_bits_without_seeds": self.up_no_seed, "round_bits": self.round_bits,
            "last_seen": {str(c): r for c, r in sorted(self.last_seen.items())},
            "wall_time_s": self.wall, "client_compute_s": self.compute,
        }

    def same_config(self, state: dict[str, Any]) -> bool:
        return super().same_config(state) and state.get("dpfedavg_noise") == self.z

    def load_state(self, tensors: dict[str, Any], state: dict[str, Any]) -> None:
        self.w = {k: tensors[f"w.{k}"] for k in self.shapes}
        self.seen_seeds = {bytes(row) for row in tensors["seen_seeds"].cpu().numpy()}
        self.round = int(state["round"])
        self.epsilon = float(state["epsilon_central"])
        self.up, self.down = int(state["uplink_bits"]), int(state["downlink_bits"])
        self.up_no_seed = int(state["uplink_bits_without_seeds"])
        self.round_bits = [int(b) for b in state["round_bits"]]
        self.last_seen = {int(c): int(r) for c, r in state["last_seen"].items()}
        self.wall, self.compute = float(state["wall_time_s"]), float(state["client_compute_s"])

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
        event = canonical_json(event_to_dict(self.local_event()))
        self.precharged = adopt_round_charges(
            self.ledger, pointer, run_id=self.algorithm, start=self.round,
            window=self.round + max(self.cfg.checkpoint_every, 1),
            charges=lambda t: [(t, cid, cnt, event) for cnt, ids in self.charges(t)
                               for cid in ids])

    # -- report -----------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """History, privacy and communication sections (and ``_model``, the final parameters,
        which the report leaves out)."""
        cfg, algorithm, z = self.cfg, self.algorithm, self.z
        eps_local = self.ledger.epsilons([str(i) for i in range(self.n)])
        local = np.array([eps_local[str(i)] for i in range(self.n)])
        messages = self.round * cfg.clients_per_round
        privacy: dict[str, Any] = {
            "delta": cfg.delta, "neighboring_relation": "REPLACE_ONE",
            "epsilon_central": self.epsilon, "epsilon_mean": float(local.mean()),
            "epsilon_max": float(local.max()), "per_client": local.tolist(), "proven": True,
            "method": "rdp", "rounds_run": self.round,
            "epsilon_per_round": [h["epsilon"] for h in self.history],
            "central_assumptions": [AMPLIFICATION_ASSUMPTION] if algorithm == "dprec" else
            ["sampling without replacement whose outcome stays secret; the server adds the "
             "noise (trusted server or secure aggregation)"],
            "local_assumptions": ["no amplification: each client's own messages composed"],
        }
        if algorithm == "dprec":
            privacy |= {"mechanism": "rec", "noise_multiplier": cfg.stddev / cfg.l2_clip,
                        "num_candidates": 1 << cfg.bits, "num_groups": self.num_groups,
                        "bound": "Theorem R (derived; privkit spec), with-replacement sampling "
                                 "(Wang-Balle-Kasiviswanathan Thm 9)"}
        else:
            assert z is not None
            privacy |= {"mechanism": "gaussian_sum", "noise_multiplier": z,
                        "noise_stddev": 2 * cfg.l2_clip * z / cfg.clients_per_round}
        if self.stopped:
            privacy["stopped"] = self.stopped
        comm = {"uplink_bits": self.up, "downlink_bits": self.down,
                "float32_uplink_bits": FLOAT_BITS * self.d * messages, "messages": messages,
                "parameters": self.d}
        if algorithm == "dprec":
            comm |= {"uplink_bits_without_seeds": self.up_no_seed,
                     "bits_per_message": (8 * rec.SEED_BYTES + self.num_groups * cfg.bits),
                     "history_compression": cfg.history_compression}
        return {"history": self.history, "privacy": privacy, "communication": comm,
                "_model": {k: v.detach().cpu() for k, v in self.w.items()}}


def _open_ledger(algorithm: str, cfg: DPRecConfig, out: Path | None,
                 resume: bool = False) -> Ledger:
    """The run's ledger: ``OUT/ledger-<algorithm>.jsonl``, reopened (never reset) on resume."""
    return open_ledger(
        out, algorithm, population_id=f"{cfg.dataset}|clients={cfg.clients}|seed={cfg.seed}|"
        f"{algorithm}", delta=cfg.delta, resume=resume, neighboring_relation=REPLACE_ONE)


def run_algorithm(algorithm: str, cfg: DPRecConfig, ds: FederatedDataset, *,
                  z: float | None = None, out: Path | None = None, resume: bool = False,
                  stop_after: int | None = None) -> dict[str, Any]:
    """Run one algorithm; returns history, communication and privacy sections (and
    ``_model``, the final parameters, which the report leaves out).

    With ``out`` and ``cfg.checkpoint_every``, checkpoints go to
    ``out/checkpoints/<algorithm>/`` every that many rounds and at the end; ``resume=True``
    continues from the latest one (the ledger is reopened, never reset). ``stop_after`` ends
    the run after that many rounds (to test resuming).
    """
    if algorithm not in ALGORITHMS:
        raise InvalidParameterError("algorithm", algorithm, "dprec or dpfedavg")
    if algorithm == "dpfedavg" and z is None:
        raise InvalidParameterError("dpfedavg_noise", None, "given or calibrated")
    run = _Run(algorithm, cfg, ds, _open_ledger(algorithm, cfg, out, resume), z)
    drive(run, checkpoints=checkpoint_dir(out, algorithm),
          checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval_every, resume=resume,
          stop_after=stop_after)
    return run.report()
