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
from privkit.accountants import fftpld, gaussian, pld
from privkit.accountants.accountant import Method, _fft_atoms, auto_prefers_pld, epsilon
from privkit.accountants.rules import NeighboringRelation, flatten
from privkit.errors import InvalidParameterError, NumericalError, UnsupportedEventError
from privkit.events import gaussian_steps_event

__all__ = [
    "CalibrationResult",
    "StepsResult",
    "calibrate_noise",
    "calibrate_noise_multiplier",
    "calibrate_steps",
]

_MAX_DOUBLINGS = 200


def _tol(tol: Any) -> float:
    """The relative precision of a calibrated parameter: finite, in (0, 0.1]."""
    t = _validate.positive("tol", tol)
    if not t <= 0.1:
        raise InvalidParameterError("tol", tol, "in (0, 0.1] (a relative precision)")
    return t


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
    eps_of: Callable[[float], float], target: float, tol: float, guess: float = 1.0,
    step: float = 2.0,
) -> tuple[float, float]:
    """Smallest x (to relative ``tol``) with eps_of(x) <= target; eps decreasing in x.

    Brackets from ``guess`` with geometric steps (``step``, squared after every
    move, so any scale is reached), then narrows by Illinois regula falsi on
    (log x, log eps). Returns (x, eps_of(x)) with eps_of(x) <= target: x is the
    safe end of the final bracket, and it has been evaluated.
    """
    x = guess
    e = eps_of(x)
    factor = step
    if e > target:
        lo, e_lo = x, e
        for _ in range(_MAX_DOUBLINGS):
            x *= factor
            factor *= factor if factor < 1e8 else 1.0
            e = eps_of(x)
            if e <= target:
                break
            lo, e_lo = x, e
        else:
            raise NumericalError("no noise level reaches the target epsilon")
        hi, e_hi = x, e
    else:
        hi, e_hi = x, e
        for _ in range(_MAX_DOUBLINGS):
            x /= factor
            factor *= factor if factor < 1e8 else 1.0
            e = eps_of(x)
            if e > target:
                break
            hi, e_hi = x, e
        else:
            return hi, e_hi  # even vanishing noise meets the target
        lo, e_lo = x, e
    return _illinois(eps_of, target, tol, lo, e_lo, hi, e_hi)


def _illinois(
    eps_of: Callable[[float], float], target: float, tol: float,
    lo: float, e_lo: float, hi: float, e_hi: float,
) -> tuple[float, float]:
    lt = math.log(target)

    def g(e: float) -> float:
        if not math.isfinite(e):
            return 745.0
        return (math.log(e) if e > 0 else -745.0) - lt

    a, b = math.log(lo), math.log(hi)
    ga, gb = g(e_lo), g(e_hi)  # ga > 0 >= gb
    side = 0
    while hi / lo - 1 > tol:
        c = b - gb * (b - a) / (gb - ga) if ga != gb else 0.5 * (a + b)
        width = b - a
        c = min(max(c, a + 0.02 * width), b - 0.02 * width)  # stay strictly inside
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
            # The secant usually lands just on the safe side: one probe a
            # tolerance below often closes the bracket at once.
            if hi / lo - 1 > tol and target - e < 1e-4 * target:
                x_low = hi / (1 + tol)
                e_low = eps_of(x_low)
                if e_low > target:
                    return hi, e_hi
                b, gb, hi, e_hi = math.log(x_low), g(e_low), x_low, e_low
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
    tol = _tol(tol)
    m = Method.parse(method)
    rel = neighboring_relation
    guess = 1.0 if initial_guess is None else _validate.positive("initial_guess", initial_guess)

    def report(x: float, meth: Method = m) -> Any:
        return epsilon(make_event(x), d, meth, neighboring_relation=rel)

    if m is Method.AUTO and auto_prefers_pld(flatten(make_event(guess)), d):
        try:
            if _fft_atoms(flatten(make_event(guess))) is not None:
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
        atoms = _fft_atoms(flatten(make_event(x)))
        if atoms is None:
            raise UnsupportedEventError("privkit's PLD does not price this event")
        # exactly what AUTO computes
        e, grids[x], _ = fftpld.epsilon_above(atoms, d, rel.name, above)
        return e

    x0 = guess * 1.02
    slope = -1.2
    c0, c1 = _clt_epsilon(make_event(x0), d), _clt_epsilon(make_event(x0 * 1.01), d)
    if 0 < c1 < c0 < math.inf:  # the CLT's local slope: a better first secant step
        slope = (math.log(c1) - math.log(c0)) / math.log(1.01)
    x, e = _secant_bracket(eps_of, target, tol, x0, slope)
    return x, e, f"pld-fft (privkit, interval {grids[x]:.2g})"


def _clt_epsilon(event: Any, d: float) -> float:
    """The CLT (GDP) epsilon of a Gaussian-family composition: a slope hint only, never an
    answer (mu^2 = sum_j n_j q_j^2 (e^{1/z_j^2} - 1); it under-reports)."""
    atoms = _fft_atoms(flatten(event))
    if atoms is None:
        return math.nan
    mu2 = 0.0
    for a, n in atoms:
        if not isinstance(a, fftpld.GaussianAtom):
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
        return lambda x: pld.epsilon(flatten(make_event(x)), d, vdi, rel)

    coarse = at(pld.PROBE_INTERVAL)
    x1, e1 = _solve_noise(coarse, target, 1e-3, guess, step=1.05)
    vdi = pld.choose_interval(flatten(make_event(x1)), d, rel)
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


def _secant_bracket(
    eps_of: Callable[..., float], target: float, tol: float, x: float,
    slope: float = -1.2, max_steps: int = 12,
) -> tuple[float, float]:
    """The smallest x (to relative ``tol``) with eps_of(x) <= target, eps decreasing in x, from
    a point ``x`` near the root: secant steps on (log x, log eps) aimed a quarter of ``tol``
    to alternate sides of the root, so that two well-aimed steps close the bracket. Falls back
    to :func:`_solve_noise` if the secant misbehaves. Returns the evaluated safe end.
    ``eps_of(x, above)`` may return any value in (above, eps(x)] when eps(x) > above."""
    lt = math.log(target)
    lo = hi = e_hi = None
    last: tuple[float, float] | None = None
    want_safe = True
    for _ in range(max_steps):
        if hi is not None and x < hi and hi / x - 1 <= tol:
            # x closes the bracket if it is over the target, and then its epsilon is not
            # used: the evaluation may stop as soon as that is known
            e = eps_of(x, target)
            if e > target:
                assert e_hi is not None
                return hi, e_hi
        else:
            e = eps_of(x)
        if not (0 < e < math.inf):
            break
        if e <= target:
            if hi is None or x < hi:
                hi, e_hi = x, e
        elif lo is None or x > lo:
            lo = x
        if lo is not None and hi is not None and hi / lo - 1 <= tol:
            assert e_hi is not None
            return hi, e_hi
        point = (math.log(x), math.log(e))
        if last is not None and point[0] != last[0]:
            s = (point[1] - last[1]) / (point[0] - last[0])
            if s < 0:
                slope = s
        last = point
        root = point[0] + (lt - point[1]) / slope
        want_safe = hi is None or (lo is not None and not want_safe)
        aim = root + (1 if want_safe else -1) * math.log1p(tol / 4)
        xn = math.exp(aim)
        if lo is not None and hi is not None and not lo < xn < hi:
            xn = math.sqrt(lo * hi)
        x = xn
    return _solve_noise(eps_of, target, tol, hi if hi is not None else x)


def _secant_down(
    eps_of: Callable[[float], float], target: float, tol: float, x: float, slope: float = -1.0
) -> tuple[float, float]:
    """Like :func:`_solve_noise`, from a point ``x`` expected to be (nearly) safe.

    Secant steps on (log x, log eps), aimed slightly past the root so that a
    bracket forms in one or two evaluations, then Illinois.
    """
    e = eps_of(x)
    if not e <= target or e <= 0:
        return _solve_noise(eps_of, target, tol, x)
    hi, e_hi = x, e
    slope = min(slope, -0.05)  # d log eps / d log x; refined by the secant below
    for _ in range(8):
        step = (math.log(target) - math.log(e_hi)) / slope
        xn = hi * math.exp(step - 10 * tol - 1e-4)
        en = eps_of(xn)
        if en > target:
            return _illinois(eps_of, target, tol, xn, en, hi, e_hi)
        if en <= 0 or en == e_hi:
            break
        slope = min((math.log(en) - math.log(e_hi)) / (math.log(xn) - math.log(hi)), -0.05)
        hi, e_hi = xn, en
    return _solve_noise(eps_of, target, tol, hi)


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
    tol = _tol(tol)
    if q == 1.0 and Method.parse(method) in (Method.AUTO, Method.EXACT):
        return _exact_noise_multiplier(target, d, t, tol)
    z, e, name = calibrate_noise(
        lambda x: gaussian_steps_event(x, t, q), target_epsilon=target, delta=d, method=method,
        tol=tol, initial_guess=_clt_guess(target, d, t, q),
    )
    return CalibrationResult(z, e, d, name, target)


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
