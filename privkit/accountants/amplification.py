"""Amplification by Poisson subsampling for pure-DP steps, as a privkit event.

:class:`PoissonSampledPureDpEvent` is one eps-DP step run on a Poisson subsample (each record
kept independently with probability q). It is priced as pure
``eps' = log(1 + q (e^eps - 1))``-DP (:func:`amplified_epsilon`) under add/remove neighbours,
and only while the sampler's outcome stays secret; every report that prices it states that
assumption. dp-accounting's ``PoissonSampledDpEvent`` does not serve here: privkit's pure-DP
accountants do not price it, and the L2-norm Laplace step has no PLD of its own.

Used by the MAPA trainer's ``--batch-sampler poisson --amplification``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privkit import _validate
from privkit.accountants import rules
from privkit.accountants._atoms import PureAtom
from privkit.errors import UnsupportedEventError
from privkit.events import PoissonSampledPureDpEvent, register_event_module

__all__ = ["AMPLIFICATION_ASSUMPTION", "PoissonSampledPureDpEvent", "amplified_epsilon"]

AMPLIFICATION_ASSUMPTION = (
    "amplified by Poisson subsampling: assumes the sampler's outcome (which records entered "
    "which batch) stays secret; add/remove neighbours")


def amplified_epsilon(epsilon: float, q: float) -> float:
    """Per-step epsilon of an epsilon-DP step run on a Poisson subsample (rate q), outcome secret.

    ``eps' = log(1 + q (e^eps - 1))`` for add/remove neighbours: amplification by Poisson
    subsampling (Li, Qardaji & Su, ASIACCS 2012; Balle, Barthe & Gaboardi, NeurIPS 2018,
    Thm 8, which shows it is tight). It equals eps at q = 1 and is < eps for q < 1. Computed
    as ``log1p(q expm1(eps))`` (no cancellation at small q or eps).

    Examples:
        >>> round(amplified_epsilon(1.0, 0.1), 6)
        0.158565
    """
    e = _validate.positive("epsilon", epsilon)
    p = _validate.probability("sampling_probability", q)
    return math.log1p(p * math.expm1(e))


register_event_module(__name__)


def _amplified_add_remove(relation: Any) -> None:
    if relation != rules.NeighboringRelation.ADD_OR_REMOVE_ONE:
        raise UnsupportedEventError("PoissonSampledPureDpEvent is priced under "
                                    "ADD_OR_REMOVE_ONE neighbours only")


@rules.check_atom.register(PoissonSampledPureDpEvent)
def _(event: PoissonSampledPureDpEvent) -> None:
    rules.check_atom(event.event)


@rules.pure_epsilon.register(PoissonSampledPureDpEvent)
def _(event: PoissonSampledPureDpEvent) -> float | None:
    return event.epsilon


@rules.only_known_as_pure.register(PoissonSampledPureDpEvent)
def _(event: PoissonSampledPureDpEvent) -> bool:
    return True


@rules.rdp_curve.register(PoissonSampledPureDpEvent)
def _(event: PoissonSampledPureDpEvent, orders: np.ndarray, relation: Any) -> np.ndarray:
    _amplified_add_remove(relation)
    return rules.randomized_response_rdp(event.epsilon, orders)


@rules.pld_of.register(PoissonSampledPureDpEvent)
def _(event: PoissonSampledPureDpEvent, vdi: float, relation: Any) -> Any:
    _amplified_add_remove(relation)
    return rules.randomized_response_pld(event.epsilon, vdi)


@rules.fft_atom.register(PoissonSampledPureDpEvent)
def _(event: PoissonSampledPureDpEvent) -> Any:
    return PureAtom(event.epsilon)


@rules.relation_error.register(PoissonSampledPureDpEvent)
def _(event: PoissonSampledPureDpEvent, relation: Any) -> str | None:
    if relation != rules.NeighboringRelation.ADD_OR_REMOVE_ONE:
        return ("PoissonSampledPureDpEvent is priced under ADD_OR_REMOVE_ONE neighbours only "
                "(amplification by Poisson subsampling is stated for add/remove)")
    return None


# A pure-DP guarantee (priced under add/remove only, relation_error above).
rules.relative_to_sensitivity.register(PoissonSampledPureDpEvent, rules.guarantee_event)


@rules.notes.register(PoissonSampledPureDpEvent)
def _(event: PoissonSampledPureDpEvent) -> tuple[str, ...]:
    return (AMPLIFICATION_ASSUMPTION,)
