"""Privacy-loss-distribution accounting (dp-accounting's PLD, pessimistic).

Every PLD here is dp-accounting's *pessimistic* estimate, an upper bound on
the true privacy curve at any discretisation interval up to floating point; a
finer interval is tighter and slower. Floating point matters: its delta can
exceed the true one by ~1e-17 per composed step, so every epsilon is read at
``delta - SLACK_PER_STEP * steps`` and every delta has that allowance added.
``Method.PLD`` uses dp-accounting's usual 1e-4, so it reproduces
dp-accounting's numbers to that allowance (about 1e-8 relative). ``AUTO``
chooses the interval per event (:func:`auto_epsilon`): it prices the event
at 4e-3 and 2e-3, models the discretisation error as ``k * interval^2``
(what those two values show on W1-W4), and picks the coarsest interval on a
fixed grid whose modelled error is <= :data:`AUTO_RELATIVE_ERROR` of epsilon.
Whatever the model says, the answer is a pessimistic PLD (with the allowance),
so it stays a valid upper bound; the model only decides how tight and how fast.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from privkit.accountants.rules import Composition, pld_of
from privkit.errors import InvalidParameterError, UnsupportedEventError

__all__ = [
    "VALUE_DISCRETIZATION",
    "MIN_DELTA",
    "AUTO_INTERVALS",
    "AUTO_RELATIVE_ERROR",
    "build",
    "epsilon",
    "delta",
    "auto_interval",
    "auto_epsilon",
    "choose_interval",
    "PROBE_INTERVAL",
    "SLACK_PER_STEP",
]

#: Discretisation of ``Method.PLD`` (dp-accounting's usual value: same numbers).
VALUE_DISCRETIZATION = 1e-4
#: PLD truncates tails of mass ~1e-15 per composition; below this delta its
#: answer is not trusted and ``Method.PLD`` refuses (``AUTO`` uses RDP).
MIN_DELTA = 1e-10
#: Allowance per composed step for dp-accounting's numerical error in delta. Its pessimistic
#: PLD is not always pessimistic in floating point: against the exact Gaussian profile
#: (mpmath) its delta at the epsilon it reports was too large by up to 1.7e-17 per step
#: (1.8e-13 at 10^4 steps, 1.7e-12 at 10^5, interval 1e-4), i.e. epsilon too small (e.g. z =
#: 70.05, 6758 steps, delta 1.18e-10: 7.78028 < exact 7.78052). privkit asks dp-accounting
#: for epsilon at ``delta - slack`` and adds ``slack`` to a delta, ``slack`` = this x steps.
SLACK_PER_STEP = 5e-16
#: Intervals ``AUTO`` may use, coarsest last.
AUTO_INTERVALS = (1e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 7e-4, 1e-3, 1.5e-3, 2e-3)
#: Modelled relative discretisation error ``AUTO`` allows.
AUTO_RELATIVE_ERROR = 2e-4
_PROBE = (4e-3, 2e-3)
#: The coarse interval ``AUTO``'s probes (and calibration's first stage) use.
PROBE_INTERVAL = _PROBE[0]


#: Errors dp-accounting raises at extreme parameters (noise multipliers near 0 or 1e300:
#: "Maximum allowed size exceeded", float overflow): PLD cannot price such an event.
_PLD_FAILURES = (OverflowError, ValueError, MemoryError, FloatingPointError, ZeroDivisionError)


def _guarded(what: str, fn: Any) -> float:
    """``fn()`` as a float; dp-accounting's failures become UnsupportedEventError (AUTO then
    falls back to RDP, labelled), never a crash from deep inside the library."""
    try:
        with np.errstate(all="ignore"):
            value = float(fn())
    except UnsupportedEventError:
        raise  # an event PLD has no rule for: its own message says so
    except _PLD_FAILURES as exc:
        raise UnsupportedEventError(
            f"pld cannot price this event ({what}: {type(exc).__name__}: {exc}); its "
            "parameters are too extreme for a discretised privacy-loss distribution") from None
    return value


def build(comp: Composition, vdi: float, relation: Any) -> Any:
    """The composed pessimistic PLD of ``comp`` at interval ``vdi``."""
    out = None
    for atom, n in comp.atoms:
        one = pld_of(atom, vdi, relation)
        one = one.self_compose(n) if n > 1 else one
        out = one if out is None else out.compose(one)
    return out


def epsilon(comp: Composition, d: float, vdi: float, relation: Any) -> float:
    """Pessimistic PLD epsilon at ``d`` (memoised: calibration re-asks the same points)."""
    if d < MIN_DELTA:
        raise InvalidParameterError("delta", d, f">= {MIN_DELTA} for method 'pld'")
    slack = _slack(comp)
    if not slack <= 0.5 * d:
        raise InvalidParameterError(
            "delta", d, f">= {2 * slack:g} for method 'pld' over {_steps(comp)} composed steps "
            "(twice its allowance for numerical error)")
    return _epsilon_cached(comp, d - slack, vdi, relation)


def _steps(comp: Composition) -> int:
    return sum(n for _, n in comp.atoms)


def _slack(comp: Composition) -> float:
    """Allowance for dp-accounting's numerical error in delta (see SLACK_PER_STEP)."""
    return SLACK_PER_STEP * _steps(comp)


@functools.lru_cache(maxsize=256)
def _epsilon_cached(comp: Composition, d: float, vdi: float, relation: Any) -> float:
    return _guarded("epsilon", lambda: build(comp, vdi, relation).get_epsilon_for_delta(d))


def delta(comp: Composition, e: float, vdi: float, relation: Any) -> float:
    """Pessimistic PLD delta at ``e``, plus the numerical-error allowance (capped at 1)."""
    d = _guarded("delta", lambda: build(comp, vdi, relation).get_delta_for_epsilon(e))
    return min(1.0, d + _slack(comp)) if d > 0 or e < math.inf else d


def auto_interval(e_coarse: float, e_mid: float) -> float:
    """The interval AUTO uses, from epsilons at 4e-3 and 2e-3 (see module doc)."""
    gap = e_coarse - e_mid
    if not (gap > 0 and math.isfinite(gap) and e_mid > 0):
        return _PROBE[1]
    k = gap / (_PROBE[0] ** 2 - _PROBE[1] ** 2)
    v_star = math.sqrt(AUTO_RELATIVE_ERROR * e_mid / k)
    fitting = [v for v in AUTO_INTERVALS if v <= v_star]
    return fitting[-1] if fitting else AUTO_INTERVALS[0]


def auto_epsilon(comp: Composition, d: float, relation: Any) -> tuple[float, float]:
    """(epsilon, interval) with the interval chosen as in the module doc."""
    v = choose_interval(comp, d, relation)
    return epsilon(comp, d, v, relation), v


def choose_interval(comp: Composition, d: float, relation: Any) -> float:
    """The interval ``AUTO`` prices ``comp`` at (two cheap probes)."""
    coarse = epsilon(comp, d, _PROBE[0], relation)
    return auto_interval(coarse, epsilon(comp, d, _PROBE[1], relation))
