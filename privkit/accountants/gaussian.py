"""Closed forms for compositions of (non-subsampled) Gaussian mechanisms.

Two accountants live here, both vectorised over clients (numpy broadcasting):

* the **exact** analytic Gaussian: M releases with noise multipliers z_m compose
  *exactly* to one Gaussian mechanism with ``gdp_mu = sqrt(sum_m 1/z_m^2)``
  (Dong, Roth & Su 2022, mu-GDP composition), whose privacy profile is
  ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``
  (Balle & Wang, ICML 2018, Thm 8). This is the tightest possible bound.
* the **moments-accountant closed form** of Upcycled-FL Theorem C.1,
  ``eps = rho + 2 sqrt(rho log(1/delta))`` with ``rho = sum_m 1/(2 z_m^2)``: the
  zCDP conversion of Bun & Steinke (TCC 2016), a valid but looser upper bound,
  kept under its own name for reproducing the paper's numbers.

Units: ``gdp_mu`` is dimensionless; ``rho`` is the zCDP parameter (nats);
epsilon is in nats.

Example:
    >>> round(float(exact_epsilon(gdp_mu=10.0, delta=1e-5)), 4)  # z=1, M=100
    91.8173
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from privkit import _validate
from privkit._numerics import log1mexp, log1mexp_scalar, log_ndtr, special
from privkit.errors import InvalidParameterError, NumericalError

__all__ = [
    "exact_log_delta",
    "exact_delta",
    "exact_epsilon",
    "moments_epsilon",
    "moments_delta",
    "theorem_c1_epsilon",
    "theorem_c1_stddev",
]

_BISECTION_STEPS = 200
_SCALAR_BELOW = 32  # arrays this small use the scalar Newton path


def _mu_array(gdp_mu: Any) -> np.ndarray:
    mu = np.asarray(gdp_mu, dtype=np.float64)
    if np.isnan(mu).any() or (mu < 0).any():
        bad = mu[np.isnan(mu) | (mu < 0)].ravel()[0]
        raise InvalidParameterError("gdp_mu", float(bad), ">= 0 (inf allowed) in every entry")
    return mu


@functools.cache
def _gauss_legendre_12() -> tuple[np.ndarray, np.ndarray]:
    # on first use: importing numpy.polynomial at import time costs privkit's start-up
    return np.polynomial.legendre.leggauss(12)  # type: ignore[no-any-return]


def _log_ndtr_drop(x: Any, mu: Any, a: Any) -> Any:
    """log Phi(x - mu) - log Phi(x) (<= 0) without cancellation, given a = log Phi(x).

    The plain difference of two log_ndtr values loses all relative precision when it is tiny
    (mu ~ 1e-8: both are ~ -8 and differ by ~1e-7), which made the exact delta too small at
    huge noise. Where the drop is small it is log1p(-D / Phi(x)) with D = Phi(x) - Phi(x - mu)
    integrated by 12-point Gauss-Legendre over [x - mu, x] (the density changes by at most
    e^(|x| mu) ~ 1 there, so the rule is exact to rounding)."""
    x = np.asarray(x, dtype=np.float64)
    mu = np.asarray(mu, dtype=np.float64)
    plain = log_ndtr(x - mu) - a
    small = (plain > -0.5) & (np.abs(x) * mu < 1.0) & (mu > 0)
    if not np.any(small):
        return plain
    xs, ms, as_ = (np.broadcast_to(v, plain.shape)[small] for v in (x, mu, a))
    mid = xs - ms / 2
    gl_x, gl_w = _gauss_legendre_12()
    nodes = mid[:, None] + (ms / 2)[:, None] * gl_x[None, :]
    dens = np.exp(-0.5 * nodes * nodes) / math.sqrt(2 * math.pi)
    d = (ms / 2) * (dens * gl_w[None, :]).sum(axis=1)
    out = np.array(plain, dtype=np.float64, copy=True)
    out[small] = np.log1p(-d / np.exp(as_))
    return out


def exact_log_delta(gdp_mu: Any, epsilon: Any) -> np.ndarray:
    """log delta(epsilon) of a mu-GDP mechanism, finite even at eps ~ 2300.

    Uses ``log delta = A + log(1 - exp(eps + B - A))`` with
    ``A = log Phi(-eps/mu + mu/2)`` and ``B = log Phi(-eps/mu - mu/2)``.
    ``gdp_mu = 0`` gives ``-inf`` (no privacy loss); ``gdp_mu = inf`` gives 0
    (delta = 1) for every finite epsilon.
    """
    mu = _mu_array(gdp_mu)
    eps = np.asarray(epsilon, dtype=np.float64)
    if np.isnan(eps).any() or (eps < 0).any():
        raise InvalidParameterError("epsilon", epsilon, ">= 0 in every entry")
    mu, eps = np.broadcast_arrays(mu, eps)
    out = np.full(mu.shape, -np.inf)
    inf_mu = np.isinf(mu) & np.isfinite(eps)
    out[inf_mu] = 0.0
    ok = (mu > 0) & np.isfinite(mu) & np.isfinite(eps)
    if ok.any():
        m, e = mu[ok], eps[ok]
        x = -e / m + m / 2
        a = log_ndtr(x)
        with np.errstate(invalid="ignore"):
            drop = _log_ndtr_drop(x, m, a)  # log Phi(-e/m - m/2) - a
            val = a + log1mexp(np.minimum(e + drop, 0.0))
        out[ok] = np.where(np.isneginf(a), -np.inf, val)  # Phi underflows: delta is 0
    if np.isnan(out).any():
        raise NumericalError(f"exact Gaussian delta is NaN at gdp_mu={gdp_mu}, epsilon={epsilon}")
    return out


def exact_delta(gdp_mu: Any, epsilon: Any) -> np.ndarray | float:
    """delta(epsilon) of the exact analytic Gaussian (vectorised)."""
    out = np.exp(exact_log_delta(gdp_mu, epsilon))
    return float(out) if out.ndim == 0 else out


def exact_epsilon(gdp_mu: Any, delta: float) -> np.ndarray | float:
    """Smallest epsilon with delta(epsilon) <= ``delta`` for a mu-GDP mechanism.

    The returned value is the upper end of a bracket that shrinks to ~1e-14
    relative, so ``exact_delta(gdp_mu, result) <= delta`` always holds (an
    upper bound, tight to rounding). Scalars use safeguarded Newton steps on
    log delta (a few microseconds); arrays use vectorised bisection.
    ``gdp_mu = inf`` gives inf; epsilon 0 is returned only when delta(0) <= delta.

    Args:
        gdp_mu: sqrt(sum_m (sensitivity_m / stddev_m)^2) = sqrt(M)/z for M equal steps.
        delta: target delta in (0, 1).
    """
    d = _validate.delta("delta", delta)
    mu = _mu_array(gdp_mu)
    if mu.ndim == 0:
        m = float(mu)
        if m == 0:
            return 0.0
        return math.inf if math.isinf(m) else _exact_epsilon_scalar(m, d)
    out = np.full(mu.shape, np.inf)
    out[mu == 0] = 0.0
    fin = (mu > 0) & np.isfinite(mu)
    if 0 < fin.sum() <= _SCALAR_BELOW:  # a few entries: Newton per entry beats bisection
        out[fin] = [_exact_epsilon_scalar(float(m), d) for m in mu[fin]]
    elif fin.any():
        out[fin] = _exact_epsilon_bisect(mu[fin], d)
    return out


def _tail_upper(mu: Any, d: float) -> Any:
    # delta(eps) <= Phi(-eps/mu + mu/2), so eps = mu (mu/2 - Phi^-1(d)) is an
    # upper bound; the caller still verifies it (and doubles it if needed).
    return np.maximum(mu * (mu / 2 - float(special.ndtri(d))), 1e-300)


def _scalar_log_delta(mu: float, eps: float) -> tuple[float, float]:
    x = -eps / mu + mu / 2
    a = float(log_ndtr(x))
    if a == -math.inf:
        return -math.inf, -math.inf
    drop = float(_log_ndtr_drop(x, mu, a))
    return a + log1mexp_scalar(min(eps + drop, 0.0)), a + drop


def _exact_epsilon_scalar(mu: float, d: float, rtol: float = 4e-15) -> float:
    if math.exp(_scalar_log_delta(mu, 0.0)[0]) <= d:
        return 0.0
    lt = math.log(d)
    lo, hi = 0.0, float(_tail_upper(mu, d))
    while math.exp(_scalar_log_delta(mu, hi)[0]) > d:
        hi *= 2
    x = hi
    for _ in range(_BISECTION_STEPS):
        ld, b = _scalar_log_delta(mu, x)
        if math.exp(ld) > d:  # compared exactly as exact_delta reports it
            lo = x
        else:
            hi = x
        if hi - lo <= rtol * hi:
            break
        slope = -math.exp(x + b - ld)  # d log(delta) / d eps
        if not slope < 0:  # underflow (eps ~ 0): bisect
            x = 0.5 * (lo + hi)
            continue
        xn = x - (ld - lt) / slope
        xn += 0.5 * rtol * hi if xn >= x else -0.5 * rtol * hi  # aim just past the root
        x = xn if lo < xn < hi else 0.5 * (lo + hi)
    return hi


def _exact_epsilon_bisect(m: np.ndarray, d: float) -> np.ndarray:
    lo = np.zeros_like(m)
    hi = _tail_upper(m, d)
    while True:
        bad = np.exp(exact_log_delta(m, hi)) > d
        if not bad.any():
            break
        hi = np.where(bad, 2 * hi, hi)
    # Compared in linear space, exactly as exact_delta reports it.
    done0 = np.exp(exact_log_delta(m, lo)) <= d  # epsilon 0 already suffices
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if not ((mid > lo) & (mid < hi)).any():
            break
        good = np.exp(exact_log_delta(m, mid)) <= d
        hi = np.where(good, mid, hi)
        lo = np.where(good, lo, mid)
    return np.where(done0, 0.0, hi)


def _rho_array(rho: Any) -> np.ndarray:
    r = np.asarray(rho, dtype=np.float64)
    if np.isnan(r).any() or (r < 0).any():
        raise InvalidParameterError("rho", rho, ">= 0 (inf allowed) in every entry")
    return r


def moments_epsilon(rho: Any, delta: float) -> np.ndarray | float:
    """The zCDP / moments-accountant closed form ``rho + 2 sqrt(rho log(1/delta))``.

    This is Upcycled-FL Theorem C.1's bound (there written with
    ``rho = M tau^2 / (2 sigma^2 |D|^2)``), valid for any Gaussian composition
    with total zCDP ``rho = sum_m 1/(2 z_m^2)`` (Bun & Steinke 2016, Prop. 1.3).
    """
    d = _validate.delta("delta", delta)
    r = _rho_array(rho)
    out = r + 2 * np.sqrt(r * math.log(1 / d))
    return float(out) if out.ndim == 0 else out


def moments_delta(rho: Any, epsilon: Any) -> np.ndarray | float:
    """Inverse of :func:`moments_epsilon`.

    ``delta = exp(-(eps - rho)^2 / (4 rho))`` for eps >= rho, else 1.
    """
    r = _rho_array(rho)
    e = np.asarray(epsilon, dtype=np.float64)
    if np.isnan(e).any() or (e < 0).any():
        raise InvalidParameterError("epsilon", epsilon, ">= 0 in every entry")
    r, e = np.broadcast_arrays(r, e)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = np.where(e >= r, np.exp(-((e - r) ** 2) / (4 * r)), 1.0)
    out = np.where(r == 0, 0.0, out)
    out = np.where(np.isinf(r) & np.isfinite(e), 1.0, out)
    out = np.where(np.isinf(e) & np.isfinite(r), 0.0, out)
    return float(out) if out.ndim == 0 else out


def theorem_c1_epsilon(
    *, num_releases: int, l2_clip_norm: float, stddev: float, dataset_size: int, delta: float
) -> float:
    """Upcycled-FL Theorem C.1 as printed: ``eps = a + 2 sqrt(a ln(1/delta))``.

    ``a = M tau^2 / (2 sigma^2 |D|^2)``. The theorem assumes the sensitivity of a
    release is ``tau/|D|`` (``Sensitivity.PAPER``): it holds only when the
    clipped model is an average of per-example terms of norm <= tau. Label any
    number it produces as the paper's.

    Example:
        >>> round(theorem_c1_epsilon(num_releases=40, l2_clip_norm=10.0, stddev=0.8,
        ...                          dataset_size=224, delta=1e-3), 6)
        1.374104
    """
    m = _validate.positive_int("num_releases", num_releases)
    tau = _validate.positive("l2_clip_norm", l2_clip_norm)
    sigma = _validate.positive("stddev", stddev)
    n = _validate.positive_int("dataset_size", dataset_size)
    a = m * tau**2 / (2 * sigma**2 * n**2)
    return float(moments_epsilon(a, delta))


def theorem_c1_stddev(
    *,
    num_releases: int,
    l2_clip_norm: float,
    dataset_size: int,
    target_epsilon: float,
    delta: float,
) -> float:
    """Inverse of Theorem C.1: the stddev sigma that gives ``target_epsilon`` exactly.

    Solving ``a + 2 sqrt(a L) = eps`` (L = ln 1/delta) gives
    ``sqrt(a) = sqrt(L + eps) - sqrt(L)``; then ``sigma = tau sqrt(M / (2 a)) / |D|``.
    """
    m = _validate.positive_int("num_releases", num_releases)
    tau = _validate.positive("l2_clip_norm", l2_clip_norm)
    n = _validate.positive_int("dataset_size", dataset_size)
    eps = _validate.positive("target_epsilon", target_epsilon)
    ln = math.log(1 / _validate.delta("delta", delta))
    sqrt_a = math.sqrt(ln + eps) - math.sqrt(ln)
    return tau * math.sqrt(m / 2) / (sqrt_a * n)
