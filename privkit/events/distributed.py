"""The event of distributed DP with secure aggregation, and the bounds it is built from.

Plain data and closed-form bounds, no pricing: :class:`SkellamDpEvent` is priced by the rules
in :mod:`privkit.accountants.distributed`, and emitted by
:class:`privkit.mechanisms.DistributedSkellam`. The two bounds below are shared by the
mechanism (which enforces them) and the accountant (which prices them), so that both use the
same integer.

* :func:`rounded_norm_bound_sq` - the squared L2 norm a client's rounded, scaled update may
  have: ``T = floor(min((c + sqrt(d))^2, c^2 + d/4 + sqrt(2 ln(1/beta)) (c + sqrt(d)/2)))``
  for a vector of norm at most ``c`` in ``d`` coordinates (Kairouz, Liu & Steinke, ICML 2021,
  "The Distributed Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation",
  the randomized-rounding norm bound of their Section 4.1: unconditional randomized rounding
  exceeds the second term with probability at most ``beta``). The first term holds always
  (every coordinate moves by less than 1). The mechanism rounds *conditionally*: it redraws
  the rounding until the integer vector's squared norm is at most ``T`` (and falls back to
  rounding towards zero, whose norm is at most the input's), so ``T`` holds with probability
  one and adds nothing to delta.
* :func:`skellam_sensitivities` - the L2 and L1 sensitivities of one rounded contribution:
  ``Delta_2 = sqrt(T)`` and, the vector being integer (``|v_i| <= v_i^2``),
  ``Delta_1 = min(T, floor(sqrt(d T)))`` (Agarwal, Kairouz & Liu, NeurIPS 2021, the bound
  ``Delta_1 <= min(Delta_2^2, sqrt(d) Delta_2)`` of their Section 4).

Examples:
    >>> t = rounded_norm_bound_sq(100.0, 64, 0.5)
    >>> t, skellam_sensitivities(t, 64)
    (10138, (100.68763578513504, 805.0))
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attr

from privkit import _validate
from privkit._dpa import dp_event
from privkit.errors import InvalidParameterError
from privkit.events._core import register_event_module
from privkit.events.mechanisms import NeighboringRelation, as_relation

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent
else:
    DpEvent = dp_event.DpEvent

__all__ = [
    "SkellamDpEvent",
    "DISTRIBUTED_TRUST_ASSUMPTION",
    "MAX_NORM_BOUND_SQ",
    "MAX_NOISE_PER_CLIENT",
    "MAX_BITS",
    "padded_dimension",
    "rounded_norm_bound_sq",
    "skellam_sensitivities",
    "check_bits",
    "honest_shares",
    "skellam_relation",
    "skellam_relation_error",
]

#: Largest squared norm bound allowed: the mechanism sums the squares of a rounded vector in
#: int64, exactly (and each coordinate is below 2^31).
MAX_NORM_BOUND_SQ = 1 << 62
#: Largest Skellam variance per client (each Poisson mean <= 2^50: numpy's sampler and int64
#: sums stay exact).
MAX_NOISE_PER_CLIENT = float(1 << 51)
#: Largest modulus exponent: the encoded values and every partial sum fit int64 / uint64.
MAX_BITS = 62

#: What distributed DP assumes (every report that prices a :class:`SkellamDpEvent` states it).
DISTRIBUTED_TRUST_ASSUMPTION = (
    "distributed DP: an honest-but-curious server that follows the protocol; secure aggregation "
    "shows it only the modular sum of the masked inputs; every honest client clips, rounds and "
    "adds its own Skellam noise share from randomness nobody else sees; at least `survivors` "
    "honest clients' shares are in every released sum (rounds with fewer survivors are not "
    "released; clients that may collude with the server are not counted, as they can subtract "
    "their shares); dropouts and the public rotation seed do not depend on the updates")

register_event_module(__name__)


def padded_dimension(dim: int) -> int:
    """The smallest power of two >= ``dim``: the length a randomized Hadamard rotation needs.

    Example:
        >>> padded_dimension(1000), padded_dimension(1024), padded_dimension(1)
        (1024, 1024, 1)
    """
    d = _validate.positive_int("dim", dim)
    return 1 << (d - 1).bit_length()


def check_bits(bits: Any) -> int:
    """``bits``, the exponent of the secure aggregation modulus ``2^bits``, checked: an
    integer in [2, :data:`MAX_BITS`] (what the mechanism and the calibration accept)."""
    b = _validate.positive_int("bits", bits)
    if not 2 <= b <= MAX_BITS:
        raise InvalidParameterError("bits", bits, f"an integer in [2, {MAX_BITS}]")
    return b


def honest_shares(min_survivors: Any, colluders: Any) -> int:
    """The noise shares every released sum is guaranteed, ``min_survivors - colluders``, with
    both checked (``min_survivors >= 1``, ``0 <= colluders < min_survivors``).

    Example:
        >>> honest_shares(50, 5)
        45
    """
    n = _validate.positive_int("min_survivors", min_survivors)
    k = _validate.nonnegative_int("colluders", colluders)
    if k >= n:
        raise InvalidParameterError("colluders", colluders,
                                    f"< min_survivors = {n} (at least one honest share)")
    return n - k


def skellam_relation_error(relation: Any) -> str | None:
    """Why a :class:`SkellamDpEvent` cannot be priced under ``relation`` (add/remove), or
    None (zero-out and replace-one)."""
    if relation == NeighboringRelation.ADD_OR_REMOVE_ONE:
        return ("SkellamDpEvent is not priced under ADD_OR_REMOVE_ONE: a client added or "
                "removed adds or removes its noise share too, so the neighbouring sums differ "
                "in their noise, not only by a shift; price it under zero-out "
                "(neighboring_relation='zero-out', the client keeps its place and its noise "
                "share, its update becomes zero) or REPLACE_ONE")
    return None


def skellam_relation(value: Any) -> Any:
    """The neighbouring relation a distributed Skellam run is stated under: ``value`` (a
    relation or its name; None: zero-out, ``REPLACE_SPECIAL``), refused under add/remove.

    Raises:
        InvalidParameterError: add/remove, or a name that is no relation (named
            ``neighboring_relation``).
    """
    rel = NeighboringRelation.REPLACE_SPECIAL if value is None else as_relation(value)
    why = skellam_relation_error(rel)
    if why is not None:
        raise InvalidParameterError("neighboring_relation", rel.name,
                                    "zero-out (REPLACE_SPECIAL) or REPLACE_ONE: " + why)
    return rel


def _beta(value: float) -> float:
    b = _validate.real("beta", value)
    if not 0.0 <= b < 1.0:
        raise InvalidParameterError("beta", value, "in [0, 1)")
    return b


def rounded_norm_bound_sq(scaled_clip: float, dim: int, beta: float) -> int:
    """The integer T that a conditionally rounded vector's squared L2 norm never exceeds.

    Args:
        scaled_clip: c, the L2 bound on the vector before rounding (the clip norm divided by
            the granularity), finite and > 0.
        dim: d, the number of coordinates rounded (the padded dimension), an integer >= 1.
        beta: the rounding's failure probability in [0, 1); 0 uses only the bound that holds
            deterministically, ``(c + sqrt(d))^2``.

    Returns:
        ``T = floor(min((c + sqrt(d))^2, c^2 + d/4 + sqrt(2 ln(1/beta)) (c + sqrt(d)/2)))``.

    Raises:
        InvalidParameterError: a bad argument, or T >= 2^62 (the norms would not be exact in
            int64; use a coarser granularity).

    Example:
        >>> rounded_norm_bound_sq(10.0, 4, 0.0)   # (10 + 2)^2
        144
    """
    c = _validate.positive("scaled_clip", scaled_clip)
    d = _validate.positive_int("dim", dim)
    b = _beta(beta)
    root_d = math.sqrt(d)
    value = (c + root_d) ** 2
    if b > 0:
        value = min(value, c * c + d / 4.0 + math.sqrt(2.0 * math.log(1.0 / b)) * (c + root_d / 2))
    if not value < MAX_NORM_BOUND_SQ:
        raise InvalidParameterError("scaled_clip", scaled_clip,
                                    f"such that the rounded norm bound is < 2^62 (dim {d})")
    return int(math.floor(value))


def _up(x: float) -> float:
    return math.nextafter(x, math.inf)


def skellam_sensitivities(norm_bound_sq: int, dim: int) -> tuple[float, float]:
    """(Delta_2, Delta_1) of an integer vector in ``dim`` coordinates with squared norm <= T.

    ``Delta_2`` is ``sqrt(T)`` rounded up (two float64 steps above the computed root, so it is
    never below the true root); ``Delta_1 = min(T, floor(sqrt(dim * T)))`` is an integer,
    returned as the float64 at or above it (exact below 2^53).

    Example:
        >>> skellam_sensitivities(4, 1000)
        (2.000000000000001, 4.0)
    """
    t = _validate.positive_int("norm_bound_sq", norm_bound_sq)
    d = _validate.positive_int("dim", dim)
    if t >= MAX_NORM_BOUND_SQ:
        raise InvalidParameterError("norm_bound_sq", t, "< 2^62")
    l1 = min(t, math.isqrt(d * t))
    f1 = float(l1)
    return _up(_up(math.sqrt(t))), f1 if int(f1) >= l1 else _up(f1)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class SkellamDpEvent(DpEvent):
    """One release of a securely aggregated sum, each client adding a Skellam noise share.

    Every honest client that takes part adds i.i.d. ``Skellam(noise_per_client)`` noise
    (``Poisson(mu/2) - Poisson(mu/2)``, variance ``mu``, in integer units) to its rounded
    update, and the server learns only the sum (modulo ``2^bits``, a post-processing). A sum of
    independent Skellam variables is Skellam, so a released sum carries
    ``Skellam(survivors * noise_per_client)`` noise at least: ``survivors`` is the number of
    honest clients whose shares every released sum is guaranteed to contain (surviving clients
    minus those that may collude with the server; a colluder can subtract its own share).

    Meaning under each relation (a client's contribution is its rounded, scaled update, an
    integer vector of L2 norm <= ``l2_sensitivity`` and L1 norm <= ``l1_sensitivity``):

    * zero-out (``REPLACE_SPECIAL``): one client's update replaced by the zero update, the client
      keeping its place in the protocol and its noise share: the sum moves by one contribution,
      ``(Delta_1, Delta_2)`` as stated. Priced with Agarwal, Kairouz & Liu's Skellam RDP.
    * replace-one (``REPLACE_ONE``): one client's update replaced by any other: the sum moves by
      a difference of two contributions, ``(2 Delta_1, 2 Delta_2)``; the accountant doubles them.
    * add/remove (``ADD_OR_REMOVE_ONE``): **refused**. A client that is added or removed adds
      or removes its noise share as well, so the two sums differ in their noise, not only by a
      shift, and the Skellam bound (a shift at fixed noise) does not cover that.

    ``sampling_probability`` q < 1: each client takes part independently with probability q
    and the outcome stays secret from whoever the guarantee is stated against (not from the
    server, which picks the cohort). Priced by joint convexity (see
    :mod:`privkit.accountants.distributed`).

    Attributes:
        noise_per_client: mu, the Skellam variance each client adds per coordinate (integer
            units), finite and > 0.
        survivors: the guaranteed number of honest noise shares in a released sum, >= 1.
        l2_sensitivity: Delta_2, the L2 bound on one client's rounded contribution, > 0.
        l1_sensitivity: Delta_1, its L1 bound, > 0.
        sampling_probability: q in (0, 1] (1: every client every round).

    Example:
        >>> ev = SkellamDpEvent(noise_per_client=50.0, survivors=100, l2_sensitivity=30.0,
        ...                     l1_sensitivity=900.0)
        >>> ev.central_variance
        5000.0
    """

    noise_per_client: float
    survivors: int
    l2_sensitivity: float
    l1_sensitivity: float
    sampling_probability: float = 1.0

    def __attrs_post_init__(self) -> None:
        n = "SkellamDpEvent"
        _validate.positive(f"{n}.noise_per_client", self.noise_per_client)
        _validate.positive_int(f"{n}.survivors", self.survivors)
        _validate.positive(f"{n}.l2_sensitivity", self.l2_sensitivity)
        _validate.positive(f"{n}.l1_sensitivity", self.l1_sensitivity)
        _validate.probability(f"{n}.sampling_probability", self.sampling_probability)

    @property
    def central_variance(self) -> float:
        """The Skellam variance of the noise every released sum carries at least, n mu."""
        return float(self.noise_per_client) * int(self.survivors)
