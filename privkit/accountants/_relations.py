"""The neighbouring relations: what an atom means under each, and which it cannot be priced
under.

:func:`relative_to_sensitivity` re-expresses an atom with its noise relative to the relation's
sensitivity (the noise-multiplier convention of :mod:`privkit.accountants.rules`, which applies
it once, in :func:`~privkit.accountants.rules.priced`), :func:`relation_error` says why an atom
cannot be priced under a relation, and :data:`PRICED_RELATIONS` names the relations privkit
prices. Apart from the per-method rules because these rules are about the relation, not the
method: every method prices what comes out of them. Both are singledispatch functions that
other accountant modules extend (``rules.relation_error.register``, as the rules module
re-exports them).
"""

from __future__ import annotations

import functools
from typing import Any

from privkit._dpa import dp_event
from privkit._dpa import privacy_accountant as pa
from privkit.errors import UnsupportedEventError
from privkit.events import PureDpEvent, ReplaceOneGaussianDpEvent, ReplaceOneLaplaceDpEvent

NeighboringRelation = pa.NeighboringRelation

__all__ = [
    "NeighboringRelation",
    "PRICED_RELATIONS",
    "relation_error",
    "relative_to_sensitivity",
    "guarantee_event",
    "sensitivity_factor",
]


# ----------------------------------------------------------- relation_error
@functools.singledispatch
def relation_error(event: dp_event.DpEvent, relation: Any) -> str | None:
    """Why ``event`` cannot be priced under ``relation`` (None: it can)."""
    return None


@relation_error.register
def _(event: dp_event.SampledWithoutReplacementDpEvent, relation: Any) -> str | None:
    if relation != NeighboringRelation.REPLACE_ONE:
        return ("SampledWithoutReplacementDpEvent (a fixed-size batch) is priced under "
                "REPLACE_ONE neighbours only: a fixed batch size is defined for a fixed data "
                "set size, and dp-accounting's rules for it are replace-one's; pass "
                "neighboring_relation=REPLACE_ONE (CLI: --relation replace-one) or sample "
                "with PoissonSampledDpEvent")
    return None


# -------------------------------------------------- relative_to_sensitivity
#: The relations privkit prices, and the relation each is priced as once its events are
#: re-expressed against its sensitivity: zero-out (``REPLACE_SPECIAL``: a contribution replaced
#: by a null one that contributes nothing) has the add/remove pairs (Poisson-sampled or not).
PRICED_RELATIONS = {
    NeighboringRelation.ADD_OR_REMOVE_ONE: NeighboringRelation.ADD_OR_REMOVE_ONE,
    NeighboringRelation.REPLACE_SPECIAL: NeighboringRelation.ADD_OR_REMOVE_ONE,
    NeighboringRelation.REPLACE_ONE: NeighboringRelation.REPLACE_ONE,
}


def _unknown_meaning(event: Any, relation: Any) -> UnsupportedEventError:
    return UnsupportedEventError(
        f"{type(event).__name__} under {relation.name}: privkit does not know whether its "
        "parameters are relative to the bound on one contribution (privkit's and "
        "dp-accounting's PLD reading, the sensitivity doubled under REPLACE_ONE) or to the "
        "relation's own sensitivity, so it cannot price it without guessing; price it under "
        "ADD_OR_REMOVE_ONE, or describe the mechanism with privkit's or dp-accounting's "
        "Gaussian, Laplace, sampled or pure events")


@functools.singledispatch
def relative_to_sensitivity(event: dp_event.DpEvent, relation: Any) -> dp_event.DpEvent:
    """The atom with its noise relative to ``relation``'s sensitivity (module doc): what the
    methods price. Unknown event types are the atom itself under add/remove and refused under
    any other relation.

    Raises:
        UnsupportedEventError: an event type whose meaning under ``relation`` is not known.
    """
    if relation == NeighboringRelation.ADD_OR_REMOVE_ONE:
        return event
    raise _unknown_meaning(event, relation)


def sensitivity_factor(relation: Any) -> float:
    """The relation's sensitivity over the bound on one contribution: 2 under ``REPLACE_ONE``
    (one contribution replaced by another), else 1."""
    return 2.0 if relation == NeighboringRelation.REPLACE_ONE else 1.0


@relative_to_sensitivity.register
def _(event: dp_event.GaussianDpEvent, relation: Any) -> dp_event.DpEvent:
    f = sensitivity_factor(relation)
    return event if f == 1 else dp_event.GaussianDpEvent(float(event.noise_multiplier) / f)


@relative_to_sensitivity.register
def _(event: dp_event.LaplaceDpEvent, relation: Any) -> dp_event.DpEvent:
    f = sensitivity_factor(relation)
    return event if f == 1 else dp_event.LaplaceDpEvent(float(event.noise_multiplier) / f)


@relative_to_sensitivity.register
def _(event: dp_event.PoissonSampledDpEvent, relation: Any) -> dp_event.DpEvent:
    inner = relative_to_sensitivity(event.event, relation)
    return event if inner is event.event else dp_event.PoissonSampledDpEvent(
        event.sampling_probability, inner)


@relative_to_sensitivity.register
def _(event: dp_event.SampledWithoutReplacementDpEvent, relation: Any) -> dp_event.DpEvent:
    inner = relative_to_sensitivity(event.event, relation)
    return event if inner is event.event else dp_event.SampledWithoutReplacementDpEvent(
        event.source_dataset_size, event.sample_size, inner)


@relative_to_sensitivity.register
def _(event: dp_event.SampledWithReplacementDpEvent, relation: Any) -> dp_event.DpEvent:
    inner = relative_to_sensitivity(event.event, relation)
    return event if inner is event.event else dp_event.SampledWithReplacementDpEvent(
        event.source_dataset_size, event.sample_size, inner)


def _replace_one_only(event: Any, relation: Any) -> str:
    return (f"{type(event).__name__}'s sensitivity is known under REPLACE_ONE only (a "
            "clipped output's two points are 2C apart, and no smaller add/remove or zero-out "
            f"bound is known), so it is not priced under {relation.name}: pass "
            "neighboring_relation=REPLACE_ONE (the mechanism's neighboring_relation)")


@relative_to_sensitivity.register
def _(event: ReplaceOneGaussianDpEvent, relation: Any) -> dp_event.DpEvent:
    if relation != NeighboringRelation.REPLACE_ONE:
        raise UnsupportedEventError(_replace_one_only(event, relation))
    return dp_event.GaussianDpEvent(float(event.noise_multiplier) / 2)


@relative_to_sensitivity.register
def _(event: ReplaceOneLaplaceDpEvent, relation: Any) -> dp_event.DpEvent:
    if relation != NeighboringRelation.REPLACE_ONE:
        raise UnsupportedEventError(_replace_one_only(event, relation))
    return dp_event.LaplaceDpEvent(float(event.noise_multiplier) / 2)


def guarantee_event(event: dp_event.DpEvent, relation: Any) -> dp_event.DpEvent:
    """:func:`relative_to_sensitivity` of an event that states its guarantee ("epsilon-DP
    under the relation priced"): the event itself. Registered for such types."""
    return event


relative_to_sensitivity.register(PureDpEvent, guarantee_event)


@relation_error.register(ReplaceOneGaussianDpEvent)
@relation_error.register(ReplaceOneLaplaceDpEvent)
def _(event: Any, relation: Any) -> str | None:
    return None if relation == NeighboringRelation.REPLACE_ONE else \
        _replace_one_only(event, relation)
