"""Upcycled-FL with its FedProx and FedAvg baselines (non-private).

Upcycled-FL (*Federated Learning with Reduced Information Leakage and Computation*,
Algorithm 2) alternates a data-touching odd iteration (a FedProx round: sampled clients
solve F_i(w) + mu/2 ||w - w_bar||^2 from w_bar, the server averages with p_i re-normalised
over the sampled clients) with a server-only even iteration

    w^{2m} = w^{2m-1} + c_m (w^{2m-1} - w^{2m-2}),   c_m = mu / (mu + lambda_m),

so half of the iterations touch no data and cost almost nothing. FedProx runs the odd
round every iteration; FedAvg does the same with mu = 0 and drops stragglers (FedProx keeps
their partial work). The k-th data round of every algorithm uses the same client subset,
stragglers and batch order (one seed tree).

Run it as ``privkit train upcycled --dataset synthetic:0.5,0.5 --mu 1 --lam 0.42
--iterations 160 --fraction 0.3 --stragglers 0.9 --compare fedprox,fedavg --out DIR``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fl_examples.core import checkpoint
from fl_examples.core.data import FederatedDataset, Split, parse_dataset_spec
from fl_examples.core.local import local_sgd
from fl_examples.core.models import MLP, MultinomialLogReg
from fl_examples.core.report import progress, write_report
from fl_examples.core.rounds import (
    aggregate,
    broadcast,
    evaluate,
    resolve_device,
    sample_clients,
    select,
    straggler_epochs,
    to_client_data,
)
from fl_examples.core.seeds import SeedTree
from privkit import _validate
from privkit.errors import InvalidParameterError

__all__ = ["ALGORITHMS", "UpcycledConfig", "run_algorithm", "train", "extrapolation",
           "final_table"]

ALGORITHMS = ("upcycled", "fedprox", "fedavg")


@dataclass(frozen=True)
class UpcycledConfig:
    """Everything a run needs; saved in the report so the run can be repeated.

    Attributes:
        dataset: a dataset spec (see :func:`fl_examples.core.data.parse_dataset_spec`).
        model: ``logreg`` (multinomial logistic regression) or ``mlp``.
        mu: FedProx proximal coefficient (>= 0).
        lam: lambda of the even step (> 0 unless mu = 0); c = mu / (mu + lambda_m).
        lam_schedule: ``constant`` (lambda_m = lam, the paper's experiments) or ``sqrt``
            (lambda_m = lam sqrt(m), c_m = O(1/sqrt(m)) as in Corollary 4.8).
        iterations: Upcycled-FL iterations (odd + even); baselines run half as many rounds
            in a comparison, as in the paper (80/80/160).
        fraction: share of clients sampled per data round, in (0, 1].
        stragglers: share of the sampled clients that run fewer epochs, in [0, 1).
        local_epochs, batch_size, lr, momentum: the local solver (paper: E = 20, lr = 0.05,
            momentum 0.5).
        seed: root of the seed tree shared by all algorithms.
        device: ``auto``, ``cpu`` or ``cuda``.
        eval_every: evaluate every this many iterations (and at the last one).
        checkpoint_every: checkpoint every this many iterations (0 = never).
    """

    dataset: str = "synthetic:0.5,0.5"
    model: str = "logreg"
    mu: float = 1.0
    lam: float = 0.42
    lam_schedule: str = "constant"
    iterations: int = 160
    fraction: float = 0.3
    stragglers: float = 0.9
    local_epochs: int = 20
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.5
    seed: int = 0
    device: str = "auto"
    eval_every: int = 1
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        _validate.nonnegative("mu", self.mu)
        _validate.nonnegative("lam", self.lam)
        if self.mu > 0 and not self.lam > 0:
            raise InvalidParameterError("lam", self.lam, "> 0 when mu > 0")
        if self.lam_schedule not in ("constant", "sqrt"):
            raise InvalidParameterError("lam_schedule", self.lam_schedule, "constant or sqrt")
        if self.model not in ("logreg", "mlp"):
            raise InvalidParameterError("model", self.model, "logreg or mlp")
        _validate.positive_int("iterations", self.iterations)
        _validate.probability("fraction", self.fraction)
        s = _validate.real("stragglers", self.stragglers)
        if not 0 <= s < 1:
            raise InvalidParameterError("stragglers", self.stragglers, "in [0, 1)")
        _validate.positive_int("local_epochs", self.local_epochs)
        _validate.positive_int("batch_size", self.batch_size)
        _validate.positive("lr", self.lr)
        m = _validate.real("momentum", self.momentum)
        if not 0 <= m < 1:
            raise InvalidParameterError("momentum", self.momentum, "in [0, 1)")
        _validate.nonnegative_int("seed", self.seed)
        _validate.positive_int("eval_every", self.eval_every)
        _validate.nonnegative_int("checkpoint_every", self.checkpoint_every)


def extrapolation(cfg: UpcycledConfig, m: int) -> float:
    """c_m = mu / (mu + lambda_m) for the m-th even step (m >= 1)."""
    if cfg.mu == 0:
        return 0.0
    lam = cfg.lam * (math.sqrt(m) if cfg.lam_schedule == "sqrt" else 1.0)
    return cfg.mu / (cfg.mu + lam)


def _model(cfg: UpcycledConfig, ds: FederatedDataset) -> Any:
    if cfg.model == "mlp":
        return MLP(ds.num_features, 196, ds.num_classes)
    return MultinomialLogReg(ds.num_features, ds.num_classes)


class _Run:
    """State of one algorithm's run (the model pair and its history)."""

    def __init__(self, algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset,
                 device: torch.device) -> None:
        if algorithm not in ALGORITHMS:
            raise InvalidParameterError("algorithm", algorithm, f"one of {', '.join(ALGORITHMS)}")
        self.algorithm, self.cfg, self.ds, self.device = algorithm, cfg, ds, device
        self.tree = SeedTree(cfg.seed)
        self.model = _model(cfg, ds)
        dtype = torch.float32
        self.train = to_client_data(ds.padded(Split.TRAIN), device, dtype)
        self.test = to_client_data(ds.padded(Split.TEST), device, dtype)
        self.p = torch.as_tensor(ds.weights, dtype=torch.float64, device=device)
        init = self.model.init(1, generator=self.tree.torch(0, "init", "cpu"), device=device)
        self.w = {k: v[0] for k, v in init.items()}  # w^{t-1}
        self.w_prev = {k: v.clone() for k, v in self.w.items()}  # w^{t-2}
        self.iteration = 0
        self.history: list[dict[str, Any]] = []
        self.wall = 0.0
        self.compute = 0.0

    # -- one iteration ----------------------------------------------------------------------
    def data_round(self, t: int) -> int:
        return (t + 1) // 2 if self.algorithm == "upcycled" else t

    def step(self) -> None:
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

    def _local_round(self, r: int) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        sel = sample_clients(self.tree, r, self.ds.num_clients, cfg.fraction)
        epochs, strag = straggler_epochs(self.tree, r, len(sel), cfg.stragglers, cfg.local_epochs)
        if self.algorithm == "fedavg":  # FedAvg drops stragglers
            sel, epochs = sel[~strag], epochs[~strag]
            if len(sel) == 0:
                return {k: v.clone() for k, v in self.w.items()}
        idx = torch.as_tensor(sel, device=self.device)
        data = select(self.train, idx)
        mu = 0.0 if self.algorithm == "fedavg" else cfg.mu
        t0 = time.perf_counter()
        local = local_sgd(
            self.model, broadcast(self.w, len(sel)), self.w, data,
            epochs=torch.as_tensor(epochs, device=self.device), batch_size=cfg.batch_size,
            lr=cfg.lr, momentum=cfg.momentum, proximal_mu=mu,
            generator=self.tree.torch(r, "batches", self.device),
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.compute += time.perf_counter() - t0
        return aggregate(local, self.p[idx])

    def evaluate(self) -> dict[str, Any]:
        loss, acc = evaluate(self.model, self.w, self.train)
        _, test_acc = evaluate(self.model, self.w, self.test)
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"{self.algorithm}: training diverged at iteration {self.iteration} "
                f"(loss {loss}); lower --lr")
        row = {"iteration": self.iteration, "train_loss": loss, "train_accuracy": acc,
               "test_accuracy": test_acc, "wall_time_s": self.wall,
               "client_compute_s": self.compute}
        self.history.append(row)
        return row

    # -- checkpoints ------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        tensors = {f"w.{k}": v for k, v in self.w.items()}
        tensors.update({f"w_prev.{k}": v for k, v in self.w_prev.items()})
        checkpoint.save(directory, self.iteration, tensors, {
            "algorithm": self.algorithm, "config": dataclasses.asdict(self.cfg),
            "history": self.history, "wall_time_s": self.wall, "client_compute_s": self.compute,
        })

    def restore(self, directory: Path) -> None:
        tensors, state = checkpoint.load_latest(directory, self.device)
        if state.get("algorithm") != self.algorithm:
            raise checkpoint.CheckpointError(
                f"{directory}: checkpoint is for {state.get('algorithm')!r}, "
                f"not {self.algorithm!r}")
        if state.get("config") != dataclasses.asdict(self.cfg):
            raise checkpoint.CheckpointError(
                f"{directory}: checkpoint was made with another configuration; "
                "resume with the same settings or start a new --out")
        names = list(self.model.parameter_shapes())  # the model's own order
        self.w = {k: tensors[f"w.{k}"] for k in names}
        self.w_prev = {k: tensors[f"w_prev.{k}"] for k in names}
        self.iteration = int(state["round"])
        self.history = list(state["history"])
        self.wall, self.compute = float(state["wall_time_s"]), float(state["client_compute_s"])


def run_algorithm(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset, *,
                  iterations: int, out: Path | None = None, resume: bool = False,
                  stop_after: int | None = None) -> dict[str, Any]:
    """Run one algorithm for ``iterations``; returns ``{"history", "model"}``.

    With ``out``, checkpoints go to ``out/checkpoints/<algorithm>/`` every
    ``cfg.checkpoint_every`` iterations; ``resume=True`` continues from the latest one.
    ``stop_after`` ends the run early after that many iterations (to test resuming).
    """
    device = resolve_device(cfg.device)
    run = _Run(algorithm, cfg, ds, device)
    ckpt_dir = out / "checkpoints" / algorithm if out is not None else None
    if resume and ckpt_dir is not None and checkpoint.latest_round(ckpt_dir) is not None:
        run.restore(ckpt_dir)
    bar = progress(iterations - run.iteration, desc=algorithm)
    try:
        while run.iteration < iterations:
            run.step()
            bar.update(1)
            if run.iteration % cfg.eval_every == 0 or run.iteration == iterations:
                row = run.evaluate()
                bar.set_postfix(loss=f"{row['train_loss']:.3f}", acc=f"{row['test_accuracy']:.3f}")
            if (ckpt_dir is not None and cfg.checkpoint_every
                    and run.iteration % cfg.checkpoint_every == 0):
                run.save(ckpt_dir)
            if stop_after is not None and run.iteration >= stop_after:
                break
    finally:
        bar.close()
    return {"history": run.history, "model": {k: v.detach().cpu() for k, v in run.w.items()}}


def train(cfg: UpcycledConfig, *, compare: tuple[str, ...] = (), out: str | Path | None = None,
          resume: bool = False, algorithm: str = "upcycled") -> dict[str, Any]:
    """Run ``algorithm`` (default Upcycled-FL) and the ``compare`` baselines; write the report.

    Baselines in a comparison with Upcycled-FL run ``iterations // 2`` rounds (the paper's
    80/80/160), so every algorithm makes the same number of data-touching rounds.
    """
    for name in (algorithm, *compare):
        if name not in ALGORITHMS:
            raise InvalidParameterError("compare", name, f"one of {', '.join(ALGORITHMS)}")
    ds = parse_dataset_spec(cfg.dataset, seed=cfg.seed)
    out_path = Path(out) if out is not None else None
    results: dict[str, Any] = {}
    for name in dict.fromkeys((algorithm, *compare)):
        iters = cfg.iterations if (name == "upcycled" or algorithm != "upcycled") \
            else max(cfg.iterations // 2, 1)
        res = run_algorithm(name, cfg, ds, iterations=iters, out=out_path, resume=resume)
        results[name] = {"history": res["history"], "iterations": iters,
                         "data_rounds": (iters + 1) // 2 if name == "upcycled" else iters}
        results[name]["_model"] = res["model"]
    config = dataclasses.asdict(cfg) | {"algorithm": algorithm, "compare": list(compare),
                                        "dataset_description": ds.description,
                                        "num_clients": ds.num_clients}
    if out_path is not None:
        write_report(out_path, config, {n: {k: v for k, v in r.items() if k != "_model"}
                                        for n, r in results.items()})
    return {"config": config, "algorithms": results}


def final_table(result: dict[str, Any]) -> str:
    """A short text table of each algorithm's last evaluation."""
    lines = [f"{'algorithm':<10} {'iters':>6} {'data rounds':>11} {'train loss':>10} "
             f"{'train acc':>9} {'test acc':>8} {'wall s':>8} {'client s':>8}"]
    for name, r in result["algorithms"].items():
        f = r["history"][-1]
        lines.append(f"{name:<10} {r['iterations']:>6} {r['data_rounds']:>11} "
                     f"{f['train_loss']:>10.4f} {f['train_accuracy']:>9.4f} "
                     f"{f['test_accuracy']:>8.4f} {f['wall_time_s']:>8.2f} "
                     f"{f['client_compute_s']:>8.2f}")
    return "\n".join(lines)

