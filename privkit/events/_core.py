"""The core of :mod:`privkit.events`: dp-accounting's events, ``PureDpEvent``, the JSON
round trip and the step builders (see the package docstring)."""


from __future__ import annotations

import enum
import importlib
import math
from collections.abc import Mapping
from typing import Any

import attr
from dp_accounting.dp_event import (
    ComposedDpEvent,
    DpEvent,
    GaussianDpEvent,
    LaplaceDpEvent,
    NonPrivateDpEvent,
    NoOpDpEvent,
    PoissonSampledDpEvent,
    SampledWithoutReplacementDpEvent,
    SampledWithReplacementDpEvent,
    SelfComposedDpEvent,
)

from privkit import _validate
from privkit._dpa import dp_event  # noqa: I001  (first: it defers dp-accounting's heavy __init__)
from privkit.errors import InvalidParameterError

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
    "event_to_dict",
    "event_from_dict",
    "register_event_module",
    "gaussian_steps_event",
    "pure_steps_event",
]


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PureDpEvent(DpEvent):
    """One use of any mechanism that is ``epsilon``-DP (pure, delta = 0).

    Use it for mechanisms whose only known guarantee is pure DP (e.g. the L2-norm
    Laplace mechanism, or an objective-perturbation step, once its per-step
    epsilon is known). It is priced by the pure-DP compositions of
    :mod:`privkit.accountants.pure` and by the randomized-response dominating
    pair in PLD accounting (Kairouz, Oh & Viswanath 2015), which dominates every
    ``epsilon``-DP mechanism.

    Attributes:
        epsilon: the per-use privacy parameter, finite and > 0.
    """

    epsilon: float

    def __attrs_post_init__(self) -> None:
        _validate.positive("epsilon", self.epsilon)


_EVENT_MODULES: set[str] = {dp_event.__name__, "privkit.events"}


def register_event_module(module_name: str) -> None:
    """Allow :func:`event_from_dict` to rebuild event classes of ``module_name``."""
    _EVENT_MODULES.add(module_name)


def _encode(value: Any, name: str) -> Any:
    if isinstance(value, DpEvent):
        return event_to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_encode(v, name) for v in value]
    if isinstance(value, enum.Enum):
        # enums: stored by name, rebuilt by the event's own converter
        return value.name
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidParameterError(name, value, "finite to be serialised")
    return value


def event_to_dict(event: DpEvent) -> dict[str, Any]:
    """A JSON-ready dict describing ``event`` (recursively)."""
    if not isinstance(event, DpEvent) or not attr.has(type(event)):
        raise InvalidParameterError("event", event, "a dp_accounting DpEvent")
    cls = type(event)
    out: dict[str, Any] = {"type": f"{cls.__module__}:{cls.__name__}"}
    for f in attr.fields(cls):
        out[f.name] = _encode(getattr(event, f.name), f"{cls.__name__}.{f.name}")
    return out


def _decode(value: Any, name: str) -> Any:
    if isinstance(value, Mapping) and "type" in value:
        return event_from_dict(value)
    if isinstance(value, list):
        return [_decode(v, name) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidParameterError(name, value, "finite")
    return value


def event_from_dict(data: Mapping[str, Any]) -> DpEvent:
    """Rebuild an event written by :func:`event_to_dict`.

    Raises:
        InvalidParameterError: unknown or disallowed event type, or bad fields.
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("type"), str):
        raise InvalidParameterError("event", data, "a dict with a 'type' entry")
    module_name, _, class_name = data["type"].partition(":")
    if module_name not in _EVENT_MODULES:
        raise InvalidParameterError(
            "event.type", data["type"], "an event class of a registered module"
        )
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, DpEvent) and attr.has(cls)):
        raise InvalidParameterError("event.type", data["type"], "the name of a DpEvent class")
    kwargs = {k: _decode(v, f"{class_name}.{k}") for k, v in data.items() if k != "type"}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise InvalidParameterError(
            "event", dict(data), f"valid fields for {class_name} ({exc})"
        ) from None


def gaussian_steps_event(
    noise_multiplier: float, steps: int, sampling_probability: float = 1.0
) -> DpEvent:
    """``steps`` uses of a Gaussian mechanism, Poisson-subsampled when q < 1.

    Args:
        noise_multiplier: stddev / L2 sensitivity, finite and > 0.
        steps: number of releases, an integer >= 1.
        sampling_probability: Poisson sampling probability in (0, 1]; 1 means
            every record is used in every step (no amplification).

    Examples:
        >>> ev = gaussian_steps_event(1.1, 1000, 0.01)
        >>> ev.count, ev.event.sampling_probability, ev.event.event.noise_multiplier
        (1000, 0.01, 1.1)
    """
    z = _validate.positive("noise_multiplier", noise_multiplier)
    t = _validate.positive_int("steps", steps)
    q = _validate.probability("sampling_probability", sampling_probability)
    inner: DpEvent = GaussianDpEvent(z)
    if q < 1:
        inner = PoissonSampledDpEvent(q, inner)
    return SelfComposedDpEvent(inner, t)


def pure_steps_event(epsilon: float, steps: int) -> DpEvent:
    """``steps`` uses of an ``epsilon``-DP mechanism.

    Examples:
        >>> pure_steps_event(1.0, 10)
        SelfComposedDpEvent(event=PureDpEvent(epsilon=1.0), count=10)
    """
    e = _validate.positive("epsilon", epsilon)
    k = _validate.positive_int("steps", steps)
    return SelfComposedDpEvent(PureDpEvent(e), k)


PureDpEvent.__module__ = "privkit.events"  # its public home (and the name ledgers store)
