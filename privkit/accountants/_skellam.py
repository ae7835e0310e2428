"""The Skellam mechanism's Renyi-DP bound, and the rules that price a SkellamDpEvent.

:func:`skellam_rdp` (Agarwal, Kairouz & Liu's bound at any order), :func:`sampled_rdp` (joint
convexity for a Poisson-sampled round) and their registration in
:mod:`privkit.accountants.rules`: what pricing one release needs. Apart from the calibration
and the wrap-around bound, which build on it; :mod:`privkit.accountants.distributed` states
the argument and exports the public names.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privkit import _validate
from privkit.accountants import rules
from privkit.accountants._skellam_gdp import MAX_GDP_VARIANCE, TAIL_TV, skellam_unit_gdp
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.events import DpEvent
from privkit.events.distributed import (
    DISTRIBUTED_TRUST_ASSUMPTION,
    SkellamDpEvent,
    skellam_relation_error,
)

__all__ = ["skellam_rdp", "sampled_rdp", "skellam_gdp_mu", "SKELLAM_NOTE", "GDP_NOTE",
           "SAMPLING_NOTE"]

SKELLAM_NOTE = ("Skellam RDP: Agarwal, Kairouz & Liu 2021, Thm 3.5, at integer orders "
                "(interpolated between them by convexity); sensitivities from the enforced "
                "conditional-rounding bound (Kairouz, Liu & Steinke 2021; holds with "
                "probability 1, nothing added to delta)")
GDP_NOTE = ("Skellam releases every client takes part in: Gaussian-DP from the exact tradeoff "
            "curve of a unit shift of the sum's Skellam noise (mu_1, computed; mu <= mu_1 "
            "Delta_2 per release), priced exactly; delta includes (1 + e^eps) k Delta_1 1e-100 "
            "for the far tails (privkit.accountants.distributed); composed with events that "
            "have no exact price the Skellam is priced by its RDP bound instead")
SAMPLING_NOTE = ("Poisson client sampling priced by joint convexity (weak amplification); it "
                 "assumes the cohort stays secret, which the server that picks it does not "
                 "grant: against the server only the unamplified composition holds")


# ------------------------------------------------------------------ RDP
def _orders(orders: Any) -> np.ndarray:
    a = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    if a.ndim != 1 or a.size == 0 or not (np.isfinite(a).all() and (a > 1).all()):
        raise InvalidParameterError("orders", orders, "a non-empty list of finite orders > 1")
    return a


def _skellam_rdp_int(a: np.ndarray, m: float, d2: float, d1: float) -> np.ndarray:
    d2sq = d2 * d2
    extra = np.minimum(((2 * a - 1) * d2sq + 6 * d1) / (4 * m * m), 3 * d1 / (2 * m))
    return a * d2sq / (2 * m) + extra


def skellam_rdp(orders: Any, *, central_variance: float, l2_sensitivity: float,
                l1_sensitivity: float) -> np.ndarray:
    """Agarwal, Kairouz & Liu's Skellam RDP bound (:mod:`privkit.accountants.distributed`), at
    any order > 1.

    At an integer order it is the theorem's bound. Between integers ``a < alpha < a + 1`` the
    cumulant ``(alpha - 1) D_alpha = log E_Q[(P/Q)^alpha]`` is convex in ``alpha`` (Hoelder), so
    it lies below the chord through the bounds at ``a`` and ``a + 1`` (through 0 at
    ``alpha = 1`` for ``alpha < 2``, which gives the bound at 2).

    Args:
        orders: RDP orders > 1.
        central_variance: M, the Skellam variance of the sum's noise, > 0.
        l2_sensitivity: Delta_2 of the shift, > 0.
        l1_sensitivity: Delta_1 of the shift, > 0.

    Example:
        >>> r = skellam_rdp([2, 2.5, 3], central_variance=1000.0, l2_sensitivity=10.0,
        ...                 l1_sensitivity=80.0)
        >>> tuple(round(float(v), 6) for v in r)
        (0.100195, 0.133562, 0.150245)
    """
    a = _orders(orders)
    m = _validate.positive("central_variance", central_variance)
    d2 = _validate.positive("l2_sensitivity", l2_sensitivity)
    d1 = _validate.positive("l1_sensitivity", l1_sensitivity)
    lo = np.floor(a)
    frac = a - lo
    at_lo = _skellam_rdp_int(np.maximum(lo, 2.0), m, d2, d1)
    at_hi = _skellam_rdp_int(lo + 1, m, d2, d1)
    with np.errstate(invalid="ignore", divide="ignore"):
        chord = ((1 - frac) * (lo - 1) * at_lo + frac * lo * at_hi) / (a - 1)
    return np.where(frac == 0, at_lo, np.where(lo < 2, at_hi, chord))


def sampled_rdp(rdp: Any, orders: Any, sampling_probability: float) -> np.ndarray:
    """Joint-convexity bound for a Poisson-sampled round
    (:mod:`privkit.accountants.distributed`):
    ``log(1 + q (exp((alpha - 1) rdp) - 1)) / (alpha - 1)``, evaluated in log space.

    Example:
        >>> round(float(sampled_rdp([1.0], [2.0], 0.1)[0]), 6)
        0.158565
    """
    a = _orders(orders)
    r = np.asarray(rdp, dtype=np.float64)
    q = _validate.probability("sampling_probability", sampling_probability)
    if r.shape != a.shape or not (r >= 0).all():
        raise InvalidParameterError("rdp", rdp, "non-negative values, one per order")
    if q == 1:
        return r.copy()
    with np.errstate(over="ignore"):
        x = (a - 1) * r
        out = np.logaddexp(math.log1p(-q), math.log(q) + x) / (a - 1)
    return np.minimum(out, r)


# ------------------------------------------------------------------ GDP
def skellam_gdp_mu(event: SkellamDpEvent) -> float | None:
    """The GDP parameter ``mu_1(n mu) Delta_2`` of one release of ``event`` (its sensitivities
    as they stand: call it on the event relative to the relation), or None when it has none:
    a Poisson-sampled event, a central variance outside [1, 2^40], or inside
    :func:`privkit.accountants.rules.without_nearby_laws`
    (:mod:`privkit.accountants.distributed`).

    Example:
        >>> ev = SkellamDpEvent(noise_per_client=1e4, survivors=100, l2_sensitivity=300.0,
        ...                     l1_sensitivity=9600.0)
        >>> round(skellam_gdp_mu(ev), 6)   # the Gaussian of variance 1e6: 0.3
        0.3
    """
    if not _gdp_applies(event):
        return None
    return skellam_unit_gdp(event.central_variance) * float(event.l2_sensitivity)


# ------------------------------------------------------------------ rules
@rules.gaussian_rho.register(SkellamDpEvent)
def _(event: SkellamDpEvent) -> float | None:
    mu = skellam_gdp_mu(event)
    return None if mu is None else 0.5 * mu * mu


def _gdp_applies(event: SkellamDpEvent, sampled: bool = False) -> bool:
    return ((sampled or event.sampling_probability == 1) and rules.nearby_laws_allowed()
            and 1.0 <= event.central_variance <= MAX_GDP_VARIANCE)


@rules.delta_slack.register(SkellamDpEvent)
def _(event: SkellamDpEvent) -> float:
    # at most l1 coordinates move (integers), each within TAIL_TV of the law priced; a sampled
    # event carries it too (AUTO may price it as its unsampled form, :func:`unsampled`)
    return float(event.l1_sensitivity) * TAIL_TV if _gdp_applies(event, True) else 0.0


@rules.unsampled.register(SkellamDpEvent)
def _(event: SkellamDpEvent) -> DpEvent | None:
    # joint convexity, for every gamma >= 0: H_gamma((1-q) A + q B || (1-q) A + q B') <=
    # (1-q) max(0, 1-gamma) + q H_gamma(B || B') <= H_gamma(B || B') (as H >= 1 - gamma): the
    # sampled round is dominated by the unsampled one, so is any composition
    if event.sampling_probability == 1:
        return None
    return SkellamDpEvent(event.noise_per_client, event.survivors, event.l2_sensitivity,
                          event.l1_sensitivity, 1.0)


@rules.relation_error.register(SkellamDpEvent)
def _(event: SkellamDpEvent, relation: Any) -> str | None:
    return skellam_relation_error(relation)


@rules.relative_to_sensitivity.register(SkellamDpEvent)
def _(event: SkellamDpEvent, relation: Any) -> DpEvent:
    why = skellam_relation_error(relation)
    if why is not None:
        raise UnsupportedEventError(why)
    if relation == NeighboringRelation.REPLACE_ONE:
        return SkellamDpEvent(event.noise_per_client, event.survivors,
                              2.0 * float(event.l2_sensitivity),
                              2.0 * float(event.l1_sensitivity), event.sampling_probability)
    return event


@rules.check_atom.register(SkellamDpEvent)
def _(event: SkellamDpEvent) -> None:
    _validate.positive("SkellamDpEvent.noise_per_client", event.noise_per_client)
    _validate.positive_int("SkellamDpEvent.survivors", event.survivors)
    _validate.positive("SkellamDpEvent.l2_sensitivity", event.l2_sensitivity)
    _validate.positive("SkellamDpEvent.l1_sensitivity", event.l1_sensitivity)
    _validate.probability("SkellamDpEvent.sampling_probability", event.sampling_probability)


@rules.rdp_curve.register(SkellamDpEvent)
def _(event: SkellamDpEvent, orders: np.ndarray, relation: Any) -> np.ndarray:
    # the event is already relative to the relation's sensitivity (rules.priced)
    base = skellam_rdp(orders, central_variance=event.central_variance,
                       l2_sensitivity=event.l2_sensitivity, l1_sensitivity=event.l1_sensitivity)
    return sampled_rdp(base, orders, event.sampling_probability)


@rules.notes.register(SkellamDpEvent)
def _(event: SkellamDpEvent) -> tuple[str, ...]:
    if event.sampling_probability < 1:
        return (DISTRIBUTED_TRUST_ASSUMPTION, SKELLAM_NOTE, SAMPLING_NOTE)
    return (DISTRIBUTED_TRUST_ASSUMPTION, GDP_NOTE, SKELLAM_NOTE)
