"""Inverse problems that never overshoot: noise (or steps) for a target epsilon.

Every solver brackets the monotone parameter (growing the bracket by doubling,
no hard-coded limits), narrows it with Illinois regula falsi on log scales, and
returns the bracket end on the **safe side** (more noise, fewer steps). That
end has been evaluated with the same upper-bound accountant the caller asked
for, so ``epsilon(result) <= target`` holds by construction; the verified
epsilon is returned with it. Calibration is pure: it prices fresh events and
never touches a ledger.

For subsampled events ``AUTO`` first solves with the cheap RDP bound (its
answer is safe for PLD too, since PLD <= RDP) and then tightens with PLD.

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

from dp_accounting import dp_event

from privkit import _validate
from privkit.accountants.accountant import Method, epsilon
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import InvalidParameterError, NumericalError
from privkit.events import gaussian_steps_event

__all__ = [
    "CalibrationResult",
    "StepsResult",
    "calibrate_noise",
    "calibrate_noise_multiplier",
    "calibrate_steps",
]

_MAX_DOUBLINGS = 200


@dataclass(frozen=True)
class CalibrationResult:
    """A calibrated noise parameter and the epsilon verified at it (<= target)."""

    noise_multiplier: float
    epsilon: float
    delta: float
    method: str
    target_epsilon: float


@dataclass(frozen=True)
class StepsResult:
    """The largest number of steps whose verified epsilon is <= target."""

    steps: int
    epsilon: float
    delta: float
    method: str
    target_epsilon: float


def _solve_noise(
    eps_of: Callable[[float], float], target: float, tol: float, lo: float | None, hi: float | None
) -> tuple[float, float]:
    """Smallest x (to relative ``tol``) with eps_of(x) <= target; eps decreasing in x.

    Returns (x, eps_of(x)) with eps_of(x) <= target guaranteed (x is the safe end).
    """
    if hi is None:
        hi = 1.0
    e_hi = eps_of(hi)
    n = 0
    while e_hi > target:
        lo, hi = hi, hi * 2
        e_hi = eps_of(hi)
        n += 1
        if n > _MAX_DOUBLINGS:
            raise NumericalError("no noise level reaches the target epsilon")
    if lo is None or lo >= hi:
        lo = hi / 2
    e_lo = eps_of(lo)
    n = 0
    while e_lo <= target:
        hi, e_hi = lo, e_lo
        lo = lo / 2
        e_lo = eps_of(lo)
        n += 1
        if n > _MAX_DOUBLINGS:
            return hi, e_hi  # even vanishing noise meets the target
    # Illinois regula falsi on (log x, log eps - log target); bracket kept valid.
    lt = math.log(target)

    def g(e: float) -> float:
        return (math.log(e) if e > 0 else -745.0) - lt if math.isfinite(e) else 745.0

    a, b = math.log(lo), math.log(hi)
    ga, gb = g(e_lo), g(e_hi)  # ga > 0 >= gb
    side = 0
    while hi / lo - 1 > tol:
        c = b - gb * (b - a) / (gb - ga) if ga != gb else 0.5 * (a + b)
        # stay strictly inside, and fall back to bisection when the step stalls
        width = b - a
        c = min(max(c, a + 0.01 * width), b - 0.01 * width)
        x = math.exp(c)
        if not lo < x < hi:
            break
        e = eps_of(x)
        gc = g(e)
        if e <= target:
            b, gb, hi, e_hi = c, gc, x, e
            if side == -1:
                ga /= 2
            side = -1
        else:
            a, ga, lo = c, gc, x
            if side == 1:
                gb /= 2
            side = 1
    return hi, e_hi


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
    tol = _validate.positive("tol", tol)
    m = Method.parse(method)
    names: list[str] = []

    def eps_with(meth: Method) -> Callable[[float], float]:
        def f(x: float) -> float:
            r = epsilon(make_event(x), d, meth, neighboring_relation=neighboring_relation)
            names.append(r.method)
            return r.epsilon

        return f

    hi = initial_guess
    lo = None
    if m is Method.AUTO:
        probe = epsilon(make_event(1.0), d, Method.AUTO, neighboring_relation=neighboring_relation)
        if probe.method.startswith("pld"):
            # Cheap conservative start: RDP's answer is also safe for PLD.
            hi, _ = _solve_noise(eps_with(Method.RDP), target, 1e-3, None, None)
            lo = hi * 0.8
            x, e = _solve_noise(_pld_only(make_event, d, neighboring_relation, names), target, tol,
                                lo, hi)
            return x, e, names[-1] if names else "pld"
    x, e = _solve_noise(eps_with(m), target, tol, lo, hi)
    final = epsilon(make_event(x), d, m, neighboring_relation=neighboring_relation)
    if final.epsilon > target:  # cannot happen: x was evaluated; guard anyway
        raise NumericalError("calibration failed to verify its answer")
    return x, final.epsilon, final.method


def _pld_only(make_event: Callable[[float], Any], d: float, rel: Any,
              names: list[str]) -> Callable[[float], float]:
    from privkit.accountants import accountant as acc  # the AUTO discretisation

    def f(x: float) -> float:
        comp = acc.flatten(make_event(x))
        names.append(f"pld (interval {acc.AUTO_PLD_VALUE_DISCRETIZATION:g})")
        return acc._pld_epsilon(comp, d, acc.AUTO_PLD_VALUE_DISCRETIZATION, rel)

    return f


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    steps: int,
    sampling_probability: float = 1.0,
    method: Method | str = Method.AUTO,
    tol: float = 1e-6,
) -> CalibrationResult:
    """Noise multiplier z so that ``steps`` (Poisson-subsampled) Gaussian steps meet the target.

    Args:
        target_epsilon: finite and > 0.
        delta: in (0, 1).
        steps: integer >= 1.
        sampling_probability: in (0, 1]; 1 = no subsampling (exact method).
        method: accountant used both to solve and to verify.
        tol: relative precision of z (the answer errs towards more noise).
    """
    target = _validate.positive("target_epsilon", target_epsilon)
    d = _validate.delta("delta", delta)
    t = _validate.positive_int("steps", steps)
    q = _validate.probability("sampling_probability", sampling_probability)
    if q == 1.0 and Method.parse(method) in (Method.AUTO, Method.EXACT):
        return _exact_noise_multiplier(target, d, t, tol)
    z, e, name = calibrate_noise(
        lambda x: gaussian_steps_event(x, t, q), target_epsilon=target, delta=d, method=method,
        tol=tol,
    )
    return CalibrationResult(z, e, d, name, target)


def _exact_noise_multiplier(target: float, d: float, t: int, tol: float) -> CalibrationResult:
    from privkit.accountants import gaussian

    # eps is a function of gdp_mu = sqrt(t)/z only: solve for mu once, verify.
    z, e = _solve_noise(
        lambda zz: float(gaussian.exact_epsilon(math.sqrt(t) / zz, d)), target, tol, None,
        math.sqrt(t),
    )
    return CalibrationResult(z, e, d, "exact", target)


def calibrate_steps(
    *,
    noise_multiplier: float,
    target_epsilon: float,
    delta: float,
    sampling_probability: float = 1.0,
    method: Method | str = Method.AUTO,
) -> StepsResult:
    """The largest number of steps whose epsilon (same accountant) is <= target.

    Raises:
        InvalidParameterError: if even one step exceeds the target.
    """
    z = _validate.positive("noise_multiplier", noise_multiplier)
    target = _validate.positive("target_epsilon", target_epsilon)
    d = _validate.delta("delta", delta)
    q = _validate.probability("sampling_probability", sampling_probability)

    def rep(t: int) -> Any:
        return epsilon(gaussian_steps_event(z, t, q), d, method)

    first = rep(1)
    if first.epsilon > target:
        raise InvalidParameterError(
            "target_epsilon", target, f">= {first.epsilon:.6g}, the epsilon of a single step"
        )
    lo, lo_rep = 1, first  # lo always meets the target
    hi = 2
    while True:
        r = rep(hi)
        if r.epsilon > target:
            break
        lo, lo_rep, hi = hi, r, hi * 2
        if hi > 2**62:
            raise NumericalError("steps unbounded: epsilon does not grow with steps")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = rep(mid)
        if r.epsilon <= target:
            lo, lo_rep = mid, r
        else:
            hi = mid
    return StepsResult(lo, lo_rep.epsilon, d, lo_rep.method, target)
