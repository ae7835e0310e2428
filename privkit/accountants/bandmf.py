"""Pricing matrix-factorization (banded MF, tree DP-FTRL) runs: sensitivity and events.

A run of :class:`privkit.mechanisms.BandMF` releases ``C^-1 (C x + Z)`` with ``Z`` i.i.d.
``N(0, (z C_clip)^2)``: a post-processing of one Gaussian mechanism ``C x + Z`` whose inputs
may be chosen adaptively (Denisov et al., NeurIPS 2022; several participations:
Choquette-Choo et al., ICML 2023). One client contributes rows
``g_t`` (``||g_t|| <= C_clip``) in the rounds it takes part in, so in units of ``C_clip`` the
L2 sensitivity under add/remove-one-client is

    sens^2 = max_pi max_g ||sum_{t in pi} C[:, t] g_t^T||_F^2
           = max_pi max_g sum_{i, j in pi} X_ij <g_i, g_j>,     X = C^T C,

over the participation patterns pi the schema allows and unit vectors g,

and the run is ``GaussianDpEvent(z / sens)``, composed once, under every relation (the
accountant doubles the sensitivity under replace-one). Zero-out (``REPLACE_SPECIAL``: a
client's data replaced by a null contribution, the client staying in its rounds) has the same
sensitivity as add/remove, and it is the relation a fixed schedule satisfies: a server that
fixes the population and each round's cohort size cannot promise that adding a client moves
nobody else. :func:`bandmf_sensitivity` computes ``sens`` for the participation schemas below,
never below the true maximum:

- **exact, closed form**, for a banded Toeplitz ``C`` when participations are at least ``b``
  rounds apart (columns of different rounds have disjoint supports: ``X`` restricted to a
  pattern is diagonal), or when its coefficients are non-negative and non-increasing (then
  ``X >= 0`` entrywise, ``X_ij`` shrinks as ``|i - j|`` grows and as the pair moves right, so
  the pattern ``0, s, 2s, ...`` dominates every other term by term);
- **exact**, for any ``C``, when the separation is at least ``C``'s bandwidth (a DP over the
  column norms);
- otherwise an **upper bound** (Choquette-Choo et al., NeurIPS 2023, Algorithm 4, with the
  row stage restricted to patterns through the row): ``|X|`` replaces ``X``, each row's best
  pattern through it is found by a DP, and the best pattern of those row values by another.

**Amplified variant** (:class:`CyclicPoisson`): the population is split into ``g >= b``
fixed groups, round ``t`` serves group ``t mod g`` and takes each of its clients independently
with probability ``q`` (secret). A client's rounds are then ``g >= b`` apart, so the rows each
of them moves are disjoint blocks of ``b`` rows; each block is one Poisson-subsampled Gaussian
release of the same ``g_t`` with sensitivity ``||C[:, t]||``, and the blocks compose
adaptively: the run is dominated by
``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z / zeta)), ceil(T / g))``
with ``zeta`` the largest column norm (Choquette-Choo et al., NeurIPS 2023, amplification for
banded MF; ``docs/theory/banded_mf.md`` has the argument and its assumptions).

Every event is dp-accounting's own, so :func:`privkit.epsilon` and dp-accounting's accountants
both price it. :func:`bandmf_assumptions` states what the number assumes.

Example:
    >>> import privkit
    >>> ev = bandmf_event((1.0,), noise_multiplier=1.0, rounds=100,
    ...                   participation=MinSeparation(20, 5))   # identity: DP-FedAvg
    >>> ev, round(privkit.epsilon(ev, 1e-5).epsilon, 2)
    (GaussianDpEvent(noise_multiplier=0.4472135954999579), 11.48)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit import _validate
from privkit.accountants.accountant import _relation, epsilon
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import InvalidParameterError, NumericalError
from privkit.events import (
    DpEvent,
    GaussianDpEvent,
    NoOpDpEvent,
    PoissonSampledDpEvent,
    SelfComposedDpEvent,
)

__all__ = [
    "BandMFCalibration",
    "BandMFSensitivity",
    "Cyclic",
    "CyclicPoisson",
    "MinSeparation",
    "bandmf_assumptions",
    "bandmf_event",
    "bandmf_round_events",
    "bandmf_sensitivity",
    "calibrate_bandmf",
]

#: Largest number of rounds priced with a dense ``X = C^T C`` (a few T x T arrays).
MAX_DENSE_ROUNDS = 2048


# ------------------------------------------------------------------ participation schemas
@dataclass(frozen=True)
class MinSeparation:
    """A client takes part in at most ``max_participations`` rounds, any two of them at least
    ``min_separation`` rounds apart (1: any distinct rounds). The server enforces it and knows
    who took part: no amplification."""

    min_separation: int
    max_participations: int

    def __post_init__(self) -> None:
        _validate.positive_int("min_separation", self.min_separation)
        _validate.positive_int("max_participations", self.max_participations)

    def allows(self, rounds_taken: Any) -> bool:
        """Whether one client taking part in ``rounds_taken`` (0-based rounds) fits.

        Example:
            >>> MinSeparation(3, 2).allows([0, 3]), MinSeparation(3, 2).allows([0, 2])
            (True, False)
        """
        r = np.sort(_rounds_taken(rounds_taken))
        return bool(r.size <= self.max_participations
                    and np.all(np.diff(r) >= self.min_separation))


@dataclass(frozen=True)
class Cyclic:
    """The population is split into ``groups`` fixed groups before training; round ``t``
    serves group ``t mod groups`` (every client of it, or any subset the server picks: no
    amplification). A client takes part at most ``ceil(T / groups)`` times."""

    groups: int

    def __post_init__(self) -> None:
        _validate.positive_int("groups", self.groups)

    def allows(self, rounds_taken: Any, group: int) -> bool:
        """Whether a client of ``group`` (0-based) taking part in ``rounds_taken`` fits."""
        return _in_group(rounds_taken, group, int(self.groups))


def _rounds_taken(value: Any) -> np.ndarray:
    r = np.asarray(value)
    if r.ndim != 1 or (r.size and (r.dtype.kind not in "iu" or r.min() < 0)):
        raise InvalidParameterError("rounds_taken", value, "a 1-D sequence of rounds >= 0")
    if np.unique(r).size != r.size:
        raise InvalidParameterError("rounds_taken", value, "distinct rounds")
    return r.astype(np.int64)


def _in_group(rounds_taken: Any, group: Any, groups: int) -> bool:
    g = _validate.nonnegative_int("group", group)
    if not g < groups:
        raise InvalidParameterError("group", group, f"in [0, {groups})")
    return bool(np.all(_rounds_taken(rounds_taken) % groups == g))


@dataclass(frozen=True)
class CyclicPoisson:
    """:class:`Cyclic` groups, and within round ``t``'s group each client takes part
    independently with probability ``sampling_probability``, the outcome secret (amplified).
    Needs ``groups >= `` the strategy's bands."""

    groups: int
    sampling_probability: float

    def __post_init__(self) -> None:
        _validate.positive_int("groups", self.groups)
        _validate.probability("sampling_probability", self.sampling_probability)

    def allows(self, rounds_taken: Any, group: int) -> bool:
        """Whether a client of ``group`` (0-based) taking part in ``rounds_taken`` fits."""
        return _in_group(rounds_taken, group, int(self.groups))


_SCHEMAS = (MinSeparation, Cyclic, CyclicPoisson)


def _schema(value: Any) -> Any:
    if not isinstance(value, _SCHEMAS):
        raise InvalidParameterError("participation", value,
                                    "a MinSeparation, Cyclic or CyclicPoisson schema")
    return value


# ------------------------------------------------------------------ strategies as plain data
@dataclass(frozen=True)
class _Strategy:
    """A strategy for ``rounds`` rounds: Toeplitz coefficients or a dense matrix."""

    rounds: int
    coefficients: np.ndarray | None  # banded Toeplitz c_0..c_(b-1)
    dense: np.ndarray | None  # rounds x rounds lower-triangular
    bandwidth: int  # C[i, j] = 0 whenever i - j >= bandwidth

    @property
    def monotone(self) -> bool:
        c = self.coefficients
        return c is not None and bool(c[-1] >= 0 and np.all(c[:-1] >= c[1:]))

    def gram(self, idx: np.ndarray, jdx: np.ndarray) -> np.ndarray:
        """``X[idx][:, jdx]`` with ``X = C^T C``, without forming C when it is Toeplitz."""
        if self.dense is not None:
            return self.dense[:, idx].T @ self.dense[:, jdx]
        return self.entries(np.asarray(idx)[:, None], np.asarray(jdx)[None, :])

    def entries(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """``X[i, j]`` of a banded Toeplitz ``C`` for broadcastable index arrays (0 outside
        the matrix): ``sum_{l} c_l c_(l + |i - j|)`` over the rows below ``max(i, j)``."""
        c, t = self.coefficients, self.rounds
        assert c is not None
        b = c.size
        prefix = np.zeros((b, b + 1))  # prefix[d, m] = sum_{l < m} c_l c_(l + d)
        for d in range(b):
            prefix[d, 1 : b - d + 1] = np.cumsum(c[: b - d] * c[d:])
        d = np.abs(i - j)
        inside = (d < b) & (i >= 0) & (j >= 0) & (i < t) & (j < t)
        dd = np.where(inside, d, 0)
        m = np.minimum(b - dd, t - np.maximum(i, j)).clip(0, b)
        return np.where(inside, prefix[dd, m], 0.0)

    def diagonal(self) -> np.ndarray:
        """The squared column norms of ``C``."""
        if self.dense is not None:
            return np.sum(self.dense * self.dense, axis=0)
        idx = np.arange(self.rounds)
        return self.entries(idx, idx)


def _strategy(value: Any, rounds: int) -> _Strategy:
    coefficients = getattr(value, "coefficients", None)
    if coefficients is None and isinstance(value, (tuple, list, np.ndarray)):
        arr = np.asarray(value, dtype=np.float64)
        if arr.ndim == 1:
            coefficients = arr
        elif arr.ndim == 2:
            return _dense(arr, rounds)
    if coefficients is not None:
        c = np.asarray(coefficients, dtype=np.float64)
        if c.ndim != 1 or c.size == 0 or not np.isfinite(c).all() or not c[0] > 0:
            raise InvalidParameterError("strategy", coefficients, "Toeplitz coefficients "
                                        "c_0 > 0, c_1, ...: finite, 1-D, non-empty")
        c = c[:rounds]
        return _Strategy(rounds, c, None, c.size)
    if callable(getattr(value, "matrix", None)):
        if rounds > MAX_DENSE_ROUNDS:
            raise InvalidParameterError("rounds", rounds, f"<= {MAX_DENSE_ROUNDS} for a "
                                        "strategy priced through its dense matrix")
        return _dense(np.asarray(value.matrix(rounds), dtype=np.float64), rounds)
    raise InvalidParameterError("strategy", type(value).__name__, "a BandedToeplitzStrategy, "
                                "a TreeStrategy, Toeplitz coefficients or a T x T matrix")


def _dense(c: np.ndarray, rounds: int) -> _Strategy:
    if c.shape != (rounds, rounds):
        raise InvalidParameterError("strategy", c.shape, f"a {rounds} x {rounds} matrix")
    if rounds > MAX_DENSE_ROUNDS:
        raise InvalidParameterError("rounds", rounds, f"<= {MAX_DENSE_ROUNDS} for a dense "
                                    "strategy matrix")
    if not np.isfinite(c).all() or np.triu(c, 1).any() or not (np.diag(c) != 0).all():
        raise InvalidParameterError("strategy", "a matrix", "finite, lower-triangular, with a "
                                    "non-zero diagonal (invertible)")
    rows, cols = np.nonzero(c)
    return _Strategy(rounds, None, c, int((rows - cols).max()) + 1)


# ------------------------------------------------------------------ the maximisation
def _best_separated(weights: np.ndarray, s: int, kmax: int) -> np.ndarray:
    """For each row of ``weights`` (>= 0; columns are positions): the best sum of at most
    ``a`` entries any two ``>= s`` positions apart, for a = 0..kmax; shape (kmax + 1, rows).
    f_a(p) = max_{p' >= p} w(p') + f_(a-1)(p' + s): one reverse running max per a."""
    w = np.atleast_2d(weights)
    rows, n = w.shape
    out = np.zeros((kmax + 1, rows))
    f = np.zeros((rows, n + s))
    g = np.zeros((rows, n + s))
    for a in range(1, kmax + 1):
        np.add(w, f[:, s : s + n], out=g[:, :n])
        f = np.maximum.accumulate(g[:, ::-1], axis=1)[:, ::-1]
        out[a] = f[:, 0]
    return out


def _two_stage_bound(st: _Strategy, s: int, k: int) -> float:
    """sum_{i, j in pi} |X_ij| <= sum_{i in pi} r_i <= max_pi sum_{i in pi} r_i, with r_i the
    best sum of |X_i.| over valid patterns through i (left and right of i separately: points
    on both sides are >= 2s apart)."""
    t = st.rounds
    i = np.arange(t)[:, None]
    diag = np.abs(st.diagonal())
    if st.dense is not None:
        w = np.abs(st.gram(np.arange(t), np.arange(t)))
        j = np.arange(t)[None, :]
        left, right = w * (j <= i - s), w * (j >= i + s)
    else:  # banded Toeplitz: only offsets |i - j| < b can be non-zero
        offs = np.arange(-(st.bandwidth - 1), st.bandwidth)
        win = np.abs(st.entries(i, i + offs[None, :]))
        left, right = win[:, offs <= -s], win[:, offs >= s]
    lb = _best_separated(left, s, k - 1)
    rb = _best_separated(right, s, k - 1)
    row = diag + np.max(lb + rb[::-1], axis=0)
    return float(_best_separated(row, s, k)[k, 0])


@dataclass(frozen=True)
class BandMFSensitivity:
    """The L2 sensitivity of ``C x`` (in units of the clip norm, add/remove one client).

    Attributes:
        value: an upper bound on the true maximum (equal to it when ``exact``).
        lower_bound: a value some valid pattern attains (all its rows one same unit vector),
            so the true maximum lies in ``[lower_bound, value]``.
        exact: whether ``value`` is the true maximum.
        method: how ``value`` was found.
        participations: the most rounds one client can take part in here.
    """

    value: float
    lower_bound: float
    exact: bool
    method: str
    participations: int


def _uniform(t: int, s: int, k: int, offset: int = 0) -> np.ndarray:
    return np.arange(offset, t, s)[:k]


def _pattern_value(st: _Strategy, idx: np.ndarray) -> tuple[float, float, bool]:
    """(sum |X_pi|, sum X_pi, whether X_pi >= 0) for the pattern ``idx``."""
    x = st.gram(idx, idx)
    return float(np.abs(x).sum()), float(x.sum()), bool((x >= 0).all())


def _sensitivity(st: _Strategy, schema: Any) -> BandMFSensitivity:
    t = st.rounds
    if isinstance(schema, MinSeparation):
        s, kmax = int(schema.min_separation), int(schema.max_participations)
    else:
        s, kmax = int(schema.groups), t
    k = min(kmax, -(-t // s))
    uniform = _uniform(t, s, k)
    if st.coefficients is not None and (s >= st.bandwidth or st.monotone):
        v2 = _pattern_value(st, uniform)[1]
        why = ("rounds at least b apart: the column norms" if s >= st.bandwidth else
               "non-negative, non-increasing coefficients")
        return BandMFSensitivity(math.sqrt(v2), math.sqrt(v2), True,
                                 f"exact: the pattern 0, s, 2s, ... with s = {s} ({why})", k)
    if s >= st.bandwidth:  # any C: columns of a pattern have disjoint supports
        diag = st.diagonal()
        if isinstance(schema, MinSeparation):
            v2 = float(_best_separated(diag, s, k)[k, 0])
        else:
            v2 = max(float(diag[offset::s].sum()) for offset in range(min(s, t)))
        return BandMFSensitivity(math.sqrt(v2), math.sqrt(v2), True,
                                 "exact: rounds at least the bandwidth apart (column norms)", k)
    offsets = range(min(s, t))
    values = [_pattern_value(st, _uniform(t, s, k, r)) for r in offsets]
    lower = max(v[1] for v in values)
    if isinstance(schema, MinSeparation):
        v2 = _two_stage_bound(st, s, k)
        method = "upper bound: two-stage maximisation over |C^T C| (valid patterns)"
    else:  # the g fixed patterns: exact where the pattern's block of X is >= 0
        best = max(range(len(values)), key=lambda r: values[r][0])
        v2 = values[best][0]
        method = "max over the groups' patterns of sum |C^T C|"
    v2 = max(v2, lower)
    exact = math.isclose(v2, lower, rel_tol=1e-12)
    return BandMFSensitivity(math.sqrt(v2), math.sqrt(max(lower, 0.0)), exact,
                             method + (" (attained)" if exact else ""), k)


def bandmf_sensitivity(strategy: Any, *, rounds: int, participation: Any) -> BandMFSensitivity:
    """L2 sensitivity of a run of ``rounds`` releases with ``strategy`` under the schema.

    Args:
        strategy: a ``BandedToeplitzStrategy`` (or its coefficients as a 1-D array), a
            ``TreeStrategy`` or any object with ``matrix(rounds)``, or a lower-triangular
            ``rounds x rounds`` array (dense strategies: rounds <= 2048).
        rounds: T, the number of rounds the run releases (more is safe: the sensitivity of a
            prefix of the run is never larger).
        participation: :class:`MinSeparation` or :class:`Cyclic` (for :class:`CyclicPoisson`
            the sensitivity of its ``Cyclic`` schema is returned).

    Example:
        >>> r = bandmf_sensitivity((0.8, 0.6), rounds=10, participation=MinSeparation(1, 2))
        >>> round(r.value, 6), r.exact
        (1.720465, True)
    """
    t = _validate.positive_int("rounds", rounds)
    schema = _schema(participation)
    if isinstance(schema, CyclicPoisson):
        schema = Cyclic(schema.groups)
    return _sensitivity(_strategy(strategy, t), schema)


# ------------------------------------------------------------------ events
def _noise(noise_multiplier: Any) -> float:
    return _validate.positive("noise_multiplier", noise_multiplier)


def _scale(relation: Any) -> float:
    """Sensitivity factor of the relation: replacing a client moves each row by up to 2 C (the
    accountant applies it to the events; here only for the calibration's first guess)."""
    return 2.0 if relation == NeighboringRelation.REPLACE_ONE else 1.0


def _amplified(st: _Strategy, schema: CyclicPoisson) -> tuple[float, int]:
    """(largest column norm, blocks per client) of the amplified schema."""
    g = int(schema.groups)
    if g < st.bandwidth:
        raise InvalidParameterError("groups", g, f">= the strategy's bandwidth "
                                    f"({st.bandwidth}) for the amplified analysis")
    if st.dense is not None:
        zeta2 = float(np.max(np.sum(st.dense * st.dense, axis=0)))
    else:
        assert st.coefficients is not None
        zeta2 = float(np.dot(st.coefficients, st.coefficients))
    return math.sqrt(zeta2), -(-st.rounds // g)


@dataclass(frozen=True)
class _Priced:
    """What an event needs besides the noise: a whole-run sensitivity, or the amplified
    schema's column norm, blocks and sampling rate."""

    sensitivity: float
    blocks: int = 0
    sampling_probability: float = 1.0

    def block_event(self, z: float) -> DpEvent:
        """The Gaussian of the whole run, or (amplified) of one block, subsampled: its noise
        multiplier is relative to the bound on one client's contribution per round (the
        accountant doubles it under ``REPLACE_ONE``)."""
        inner = GaussianDpEvent(z / self.sensitivity)
        q = self.sampling_probability
        return inner if q == 1 else PoissonSampledDpEvent(q, inner)

    def event(self, z: float) -> DpEvent:
        one = self.block_event(z)
        return SelfComposedDpEvent(one, self.blocks) if self.blocks else one


def _priced(strategy: Any, rounds: Any, participation: Any) -> tuple[_Priced, _Strategy, Any]:
    t = _validate.positive_int("rounds", rounds)
    schema = _schema(participation)
    st = _strategy(strategy, t)
    if isinstance(schema, CyclicPoisson):
        zeta, blocks = _amplified(st, schema)
        return _Priced(zeta, blocks, float(schema.sampling_probability)), st, schema
    sens = _sensitivity(st, schema)
    if not sens.value > 0:
        raise NumericalError(f"sensitivity came out as {sens.value}")
    return _Priced(sens.value), st, schema


def bandmf_event(strategy: Any, *, noise_multiplier: float, rounds: int, participation: Any,
                 neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE) -> DpEvent:
    """The event of a whole run (JAX-Privacy style pure builder).

    ``MinSeparation`` / ``Cyclic``: ``GaussianDpEvent(z / sens)``, composed once.
    ``CyclicPoisson``:
    ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z / zeta)), ceil(T / g))``
    with ``zeta`` the largest column norm (``q = 1``: no sampling event). The event is the
    same under every relation (noise over the bound on one contribution); price it under the
    relation the schedule satisfies: a schedule that fixes the population and the cohort size
    (``MinSeparation`` with a fixed number per round, ``Cyclic``) satisfies zero-out
    (``REPLACE_SPECIAL``) and ``REPLACE_ONE``, not add/remove (an added client could push
    another out of a round).

    Args:
        strategy: as for :func:`bandmf_sensitivity`.
        noise_multiplier: the mechanism's z (stddev of ``Z`` / clip norm), finite, > 0.
        rounds: T, the rounds the run releases.
        participation: :class:`MinSeparation`, :class:`Cyclic` or :class:`CyclicPoisson`.
        neighboring_relation: the relation it will be priced under (validated; any of
            ``ADD_OR_REMOVE_ONE``, ``REPLACE_SPECIAL``, ``REPLACE_ONE``).
    """
    z = _noise(noise_multiplier)
    _relation(neighboring_relation)
    return _priced(strategy, rounds, participation)[0].event(z)


def bandmf_round_events(strategy: Any, *, noise_multiplier: float, rounds: int,
                        participation: Any,
                        neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE
                        ) -> tuple[DpEvent, ...]:
    """One event per round whose composition is priced exactly as :func:`bandmf_event`, to
    charge on a ledger before each round's noise (``NoOpDpEvent`` rounds charge nothing).

    Where the sensitivity is exact through the uniform pattern (banded Toeplitz, rounds at
    least b apart or monotone coefficients), round ``r``'s event is the Gaussian whose
    ``1 / z_r^2`` is what row ``r`` adds to ``sens^2 / z^2``: the first ``r + 1`` charges then
    price exactly the first ``r + 1`` releases. ``CyclicPoisson``: the amplified block event
    in rounds ``0, g, 2g, ...`` (every group's ``m``-th block starts no earlier). Otherwise the
    whole run's event in round 0.
    """
    z = _noise(noise_multiplier)
    _relation(neighboring_relation)
    priced, st, schema = _priced(strategy, rounds, participation)
    t = st.rounds
    noop: DpEvent = NoOpDpEvent()
    if isinstance(schema, CyclicPoisson):
        one = priced.block_event(z)
        return tuple(one if r % int(schema.groups) == 0 else noop for r in range(t))
    s = int(schema.min_separation if isinstance(schema, MinSeparation) else schema.groups)
    k = min(int(getattr(schema, "max_participations", t)), -(-t // s))
    if st.coefficients is None or not (s >= st.bandwidth or st.monotone):
        return (priced.event(z),) + (noop,) * (t - 1)
    c = st.coefficients
    rows = np.zeros(t)
    for start in _uniform(t, s, k):  # row r of C 1_pi: the uniform pattern's entries
        stop = min(t, start + c.size)
        rows[start:stop] += c[: stop - start]
    return tuple(GaussianDpEvent(z / abs(v)) if v != 0 else noop for v in rows)


# ------------------------------------------------------------------ assumptions
def bandmf_assumptions(participation: Any,
                       neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE
                       ) -> tuple[str, ...]:
    """What a banded-MF epsilon assumes, one phrase each (reports print them).

    Example:
        >>> for line in bandmf_assumptions(MinSeparation(10, 3))[1:3]:
        ...     print(line[:76])
        participation enforced by the server: at most 3 rounds per client, any two a
        updates may depend on earlier releases (adaptive streams), never on who else
    """
    schema = _schema(participation)
    rel = _relation(neighboring_relation)
    out = ["trusted aggregator: it clips, sums and adds the correlated noise itself and keeps "
           "the noise state secret (privkit.mechanisms.BANDMF_TRUST_ASSUMPTION)"]
    if isinstance(schema, MinSeparation):
        out.append(f"participation enforced by the server: at most "
                   f"{schema.max_participations} rounds per client, any two at least "
                   f"{schema.min_separation} rounds apart; the server knows who took part "
                   "(no amplification: the epsilon holds against it)")
    else:
        out.append(f"clients split into {schema.groups} fixed groups before training, "
                   f"independently of the data; round t serves group t mod {schema.groups}")
    if isinstance(schema, CyclicPoisson):
        out.append(f"within the round's group each client takes part independently with "
                   f"probability {schema.sampling_probability}, and who took part stays "
                   "secret (amplification used; against the server that draws the sample, "
                   "the Cyclic schema's unamplified epsilon holds)")
    elif isinstance(schema, Cyclic):
        out.append("the server may pick any subset of the round's group (no amplification)")
    out.append("updates may depend on earlier releases (adaptive streams), never on who "
               "else took part")
    out.append("neighbouring relation: " + {
        "ADD_OR_REMOVE_ONE": "add or remove one client with all its rounds",
        "REPLACE_SPECIAL": "zero-out: one client's data replaced by a null contribution in "
                           "the same rounds (the population and the schedule are public and "
                           "never depend on the data)",
        "REPLACE_ONE": "replace one client's data by another's in the same rounds "
                       "(sensitivity twice the clip norm per participation)"}[rel.name])
    return tuple(out)


# ------------------------------------------------------------------ calibration
@dataclass(frozen=True)
class BandMFCalibration:
    """A calibrated noise multiplier for a banded-MF run, and what it was verified at.

    ``noise_multiplier`` is the mechanism's z (stddev of ``Z`` / clip norm); ``event`` is
    :func:`bandmf_event` at it, whose epsilon (``epsilon``, by ``method``) is <= the target.
    ``sensitivity`` is the whole-run sensitivity (or, for ``CyclicPoisson``, the largest
    column norm the blocks are priced with).
    """

    noise_multiplier: float
    epsilon: float
    delta: float
    method: str
    target_epsilon: float
    sensitivity: float
    event: DpEvent


def calibrate_bandmf(strategy: Any, *, target_epsilon: float, delta: float, rounds: int,
                     participation: Any,
                     neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE,
                     tol: float = 1e-6) -> BandMFCalibration:
    """The smallest noise multiplier (to relative ``tol``, on the safe side) whose run meets
    ``target_epsilon`` at ``delta``, by :func:`privkit.calibrate_noise` on
    :func:`bandmf_event` (exact Gaussian pricing, or privkit's PLD for ``CyclicPoisson``).

    Example:
        >>> r = calibrate_bandmf((1.0,), target_epsilon=2.0, delta=1e-5, rounds=100,
        ...                      participation=MinSeparation(10, 10))
        >>> round(r.noise_multiplier, 4), r.epsilon <= 2.0, r.method
        (6.305, True, 'exact')
    """
    from privkit.accountants.calibration import calibrate_noise

    target = _validate.positive("target_epsilon", target_epsilon)
    d = _validate.delta("delta", delta)
    rel = _relation(neighboring_relation)
    priced = _priced(strategy, rounds, participation)[0]
    guess = priced.sensitivity * _scale(rel)
    z, eps, method = calibrate_noise(priced.event, target_epsilon=target,
                                     delta=d, tol=tol, initial_guess=guess,
                                     neighboring_relation=rel)
    event = priced.event(z)
    check = epsilon(event, d, neighboring_relation=rel)
    if check.epsilon > target:  # cannot happen: the same event was priced; guard anyway
        raise NumericalError("calibration failed to verify its answer")
    return BandMFCalibration(z, eps, d, method, target, priced.sensitivity, event)
