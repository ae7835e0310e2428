"""MAPA, AUDP and ASGD: asynchronous FL with per-upload pure-DP gradient noise.

Li, Yang, Ren, Zhao, *Asynchronous Federated Learning with Differential Privacy for Edge
Intelligence* (arXiv 1912.07902), rebuilt as spec ``mapa.md`` describes:

- **Simulator** (:mod:`fl_examples.core.asyncsim`): K edges with heterogeneous speeds, a FIFO
  buffer at the cloud, a simulated clock, staleness recorded per applied update, optional
  ``tau_max`` (staler uploads are dropped, already charged).
- **Edge step**: b *distinct* records of the edge's data (sampling without replacement: a record
  drawn twice would double the sensitivity), per-example gradients clipped to ``C_s``, averaged,
  plus privkit's :class:`~privkit.mechanisms.LaplaceGradientNoise` noise (L2-norm Laplace by
  default, per-coordinate L1 Laplace as an option) at the edge's epsilon_k with sensitivity
  ``DeltaS = 2 C_s / b``. One upload is pure epsilon_k-DP.
- **ASGD** (no privacy): ``gamma_t = 1 / (L (tau+1)^2 + sigma sqrt(t+1) / (R sqrt(b)))``.
- **AUDP**: a fixed clip G (``DeltaS = 2G/b``) and
  ``gamma_t = 1 / (2 L (tau+1) + sqrt(Delta_b t))``.
- **MAPA**: Thm 3's first ``DeltaS = 2 sigma / (b sqrt(1 - sqrt(1 - delta)))``; per stage
  ``P = max{1, 8 Delta_b / (theta^2 b^2 DeltaS^2 (tau+1))}``, ``gamma = 1/(2 L P (tau+1))``,
  ``T_s = ceil(4 L P^2 (tau+1)^2 R / Delta_b)``; then ``DeltaS <- theta DeltaS``,
  ``C_s = b DeltaS / 2``. ``Delta_b = sigma^2/b + Delta_0``, where ``Delta_0`` is the true
  ``E||eta||^2`` of the chosen noise (``variance="sound"``, default) or the paper's 1-D Laplace
  value ``2 DeltaS^2 / eps_0^2`` (``variance="paper"``; it understates the L2 noise by
  d(d+1)/2). Here tau is ``tau_max`` when set, else K - 1 (the mean staleness of K always-busy
  edges).

Each edge's uploads are charged on a privkit :class:`~privkit.ledger.Ledger` (one pure-DP event
per upload, optimal composition, replace-one neighbours, no amplification) before their noise is
drawn; a budget stop ends the run before the first upload that would take any edge over
``epsilon_budget``. The authors' code adds non-DP noise at the cloud and applies one update
twice; neither happens here.

**Batch sampler and amplification.** ``batch_sampler="poisson"`` includes each of edge k's n_k
records independently with probability ``q_k = b / n_k`` and releases the clipped *sum* divided
by the fixed expected size b (so the batch size is never revealed by the denominator). The noise
is calibrated as before, to ``DeltaS = 2 C_s / b``: that is the replace-one sensitivity of
sum/b, and it bounds the add/remove sensitivity ``C_s / b``, so one upload is eps_k-DP under
either relation. ``amplification=True`` (Poisson only) prices each upload as
``eps' = log(1 + q_k (e^eps_k - 1))`` under add/remove neighbours (amplification by Poisson
subsampling: Li, Qardaji & Su, ASIACCS 2012; Balle, Barthe & Gaboardi, NeurIPS 2018, Thm 8),
composed optimally as pure steps; it assumes the sampler's outcome (which records entered which
batch) stays secret, and the report states that next to the amplified number and also gives
the unamplified one.

**Checkpoints.** With ``checkpoint_every = N`` and an output directory, the run's full state
(model, every edge's pulled model, in-flight gradients, ready flags, upload counters, DeltaS of
each pending job, history, ledger pointer) is saved after every N-th applied update and at the
end; ``resume=True`` continues from the latest checkpoint. Every random draw comes from a stream
keyed by (seed, edge, upload), so a resumed run is bitwise equal to an uninterrupted one. The
ledger is charged before noise is drawn, so a crash can leave charges after the checkpoint's
ledger pointer; on resume they are matched, spend call by spend call, against the charges the run
makes from the checkpoint up to its next checkpoint (same edges, upload numbers, events, model
version and cloud event) and adopted instead of charged twice. Anything else after the pointer
(spend a later checkpoint depends on) refuses the resume (``LedgerRollbackError``), and a ledger
that lacks the pointer's entry (an older ledger) is refused too (``LedgerMismatchError``).

Run it as ``privkit train mapa --algorithms mapa,audp,asgd --edges 100 --epsilon 1 --batch 24
--updates 5000 --speed-dist lognormal:0,1 --out DIR``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

import privkit
from fl_examples.core import checkpoint
from fl_examples.core.asyncsim import Schedule, TimingModel, simulate
from fl_examples.core.data import (
    FederatedDataset,
    Split,
    SyntheticPreset,
    digits,
    synthetic,
)
from fl_examples.core.models import MultinomialLogReg, flatten
from fl_examples.core.report import progress, write_report
from fl_examples.core.rounds import resolve_device
from privkit import _validate
from privkit._journal import canonical_json
from privkit.accountants import rules
from privkit.accountants.amplification import (
    AMPLIFICATION_ASSUMPTION,
    PoissonSampledPureDpEvent,
    amplified_epsilon,
)
from privkit.errors import (
    BudgetExceededError,
    InvalidParameterError,
    LedgerRollbackError,
)
from privkit.events import DpEvent, SelfComposedDpEvent, event_to_dict
from privkit.ledger import Ledger, LedgerPointer, atomic_write_bytes
from privkit.mechanisms import (
    LaplaceGradientNoise,
    NoiseShape,
    clip_per_example,
    l2_laplace_noise,
    laplace_noise,
)

__all__ = [
    "ALGORITHMS", "SAMPLERS", "AMPLIFICATION_ASSUMPTION", "MapaConfig", "MapaCNN", "Stage",
    "MapaSchedule", "PoissonSampledPureDpEvent", "amplified_epsilon", "initial_sensitivity",
    "noise_variance", "audp_step", "asgd_step", "load_edges", "run_algorithm", "train",
    "updates_to_loss", "final_table",
]  # fmt: skip

ALGORITHMS = ("mapa", "audp", "asgd")
SAMPLERS = ("distinct", "poisson")
NOISES = {"l2": NoiseShape.L2, "l1": NoiseShape.L1}
VARIANCES = ("sound", "paper")
TARGET_FRACTIONS = (0.95, 0.9, 0.75, 0.5)
"""Loss targets of the comparison, as fractions of the initial model's training loss."""

# spawn-key tags of the per-upload random streams (part of the reproducibility contract)
_TAG_BATCH = 7101
_TAG_NOISE = 7102
_TAG_INIT = 7103
_CHUNK_ROWS = 1 << 14  # per-example rows (jobs x b) per gradient chunk


# ------------------------------------------------------------------------ schedule formulas
def initial_sensitivity(sigma: float, batch: int, delta: float) -> float:
    """Thm 3: DeltaS_0 = 2 sigma / (b sqrt(1 - sqrt(1 - delta))) (spec ``mapa.md`` section 4).

    It bounds the *realised* sensitivity with probability >= 1 - delta; privkit only uses it
    as the first clip bound (``C_0 = b DeltaS_0 / 2``) and always clips.

    Examples:
        >>> round(initial_sensitivity(30, 24, 1e-3), 6)
        111.789419
    """
    s = _validate.positive("sigma", sigma)
    b = _validate.positive_int("batch", batch)
    d = _validate.delta("delta", delta)
    one_minus_root = -math.expm1(0.5 * math.log1p(-d))  # 1 - sqrt(1 - delta), no cancellation
    return 2.0 * s / (b * math.sqrt(one_minus_root))


def _mechanism(delta_s: float, batch: int, epsilon: float, noise: str) -> LaplaceGradientNoise:
    """The upload mechanism whose sensitivity is ``delta_s``: clip C = b DeltaS / 2."""
    return LaplaceGradientNoise(l2_clip_norm=batch * delta_s / 2.0, batch_size=batch,
                                epsilon=epsilon, shape=NOISES[noise])


def noise_variance(delta_s: float, epsilon: float, dim: int, *, batch: int, noise: str = "l2",
                   variance: str = "sound") -> float:
    """Delta_0: E||eta||^2 of one upload's noise at sensitivity ``delta_s``.

    ``sound``: the mechanism's true value, d(d+1) (DeltaS/eps)^2 for ``l2`` and
    2 d^2 (DeltaS/eps)^2 for ``l1``. ``paper``: 2 DeltaS^2 / eps^2, the 1-D Laplace variance
    the paper uses (it understates the l2 noise by d(d+1)/2).
    """
    if variance not in VARIANCES:
        raise InvalidParameterError("variance", variance, "sound or paper")
    if noise not in NOISES:
        raise InvalidParameterError("noise", noise, "l2 or l1")
    if variance == "paper":
        return 2.0 * (_validate.positive("delta_s", delta_s)
                      / _validate.positive("epsilon", epsilon)) ** 2
    return _mechanism(delta_s, batch, epsilon, noise).noise_variance(dim)


@dataclass(frozen=True)
class Stage:
    """One MAPA stage: updates ``start .. start + length - 1`` (1-based) use these values."""

    index: int
    start: int
    delta_s: float
    clip: float
    delta_0: float
    delta_b: float
    raw_p: float
    p: float
    gamma: float
    length: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class MapaSchedule:
    """MAPA's stage schedule (cloud lines C3-C16); public constants only, so it costs no privacy.

    Args:
        sigma: the gradient-noise constant sigma (Delta_b's sigma^2/b), > 0.
        batch: b, records per upload.
        delta: Thm 3's failure probability, in (0, 1).
        epsilon0: min_k eps_k, the budget the cloud schedules with.
        lipschitz: L, > 0.
        r0: R, the estimate of f(x_1) - f*, > 0.
        tau: the staleness bound used in the formulas, >= 0.
        theta: the per-stage shrink factor, in (0, 1).
        dim: d, the number of model coordinates.
        noise: the noise shape (``l2`` or ``l1``), see :func:`noise_variance`.
        variance: ``sound`` (the noise's true variance) or ``paper``, see
            :func:`noise_variance`.

    Examples:
        >>> s = MapaSchedule(sigma=30, batch=24, delta=1e-3, epsilon0=1, lipschitz=10, r0=50,
        ...                  tau=3, theta=0.5, dim=4380, variance="paper")
        >>> [s.stage(i).length for i in range(5)]
        [2, 6, 21, 75, 237]
    """

    def __init__(self, *, sigma: float, batch: int, delta: float, epsilon0: float,
                 lipschitz: float, r0: float, tau: int, theta: float, dim: int,
                 noise: str = "l2", variance: str = "sound") -> None:
        self.sigma = _validate.positive("sigma", sigma)
        self.batch = _validate.positive_int("batch", batch)
        self.delta = _validate.delta("delta", delta)
        self.epsilon0 = _validate.positive("epsilon", epsilon0)
        self.lipschitz = _validate.positive("lipschitz", lipschitz)
        self.r0 = _validate.positive("r0", r0)
        self.tau = _validate.nonnegative_int("tau_max", tau)
        self.theta = _check_theta(theta)
        self.dim = _validate.positive_int("dim", dim)
        noise_variance(1.0, 1.0, 1, batch=1, noise=noise, variance=variance)  # validate names
        self.noise, self.variance = noise, variance
        self._stages: list[Stage] = []
        self._ends: list[int] = []  # last update of each stage

    def _make(self, index: int, start: int, delta_s: float) -> Stage:
        b, tau1, lip = self.batch, self.tau + 1, self.lipschitz
        d0 = noise_variance(delta_s, self.epsilon0, self.dim, batch=b, noise=self.noise,
                            variance=self.variance)
        db = self.sigma**2 / b + d0
        raw = 8.0 * db / (self.theta**2 * b**2 * delta_s**2 * tau1)
        p = max(1.0, raw)
        gamma = 1.0 / (2.0 * lip * p * tau1)
        length = max(1, math.ceil(4.0 * lip * p**2 * tau1**2 * self.r0 / db))
        return Stage(index, start, delta_s, b * delta_s / 2.0, d0, db, raw, p, gamma, length)

    def stage(self, index: int) -> Stage:
        """Stage ``index`` (0-based), computed on demand."""
        i = _validate.nonnegative_int("index", index)
        while len(self._stages) <= i:
            if not self._stages:
                st = self._make(0, 1, initial_sensitivity(self.sigma, self.batch, self.delta))
            else:
                prev = self._stages[-1]
                st = self._make(prev.index + 1, prev.start + prev.length,
                                self.theta * prev.delta_s)
            if not (st.delta_s > 0 and math.isfinite(st.gamma)):
                raise InvalidParameterError("theta", self.theta, "a schedule whose DeltaS stays "
                                            f"positive (stage {st.index} underflows)")
            self._stages.append(st)
            self._ends.append(st.start + st.length - 1)
        return self._stages[i]

    def for_update(self, t: int) -> Stage:
        """The stage of update ``t`` (1-based)."""
        t = _validate.positive_int("t", t)
        while not self._ends or self._ends[-1] < t:
            self.stage(len(self._stages))
        return self._stages[int(np.searchsorted(self._ends, t))]

    def stages_through(self, t: int) -> list[Stage]:
        """Every stage that updates 1..t touch."""
        last = self.for_update(max(t, 1)).index
        return self._stages[: last + 1]


def audp_step(t: int, *, lipschitz: float, tau: int, delta_b: float) -> float:
    """AUDP's gamma_t = 1 / (2 L (tau+1) + sqrt(Delta_b t)), t = updates applied before (from 0)."""
    return 1.0 / (2.0 * lipschitz * (tau + 1) + math.sqrt(delta_b * t))


def asgd_step(t: int, *, lipschitz: float, tau: int, sigma: float, r0: float,
              batch: int) -> float:
    """ASGD's gamma_t = 1 / (L (tau+1)^2 + sigma sqrt(t+1) / (R sqrt(b))), t from 0."""
    return 1.0 / (lipschitz * (tau + 1) ** 2 + sigma * math.sqrt(t + 1) / (r0 * math.sqrt(batch)))


def _check_theta(theta: Any) -> float:
    th = _validate.real("theta", theta)
    if not (math.isfinite(th) and 0 < th < 1):
        raise InvalidParameterError("theta", theta, "in (0, 1)")
    return th


# --------------------------------------------------------------------------- amplification
# ---------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class MapaConfig:
    """Everything a run needs; saved in the report so the run can be repeated.

    Attributes:
        dataset: ``digits`` / ``digits:iid`` (IID over the edges), ``digits:K`` (K classes per
            edge), ``synthetic:ALPHA,BETA[:PRESET]``, ``synthetic:iid[:PRESET]`` (PRESET
            ``paper`` 20-d, ``fedprox`` 60-d) or ``mnist:DIR`` (IDX files you provide; IID).
        model: ``logreg`` or ``cnn`` (the paper's CNN, 28x28 inputs only).
        edges: K, the number of edge servers (each holds one partition of the data).
        batch: b, distinct records per upload (``poisson``: the expected number, and the
            release's denominator); every edge needs >= b training records.
        updates: applied cloud updates T.
        epsilon: eps_k of every edge (one number), or one per edge (a tuple of K).
        delta: Thm 3's delta, also the delta every composed epsilon is reported at.
        theta, sigma, lipschitz, r0: MAPA's theta, sigma, L and R (testbed: 0.5, 30, 10, 50).
        tau_max: drop uploads staler than this, and use it in the step sizes; None: nothing is
            dropped and the step sizes use K - 1 (the mean staleness of K always-busy edges).
        noise: ``l2`` (L2-norm Laplace, default) or ``l1`` (per-coordinate Laplace).
        variance: ``sound`` (the noise's true E||eta||^2 in Delta_b) or ``paper``.
        audp_clip: AUDP's fixed per-example clip G (testbed 4, DeltaS = 8/b).
        asgd_sigma: ASGD's sigma (testbed 5).
        speed_dist, link_dist, compute_time_s, link_time_s, cloud_time_s, jitter: the
            simulator's :class:`~fl_examples.core.asyncsim.TimingModel`.
        seed: root of every random stream (timing, init, batches, noise), shared by all
            algorithms of a comparison.
        eval_every: evaluate every this many applied updates (and at 0 and the end).
        epsilon_budget: per-edge budget at ``delta``; the run stops before the first upload
            that would exceed it (None: no budget).
        target_loss: an extra absolute training-loss target for the comparison.
        device: ``auto``, ``cpu`` or ``cuda[:N]``.
        batched: compute pending uploads together (default); False: one at a time, through
            ``LaplaceGradientNoise.__call__`` (the reference path).
        batch_sampler: ``distinct`` (b distinct records per upload, default) or ``poisson``
            (each record independently with probability q_k = b / n_k; the clipped sum is
            divided by b).
        amplification: price uploads with amplification by Poisson subsampling (add/remove
            neighbours, sampler outcome secret); only with ``batch_sampler="poisson"``.
        checkpoint_every: with an output directory, checkpoint every this many applied
            updates (and at the end) into ``OUT/checkpoints/<algorithm>/``; 0: never.
    """

    dataset: str = "digits"
    model: str = "logreg"
    edges: int = 30
    batch: int = 24
    updates: int = 2000
    epsilon: float | tuple[float, ...] = 1.0
    delta: float = 1e-3
    theta: float = 0.5
    sigma: float = 30.0
    lipschitz: float = 10.0
    r0: float = 50.0
    tau_max: int | None = None
    noise: str = "l2"
    variance: str = "sound"
    audp_clip: float = 4.0
    asgd_sigma: float = 5.0
    speed_dist: str = "lognormal:0,1"
    link_dist: str = "constant"
    compute_time_s: float = 1.0
    link_time_s: float = 0.1
    cloud_time_s: float = 0.0
    jitter: str = "exponential"
    seed: int = 0
    eval_every: int = 50
    epsilon_budget: float | None = None
    target_loss: float | None = None
    device: str = "cpu"
    batched: bool = True
    batch_sampler: str = "distinct"
    amplification: bool = False
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        k = _validate.positive_int("edges", self.edges)
        _validate.positive_int("batch", self.batch)
        _validate.positive_int("updates", self.updates)
        eps = self.epsilon
        if isinstance(eps, (list, tuple, np.ndarray)):
            vals = tuple(_validate.positive(f"epsilon[{i}]", e) for i, e in enumerate(eps))
            if len(vals) not in (1, k):
                raise InvalidParameterError("epsilon", eps, f"one value or {k} (one per edge)")
            object.__setattr__(self, "epsilon", vals if len(vals) > 1 else vals[0])
        else:
            object.__setattr__(self, "epsilon", _validate.positive("epsilon", eps))
        _validate.delta("delta", self.delta)
        _check_theta(self.theta)
        _validate.positive("sigma", self.sigma)
        _validate.positive("lipschitz", self.lipschitz)
        _validate.positive("r0", self.r0)
        if self.tau_max is not None:
            _validate.nonnegative_int("tau_max", self.tau_max)
        if self.noise not in NOISES:
            raise InvalidParameterError("noise", self.noise, "l2 or l1")
        if self.variance not in VARIANCES:
            raise InvalidParameterError("variance", self.variance, "sound or paper")
        _validate.positive("audp_clip", self.audp_clip)
        _validate.positive("asgd_sigma", self.asgd_sigma)
        if self.model not in ("logreg", "cnn"):
            raise InvalidParameterError("model", self.model, "logreg or cnn")
        self.timing()  # validates the simulator settings
        _validate.nonnegative_int("seed", self.seed)
        _validate.positive_int("eval_every", self.eval_every)
        if self.epsilon_budget is not None:
            _validate.positive("epsilon_budget", self.epsilon_budget)
        if self.target_loss is not None:
            _validate.positive("target_loss", self.target_loss)
        if not isinstance(self.batched, bool):
            raise InvalidParameterError("batched", self.batched, "a bool")
        if self.batch_sampler not in SAMPLERS:
            raise InvalidParameterError("batch_sampler", self.batch_sampler,
                                        "distinct or poisson")
        if not isinstance(self.amplification, bool):
            raise InvalidParameterError("amplification", self.amplification, "a bool")
        if self.amplification and self.batch_sampler != "poisson":
            raise InvalidParameterError(
                "amplification", self.amplification,
                "used only with batch_sampler='poisson' (a Poisson sampler whose outcome stays "
                "secret); a batch of b distinct records gets no amplification")
        _validate.nonnegative_int("checkpoint_every", self.checkpoint_every)

    def timing(self) -> TimingModel:
        return TimingModel(self.speed_dist, self.link_dist, self.compute_time_s,
                           self.link_time_s, self.cloud_time_s, self.jitter)

    def epsilons(self) -> np.ndarray:
        """eps_k per edge (float64, length K)."""
        e = self.epsilon
        return np.asarray(e if isinstance(e, tuple) else [e] * self.edges, dtype=np.float64)

    def tau(self) -> int:
        """The staleness bound the step sizes use: tau_max, else K - 1."""
        return self.tau_max if self.tau_max is not None else self.edges - 1


# ---------------------------------------------------------------------------------- data
def load_edges(spec: str, *, edges: int, seed: int) -> FederatedDataset:
    """The data set of ``spec`` partitioned over ``edges`` edge servers (see MapaConfig)."""
    forms = ("digits[:iid|:K], synthetic:ALPHA,BETA[:paper|:fedprox], synthetic:iid[:PRESET] "
             "or mnist:DIR")
    if not isinstance(spec, str):
        raise InvalidParameterError("dataset", spec, forms)
    k = _validate.positive_int("edges", edges)
    name, _, rest = spec.strip().partition(":")
    name = name.lower()
    if name == "digits":
        if rest in ("", "iid"):
            return digits(rng=seed, num_clients=k, classes_per_client=None)
        try:
            per = int(rest)
        except ValueError:
            raise InvalidParameterError("dataset", spec, forms) from None
        if not 1 <= per <= 10:
            raise InvalidParameterError("dataset", spec, "digits:K with 1 <= K <= 10")
        return digits(rng=seed, num_clients=k, classes_per_client=per)
    if name == "synthetic":
        args = rest.split(":")
        presets = {"paper": SyntheticPreset.UPCYCLED_PAPER, "fedprox": SyntheticPreset.FEDPROX}
        preset = presets.get(args[1].lower()) if len(args) == 2 else presets["paper"]
        if not rest or len(args) > 2 or preset is None:
            raise InvalidParameterError("dataset", spec, forms)
        if args[0].lower() == "iid":
            return synthetic(0.0, 0.0, rng=seed, num_clients=k, preset=preset, iid=True)
        try:
            a, b = (float(t) for t in args[0].split(","))
        except ValueError:
            raise InvalidParameterError("dataset", spec, forms) from None
        return synthetic(a, b, rng=seed, num_clients=k, preset=preset)
    if name == "mnist":
        if not rest or not Path(rest).is_dir():
            raise InvalidParameterError("dataset", spec, "mnist:DIR with an existing directory")
        from fl_examples.core.idx import load_mnist

        return load_mnist(rest, rng=seed, num_clients=k)
    raise InvalidParameterError("dataset", spec, forms)


@dataclass
class _Data:
    """Pooled training data (edge k owns rows offsets[k] .. offsets[k] + sizes[k] - 1)."""

    x: Tensor
    y: Tensor
    x_test: Tensor
    y_test: Tensor
    offsets: np.ndarray
    sizes: np.ndarray


def _pool(ds: FederatedDataset, device: torch.device) -> _Data:
    x, y = ds.pooled(Split.TRAIN)
    xt, yt = ds.pooled(Split.TEST)
    sizes = ds.train_sizes
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return _Data(torch.as_tensor(x, dtype=torch.float32, device=device),
                 torch.as_tensor(y, dtype=torch.long, device=device),
                 torch.as_tensor(xt, dtype=torch.float32, device=device),
                 torch.as_tensor(yt, dtype=torch.long, device=device), offsets, sizes)


# ---------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class MapaCNN:
    """The testbed CNN (spec ``mapa.md`` section 9) for flattened 28x28 grey images.

    conv(1->10, 5x5)-ReLU-maxpool2, conv(10->10, 5x5)-ReLU-maxpool2, Linear(160->10):
    d = 250 + 10 + 2500 + 10 + 1600 + 10 = 4380. Initialisation: conv filters
    N(0, 1/fan_in) (fan_in = in_channels * 25, our reading of the testbed's "1/(number of
    elements)"), the linear weight N(0, 0.01^2), biases 0.

    Examples:
        >>> MapaCNN().num_parameters
        4380
    """

    num_classes: int = 10

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"conv1_w": (10, 1, 5, 5), "conv1_b": (10,), "conv2_w": (10, 10, 5, 5),
                "conv2_b": (10,), "fc_w": (160, self.num_classes), "fc_b": (self.num_classes,)}

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in self.parameter_shapes().values())

    def init(self, generator: torch.Generator) -> Tensor:
        """A flat (d,) float32 initial model."""
        parts = []
        for name, shape in self.parameter_shapes().items():
            if name.endswith("_b"):
                parts.append(torch.zeros(math.prod(shape)))
                continue
            std = 0.01 if name == "fc_w" else 1.0 / math.sqrt(math.prod(shape[1:]))
            parts.append(torch.randn(math.prod(shape), generator=generator) * std)
        return torch.cat(parts)

    def split(self, flat: Tensor) -> dict[str, Tensor]:
        out, start = {}, 0
        for name, shape in self.parameter_shapes().items():
            n = math.prod(shape)
            out[name] = flat[start:start + n].view(shape)
            start += n
        return out

    def logits(self, flat: Tensor, x: Tensor) -> Tensor:
        """Logits (B, C) of one model (flat (d,)) on x (B, 784)."""
        p = self.split(flat)
        h = F.conv2d(x.reshape(-1, 1, 28, 28), p["conv1_w"], p["conv1_b"])
        h = F.max_pool2d(h.relu(), 2)
        h = F.conv2d(h, p["conv2_w"], p["conv2_b"])
        h = F.max_pool2d(h.relu(), 2).flatten(1)
        return h @ p["fc_w"] + p["fc_b"]


class _LogRegOps:
    """Multinomial logistic regression on flat parameters [W (F x C) row-major; b (C)]."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        self.model = MultinomialLogReg(num_features, num_classes)
        self.f, self.c = num_features, num_classes
        self.dim = (num_features + 1) * num_classes

    def init(self, generator: torch.Generator) -> Tensor:
        return flatten(self.model.init(1, generator=generator))[0]

    def logits(self, flat: Tensor, x: Tensor) -> Tensor:
        fc = self.f * self.c
        return x @ flat[:fc].view(self.f, self.c) + flat[fc:]

    def per_example(self, params: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """(m, b, d) per-example gradients of the cross-entropy, closed form."""
        m, b, _ = x.shape
        fc = self.f * self.c
        logits = torch.baddbmm(params[:, None, fc:], x, params[:, :fc].view(m, self.f, self.c))
        r = logits.softmax(-1)
        r.sub_(F.one_hot(y, self.c).to(r.dtype))
        gw = x[:, :, :, None] * r[:, :, None, :]
        return torch.cat([gw.reshape(m, b, fc), r], dim=2)

    def mean_grad(self, params: Tensor, x: Tensor, y: Tensor, mask: Tensor | None = None,
                  denom: int | None = None) -> Tensor:
        """(m, d) gradients: the sum over rows (those with ``mask`` 1) divided by ``denom``
        (default: the number of rows)."""
        m, b, _ = x.shape
        fc = self.f * self.c
        logits = torch.baddbmm(params[:, None, fc:], x, params[:, :fc].view(m, self.f, self.c))
        r = logits.softmax(-1)
        r.sub_(F.one_hot(y, self.c).to(r.dtype))
        if mask is not None:
            r.mul_(mask[:, :, None].to(r.dtype))
        r.div_(b if denom is None else denom)
        return torch.cat([torch.bmm(x.transpose(1, 2), r).reshape(m, fc), r.sum(1)], dim=1)


class _CNNOps:
    """:class:`MapaCNN` with per-example gradients from ``torch.func`` (vmap of grad)."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        if num_features != 784:
            raise InvalidParameterError("model", "cnn", "used with 28x28 images (mnist:DIR), "
                                        f"not {num_features} features")
        self.model = MapaCNN(num_classes)
        self.dim = self.model.num_parameters
        from torch.func import grad, vmap

        def loss_one(flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
            return F.cross_entropy(self.model.logits(flat, x[None]), y[None])

        self._per = vmap(vmap(grad(loss_one), in_dims=(None, 0, 0)), in_dims=(0, 0, 0))

    def init(self, generator: torch.Generator) -> Tensor:
        return self.model.init(generator)

    def logits(self, flat: Tensor, x: Tensor) -> Tensor:
        return self.model.logits(flat, x)

    def per_example(self, params: Tensor, x: Tensor, y: Tensor) -> Tensor:
        return self._per(params, x, y)

    def mean_grad(self, params: Tensor, x: Tensor, y: Tensor, mask: Tensor | None = None,
                  denom: int | None = None) -> Tensor:
        per = self._per(params, x, y)
        if mask is None and denom is None:
            return per.mean(1)
        if mask is not None:
            per = per * mask[:, :, None].to(per.dtype)
        return per.sum(1) / (per.shape[1] if denom is None else denom)


def _ops(model: str, ds: FederatedDataset) -> Any:
    if model == "cnn":
        return _CNNOps(ds.num_features, ds.num_classes)
    return _LogRegOps(ds.num_features, ds.num_classes)


@torch.no_grad()
def _evaluate(ops: Any, flat: Tensor, x: Tensor, y: Tensor, chunk: int = 8192
              ) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of one model over (x, y)."""
    if len(y) == 0:
        return float("nan"), float("nan")
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.float64, device=x.device)
    for s in range(0, len(y), chunk):
        logits = ops.logits(flat, x[s:s + chunk])
        loss += F.cross_entropy(logits, y[s:s + chunk], reduction="sum").double()
        correct += (logits.argmax(-1) == y[s:s + chunk]).sum().double()
    return float(loss) / len(y), float(correct) / len(y)


# ---------------------------------------------------------------------------------- privacy
def _stream(seed: int, tag: int, edge: int, upload: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(tag, edge, upload)))


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
    """A new ledger (in memory without ``out``), or with ``resume`` the run's existing one."""
    kw: dict[str, Any] = dict(population_id=_population(cfg, algorithm), delta=cfg.delta,
                              epsilon_budget=cfg.epsilon_budget, method="optimal",
                              neighboring_relation=_relation(cfg))
    if out is None:
        return Ledger.create(None, **kw)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ledger-{algorithm}.jsonl"
    if path.exists():
        if not resume:
            raise InvalidParameterError("out", str(out), f"a directory without {path.name} (a "
                                        "ledger never resets: use a new --out, or --resume)")
        led = Ledger.open(path)
        if (led.population_id, led.delta, led.epsilon_budget, led.method.value,
                led.neighboring_relation.name) != (kw["population_id"], cfg.delta,
                                                   cfg.epsilon_budget, "optimal",
                                                   kw["neighboring_relation"]):
            raise InvalidParameterError(
                "out", str(out), f"a directory whose {path.name} belongs to these settings (it "
                f"holds population {led.population_id!r}, delta {led.delta:g}, budget "
                f"{led.epsilon_budget}, relation {led.neighboring_relation.name}); resume with "
                "the same settings or use a new --out")
        return led
    return Ledger.create(path, **kw)


# ---------------------------------------------------------------------------------- the run
_Call = tuple[tuple[str, ...], str, int, int]
"""One spend call: (edge ids, canonical event JSON, ledger ``round``, ledger ``step``)."""


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


class _Run:
    """One algorithm over a precomputed schedule (see the module docstring)."""

    def __init__(self, algorithm: str, cfg: MapaConfig, ops: Any, data: _Data,
                 schedule: Schedule, ledger: Ledger | None, device: torch.device) -> None:
        self.alg, self.cfg, self.ops, self.data, self.sched = algorithm, cfg, ops, data, schedule
        self.ledger, self.device = ledger, device
        self.private = algorithm != "asgd"
        self.dim = ops.dim
        k = cfg.edges
        self.eps = cfg.epsilons()
        self.q = _sampling_probabilities(cfg, data.sizes)
        self.events = schedule.events_of_edge()
        # per edge: the event each upload is charged, and its unamplified version
        self.edge_events, self.base_events = _edge_events(cfg, self.dim, data.sizes) \
            if self.private else ([], [])
        self.end, self.stopped = _budget_stop(cfg, schedule, self.edge_events) \
            if self.private else (schedule.num_events, None)
        tau = cfg.tau()
        self.mapa = MapaSchedule(
            sigma=cfg.sigma, batch=cfg.batch, delta=cfg.delta, epsilon0=float(self.eps.min()),
            lipschitz=cfg.lipschitz, r0=cfg.r0, tau=tau, theta=cfg.theta, dim=self.dim,
            noise=cfg.noise, variance=cfg.variance) if algorithm == "mapa" else None
        self.audp_delta_s = 2.0 * cfg.audp_clip / cfg.batch
        self.audp_delta_b = cfg.sigma**2 / cfg.batch + noise_variance(
            self.audp_delta_s, float(self.eps.min()), self.dim, batch=cfg.batch, noise=cfg.noise,
            variance=cfg.variance)
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence(
            cfg.seed, spawn_key=(_TAG_INIT,)).generate_state(1, np.uint64)[0] >> 1))
        self.x = ops.init(gen).to(device)
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
        self._saved_at = -1
        self._json_cache: dict[DpEvent, str] = {}
        self._eps_cache: dict[tuple[DpEvent, int], float] = {}
        self._meta = {"noise": cfg.noise, "sampler": cfg.batch_sampler}

    # -- per-update quantities ------------------------------------------------------------
    def _delta_s_for(self, version: int) -> float:
        """DeltaS sent with model ``version`` (the stage of the next update)."""
        if self.alg == "mapa":
            assert self.mapa is not None
            return self.mapa.for_update(version + 1).delta_s
        return self.audp_delta_s

    def step_size(self, t: int) -> float:
        """gamma of update t (1-based)."""
        cfg, tau = self.cfg, self.cfg.tau()
        if self.alg == "mapa":
            assert self.mapa is not None
            return self.mapa.for_update(t).gamma
        if self.alg == "audp":
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

    # -- privacy --------------------------------------------------------------------------
    def _event_json(self, event: DpEvent) -> str:
        text = self._json_cache.get(event)
        if text is None:
            text = self._json_cache[event] = canonical_json(event_to_dict(event))
        return text

    def _groups(self, edges: list[int]) -> list[tuple[DpEvent, list[int]]]:
        """The spend calls charging one upload to each of ``edges``: one per distinct event."""
        groups: dict[DpEvent, list[int]] = {}
        for k in edges:
            groups.setdefault(self.edge_events[k], []).append(k)
        return list(groups.items())

    def _charge(self, edges: list[int]) -> None:
        """Charge one upload to each edge (write-ahead: before its noise is drawn).

        Entries record ``round`` = updates applied so far and ``step`` = the cloud event being
        served; an edge's ``client_seq`` is its upload number. On resume, charges a crashed run
        already wrote for these very uploads (:attr:`precharged`) are adopted, not repeated.
        """
        if not self.private or not edges:
            return
        assert self.ledger is not None
        for ev, ks in self._groups(edges):
            ids = tuple(str(k) for k in ks)
            if self.precharged:
                want = self.precharged.popleft()
                if want != (ids, self._event_json(ev), self.applied, self.events_done):
                    raise LedgerRollbackError(
                        f"the ledger's entries after the checkpoint are not the charges this "
                        f"run makes at cloud event {self.events_done}; resume from the latest "
                        "checkpoint with the same settings (spend is never rolled back)")
            else:
                try:
                    self.ledger.spend(list(ids), ev, label="upload", run_id=self.alg,
                                      round=self.applied, step=self.events_done, meta=self._meta)
                except BudgetExceededError as exc:  # the precomputed stop makes it unreachable
                    raise RuntimeError(f"budget stop and ledger disagree: {exc}") from exc
            self.charged[ks] += 1

    def _plan(self, stop: int) -> list[_Call]:
        """The spend calls this run makes from its current state through cloud event ``stop``.

        It replays the loop's control flow (flushes, drops, pulls) on copies of the flags,
        without computing anything: what is charged never depends on gradient values.
        """
        sched, calls = self.sched, []
        ready, nxt = self.ready.copy(), self.next_upload.copy()
        applied = self.applied

        def charge(edges: list[int], step: int) -> None:
            for ev, ks in self._groups(edges):
                calls.append((tuple(str(k) for k in ks), self._event_json(ev), applied, step))

        if not self.cfg.batched and self.events_done == 0:
            first = [k for k in range(self.cfg.edges) if self._will_apply(k, nxt)]
            for k in first:
                charge([k], 0)
            ready[first] = True
        for j in range(self.events_done, stop):
            k = int(sched.edge[j])
            if sched.applied[j]:
                if not ready[k]:
                    pend = [i for i in np.flatnonzero(~ready).tolist() if self._will_apply(i, nxt)]
                    charge(pend, j)
                    ready[pend] = True
                applied = int(sched.version[j])
            else:
                charge([k], j)
            nxt[k] += 1
            ready[k] = False
            if not self.cfg.batched and self._will_apply(k, nxt):
                charge([k], j + 1)
                ready[k] = True
        return calls

    def _window_end(self) -> int:
        """Cloud events up to the next checkpoint (after the next multiple of N updates)."""
        n = self.cfg.checkpoint_every
        if n:
            target = (self.applied // n + 1) * n
            hit = np.flatnonzero(self.sched.version[self.events_done:self.end] == target)
            if hit.size:
                return self.events_done + int(hit[0]) + 1
        return self.end

    def adopt(self, pointer: LedgerPointer) -> None:
        """Check the ledger against the state at ``pointer``; never lose or redo spend.

        Entries after the pointer are allowed only if they are the write-ahead charges this run
        makes before its next checkpoint (a crash after charging and before that checkpoint),
        in the same spend calls (edges, event, model version, cloud event). Replaying those
        uploads draws the same batches and noise (streams keyed by seed, edge and upload), so
        their charges are adopted rather than made twice. Anything else is refused.

        Raises:
            LedgerMismatchError: the ledger lacks the pointer's entry (an older ledger).
            LedgerRollbackError: the state is older than spend that later states depend on.
        """
        assert self.ledger is not None
        pending = self.ledger.entries_since(pointer)
        calls: list[list[dict[str, Any]]] = []
        for e in pending:
            if calls and e.get("batch_end") == calls[-1][0].get("batch_end"):
                calls[-1].append(e)
            else:
                calls.append([e])
        plan = self._plan(self._window_end()) if calls else []
        for i, es in enumerate(calls):
            ok = i < len(plan) and all(
                e.get("kind") == "spend" and e["run_id"] == self.alg and e["label"] == "upload"
                and e["count"] == 1 and e["round"] == plan[i][2] and e["step"] == plan[i][3]
                and canonical_json(e["event"]) == plan[i][1] for e in es) \
                and tuple(e["client_id"] for e in es) == plan[i][0]
            if not ok:
                raise LedgerRollbackError(
                    f"the checkpoint at cloud event {self.events_done} ({self.applied} updates, "
                    f"ledger seq {pointer.seq}) is older than the ledger (head seq "
                    f"{self.ledger.head().seq}): entry {es[0]['seq']} is spend that a later state "
                    "depends on, not an interrupted upload of this run; resume from the latest "
                    "checkpoint (spend is never rolled back)")
        self.precharged = deque(plan[:len(calls)])

    def _epsilon_max(self) -> float:
        """The largest edge epsilon after this run's charges (as the ledger replays it)."""
        top: dict[DpEvent, int] = {}
        for k in np.flatnonzero(self.charged).tolist():
            ev, n = self.edge_events[k], int(self.charged[k])
            if n > top.get(ev, 0):
                top[ev] = n
        return max((self._epsilon(ev, n) for ev, n in top.items()), default=0.0)

    def _epsilon(self, event: DpEvent, n: int, relation: str | None = None) -> float:
        key = (event, n)
        e = self._eps_cache.get(key)
        if e is None:
            e = self._eps_cache[key] = _price(event, n, self.cfg.delta,
                                              relation or _relation(self.cfg))
        return e

    # -- computing uploads ----------------------------------------------------------------
    def _batch_rows(self, k: int, u: int) -> np.ndarray:
        """Rows (into the pooled data) of upload u of edge k: b distinct records, or a Poisson
        sample keeping each of the edge's n_k records with probability q_k = b / n_k."""
        n = int(self.data.sizes[k])
        rng = _stream(self.cfg.seed, _TAG_BATCH, k, u)
        if self.cfg.batch_sampler == "poisson":
            rows = np.flatnonzero(rng.random(n) < self.q[k])
        else:
            rows = rng.choice(n, self.cfg.batch, replace=False)
        return rows + int(self.data.offsets[k])

    def _rows(self, ks: list[int], ups: list[int]) -> tuple[Tensor, Tensor | None]:
        """(jobs, rows) indices of the jobs' batches, and for Poisson batches the 0/1 mask of
        real rows (shorter batches are padded with the edge's first record, masked out)."""
        idx = [self._batch_rows(k, u) for k, u in zip(ks, ups)]
        if self.cfg.batch_sampler != "poisson":
            return torch.as_tensor(np.stack(idx), device=self.device), None
        width = max(1, max(len(r) for r in idx))
        rows = np.empty((len(ks), width), dtype=np.int64)
        mask = np.zeros((len(ks), width), dtype=bool)
        for i, (k, r) in enumerate(zip(ks, idx)):
            rows[i] = int(self.data.offsets[k])
            rows[i, :len(r)] = r
            mask[i, :len(r)] = True
        return (torch.as_tensor(rows, device=self.device),
                torch.as_tensor(mask, device=self.device))

    def _compute(self, edges: list[int]) -> None:
        """Noisy uploads of the pending jobs of ``edges`` into ``self.grads`` (charged first)."""
        t0 = time.perf_counter()
        self._charge(edges)
        b = self.cfg.batch
        per_chunk = max(1, _CHUNK_ROWS // (b * max(1, self.dim // 1024)))
        for s in range(0, len(edges), per_chunk):
            ks = edges[s:s + per_chunk]
            ups = [int(self.next_upload[k]) for k in ks]
            rows, mask = self._rows(ks, ups)
            xb, yb = self.data.x[rows], self.data.y[rows]
            params = self.pulled[ks]
            if not self.private:
                self.grads[ks] = self.ops.mean_grad(params, xb, yb) if mask is None \
                    else self.ops.mean_grad(params, xb, yb, mask, b)
                continue
            per_ex = self.ops.per_example(params, xb, yb)
            if self.cfg.batched or mask is not None:
                # (the naive path computes one job per call, so a Poisson job is alone here;
                # LaplaceGradientNoise needs exactly b rows, a Poisson batch has any number)
                self.grads[ks] = self._noisy_batched(per_ex, ks, ups, mask)
            else:
                for i, (k, u) in enumerate(zip(ks, ups)):
                    mech = _mechanism(float(self.delta_s[k]), b, float(self.eps[k]),
                                      self.cfg.noise)
                    self.grads[k] = mech(per_ex[i], rng=_stream(self.cfg.seed, _TAG_NOISE, k, u))
        self.ready[edges] = True
        self.compute += time.perf_counter() - t0

    def _noisy_batched(self, per_ex: Tensor, ks: list[int], ups: list[int],
                       mask: Tensor | None = None) -> Tensor:
        """The same release as ``LaplaceGradientNoise.__call__`` per job, clipped in groups.

        Rows are clipped to C = b DeltaS / 2, summed (those with ``mask`` 1) and divided by
        the configured b, whatever the number of rows; then each job's noise is added.
        """
        m, width, d = per_ex.shape
        b = self.cfg.batch
        flat = per_ex.reshape(m * width, d)
        clipped = torch.empty_like(flat)
        ds = self.delta_s[ks]
        for value in np.unique(ds):
            sel = np.flatnonzero(ds == value)
            rows = torch.as_tensor((sel[:, None] * width + np.arange(width)).ravel(),
                                   device=flat.device)
            clipped[rows] = clip_per_example(flat[rows], b * float(value) / 2.0)
        per = clipped.view(m, width, d).double()
        if mask is not None:
            per = per * mask[:, :, None].to(per.dtype)
        mean64 = per.sum(1) / b
        noise = np.empty((m, d))
        for i, (k, u) in enumerate(zip(ks, ups)):
            mech = _mechanism(float(ds[i]), b, float(self.eps[k]), self.cfg.noise)
            rng = _stream(self.cfg.seed, _TAG_NOISE, k, u)
            if mech.shape is NoiseShape.L2:
                noise[i] = l2_laplace_noise(noise[i], mech.alpha, rng=rng)
            else:
                noise[i] = laplace_noise(noise[i], mech.l1_sensitivity(d) / mech.epsilon, rng=rng)
        return (mean64 + torch.from_numpy(noise).to(mean64.device)).float()

    def _flush(self) -> None:
        """Compute every pending upload that this run will make (batched path)."""
        pending = [k for k in np.flatnonzero(~self.ready).tolist() if self._will_apply(k)]
        self.flushes += 1
        self._compute(pending)

    def _pull(self, k: int) -> None:
        """Edge k receives the current model (and DeltaS) and starts its next upload."""
        self.pulled[k] = self.x
        self.next_upload[k] += 1
        self.ready[k] = False
        self.delta_s[k] = self._delta_s_for(self.applied)
        if not self.cfg.batched and self._will_apply(k):
            self._compute([k])

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """Checkpoint the whole state (named by the cloud events served, which only grow)."""
        if self.precharged:
            raise RuntimeError("charges adopted on resume were not all replayed before the "
                               "next checkpoint")
        tensors = {"x": self.x, "pulled": self.pulled, "grads": self.grads}
        checkpoint.save(directory, self.events_done, tensors, {
            "algorithm": self.alg, "config": _config_json(self.cfg),
            "events_done": self.events_done, "applied": self.applied,
            "ready": self.ready.tolist(), "next_upload": self.next_upload.tolist(),
            "delta_s": self.delta_s.tolist(), "charged": self.charged.tolist(),
            "flushes": self.flushes, "diverged": self.diverged,
            "history": _history_json(self.history),
            "wall_time_s": self.wall, "client_compute_s": self.compute,
            "ledger_pointer": self.ledger.head().to_dict() if self.ledger is not None else None,
        })
        self._saved_at = self.events_done

    def restore(self, directory: Path) -> None:
        """Continue from the latest checkpoint in ``directory`` (checked against the ledger)."""
        tensors, state = checkpoint.load_latest(directory, self.device)
        if state.get("algorithm") != self.alg:
            raise checkpoint.CheckpointError(
                f"{directory}: checkpoint is for {state.get('algorithm')!r}, not {self.alg!r}")
        if state.get("config") != _config_json(self.cfg):
            raise checkpoint.CheckpointError(
                f"{directory}: checkpoint was made with another configuration; resume with the "
                "same settings or start a new --out")
        k, d = self.cfg.edges, self.dim
        shapes = {"x": (d,), "pulled": (k, d), "grads": (k, d)}
        for name, shape in shapes.items():
            if name not in tensors or tuple(tensors[name].shape) != shape:
                raise checkpoint.CheckpointError(f"{directory}: tensor {name!r} missing or not "
                                                 f"of shape {shape}")
        self.x, self.pulled, self.grads = tensors["x"], tensors["pulled"], tensors["grads"]
        self.events_done, self.applied = int(state["events_done"]), int(state["applied"])
        self.ready = np.array(state["ready"], dtype=bool)
        self.next_upload = np.array(state["next_upload"], dtype=np.int64)
        self.delta_s = np.array(state["delta_s"], dtype=np.float64)
        self.charged = np.array(state["charged"], dtype=np.int64)
        self.flushes, self.diverged = int(state["flushes"]), state["diverged"]
        self.history = _history_json(state["history"], decode=True)
        self.wall, self.compute = float(state["wall_time_s"]), float(state["client_compute_s"])
        self._saved_at = self.events_done
        if self.ledger is not None:
            ptr = state["ledger_pointer"]
            if ptr is None:
                raise checkpoint.CheckpointError(f"{directory}: a private run's checkpoint "
                                                 "without a ledger pointer")
            self.adopt(LedgerPointer.from_dict(ptr))

    # -- the loop -------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        loss, acc = _evaluate(self.ops, self.x, self.data.x, self.data.y)
        _, test_acc = _evaluate(self.ops, self.x, self.data.x_test, self.data.y_test)
        last = self.events_done - 1
        row = {"iteration": self.applied, "train_loss": loss, "train_accuracy": acc,
               "test_accuracy": test_acc, "wall_time_s": self.wall,
               "client_compute_s": self.compute,
               "simulated_time_s": float(self.sched.done_s[last]) if last >= 0 else 0.0}
        if self.private and self.ledger is not None:
            row["epsilon_max"] = self._epsilon_max()
        self.history.append(row)
        return row

    def run(self, ckpt_dir: Path | None = None) -> None:
        """Serve cloud events ``events_done .. end - 1`` (checkpointing into ``ckpt_dir``)."""
        sched = self.sched
        every = self.cfg.checkpoint_every if ckpt_dir is not None else 0
        if not self.history:
            self.evaluate()
        bar = progress(int(sched.applied[self.events_done:self.end].sum()), desc=self.alg)
        try:
            start = time.perf_counter()
            if not self.cfg.batched and self.events_done == 0:
                for k in range(self.cfg.edges):  # every edge starts on version 0
                    if self._will_apply(k):
                        self._compute([k])
            for j in range(self.events_done, self.end if self.diverged is None else 0):
                k = int(sched.edge[j])
                if sched.applied[j]:
                    if not self.ready[k]:
                        self._flush()
                    t = int(sched.version[j])
                    self.x.sub_(self.grads[k], alpha=self.step_size(t))
                    self.applied = t
                else:
                    self._charge([k])  # a dropped upload was still released
                self.events_done = j + 1
                self._pull(k)
                if not sched.applied[j]:
                    continue
                bar.update(1)
                if self.applied % self.cfg.eval_every == 0:
                    self.wall += time.perf_counter() - start
                    start = time.perf_counter()
                    if not bool(torch.isfinite(self.x).all()):
                        self.diverged = f"non-finite model after update {self.applied}"
                        break
                    row = self.evaluate()
                    bar.set_postfix(loss=f"{row['train_loss']:.3f}")
                if every and self.applied % every == 0:
                    assert ckpt_dir is not None
                    self.wall += time.perf_counter() - start
                    self.save(ckpt_dir)
                    start = time.perf_counter()
            else:
                self.wall += time.perf_counter() - start
                if self.diverged is None and not bool(torch.isfinite(self.x).all()):
                    self.diverged = f"non-finite model after update {self.applied}"
            if not self.diverged and self.history[-1]["iteration"] != self.applied:
                self.evaluate()
            if self.precharged:
                raise RuntimeError("charges adopted on resume were not all replayed")
            if every and self._saved_at != self.events_done:
                assert ckpt_dir is not None
                self.save(ckpt_dir)
        finally:
            bar.close()

    # -- report ---------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        cfg, sched, end = self.cfg, self.sched, self.events_done
        hist = sched.staleness_histogram(end)
        applied_st = sched.staleness[:end][sched.applied[:end]]
        uploads = sched.uploads_per_edge(end)
        out: dict[str, Any] = {
            "history": self.history,
            "updates": self.applied,
            "cloud_events": end,
            "dropped_uploads": int((~sched.applied[:end]).sum()),
            "staleness_histogram": {str(s): c for s, c in hist.items()},
            "staleness_mean": float(applied_st.mean()) if applied_st.size else 0.0,
            "staleness_max": int(applied_st.max()) if applied_st.size else 0,
            "tau_in_step_sizes": cfg.tau(),
            "simulated_time_s": float(sched.done_s[end - 1]) if end else 0.0,
            "uploads_per_edge": uploads.tolist(),
            "gradient_batches": self.flushes,
            "step_size": self._step_description(),
        }
        if self.mapa is not None:
            out["stages"] = [s.to_dict() for s in self.mapa.stages_through(max(self.applied, 1))]
        if self.diverged:
            out["diverged"] = self.diverged
        if self.private:
            out["privacy"] = self._privacy(uploads)
        return out

    def _step_description(self) -> dict[str, Any]:
        cfg, tau = self.cfg, self.cfg.tau()
        if self.alg == "asgd":
            return {"formula": "1/(L (tau+1)^2 + sigma sqrt(t+1)/(R sqrt(b)))", "L": cfg.lipschitz,
                    "tau": tau, "sigma": cfg.asgd_sigma, "R": cfg.r0, "b": cfg.batch}
        if self.alg == "audp":
            return {"formula": "1/(2 L (tau+1) + sqrt(Delta_b t))", "L": cfg.lipschitz,
                    "tau": tau, "delta_s": self.audp_delta_s, "clip": cfg.audp_clip,
                    "delta_b": self.audp_delta_b, "variance": cfg.variance}
        return {"formula": "1/(2 L P (tau+1)) per stage", "L": cfg.lipschitz, "tau": tau,
                "theta": cfg.theta, "R": cfg.r0, "sigma": cfg.sigma, "variance": cfg.variance}

    def _privacy(self, uploads: np.ndarray) -> dict[str, Any]:
        assert self.ledger is not None
        cfg = self.cfg
        ids = [str(k) for k in range(cfg.edges)]
        eps_map = self.ledger.epsilons(ids)
        per_edge = np.array([eps_map[i] for i in ids])
        charged = np.array([int(sum(n for _, n in self.ledger.composition(i).atoms))
                            for i in ids])
        if not np.array_equal(charged, uploads):  # each upload charged exactly once
            raise RuntimeError("ledger charges differ from the uploads made")
        basic = uploads * self.eps
        poisson = cfg.batch_sampler == "poisson"
        if poisson:
            sampling = (f"Poisson: each record of edge k independently with probability "
                        f"q_k = b / n_k (q_k from {self.q.min():.4g} to {self.q.max():.4g}); the "
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
            "per_update_epsilon_paper": {"min": float(self.eps.min()),
                                         "max": float(self.eps.max()),
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
            unamp = np.array([self._epsilon(self.base_events[k], int(n), "REPLACE_ONE")
                              if n else 0.0 for k, n in enumerate(uploads.tolist())])
            amp_step = np.array([ev.epsilon for ev in self.edge_events])
            out |= {
                "epsilon_assumption": AMPLIFICATION_ASSUMPTION,
                "epsilon_unamplified_mean": float(unamp.mean()),
                "epsilon_unamplified_max": float(unamp.max()),
                "per_edge_unamplified": unamp.tolist(),
                "per_upload_epsilon_amplified": {"min": float(amp_step.min()),
                                                 "max": float(amp_step.max())},
                "sampling_probability": {"min": float(self.q.min()),
                                         "max": float(self.q.max())},
            }
        if cfg.variance == "paper":
            out["variance_note"] = ("Delta_0 = 2 DeltaS^2/eps^2 (paper) understates the noise's "
                                    "E||eta||^2 by " + ("d(d+1)/2" if cfg.noise == "l2"
                                                        else "d^2") + " (step sizes only; the "
                                    "privacy guarantee is unaffected)")
        if self.stopped and self.events_done == self.end and self.end < self.sched.num_events:
            out["stopped"] = self.stopped
        return out


def run_algorithm(algorithm: str, cfg: MapaConfig, *, out: Path | None = None,
                  dataset: FederatedDataset | None = None, schedule: Schedule | None = None,
                  resume: bool = False) -> dict[str, Any]:
    """Run one algorithm; returns its report entry (``history``, privacy, staleness, ...).

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
    ops = _ops(cfg.model, ds)
    if schedule is None:
        schedule = simulate(cfg.edges, cfg.updates, cfg.timing(), seed=cfg.seed,
                            tau_max=cfg.tau_max)
    ckpt_dir = out / "checkpoints" / algorithm if out is not None else None
    has_ckpt = bool(resume and ckpt_dir is not None
                    and checkpoint.latest_round(ckpt_dir) is not None)
    private = algorithm != "asgd"
    if has_ckpt and private and out is not None \
            and not (out / f"ledger-{algorithm}.jsonl").exists():
        raise checkpoint.CheckpointError(
            f"{ckpt_dir}: a checkpoint exists but its ledger {out / f'ledger-{algorithm}.jsonl'} "
            "is missing; spend is never reset (use a new --out)")
    ledger = _open_ledger(cfg, algorithm, out, resume) if private else None
    run = _Run(algorithm, cfg, ops, _pool(ds, device), schedule, ledger, device)
    if has_ckpt:
        assert ckpt_dir is not None
        run.restore(ckpt_dir)
    elif resume and ledger is not None and ledger.head().seq >= 0:
        run.adopt(ledger.origin())  # a crash before the first checkpoint
    run.run(ckpt_dir if cfg.checkpoint_every else None)
    res = run.result()
    res["_model"] = run.x.detach().cpu()
    res["_ledger"] = ledger
    return res


def _check_data(cfg: MapaConfig, ds: FederatedDataset) -> None:
    if ds.num_clients != cfg.edges:
        raise InvalidParameterError("edges", cfg.edges, f"the data set's {ds.num_clients} edges")
    smallest = int(ds.train_sizes.min())
    if smallest < cfg.batch:
        raise InvalidParameterError(
            "batch", cfg.batch, f"<= the smallest edge's training set ({smallest} records, "
            f"{cfg.edges} edges): b distinct records per upload; use fewer edges or a smaller "
            "batch")


def updates_to_loss(history: list[dict[str, Any]], target: float) -> int | None:
    """The first evaluated update count whose training loss is <= target (None: never)."""
    for row in history:
        if row["train_loss"] is not None and row["train_loss"] <= target:
            return int(row["iteration"])
    return None


def _comparison(cfg: MapaConfig, algs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    first = next(iter(algs.values()))["history"]
    f0 = float(first[0]["train_loss"])
    targets = [(f"{q:g} x initial loss", q * f0) for q in TARGET_FRACTIONS]
    if cfg.target_loss is not None:
        targets.append(("absolute", cfg.target_loss))
    rows = []
    for label, target in targets:
        need = {n: updates_to_loss(r["history"], target) for n, r in algs.items()}
        row: dict[str, Any] = {"target": label, "target_loss": target, "updates": need}
        m = need.get("mapa")
        for other in ("audp", "asgd"):
            o = need.get(other)
            if "mapa" in need and other in need:
                row[f"mapa_over_{other}"] = (m / o) if (m is not None and o) else None
        rows.append(row)
    best = {n: min(h["train_loss"] for h in r["history"]) for n, r in algs.items()}
    return {"initial_loss": f0, "targets": rows, "best_train_loss": best,
            "note": "updates are resolved to the evaluation grid (eval_every); a ratio < 1 "
                    "means MAPA needed fewer updates; None: a side never reached the target"}


def _plot_extras(out: Path, schedule: Schedule, end: int,
                 stages: list[dict[str, Any]] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = schedule.staleness_histogram(end)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if hist:
        ax.bar(list(hist), list(hist.values()), width=1.0)
    ax.set_xlabel("staleness tau (updates applied between pull and apply)")
    ax.set_ylabel("applied updates")
    ax.set_title(f"staleness, {schedule.num_edges} edges")
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=110)
    plt.close(fig)
    if stages:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        idx = [s["index"] for s in stages]
        for ax, key, title in zip(axes, ("delta_s", "gamma", "length"),
                                  ("DeltaS_s (clip C_s = b DeltaS_s / 2)", "gamma_s", "T_s")):
            ax.plot(idx, [s[key] for s in stages], "o-")
            ax.set_yscale("log")
            ax.set_xlabel("stage")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "schedule.png", dpi=110)
        plt.close(fig)


def train(cfg: MapaConfig, *, algorithms: tuple[str, ...] = ALGORITHMS,
          out: str | Path | None = None, resume: bool = False) -> dict[str, Any]:
    """Run ``algorithms`` on one schedule and one data set (same seed); write the report.

    ``resume=True`` continues each algorithm from its latest checkpoint in ``out`` (see
    :func:`run_algorithm`). The report's only wall-clock fields are ``wall_time_s`` and
    ``client_compute_s`` (history rows, ``config.simulator.wall_time_s``); everything else is
    the same bitwise for a resumed run and an uninterrupted one.
    """
    if not algorithms:
        raise InvalidParameterError("algorithms", algorithms, "at least one algorithm")
    for name in algorithms:
        if name not in ALGORITHMS:
            raise InvalidParameterError("algorithms", name, f"among {', '.join(ALGORITHMS)}")
    ds = load_edges(cfg.dataset, edges=cfg.edges, seed=cfg.seed)
    _check_data(cfg, ds)
    _ops(cfg.model, ds)  # model/data mismatches fail before any ledger file is created
    out_path = Path(out) if out is not None else None
    if out_path is not None and not resume:
        for name in algorithms:
            if name != "asgd" and (out_path / f"ledger-{name}.jsonl").exists():
                raise InvalidParameterError("out", str(out_path), f"a directory without "
                                            f"ledger-{name}.jsonl (use a new --out, or "
                                            "--resume)")
    t0 = time.perf_counter()
    schedule = simulate(cfg.edges, cfg.updates, cfg.timing(), seed=cfg.seed, tau_max=cfg.tau_max)
    sim_s = time.perf_counter() - t0
    results: dict[str, Any] = {}
    for name in dict.fromkeys(algorithms):
        results[name] = run_algorithm(name, cfg, out=out_path, dataset=ds, schedule=schedule,
                                      resume=resume)
    public = {n: {k: v for k, v in r.items() if not k.startswith("_")}
              for n, r in results.items()}
    config = dataclasses.asdict(cfg) | {
        "algorithms": list(dict.fromkeys(algorithms)),
        "dataset_description": ds.description, "num_parameters": _ops(cfg.model, ds).dim,
        "train_sizes": {"min": int(ds.train_sizes.min()), "max": int(ds.train_sizes.max()),
                        "total": int(ds.train_sizes.sum())},
        "simulator": {"method": schedule.method, "wall_time_s": sim_s,
                      "speeds": {"min": float(schedule.speeds.min()),
                                 "median": float(np.median(schedule.speeds)),
                                 "max": float(schedule.speeds.max())}},
    }
    comparison = _comparison(cfg, public)
    if out_path is not None:
        path = write_report(out_path, config, public)
        body = json.loads(path.read_text(encoding="utf-8"))
        body["comparison"] = comparison
        atomic_write_bytes(path, json.dumps(body, indent=1, allow_nan=False).encode("utf-8"))
        end = max(r["cloud_events"] for r in public.values())
        _plot_extras(out_path, schedule, end, public.get("mapa", {}).get("stages"))
    return {"config": config, "algorithms": results, "comparison": comparison}


def final_table(result: dict[str, Any]) -> str:
    """A text table of each algorithm's last evaluation, privacy and the comparison."""
    lines = [f"{'algorithm':<9} {'updates':>7} {'train loss':>10} {'train acc':>9} "
             f"{'test acc':>8} {'sim s':>9} {'wall s':>7} {'tau mean':>8} {'tau max':>7}"]
    notes = []
    for name, r in result["algorithms"].items():
        f = r["history"][-1]
        lines.append(f"{name:<9} {r['updates']:>7} {f['train_loss']:>10.4f} "
                     f"{f['train_accuracy']:>9.4f} {f['test_accuracy']:>8.4f} "
                     f"{r['simulated_time_s']:>9.1f} {f['wall_time_s']:>7.2f} "
                     f"{r['staleness_mean']:>8.1f} {r['staleness_max']:>7}")
        if "diverged" in r:
            notes.append(f"{name}: {r['diverged']}")
        if "privacy" in r:
            p = r["privacy"]
            amp = (f" [{p['epsilon_assumption']}; unamplified: mean "
                   f"{p['epsilon_unamplified_mean']:.4g}, max {p['epsilon_unamplified_max']:.4g}]"
                   if p.get("amplified") else "")
            notes.append(
                f"{name}: per-edge eps mean {p['epsilon_mean']:.4g}, max {p['epsilon_max']:.4g} "
                f"at delta={p['delta']:g}{amp} (optimal composition; basic max "
                f"{p['epsilon_basic_max']:.4g}); the paper's per-update claim: eps = "
                f"{p['per_update_epsilon_paper']['max']:g}; uploads per edge "
                f"{p['uploads_min']}..{p['uploads_max']} (mean {p['uploads_mean']:.1f})"
                + (f"\n  {p['stopped']}" if "stopped" in p else ""))
    comp = result["comparison"]
    cmp_lines = [f"updates to reach a training loss (initial {comp['initial_loss']:.4f}):"]
    for row in comp["targets"]:
        need = ", ".join(f"{n} {v if v is not None else 'never'}"
                         for n, v in row["updates"].items())
        ratios = "; ".join(f"{k.replace('_over_', '/')} {v:.3g}" for k, v in row.items()
                           if k.startswith("mapa_over_") and v is not None)
        cmp_lines.append(f"  <= {row['target_loss']:.4f} ({row['target']}): {need}"
                         + (f"  [{ratios}]" if ratios else ""))
    return "\n".join(lines + ([""] + notes if notes else []) + [""] + cmp_lines)
