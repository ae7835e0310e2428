"""How each accounting method prices a flattened composition, and how ``AUTO`` picks.

:mod:`privkit.accountants.accountant` holds the user's side (``epsilon``, ``delta``, the batch
functions, :class:`~privkit.accountants.accountant.Accountant` and the report); this module
holds what they dispatch to, apart because it is the part that grows with every method: the
:class:`Method` enum, the readers that say whether a composition is a non-subsampled Gaussian,
pure steps or what privkit's PLD prices, each method's epsilon and delta, and ``AUTO``'s choice
among the valid upper bounds. Every function here takes a composition already re-expressed
against the relation's sensitivity (:func:`privkit.accountants.rules.priced`), except
:func:`unsupported` and :func:`_priced_rho`, which take one of user events.
"""

from __future__ import annotations

import enum
import functools
import math
from typing import Any

import numpy as np

from privkit._dpa import dp_event
from privkit._lazy import LazyModule
from privkit.accountants import gaussian, rdp, rules
from privkit.accountants._atoms import GaussianAtom
from privkit.accountants.rules import (
    Composition,
    gaussian_rho,
    only_known_as_pure,
    pure_epsilon,
    rdp_curve,
)
from privkit.errors import InvalidParameterError, NumericalError, UnsupportedEventError

# Loaded on first use (privkit's start-up): the PLDs and pure composition.
fftpld: Any = LazyModule("privkit.accountants.fftpld")
pure: Any = LazyModule("privkit.accountants.pure")
pld_acc: Any = LazyModule("privkit.accountants.pld")

__all__ = ["Method", "AUTO_PLD_MAX_EPSILON", "auto_prefers_pld", "unsupported", "atom_rdp"]


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


# ------------------------------------------------------ what a composition is
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
        if isinstance(a, GaussianAtom):
            z = a.noise_multiplier
            total += n * (0.5 / z / z)
            continue
        u = rules.unsampled(atom)
        r = None if u is None else gaussian_rho(u)
        if r is None:
            return None
        total += n * r
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


def _optimal_label(terms: list[tuple[float, int]]) -> str:
    return "optimal"


_MOMENTS_LABEL = "moments (Upcycled-FL Thm C.1 closed form)"


def _required(comp: Composition, method: Method) -> Any:
    """What a method that prices one kind of composition prices it from (rho for exact and
    moments, privkit's PLD atoms for pld-fft, the pure terms for the pure compositions);
    refused, naming that kind, when ``comp`` is not of it."""
    value: Any
    if method in (Method.EXACT, Method.MOMENTS):
        value, kind = _rho_total(comp), "non-subsampled Gaussian events"
    elif method is Method.PLD_FFT:
        value, kind = (_fft_atoms(comp),
                       "Gaussian, Poisson-subsampled Gaussian and pure-DP events")
    else:
        value, kind = _pure_terms(comp), "pure-DP events"
    if value is None:
        raise UnsupportedEventError(f"method {method.value!r} prices {kind} only")
    return value


# ------------------------------------------------------------- per method
def _epsilon_by(comp: Composition, d: float, method: Method, relation: Any) -> tuple[float, str]:
    if method is Method.EXACT:
        return float(gaussian.exact_epsilon(math.sqrt(2 * _required(comp, method)), d)), "exact"
    if method is Method.MOMENTS:
        return float(gaussian.moments_epsilon(_required(comp, method), d)), _MOMENTS_LABEL
    if method in (Method.OPTIMAL, Method.ADVANCED, Method.BASIC):
        terms = _required(comp, method)
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
        return _fft_epsilon(comp, _required(comp, method), d, relation)
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
        return float(gaussian.exact_delta(math.sqrt(2 * _required(comp, method)), e)), "exact"
    if method is Method.MOMENTS:
        return float(gaussian.moments_delta(_required(comp, method), e)), _MOMENTS_LABEL
    if method in (Method.OPTIMAL, Method.ADVANCED, Method.BASIC):
        terms = _required(comp, method)
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
        return _fft_delta(comp, _required(comp, method), e, relation, None), "pld-fft (privkit)"
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


#: The share of delta set aside for :func:`privkit.accountants.rules.delta_slack`.
SLACK_SHARE = 1e-9


def _priced_epsilon(comp: Composition, relation: Any, d: float, method: Method
                    ) -> tuple[float, str]:
    """Epsilon of a composition already re-expressed against ``relation``'s sensitivity.

    With a total-variation slack ``t`` (:func:`privkit.accountants.rules.slack_total`) the
    methods price ``d (1 - SLACK_SHARE)`` and the answer must leave room for
    ``(1 + e^epsilon) t <= d SLACK_SHARE``; where it does not (a large epsilon) the composition
    is priced again with every atom as it is (:func:`~privkit.accountants.rules.
    without_nearby_laws`)."""
    slack = rules.slack_total(comp)
    if slack == 0:
        return _epsilon_plain(comp, relation, d, method)
    e, name = _epsilon_plain(comp, relation, d * (1.0 - SLACK_SHARE), method)
    if e < 700 and (1.0 + math.exp(e)) * slack <= d * SLACK_SHARE:
        return e, name
    with rules.without_nearby_laws():
        return _epsilon_plain(comp, relation, d, method)


def _epsilon_plain(comp: Composition, relation: Any, d: float, method: Method
                   ) -> tuple[float, str]:
    if method is Method.AUTO:
        return _auto_epsilon(comp, d, relation)
    return _epsilon_by(comp, d, method, relation)


def _delta_plain(comp: Composition, relation: Any, e: float, method: Method
                 ) -> tuple[float, str]:
    if method is Method.AUTO:
        return _auto_delta(comp, e, relation)
    return _delta_by(comp, e, method, relation)


def _priced_delta(comp: Composition, relation: Any, e: float, method: Method
                  ) -> tuple[float, str]:
    """Delta of a composition already re-expressed against ``relation``'s sensitivity: with a
    total-variation slack ``t``, the smaller of the nearby law's delta plus
    ``(1 + e^epsilon) t`` and the delta with every atom priced as it is."""
    slack = rules.slack_total(comp)
    d, name = _delta_plain(comp, relation, e, method)
    if slack == 0:
        return d, name
    d = d + (1.0 + math.exp(e)) * slack if e < 700 else math.inf
    with rules.without_nearby_laws():
        try:
            d2, name2 = _delta_plain(comp, relation, e, method)
        except (UnsupportedEventError, NumericalError):
            return d, name
    return (d, name) if d <= d2 else (d2, name2)
