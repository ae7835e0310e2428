"""What an audit returns (:class:`AuditResult`) and the helpers every audit uses.

The helpers spawn the audit's independent generators from one seed and measure the clipped
centres of two neighbouring inputs with the real mechanism (refusing when its noise is not
additive and input independent, which the audits' batched draws rely on).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from privkit.errors import NumericalError

__all__ = ["AuditResult", "REPORT_DELTA", "RAW_NORM"]

REPORT_DELTA = 1e-5
"""delta at which the Gaussian audit converts gdp_mu into epsilon."""

RAW_NORM = 1000.0  # raw input norm, far above every clip norm: clipping is exercised

_CENTRE_SEEDS = 16  # seeds used to measure the clipped centres / check additivity
_ADDITIVITY_RTOL = 1e-9


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """Outcome of one audit.

    Attributes:
        mechanism: the audited name (one of :data:`ALL_MECHANISMS`).
        claimed_epsilon: epsilon the mechanism claims for one use (for ``gaussian``
            the exact epsilon of its gdp_mu at ``delta = 1e-5``; for ``rec`` the Renyi D_2
            and for ``coded`` the MI-DP bound, both in nats).
        empirical_epsilon_lower: the audit's lower bound on the true epsilon, at
            confidence ``1 - alpha`` (clamped at 0; for ``gaussian`` converted from
            ``gdp_mu_lb`` the same way as the claim).
        passed: True when no violation was found (lower bound <= claim).
        trials: draws per neighbour (per half for threshold audits).
        noise_scale: factor on the noise (1.0 = the real mechanism; < 1 builds a
            deliberately broken one).
        statistic: the test that was run.
        details: JSON-ready numbers behind the verdict (counts, bounds, threshold,
            the mechanism's settings, the seed entropy, seconds).
    """

    mechanism: str
    claimed_epsilon: float
    empirical_epsilon_lower: float
    passed: bool
    trials: int
    noise_scale: float
    statistic: str
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``details`` copied)."""
        return {
            "mechanism": self.mechanism,
            "claimed_epsilon": self.claimed_epsilon,
            "empirical_epsilon_lower": self.empirical_epsilon_lower,
            "passed": self.passed,
            "trials": self.trials,
            "noise_scale": self.noise_scale,
            "statistic": self.statistic,
            "details": dict(self.details),
        }


def _spawn(seed: int | None, k: int) -> tuple[int, list[np.random.Generator]]:
    ss = np.random.SeedSequence(seed)
    entropy = int(ss.entropy)  # type: ignore[arg-type]  # an int for int or None seeds
    return entropy, [np.random.default_rng(c) for c in ss.spawn(k)]


def _measured_difference(
    call_a: Callable[[np.random.Generator], Any],
    call_b: Callable[[np.random.Generator], Any],
    seed_rng: np.random.Generator,
    what: str,
) -> np.ndarray:
    """``call_b(rng_s) - call_a(rng_s)`` for fresh seeds s; refuses if it varies with s.

    A constant difference means the noise is additive and does not depend on the
    input, which is what lets the audit batch or couple its draws.
    """
    seeds = seed_rng.integers(0, 2**63 - 1, size=_CENTRE_SEEDS)
    diffs, scale = [], 0.0
    for s in seeds:
        a = np.asarray(call_a(np.random.default_rng(int(s))), dtype=np.float64)
        b = np.asarray(call_b(np.random.default_rng(int(s))), dtype=np.float64)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise NumericalError(f"audit: the mechanism returned a non-finite output ({what})")
        diffs.append(b - a)
        scale = max(scale, float(np.max(np.abs(a))), float(np.max(np.abs(b))))
    d = np.stack(diffs)
    spread = float(np.max(np.abs(d - d[0])))
    if spread > _ADDITIVITY_RTOL * max(scale, 1.0):
        raise NumericalError(
            f"audit: M(x; rng) - M(x'; rng) varies with the seed ({what}; spread {spread:.3g}): "
            "the noise is not additive and input independent, so this audit does not apply"
        )
    return d.mean(axis=0)


def _direction(d: int) -> np.ndarray:
    return np.full(d, 1.0 / math.sqrt(d))
