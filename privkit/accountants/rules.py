"""How each event type is priced: one generic function per accounting rule.

An event is first *flattened* into a :class:`Composition`: a multiset of atomic
events (anything that is not a composition) with integer counts, so composing
the same event 10^6 times costs one entry, not 10^6. Each accountant then asks
the rules below about every atom. The rules are :func:`functools.singledispatch`
functions: a later module adds a new event type by registering its rules, e.g.::

    @rules.rdp_curve.register
    def _(event: MyEvent, orders, relation):
        return ...

and touches nothing else. An atom that a rule does not know raises
:class:`~privkit.errors.UnsupportedEventError` for that method only; ``AUTO``
then uses the methods that do support it.

Rules:

* :func:`check_atom` - validate the atom's parameters (raise, naming the field).
* :func:`is_non_private` - True when the atom releases data without noise.
* :func:`gaussian_rho` - for a non-subsampled Gaussian: its zCDP rho = 1/(2 z^2)
  (exact GDP composition applies); None otherwise.
* :func:`pure_epsilon` - epsilon if the atom is pure epsilon-DP; None otherwise.
* :func:`rdp_curve` - Renyi-DP at the given orders.
* :func:`pld_of` - a pessimistic dp-accounting PrivacyLossDistribution of one use.
* :func:`fft_atom` - the atom as privkit's own PLD (:mod:`privkit.accountants.fftpld`) sees it
  (a Gaussian with a sampling rate, or a pure step), or None if it cannot price it.
* :func:`relation_error` - why the atom cannot be priced under a neighbouring relation, or
  None (checked before any method runs).
* :func:`relative_to_sensitivity` - the atom with its noise relative to the relation's
  sensitivity (below).
* :func:`notes` - assumption strings every report containing the atom must carry.
* :func:`unsampled` - the atom with its sampling rate set to 1, for atoms whose sampled form
  is dominated by it (None: none, or not known).
* :func:`delta_slack` - ``t``: one use of the atom is priced by a law within total variation
  ``t`` of its own (default 0), so a composition's delta at epsilon carries
  ``(1 + e^epsilon) sum(count t)`` more (:func:`slack_total`; the accountant adds it).

The two relation rules, :data:`PRICED_RELATIONS` and :func:`guarantee_event` are defined in
``privkit.accountants._relations`` and exported here.

**The noise-multiplier convention** (one meaning for an event, under every relation, as in
Opacus, Flower, TensorFlow Privacy and dp-accounting's PLD accountant). A Gaussian event's
``noise_multiplier`` is ``stddev / C``, ``C`` the bound on one contribution (the clip norm); a
Laplace event's is ``scale / C`` (``C`` the L1 bound). The accountant applies the relation's
sensitivity: ``C`` under ``ADD_OR_REMOVE_ONE`` and under zero-out (``REPLACE_SPECIAL``: one
contribution replaced by a null one that contributes zero), ``2 C`` under ``REPLACE_ONE``.
:func:`priced` does it once, before any method runs: it re-expresses every atom with its noise
relative to the relation's sensitivity (:func:`relative_to_sensitivity`; ``GaussianDpEvent(z)``
under ``REPLACE_ONE`` becomes ``GaussianDpEvent(z / 2)``), and the methods below price that.
(dp-accounting's RDP accountant reads ``z`` against the relation's own sensitivity instead, so
for the same event under ``REPLACE_ONE`` it prints the epsilon of twice the noise; privkit
agrees with its PLD accountant.) Events that state a guarantee rather than a noise level
(``PureDpEvent``, ``L2LaplaceDpEvent``, objective perturbation: "epsilon-DP") mean that
guarantee under the relation they are priced with. An event type whose meaning privkit does
not know is refused under ``REPLACE_ONE`` and zero-out rather than guessed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit import _validate
from privkit._dpa import dp_event
from privkit._lazy import LazyModule
from privkit.accountants._atoms import GaussianAtom, PureAtom
from privkit.accountants._relations import (
    PRICED_RELATIONS,
    NeighboringRelation,
    guarantee_event,
    relation_error,
    relative_to_sensitivity,
    sensitivity_factor,
)
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.events import PureDpEvent

pld_lib = LazyModule("dp_accounting.pld.privacy_loss_distribution")
rdp_lib = LazyModule("dp_accounting.rdp.rdp_privacy_accountant")

__all__ = [
    "Composition",
    "flatten",
    "check_atom",
    "is_non_private",
    "gaussian_rho",
    "pure_epsilon",
    "rdp_curve",
    "pld_of",
    "fft_atom",
    "relation_error",
    "relative_to_sensitivity",
    "priced",
    "PRICED_RELATIONS",
    "notes",
    "delta_slack",
    "slack_total",
    "unsampled",
    "nearby_laws_allowed",
    "without_nearby_laws",
    "guarantee_event",
    "randomized_response_rdp",
    "randomized_response_pld",
    "NeighboringRelation",
]


@dataclass(frozen=True)
class Composition:
    """A flattened event: atoms with multiplicities, in a canonical order.

    Attributes:
        atoms: ((atom, count), ...), sorted by ``repr(atom)``; counts are >= 1.
        non_private: True if any part releases data without noise (epsilon = inf).
    """

    atoms: tuple[tuple[dp_event.DpEvent, int], ...]
    non_private: bool = False

    @property
    def empty(self) -> bool:
        return not self.atoms and not self.non_private

    def __add__(self, other: Composition) -> Composition:
        c: Counter[dp_event.DpEvent] = Counter(dict(self.atoms))
        c.update(dict(other.atoms))
        return _from_counter(c, self.non_private or other.non_private)


def _from_counter(c: Counter[Any], non_private: bool) -> Composition:
    atoms = tuple(sorted(((a, n) for a, n in c.items() if n > 0), key=lambda t: repr(t[0])))
    return Composition(atoms, non_private)


def flatten(event: dp_event.DpEvent, count: int = 1) -> Composition:
    """Flatten nested Composed/SelfComposed events into atoms with counts."""
    count = _validate.positive_int("count", count)
    c: Counter[dp_event.DpEvent] = Counter()
    non_private = _walk(event, count, c)
    return _from_counter(c, non_private)


def _walk(event: Any, count: int, c: Counter[Any]) -> bool:
    if not isinstance(event, dp_event.DpEvent):
        raise InvalidParameterError("event", event, "a DpEvent")
    if isinstance(event, dp_event.NoOpDpEvent):
        return False
    if isinstance(event, dp_event.NonPrivateDpEvent):
        return True
    if isinstance(event, dp_event.SelfComposedDpEvent):
        n = _validate.nonnegative_int("SelfComposedDpEvent.count", event.count)
        return False if n == 0 else _walk(event.event, count * n, c)
    if isinstance(event, dp_event.ComposedDpEvent):
        flags = [_walk(e, count, c) for e in event.events]
        return any(flags)
    if isinstance(event, dp_event.UnsupportedDpEvent):
        raise UnsupportedEventError("UnsupportedDpEvent cannot be priced by any accountant")
    check_atom(event)
    if is_non_private(event):
        return True
    try:
        c[event] += count
    except TypeError:  # unhashable fields (e.g. lists): no rule can know such an event
        raise UnsupportedEventError(
            f"{type(event).__name__} cannot be priced by privkit's accountants") from None
    return False


# ---------------------------------------------------------------- check_atom
@functools.singledispatch
def check_atom(event: dp_event.DpEvent) -> None:
    """Validate an atom's parameters; unknown types are left to the methods."""


@check_atom.register
def _(event: dp_event.GaussianDpEvent) -> None:
    _validate.nonnegative("GaussianDpEvent.noise_multiplier", event.noise_multiplier)


@check_atom.register
def _(event: dp_event.LaplaceDpEvent) -> None:
    _validate.nonnegative("LaplaceDpEvent.noise_multiplier", event.noise_multiplier)


@check_atom.register
def _(event: dp_event.PoissonSampledDpEvent) -> None:
    _validate.probability("PoissonSampledDpEvent.sampling_probability", event.sampling_probability)
    inner = event.event
    if isinstance(inner, (dp_event.ComposedDpEvent, dp_event.SelfComposedDpEvent)):
        raise UnsupportedEventError("PoissonSampledDpEvent of a composition is not supported")
    check_atom(inner)


# ------------------------------------------------------------ is_non_private
@functools.singledispatch
def is_non_private(event: dp_event.DpEvent) -> bool:
    """True if the atom releases its input without noise."""
    return False


@is_non_private.register
def _(event: dp_event.GaussianDpEvent) -> bool:
    return event.noise_multiplier == 0


@is_non_private.register
def _(event: dp_event.LaplaceDpEvent) -> bool:
    return event.noise_multiplier == 0


@is_non_private.register
def _(event: dp_event.PoissonSampledDpEvent) -> bool:
    return is_non_private(event.event)


# ------------------------------------------------------------- gaussian_rho
@functools.singledispatch
def gaussian_rho(event: dp_event.DpEvent) -> float | None:
    """zCDP rho of one use if the atom is a non-subsampled Gaussian, else None."""
    return None


@gaussian_rho.register
def _(event: dp_event.GaussianDpEvent) -> float | None:
    # 0.5 / z / z, not 1 / (2 z^2): z^2 underflows to 0 for z < ~1e-154 (a ZeroDivisionError);
    # this way rho overflows to inf (epsilon inf, an upper bound) instead.
    z = float(event.noise_multiplier)
    return 0.5 / z / z


@gaussian_rho.register
def _(event: dp_event.PoissonSampledDpEvent) -> float | None:
    # q = 1 is no subsampling at all (guards against the small-q GDP formula bug).
    return gaussian_rho(event.event) if event.sampling_probability == 1 else None


# ------------------------------------------------------------- pure_epsilon
@functools.singledispatch
def pure_epsilon(event: dp_event.DpEvent) -> float | None:
    """epsilon if the atom is pure epsilon-DP, else None."""
    return None


@pure_epsilon.register
def _(event: PureDpEvent) -> float | None:
    return float(event.epsilon)


@pure_epsilon.register
def _(event: dp_event.LaplaceDpEvent) -> float | None:
    # Laplace with scale b = noise_multiplier * L1 sensitivity is (1/noise_multiplier)-DP.
    return 1.0 / float(event.noise_multiplier)


# ------------------------------------------------------- only_known_as_pure
@functools.singledispatch
def only_known_as_pure(event: dp_event.DpEvent) -> bool:
    """True if all that is known of the atom is "epsilon-DP".

    For such atoms the randomized-response dominating pair is the tightest valid
    description, so optimal composition is as tight as PLD and ``AUTO`` skips PLD.
    (dp-accounting's ``LaplaceDpEvent`` is not one: its 1-D Laplace PLD is tighter.)
    """
    return False


@only_known_as_pure.register
def _(event: PureDpEvent) -> bool:
    return True


# ---------------------------------------------------------------- rdp_curve
@functools.singledispatch
def rdp_curve(event: dp_event.DpEvent, orders: np.ndarray, relation: Any) -> np.ndarray:
    """RDP of one use at ``orders``; default: dp-accounting's RdpAccountant."""
    acc = rdp_lib.RdpAccountant(list(orders), relation)
    if not acc.supports(event):
        raise UnsupportedEventError(f"no RDP rule for {type(event).__name__}")
    # dp-accounting logs a warning for each order whose series does not
    # converge; it sets that order's RDP to inf, which the conversion ignores.
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        acc.compose(event)
    except (OverflowError, ValueError, FloatingPointError, ZeroDivisionError) as exc:
        # dp-accounting's series overflow at extreme noise multipliers (e.g. 1e300)
        raise UnsupportedEventError(
            f"rdp cannot price this {type(event).__name__} ({type(exc).__name__}: {exc}); "
            "its parameters are too extreme") from None
    finally:
        absl_logger.setLevel(level)
    return np.asarray(acc.rdp, dtype=np.float64)


@rdp_curve.register
def _(event: dp_event.GaussianDpEvent, orders: np.ndarray, relation: Any) -> np.ndarray:
    z = float(event.noise_multiplier)
    return np.asarray(orders, dtype=np.float64) * (0.5 / z / z)  # inf, not 0-division, if z ~ 0


def randomized_response_rdp(epsilon: float, orders: np.ndarray) -> np.ndarray:
    """RDP at ``orders`` of RR(epsilon), which dominates every epsilon-DP mechanism."""
    # D_a = log(p^a q^(1-a) + q^a p^(1-a)) / (a - 1), p = e^eps/(1+e^eps).
    a = np.asarray(orders, dtype=np.float64)
    eps = float(epsilon)
    log_p = -np.logaddexp(0.0, -eps)
    log_q = -np.logaddexp(0.0, eps)
    val = np.logaddexp(a * log_p + (1 - a) * log_q, a * log_q + (1 - a) * log_p) / (a - 1)
    return np.minimum(val, eps)


@rdp_curve.register
def _(event: PureDpEvent, orders: np.ndarray, relation: Any) -> np.ndarray:
    return randomized_response_rdp(event.epsilon, orders)


# ------------------------------------------------------------------- pld_of
@functools.singledispatch
def pld_of(event: dp_event.DpEvent, vdi: float, relation: Any) -> Any:
    """Pessimistic PLD of one use, discretised at ``vdi``."""
    raise UnsupportedEventError(f"no PLD rule for {type(event).__name__}")


def _pld_sensitivity(relation: Any) -> float:
    # dp-accounting's REPLACE_ONE pair doubles the sensitivity it is given; privkit's noise
    # multiplier is already relative to the replace-one sensitivity (module doc).
    return 1.0 / sensitivity_factor(relation)


@pld_of.register
def _(event: dp_event.GaussianDpEvent, vdi: float, relation: Any) -> Any:
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=float(event.noise_multiplier),
        sensitivity=_pld_sensitivity(relation),
        value_discretization_interval=vdi,
        neighboring_relation=relation,
        pessimistic_estimate=True,
    )


@pld_of.register
def _(event: dp_event.LaplaceDpEvent, vdi: float, relation: Any) -> Any:
    # Unsampled, the pair Lap(0, b) vs Lap(Delta, b) is the same under either relation when
    # Delta is the sensitivity under the relation priced (module doc).
    return pld_lib.from_laplace_mechanism(
        parameter=float(event.noise_multiplier), value_discretization_interval=vdi,
        pessimistic_estimate=True,
    )


def randomized_response_pld(epsilon: float, vdi: float) -> Any:
    """PLD of RR(epsilon), which dominates every epsilon-DP mechanism (KOV 2015)."""
    params = pld_lib.common.DifferentialPrivacyParameters(float(epsilon), 0.0)
    return pld_lib.from_privacy_parameters(params, value_discretization_interval=vdi)


@pld_of.register
def _(event: PureDpEvent, vdi: float, relation: Any) -> Any:
    return randomized_response_pld(event.epsilon, vdi)


@pld_of.register
def _(event: dp_event.PoissonSampledDpEvent, vdi: float, relation: Any) -> Any:
    inner, q = event.event, float(event.sampling_probability)
    if isinstance(inner, dp_event.GaussianDpEvent):
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=float(inner.noise_multiplier), value_discretization_interval=vdi,
            sensitivity=_pld_sensitivity(relation), sampling_prob=q,
            neighboring_relation=relation, pessimistic_estimate=True,
        )
    if isinstance(inner, dp_event.LaplaceDpEvent):
        _require_add_remove(relation, "PoissonSampledDpEvent(LaplaceDpEvent)")
        return pld_lib.from_laplace_mechanism(
            parameter=float(inner.noise_multiplier), value_discretization_interval=vdi,
            sampling_prob=q, pessimistic_estimate=True,
        )
    raise UnsupportedEventError(f"no PLD rule for Poisson-sampled {type(inner).__name__}")


def _require_add_remove(relation: Any, what: str) -> None:
    if relation != NeighboringRelation.ADD_OR_REMOVE_ONE:
        raise UnsupportedEventError(f"PLD of {what} is implemented for ADD_OR_REMOVE_ONE only")


# ------------------------------------------------------------------ fft_atom
@functools.singledispatch
def fft_atom(event: dp_event.DpEvent) -> GaussianAtom | PureAtom | None:
    """The atom as :mod:`privkit.accountants.fftpld` prices it, or None."""
    return None


@fft_atom.register
def _(event: dp_event.GaussianDpEvent) -> GaussianAtom | PureAtom | None:
    return GaussianAtom(float(event.noise_multiplier), 1.0)


@fft_atom.register
def _(event: dp_event.PoissonSampledDpEvent) -> GaussianAtom | PureAtom | None:
    inner = event.event
    if isinstance(inner, dp_event.GaussianDpEvent):
        return GaussianAtom(float(inner.noise_multiplier), float(event.sampling_probability))
    return None


@fft_atom.register
def _(event: PureDpEvent) -> GaussianAtom | PureAtom | None:
    return PureAtom(float(event.epsilon))


# ------------------------------------------------------------------- priced
def priced(comp: Composition, relation: Any) -> tuple[Composition, Any]:
    """``comp`` re-expressed against ``relation``'s sensitivity, and the relation it is then
    priced as (:data:`PRICED_RELATIONS`). Apply it exactly once, where a composition of user
    events meets a relation (module doc).

    Raises:
        UnsupportedEventError: an atom whose meaning under ``relation`` is not known, or a
            relation privkit does not price.
    """
    rel = PRICED_RELATIONS.get(relation)
    if rel is None:
        raise UnsupportedEventError(f"privkit does not price the relation {relation!r}")
    if relation == NeighboringRelation.ADD_OR_REMOVE_ONE:
        return comp, rel
    c: Counter[dp_event.DpEvent] = Counter()
    for atom, n in comp.atoms:
        c[relative_to_sensitivity(atom, relation)] += n
    return _from_counter(c, comp.non_private), rel


# -------------------------------------------------------------------- notes
@functools.singledispatch
def notes(event: dp_event.DpEvent) -> tuple[str, ...]:
    """Assumptions a report containing this atom must state (default: none)."""
    return ()


# -------------------------------------------------------------- delta_slack
@functools.singledispatch
def delta_slack(event: dp_event.DpEvent) -> float:
    """The total variation between one use of the atom and the law its pricing describes
    (0: priced as it is). A composition priced so carries ``(1 + e^epsilon) sum(count t)``
    more delta at epsilon (each use's two neighbouring laws are both within ``t``)."""
    return 0.0


def slack_total(comp: Composition) -> float:
    """``sum(count * delta_slack(atom))`` over a (priced) composition."""
    return float(sum(n * delta_slack(a) for a, n in comp.atoms))


_NEARBY: contextvars.ContextVar[bool] = contextvars.ContextVar("privkit_nearby_laws",
                                                               default=True)


def nearby_laws_allowed() -> bool:
    """False inside :func:`without_nearby_laws`: rules that price an atom through a nearby
    law (a nonzero :func:`delta_slack`) must then price it as it is, or not at all."""
    return _NEARBY.get()


@contextlib.contextmanager
def without_nearby_laws() -> Iterator[None]:
    """Price every atom as it is (no :func:`delta_slack`): the accountant's fallback where the
    slack ``(1 + e^epsilon) t`` would not be negligible (a large epsilon)."""
    token = _NEARBY.set(False)
    try:
        yield
    finally:
        _NEARBY.reset(token)


# -------------------------------------------------------------- unsampled
@functools.singledispatch
def unsampled(event: dp_event.DpEvent) -> dp_event.DpEvent | None:
    """The atom without its client or record sampling, when the sampled atom's two
    neighbouring laws are dominated by the unsampled atom's (every hockey-stick divergence no
    larger: then so is every composition), or None. Used by ``AUTO``'s "sampling rates set
    to 1" candidate for atoms privkit's PLD does not know."""
    return None
