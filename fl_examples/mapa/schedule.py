"""MAPA's step sizes and stage schedule, and the AUDP / ASGD step sizes (public constants only).

Spec ``mapa.md`` section 4: Thm 3's first sensitivity, the per-stage shrink, each stage's step
size and length; :func:`noise_variance` is the ``Delta_0`` the formulas use. Nothing here
touches data, so none of it costs privacy.

The Gaussian mode (not the paper's) derives its stages the way the sound schedule does for
the Laplace noises, from the true variance of what an edge uploads:

* ``Delta_b = min(sigma, C_s)^2 / b + d (z C_s / b)^2``. Every per-example gradient is
  clipped to C_s, so the Poisson-sampled sum over b varies about its mean by at most
  C_s^2 / b (``sum_i q (1 - q) ||g_i||^2 / b^2 <= n q C_s^2 / b^2``) however large the
  testbed's sigma (30, for unclipped CNN gradients) is; the second term is the noise's
  E||eta||^2.
* ``T_s = ceil(R / (L step^2 Delta_b))``, the update count at which the convergence bound's
  optimisation term ``2 R / (step T)`` falls to its noise term ``2 L step Delta_b``
  (Theorem 4's structure, spec section 4). With the paper's step
  ``gamma_s = 1 / (2 L P (tau+1))`` this is the paper's ``4 L P^2 (tau+1)^2 R / Delta_b``;
  with a constant step (``step_schedule`` ``constant`` or ``auto``) it is the length for the
  step the run takes (``MapaSchedule(step=lr)``).

With the testbed's sigma and gamma the Gaussian mode's first stage was millions of updates
long (4 944 445 for the default digits run), so MAPA never left it and equalled AUDP.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.mechanisms import LaplaceGradientNoise, NoiseShape

__all__ = ["NOISES", "NOISE_CHOICES", "VARIANCES", "STEP_SCHEDULES", "step_rule",
           "initial_sensitivity", "noise_variance", "Stage", "MapaSchedule", "audp_step",
           "asgd_step"]

NOISES = {"l2": NoiseShape.L2, "l1": NoiseShape.L1}
"""The pure-DP noises (shapes of :class:`~privkit.mechanisms.LaplaceGradientNoise`)."""


NOISE_CHOICES = ("l2", "l1", "gaussian")
"""Every ``noise``: the pure-DP ones and ``gaussian`` (DP-SGD's, Poisson-sampled batches)."""


VARIANCES = ("sound", "paper")

#: The longest stage (updates): a longer one outlasts any run, so it is capped here.
_LONGEST = 2**62


STEP_SCHEDULES = ("auto", "paper", "constant")
"""Step-size choices (:func:`step_rule`): ``paper`` (the paper's formulas for all three),
``constant`` (``lr`` for all three) and ``auto``, the default (see :func:`step_rule`)."""


def step_rule(step_schedule: str, algorithm: str, noise: str) -> str:
    """The rule an algorithm's updates use: ``paper`` or ``constant``.

    ``auto`` picks ``constant`` for ASGD (the paper's ASGD step falls as 1/(tau+1)^2 and
    stalls at high staleness) and for the Gaussian noise, and ``paper`` for AUDP and MAPA with
    the pure-DP noises (their noise-aware formulas: a constant step with Laplace noise of norm
    about d DeltaS / eps makes the loss blow up).
    """
    if step_schedule not in STEP_SCHEDULES:
        raise InvalidParameterError("step_schedule", step_schedule, " or ".join(STEP_SCHEDULES))
    if step_schedule != "auto":
        return step_schedule
    return "constant" if algorithm == "asgd" or noise == "gaussian" else "paper"


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
                   variance: str = "sound", noise_multiplier: float | None = None) -> float:
    """Delta_0: E||eta||^2 of one upload's noise at sensitivity ``delta_s``.

    ``sound``: the mechanism's true value, d(d+1) (DeltaS/eps)^2 for ``l2`` and
    2 d^2 (DeltaS/eps)^2 for ``l1``. ``paper``: 2 DeltaS^2 / eps^2, the 1-D Laplace variance
    the paper uses (it understates the l2 noise by d(d+1)/2). ``gaussian`` (clip
    C = b DeltaS / 2, noise N(0, (z C)^2 I) on the clipped sum, divided by b): d (z DeltaS / 2)^2,
    or with ``paper`` one coordinate's (z DeltaS / 2)^2; ``epsilon`` is then unused.
    """
    if variance not in VARIANCES:
        raise InvalidParameterError("variance", variance, "sound or paper")
    if noise not in NOISE_CHOICES:
        raise InvalidParameterError("noise", noise, "l2, l1 or gaussian")
    if noise == "gaussian":
        z = _validate.positive("noise_multiplier", noise_multiplier)
        half = z * _validate.positive("delta_s", delta_s) / 2.0
        dims = 1 if variance == "paper" else _validate.positive_int("dim", dim)
        try:
            value = half**2 * dims
        except OverflowError:
            value = math.inf
        return _finite_variance(value, "noise_multiplier", z)
    if variance == "paper":
        ratio = _validate.positive("delta_s", delta_s) / _validate.positive("epsilon", epsilon)
        try:
            value = 2.0 * ratio**2
        except OverflowError:
            value = math.inf
        return _finite_variance(value, "epsilon", epsilon)
    try:
        value = _mechanism(delta_s, batch, epsilon, noise).noise_variance(dim)
    except (OverflowError, ZeroDivisionError):  # a scale whose square under- or overflows
        value = math.inf
    return _finite_variance(value, "epsilon", epsilon)


def _finite_variance(value: float, name: str, given: float) -> float:
    """``value`` if finite; else the noise is too large for any step-size formula: an error
    naming the parameter that sets it (``noise_multiplier`` or the upload ``epsilon``)."""
    if math.isfinite(value):
        return float(value)
    what = "small" if name == "noise_multiplier" else "large"
    raise InvalidParameterError(
        name, given, f"{what} enough that the noise's variance E||eta||^2 is a finite number "
        "(it overflows: each upload would be all noise)")


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
    step: float | None = None  # the step the length is for, when not the paper's gamma

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
        noise: the noise (``l2``, ``l1`` or ``gaussian``), see :func:`noise_variance`.
        variance: ``sound`` (the noise's true variance) or ``paper``, see
            :func:`noise_variance`.
        noise_multiplier: z of the ``gaussian`` noise (unused otherwise).
        initial_clip: the first stage's clip C_0 (DeltaS_0 = 2 C_0 / b); None: Theorem 3's
            (:func:`initial_sensitivity`).
        step: the constant step size the run takes instead of each stage's gamma (None:
            gamma); a stage then lasts ``ceil(R / (L step^2 Delta_b))`` updates, the paper's
            balance of the bound's two terms for that step (module docstring). The trainer
            passes its ``lr`` in the Gaussian mode with a constant step.

    With ``noise="gaussian"`` the sampling term of Delta_b is ``min(sigma, C_s)^2 / b``: the
    uploads are sums of gradients clipped to C_s (module docstring).

    Examples:
        >>> s = MapaSchedule(sigma=30, batch=24, delta=1e-3, epsilon0=1, lipschitz=10, r0=50,
        ...                  tau=3, theta=0.5, dim=4380, variance="paper")
        >>> [s.stage(i).length for i in range(5)]
        [2, 6, 21, 75, 237]
    """

    def __init__(self, *, sigma: float, batch: int, delta: float, epsilon0: float,
                 lipschitz: float, r0: float, tau: int, theta: float, dim: int,
                 noise: str = "l2", variance: str = "sound",
                 noise_multiplier: float | None = None,
                 initial_clip: float | None = None, step: float | None = None) -> None:
        self.sigma = _validate.positive("sigma", sigma)
        self.batch = _validate.positive_int("batch", batch)
        self.delta = _validate.delta("delta", delta)
        self.epsilon0 = _validate.positive("epsilon", epsilon0)
        self.lipschitz = _validate.positive("lipschitz", lipschitz)
        self.r0 = _validate.positive("r0", r0)
        self.tau = _validate.nonnegative_int("tau_max", tau)
        self.theta = _check_theta(theta)
        self.dim = _validate.positive_int("dim", dim)
        noise_variance(1.0, 1.0, 1, batch=1, noise=noise, variance=variance,
                       noise_multiplier=noise_multiplier)  # validate names (and z)
        self.noise, self.variance, self.noise_multiplier = noise, variance, noise_multiplier
        self.initial_clip = None if initial_clip is None else _validate.positive(
            "clip", initial_clip)
        self.step = None if step is None else _validate.positive("lr", step)
        self._stages: list[Stage] = []
        self._ends: list[int] = []  # last update of each stage

    def _make(self, index: int, start: int, delta_s: float) -> Stage:
        b, tau1, lip = self.batch, self.tau + 1, self.lipschitz
        d0 = noise_variance(delta_s, self.epsilon0, self.dim, batch=b, noise=self.noise,
                            variance=self.variance, noise_multiplier=self.noise_multiplier)
        # a Gaussian upload sums gradients clipped to C_s = b DeltaS / 2: its sampling
        # variance is at most min(sigma, C_s)^2 / b (module docstring)
        spread = min(self.sigma, b * delta_s / 2.0) if self.noise == "gaussian" else self.sigma
        try:
            db = spread**2 / b + d0
        except OverflowError:
            db = math.inf
        if not math.isfinite(db):
            raise self._refuse("sigma", self.sigma, index, "sigma^2 / b overflows")
        try:
            scale = self.theta**2 * b**2 * delta_s**2 * tau1
        except OverflowError:
            scale = math.inf
        if not 0 < scale < math.inf:  # DeltaS (or theta) under- or overflows when squared
            name, given = (("theta", self.theta) if index or self.theta**2 == 0 else
                           ("sigma", self.sigma) if self.initial_clip is None else
                           ("clip", self.initial_clip))
            raise self._refuse(name, given, index, f"DeltaS = {delta_s:.4g} squares to "
                               f"{delta_s * delta_s:.4g}")
        raw = 8.0 * db / scale
        p = max(1.0, raw)
        gamma = 1.0 / (2.0 * lip * p * tau1)
        if not (math.isfinite(raw) and gamma > 0):
            noisy = raw if math.isfinite(raw) else math.inf
            name, given = (("lipschitz", lip) if lip > noisy else
                           ("noise_multiplier", self.noise_multiplier)
                           if self.noise == "gaussian" else ("epsilon", self.epsilon0))
            raise self._refuse(name, given, index, f"Delta_b = {db:.4g}, p = {raw:.4g}, "
                               "the step 1 / (2 L p (tau + 1)) underflows")
        try:  # p^2 may overflow: a stage longer than any run is capped at _LONGEST updates
            span = (4.0 * lip * p**2 * tau1**2 * self.r0 / db if self.step is None
                    else self.r0 / (lip * self.step**2 * db))  # R / (L gamma^2 Delta_b)
        except (OverflowError, ZeroDivisionError):
            span = math.inf
        length = _LONGEST if not span < _LONGEST else max(1, math.ceil(span))
        return Stage(index, start, delta_s, b * delta_s / 2.0, d0, db, raw, p, gamma, length,
                     self.step)

    @staticmethod
    def _refuse(name: str, given: Any, index: int, why: str) -> InvalidParameterError:
        return InvalidParameterError(
            name, given, f"a value whose MAPA stage-{index} step size is a positive number "
            f"({why})")

    def stage(self, index: int) -> Stage:
        """Stage ``index`` (0-based), computed on demand."""
        i = _validate.nonnegative_int("index", index)
        while len(self._stages) <= i:
            if not self._stages:
                first = initial_sensitivity(self.sigma, self.batch, self.delta) \
                    if self.initial_clip is None else 2.0 * self.initial_clip / self.batch
                if not first < math.inf:
                    raise self._refuse(*(("sigma", self.sigma) if self.initial_clip is None
                                         else ("clip", self.initial_clip)), 0,
                                       "the first sensitivity DeltaS_0 overflows")
                st = self._make(0, 1, first)
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
