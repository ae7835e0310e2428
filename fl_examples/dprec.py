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
older ledger than the other is refused (:meth:`_Run.adopt`).

Run it as ``privkit train dprec --dataset digits --clients 100 --clients-per-round 10
--bits 8 --groups per-layer --l2-clip 0.5 --stddev 1.0 --rounds 200 --compare dpfedavg
--out DIR`` (add ``--checkpoint-every N``, and ``--resume`` after a crash).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_examples.core.data import FederatedDataset, Split, digits, parse_dataset_spec
from fl_examples.core.deep_models import CNN
from fl_examples.core.local import local_sgd
from fl_examples.core.models import MultinomialLogReg, num_parameters
from fl_examples.core.report import Column, text_table, write_report
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
    check_shared_settings,
    checkpoint_dir,
    drive,
    open_ledger,
)
from fl_examples.core.seeds import SeedTree
from privkit import _validate
from privkit._journal import canonical_json
from privkit.accountants import rdp, rules
from privkit.accountants.rec import AMPLIFICATION_ASSUMPTION, RecDpEvent, rec_run_event
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import InvalidParameterError
from privkit.events import (
    GaussianDpEvent,
    SampledWithoutReplacementDpEvent,
    SelfComposedDpEvent,
    event_to_dict,
)
from privkit.ledger import Ledger, LedgerPointer
from privkit.mechanisms import rec, sampling

__all__ = ["ALGORITHMS", "DPRecConfig", "train", "run_algorithm", "calibrate_dpfedavg",
           "dprec_central_epsilon", "dpfedavg_central_epsilon", "final_table"]

ALGORITHMS = ("dprec", "dpfedavg")
REPLACE_ONE = NeighboringRelation.REPLACE_ONE
FLOAT_BITS = 32


@dataclass(frozen=True)
class DPRecConfig:
    """Everything a run needs; saved in the report.

    Attributes:
        dataset: ``digits`` (split over ``clients`` clients, ``digits_classes`` classes each),
            ``synthetic:A,B``, ``femnist:DIR``, ... (:func:`parse_dataset_spec`).
        clients: N for ``digits`` (other data sets bring their own client count).
        digits_classes: classes per client for ``digits`` (0: IID).
        model: ``logreg`` or ``cnn`` (a small CNN: 3 channels, one hidden layer of 100).
        clients_per_round: |S'|, draws per round (with replacement for DP-REC).
        rounds: T.
        bits: b, REC bits per group (K = 2**b).
        groups: REC grouping: ``per-layer`` (= per-tensor), ``whole``, ``per-parameter`` or
            ``chunks:N``.
        l2_clip: C, the update clip norm (both algorithms).
        stddev: sigma, REC prior/target std (DP-REC's noise).
        local_epochs, batch_size, lr: local SGD (no momentum).
        server_lr: FedAvg server step on the averaged update.
        delta: delta of every epsilon.
        epsilon_budget: central-epsilon budget; the run stops before exceeding it.
        dpfedavg_noise: DP-FedAvg noise multiplier z (None: calibrated to DP-REC's epsilon).
        history_compression: send returning clients the message history when shorter.
        seed: root of the seed tree; device: auto, cpu, cuda; eval_every: rounds between
            evaluations.
        checkpoint_every: with an output directory, checkpoint every N rounds (and at the
            end) into ``OUT/checkpoints/<algorithm>/``; 0: never.
    """

    dataset: str = "digits"
    clients: int = 100
    digits_classes: int = 0
    model: str = "logreg"
    clients_per_round: int = 10
    rounds: int = 200
    bits: int = 8
    groups: str = "per-layer"
    l2_clip: float = 0.5
    stddev: float = 1.0
    local_epochs: int = 1
    batch_size: int = 16
    lr: float = 0.5
    server_lr: float = 1.0
    delta: float = 1e-5
    epsilon_budget: float | None = None
    dpfedavg_noise: float | None = None
    history_compression: bool = True
    seed: int = 0
    device: str = "auto"
    eval_every: int = 5
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        _validate.positive_int("clients", self.clients)
        d = _validate.nonnegative_int("digits_classes", self.digits_classes)
        if d > 10:
            raise InvalidParameterError("digits_classes", d, "in [0, 10]")
        if self.model not in ("logreg", "cnn"):
            raise InvalidParameterError("model", self.model, "logreg or cnn")
        _validate.positive_int("clients_per_round", self.clients_per_round)
        _validate.positive_int("rounds", self.rounds)
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) \
                or not rec.MIN_BITS <= self.bits <= rec.MAX_BITS:
            raise InvalidParameterError("bits", self.bits, "an integer in [1, 24]")
        rec._check_grouping(self.groups)  # noqa: SLF001 - same validation as the mechanism
        if self.groups not in ("per-layer", "per-tensor", "whole", "per-parameter") \
                and not self.groups.startswith("chunks:"):
            raise InvalidParameterError("groups", self.groups,
                                        "per-layer, whole, per-parameter or chunks:N")
        _validate.positive("l2_clip", self.l2_clip)
        _validate.positive("stddev", self.stddev)
        _validate.positive("server_lr", self.server_lr)
        if self.dpfedavg_noise is not None:
            _validate.positive("dpfedavg_noise", self.dpfedavg_noise)
        check_shared_settings(self)  # local solver, delta, budget, seed, eval/checkpoint grid


def load_dataset(cfg: DPRecConfig) -> FederatedDataset:
    """``digits`` over ``cfg.clients`` clients, else :func:`parse_dataset_spec`."""
    name = cfg.dataset.strip().lower()
    if name == "digits":
        return digits(rng=cfg.seed, num_clients=cfg.clients,
                      classes_per_client=cfg.digits_classes or None)
    return parse_dataset_spec(cfg.dataset, seed=cfg.seed)


def _model(cfg: DPRecConfig, ds: FederatedDataset) -> Any:
    if cfg.model == "cnn":
        side = math.isqrt(ds.num_features)
        if side * side != ds.num_features:
            raise InvalidParameterError("model", "cnn", "used with square images")
        return CNN(image_size=side, channels=3, hidden=(100,), num_classes=ds.num_classes)
    return MultinomialLogReg(ds.num_features, ds.num_classes)


# ------------------------------------------------------------------ accounting
@functools.lru_cache(maxsize=64)
def _curve(atom: Any) -> np.ndarray:
    """RDP of one use of ``atom`` at privkit's orders (replace-one), computed once."""
    return rules.rdp_curve(atom, rdp.ORDERS, REPLACE_ONE)


def _eps(atom: Any, count: int, delta: float) -> float:
    """epsilon of ``count`` uses of ``atom`` (the RDP accountant's conversion, reused curve)."""
    return rdp.epsilon_from_rdp(rdp.ORDERS, count * _curve(atom), delta)[0]


def dprec_central_epsilon(cfg: DPRecConfig, num_clients: int, rounds: int,
                          num_groups: int = 1) -> float:
    """DP-REC's amplified epsilon after ``rounds`` rounds (T |S'| draws at rate 1/N).

    Equal to ``privkit.epsilon(rec_run_event(...), delta, "rdp",
    neighboring_relation=REPLACE_ONE)``; the one-draw curve is computed once.
    """
    if rounds == 0:
        return 0.0
    ev = rec_run_event(noise_multiplier=cfg.stddev / cfg.l2_clip, num_candidates=1 << cfg.bits,
                       population_size=num_clients, messages=rounds * cfg.clients_per_round,
                       num_groups=num_groups)
    return _eps(ev.event, ev.count, cfg.delta)


def _dpfedavg_event(z: float, num_clients: int, k: int, rounds: int) -> Any:
    inner: Any = GaussianDpEvent(z)
    if k < num_clients:
        inner = SampledWithoutReplacementDpEvent(num_clients, k, inner)
    return SelfComposedDpEvent(inner, rounds)


def dpfedavg_central_epsilon(z: float, cfg: DPRecConfig, num_clients: int, rounds: int) -> float:
    """DP-FedAvg's epsilon: ``rounds`` Gaussian sums, sampling without replacement, replace-one."""
    if rounds == 0:
        return 0.0
    ev = _dpfedavg_event(z, num_clients, min(cfg.clients_per_round, num_clients), rounds)
    return _eps(ev.event, ev.count, cfg.delta)


def calibrate_dpfedavg(target: float, cfg: DPRecConfig, num_clients: int) -> float:
    """The smallest z (bisection on log z to 1e-4 relative) whose epsilon after T rounds is
    <= target."""
    lo, hi = 1e-2, 1.0
    while dpfedavg_central_epsilon(hi, cfg, num_clients, cfg.rounds) > target:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise InvalidParameterError("epsilon", target, "reachable by DP-FedAvg")
    while math.log(hi / lo) > 1e-4:
        mid = math.sqrt(lo * hi)
        if dpfedavg_central_epsilon(mid, cfg, num_clients, cfg.rounds) <= target:
            hi = mid
        else:
            lo = mid
    return hi


# ------------------------------------------------------------------ one run
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
