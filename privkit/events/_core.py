"""Privacy events: the contract between mechanisms and accountants.

Standard events are dp-accounting's own (:mod:`dp_accounting.dp_event`) and are
re-exported here, so a privkit mechanism can be priced by dp-accounting's
accountants as well as by privkit's. privkit adds events for what dp-accounting
lacks, in the same frozen, plain-data style. A new kind of privacy event is a
new class (never a changed one) plus rules registered with
:mod:`privkit.accountants.rules`; nothing else needs to change.

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
    "L2LaplaceDpEvent",
    "ObjectivePerturbationDpEvent",
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


_EVENT_MODULES: set[str] = {dp_event.__name__, __name__}


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


# ------------------------------------------------ events added for mechanisms

@attr.s(frozen=True, slots=True, auto_attribs=True)
class L2LaplaceDpEvent(DpEvent):
    """One use of the L2-norm Laplace ("K-norm") mechanism, pure ``epsilon``-DP.

    The noise has density proportional to ``exp(-alpha ||x||_2)`` on R^d with
    ``alpha = epsilon / Delta_2`` (Delta_2 the L2 sensitivity), so one use is
    pure ``epsilon``-DP under the relation Delta_2 was computed for (the
    log-density ratio is at most alpha * Delta_2; mechanisms.md 2.2). For
    ``dimension == 1`` it *is* the 1-D Laplace mechanism and is priced with its
    exact PLD; for ``dimension > 1`` it is priced through randomized response,
    which dominates every ``epsilon``-DP mechanism (dp-accounting's
    ``LaplaceDpEvent`` describes the 1-D / L1 mechanism and must not be used).

    Attributes:
        epsilon: privacy parameter of one use, finite and > 0.
        dimension: number of noised coordinates d, an integer >= 1.
    """

    epsilon: float
    dimension: int

    def __attrs_post_init__(self) -> None:
        _validate.positive("L2LaplaceDpEvent.epsilon", self.epsilon)
        _validate.positive_int("L2LaplaceDpEvent.dimension", self.dimension)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ObjectivePerturbationDpEvent(DpEvent):
    """One objective-perturbation step (Upcycled-FL Thm C.2), pure ``epsilon``-DP if proven.

    The step minimises ``F_i(w) + (mu/2)||w - w_bar||^2 + <n, w>`` with
    ``p(n) ~ exp(-alpha ||n||_2)``. Under Thm C.2's conditions (GLM with convex
    per-example loss, ``||grad|| < u1``, ``|loss''| <= u2``, feature norm <= 1,
    ``u2 <= 0.5 |D| mu``, exact minimiser) one step is pure ``epsilon``-DP with
    ``epsilon = 2 alpha u1/|D| + 1.4 rank u2/(|D| mu)``
    (:func:`privkit.accountants.objective.objective_step_epsilon`; the paper's
    rank is 2). ``epsilon`` must equal that formula (checked, relative 1e-9).

    ``proven=False`` marks a step run outside the theorem (non-GLM model or an
    inexact solver): it is still priced with ``epsilon`` but every report that
    contains it carries a ``"NOT PROVEN: ..."`` assumption.

    Attributes:
        epsilon: per-step privacy parameter, finite and > 0.
        alpha: L2-Laplace rate of the linear term (1 / length units of the gradient), > 0.
        lipschitz: u1, bound on per-example gradient norms, > 0.
        smoothness: u2, bound on the per-example loss's second derivative, >= 0.
        rank: rank bound r of the Hessian difference (2 for a binary GLM), integer >= 1.
        dataset_size: |D_i|, the client's number of records, integer >= 1.
        proximal_mu: mu of the proximal term, > 0.
        proven: True only if every condition of Thm C.2 is known to hold.
    """

    epsilon: float
    alpha: float
    lipschitz: float
    smoothness: float
    rank: int
    dataset_size: int
    proximal_mu: float
    proven: bool

    def __attrs_post_init__(self) -> None:
        name = "ObjectivePerturbationDpEvent"
        e = _validate.positive(f"{name}.epsilon", self.epsilon)
        if not isinstance(self.proven, bool):
            raise InvalidParameterError(f"{name}.proven", self.proven, "a bool")
        # Imported here: privkit.accountants imports this module.
        from privkit.accountants.objective import _step_epsilon

        expected = _step_epsilon(
            f"{name}.", alpha=self.alpha, lipschitz=self.lipschitz, smoothness=self.smoothness,
            rank=self.rank, dataset_size=self.dataset_size, proximal_mu=self.proximal_mu,
        )
        if not math.isclose(e, expected, rel_tol=1e-9, abs_tol=0.0):
            raise InvalidParameterError(
                f"{name}.epsilon", self.epsilon,
                f"2 alpha u1/|D| + 1.4 rank u2/(|D| mu) = {expected!r} (Thm C.2)",
            )
