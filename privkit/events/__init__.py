"""Privacy events: the contract between mechanisms and accountants.

Standard events are dp-accounting's own (:mod:`dp_accounting.dp_event`) and are
re-exported here, so a privkit mechanism can be priced by dp-accounting's
accountants as well as by privkit's. privkit adds events for what dp-accounting
lacks, in the same frozen, plain-data style. A new kind of privacy event is a
new class (never a changed one) plus rules registered with
:mod:`privkit.accountants.rules`; nothing else needs to change. Events are plain data: this
package imports no accountant (the standard events and the JSON round trip are in
``_core``, the events of privkit's own mechanisms in :mod:`privkit.events.mechanisms`).

Events are plain data and round-trip through JSON with :func:`event_to_dict` and
:func:`event_from_dict`; only event classes from dp-accounting and from modules
that registered themselves with :func:`register_event_module` can be rebuilt, so
loading a journal never imports or calls arbitrary code.

Examples:
    >>> from privkit.events import GaussianDpEvent, SelfComposedDpEvent, event_to_dict
    >>> event_to_dict(SelfComposedDpEvent(GaussianDpEvent(1.0), 3))["count"]
    3
"""

from __future__ import annotations

from privkit.events._core import (
    ComposedDpEvent,
    DpEvent,
    GaussianDpEvent,
    LaplaceDpEvent,
    NonPrivateDpEvent,
    NoOpDpEvent,
    PoissonSampledDpEvent,
    PureDpEvent,
    SampledWithoutReplacementDpEvent,
    SampledWithReplacementDpEvent,
    SelfComposedDpEvent,
    event_from_dict,
    event_to_dict,
    gaussian_steps_event,
    pure_steps_event,
    register_event_module,
)
from privkit.events.mechanisms import (
    JACOBIAN_CONSTANT,
    MAX_CANDIDATES,
    NOISE_MULTIPLIER_NOTE,
    RELATION_LABELS,
    CodedDataMiEvent,
    L2LaplaceDpEvent,
    LabelMode,
    ObjectivePerturbationDpEvent,
    PoissonSampledPureDpEvent,
    RecDpEvent,
    ReplaceOneGaussianDpEvent,
    ReplaceOneLaplaceDpEvent,
    as_relation,
    objective_step_epsilon,
)

__all__ = [
    "DpEvent",
    "GaussianDpEvent",
    "LaplaceDpEvent",
    "PoissonSampledDpEvent",
    "SampledWithReplacementDpEvent",
    "SampledWithoutReplacementDpEvent",
    "SelfComposedDpEvent",
    "ComposedDpEvent",
    "NoOpDpEvent",
    "NonPrivateDpEvent",
    "PureDpEvent",
    "L2LaplaceDpEvent",
    "ObjectivePerturbationDpEvent",
    "objective_step_epsilon",
    "JACOBIAN_CONSTANT",
    "RecDpEvent",
    "MAX_CANDIDATES",
    "LabelMode",
    "CodedDataMiEvent",
    "PoissonSampledPureDpEvent",
    "event_to_dict",
    "event_from_dict",
    "register_event_module",
    "gaussian_steps_event",
    "pure_steps_event",
    "as_relation",
    "RELATION_LABELS",
    "NOISE_MULTIPLIER_NOTE",
    "ReplaceOneGaussianDpEvent",
    "ReplaceOneLaplaceDpEvent",
]
