"""MAPA's configuration, its edges' data and its model.

:class:`MapaConfig` holds everything a run needs (saved in the report so the run can be
repeated); :func:`load_edges` partitions a data set over the edge servers; :func:`make_model`
is the core model an edge trains (:class:`~fl_examples.core.models.MultinomialLogReg` or the
testbed CNN :class:`~fl_examples.core.deep_models.PooledCNN`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fl_examples.core.asyncsim import TimingModel
from fl_examples.core.canaries import check_count, refusal
from fl_examples.core.data import (
    MAX_SYNTHETIC_CLIENTS,
    FederatedDataset,
    SyntheticPreset,
    check_digits_clients,
    digits,
    synthetic,
)
from fl_examples.core.deep_models import PooledCNN
from fl_examples.core.models import MultinomialLogReg, PerExampleModel
from fl_examples.core.run import check_shared_settings, target_within_budget
from fl_examples.mapa.schedule import (
    NOISE_CHOICES,
    STEP_SCHEDULES,
    VARIANCES,
    MapaSchedule,
    _check_theta,
    noise_variance,
    step_rule,
)
from privkit import _validate
from privkit.errors import InvalidParameterError

__all__ = ["ALGORITHMS", "SAMPLERS", "DEFAULT_DELTA", "THEOREM3_DELTA", "DEFAULT_CLIP",
           "MapaConfig", "load_edges",
           "check_edges_spec", "make_model"]

ALGORITHMS = ("mapa", "audp", "asgd")


SAMPLERS = ("distinct", "poisson")


DEFAULT_DELTA = 1e-5
"""``delta``, the delta of every reported epsilon, when none is given (as in every trainer)."""


THEOREM3_DELTA = 1e-3
"""Theorem 3's failure probability when none is given: the paper's testbed setting (spec
``mapa.md`` section 9), which gives the Laplace noises' first clip C_0 = 1341.47 at sigma 30,
b 24. A schedule constant: privkit clips every upload, so it is not a privacy parameter."""


_FLOAT32_MAX = float(np.finfo(np.float32).max)

DEFAULT_CLIP = 1.0
"""The Gaussian mode's per-example clip C when none is given (measured: docs/trainers/mapa.md)."""


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
        epsilon: eps_k of every edge (one number), or one per edge (a tuple of K): the
            per-upload pure epsilon of ``l2`` / ``l1`` (unused by ``gaussian``).
        delta: the delta every composed epsilon (and ``epsilon_budget``) is reported at
            (None or left out: 1e-5, as in every trainer; the paper reports per-upload pure
            epsilons).
        theorem3_delta: ``l2`` / ``l1`` only: Theorem 3's failure probability, which sets
            MAPA's first clip C_0 = b DeltaS_0 / 2 (None: :data:`THEOREM3_DELTA`, the paper's
            1e-3). A schedule constant, not a privacy parameter: every upload is clipped.
        theta, sigma, lipschitz, r0: MAPA's theta, sigma, L and R (testbed: 0.5, 30, 10, 50).
        tau_max: drop uploads staler than this, and use it in the step sizes; None: nothing is
            dropped and the step sizes use K - 1 (the mean staleness of K always-busy edges).
        noise: ``l2`` (L2-norm Laplace, default), ``l1`` (per-coordinate Laplace) or
            ``gaussian`` (DP-SGD's release: per-example clip C, sum of a Poisson batch,
            N(0, (z C)^2 I), divided by b; charged ``PoissonSampledDpEvent(b / n_k,
            GaussianDpEvent(z))`` per upload under add/remove one record, composed on privkit's
            PLD).
        variance: ``sound`` (the noise's true E||eta||^2 in Delta_b) or ``paper``.
        audp_clip: AUDP's fixed per-example clip G (testbed 4, DeltaS = 8/b); ``gaussian``
            uses ``clip`` instead.
        asgd_sigma: ASGD's sigma (testbed 5).
        speed_dist, link_dist, compute_time_s, link_time_s, cloud_time_s, jitter: the
            simulator's :class:`~fl_examples.core.asyncsim.TimingModel`.
        seed: root of every random stream (timing, init, batches, noise), shared by all
            algorithms of a comparison.
        eval_every: evaluate every this many applied updates (and at 0 and the end).
        epsilon_budget: per-edge budget at ``delta``; the run stops before the first upload
            that would exceed it (None: no budget).
        target_loss: an extra absolute training-loss target for the comparison.
        device: ``auto`` (the default, as in every trainer: CUDA when available), ``cpu`` or
            ``cuda[:N]``.
        batched: compute pending uploads together (default); False: one at a time, through
            ``LaplaceGradientNoise.__call__`` (the reference path).
        batch_sampler: ``distinct`` (b distinct records per upload) or ``poisson`` (each
            record independently with probability q_k = b / n_k; the clipped sum is divided
            by b). None: ``distinct``, or ``poisson`` for ``gaussian`` (which needs it).
        amplification: price uploads with amplification by Poisson subsampling (add/remove
            neighbours, sampler outcome secret); only with ``batch_sampler="poisson"``.
        checkpoint_every: with an output directory, checkpoint every this many applied
            updates (and at the end) into ``OUT/checkpoints/<algorithm>/``; 0: never.
        noise_multiplier: ``gaussian`` only: z (None: 1, unless ``noise_for_epsilon``).
        noise_for_epsilon: ``gaussian`` only: calibrate z so that every edge's whole-run
            epsilon at ``delta`` is <= this, for the uploads the schedule makes.
        clip: ``gaussian`` only: the per-example clip C, AUDP's fixed clip and MAPA's first
            stage's (None: 1). The pure-DP noises use ``audp_clip`` and Thm 3.
        step_schedule: ``paper`` (the paper's step sizes), ``constant`` (``lr`` for every
            update) or ``auto`` (default: ``constant`` for ASGD and ``gaussian``, ``paper``
            for AUDP and MAPA with ``l2`` / ``l1``); see
            :func:`~fl_examples.mapa.schedule.step_rule`.
        lr: the constant step size.
        secure_noise: the private algorithms' batches and noise from the OS CSPRNG (otherwise
            a private run is a seeded simulation).
        eval_client_data: the private algorithms also evaluate on the edges' training and test
            data (listed as not covered by their epsilon).
        audit_canaries: ``gaussian`` only: M > 0 plants M white-box canary records in one
            edge's uploads (the edge with the most) of the first private algorithm and audits
            the run against that edge's epsilon (:mod:`fl_examples.core.canaries`).
    """

    dataset: str = "digits"
    model: str = "logreg"
    edges: int = 30
    batch: int = 24
    updates: int = 2000
    epsilon: float | tuple[float, ...] = 1.0
    delta: float | None = DEFAULT_DELTA
    theorem3_delta: float | None = None
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
    device: str = "auto"
    batched: bool = True
    batch_sampler: str | None = None
    amplification: bool = False
    checkpoint_every: int = 0
    noise_multiplier: float | None = None
    noise_for_epsilon: float | None = None
    clip: float | None = None
    step_schedule: str = "auto"
    lr: float = 0.1
    secure_noise: bool = False
    eval_client_data: bool = False
    audit_canaries: int = 0

    def __post_init__(self) -> None:
        if self.noise not in NOISE_CHOICES:
            raise InvalidParameterError("noise", self.noise, "l2, l1 or gaussian")
        gaussian = self.noise == "gaussian"
        if self.delta is None:  # (None: the default, as before)
            object.__setattr__(self, "delta", DEFAULT_DELTA)
        if self.batch_sampler is None:
            object.__setattr__(self, "batch_sampler", "poisson" if gaussian else "distinct")
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
        check_shared_settings(self)  # delta, budget, seed, eval/checkpoint grid
        if self.theorem3_delta is not None:
            _validate.delta("theorem3_delta", self.theorem3_delta)
        _check_theta(self.theta)
        _validate.positive("sigma", self.sigma)
        _validate.positive("lipschitz", self.lipschitz)
        _validate.positive("r0", self.r0)
        if self.tau_max is not None:
            _validate.nonnegative_int("tau_max", self.tau_max)
        if self.variance not in VARIANCES:
            raise InvalidParameterError("variance", self.variance, "sound or paper")
        _validate.positive("audp_clip", self.audp_clip)
        _validate.positive("asgd_sigma", self.asgd_sigma)
        if self.model not in ("logreg", "cnn"):
            raise InvalidParameterError("model", self.model, "logreg or cnn")
        self.timing()  # validates the simulator settings
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
        self._check_gaussian()
        m = check_count(self.audit_canaries, checkpoint_every=self.checkpoint_every)
        if m and not gaussian:
            raise refusal(m, f"with --noise {self.noise} (pure-DP Laplace uploads: the "
                          "Gaussian one-run bound assumes Gaussian scores; privkit audit "
                          "laplace-l2|laplace-l1 audits the mechanism; --noise gaussian "
                          "uploads take canaries)")
        if self.step_schedule not in STEP_SCHEDULES:
            raise InvalidParameterError("step_schedule", self.step_schedule,
                                        " or ".join(STEP_SCHEDULES))
        _validate.positive("lr", self.lr)
        if self.lr > _FLOAT32_MAX:
            raise InvalidParameterError("lr", self.lr, f"at most {_FLOAT32_MAX:.4g} (the model "
                                        "is float32: a larger step is not a number)")
        if 1.0 / self.lipschitz > _FLOAT32_MAX:
            raise InvalidParameterError(
                "lipschitz", self.lipschitz, f"at least {1.0 / _FLOAT32_MAX:.4g} (the step "
                "sizes, up to 1 / L, must be float32 numbers)")
        self._check_step_sizes()

    def _check_step_sizes(self) -> None:
        """The noise's variance and MAPA's first stage are finite numbers (a huge
        ``noise_multiplier``, a tiny upload ``epsilon`` or a huge ``sigma`` overflow them):
        refused here, before anything runs, naming the parameter. The model's dimension,
        which multiplies the variance, is checked again when the run builds its schedule.
        A calibrated noise multiplier (``noise_for_epsilon``) is checked then too."""
        gaussian = self.noise == "gaussian"
        z = self.noise_multiplier if gaussian else None
        if gaussian and z is None and self.noise_for_epsilon is not None:
            return
        z = 1.0 if gaussian and z is None else z
        eps0 = float(self.epsilons().min())
        clip = float(self.clip if gaussian else self.audp_clip)  # type: ignore[arg-type]
        name = "clip" if gaussian else "audp_clip"
        sensitivity = 2.0 * clip / self.batch
        if not (0 < sensitivity * sensitivity < math.inf
                and float(self.epsilons().max()) / sensitivity < math.inf):
            raise InvalidParameterError(name, clip, f"a clip whose sensitivity 2 C / b = "
                                        f"{sensitivity:.4g}, its square and epsilon over it "
                                        "are positive finite numbers")
        if gaussian and z * clip > _FLOAT32_MAX / 1e3:
            raise InvalidParameterError(
                "noise_multiplier", z, f"at most {_FLOAT32_MAX / 1e3 / clip:.4g} with --clip "
                f"{clip:g} (the noise's stddev z C is drawn in float32, with room for its "
                "tails)")
        noise_variance(2.0 * clip / self.batch, eps0, 1, batch=self.batch, noise=self.noise,
                       variance=self.variance, noise_multiplier=z)  # AUDP's
        MapaSchedule(sigma=self.sigma, batch=self.batch, delta=self.schedule_delta(),
                     epsilon0=eps0, lipschitz=self.lipschitz, r0=self.r0, tau=self.tau(),
                     theta=self.theta, dim=1, noise=self.noise, variance=self.variance,
                     noise_multiplier=z, initial_clip=self.clip,
                     step=self.stage_step()).stage(0)

    def schedule_delta(self) -> float:
        """Theorem 3's failure probability MAPA's schedule uses (unused by ``gaussian``,
        whose first clip is ``clip``)."""
        return float(THEOREM3_DELTA if self.theorem3_delta is None else self.theorem3_delta)

    def stage_step(self) -> float | None:
        """The step MAPA's stage lengths are computed for (``MapaSchedule(step=...)``): ``lr``
        in the Gaussian mode when MAPA steps with it (``step_schedule`` ``constant`` or
        ``auto``), else None (each stage's own gamma, the paper's schedule)."""
        if self.noise == "gaussian" and step_rule(self.step_schedule, "mapa",
                                                  self.noise) == "constant":
            return float(self.lr)
        return None

    def _check_gaussian(self) -> None:
        """The Gaussian mode's settings: Poisson batches, z given or calibrated, not both."""
        if self.noise != "gaussian":
            for name in ("noise_multiplier", "noise_for_epsilon", "clip"):
                if getattr(self, name) is not None:
                    raise InvalidParameterError(name, getattr(self, name),
                                                "used only with noise='gaussian'")
            return
        if self.theorem3_delta is not None:
            raise InvalidParameterError(
                "theorem3_delta", self.theorem3_delta, "left out with noise='gaussian' "
                "(Theorem 3 sets the Laplace noises' first clip; the Gaussian mode starts at "
                "clip)")
        if self.batch_sampler != "poisson":
            raise InvalidParameterError(
                "batch_sampler", self.batch_sampler,
                "poisson with noise='gaussian' (its accounting is that of Poisson-sampled "
                "minibatches)")
        if self.amplification:
            raise InvalidParameterError(
                "amplification", self.amplification,
                "False with noise='gaussian' (its events are Poisson-subsampled Gaussians "
                "already; --amplification is for the pure-DP noises)")
        if self.clip is None:
            object.__setattr__(self, "clip", DEFAULT_CLIP)
        _validate.positive("clip", self.clip)
        if self.noise_multiplier is not None:
            _validate.positive("noise_multiplier", self.noise_multiplier)
        target = target_within_budget("noise_for_epsilon", self.noise_for_epsilon,
                                      self.epsilon_budget)
        if target is not None and self.noise_multiplier is not None:
            raise InvalidParameterError(
                "noise_for_epsilon", self.noise_for_epsilon,
                "given without noise_multiplier (it calibrates the noise multiplier)")

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


def load_edges(spec: str, *, edges: int, seed: int) -> FederatedDataset:
    """The data set of ``spec`` partitioned over ``edges`` edge servers (see MapaConfig)."""
    return _edges_loader(spec, edges=edges, seed=seed)()


def check_edges_spec(spec: str, *, edges: int, seed: int) -> None:
    """Check ``spec`` as :func:`load_edges` does, reading and making no data: the grammar,
    the numbers, that a DIR exists, and that every edge of a digits split holds a training
    record (naming ``edges``, the ``--clients`` flag)."""
    _edges_loader(spec, edges=edges, seed=seed)


def _edges_loader(spec: str, *, edges: int, seed: int) -> Callable[[], FederatedDataset]:
    forms = ("digits[:iid|:K], synthetic:ALPHA,BETA[:paper|:fedprox], synthetic:iid[:PRESET] "
             "or mnist:DIR")
    if not isinstance(spec, str):
        raise InvalidParameterError("dataset", spec, forms)
    k = _validate.positive_int("edges", edges)
    name, _, rest = spec.strip().partition(":")
    name = name.lower()
    if name == "digits":
        if rest in ("", "iid"):
            per: int | None = None
        else:
            try:
                per = int(rest)
            except ValueError:
                raise InvalidParameterError("dataset", spec, forms) from None
            if not 1 <= per <= 10:
                raise InvalidParameterError("dataset", spec, "digits:K with 1 <= K <= 10")
        check_digits_clients("edges", k, num_clients=k, classes_per_client=per, seed=seed)
        return functools.partial(digits, rng=seed, num_clients=k, classes_per_client=per)
    if name == "synthetic":
        args = rest.split(":")
        presets = {"paper": SyntheticPreset.UPCYCLED_PAPER, "fedprox": SyntheticPreset.FEDPROX}
        preset = presets.get(args[1].lower()) if len(args) == 2 else presets["paper"]
        if not rest or len(args) > 2 or preset is None:
            raise InvalidParameterError("dataset", spec, forms)
        if k > MAX_SYNTHETIC_CLIENTS:
            raise InvalidParameterError("edges", k, f"at most {MAX_SYNTHETIC_CLIENTS} with a "
                                        "synthetic --dataset")
        if args[0].lower() == "iid":
            return functools.partial(synthetic, 0.0, 0.0, rng=seed, num_clients=k,
                                     preset=preset, iid=True)
        try:
            a, b = (float(t) for t in args[0].split(","))
        except ValueError:
            raise InvalidParameterError("dataset", spec, forms) from None
        if not all(math.isfinite(x) and x >= 0 for x in (a, b)):
            raise InvalidParameterError("dataset", spec, "synthetic:ALPHA,BETA with ALPHA and "
                                        "BETA finite and >= 0")
        return functools.partial(synthetic, a, b, rng=seed, num_clients=k, preset=preset)
    if name == "mnist":
        if not rest or not Path(rest).is_dir():
            raise InvalidParameterError("dataset", spec, "mnist:DIR with an existing directory")
        from fl_examples.core.idx import load_mnist

        return functools.partial(load_mnist, rest, rng=seed, num_clients=k)
    raise InvalidParameterError("dataset", spec, forms)


def _check_data(cfg: MapaConfig, ds: FederatedDataset) -> None:
    if ds.num_clients != cfg.edges:
        raise InvalidParameterError("edges", cfg.edges, f"the data set's {ds.num_clients} edges")
    smallest = int(ds.train_sizes.min())
    if smallest < cfg.batch and cfg.noise == "gaussian":
        raise InvalidParameterError(
            "batch", cfg.batch, f"<= the smallest edge's training set ({smallest} records, "
            f"{cfg.edges} edges): each edge's Poisson rate b / n_k must lie in (0, 1]; use "
            "fewer edges or a smaller batch")
    if smallest < cfg.batch:
        raise InvalidParameterError(
            "batch", cfg.batch, f"<= the smallest edge's training set ({smallest} records, "
            f"{cfg.edges} edges): b distinct records per upload; use fewer edges or a smaller "
            "batch")


def make_model(model: str, ds: FederatedDataset) -> PerExampleModel:
    """The model every edge of a run trains: ``logreg`` or ``cnn`` (28x28 images only)."""
    if model == "cnn":
        if ds.num_features != 784:
            raise InvalidParameterError("model", "cnn", "used with 28x28 images (mnist:DIR), "
                                        f"not {ds.num_features} features")
        return PooledCNN(num_classes=ds.num_classes)
    return MultinomialLogReg(ds.num_features, ds.num_classes)
