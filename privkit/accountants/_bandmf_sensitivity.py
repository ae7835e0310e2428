"""The L2 sensitivity of a banded-MF run: the strategy as plain data and the maximisation.

:func:`bandmf_sensitivity` maximises ``sum_{i, j in pi} X_ij <g_i, g_j>`` (``X = C^T C``) over
the participation patterns a schema allows: in closed form, by a DP over the column norms, or
as the two-stage upper bound (the module docstring of :mod:`privkit.accountants.bandmf` states
when each applies). Apart from the events and the calibration because it is the numerical
core, and the only part that reads the strategy's matrix; the public names are exported from
:mod:`privkit.accountants.bandmf`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit import _validate
from privkit.accountants._bandmf_participation import (
    Cyclic,
    CyclicPoisson,
    MinSeparation,
    _schema,
    _spacing,
)
from privkit.errors import InvalidParameterError

__all__ = ["BandMFSensitivity", "bandmf_sensitivity", "MAX_DENSE_ROUNDS"]

#: Largest number of rounds priced with a dense ``X = C^T C`` (a few T x T arrays).
MAX_DENSE_ROUNDS = 2048

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
    s, k = _spacing(schema, t)
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
