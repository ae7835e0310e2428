"""Privacy-loss-distribution accounting (dp-accounting's PLD, pessimistic).

Every PLD here is dp-accounting's *pessimistic* estimate, an upper bound on
the true privacy curve at any discretisation interval; a finer interval is
tighter and slower. ``Method.PLD`` uses dp-accounting's usual 1e-4, so it
reproduces dp-accounting's numbers. ``AUTO`` chooses the interval per event
(:func:`auto_epsilon`): it prices the event at 4e-3 and 2e-3, models the
discretisation error as ``k * interval^2`` (what those two values show on
W1-W4), and picks the coarsest interval on a fixed grid whose modelled error
is <= :data:`AUTO_RELATIVE_ERROR` of epsilon. Whatever the model says, the
answer is a pessimistic PLD, so it stays a valid upper bound; the model only
decides how tight and how fast.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from privkit.accountants.rules import Composition, pld_of
from privkit.errors import InvalidParameterError

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
]

#: Discretisation of ``Method.PLD`` (dp-accounting's usual value: same numbers).
VALUE_DISCRETIZATION = 1e-4
#: PLD truncates tails of mass ~1e-15 per composition; below this delta its
#: answer is not trusted and ``Method.PLD`` refuses (``AUTO`` uses RDP).
MIN_DELTA = 1e-10
#: Intervals ``AUTO`` may use, coarsest last.
AUTO_INTERVALS = (1e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 7e-4, 1e-3, 1.5e-3, 2e-3)
#: Modelled relative discretisation error ``AUTO`` allows.
AUTO_RELATIVE_ERROR = 2e-4
_PROBE = (4e-3, 2e-3)
#: The coarse interval ``AUTO``'s probes (and calibration's first stage) use.
PROBE_INTERVAL = _PROBE[0]


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
    return _epsilon_cached(comp, d, vdi, relation)


@functools.lru_cache(maxsize=256)
def _epsilon_cached(comp: Composition, d: float, vdi: float, relation: Any) -> float:
    return float(build(comp, vdi, relation).get_epsilon_for_delta(d))


def delta(comp: Composition, e: float, vdi: float, relation: Any) -> float:
    return float(build(comp, vdi, relation).get_delta_for_epsilon(e))


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
