"""Exact Poisson draws from uniform random bits: inversion against certified CDF bounds.

Secure mode (:class:`~privkit.SecureRandom`) draws the Skellam noise of
:mod:`privkit.mechanisms.distributed` as a difference of two Poisson variables, each drawn here
by **exact inversion**. ``U`` is a uniform real in [0, 1) whose binary digits are read lazily
from the random source, 64 at a time; the draw is the ``k`` with ``F(k - 1) <= U < F(k)``
(``F`` the Poisson(lambda) CDF), returned only once the digits read so far *prove* it:

1. The unnormalised weights ``w(k) = p(k) / p(k0)`` (``k0 = floor(lambda)`` the mode,
   ``w(k0) = 1``, ``w(k + 1) = w(k) lambda / (k + 1)``) are computed on a window around the
   mode in decimal arithmetic with directed rounding (each product and quotient rounded down
   for a lower bound and up for an upper bound; :mod:`decimal` rounds every operation
   correctly in the context's direction). ``lambda`` is the float64 value itself, a dyadic
   rational, converted exactly.
2. The mass outside the window is bounded by geometric series (below the window the ratios
   ``w(j - 1) / w(j) = j / lambda`` are at most ``(k_lo - 1) / lambda < 1``; above it
   ``w(j + 1) / w(j) <= lambda / (k_hi + 2) < 1``), so the normalising constant and every
   ``F(k)`` on the window lie in certified intervals ``[F_lo(k), F_hi(k)]`` (no exponential,
   logarithm or factorial is evaluated: normalisation does the work of ``e^-lambda``).
3. With the first ``b`` bits of ``U`` read as the integer ``u`` (so ``U`` lies in
   ``[u, u + 1) / 2^b``), ``k`` is returned when ``ceil(F_hi(k - 1) 2^b) <= u`` and
   ``u + 1 <= floor(F_lo(k) 2^b)``. Otherwise (at ``b = 64`` probability about ``2^-63`` per
   window entry, below ``2^-40`` for the largest windows, or ``U`` beyond the window) 64 more
   bits are read and the bounds recomputed at higher precision on a wider window, until
   decided. Every ``F(k)`` is irrational
   (``e^-lambda`` times a rational), so this ends with probability one.

The output is therefore exactly Poisson(lambda) when the bits are uniform. A ``lambda`` above
``2^28`` is split into ``2^j`` equal parts (an exact division by a power of two): a sum of
independent Poisson variables is Poisson with the summed mean.
"""

from __future__ import annotations

import bisect
import decimal
import functools
import math
from collections.abc import Callable

import numpy as np

from privkit.errors import InvalidParameterError

__all__: list[str] = []

#: Largest lambda priced by one table; larger means are split into 2^j parts.
TABLE_MAX_LAMBDA = float(1 << 28)
#: Largest lambda secure mode draws (2^12 parts of TABLE_MAX_LAMBDA).
MAX_LAMBDA = float(1 << 40)
_WORD_BITS = 64

Words = Callable[[int], np.ndarray]


def _contexts(prec: int) -> tuple[decimal.Context, decimal.Context]:
    kw = {"prec": prec, "Emin": -(10**9), "Emax": 10**9}
    return (decimal.Context(rounding=decimal.ROUND_FLOOR, **kw),  # type: ignore[arg-type]
            decimal.Context(rounding=decimal.ROUND_CEILING, **kw))  # type: ignore[arg-type]


def _build(lam: float, bits: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(k_start, H, L)``: for ``k = k_start + i``, ``H[i] >= F(k) 2^bits`` and
    ``L[i] <= F(k) 2^bits`` (integers; ``H`` non-decreasing). ``k_start`` is one below the
    window, whose CDF value is bounded by the lower tail (0 when the window starts at 0)."""
    prec = int(bits * 0.30103) + 25
    lo, hi = _contexts(prec)
    tail_limit = decimal.Decimal(2) ** -(bits + 8)
    lam_d = decimal.Decimal(lam)  # exact: a float is a dyadic rational
    k0 = int(math.floor(lam))
    one = decimal.Decimal(1)

    # Weights above the mode, until the mass beyond k is provably below tail_limit:
    # sum_{j > k} w(j) <= w(k + 1) / (1 - lambda / (k + 2)), valid as k + 2 > lambda.
    up_lo: list[decimal.Decimal] = []
    up_hi: list[decimal.Decimal] = []
    wl = wh = one
    k = k0
    upper_tail = decimal.Decimal(0)
    while True:
        if wh < tail_limit:
            room = lo.subtract(one, hi.divide(lam_d, decimal.Decimal(k + 2)))
            if room > 0:
                nxt = hi.divide(hi.multiply(wh, lam_d), decimal.Decimal(k + 1))
                upper_tail = hi.divide(nxt, room)
                if upper_tail < tail_limit:
                    break
        k += 1
        wl = lo.divide(lo.multiply(wl, lam_d), decimal.Decimal(k))
        wh = hi.divide(hi.multiply(wh, lam_d), decimal.Decimal(k))
        up_lo.append(wl)
        up_hi.append(wh)
    # Weights below the mode, until the mass below k is provably below tail_limit (or k = 0):
    # sum_{j < k} w(j) <= w(k - 1) / (1 - (k - 1) / lambda), valid as k - 1 < lambda.
    down_lo: list[decimal.Decimal] = []
    down_hi: list[decimal.Decimal] = []
    wl = wh = one
    k = k0
    lower_tail = decimal.Decimal(0)
    while k > 0:
        if wh < tail_limit:
            room = lo.subtract(one, hi.divide(decimal.Decimal(k - 1), lam_d))
            if room > 0:
                prev = hi.divide(hi.multiply(wh, decimal.Decimal(k)), lam_d)
                lower_tail = hi.divide(prev, room)
                if lower_tail < tail_limit:
                    break
        wl = lo.divide(lo.multiply(wl, decimal.Decimal(k)), lam_d)
        wh = hi.divide(hi.multiply(wh, decimal.Decimal(k)), lam_d)
        down_lo.append(wl)
        down_hi.append(wh)
        k -= 1
    k_lo = k
    if k_lo == 0:
        lower_tail = decimal.Decimal(0)

    w_lo = down_lo[::-1] + [one] + up_lo
    w_hi = down_hi[::-1] + [one] + up_hi
    n = len(w_lo)
    # prefix sums S(k) and suffix sums R(k) = sum over j > k in the window, both directions
    s_lo, s_hi = [decimal.Decimal(0)] * n, [decimal.Decimal(0)] * n
    acc_lo = acc_hi = decimal.Decimal(0)
    for i in range(n):
        acc_lo = lo.add(acc_lo, w_lo[i])
        acc_hi = hi.add(acc_hi, w_hi[i])
        s_lo[i], s_hi[i] = acc_lo, acc_hi
    r_lo, r_hi = [decimal.Decimal(0)] * n, [decimal.Decimal(0)] * n
    acc_lo = acc_hi = decimal.Decimal(0)
    for i in range(n - 1, -1, -1):
        r_lo[i], r_hi[i] = acc_lo, acc_hi
        acc_lo = lo.add(acc_lo, w_lo[i])
        acc_hi = hi.add(acc_hi, w_hi[i])

    scale = decimal.Decimal(1 << bits)
    h_out = [0]
    l_out = [0]
    if lower_tail > 0:  # F(k_lo - 1) <= L / (L + W): an upper bound, from above
        f = hi.divide(lower_tail, lo.add(lower_tail, s_lo[-1]))
        h_out[0] = int(hi.multiply(f, scale).to_integral_value(rounding=decimal.ROUND_CEILING))
    for i in range(n):
        # F(k) = (L + S(k)) / (L + S(k) + R(k) + U): increasing in L + S, decreasing in R + U
        f_lo = lo.divide(s_lo[i], hi.add(hi.add(s_lo[i], r_hi[i]), upper_tail))
        num = hi.add(lower_tail, s_hi[i])
        f_hi = hi.divide(num, lo.add(num, r_lo[i]))
        l_out.append(int(lo.multiply(f_lo, scale).to_integral_value(rounding=decimal.ROUND_FLOOR)))
        h_out.append(max(h_out[-1], int(hi.multiply(f_hi, scale).to_integral_value(
            rounding=decimal.ROUND_CEILING))))
    return k_lo - 1, tuple(h_out), tuple(l_out)


#: The refinement's tables (rarely used: kept few, they hold Python integers).
_thresholds = functools.lru_cache(maxsize=4)(_build)


def _decide(lam: float, u: int, bits: int) -> int | None:
    """The draw if the first ``bits`` bits of U (the integer ``u``) decide it, else None."""
    k_start, h, low = _thresholds(lam, bits)
    i = bisect.bisect_right(h, u) - 1
    if i >= 0 and i + 1 < len(h) and u < low[i + 1]:
        return k_start + i + 1
    return None


@functools.lru_cache(maxsize=8)
def _fast_tables(lam: float, bits: int) -> tuple[int, np.ndarray, np.ndarray]:
    """:func:`_build` as uint64 arrays, cut before the first entry >= 2^bits."""
    k_start, h, low = _build(lam, bits)
    limit = 1 << bits
    cut = bisect.bisect_left(h, limit)
    return (k_start, np.array(h[:cut], dtype=np.uint64),
            np.array(low[:cut], dtype=np.uint64))


def _poisson_table(lam: float, n: int, words: Words, first_bits: int) -> np.ndarray:
    """n exact Poisson(lam) draws, lam <= TABLE_MAX_LAMBDA."""
    k_start, h, low = _fast_tables(lam, first_bits)
    u = words(n)
    if first_bits < _WORD_BITS:
        u = u >> np.uint64(_WORD_BITS - first_bits)
    out = np.empty(n, dtype=np.int64)
    if h.size:
        idx = np.searchsorted(h, u, side="right").astype(np.int64) - 1
        nxt = np.minimum(idx + 1, h.size - 1)
        ok = (idx >= 0) & (idx + 1 < h.size) & (u < low[nxt])
        out[ok] = k_start + 1 + idx[ok]
    else:
        ok = np.zeros(n, dtype=bool)
    for j in np.flatnonzero(~ok):  # undecided: read 64 more bits until decided
        big, bits = int(u[j]), first_bits
        while True:
            big = (big << _WORD_BITS) | int(words(1)[0])
            bits += _WORD_BITS
            k = _decide(lam, big, bits)
            if k is not None:
                out[j] = k
                break
    return out


def exact_poisson(lam: float, n: int, words: Words, *, first_bits: int = _WORD_BITS
                  ) -> np.ndarray:
    """n independent Poisson(lam) draws (int64), exact given uniform 64-bit words.

    Args:
        lam: the mean, a float64 in [0, 2^40] (taken exactly).
        n: the number of draws, >= 0.
        words: ``words(k)`` returns k independent uniform uint64 words.
        first_bits: bits of U read before the first decision (64; fewer only to exercise
            the refinement in tests).
    """
    if not (math.isfinite(lam) and 0.0 <= lam <= MAX_LAMBDA):
        raise InvalidParameterError("lam", lam, "a Poisson mean in [0, 2^40] (secure mode)")
    if lam == 0.0 or n == 0:
        return np.zeros(n, dtype=np.int64)
    parts = 0
    while math.ldexp(lam, -parts) > TABLE_MAX_LAMBDA:
        parts += 1
    part = math.ldexp(lam, -parts)  # exact: division by a power of two
    out = np.zeros(n, dtype=np.int64)
    for _ in range(1 << parts):
        out += _poisson_table(part, n, words, first_bits)
    return out
