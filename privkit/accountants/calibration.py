"""Inverse problems that never overshoot: noise (or steps) for a target epsilon.

Every solver brackets the monotone parameter (growing the bracket by doubling,
no hard-coded limits), narrows it with Illinois regula falsi on log scales, and
returns the bracket end on the **safe side** (more noise, fewer steps). That
end has been evaluated with the same upper-bound accountant the caller asked
for, so ``epsilon(result) <= target`` holds by construction; the verified
epsilon is returned with it. Calibration is pure: it prices fresh events and
never touches a ledger.

For subsampled events ``AUTO`` solves on privkit's own PLD
(:mod:`privkit.accountants.fftpld`) with its grid planned once for the target, by secant steps
from the CLT guess (a few evaluations); events it does not price are solved on dp-accounting's
PLD (a coarse stage, then AUTO's interval).

Example:
    >>> r = calibrate_noise_multiplier(target_epsilon=1.0, delta=1e-5, steps=100)
    >>> r.epsilon <= 1.0, r.method
    (True, 'exact')
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from privkit import _validate
from privkit._dpa import dp_event
from privkit.accountants import fftpld, gaussian, pld, rules
from privkit.accountants._atoms import GaussianAtom
from privkit.accountants._methods import Method, _fft_atoms, auto_prefers_pld
from privkit.accountants._solve import (  # _solve_noise is also imported from here
    _MAX_DOUBLINGS,
    _secant_bracket,
    _secant_down,
    _solve_noise,
)
from privkit.accountants.accountant import epsilon
from privkit.accountants.rules import NeighboringRelation, flatten
from privkit.accountants.schedule import schedule
from privkit.errors import InvalidParameterError, NumericalError, UnsupportedEventError
from privkit.events import gaussian_steps_event
from privkit.events.mechanisms import as_relation

__all__ = [
    "CalibrationResult",
    "StepsResult",
    "calibrate_noise",
    "calibrate_noise_multiplier",
    "calibrate_steps",
]

def _tol(tol: Any) -> float:
    """The relative precision of a calibrated parameter: finite, in (0, 0.1]."""
    t = _validate.positive("tol", tol)
    if not t <= 0.1:
        raise InvalidParameterError("tol", tol, "in (0, 0.1] (a relative precision)")
    return t


@dataclass(frozen=True)
class CalibrationResult:
    """A calibrated noise parameter and the epsilon verified at it (<= target).

    ``steps``, ``sampling_probability`` and ``neighboring_relation`` (its name) are the
    schedule and relation priced, when the calibration was of Gaussian steps (else None).
    """

    noise_multiplier: float
    epsilon: float
    delta: float
    method: str
    target_epsilon: float
    steps: int | None = None
    sampling_probability: float | None = None
    neighboring_relation: str | None = None


@dataclass(frozen=True)
class StepsResult:
    """The largest number of steps whose verified epsilon is <= target (and the epochs they
    make at the sampling probability: :mod:`privkit.accountants.schedule`)."""

    steps: int
    epsilon: float
    delta: float
    method: str
    target_epsilon: float
    sampling_probability: float = 1.0
    epochs: float | None = None
    neighboring_relation: str | None = None


def calibrate_noise(
    make_event: Callable[[float], dp_event.DpEvent],
    *,
    target_epsilon: float,
    delta: float,
    method: Method | str = Method.AUTO,
    tol: float = 1e-6,
    initial_guess: float | None = None,
    neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE,
) -> tuple[float, float, str]:
    """Generic solver: the smallest noise x such that ``make_event(x)`` meets the target.

    ``make_event`` must be more private for larger x. Returns
    ``(x, verified_epsilon, method_name)``.
    """
    target = _validate.positive("target_epsilon", target_epsilon)
    d = _validate.delta("delta", delta)
    tol = _tol(tol)
    m = Method.parse(method)
    rel = as_relation(neighboring_relation)
    guess = 1.0 if initial_guess is None else _validate.positive("initial_guess", initial_guess)

    def report(x: float, meth: Method = m) -> Any:
        return epsilon(make_event(x), d, meth, neighboring_relation=rel)

    if m is Method.AUTO and auto_prefers_pld(flatten(make_event(guess)), d):
        try:
            if _fft_atoms(_priced(make_event(guess), rel)[0]) is not None:
                return _calibrate_fft(make_event, target, d, tol, guess, rel)
            return _calibrate_auto_pld(make_event, target, d, tol, guess, rel)
        except UnsupportedEventError:
            pass  # some atom has no PLD rule: AUTO prices it otherwise
    x, _ = _solve_noise(lambda x: report(x).epsilon, target, tol, guess)
    final = report(x)
    if final.epsilon > target:  # cannot happen: x was evaluated; guard anyway
        raise NumericalError("calibration failed to verify its answer")
    return x, final.epsilon, final.method


def _calibrate_fft(
    make_event: Callable[[float], Any], target: float, d: float, tol: float, guess: float,
    rel: Any,
) -> tuple[float, float, str]:
    """AUTO calibration on privkit's PLD (the function AUTO evaluates, so AUTO's epsilon at the
    answer, the minimum of it and RDP, is <= target too): secant steps from just above the
    guess, then Illinois; the answer is the evaluated safe end."""
    grids: dict[float, float] = {}

    def eps_of(x: float, above: float | None = None) -> float:
        """AUTO's PLD epsilon at x; with ``above``, possibly only a value in (above, eps]."""
        comp, prel = _priced(make_event(x), rel)
        atoms = _fft_atoms(comp)
        if atoms is None:
            raise UnsupportedEventError("privkit's PLD does not price this event")
        # exactly what AUTO computes
        e, grids[x], _ = fftpld.epsilon_above(atoms, d, prel.name, above)
        return e

    x0 = guess * 1.02
    slope = -1.2
    c0, c1 = (_clt_epsilon(make_event(x0), d, rel),
              _clt_epsilon(make_event(x0 * 1.01), d, rel))
    if 0 < c1 < c0 < math.inf:  # the CLT's local slope: a better first secant step
        slope = (math.log(c1) - math.log(c0)) / math.log(1.01)
    x, e = _secant_bracket(eps_of, target, tol, x0, slope)
    return x, e, f"pld-fft (privkit, interval {grids[x]:.2g})"


def _priced(event: Any, rel: Any) -> tuple[Any, Any]:
    """The event's composition re-expressed against ``rel``'s sensitivity, and the relation
    it is priced as (:func:`privkit.accountants.rules.priced`)."""
    return rules.priced(flatten(event), rel)


def _clt_epsilon(event: Any, d: float, rel: Any) -> float:
    """The CLT (GDP) epsilon of a Gaussian-family composition: a slope hint only, never an
    answer (mu^2 = sum_j n_j q_j^2 (e^{1/z_j^2} - 1); it under-reports)."""
    atoms = _fft_atoms(_priced(event, rel)[0])
    if atoms is None:
        return math.nan
    mu2 = 0.0
    for a, n in atoms:
        if not isinstance(a, GaussianAtom):
            return math.nan
        z, q = a.noise_multiplier, a.sampling_probability
        with_q = q * q * math.expm1(min(1 / (z * z), 700.0))
        mu2 += n * (with_q if q < 1 else 1 / (z * z))
    return float(gaussian.exact_epsilon(math.sqrt(mu2), d))


def _calibrate_auto_pld(
    make_event: Callable[[float], Any], target: float, d: float, tol: float, guess: float,
    rel: Any,
) -> tuple[float, float, str]:
    """AUTO calibration when AUTO prices with PLD: coarse search, then fine, then verify.

    1. Solve with the cheap probe interval (2e-3) to relative 1e-3.
    2. Pick AUTO's interval there and solve again with it, from a tight bracket.
    3. Verify with ``epsilon(..., AUTO)`` itself; step to more noise until it passes.
    """
    def at(vdi: float) -> Callable[[float], float]:
        def eps(x: float) -> float:
            comp, prel = _priced(make_event(x), rel)
            return float(pld.epsilon(comp, d, vdi, prel))
        return eps

    coarse = at(pld.PROBE_INTERVAL)
    x1, e1 = _solve_noise(coarse, target, 1e-3, guess, step=1.05)
    comp1, prel1 = _priced(make_event(x1), rel)
    vdi = pld.choose_interval(comp1, d, prel1)
    e1b = coarse(x1 * 1.01)  # local slope of log eps in log x, a hint for the fine stage
    slope = (math.log(e1b) - math.log(e1)) / math.log(1.01) if 0 < e1b < e1 else -1.0
    x2, _ = _secant_down(at(vdi), target, tol, x1, slope)
    bump = max(tol, 1e-9)
    for _ in range(_MAX_DOUBLINGS):
        final = epsilon(make_event(x2), d, Method.AUTO, neighboring_relation=rel)
        if final.epsilon <= target:
            return x2, final.epsilon, final.method
        x2 *= 1 + bump
        bump *= 2
    raise NumericalError("calibration failed to verify its answer")


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    steps: int | None = None,
    sampling_probability: float | None = None,
    method: Method | str = Method.AUTO,
    tol: float = 1e-6,
    neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE,
    epochs: float | None = None,
    batch_size: int | None = None,
    dataset_size: int | None = None,
) -> CalibrationResult:
    """Noise multiplier z so that ``steps`` (Poisson-subsampled) Gaussian steps meet the target.

    The run is given by ``steps`` or, as in Opacus, by ``epochs``; its sampling probability by
    ``sampling_probability`` or by ``batch_size`` and ``dataset_size`` (q = B / N; neither:
    q = 1). Epochs become steps as :mod:`privkit.accountants.schedule` says (one epoch is
    ceil(N / B) steps, rounded up, never fewer than the run takes), so calibrating by epochs
    gives the same z as calibrating by those steps.

    The noise multiplier means what it means in Opacus and dp-accounting's PLD under every
    relation: z = stddev / C, C the bound on one contribution (the clip norm); the accountant
    applies the relation's sensitivity (2 C under ``REPLACE_ONE``), so a replace-one answer
    is larger (for unsampled steps exactly twice the add/remove one).

    Args:
        target_epsilon: finite and > 0.
        delta: in (0, 1).
        steps: integer >= 1 (or ``epochs`` instead).
        sampling_probability: in (0, 1]; 1 = no subsampling (exact method). Default: 1, or
            ``batch_size / dataset_size``.
        method: accountant used both to solve and to verify.
        tol: relative precision of z (the answer errs towards more noise).
        neighboring_relation: dp-accounting's relation (or its name, e.g. ``"REPLACE_ONE"``).
        epochs: passes over the data, > 0 (instead of ``steps``).
        batch_size: expected batch size B (Poisson sampling), with ``dataset_size``.
        dataset_size: N, the number of records, >= B.

    Raises:
        InvalidParameterError: a bad argument, or a bad combination (named in the message).

    Example:
        >>> by_epochs = calibrate_noise_multiplier(target_epsilon=8, delta=1e-5, epochs=2,
        ...                                        batch_size=100, dataset_size=10_000)
        >>> by_steps = calibrate_noise_multiplier(target_epsilon=8, delta=1e-5, steps=200,
        ...                                       sampling_probability=0.01)
        >>> by_epochs.steps, by_epochs.noise_multiplier == by_steps.noise_multiplier
        (200, True)
    """
    target = _validate.positive("target_epsilon", target_epsilon)
    d = _validate.delta("delta", delta)
    sched = schedule(steps=steps, epochs=epochs, sampling_probability=sampling_probability,
                     batch_size=batch_size, dataset_size=dataset_size)
    t, q = sched.steps, sched.sampling_probability
    tol = _tol(tol)
    rel = as_relation(neighboring_relation)
    if q == 1.0 and Method.parse(method) in (Method.AUTO, Method.EXACT):
        # exact: epsilon depends on sqrt(T) / (z / factor) only, factor the relation's
        # sensitivity over the bound on one contribution (2 under replace-one)
        factor = 1 / rules.relative_to_sensitivity(dp_event.GaussianDpEvent(1.0), rel
                                                   ).noise_multiplier
        r = _exact_noise_multiplier(target, d, t, tol)
        z, e, name = r.noise_multiplier * factor, r.epsilon, r.method
    else:
        z, e, name = calibrate_noise(
            lambda x: gaussian_steps_event(x, t, q), target_epsilon=target, delta=d,
            method=method, tol=tol, initial_guess=_clt_guess(target, d, t, q),
            neighboring_relation=rel)
    return CalibrationResult(z, e, d, name, target, t, q, rel.name)


def _clt_guess(target: float, d: float, t: int, q: float) -> float:
    """A starting point only (never an answer): the CLT / GDP approximation.

    mu = q sqrt(T (e^{1/z^2} - 1)) (Dong, Roth & Su 2022) is *not* a valid
    bound (it under-reports), but it lands within a few percent of the PLD
    answer, which saves most of the bracketing work.
    """
    x, _ = _solve_noise(lambda inv_mu: float(gaussian.exact_epsilon(1 / inv_mu, d)), target, 1e-3)
    mu = 1 / x
    arg = math.log1p(mu * mu / (q * q * t))
    return 1 / math.sqrt(arg) if arg > 0 and math.isfinite(arg) else 1.0


def _exact_noise_multiplier(target: float, d: float, t: int, tol: float) -> CalibrationResult:
    # eps is a function of gdp_mu = sqrt(t)/z only: solve for mu once, verify.
    z, e = _solve_noise(
        lambda zz: float(gaussian.exact_epsilon(math.sqrt(t) / zz, d)), target, tol, math.sqrt(t)
    )
    return CalibrationResult(z, e, d, "exact", target)


#: calibrate_steps: the answer is exact to one step up to this many steps, and to a relative
#: _STEPS_TOL above (at 10^6 steps one more changes epsilon by ~5e-7 relative, below what a
#: PLD resolves); runs longer than _MAX_STEPS are refused (naming target_epsilon).
_EXACT_STEPS = 1_000_000
_STEPS_TOL = 1e-6
_MAX_STEPS = float(2**62)


def _steps_guess(target: float, d: float, z: float, q: float) -> float:
    """A starting point only (never an answer): the steps at which the CLT / GDP
    approximation mu = q sqrt(T (e^{1/z^2} - 1)) (exact for q = 1: sqrt(T) / z) reaches the
    target (Dong, Roth & Su 2022)."""
    inv_mu, _ = _solve_noise(lambda v: float(gaussian.exact_epsilon(1 / v, d)), target, 1e-3)
    mu = 1 / inv_mu
    per_step = q * q * math.expm1(min(1 / (z * z), 700.0)) if q < 1 else 1 / (z * z)
    t = mu * mu / per_step if per_step > 0 else math.inf
    return max(1.0, t) if math.isfinite(t) else _MAX_STEPS * 2


def calibrate_steps(
    *,
    noise_multiplier: float,
    target_epsilon: float,
    delta: float,
    sampling_probability: float | None = None,
    method: Method | str = Method.AUTO,
    neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE,
    batch_size: int | None = None,
    dataset_size: int | None = None,
) -> StepsResult:
    """The largest number of steps whose epsilon (same accountant) is <= target.

    The sampling probability is ``sampling_probability`` or ``batch_size / dataset_size``
    (neither: 1); ``noise_multiplier`` is stddev / C, C the bound on one contribution, under
    every relation (as in :func:`calibrate_noise_multiplier`). The result also gives the
    epochs those steps make (:mod:`privkit.accountants.schedule`).

    The answer is the largest step count whose epsilon (priced, not estimated) is <= target,
    exact to one step up to 10^6 steps and to a relative 1e-6 beyond (where one step more moves
    epsilon by less than any accountant resolves); it takes a few pricings whatever the noise
    (a CLT guess, then regula falsi).

    Raises:
        InvalidParameterError: a bad argument (named), if even one step exceeds the target,
            or if the target is not reached within 2^62 steps (named ``target_epsilon``).

    Example:
        >>> r = calibrate_steps(noise_multiplier=1.0, target_epsilon=10.0, delta=1e-5)
        >>> r.steps, r.epsilon <= 10.0
        (4, True)
    """
    z = _validate.positive("noise_multiplier", noise_multiplier)
    target = _validate.positive("target_epsilon", target_epsilon)
    d = _validate.delta("delta", delta)
    meth = Method.parse(method)

    def plan(t: int) -> Any:
        return schedule(steps=t, sampling_probability=sampling_probability,
                        batch_size=batch_size, dataset_size=dataset_size)

    q = plan(1).sampling_probability
    rel = as_relation(neighboring_relation)
    reports: dict[int, Any] = {}

    def rep(t: int) -> Any:
        if t not in reports:
            reports[t] = epsilon(gaussian_steps_event(z, t, q), d, meth,
                                 neighboring_relation=rel)
        return reports[t]

    first = rep(1)
    if first.epsilon > target:
        raise InvalidParameterError(
            "target_epsilon", target, f">= {first.epsilon:.6g}, the epsilon of a single step"
        )
    # z against the relation's sensitivity (replace-one: z / 2), for the starting guess
    z_rel = rules.relative_to_sensitivity(dp_event.GaussianDpEvent(z), rel).noise_multiplier
    guess = _steps_guess(target, d, float(z_rel), q)
    if guess > _MAX_STEPS:
        raise InvalidParameterError(
            "target_epsilon", target, f"reached within {_MAX_STEPS:.3g} steps (at noise "
            f"multiplier {z:g} and q = {q:g} a run of about {guess:.3g} steps stays below it: "
            "a lower noise multiplier or a smaller target)")
    # the largest T with eps(T) <= target: the smallest x = 1/T, to relative _STEPS_TOL
    # (regula falsi on log x against log eps from the CLT's guess, a few evaluations)
    x, _ = _solve_noise(lambda x: rep(max(1, math.floor(1 / x))).epsilon, target,
                        _STEPS_TOL, 1 / guess)
    lo = max(1, math.floor(1 / x))
    lo_rep = rep(lo)
    if lo_rep.epsilon > target:  # cannot happen: x was evaluated; guard anyway
        raise NumericalError("calibrate_steps failed to verify its answer")
    if lo <= _EXACT_STEPS:  # exact to one step: the first step over the target
        hi = lo + 1
        while rep(hi).epsilon <= target:
            lo, lo_rep, hi = hi, rep(hi), hi + max(1, hi - lo) * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if rep(mid).epsilon <= target:
                lo, lo_rep = mid, rep(mid)
            else:
                hi = mid
    return StepsResult(lo, lo_rep.epsilon, d, lo_rep.method, target, q, plan(lo).epochs,
                       rel.name)
