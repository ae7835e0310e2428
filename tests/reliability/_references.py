"""Independent reference values for the no-under-reporting property tests.

Each function here is written without privkit's accountant code, so that a bug there cannot
hide in the reference:

* :func:`gaussian_delta_mp`: the exact privacy profile of a mu-GDP (non-subsampled Gaussian)
  composition, delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Balle & Wang
  2018), in mpmath at 60 digits (no cancellation problem at any eps).
* :func:`pure_delta`: the exact optimal-composition profile of k-fold randomized response
  RR(eps0) (Kairouz, Oh & Viswanath 2015, Thm 3.3) from scipy's binomial log-pmf: a sum of
  positive terms in log space; for several distinct epsilons, the exact profile of the
  product of the RR(eps_j) (the worst case over eps_j-DP mechanisms), summed over the full
  product lattice. :func:`pure_delta_mp` is the one-epsilon sum in mpmath (small k).
* :func:`optimistic_pld`: dp-accounting's *optimistic* privacy-loss distribution, a lower
  bound on the true privacy curve at any discretisation (losses are rounded down), used for
  events without a closed form (Poisson-subsampled Gaussian, Laplace).

A reported epsilon ``e`` at ``delta`` never under-reports iff the true delta at ``e`` is
<= ``delta``; :func:`eps_from_delta_fn` inverts a reference profile by bisection where an
epsilon is needed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import mpmath
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import special, stats

_MP_DPS = 60


def gaussian_delta_mp(mu: float, eps: float) -> float:
    """Exact delta(eps) of a mu-GDP mechanism (mpmath, 60 digits), as a float."""
    with mpmath.workdps(_MP_DPS):
        m, e = mpmath.mpf(mu), mpmath.mpf(eps)
        a = mpmath.ncdf(-e / m + m / 2)
        b = mpmath.ncdf(-e / m - m / 2)
        return float(a - mpmath.exp(e) * b)


def _rr_log_probs(eps0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log p, log q of RR(eps0): p = e^eps0 / (1 + e^eps0)."""
    return -np.logaddexp(0.0, -eps0), -np.logaddexp(0.0, eps0)


def pure_delta(terms: Sequence[tuple[float, int]], eps: float) -> float:
    """Exact delta(eps) of the product of RR(eps_j), count_j times each (<= 2 distinct eps_j).

    The privacy loss is L = sum_j (count_j - 2 l_j) eps_j with l_j ~ Binomial(count_j, q_j)
    under P; delta(eps) = E_P[(1 - e^(eps - L))_+], a sum of positive terms.
    """
    if len(terms) > 2:
        raise ValueError("at most two distinct epsilons")
    grids, losses = [], []
    for e0, k in terms:
        ell = np.arange(k + 1)
        q = float(np.exp(_rr_log_probs(np.array(e0))[1]))
        grids.append(stats.binom.logpmf(ell, k, q))
        losses.append((k - 2.0 * ell) * e0)
    if len(terms) == 1:
        logw, loss = grids[0], losses[0]
    else:
        logw = (grids[0][:, None] + grids[1][None, :]).ravel()
        loss = (losses[0][:, None] + losses[1][None, :]).ravel()
    keep = loss > eps
    if not keep.any():
        return 0.0
    with np.errstate(divide="ignore"):
        log_terms = logw[keep] + np.log(-np.expm1(eps - loss[keep]))
    return float(np.exp(special.logsumexp(log_terms)))


def pure_delta_mp(eps0: float, k: int, eps: float) -> float:
    """The one-epsilon KOV sum sum_l C(k,l) [p^(k-l) q^l - e^eps q^(k-l) p^l]_+ in mpmath."""
    with mpmath.workdps(_MP_DPS):
        e0, e = mpmath.mpf(eps0), mpmath.mpf(eps)
        p = mpmath.exp(e0) / (1 + mpmath.exp(e0))
        q = 1 - p
        total = mpmath.mpf(0)
        for ell in range(k + 1):
            t = mpmath.binomial(k, ell) * (p ** (k - ell) * q**ell - mpmath.exp(e) * q ** (k - ell)
                                           * p**ell)
            if t > 0:
                total += t
        return float(total)


def optimistic_pld(kind: str, parameter: float, sampling_probability: float, count: int,
                   vdi: float):
    """dp-accounting's optimistic PLD of ``count`` uses (a lower bound on the true curve).

    ``kind`` is ``gaussian`` (``parameter`` = noise multiplier) or ``laplace`` (``parameter``
    = Laplace scale / sensitivity).
    """
    logging.getLogger().setLevel(logging.ERROR)  # dp-accounting warns on optimistic mode
    if kind == "gaussian":
        one = pld_lib.from_gaussian_mechanism(
            parameter, sampling_prob=sampling_probability, value_discretization_interval=vdi,
            pessimistic_estimate=False, use_connect_dots=False)
    else:
        one = pld_lib.from_laplace_mechanism(
            parameter, sampling_prob=sampling_probability, value_discretization_interval=vdi,
            pessimistic_estimate=False, use_connect_dots=False)
    return one.self_compose(count) if count > 1 else one


def pld_lower_delta(pld, eps: float) -> float:
    """A lower bound on delta(eps) from an optimistic PLD.

    dp-accounting moves the tail mass it truncates (<= 1e-15 per composition) to the loss
    +inf, which adds to every delta; the true events here have no infinite loss, so that
    mass (delta at a huge epsilon) is subtracted.
    """
    return max(0.0, float(pld.get_delta_for_epsilon(eps)) - _infinity_mass(pld))


def pld_lower_epsilon(pld, delta: float) -> float:
    """A lower bound on epsilon(delta) from an optimistic PLD (see :func:`pld_lower_delta`)."""
    return float(pld.get_epsilon_for_delta(delta + _infinity_mass(pld)))


def _infinity_mass(pld) -> float:
    return float(pld.get_delta_for_epsilon(1e9))


def eps_from_delta_fn(delta_fn: Callable[[float], float], delta: float, hi: float) -> float:
    """Smallest eps >= 0 with delta_fn(eps) <= delta, to 1e-12 relative (bisection)."""
    if delta_fn(0.0) <= delta:
        return 0.0
    lo = 0.0
    while delta_fn(hi) > delta:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        if delta_fn(mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
