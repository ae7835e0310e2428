"""Root finders that return the safe side (used by :mod:`privkit.accountants.calibration`).

Each finds the smallest x (to a relative tolerance) with ``eps_of(x) <= target`` for an
``eps_of`` decreasing in x, and returns that x with its evaluated epsilon: the answer has been
priced, so it meets the target by construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from privkit.errors import NumericalError

_MAX_DOUBLINGS = 200


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
        # Every evaluation may stop as soon as x is known to be over the target: an over
        # point's epsilon only steers the secant (a value in (target, eps(x)], usually eps(x)
        # itself: the first direction priced is usually the larger), while the answer is
        # always a safe point, whose evaluation is whole.
        e = eps_of(x, target)
        if hi is not None and x < hi and hi / x - 1 <= tol and e > target:
            assert e_hi is not None
            return hi, e_hi  # x closes the bracket
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
