"""The wrap-around bound of distributed DP: how likely a round's integer sum leaves the
modulus.

A utility failure, not a privacy one (the released residue is a post-processing of the noisy
sum whatever it is); apart from the RDP bound because nothing prices it, and the calibration
chooses its grid by it. The public names are exported from
:mod:`privkit.accountants.distributed`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from privkit import _validate
from privkit.errors import InvalidParameterError

__all__ = ["skellam_chernoff_tail", "wraparound_probability", "finest_granularity"]


def skellam_chernoff_tail(t: float, variance: float, subgaussian_variance: float = 0.0) -> float:
    """Chernoff bound on ``P(X + Y >= t)`` for ``X ~ Skellam(variance)`` and an independent
    ``Y`` sub-Gaussian with variance proxy ``subgaussian_variance``:
    ``min_theta exp(theta^2 v / 2 + M (cosh theta - 1) - theta t)`` (the Skellam moment
    generating function is ``exp(M (cosh theta - 1))``). 1 when ``t <= 0``.

    Example:
        >>> round(skellam_chernoff_tail(30.0, 100.0), 6)   # 3 standard deviations
        0.01148
    """
    t = _validate.real("t", t)
    m = _validate.nonnegative("variance", variance)
    v = _validate.nonnegative("subgaussian_variance", subgaussian_variance)
    if t <= 0:
        return 1.0
    if m == 0 and v == 0:
        return 0.0

    def slope(th: float) -> float:  # derivative of the convex exponent
        return th * v + m * math.sinh(th) - t

    hi = min(t / v if v > 0 else math.inf, math.asinh(t / m) if m > 0 else math.inf)
    lo = 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if slope(mid) > 0:
            hi = mid
        else:
            lo = mid
    th = lo  # any theta gives a valid bound; lo is the bisection's side below the optimum
    expo = th * th * v / 2 - th * t + (m * (math.cosh(th) - 1) if m > 0 else 0.0)
    return min(1.0, math.exp(expo))


def wraparound_probability(*, clients: int, noise_per_client: float, scaled_clip: float,
                           padded_dim: int, bits: int) -> float:
    """Upper bound on the probability that a round's true integer sum leaves
    ``[-2^(bits-1), 2^(bits-1))`` in some coordinate (the decoded sum then wraps).

    Coordinate ``j`` of the sum is ``R_j + E_j + Z_j``: ``R`` the rotated sum of the scaled,
    clipped updates (norm at most ``n c``; with the public random signs each coordinate is a
    Rademacher sum, sub-Gaussian with variance proxy ``(n c)^2 / d``, Hoeffding), ``E`` the
    rounding errors (``|E_j| < n``, every coordinate moves by less than 1) and
    ``Z ~ Skellam(n mu)``. So ``P(wrap) <= 2 d min_theta exp(theta^2 v / 2 + n mu
    (cosh theta - 1) - theta (m/2 - n))`` (:func:`skellam_chernoff_tail`, union over the ``d``
    coordinates and both signs). ``clients`` is the most contributions a sum holds; fewer
    clients can only lower the bound.

    Example:
        >>> p = wraparound_probability(clients=100, noise_per_client=1e5, scaled_clip=300.0,
        ...                            padded_dim=1024, bits=16)
        >>> p < 1e-9
        True
    """
    n = _validate.positive_int("clients", clients)
    mu = _validate.nonnegative("noise_per_client", noise_per_client)
    c = _validate.positive("scaled_clip", scaled_clip)
    d = _validate.positive_int("padded_dim", padded_dim)
    b = _validate.positive_int("bits", bits)
    t = 2.0 ** (b - 1) - n
    v = (n * c) ** 2 / d
    return min(1.0, 2.0 * d * skellam_chernoff_tail(t, n * mu, v))


def finest_granularity(wrap: Callable[[float], float], *, clip: float, padded_dim: int,
                       max_wrap_probability: float, bits: Any, too_coarse: str) -> float:
    """The finest grid gamma whose wrap-around bound ``wrap(gamma)`` is at most
    ``max_wrap_probability``: the finest grid the int64 norms allow (``(C / gamma + sqrt(d) +
    1)^2 < 2^62`` with room) if it fits, else a bisection on log gamma between it and the
    first of C, 2C, 4C, ... that fits (every standard deviation of the sum scales as
    1 / gamma, so the bound falls as gamma grows; ``wrap`` may return inf for a grid that
    needs more noise than a client may draw). The answer is an evaluated grid that fits.

    Raises:
        InvalidParameterError: naming ``bits`` (the requirement ``too_coarse``): not even
            2^20 C fits.

    Example:
        >>> round(finest_granularity(lambda g: 1e-3 / g, clip=1.0, padded_dim=4,
        ...                          max_wrap_probability=1e-6, bits=16, too_coarse="-"), 1)
        1000.0
    """
    finest = clip / (2.0**30 - math.sqrt(padded_dim) - 2.0)
    if wrap(finest) <= max_wrap_probability:
        return finest
    good = clip
    while wrap(good) > max_wrap_probability:
        good *= 2.0
        if good > clip * 2.0**20:
            raise InvalidParameterError("bits", bits, too_coarse)
    bad = finest
    for _ in range(60):  # wrap(bad) > max >= wrap(good)
        mid = math.sqrt(bad * good)
        if wrap(mid) <= max_wrap_probability:
            good = mid
        else:
            bad = mid
        if good / bad < 1 + 1e-6:
            break
    return good
