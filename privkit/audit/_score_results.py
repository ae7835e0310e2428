"""What a score method answers, and the argument checks every method shares.

:class:`EpsilonLowerBound` (a bound at a confidence, under stated assumptions) and
:class:`EpsilonEstimate` (a labelled estimate), their JSON form, the checks of scores,
confidence and delta, and the conversion of a Gaussian separation ``mu`` to epsilon. Apart
from the methods of :mod:`privkit.audit.scores` (threshold tests there, the one-run and
Gaussian methods in their own modules) because all of them build on it; the public names are
exported from there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError

__all__ = ["DEFAULT_CONFIDENCE", "EpsilonLowerBound", "EpsilonEstimate"]

DEFAULT_CONFIDENCE = 0.95
"""Confidence of every bound unless said otherwise (the usual 95% of the auditing papers)."""


@dataclasses.dataclass(frozen=True)
class EpsilonLowerBound:
    """A lower bound on epsilon at ``delta``, holding with probability >= ``confidence``.

    Attributes:
        epsilon_lower_bound: the bound (>= 0; 0 when the scores show nothing).
        method: ``clopper-pearson``, ``gdp``, ``one-run`` or ``gaussian-one-run``.
        confidence: the probability the bound holds, over the randomness of the run(s).
        delta: the delta the epsilon is at.
        assumptions: what the bound assumes, as sentences; it is a bound only under them.
        counts: the numbers it used (sample sizes, threshold, counts, levels, ...).
        mu_lower_bound: for ``gdp`` and ``gaussian-one-run``, the bound on the Gaussian
            separation ``mu`` the epsilon was converted from; None otherwise.
    """

    epsilon_lower_bound: float
    method: str
    confidence: float
    delta: float
    assumptions: tuple[str, ...]
    counts: Mapping[str, Any]
    mu_lower_bound: float | None = None

    def exceeds(self, accounted_epsilon: float) -> bool:
        """Whether this lower bound is above an accounted (upper-bound) epsilon at the same
        delta: the run is not what its accounting says (with this bound's confidence)."""
        return self.epsilon_lower_bound > _validate.nonnegative("accounted_epsilon",
                                                                accounted_epsilon)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"kind": "lower_bound", "method": self.method,
                "epsilon_lower_bound": self.epsilon_lower_bound,
                "confidence": self.confidence, "delta": self.delta,
                "mu_lower_bound": self.mu_lower_bound,
                "assumptions": list(self.assumptions), "counts": _plain(self.counts)}


@dataclasses.dataclass(frozen=True)
class EpsilonEstimate:
    """An **estimate** of epsilon: no confidence statement makes it a bound.

    Attributes:
        epsilon_estimate: the point estimate.
        method: how it was computed.
        delta: the delta the epsilon is at.
        assumptions: what the estimate takes for granted.
        counts: the numbers it used.
        interval: bootstrap quantiles of the estimate (the spread of the estimator under
            resampling, not a confidence interval on the true epsilon), or None.
    """

    epsilon_estimate: float
    method: str
    delta: float
    assumptions: tuple[str, ...]
    counts: Mapping[str, Any]
    interval: tuple[float, ...] | None = None

    note = "an estimate, not a bound"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"kind": "estimate", "method": self.method,
                "epsilon_estimate": self.epsilon_estimate, "delta": self.delta,
                "interval": None if self.interval is None else list(self.interval),
                "note": self.note, "assumptions": list(self.assumptions),
                "counts": _plain(self.counts)}


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


# ------------------------------------------------------------------ argument checks
def _scores(name: str, value: Any, minimum: int = 1) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidParameterError(name, type(value).__name__,
                                    "a 1-D sequence of real scores") from None
    if arr.ndim != 1 or arr.size < minimum:
        raise InvalidParameterError(name, f"shape {arr.shape}",
                                    f"a 1-D sequence of at least {minimum} scores")
    if not np.isfinite(arr).all():
        raise InvalidParameterError(name, float(arr[~np.isfinite(arr)][0]), "finite scores")
    return arr


def _confidence(value: Any) -> float:
    c = _validate.real("confidence", value)
    if not 0.0 < c < 1.0:
        raise InvalidParameterError("confidence", value, "in the open interval (0, 1)")
    return c


def _delta(value: Any, *, zero: bool) -> float:
    d = _validate.real("delta", value)
    if not ((0.0 <= d < 1.0) if zero else (0.0 < d < 1.0)):
        raise InvalidParameterError("delta", value, "in [0, 1)" if zero else "in (0, 1)")
    return d


def _eps_of_mu(mu: float, delta: float) -> float:
    if not mu > 0:
        return 0.0
    from privkit.accountants.gaussian import exact_epsilon

    return float(exact_epsilon(mu, delta))
