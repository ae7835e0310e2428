"""Pricing events: one function per direction, a method enum, and ``AUTO``.

``epsilon(event, delta)`` and ``delta(event, epsilon)`` flatten the event into
atoms with counts (:mod:`privkit.accountants.rules`) and price it with the
chosen :class:`Method`. Every number returned is an **upper bound** on the true
epsilon (or delta) under the stated assumptions: PLD is the pessimistic
estimate, RDP and the closed forms are upper bounds by construction, and
``AUTO`` returns the minimum of valid upper bounds (itself a valid bound).

Example:
    >>> from privkit.events import GaussianDpEvent, SelfComposedDpEvent
    >>> r = epsilon(SelfComposedDpEvent(GaussianDpEvent(1.0), 100), delta=1e-5)
    >>> round(r.epsilon, 4), r.method
    (91.8173, 'exact')
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privkit import _validate
from privkit._dpa import dp_event
from privkit._lazy import LazyModule
from privkit.accountants import gaussian, rdp, rules
from privkit.accountants._atoms import GaussianAtom
from privkit.accountants.rules import (
    Composition,
    NeighboringRelation,
    flatten,
    gaussian_rho,
    only_known_as_pure,
    pure_epsilon,
    rdp_curve,
)
from privkit.errors import InvalidParameterError, NumericalError, UnsupportedEventError
from privkit.events.mechanisms import as_relation

# Loaded on first use (privkit's start-up): the PLDs and pure composition.
fftpld: Any = LazyModule("privkit.accountants.fftpld")
pure: Any = LazyModule("privkit.accountants.pure")
pld_acc: Any = LazyModule("privkit.accountants.pld")

__all__ = [
    "Method",
    "EpsilonReport",
    "epsilon",
    "delta",
    "epsilon_batch",
    "epsilon_batch_compositions",
    "auto_prefers_pld",
    "unsupported",
    "Accountant",
    "AUTO_PLD_MAX_EPSILON",
]

#: PLD cost grows with epsilon (57 s at eps ~ 2270); ``AUTO`` skips it, labelled,
#: when the cheap RDP bound is above this.
AUTO_PLD_MAX_EPSILON = 200.0


class Method(enum.Enum):
    """Accounting methods. Each states which events it can price."""

    AUTO = "auto"
    """The tightest valid method for the event (minimum of valid upper bounds)."""
    EXACT = "exact"
    """Non-subsampled Gaussians only: exact analytic Gaussian (GDP composition)."""
    PLD = "pld"
    """Pessimistic privacy-loss distribution of dp-accounting, discretisation 1e-4 (its
    numbers, with privkit's allowance for its floating-point error)."""
    PLD_FFT = "pld-fft"
    """privkit's own pessimistic PLD (:mod:`privkit.accountants.fftpld`): Gaussian and
    Poisson-subsampled Gaussian events and pure steps, any mix; the grid is chosen for a
    relative error of about 5e-6, so it is as tight as ``PLD`` and many times faster."""
    RDP = "rdp"
    """Renyi DP with the Balle et al. 2020 conversion (:data:`rdp.ORDERS`)."""
    MOMENTS = "moments"
    """Non-subsampled Gaussians only: the Upcycled-FL Thm C.1 (zCDP) closed form."""
    OPTIMAL = "optimal"
    """Pure-DP steps only: optimal composition (Kairouz-Oh-Viswanath; dominating pair)."""
    ADVANCED = "advanced"
    """Pure-DP steps only: advanced composition (Dwork-Rothblum-Vadhan), or basic if smaller."""
    BASIC = "basic"
    """Pure-DP steps only: the sum of the epsilons (delta = 0)."""

    @classmethod
    def parse(cls, value: Any) -> Method:
        if isinstance(value, Method):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise InvalidParameterError("method", value, f"one of {names}") from None


@dataclass(frozen=True)
class EpsilonReport:
    """An (epsilon, delta) guarantee: epsilon is an upper bound at this delta.

    Attributes:
        epsilon: upper bound on the privacy loss (nats); ``inf`` if unbounded.
        delta: the delta it holds at.
        method: the accounting method that produced it (e.g. ``"exact"``,
            ``"pld"``, ``"rdp (fallback: ...)"``, ``"optimal"``).
        assumptions: what the number assumes, one phrase each.
        neighboring_relation: the name of the neighbouring relation priced
            (``"ADD_OR_REMOVE_ONE"`` or ``"REPLACE_ONE"``; None when no relation was priced).

    ``float(report)`` is the epsilon and ``str(report)`` one line (epsilon, delta, method,
    relation); :meth:`summary` adds the assumptions, one line each. A report compares with a
    number by its epsilon (``report <= 2``); two reports compare only at the same delta.

    Example:
        >>> r = EpsilonReport(1.5, 1e-5, "exact", (), "REPLACE_ONE")
        >>> float(r), str(r)
        (1.5, 'eps <= 1.5 at delta=1e-05  [exact; neighbouring relation: replace_one]')
    """

    epsilon: float
    delta: float
    method: str
    assumptions: tuple[str, ...] = field(default_factory=tuple)
    neighboring_relation: str | None = None

    def __float__(self) -> float:
        return float(self.epsilon)

    def _other(self, other: Any) -> float:
        if isinstance(other, EpsilonReport):
            if other.delta != self.delta:
                raise InvalidParameterError(
                    "other", other, f"a report at the same delta ({self.delta:g}): epsilons at "
                    "different deltas do not compare")
            return float(other.epsilon)
        if isinstance(other, (int, float, np.integer, np.floating)) and \
                not isinstance(other, bool):
            return float(other)
        return NotImplemented  # type: ignore[return-value]

    def __lt__(self, other: Any) -> bool:
        o = self._other(other)
        return o if o is NotImplemented else float(self.epsilon) < o

    def __le__(self, other: Any) -> bool:
        o = self._other(other)
        return o if o is NotImplemented else float(self.epsilon) <= o

    def __gt__(self, other: Any) -> bool:
        o = self._other(other)
        return o if o is NotImplemented else float(self.epsilon) > o

    def __ge__(self, other: Any) -> bool:
        o = self._other(other)
        return o if o is NotImplemented else float(self.epsilon) >= o

    def __str__(self) -> str:
        rel = (f"; neighbouring relation: {relation_label(self.neighboring_relation)}"
               if self.neighboring_relation else "")
        return f"eps <= {self.epsilon:.6g} at delta={self.delta:.3g}  [{self.method}{rel}]"

    def summary(self) -> str:
        """:func:`str` of the report, then each assumption other than the relation on a line."""
        rest = [a for a in self.assumptions if not a.startswith("neighbouring relation:")]
        return str(self) + "".join(f"\n  - {a}" for a in rest)

    def to_dict(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "method": self.method,
            "assumptions": list(self.assumptions),
            "neighboring_relation": self.neighboring_relation,
        }


# ----------------------------------------------------------------- helpers
_relation = as_relation


def relation_label(name: str) -> str:
    """How a report names a relation (zero-out is dp-accounting's REPLACE_SPECIAL)."""
    return "zero-out (replace_special)" if name == "REPLACE_SPECIAL" else name.lower()


def _priced_rho(comp: Composition, relation: Any) -> float | None:
    """:func:`_rho_total` of a composition of user events under ``relation`` (None also when
    the relation refuses an atom: the full pricing then says why)."""
    if _rho_total(comp) is None:
        return None
    _check_relation(comp, relation)
    return _rho_total(rules.priced(comp, relation)[0])


def _rho_total(comp: Composition) -> float | None:
    total = 0.0
    for atom, n in comp.atoms:
        r = gaussian_rho(atom)
        if r is None:
            return None
        total += n * r
    return total


def _pure_terms(comp: Composition) -> list[tuple[float, int]] | None:
    terms = []
    for atom, n in comp.atoms:
        e = pure_epsilon(atom)
        if e is None:
            return None
        terms.append((e, n))
    return terms


def _unsampled_rho(comp: Composition) -> float | None:
    """rho of the same Gaussian composition with every sampling rate set to 1, or None.

    Poisson subsampling is a garbling of the unsampled mechanism (keep the output with
    probability q, else replace it by a fresh draw of the null distribution), so the exact
    epsilon of the unsampled composition bounds the subsampled one too: it keeps AUTO monotone
    in q up to q = 1."""
    total = 0.0
    for atom, n in comp.atoms:
        a = rules.fft_atom(atom)
        if not isinstance(a, GaussianAtom):
            return None
        z = a.noise_multiplier
        total += n * (0.5 / z / z)
    return total


def _fft_atoms(comp: Composition) -> list[tuple[Any, int]] | None:
    out = []
    for atom, n in comp.atoms:
        a = rules.fft_atom(atom)
        if a is None:
            return None
        out.append((a, n))
    return out


def _check_relation(comp: Composition, relation: Any) -> None:
    for atom, _ in comp.atoms:
        why = rules.relation_error(atom, relation)
        if why is not None:
            raise UnsupportedEventError(why)


def unsupported(comp: Composition, method: Method, relation: Any) -> str | None:
    """Why ``method`` cannot price ``comp`` under ``relation``, from the event types alone
    (nothing is priced: an event whose parameters are too extreme for the method is found
    only when it is priced); None if it can.
    """
    for atom, _ in comp.atoms:
        why = rules.relation_error(atom, relation)
        if why is not None:
            return why
    if comp.non_private or comp.empty:
        return None
    try:
        comp, relation = rules.priced(comp, relation)
    except UnsupportedEventError as exc:
        return str(exc)
    rho, pure_ok, fft = (_rho_total(comp) is not None, _pure_terms(comp) is not None,
                         _fft_atoms(comp) is not None)
    if method in (Method.EXACT, Method.MOMENTS):
        ok = rho
    elif method in (Method.OPTIMAL, Method.ADVANCED, Method.BASIC):
        ok = pure_ok
    elif method is Method.PLD_FFT:
        ok = fft
    elif method is Method.RDP:
        ok = all(_has_rdp(a, relation) for a, _ in comp.atoms)
    elif method is Method.PLD:
        ok = all(_has_pld(a) for a, _ in comp.atoms)
    else:  # AUTO: any of its candidates
        ok = rho or pure_ok or fft or all(_has_rdp(a, relation) for a, _ in comp.atoms) \
            or all(_has_pld(a) for a, _ in comp.atoms)
    return None if ok else f"method {method.value!r} has no rule for this event"


def _has_rdp(atom: Any, relation: Any) -> bool:
    if rules.rdp_curve.dispatch(type(atom)) is not rules.rdp_curve.dispatch(object):
        return True
    from dp_accounting.rdp import rdp_privacy_accountant

    return bool(rdp_privacy_accountant.RdpAccountant([2.0], relation).supports(atom))


def _has_pld(atom: Any) -> bool:
    if isinstance(atom, dp_event.PoissonSampledDpEvent):
        return isinstance(atom.event, (dp_event.GaussianDpEvent, dp_event.LaplaceDpEvent))
    return rules.pld_of.dispatch(type(atom)) is not rules.pld_of.dispatch(object)


def _rdp_total(comp: Composition, relation: Any) -> np.ndarray:
    total = np.zeros_like(rdp.ORDERS)
    for atom, n in comp.atoms:
        total = total + n * atom_rdp(atom, relation)
    return total


@functools.lru_cache(maxsize=4096)
def atom_rdp(atom: dp_event.DpEvent, relation: Any) -> np.ndarray:
    """RDP of one use of ``atom`` at :data:`rdp.ORDERS` (read-only; cached per atom and
    relation, since dp-accounting's series for a subsampled Gaussian take tens of ms).

    Raises:
        UnsupportedEventError: no RDP rule for the atom.
    """
    curve = np.array(rdp_curve(atom, rdp.ORDERS, relation), dtype=np.float64)
    curve.flags.writeable = False
    return curve


def _assumptions(comp: Composition, relation: Any) -> tuple[str, ...]:
    out = [f"neighbouring relation: {relation_label(relation.name)}"]
    if any(isinstance(a, dp_event.PoissonSampledDpEvent) for a, _ in comp.atoms):
        out.append("Poisson subsampling whose outcome stays secret (amplification used)")
    if any(only_known_as_pure(a) for a, _ in comp.atoms):
        out.append("each pure step is epsilon-DP (dominated by randomized response)")
    for atom, _ in comp.atoms:
        out.extend(n for n in rules.notes(atom) if n not in out)
    return tuple(out)


def _optimal_label(terms: list[tuple[float, int]]) -> str:
    return "optimal"


def _check_result(value: float, what: str) -> float:
    if math.isnan(value) or value < 0:
        raise NumericalError(f"{what} came out as {value}; refusing to report it")
    return value


def _need(value: Any, method: Method, kind: str) -> Any:
    if value is None:
        raise UnsupportedEventError(f"method {method.value!r} prices {kind} only")
    return value


# ------------------------------------------------------------- per method
def _epsilon_by(comp: Composition, d: float, method: Method, relation: Any) -> tuple[float, str]:
    if method is Method.EXACT:
        rho = _need(_rho_total(comp), method, "non-subsampled Gaussian events")
        return float(gaussian.exact_epsilon(math.sqrt(2 * rho), d)), "exact"
    if method is Method.MOMENTS:
        rho = _need(_rho_total(comp), method, "non-subsampled Gaussian events")
        return float(gaussian.moments_epsilon(rho, d)), "moments (Upcycled-FL Thm C.1 closed form)"
    if method in (Method.OPTIMAL, Method.ADVANCED, Method.BASIC):
        terms = _need(_pure_terms(comp), method, "pure-DP events")
        if method is Method.BASIC:
            return pure.basic_epsilon(terms), "basic"
        if method is Method.ADVANCED:
            return pure.advanced_epsilon(terms, d), "advanced"
        return pure.optimal_epsilon(terms, d), _optimal_label(terms)
    if method is Method.RDP:
        rho = _rho_total(comp)
        if rho is not None:
            return rdp.gaussian_rdp_epsilon(rho, d)[0], "rdp"
        return rdp.epsilon_from_rdp(rdp.ORDERS, _rdp_total(comp, relation), d)[0], "rdp"
    if method is Method.PLD:
        return pld_acc.epsilon(comp, d, pld_acc.VALUE_DISCRETIZATION, relation), "pld"
    if method is Method.PLD_FFT:
        atoms = _need(_fft_atoms(comp), method,
                      "Gaussian, Poisson-subsampled Gaussian and pure-DP events")
        return _fft_epsilon(comp, atoms, d, relation)
    raise AssertionError(method)


def _fft_epsilon(comp: Composition, atoms: list[tuple[Any, int]], d: float,
                 relation: Any) -> tuple[float, str]:
    # The grid is planned from fftpld's own closed-form estimate (not from RDP), so that the
    # same event always gets the same grid: calibration solves on exactly this function.
    e, h = fftpld.epsilon(atoms, d, relation.name)
    return e, f"pld-fft (privkit, interval {h:.2g})"


def _auto_epsilon(comp: Composition, d: float, relation: Any) -> tuple[float, str]:
    """The smallest of the valid upper bounds AUTO can compute (see :class:`Method`).

    Non-subsampled Gaussians: exact. Otherwise the candidates are optimal pure composition
    (pure steps), the exact value with every sampling rate set to 1 (Gaussian families), and
    privkit's PLD (Gaussian family and pure steps, any mix; its grid is capped at
    :data:`privkit.accountants.fftpld.MAX_POINTS`, which bounds its time). RDP is computed
    when privkit's PLD cannot price the event: privkit's PLD is within ~1e-5 of the exact
    curve, so RDP (an upper bound on the same curve) cannot beat it. Events privkit's PLD does
    not know also get dp-accounting's PLD (skipped when the cheap bounds are above
    :data:`AUTO_PLD_MAX_EPSILON`, where it takes minutes). A method that fails is left out and
    named in the label of the one that wins if nothing tighter ran.
    """
    if _rho_total(comp) is not None:
        return _epsilon_by(comp, d, Method.EXACT, relation)
    candidates: list[tuple[float, str]] = []
    notes: list[str] = []
    terms = _pure_terms(comp)
    if terms is not None:
        candidates.append((pure.optimal_epsilon(terms, d), _optimal_label(terms)))
        if all(only_known_as_pure(a) for a, _ in comp.atoms):
            # the dominating pair itself (KOV exact, or privkit's PLD of it): nothing is tighter
            return candidates[0]
    rho1 = _unsampled_rho(comp)
    if rho1 is not None:
        candidates.append((float(gaussian.exact_epsilon(math.sqrt(2 * rho1), d)),
                           "exact (sampling rates set to 1: subsampling can only help)"))
    atoms = _fft_atoms(comp)
    fft_ok = False
    if atoms is not None:
        try:
            candidates.append(_fft_epsilon(comp, atoms, d, relation))
            fft_ok = True
        except UnsupportedEventError as exc:
            notes.append(f"pld-fft unavailable: {exc}")
    if not fft_ok:
        try:
            candidates.append(_epsilon_by(comp, d, Method.RDP, relation))
        except (UnsupportedEventError, NumericalError) as exc:
            notes.append(f"rdp unavailable: {exc}")
    estimate = min((c[0] for c in candidates), default=math.nan)
    if atoms is not None:
        pass
    elif d < pld_acc.MIN_DELTA:
        notes.append(f"pld skipped: delta < {pld_acc.MIN_DELTA:g}")
    elif math.isfinite(estimate) and estimate > AUTO_PLD_MAX_EPSILON:
        notes.append(f"pld skipped: epsilon > {AUTO_PLD_MAX_EPSILON:g}")
    else:
        try:
            e, vdi = pld_acc.auto_epsilon(comp, d, relation)
            if math.isfinite(e):
                candidates.append((e, f"pld (interval {vdi:g})"))
            else:
                notes.append("pld gave inf (tail truncation)")
        except (UnsupportedEventError, InvalidParameterError) as exc:
            notes.append(f"pld unavailable: {exc}")
    if not candidates:
        raise UnsupportedEventError("no accounting method supports this event: " + "; ".join(notes))
    best = min(candidates, key=lambda c: c[0])
    if best[1] == "rdp" and notes:
        best = (best[0], f"rdp (fallback: {'; '.join(notes)})")
    return best


def _delta_by(comp: Composition, e: float, method: Method, relation: Any) -> tuple[float, str]:
    if method is Method.EXACT:
        rho = _need(_rho_total(comp), method, "non-subsampled Gaussian events")
        return float(gaussian.exact_delta(math.sqrt(2 * rho), e)), "exact"
    if method is Method.MOMENTS:
        rho = _need(_rho_total(comp), method, "non-subsampled Gaussian events")
        return float(gaussian.moments_delta(rho, e)), "moments (Upcycled-FL Thm C.1 closed form)"
    if method in (Method.OPTIMAL, Method.ADVANCED, Method.BASIC):
        terms = _need(_pure_terms(comp), method, "pure-DP events")
        if method is Method.BASIC:
            return (0.0 if e >= pure.basic_epsilon(terms) else 1.0), "basic"
        if method is Method.ADVANCED:
            return pure.advanced_delta(terms, e), "advanced"
        return pure.optimal_delta(terms, e), _optimal_label(terms)
    if method is Method.RDP:
        rho = _rho_total(comp)
        curve = rdp.ORDERS * rho if rho is not None else _rdp_total(comp, relation)
        return rdp.delta_from_rdp(rdp.ORDERS, curve, e)[0], "rdp"
    if method is Method.PLD:
        return pld_acc.delta(comp, e, pld_acc.VALUE_DISCRETIZATION, relation), "pld"
    if method is Method.PLD_FFT:
        atoms = _need(_fft_atoms(comp), method,
                      "Gaussian, Poisson-subsampled Gaussian and pure-DP events")
        return _fft_delta(comp, atoms, e, relation, None), "pld-fft (privkit)"
    raise AssertionError(method)


def _fft_delta(comp: Composition, atoms: list[tuple[Any, int]], e: float, relation: Any,
               delta_estimate: float | None) -> float:
    if delta_estimate is None:
        try:
            delta_estimate = _delta_by(comp, e, Method.RDP, relation)[0]
        except (UnsupportedEventError, NumericalError):
            delta_estimate = 1.0
    return fftpld.delta(atoms, e, relation.name, e, delta_estimate)


def _auto_delta(comp: Composition, e: float, relation: Any) -> tuple[float, str]:
    """The smallest of the valid upper bounds on delta (as :func:`_auto_epsilon`)."""
    if _rho_total(comp) is not None:
        return _delta_by(comp, e, Method.EXACT, relation)
    candidates = []
    for m in (Method.OPTIMAL, Method.RDP):
        try:
            candidates.append(_delta_by(comp, e, m, relation))
        except (UnsupportedEventError, NumericalError):
            pass
    rho1 = _unsampled_rho(comp)
    if rho1 is not None:
        candidates.append((float(gaussian.exact_delta(math.sqrt(2 * rho1), e)),
                           "exact (sampling rates set to 1: subsampling can only help)"))
    terms = _pure_terms(comp)
    if terms is not None and all(only_known_as_pure(a) for a, _ in comp.atoms):
        return candidates[0]
    atoms = _fft_atoms(comp)
    estimate = min((c[0] for c in candidates), default=1.0)
    if atoms is not None:
        try:
            candidates.append((_fft_delta(comp, atoms, e, relation, estimate),
                               "pld-fft (privkit)"))
        except UnsupportedEventError:
            pass
    elif e <= AUTO_PLD_MAX_EPSILON:
        try:
            dd = pld_acc.delta(comp, e, pld_acc.VALUE_DISCRETIZATION, relation)
            candidates.append((dd, "pld"))
        except UnsupportedEventError:
            pass
    if not candidates:
        raise UnsupportedEventError("no accounting method supports this event")
    return min(candidates, key=lambda c: c[0])


def auto_prefers_pld(comp: Composition, d: float) -> bool:
    """Whether ``AUTO`` prices ``comp`` with a PLD (subsampled or mixed events)."""
    if comp.non_private or comp.empty or _rho_total(comp) is not None:
        return False
    if all(only_known_as_pure(a) for a, _ in comp.atoms):
        return len(comp.atoms) > 1
    return _fft_atoms(comp) is not None or d >= pld_acc.MIN_DELTA


# ------------------------------------------------------------ public API
def _price_epsilon(comp: Composition, d: float, method: Method, relation: Any) -> EpsilonReport:
    """The report for a composition of user events (re-expressed against the relation's
    sensitivity here, once: :func:`privkit.accountants.rules.priced`)."""
    if comp.non_private:
        return EpsilonReport(math.inf, d, "non-private (noise 0 or NonPrivateDpEvent)",
                             _assumptions(comp, relation), relation.name)
    if comp.empty:
        return EpsilonReport(0.0, d, "none (no events)", (), None)
    _check_relation(comp, relation)
    e, name = _priced_epsilon(*rules.priced(comp, relation), d, method)
    return EpsilonReport(_check_result(e, "epsilon"), d, name, _assumptions(comp, relation),
                         relation.name)


def _priced_epsilon(comp: Composition, relation: Any, d: float, method: Method
                    ) -> tuple[float, str]:
    """Epsilon of a composition already re-expressed against ``relation``'s sensitivity."""
    if method is Method.AUTO:
        return _auto_epsilon(comp, d, relation)
    return _epsilon_by(comp, d, method, relation)


def epsilon(
    event: dp_event.DpEvent,
    delta: float,
    method: Method | str = Method.AUTO,
    *,
    neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE,
) -> EpsilonReport:
    """Upper bound on epsilon at ``delta`` for ``event`` (any composition of events).

    Args:
        event: a dp-accounting ``DpEvent`` or a privkit event, possibly composed.
        delta: target delta in (0, 1).
        method: a :class:`Method` (or its name); ``AUTO`` picks the tightest.
        neighboring_relation: dp-accounting's relation (or its name, e.g. ``"REPLACE_ONE"``,
            ``"replace-one"``): the relation the event's sensitivity is for (a mechanism's
            ``neighboring_relation``, e.g. ``GaussianOutputPerturbation``'s ``REPLACE_ONE``);
            the report names it. It changes the number for sampled events only.

    Returns:
        The report: ``epsilon``, the ``delta`` asked for, the method that priced it and the
        assumptions.

    Raises:
        InvalidParameterError: bad delta or bad event parameters (names the field).
        UnsupportedEventError: ``method`` cannot price this event.

    Example:
        >>> from privkit.events import GaussianDpEvent
        >>> round(epsilon(GaussianDpEvent(1.0), 1e-5).epsilon, 4)
        4.3772
    """
    d = _validate.delta("delta", delta)
    m = Method.parse(method)
    rel = _relation(neighboring_relation)
    return _price_epsilon(flatten(event), d, m, rel)


def delta(
    event: dp_event.DpEvent,
    epsilon: float,
    method: Method | str = Method.AUTO,
    *,
    neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE,
) -> EpsilonReport:
    """Upper bound on delta at ``epsilon`` for ``event`` (the inverse question of
    :func:`epsilon`).

    Args:
        event: a dp-accounting ``DpEvent`` or a privkit event, possibly composed.
        epsilon: the epsilon, >= 0 (``inf`` gives delta 0).
        method: a :class:`Method` (or its name); ``AUTO`` picks the tightest.
        neighboring_relation: the relation the event's sensitivity is for (or its name), as
            in :func:`epsilon`.

    Returns:
        The report: the ``epsilon`` asked for, the ``delta`` upper bound at it (at most 1),
        the method and the assumptions.

    Raises:
        InvalidParameterError: bad epsilon or bad event parameters (names the field).
        UnsupportedEventError: ``method`` cannot price this event.
        NumericalError: the computed delta is not a probability (never reported).

    Example:
        >>> from privkit.events import GaussianDpEvent
        >>> delta(GaussianDpEvent(1.0), 4.3772).delta < 1e-5
        True
    """
    e = _validate.nonnegative_or_inf("epsilon", epsilon)
    return _price_delta(flatten(event), e, Method.parse(method), _relation(neighboring_relation))


def _price_delta(comp: Composition, e: float, m: Method, rel: Any) -> EpsilonReport:
    if comp.non_private:
        return EpsilonReport(e, 1.0, "non-private (noise 0 or NonPrivateDpEvent)",
                             _assumptions(comp, rel), rel.name)
    if comp.empty or math.isinf(e):
        return EpsilonReport(e, 0.0, "none (no events)" if comp.empty else "epsilon = inf",
                             _assumptions(comp, rel), None if comp.empty else rel.name)
    _check_relation(comp, rel)
    pc, prel = rules.priced(comp, rel)
    d, name = _auto_delta(pc, e, prel) if m is Method.AUTO else _delta_by(pc, e, m, prel)
    if math.isnan(d) or d < 0 or d > 1 + 1e-12:
        raise NumericalError(f"delta came out as {d}; refusing to report it")
    return EpsilonReport(e, min(d, 1.0), name, _assumptions(comp, rel), rel.name)


def epsilon_batch(
    events: Sequence[dp_event.DpEvent],
    delta: float,
    method: Method | str = Method.AUTO,
    *,
    neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE,
) -> np.ndarray:
    """Epsilons of many events at once (e.g. one composed event per client).

    Identical compositions are priced once; when every composition is a
    non-subsampled Gaussian composition and the method is AUTO or EXACT, all are
    priced in one vectorised exact computation (10^4 clients in tens of ms).
    """
    d = _validate.delta("delta", delta)
    m = Method.parse(method)
    rel = _relation(neighboring_relation)
    comps = [flatten(ev) for ev in events]
    return epsilon_batch_compositions(comps, d, m, rel)


def epsilon_batch_compositions(
    comps: Sequence[Composition], d: float, m: Method, rel: Any
) -> np.ndarray:
    """As :func:`epsilon_batch`, on already-flattened compositions (of user events: each is
    re-expressed against the relation's sensitivity here)."""
    out = np.empty(len(comps))
    unique: dict[Composition, list[int]] = {}
    for i, c in enumerate(comps):
        unique.setdefault(c, []).append(i)
    keys = list(unique)
    if m in (Method.AUTO, Method.EXACT):
        rhos = [None if c.non_private or c.empty else _priced_rho(c, rel) for c in keys]
        gauss = [i for i, r in enumerate(rhos) if r is not None]
        if gauss:
            mus = np.sqrt(2 * np.array([rhos[i] for i in gauss]))
            eps = np.atleast_1d(gaussian.exact_epsilon(mus, d))
            for i, e in zip(gauss, eps):
                out[unique[keys[i]]] = e
        rest = [k for i, k in enumerate(keys) if rhos[i] is None]
    else:
        rest = keys
    for k in rest:
        out[unique[k]] = _price_epsilon(k, d, m, rel).epsilon
    if np.isnan(out).any() or (out < 0).any():
        raise NumericalError("a batch epsilon came out NaN or negative")
    return out


class Accountant:
    """A running composition (like dp-accounting's ``PrivacyAccountant``).

    Example:
        >>> from privkit.events import GaussianDpEvent
        >>> acc = Accountant()
        >>> acc.compose(GaussianDpEvent(1.0), count=100)
        >>> round(acc.get_epsilon(1e-5), 4)
        91.8173
    """

    def __init__(
        self,
        method: Method | str = Method.AUTO,
        *,
        neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE,
    ) -> None:
        self.method = Method.parse(method)
        self.neighboring_relation = _relation(neighboring_relation)
        self._comp = Composition(())

    @property
    def composition(self) -> Composition:
        return self._comp

    def compose(self, event: dp_event.DpEvent, count: int = 1) -> None:
        """Add ``count`` uses of ``event`` (validated before anything changes)."""
        self._comp = self._comp + flatten(event, count)

    def report(self, delta: float) -> EpsilonReport:
        d = _validate.delta("delta", delta)
        return _price_epsilon(self._comp, d, self.method, self.neighboring_relation)

    def get_epsilon(self, delta: float) -> float:
        return self.report(delta).epsilon

    def get_delta(self, epsilon: float) -> float:
        e = _validate.nonnegative_or_inf("epsilon", epsilon)
        return _price_delta(self._comp, e, self.method, self.neighboring_relation).delta
