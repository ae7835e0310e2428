"""The moments behind DP-REC's RDP bound: ``log m+`` and ``log m-``, computed in log space.

``m+_n(r, c) = E[Ybar_n^r]`` and ``m-_n(s, c) = E[Ybar_n^-s]`` for the mean ``Ybar_n`` of n
i.i.d. ``Y = exp(c G - c^2/2)``, ``G ~ N(0, 1)`` (:mod:`privkit.accountants.rec` states the
bound they enter). Apart from the bound because they are the numerics, and the costly part
(cached per n and c); the public names are exported from :mod:`privkit.accountants.rec`.

Numerics (all in log space, float64): ``m+`` for integer r is ``r! [t^r] S(t)^n / n^r`` with
``S(t) = sum_k e^{k(k-1)c^2/2} t^k/k!``, by binary powering of the series truncated at degree
511 (``logsumexp`` convolutions of positive terms), linear interpolation of ``log m+`` between
integers (an upper bound by log-convexity); ``m-`` is
``(n^s/Gamma(s)) int exp(s y) Lbar(e^y)^n dy`` with ``Lbar(x) = E exp(-x Y)`` tabulated on a
y grid (trapezoid in g around the mode), a cubic spline, and a trapezoid in y over the window
where the log-integrand is within 80 of its maximum; where that window leaves the table, the
closed-form cap ``m-_n <= m-_1 = e^{s(s+1)c^2/2}`` is used.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.errors import InvalidParameterError

interpolate = LazyModule("scipy.interpolate")
special = LazyModule("scipy.special")

__all__ = ["MAX_ORDER", "log_m_plus", "log_m_minus"]

#: Largest RDP order priced (m+ is exact to degree 2 * MAX_ORDER - 1); higher orders get inf.
MAX_ORDER = 256
_R_MAX = 2 * MAX_ORDER - 1
_WINDOW = 80.0  # log-integrand kept within this of its maximum


def _log_conv(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """log of the coefficients of (sum e^a_i t^i)(sum e^b_j t^j), truncated to len(a)."""
    n = a.size
    m = np.full((n, 2 * n - 1), -np.inf)
    rows = np.arange(n)[:, None]
    cols = rows + np.arange(n)[None, :]
    m[np.broadcast_to(rows, (n, n)), cols] = a[:, None] + b[None, :]
    return special.logsumexp(m[:, :n], axis=0)


@functools.lru_cache(maxsize=256)
def _log_m_plus_table(n: int, c: float) -> np.ndarray:
    """log m+_n(r, c) for r = 0.._R_MAX (integer r), exact series."""
    k = np.arange(_R_MAX + 1, dtype=np.float64)
    base = k * (k - 1) * c * c / 2.0 - special.gammaln(k + 1)
    result = np.full_like(base, -np.inf)
    result[0] = 0.0
    power, e = base, n
    while e:
        if e & 1:
            result = _log_conv(result, power)
        e >>= 1
        if e:
            power = _log_conv(power, power)
    out = special.gammaln(k + 1) + result - k * math.log(n)
    out[0] = 0.0
    out[1] = 0.0  # E Ybar = 1 exactly
    out.setflags(write=False)
    return out


def log_m_plus(n: int, c: float, r: Any) -> np.ndarray:
    """log E[Ybar_n^r] for r >= 1 (integers exact; between integers a linear upper bound).

    Examples:
        >>> round(float(log_m_plus(15, 0.5, 3)), 10)
        0.0563638137
    """
    n = _validate.positive_int("n", n)
    c = _validate.positive("c", c)
    r = np.asarray(r, dtype=np.float64)
    if not (np.all(r >= 1) and np.all(np.isfinite(r))):
        raise InvalidParameterError("r", r, "finite and >= 1")
    table = _log_m_plus_table(n, c)
    lo = np.floor(r).astype(np.int64)
    out = np.full(r.shape, np.inf)
    ok = lo <= _R_MAX
    lo_c = np.minimum(lo, _R_MAX)
    hi_c = np.minimum(lo_c + 1, _R_MAX)
    frac = r - lo
    vals = table[lo_c] + frac * (table[hi_c] - table[lo_c])
    out[ok] = np.where(frac[ok] == 0, table[lo_c][ok], vals[ok])
    out[ok & (r > _R_MAX)] = np.inf
    return out


@functools.lru_cache(maxsize=64)
def _log_lbar_spline(c: float) -> tuple[Any, np.ndarray, np.ndarray]:
    """Cubic spline of y -> log E exp(-e^y Y) on y in [-60, 60] (plus the table itself)."""
    y = np.linspace(-60.0, 60.0, 2401)
    a = y - c * c / 2.0
    g = np.zeros_like(y)
    for _ in range(400):  # Newton on h(g) = g + c e^{a + c g}: convex, increasing, from the right
        ex = np.exp(np.minimum(a + c * g, 700.0))
        step = (g + c * ex) / (1.0 + c * c * ex)
        g = g - step
        if np.max(np.abs(step)) < 1e-13:
            break
    offs = np.linspace(-13.0, 13.0, 2601)
    dg = offs[1] - offs[0]
    out = np.empty_like(y)
    for s in range(0, y.size, 200):
        gg = g[s:s + 200, None] + offs[None, :]
        f = -0.5 * gg * gg - np.exp(np.minimum(a[s:s + 200, None] + c * gg, 700.0))
        out[s:s + 200] = special.logsumexp(f, axis=1) + math.log(dg) - 0.5 * math.log(2 * math.pi)
    out = np.minimum(out, 0.0)
    return interpolate.CubicSpline(y, out), y, out


def log_m_minus(n: int, c: float, s: Any) -> np.ndarray:
    """log E[Ybar_n^-s] for s > 0 (integral representation; capped by the n = 1 closed form).

    Examples:
        >>> round(float(log_m_minus(15, 0.5, 3)[0]), 6)
        0.111744
    """
    n = _validate.positive_int("n", n)
    c = _validate.positive("c", c)
    s = np.atleast_1d(np.asarray(s, dtype=np.float64))
    if not (np.all(s > 0) and np.all(np.isfinite(s))):
        raise InvalidParameterError("s", s, "finite and > 0")
    spline, y, table = _log_lbar_spline(c)
    cap = s * (s + 1.0) * c * c / 2.0
    out = cap.copy()
    dy = y[1] - y[0]
    for start in range(0, s.size, 256):
        sc = s[start:start + 256]
        coarse = sc[:, None] * y[None, :] + n * table[None, :]
        imax = np.argmax(coarse, axis=1)
        top = coarse[np.arange(sc.size), imax]
        for i in range(sc.size):
            keep = np.flatnonzero(coarse[i] >= top[i] - _WINDOW)
            lo, hi = keep[0], keep[-1]
            if lo == 0 or hi == y.size - 1 or imax[i] in (0, y.size - 1):
                continue  # the mass leaves the table: keep the cap
            yy = np.linspace(y[lo] - dy, y[hi] + dy, 4001)
            f = sc[i] * yy + n * np.minimum(spline(yy), 0.0)
            log_int = special.logsumexp(f) + math.log(yy[1] - yy[0])
            val = sc[i] * math.log(n) - special.gammaln(sc[i]) + log_int
            out[start + i] = max(0.0, min(val, cap[start + i]))
    return out
