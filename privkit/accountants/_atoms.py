"""The atoms privkit's own PLD (:mod:`privkit.accountants.fftpld`) prices: plain data, kept
apart from the PLD so that importing the pricing rules does not load it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GaussianAtom", "PureAtom"]


@dataclass(frozen=True)
class GaussianAtom:
    """One use of the Gaussian mechanism (``q = 1``) or its Poisson-subsampled version.

    Attributes:
        noise_multiplier: z = stddev / sensitivity, > 0.
        sampling_probability: q in (0, 1].
    """

    noise_multiplier: float
    sampling_probability: float = 1.0


@dataclass(frozen=True)
class PureAtom:
    """One use of an epsilon-DP mechanism, priced as randomized response RR(epsilon)."""

    epsilon: float
