"""Renyi-DP accounting with the Balle et al. (2020) conversion.

RDP curves are additive under composition. The conversion to (epsilon, delta)
is Balle, Barthe, Gaboardi, Hsu & Sato, AISTATS 2020, Theorem 21 (the one
dp-accounting and Opacus use)::

    eps(delta) = min_a [ R(a) + log((a-1)/a) - (log delta + log a)/(a - 1) ]

Order grid: :data:`ORDERS` = 1.01..1.09 (needed at large rho, where the optimal
order is ~1 + sqrt(log(1/delta)/rho)), then dp-accounting's default grid
(1.1..10.9 by 0.1, 11..63, 128, 256, 512, 1024). No order below 1 + 1e-6 is ever
used (an order of 1 + 1e-8 makes the conversion report epsilon 0). For a pure
Gaussian composition (R(a) = a rho) the order is also optimised continuously.
"""

from __future__ import annotations

import math

import numpy as np

from privkit._lazy import LazyModule
from privkit.errors import NumericalError

optimize = LazyModule("scipy.optimize")

__all__ = [
    "ORDERS",
    "epsilon_from_rdp",
    "delta_from_rdp",
    "gaussian_rdp_epsilon",
    "gaussian_rdp_delta",
]

ORDERS: np.ndarray = np.array(
    [1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08, 1.09]
    + [1 + x / 10.0 for x in range(1, 100)]
    + list(range(11, 64))
    + [128, 256, 512, 1024],
    dtype=np.float64,
)
_MIN_ORDER = 1 + 1e-6


def _terms(orders: np.ndarray, rdp: np.ndarray, log_delta: float) -> np.ndarray:
    a = orders
    return rdp + np.log1p(-1 / a) - (log_delta + np.log(a)) / (a - 1)


def epsilon_from_rdp(orders: np.ndarray, rdp: np.ndarray, delta: float) -> tuple[float, float]:
    """(epsilon, optimal order) by Balle et al. 2020 Thm 21; raises on <= 0 or NaN."""
    orders = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    if (orders < _MIN_ORDER).any():
        raise NumericalError(f"RDP orders must be >= {_MIN_ORDER}")
    if (rdp < 0).any():
        raise NumericalError("RDP curve has negative values")
    # An order whose RDP came out NaN (a series that failed at extreme parameters) is unusable,
    # not fatal: the other orders still give a valid bound.
    rdp = np.where(np.isnan(rdp), np.inf, rdp)
    if np.isinf(rdp).all():
        return math.inf, float(orders[0])
    vals = _terms(orders, rdp, math.log(delta))
    i = int(np.nanargmin(vals))
    eps = float(vals[i])
    if not eps > 0:
        # The bound delta(eps) <= exp((a-1)(R(a) - eps)) (1-1/a)^a / (a-1) decreases in eps, so
        # a root below 0 means delta(0) <= delta already: the guarantee is (0, delta). Checked
        # at eps = 0 directly rather than assumed.
        if delta_from_rdp(orders, rdp, 0.0)[0] <= delta:
            return 0.0, float(orders[i])
        raise NumericalError(f"RDP conversion gave epsilon {eps} <= 0 and did not verify")
    return eps, float(orders[i])


def delta_from_rdp(orders: np.ndarray, rdp: np.ndarray, epsilon: float) -> tuple[float, float]:
    """(delta, optimal order), inverting Thm 21 at each order; capped at 1."""
    a = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    if math.isinf(epsilon):
        return 0.0, float(a[-1])
    with np.errstate(invalid="ignore"):
        log_d = (a - 1) * (rdp - epsilon + np.log1p(-1 / a)) - np.log(a)
    log_d = np.where(np.isnan(log_d), np.inf, log_d)
    i = int(np.argmin(log_d))
    return float(min(1.0, math.exp(min(log_d[i], 0.0)))), float(a[i])


def gaussian_rdp_epsilon(rho: float, delta: float) -> tuple[float, float]:
    """Thm 21 conversion for R(a) = a*rho, optimised over every real order > 1."""
    if math.isinf(rho):
        return math.inf, 1.0
    grid_eps, grid_a = epsilon_from_rdp(ORDERS, ORDERS * rho, delta)
    ld = math.log(delta)

    def f(log_am1: float) -> float:
        a = 1 + math.exp(log_am1)
        return a * rho + math.log1p(-1 / a) - (ld + math.log(a)) / (a - 1)

    # f is smooth and unimodal in log(a - 1); search around the best grid order.
    x0 = math.log(grid_a - 1)
    res = optimize.minimize_scalar(
        f, bounds=(max(math.log(_MIN_ORDER - 1), x0 - 2.0), x0 + 2.0), method="bounded",
        options={"xatol": 1e-10},
    )
    if res.success and res.fun < grid_eps:
        return float(res.fun), 1 + math.exp(float(res.x))
    return grid_eps, grid_a


def gaussian_rdp_delta(rho: float, epsilon: float) -> tuple[float, float]:
    """delta(epsilon) for R(a) = a*rho on the order grid."""
    return delta_from_rdp(ORDERS, ORDERS * rho, epsilon)
