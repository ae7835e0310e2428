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

from fl_examples.core.data import FederatedDataset, Split, parse_dataset_spec
from fl_examples.core.deep_models import CNN
from fl_examples.core.local import local_sgd
from fl_examples.core.models import MLP, MultinomialLogReg
from fl_examples.core.privacy import (
    PRIVACY_KINDS,
    BudgetStop,
    PrivacyPlan,
    calibrate,
    clip_features,
    logreg_lipschitz,
    logreg_smoothness,
)
from fl_examples.core.report import Column, text_table, write_report
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
from privkit.errors import InvalidParameterError
from privkit.events import event_to_dict
from privkit.ledger import Ledger, LedgerPointer

__all__ = ["ALGORITHMS", "UpcycledConfig", "run_algorithm", "train", "extrapolation",
           "final_table"]

ALGORITHMS = ("upcycled", "fedprox", "fedavg")


@dataclass(frozen=True)
class UpcycledConfig:
    """Everything a run needs; saved in the report so the run can be repeated.

    Attributes:
        dataset: a dataset spec (see :func:`fl_examples.core.data.parse_dataset_spec`).
        model: ``logreg`` (multinomial logistic regression), ``mlp`` (784-196-10 shape),
            ``cnn`` (the paper's FEMNIST CNN: 3x3 conv, 3 channels, linear 1000 and 100) or
            ``lstm`` (Sent140: embedding 300, 2 x LSTM 128; needs token ids, ``sent140tok:DIR``).
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
        privacy: ``none``, ``output`` (clip the uploaded model to ``l2_clip_norm`` and add
            N(0, ``stddev``^2) on odd iterations) or ``objective`` (a linear term with density
            ~ exp(-``alpha`` ||n||) in the local objective on odd iterations).
        sensitivity: output perturbation's sensitivity: ``replace-one`` (2 tau, default),
            ``paper`` (tau/|D_i|, Thm C.1's assumption, reported NOT PROVEN) or
            ``strongly-convex`` (needs ``feature_norm``, momentum 0, logreg and
            lr <= 2/(beta + 2 mu)).
        feature_norm: R, the public L2 bound every feature row is clipped to
            (``strongly-convex``): it gives u1 = sqrt(2 (R^2 + 1)) and beta = (R^2 + 1)/2.
        lipschitz: u1 for ``strongly-convex`` (default: the one ``feature_norm`` implies; a
            smaller value is refused, a larger one is used as given).
        delta: the delta every epsilon is reported at (the paper's 1e-3).
        epsilon_budget: per-client budget; the run stops before a client would exceed it.
        allow_unproven: run objective perturbation although Thm C.2 does not hold here (SGD is
            not an exact minimiser); its epsilon is then marked NOT PROVEN.
        noise_for_epsilon: calibrate ``stddev`` (output) or ``alpha`` (objective) so that the
            run ends at this mean (``noise_target="mean"``) or max epsilon.
        baseline_iterations: iterations of the baselines in a comparison: ``half`` (the same
            number of data rounds, as in the paper's Table 1), ``same`` (the same number of
            iterations, as in its privacy experiments: FedProx then leaks twice as often), or
            ``auto`` (half without privacy, same with).
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
    privacy: str = "none"
    sensitivity: str = "replace-one"
    l2_clip_norm: float = 10.0
    stddev: float = 1.0
    alpha: float = 20.0
    lipschitz: float | None = None
    feature_norm: float | None = None
    delta: float = 1e-3
    epsilon_budget: float | None = None
    allow_unproven: bool = False
    noise_for_epsilon: float | None = None
    noise_target: str = "mean"
    baseline_iterations: str = "auto"

    def __post_init__(self) -> None:
        _validate.nonnegative("mu", self.mu)
        _validate.nonnegative("lam", self.lam)
        if self.mu > 0 and not self.lam > 0:
            raise InvalidParameterError("lam", self.lam, "> 0 when mu > 0")
        if self.lam_schedule not in ("constant", "sqrt"):
            raise InvalidParameterError("lam_schedule", self.lam_schedule, "constant or sqrt")
        if self.model not in ("logreg", "mlp", "cnn", "lstm"):
            raise InvalidParameterError("model", self.model, "logreg, mlp, cnn or lstm")
        _validate.positive_int("iterations", self.iterations)
        _validate.probability("fraction", self.fraction)
        s = _validate.real("stragglers", self.stragglers)
        if not 0 <= s < 1:
            raise InvalidParameterError("stragglers", self.stragglers, "in [0, 1)")
        m = _validate.real("momentum", self.momentum)
        if not 0 <= m < 1:
            raise InvalidParameterError("momentum", self.momentum, "in [0, 1)")
        check_shared_settings(self)  # local solver, delta, budget, seed, eval/checkpoint grid
        if self.privacy not in PRIVACY_KINDS:
            raise InvalidParameterError("privacy", self.privacy, "none, output or objective")
        _validate.positive("l2_clip_norm", self.l2_clip_norm)
        _validate.positive("stddev", self.stddev)
        _validate.positive("alpha", self.alpha)
        if self.noise_for_epsilon is not None:
            _validate.positive("noise_for_epsilon", self.noise_for_epsilon)
            if self.privacy == "none":
                raise InvalidParameterError("noise_for_epsilon", self.noise_for_epsilon,
                                            "used with --privacy output or objective")
        if self.noise_target not in ("mean", "max"):
            raise InvalidParameterError("noise_target", self.noise_target, "mean or max")
        if self.privacy == "objective" and not self.mu > 0:
            raise InvalidParameterError("mu", self.mu, "> 0 for objective perturbation")
        if self.lipschitz is not None:
            _validate.positive("lipschitz", self.lipschitz)
        if self.feature_norm is not None:
            _validate.positive("feature_norm", self.feature_norm)
        if self.privacy == "output" and self.sensitivity == "strongly-convex":
            self._check_strongly_convex()
        if self.baseline_iterations not in ("auto", "half", "same"):
            raise InvalidParameterError("baseline_iterations", self.baseline_iterations,
                                        "auto, half or same")


    def _check_strongly_convex(self) -> None:
        """The strongly convex bound's conditions, enforced (not taken on trust)."""
        r = self.feature_norm
        if r is None:
            raise InvalidParameterError(
                "feature_norm", None, "given with --sensitivity strongly-convex: every feature "
                "row is clipped to this public L2 norm R, which bounds the per-example gradient "
                "(--lipschitz) by sqrt(2 (R^2 + 1))")
        u1 = logreg_lipschitz(r)
        if self.lipschitz is not None and self.lipschitz < u1:
            raise InvalidParameterError(
                "lipschitz", self.lipschitz, f">= {u1:.6g} = sqrt(2 (R^2 + 1)), the per-example "
                f"gradient bound of logistic regression on features clipped to --feature-norm "
                f"{r:g}")
        bound = 2.0 / (logreg_smoothness(r) + 2.0 * self.mu) if self.mu > 0 else 0.0
        if self.mu > 0 and not self.lr <= bound:
            raise InvalidParameterError(
                "lr", self.lr, f"<= 2/(beta + 2 mu) = {bound:.6g} for --sensitivity "
                f"strongly-convex (contracting steps; beta = (R^2 + 1)/2 = "
                f"{logreg_smoothness(r):.6g})")

    @property
    def lipschitz_bound(self) -> float | None:
        """u1 the strongly convex bound uses (given, or implied by ``feature_norm``)."""
        if self.lipschitz is not None:
            return self.lipschitz
        return None if self.feature_norm is None else logreg_lipschitz(self.feature_norm)


def extrapolation(cfg: UpcycledConfig, m: int) -> float:
    """c_m = mu / (mu + lambda_m) for the m-th even step (m >= 1)."""
    if cfg.mu == 0:
        return 0.0
    lam = cfg.lam * (math.sqrt(m) if cfg.lam_schedule == "sqrt" else 1.0)
    return cfg.mu / (cfg.mu + lam)


def _model(cfg: UpcycledConfig, ds: FederatedDataset) -> Any:
    if cfg.model == "mlp":
        return MLP(ds.num_features, 196, ds.num_classes)
    if cfg.model == "cnn":
        side = math.isqrt(ds.num_features)
        if side * side != ds.num_features:
            raise InvalidParameterError("model", "cnn", "used with square images (e.g. 28x28 "
                                        f"FEMNIST/MNIST or 8x8 digits), not {ds.num_features} "
                                        "features")
        return CNN(image_size=side, channels=3, hidden=(1000, 100), num_classes=ds.num_classes)
    if cfg.model == "lstm":
        from fl_examples.core.deep_models import StackedLSTM

        vocab_size = ds.description.get("vocab_size")
        if vocab_size is None:
            raise InvalidParameterError("model", "lstm", "used with token-id features (e.g. "
                                        "sent140tok:DIR), not a data set without vocab_size")
        return StackedLSTM(vocab_size=vocab_size, embedding_dim=300, hidden=128, layers=2,
                           num_classes=ds.num_classes, seq_len=ds.num_features)
    return MultinomialLogReg(ds.num_features, ds.num_classes)


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
                            f"budget {self.cfg.epsilon_budget}")
            return False
        return True

    def report(self) -> dict[str, Any]:
        result: dict[str, Any] = {"history": self.history,
                                  "model": {k: v.detach().cpu() for k, v in self.w.items()}}
        if self.plan is not None and self.ledger is not None:
            result["privacy"] = self.plan.report(self.ledger, self.ds.num_clients) \
                | self.calibration
            if self.stopped:
                result["privacy"]["stopped"] = self.stopped
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

    def _selection(self, r: int) -> tuple[Any, Any]:
        """(clients, local epochs) of data round ``r`` (FedAvg drops its stragglers)."""
        cfg = self.cfg
        sel = sample_clients(self.tree, r, self.ds.num_clients, cfg.fraction)
        epochs, strag = straggler_epochs(self.tree, r, len(sel), cfg.stragglers, cfg.local_epochs)
        if self.algorithm == "fedavg":
            sel, epochs = sel[~strag], epochs[~strag]
        return sel, epochs

    def _charge(self, r: int, sel: Any) -> torch.Generator:
        """Write-ahead charge of data round ``r`` (all or nothing; charges a crashed run
        already wrote for this very round are not made twice); returns its noise generator."""
        assert self.plan is not None and self.ledger is not None
        done = self.precharged.pop(r, set())
        todo = [c for c in sel.tolist() if str(c) not in done]
        if todo:
            self.plan.charge(self.ledger, todo, round_=r, run_id=self.algorithm)
        return self.tree.torch(r, "noise", self.device)

    def _check_finite(self, local: dict[str, torch.Tensor], sel: Any, r: int, kind: str) -> None:
        """Refuse a non-finite client update, naming the client (nothing is released)."""
        ok = torch.ones(len(sel), dtype=torch.bool, device=self.device)
        for v in local.values():
            ok &= torch.isfinite(v.reshape(len(sel), -1)).all(dim=1)
        if not bool(ok.all()):
            j = int(torch.nonzero(~ok)[0])
            charged = ("nothing was charged or released" if kind == "output" else
                       "its noise term was drawn, so the round stays charged; nothing was "
                       "released")
            raise InvalidParameterError(
                f"update of client {int(sel[j])} in data round {r}", "non-finite values",
                f"finite ({charged}; lower --lr)")

    def _local_round(self, r: int) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        sel, epochs = self._selection(r)
        if len(sel) == 0:  # FedAvg with every sampled client a straggler
            return {k: v.clone() for k, v in self.w.items()}
        linear = noise = None
        plan = self.plan if self.ledger is not None else None
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
        if plan is not None:
            self._check_finite(local, sel, r, plan.kind)
        if plan is not None and plan.kind == "output":
            # Output perturbation: charge after the updates are known to be finite, before
            # any noise is drawn, so a bad update is refused with nothing charged.
            noise = self._charge(r, sel)
            released = [plan.mechanism(int(c))({k: v[j] for k, v in local.items()}, rng=noise)
                        for j, c in enumerate(sel)]
            local = {k: torch.stack([rel[k] for rel in released]) for k in local}
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
    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        tensors = {f"w.{k}": v for k, v in self.w.items()}
        tensors.update({f"w_prev.{k}": v for k, v in self.w_prev.items()})
        return tensors, {"wall_time_s": self.wall, "client_compute_s": self.compute}

    def load_state(self, tensors: dict[str, Any], state: dict[str, Any]) -> None:
        names = list(self.model.parameter_shapes())  # the model's own order
        self.w = {k: tensors[f"w.{k}"] for k in names}
        self.w_prev = {k: tensors[f"w_prev.{k}"] for k in names}
        self.iteration = int(state["round"])
        self.wall, self.compute = float(state["wall_time_s"]), float(state["client_compute_s"])

    def _expected_charges(self, t: int) -> list[tuple[int, str, int, str]]:
        """(data round, client id, count, canonical event JSON) of each entry iteration ``t``
        charges, in order (none for an even Upcycled-FL iteration)."""
        assert self.plan is not None
        if self.algorithm == "upcycled" and t % 2 == 0:
            return []
        r = self.data_round(t)
        groups: dict[Any, list[str]] = {}
        for c in self._selection(r)[0].tolist():
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
            charges=self._expected_charges, step_name="iteration")


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
    ledger = _open_ledger(algorithm, cfg, out, resume) if plan is not None else None
    run = _Run(algorithm, cfg, ds, device, plan, ledger, model, iterations=iterations,
               calibration=calibration)
    drive(run, checkpoints=checkpoint_dir(out, algorithm),
          checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval_every, resume=resume,
          stop_after=stop_after)
    return run.report()


def planned_releases(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset,
                     iterations: int) -> list[int]:
    """Releases each client will make in a run (client sampling comes from the seed tree)."""
    tree = SeedTree(cfg.seed)
    rounds = (iterations + 1) // 2 if algorithm == "upcycled" else iterations
    counts = [0] * ds.num_clients
    for r in range(1, rounds + 1):
        sel = sample_clients(tree, r, ds.num_clients, cfg.fraction)
        _, strag = straggler_epochs(tree, r, len(sel), cfg.stragglers, cfg.local_epochs)
        for c in (sel[~strag] if algorithm == "fedavg" else sel):
            counts[int(c)] += 1
    return counts


def _plan_for(cfg: UpcycledConfig, ds: FederatedDataset, algorithm: str,
              noise: float | None = None) -> PrivacyPlan:
    stddev = noise if (noise is not None and cfg.privacy == "output") else cfg.stddev
    alpha = noise if (noise is not None and cfg.privacy == "objective") else cfg.alpha
    return PrivacyPlan(
        kind=cfg.privacy, sizes=tuple(int(n) for n in ds.train_sizes),
        l2_clip_norm=cfg.l2_clip_norm, stddev=stddev, sensitivity=cfg.sensitivity, alpha=alpha,
        proximal_mu=0.0 if algorithm == "fedavg" else cfg.mu, lipschitz_model=cfg.lipschitz_bound,
        batch_size=cfg.batch_size, momentum=cfg.momentum, allow_unproven=cfg.allow_unproven,
        glm=cfg.model == "logreg")


def _privacy_plan(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset, iterations: int
                  ) -> tuple[PrivacyPlan | None, dict[str, Any]]:
    if cfg.privacy == "none":
        return None, {}
    if cfg.privacy == "objective" and algorithm == "fedavg":
        raise InvalidParameterError("compare", "fedavg",
                                    "not combined with objective perturbation (it needs mu > 0)")
    if cfg.noise_for_epsilon is None:
        return _plan_for(cfg, ds, algorithm), {}
    counts = planned_releases(algorithm, cfg, ds, iterations)
    x, eps = calibrate(lambda v: _plan_for(cfg, ds, algorithm, v), counts,
                       target=cfg.noise_for_epsilon, delta=cfg.delta,
                       statistic=cfg.noise_target,
                       larger_is_more_private=cfg.privacy == "output")
    info = {"calibrated": {"parameter": "stddev" if cfg.privacy == "output" else "alpha",
                           "value": x, "target_epsilon": cfg.noise_for_epsilon,
                           "statistic": cfg.noise_target, "planned_epsilon": eps}}
    return _plan_for(cfg, ds, algorithm, x), info


def _open_ledger(algorithm: str, cfg: UpcycledConfig, out: Path | None, resume: bool) -> Ledger:
    """One ledger per (output directory, algorithm); reopened, never reset, by every run."""
    return open_ledger(out, algorithm, population_id=f"{cfg.dataset}|seed={cfg.seed}|{algorithm}",
                       delta=cfg.delta, resume=resume, reopen=True,
                       epsilon_budget=cfg.epsilon_budget)


def train(cfg: UpcycledConfig, *, compare: tuple[str, ...] = (), out: str | Path | None = None,
          resume: bool = False, algorithm: str = "upcycled") -> dict[str, Any]:
    """Run ``algorithm`` (default Upcycled-FL) and the ``compare`` baselines; write the report.

    Baselines in a comparison with Upcycled-FL run ``iterations // 2`` rounds (the paper's
    80/80/160, the same number of data rounds) or ``iterations`` (private runs, the paper's
    privacy experiments): see ``UpcycledConfig.baseline_iterations``.
    """
    for name in (algorithm, *compare):
        if name not in ALGORITHMS:
            raise InvalidParameterError("compare", name, f"one of {', '.join(ALGORITHMS)}")
    ds = parse_dataset_spec(cfg.dataset, seed=cfg.seed)
    if cfg.feature_norm is not None:
        ds = clip_features(ds, cfg.feature_norm)
    out_path = Path(out) if out is not None else None
    results: dict[str, Any] = {}
    for name in dict.fromkeys((algorithm, *compare)):
        half = cfg.baseline_iterations == "half" or (
            cfg.baseline_iterations == "auto" and cfg.privacy == "none")
        iters = cfg.iterations if (name == "upcycled" or algorithm != "upcycled" or not half) \
            else max(cfg.iterations // 2, 1)
        res = run_algorithm(name, cfg, ds, iterations=iters, out=out_path, resume=resume)
        done = res["history"][-1]["iteration"] if res["history"] else 0
        results[name] = {"history": res["history"], "iterations": iters,
                         "data_rounds": (done + 1) // 2 if name == "upcycled" else done}
        if "privacy" in res:
            results[name]["privacy"] = res["privacy"]
        results[name]["_model"] = res["model"]
    config = dataclasses.asdict(cfg) | {"algorithm": algorithm, "compare": list(compare),
                                        "dataset_description": ds.description,
                                        "num_clients": ds.num_clients}
    if out_path is not None:
        write_report(out_path, config, results)
    return {"config": config, "algorithms": results}


_COLUMNS = (Column("algorithm", 10), Column("iters", 6), Column("data rounds", 11),
            Column("train loss", 10, ".4f"), Column("train acc", 9, ".4f"),
            Column("test acc", 8, ".4f"), Column("wall s", 8, ".2f"),
            Column("client s", 8, ".2f"))


def final_table(result: dict[str, Any]) -> str:
    """A short text table of each algorithm's last evaluation (and epsilon, if private)."""
    algs = result["algorithms"]
    lines = text_table(_COLUMNS, [
        (name, r["history"][-1]["iteration"], r["data_rounds"],
         *(r["history"][-1][k] for k in ("train_loss", "train_accuracy", "test_accuracy",
                                         "wall_time_s", "client_compute_s")))
        for name, r in algs.items()])
    notes = []
    for name, r in algs.items():
        if "privacy" in r:
            p = r["privacy"]
            mark = "" if p["proven"] else "  [NOT PROVEN]"
            detail = (f"sensitivity {p['sensitivity']} ({p['sensitivity_formula']})"
                      if p["mechanism"] == "gaussian_output_perturbation"
                      else f"alpha {p['alpha']:.4g}")
            notes.append(f"{name}: eps mean {p['epsilon_mean']:.4g}, max {p['epsilon_max']:.4g} "
                         f"at delta={p['delta']:g} [{p['method']}], {detail}{mark}"
                         + (f"\n  {p['stopped']}" if "stopped" in p else ""))
    return "\n".join(lines + (["", "privacy (per client, upper bounds):"] + notes
                              if notes else []))

