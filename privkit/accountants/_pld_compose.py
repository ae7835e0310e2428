"""privkit's PLD, steps 2 and 3: composition by FFT within Chernoff-bounded windows, and
reading delta(eps) and eps(delta) off the composed PMF.

See :mod:`privkit.accountants.fftpld` for the method and its guarantees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit.accountants._pld_step import _LAMBDAS, MAX_POINTS, _moments, _Pmf, _TooFine

_TINY = 1e-300


def _fast_len(n: int) -> int:
    """Smallest 2^a 3^b 5^c >= n (a size numpy's FFT handles fast)."""
    best = 1 << max(0, (n - 1).bit_length())
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            m = p35
            while m < n:
                m *= 2
            best = min(best, m)
            p35 *= 3
        p5 *= 5
    return best




def _log_mgf(pmfs: list[tuple[_Pmf, int]], h: float,
             group: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Upper bounds on log E[e^{+lam S}] and log E[e^{-lam S}] of the composed finite parts,
    lam in _LAMBDAS."""
    k = _LAMBDAS.size
    total = sum((n * p.log_mgf(h, group) for p, n in pmfs), np.zeros(2 * k))
    return total[:k], total[k:]


def _tail_points(pmfs: list[tuple[_Pmf, int]], h: float, tail: float,
                 group: int) -> tuple[float, float]:
    """(a, b) with Chernoff bounds P(S <= a) <= tail and P(S >= b) <= tail, from one pass:
    P(S >= b) <= E[e^{lam S}] e^{-lam b} <= tail iff b >= (log M(lam) - log tail) / lam."""
    lt = math.log(max(tail, _TINY))
    up, down = _log_mgf(pmfs, h, group)
    return float(np.max((lt - down) / _LAMBDAS)), float(np.min((up - lt) / _LAMBDAS))


def _upper_tail(pmfs: list[tuple[_Pmf, int]], h: float, b: float, group: int) -> float:
    """Chernoff bound min_lam E[e^{lam S}] e^{-lam b} on P(S >= b)."""
    up, _ = _log_mgf(pmfs, h, group)
    return math.exp(min(0.0, float(np.min(up - _LAMBDAS * b))))


@dataclass(frozen=True)
class _Composed:
    """A composed PMF on the grid points k_a .. k_a + N - 1 (interval h), its +inf mass and the
    bound on the mass that wrapped round from above the window (to be added to delta)."""

    k_a: int
    h: float
    pmf: np.ndarray
    inf_mass: float
    wrap_bound: float


#: Windows up to this many points hold the whole support of the composition (no wrap).
_FULL_SUPPORT = 1 << 16


def _window(pmfs: list[tuple[_Pmf, int]], h: float,
            tail: float) -> tuple[int, int, int, float]:
    """(k_lo, k_a, k_b, wrap): the lowest grid index of the composed support, the window
    [k_a, k_b] that holds it but for Chernoff-bounded tails, and the bound on the mass above
    the window (to be added to delta). The Chernoff bounds use MGFs lumped in runs of grid
    points (:meth:`_Pmf.log_mgf`) that move the bounds by at most one standard deviation of
    the sum."""
    count = sum(n for _, n in pmfs)
    sd = math.sqrt(sum(n * _moments(p, h)[1] for p, n in pmfs))
    group = max(1, int(sd / (count * h)))
    k_lo = sum(n * p.k0 for p, n in pmfs)
    k_hi = sum(n * (p.k0 + p.masses.size - 1) for p, n in pmfs)
    wrap = 0.0
    k_a, k_b = k_lo, k_hi  # the whole composed support: nothing wraps
    if k_hi - k_lo + 1 > _FULL_SUPPORT:
        # Chernoff bounds cut both tails at the budget. Mass below the window wraps round to
        # its top (pessimistic); the mass above it (<= the bound) is added to delta.
        a, b = _tail_points(pmfs, h, tail, group)
        k_a = max(k_lo, math.floor(a / h) - 1)
        k_b = min(k_hi, max(math.ceil(b / h) + 1, k_a + 1))
        if k_b < k_hi:
            wrap = _upper_tail(pmfs, h, (k_b + 1) * h, group)
    return k_lo, k_a, k_b, wrap


def _fft(extended: bool) -> tuple[Any, Any]:
    if extended:
        from scipy import fft as fft_mod

        return fft_mod, np.longdouble
    return np.fft, np.float64


def _spectrum(p: _Pmf, n: int, fft_mod: Any, real: Any) -> np.ndarray:
    """rfft of the PMF's finite masses wrapped onto n points (index i at i mod n)."""
    arr = np.bincount(np.arange(p.masses.size) % n, weights=p.masses, minlength=n)
    return fft_mod.rfft(arr.astype(real))


def _finish(spec: np.ndarray, n: int, k_lo: int, k_a: int, wrap: float, h: float,
            log_fin: float, log_all: float, fft_mod: Any) -> _Composed:
    """The composed PMF from the product spectrum, its window starting at k_a."""
    c = np.asarray(fft_mod.irfft(spec, n), dtype=np.float64)
    np.maximum(c, 0.0, out=c)  # rounding can leave tiny negatives: raising them is pessimistic
    c = np.roll(c, (k_lo - k_a) % n)
    # +inf mass of the composition: total mass minus finite mass (masses may exceed 1 by the
    # wrap bounds added at an earlier stage, which keeps this pessimistic).
    inf_mass = math.exp(log_all) if log_fin == -math.inf else \
        math.exp(log_fin) * math.expm1(log_all - log_fin)
    return _Composed(k_a, h, c, min(1.0, inf_mass), wrap)


def _compose(pmfs: list[tuple[_Pmf, int]], h: float, tail: float,
             extended: bool = False) -> _Composed:
    """The composition of ``n`` copies of each PMF by one FFT (module doc, step 2);
    ``extended`` does the FFT in extended precision (numpy's longdouble through scipy.fft),
    for tiny deltas."""
    k_lo, k_a, k_b, wrap = _window(pmfs, h, tail)
    n = _fast_len(k_b - k_a + 1)
    if n > MAX_POINTS:
        raise _TooFine(n)
    fft_mod, real = _fft(extended)
    spec = None
    log_fin = log_all = 0.0
    for p, cnt in pmfs:
        fin = float(p.masses.sum())
        f = _power(_spectrum(p, n, fft_mod, real), cnt)
        spec = f if spec is None else spec * f
        log_fin += cnt * math.log(fin) if fin > 0 else -math.inf
        log_all += cnt * math.log(fin + p.inf_mass)
    assert spec is not None
    return _finish(spec, n, k_lo, k_a, wrap, h, log_fin, log_all, fft_mod)


def _compose_counts(p: _Pmf, counts: list[int], h: float, tail: float,
                    extended: bool = False) -> list[_Composed]:
    """``[_compose([(p, c)], ...) for c in counts]``, sharing one FFT of ``p`` and one chain
    of squarings: every composition gets the window of the widest (a wider window only
    leaves less to wrap; each keeps its own Chernoff bound on the mass above its own)."""
    windows = [_window([(p, c)], h, tail) for c in counts]
    n = _fast_len(max(k_b - k_a + 1 for _, k_a, k_b, _ in windows))
    if n > MAX_POINTS:
        raise _TooFine(n)
    fft_mod, real = _fft(extended)
    fin = float(p.masses.sum())
    spectra = _powers(_spectrum(p, n, fft_mod, real), counts)
    out = []
    for c, spec, (k_lo, k_a, _, wrap) in zip(counts, spectra, windows, strict=True):
        log_fin = c * math.log(fin) if fin > 0 else -math.inf
        out.append(_finish(spec, n, k_lo, k_a, wrap, h, log_fin,
                           c * math.log(fin + p.inf_mass), fft_mod))
    return out


def _power(x: np.ndarray, n: int) -> np.ndarray:
    """x ** n elementwise by repeated squaring (numpy's complex power is many times slower
    for some exponents; the rounding error is of the same order)."""
    return _powers(x, [n])[0]


def _powers(x: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """[x ** n for n in counts] (each n >= 1) from one chain of squarings, each power
    multiplied up in the order :func:`_power` always used (low bits first)."""
    outs: list[np.ndarray | None] = [None] * len(counts)
    base = x
    bit, top = 1, max(counts)
    while True:
        for i, n in enumerate(counts):
            if n & bit:
                o = outs[i]
                outs[i] = base.copy() if o is None else o * base
        bit <<= 1
        if bit > top:
            break
        base = base * base
    assert all(o is not None for o in outs)
    return outs  # type: ignore[return-value]


def _as_pmf(comp: _Composed, h: float) -> _Pmf:
    """Re-discretise a composed PMF onto the coarser grid ``h`` (connect-the-dots split of each
    point, as in step 1); the wrap bound joins the +inf mass (the wrapped copy stays, extra
    mass), so the result dominates the composition. The fine points are in increasing order,
    so each coarse cell's share is a sum over a run of them (np.add.reduceat)."""
    ell = np.arange(comp.k_a, comp.k_a + comp.pmf.size, dtype=np.float64)
    ell *= comp.h
    j = np.floor(ell / h).astype(np.int64)
    j -= (j * h > ell)
    a = (j + 1) * h
    a -= ell
    a = np.expm1(a, out=a)
    a /= math.expm1(h)
    np.clip(a, 0.0, 1.0, out=a)
    j0 = int(j[0])
    size = int(j[-1]) - j0 + 2
    starts = np.flatnonzero(np.diff(j)) + 1
    starts = np.concatenate([[0], starts])
    cells = j[starts] - j0
    low = comp.pmf * a
    up = comp.pmf * (1 - a)
    masses = np.zeros(size)
    masses[cells] += np.add.reduceat(low, starts)
    masses[cells + 1] += np.add.reduceat(up, starts)
    nz = np.nonzero(masses)[0]
    if nz.size == 0:
        return _Pmf(j0, np.zeros(1), min(1.0, comp.inf_mass + comp.wrap_bound))
    return _Pmf(j0 + int(nz[0]), masses[nz[0]:nz[-1] + 1],
                min(1.0, comp.inf_mass + comp.wrap_bound))


def _hockey(comp: _Composed, eps: float) -> float:
    """delta(eps) of the composed discrete PMF (its +inf mass included)."""
    k = comp.k_a + np.arange(comp.pmf.size)
    ell = k * comp.h
    sel = ell > eps
    with np.errstate(over="ignore"):
        vals = -np.expm1(eps - ell[sel])
    # a pairwise sum, not np.dot (no BLAS threads for one vector; see _pld_step._moments)
    return (comp.inf_mass + float((comp.pmf[sel] * vals).sum())) * (1 + _READ_RTOL)


#: Relative allowance for reading a delta off a PMF in double precision (summation and the
#: PMF's own rounding to double): delta(eps) is reported times (1 + this).
_READ_RTOL = 1e-14


def _epsilon_of(comp: _Composed, target: float) -> float:
    """Smallest eps >= 0 with delta(eps) <= target (closed form within a grid cell)."""
    c, h, k_a = comp.pmf, comp.h, comp.k_a
    n = c.size
    target = target / (1 + _READ_RTOL)
    if comp.inf_mass >= target:
        return math.inf
    if _hockey(comp, 0.0) <= target * (1 + _READ_RTOL):
        return 0.0
    # Suffix sums S0[i] = sum_{j>=i} c_j and, chunk by chunk (e^{+-500} stays finite),
    # R[i] = sum_{j>=i} c_j e^{(i-j) h}; delta at grid point i is inf + S0[i] - R[i].
    s0 = np.cumsum(c[::-1])[::-1]
    r = np.empty(n)
    chunk = max(1, int(500.0 / h))
    carry = 0.0  # R at the start of the chunk above
    for top in range(n, 0, -chunk):
        bot = max(0, top - chunk)
        seg = c[bot:top]
        rel = np.arange(seg.size) * h  # (j - bot) h
        with np.errstate(under="ignore"):
            suffix = np.cumsum((seg * np.exp(-rel))[::-1])[::-1]
            r[bot:top] = np.exp(rel) * (suffix + carry * math.exp(-(top - bot) * h))
        carry = float(r[bot])
    d_grid = comp.inf_mass + s0 - r
    i = int(np.argmax(d_grid <= target))  # d_grid is non-increasing; the last point is inf
    if not d_grid[i] <= target:
        return math.inf
    # Within [eps_{i-1}, eps_i] (below eps_0 for i = 0): delta(eps) = inf + S0[i] -
    # e^{eps - eps_i} R[i], solved for delta(eps) = target.
    floor = (k_a + i - 1) * h if i > 0 else 0.0
    rem = comp.inf_mass + s0[i] - target
    if not (r[i] > 0 and rem > 0):
        return max((k_a + i) * h, 0.0)
    eps = (k_a + i) * h + math.log(rem / r[i])
    return min(max(eps, floor, 0.0), max((k_a + i) * h, 0.0))

