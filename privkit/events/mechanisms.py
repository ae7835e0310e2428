"""privkit's own events for its mechanisms: plain data, no pricing.

Each is priced by rules registered in :mod:`privkit.accountants` (``objective``, ``rec``,
``midp``, ``amplification``); nothing here imports an accountant. Their classes report
``privkit.events`` as their module, so the JSON a ledger stores names them
``privkit.events:<Class>`` (older ledgers name the accountant modules they used to live in;
those modules re-export the classes, so such ledgers still reopen).
"""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING, Any

import attr

from privkit import _validate
from privkit._dpa import dp_event
from privkit._dpa import privacy_accountant as _pa
from privkit.errors import InvalidParameterError

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent
else:
    DpEvent = dp_event.DpEvent
NeighboringRelation = _pa.NeighboringRelation

__all__ = [
    "L2LaplaceDpEvent",
    "ObjectivePerturbationDpEvent",
    "objective_step_epsilon",
    "JACOBIAN_CONSTANT",
    "RecDpEvent",
    "MAX_CANDIDATES",
    "LabelMode",
    "CodedDataMiEvent",
    "PoissonSampledPureDpEvent",
    "as_relation",
    "RELATION_LABELS",
    "NOISE_MULTIPLIER_NOTE",
    "ReplaceOneGaussianDpEvent",
    "ReplaceOneLaplaceDpEvent",
]

#: Largest number of REC candidates per group (2**24).
MAX_CANDIDATES = 1 << 24


# ------------------------------------------------------- objective perturbation
#: The constant c with -ln(1 - x) <= c x on [0, 0.5] used by Thm C.2 (2 ln 2 = 1.386 < 1.4).
JACOBIAN_CONSTANT = 1.4


def objective_step_epsilon(
    *,
    alpha: float,
    lipschitz: float,
    smoothness: float,
    rank: int,
    dataset_size: int,
    proximal_mu: float,
) -> float:
    """Per-step epsilon of objective perturbation, Upcycled-FL Thm C.2 with explicit rank.

    ``epsilon = 2 alpha u1/|D| + 1.4 rank u2/(|D| mu)``; ``rank = 2`` gives the
    paper's ``(2 alpha u1 mu + 2.8 u2)/(|D| mu)``. The second term does not
    shrink with alpha: it is a per-step floor.

    Args:
        alpha: rate of the L2-Laplace linear term ``p(n) ~ exp(-alpha ||n||_2)``, > 0.
        lipschitz: u1, bound on every per-example gradient norm, > 0 (logistic: max ||x~||).
        smoothness: u2, bound on the per-example loss's second derivative, >= 0
            (logistic: max ||x~||^2 / 4).
        rank: rank bound r of the Hessian difference of neighbours, integer >= 1
            (2 for a binary GLM; 2(K-1) for K-class softmax).
        dataset_size: |D_i|, records of the client, integer >= 1.
        proximal_mu: mu, weight of the proximal term, > 0.

    Returns:
        The per-step epsilon (pure DP, delta = 0) under the theorem's conditions.

    Raises:
        InvalidParameterError: a bad argument, or condition (d) ``u2 <= 0.5 |D| mu``
            violated (named ``smoothness``; the message gives dataset_size and proximal_mu).

    Example:
        >>> e = objective_step_epsilon(alpha=20, lipschitz=1, smoothness=0.25, rank=2,
        ...                            dataset_size=224, proximal_mu=0.1)
        >>> round(e, 6), round(40 * e, 6)
        (0.209821, 8.392857)
    """
    return _step_epsilon(
        "", alpha=alpha, lipschitz=lipschitz, smoothness=smoothness, rank=rank,
        dataset_size=dataset_size, proximal_mu=proximal_mu,
    )


def _step_epsilon(
    prefix: str, *, alpha: Any, lipschitz: Any, smoothness: Any, rank: Any,
    dataset_size: Any, proximal_mu: Any,
) -> float:
    """:func:`objective_step_epsilon` with error names prefixed (e.g. by the event class)."""
    a = _validate.positive(prefix + "alpha", alpha)
    u1 = _validate.positive(prefix + "lipschitz", lipschitz)
    u2 = _validate.nonnegative(prefix + "smoothness", smoothness)
    r = _validate.positive_int(prefix + "rank", rank)
    n = _validate.positive_int(prefix + "dataset_size", dataset_size)
    mu = _validate.positive(prefix + "proximal_mu", proximal_mu)
    bound = 0.5 * n * mu
    if not u2 <= bound:
        raise InvalidParameterError(
            prefix + "smoothness", smoothness,
            f"<= 0.5 * dataset_size * proximal_mu = {bound:g} (Thm C.2 condition (d); "
            f"{prefix}dataset_size={n}, {prefix}proximal_mu={mu:g}): "
            "use more records or a larger proximal_mu",
        )
    eps = 2.0 * a * u1 / n + JACOBIAN_CONSTANT * r * u2 / (n * mu)
    if not (math.isfinite(eps) and eps > 0):
        raise InvalidParameterError(prefix + "alpha", alpha, "such that epsilon is finite")
    return float(eps)


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
    (:func:`objective_step_epsilon`; the paper's
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
        expected = _step_epsilon(
            f"{name}.", alpha=self.alpha, lipschitz=self.lipschitz, smoothness=self.smoothness,
            rank=self.rank, dataset_size=self.dataset_size, proximal_mu=self.proximal_mu,
        )
        if not math.isclose(e, expected, rel_tol=1e-9, abs_tol=0.0):
            raise InvalidParameterError(
                f"{name}.epsilon", self.epsilon,
                f"2 alpha u1/|D| + 1.4 rank u2/(|D| mu) = {expected!r} (Thm C.2)",
            )


# ------------------------------------------------------------------ REC
#: Spellings of the relations a string may use (case and ``-``/``_`` do not matter).
_RELATION_NAMES = {"ADD_OR_REMOVE_ONE": "ADD_OR_REMOVE_ONE", "ADD_REMOVE": "ADD_OR_REMOVE_ONE",
                   "REPLACE_ONE": "REPLACE_ONE", "REPLACE_SPECIAL": "REPLACE_SPECIAL",
                   "ZERO_OUT": "REPLACE_SPECIAL"}

#: The one line reports, JSON and the CLI print about what a noise multiplier means.
NOISE_MULTIPLIER_NOTE = ("z = stddev / C (C the clip norm) under every relation; sensitivity "
                         "C under add-remove and zero-out, 2C under replace-one")

#: How reports name each relation (dp-accounting's name for zero-out is REPLACE_SPECIAL).
RELATION_LABELS = {"ADD_OR_REMOVE_ONE": "add-remove", "REPLACE_ONE": "replace-one",
                   "REPLACE_SPECIAL": "zero-out"}


def as_relation(value: Any) -> Any:
    """A dp_accounting ``NeighboringRelation`` from itself or a name: ``"replace-one"`` (the
    CLI's spelling), ``"REPLACE_ONE"``, ``"add-remove"``, ``"add_or_remove_one"``,
    ``"zero-out"`` (dp-accounting's ``REPLACE_SPECIAL``: one contribution replaced by a null
    one that contributes nothing), ...

    Raises:
        InvalidParameterError: anything else (naming ``neighboring_relation``).
    """
    if isinstance(value, NeighboringRelation):
        return value
    if isinstance(value, str):
        name = _RELATION_NAMES.get(value.strip().upper().replace("-", "_").replace("/", "_"))
        if name is not None:
            return NeighboringRelation[name]
    raise InvalidParameterError(
        "neighboring_relation", value, "a dp_accounting NeighboringRelation (ADD_OR_REMOVE_ONE, "
        "REPLACE_ONE or REPLACE_SPECIAL) or its name ('add-remove', 'replace-one', 'zero-out')")


def _relation_name(value: Any) -> str:
    try:
        name = str(as_relation(value).name)
    except InvalidParameterError:
        name = ""
    if name not in ("REPLACE_ONE", "ADD_OR_REMOVE_ONE"):
        raise InvalidParameterError("RecDpEvent.neighboring_relation", value,
                                    "REPLACE_ONE or ADD_OR_REMOVE_ONE")
    return name


@attr.s(frozen=True, slots=True, auto_attribs=True)
class RecDpEvent(dp_event.DpEvent):
    """One DP-REC message: a clipped update sent as K candidates per group plus indices.

    Attributes:
        noise_multiplier: sigma / C, the prior std over the update's L2 clip norm (c = 1/it).
        num_candidates: K = 2**bits, candidates per group, integer in [2, 2**24].
        num_groups: M, groups the update was split into (the bound does not depend on it).
        neighboring_relation: ``"REPLACE_ONE"`` (any two updates of the C-ball; default) or
            ``"ADD_OR_REMOVE_ONE"`` (zero-out: an absent client encodes the zero update).
    """

    noise_multiplier: float
    num_candidates: int
    num_groups: int = 1
    neighboring_relation: str = attr.ib(default="REPLACE_ONE", converter=_relation_name)

    def __attrs_post_init__(self) -> None:
        _validate.positive("RecDpEvent.noise_multiplier", self.noise_multiplier)
        k = _validate.positive_int("RecDpEvent.num_candidates", self.num_candidates)
        if not 2 <= k <= MAX_CANDIDATES:
            raise InvalidParameterError("RecDpEvent.num_candidates", k, "in [2, 2**24]")
        _validate.positive_int("RecDpEvent.num_groups", self.num_groups)


# --------------------------------------------------- replace-one-only noise events
@attr.s(frozen=True, slots=True, auto_attribs=True)
class ReplaceOneGaussianDpEvent(dp_event.GaussianDpEvent):
    """A Gaussian release whose sensitivity is known under ``REPLACE_ONE`` only.

    ``noise_multiplier`` is stddev / C with 2C the replace-one sensitivity (as in every
    privkit event). A clipped model (output perturbation: any two points of the tau-ball are
    2 tau apart) has no smaller add/remove or zero-out bound, so this event is priced under
    ``REPLACE_ONE`` and refused under any other relation: a plain ``GaussianDpEvent(z)`` priced
    under add/remove would be charged against C, half the truth. It is a ``GaussianDpEvent``
    (dp-accounting's accountants price it as one; price it there under ``REPLACE_ONE`` too).

    Example:
        >>> import privkit
        >>> ev = ReplaceOneGaussianDpEvent(4.0)
        >>> round(privkit.epsilon(ev, 1e-5, neighboring_relation="replace-one").epsilon, 4)
        1.9931
    """

    noise_multiplier: float


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ReplaceOneLaplaceDpEvent(dp_event.LaplaceDpEvent):
    """A Laplace release whose sensitivity is known under ``REPLACE_ONE`` only (as
    :class:`ReplaceOneGaussianDpEvent`): ``noise_multiplier`` is the scale over C, 2C the
    replace-one L1 sensitivity; one use is pure ``2 / noise_multiplier``-DP under
    ``REPLACE_ONE``, and it is refused under any other relation."""

    noise_multiplier: float


# ------------------------------------------------------------ coded data (SCFL)
class LabelMode(enum.Enum):
    """How the labels are uploaded with the coded features."""

    NOISY = "noisy"
    """``Y~ = G Y + sigma_y N_y``: privkit's default; the bound covers the whole record."""
    PAPER_NOISELESS = "paper_noiseless"
    """``Y~ = G Y`` as in the paper: labels unprotected, and G can be read off Y~."""
    NONE = "none"
    """No labels uploaded (features only): Theorem F as is."""


def _label_mode(value: Any) -> LabelMode:
    if isinstance(value, LabelMode):
        return value
    if isinstance(value, str):
        for m in LabelMode:
            if value in (m.name, m.value):
                return m
    raise InvalidParameterError("label_mode", value,
                                "a LabelMode (NOISY, PAPER_NOISELESS or NONE)")


@attr.s(frozen=True, slots=True, auto_attribs=True)
class CodedDataMiEvent(DpEvent):
    """One client's one-time coded upload (SCFL): everything the MI-DP bound needs.

    This is an MI-DP release, not an (epsilon, delta) one: price it with
    :func:`privkit.accountants.midp.midp_coded_release`; :func:`privkit.epsilon` and the
    ledger refuse it.

    Attributes:
        num_coded_rows: c, the number of coded rows, an integer >= 1.
        stddev: sigma, absolute stddev of the feature noise, >= 0 (0 gives MI-DP = inf).
        row_l2_bound: rho_x, the L2 bound every feature row was clipped to, > 0.
        dim: d, number of feature columns (a bias column included), an integer >= 1.
        label_mode: :class:`LabelMode` (stored by name in JSON).
        label_stddev: sigma_y, > 0 for ``NOISY``; 0 for ``PAPER_NOISELESS`` and ``NONE``.
        label_l2_bound: rho_y, the L2 bound labels were clipped to (> 0; required for
            ``NOISY``; one-hot labels: the scale of the one-hot rows, 1 unless weighted);
            None when the labels were not clipped.
        label_dim: o, number of label columns; 0 exactly for ``NONE``.
        categorical_labels: True for one-hot labels (o classes, possibly scaled by
            ``label_l2_bound``): the label then carries at most log o nats.
    """

    num_coded_rows: int
    stddev: float
    row_l2_bound: float
    dim: int
    label_mode: LabelMode = attr.ib(converter=_label_mode)
    label_stddev: float = 0.0
    label_l2_bound: float | None = None
    label_dim: int = 0
    categorical_labels: bool = False

    def __attrs_post_init__(self) -> None:
        n = "CodedDataMiEvent"
        _validate.positive_int(f"{n}.num_coded_rows", self.num_coded_rows)
        _validate.nonnegative(f"{n}.stddev", self.stddev)
        _validate.positive(f"{n}.row_l2_bound", self.row_l2_bound)
        _validate.positive_int(f"{n}.dim", self.dim)
        o = _validate.nonnegative_int(f"{n}.label_dim", self.label_dim)
        sy = _validate.nonnegative(f"{n}.label_stddev", self.label_stddev)
        if self.label_l2_bound is not None:
            _validate.positive(f"{n}.label_l2_bound", self.label_l2_bound)
        if not isinstance(self.categorical_labels, bool):
            raise InvalidParameterError(f"{n}.categorical_labels", self.categorical_labels,
                                        "a bool")
        mode = self.label_mode
        if (mode is LabelMode.NONE) != (o == 0):
            raise InvalidParameterError(f"{n}.label_dim", self.label_dim,
                                        "0 exactly when label_mode is NONE")
        if mode is LabelMode.NOISY:
            if not sy > 0:
                raise InvalidParameterError(f"{n}.label_stddev", self.label_stddev,
                                            "> 0 in NOISY mode (0 is the paper's scheme)")
            if self.label_l2_bound is None:
                raise InvalidParameterError(f"{n}.label_l2_bound", None,
                                            "given (the labels' clipping bound) in NOISY mode")
        elif sy != 0:
            raise InvalidParameterError(f"{n}.label_stddev", self.label_stddev,
                                        f"0 in {mode.name} mode")


# ------------------------------------------------------ Poisson-sampled pure steps
def _inner_epsilon(event: Any) -> float | None:
    """The pure epsilon of an inner event: privkit's pure events carry it as ``epsilon``;
    dp-accounting's ``LaplaceDpEvent`` is 1/noise_multiplier-DP."""
    if isinstance(event, dp_event.LaplaceDpEvent):
        z = float(event.noise_multiplier)
        return 1.0 / z if z > 0 else None
    e = getattr(event, "epsilon", None)
    return float(e) if isinstance(e, (int, float)) and not isinstance(e, bool) and e > 0 else None


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PoissonSampledPureDpEvent(DpEvent):
    """One pure-DP step on a Poisson subsample (each record kept with probability q).

    Priced as pure ``eps' = log(1 + q (e^eps - 1))``-DP
    (:func:`privkit.accountants.amplification.amplified_epsilon`) with eps
    the inner event's pure epsilon, dominated by randomized response RR(eps') in RDP and PLD.
    Valid under add/remove neighbours only (RDP / PLD pricing refuse another relation; the
    trainer opens amplified ledgers with ADD_OR_REMOVE_ONE), and only while the sampler's
    outcome stays secret: every report containing it states that assumption.
    dp-accounting's ``PoissonSampledDpEvent`` is not used because privkit's pure-DP
    accountants do not price it (and its L2-norm Laplace inner event has no PLD).

    Attributes:
        sampling_probability: q in (0, 1].
        event: the inner step, an event with a pure epsilon (e.g. ``L2LaplaceDpEvent``).
    """

    sampling_probability: float
    event: DpEvent

    def __attrs_post_init__(self) -> None:
        _validate.probability("PoissonSampledPureDpEvent.sampling_probability",
                              self.sampling_probability)
        if not isinstance(self.event, DpEvent) or _inner_epsilon(self.event) is None:
            raise InvalidParameterError("PoissonSampledPureDpEvent.event", self.event,
                                        "a pure-DP event (one with a pure epsilon)")

    @property
    def epsilon(self) -> float:
        """The amplified per-step epsilon eps'."""
        inner = _inner_epsilon(self.event)
        assert inner is not None
        return math.log1p(self.sampling_probability * math.expm1(inner))


for _cls in (L2LaplaceDpEvent, ObjectivePerturbationDpEvent, RecDpEvent, LabelMode,
             CodedDataMiEvent, PoissonSampledPureDpEvent, ReplaceOneGaussianDpEvent,
             ReplaceOneLaplaceDpEvent):
    _cls.__module__ = "privkit.events"
