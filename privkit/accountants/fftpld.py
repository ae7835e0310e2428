"""privkit's own privacy-loss-distribution (PLD) accountant for Gaussian-family events.

It prices compositions of Gaussian and Poisson-subsampled Gaussian mechanisms (any mix of
noise multipliers, sampling rates and counts) and of pure epsilon-DP steps, under
``ADD_OR_REMOVE_ONE`` or ``REPLACE_ONE``, as a **pessimistic** (upper-bound) epsilon or delta.
Three steps, each one-sided:

1. **One step, connect-the-dots** (Doroshenko, Ghazi, Kamath, Kumar & Manurangsi, PETS 2022).
   The privacy loss ``L = log(p/q)`` of one use, seen under ``P``, is moved onto the grid
   ``{k h}``: a loss value in ``[k h, (k+1) h)`` is split between the two grid points so that
   the mass and the ``e^-L`` mass are kept. The hockey-stick curve of the result interpolates
   the true one linearly in ``e^eps``; the true curve is convex in ``e^eps``, so the result
   dominates it, and domination is kept by composition. The split masses are integrals over
   ``x`` computed by Gauss-Legendre quadrature on short pieces (no cancellation); the far upper
   tail (``P``-mass below a stated budget) is moved to ``L = +inf`` and the far lower tail up to
   the lowest grid point, both pessimistic.
2. **Composition by one FFT**: the composed PMF is ``irfft(prod_j rfft(p_j)^{n_j})`` on a window
   of ``N`` grid points. Mass that wraps around from below lands at high losses (pessimistic);
   the mass that would wrap from above is bounded by a Chernoff bound computed from the
   one-step PMFs and added to delta.
3. **Reading the curve**: ``delta(eps) = P_inf + sum_k c_k (1 - e^(eps - k h))_+`` is exact for
   the discrete PMF; epsilon for a target delta solves it in closed form within a grid cell,
   after subtracting every allowance from the target.

Floating point: the FFT's rounding error in delta grows with the number of factors of the
FFT power; every answer carries an allowance for it (:data:`SLACK_PER_FACTOR`, measured), and
an FFT runs in extended precision when double precision's allowance would matter.

The grid interval ``h`` is chosen in closed form, without trial compositions: the split adds at
most ``h^2/8`` to the mean and ``h^2/4`` to the variance of each step's loss, so ``T`` steps
move epsilon by about ``T h^2 (1 + zeta/s)/8``, where ``s`` is the composed loss's standard
deviation and ``zeta = sqrt(2 log(1/delta))``; ``h`` is set so that this is at most
:data:`RELATIVE_ERROR` of the cheap RDP estimate of epsilon (a tightness target only: any
``h`` gives a valid upper bound). When the window would exceed :data:`MAX_POINTS`, ``h`` is
made coarser (still an upper bound, a looser one).

Units: losses and epsilons in nats. Noise multipliers follow privkit's convention
(``z = stddev / Delta``, ``Delta`` the L2 sensitivity under the relation priced; for
``REPLACE_ONE`` a Poisson-sampled sum of contributions clipped to ``C`` has ``Delta = 2 C``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit.errors import NumericalError, UnsupportedEventError

__all__ = [
    "GaussianAtom",
    "PureAtom",
    "epsilon",
    "delta",
    "choose_interval",
    "RELATIVE_ERROR",
    "MAX_POINTS",
    "SLACK_PER_FACTOR",
]

#: Target relative distance of epsilon above the exact value (the grid is chosen for it).
RELATIVE_ERROR = 5e-6
#: Largest FFT window (grid points); beyond it the grid is made coarser. One step's PMF may
#: hold at most ``_MAX_CELLS`` points. These caps bound time and memory (~0.5 GB at most).
MAX_POINTS = 1 << 22
_MAX_CELLS = 1 << 20
#: Allowance in delta for floating-point error, per factor of an FFT power: 5e-16 in double
#: precision (the largest error measured against extended precision was 1.3e-16, 1.2 unit
#: roundoffs), 2.5e-19 in extended precision (the same 1.2 of its unit roundoff 2^-64, with the
#: same 4x margin). A block's error carries into
#: every use of the block, so a two-stage composition of T steps in B blocks is allowed
#: ``a1 T + a2 B``. An FFT runs in extended precision when double's allowance would exceed
#: :data:`_EXTENDED_ABOVE` of the target delta.
SLACK_PER_FACTOR = {False: 5e-16, True: 2.5e-19}
_EXTENDED_ABOVE = 1e-4
#: Largest |loss| on the grid (exp of it must stay finite); beyond, pricing is refused.
_MAX_LOSS = 600.0
#: Gauss-Legendre nodes per piece and the widest piece, in units of the noise std.
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(2)
_PIECE = 1.0 / 256
#: Bound on the quadrature's relative error per cell (tested against exact Gaussian cell
#: masses); every mass is raised by this factor, so the masses stay on the safe side.
_QUAD_RTOL = 1e-12
#: Each of the tails moved (to +inf, or up to the lowest grid point) has at most this
#: share of the target delta, per step; the wrap-around bound at most ``_TAIL_SHARE``.
_TAIL_SHARE = 1e-6
_TINY = 1e-300


# ------------------------------------------------------------------ atoms
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


class _Pair:
    """A one-step dominating pair (P, Q) parametrised so that the loss is increasing in x.

    ``scale`` is the noise standard deviation; ``kind`` one of ``remove`` (P the mixture
    (1-q) N(0) + q N(1), Q = N(0)), ``add`` (P = N(0), Q the mixture, x mirrored), ``replace``
    (P = (1-q) N(0) + q N(1/2), Q = (1-q) N(0) + q N(-1/2)).
    """

    def __init__(self, kind: str, z: float, q: float) -> None:
        if not 1e-100 < z < 1e100:
            raise UnsupportedEventError(
                f"privkit's PLD: noise multiplier {z:g} is outside what a discretised PLD can "
                "represent")
        self.kind, self.z, self.q = kind, float(z), float(q)
        self.log_q = math.log(q)
        self.log_1mq = math.log1p(-q) if q < 1 else -math.inf
        self.shift = 0.5 if kind == "replace" else 1.0
        # means of the components of P (in the x parametrisation)
        self.means = (0.0,) if kind == "add" else (0.0, self.shift) if q < 1 else (self.shift,)

    # -- P's density and tails
    def loss_and_density(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The privacy loss L(x) and P's density at x. P's density is the N(0, z^2) density
        times the mixture factor whose log is the loss's numerator (one exp, no overflow)."""
        z = self.z
        norm = -math.log(z * math.sqrt(2 * math.pi))
        base = -0.5 * (x / z) ** 2 + norm
        z2 = z * z
        if self.kind == "add":
            return self.loss(x), np.exp(base)
        if self.kind == "remove":
            ell = self.loss(x)
            return ell, np.exp(base + ell)
        c = self.shift
        if self.q == 1:
            return 2 * c * x / z2, np.exp(-0.5 * ((x - c) / z) ** 2 + norm)
        up = self._log_mix((2 * c * x - c * c) / (2 * z2))
        down = self._log_mix((-2 * c * x - c * c) / (2 * z2))
        return up - down, np.exp(base + up)

    def tail_above(self, x: float) -> float:
        """P(X > x)."""
        from scipy.special import ndtr

        if self.kind == "add" or self.q == 1:
            return float(ndtr(-(x - self.means[-1]) / self.z))
        return float((1 - self.q) * ndtr(-x / self.z) + self.q * ndtr(-(x - self.shift) / self.z))

    def tail_below(self, x: float) -> float:
        """P(X < x)."""
        from scipy.special import ndtr

        if self.kind == "add" or self.q == 1:
            return float(ndtr((x - self.means[-1]) / self.z))
        return float((1 - self.q) * ndtr(x / self.z) + self.q * ndtr((x - self.shift) / self.z))

    # -- the privacy loss and its inverse
    def _log_mix(self, t: np.ndarray) -> np.ndarray:
        """log(1 - q + q e^t), without overflow (e^t beyond e^700 is exact to float)."""
        small = np.minimum(t, 700.0)
        return np.where(t > 700.0, self.log_q + t, np.log1p(self.q * np.expm1(small)))

    def loss(self, x: np.ndarray) -> np.ndarray:
        z2 = self.z * self.z
        if self.kind == "remove":
            t = (2 * x - 1) / (2 * z2)
            return t if self.q == 1 else self._log_mix(t)
        if self.kind == "add":
            t = (-2 * x - 1) / (2 * z2)
            return -(t if self.q == 1 else self._log_mix(t))
        c = self.shift
        if self.q == 1:
            return 2 * c * x / z2
        return (self._log_mix((2 * c * x - c * c) / (2 * z2))
                - self._log_mix((-2 * c * x - c * c) / (2 * z2)))

    def x_of_loss(self, ell: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`loss` (-inf / +inf outside the loss's range)."""
        ell = np.asarray(ell, dtype=np.float64)
        z2 = self.z * self.z
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if self.kind == "remove":
                if self.q == 1:
                    return z2 * ell + 0.5
                arg = np.expm1(ell) + self.q
                out = z2 * (np.log(np.where(arg > 0, arg, 1.0)) - self.log_q) + 0.5
                return np.where(arg > 0, out, -np.inf)
            if self.kind == "add":
                if self.q == 1:
                    return z2 * ell - 0.5
                arg = np.expm1(-ell) + self.q
                out = -(z2 * (np.log(np.where(arg > 0, arg, 1.0)) - self.log_q) + 0.5)
                return np.where(arg > 0, out, np.inf)
            c = self.shift
            if self.q == 1:
                return z2 * ell / (2 * c)
            a = 1 - self.q
            b = self.q * math.exp(-c * c / (2 * z2))
            big_a = a * np.expm1(ell)
            e = np.exp(ell)
            root = np.sqrt(big_a * big_a + 4 * b * b * e)
            u = np.where(big_a >= 0, (big_a + root) / (2 * b), 2 * b * e / (root - big_a))
            return z2 * np.log(u) / c

    def x_range(self, budget: float) -> tuple[float, float]:
        """x bounds with at most ``budget`` of P's mass below and above."""
        from scipy.special import ndtri

        w = -float(ndtri(max(budget, _TINY)))
        return min(self.means) - self.z * w, max(self.means) + self.z * w


# --------------------------------------------------------------- one step
class _Pmf:
    """A discrete loss distribution on the grid {k h}: masses[i] at (k0 + i) h, plus +inf."""

    __slots__ = ("k0", "masses", "inf_mass", "_mgf")

    def __init__(self, k0: int, masses: np.ndarray, inf_mass: float) -> None:
        self.k0, self.masses, self.inf_mass = int(k0), masses, float(inf_mass)
        self._mgf: tuple[tuple[float, int], np.ndarray] | None = None

    def log_mgf(self, h: float, group: int = 1) -> np.ndarray:
        """Upper bounds on log E[e^{lam L}] of the finite part at lam in (+_LAMBDAS,
        -_LAMBDAS), cached. With ``group`` > 1, runs of that many grid points are lumped at
        their highest loss for lam > 0 and at their lowest for lam < 0 (cheaper, still
        upper bounds)."""
        if self._mgf is None or self._mgf[0] != (h, group):
            m = self.masses
            starts = np.arange(0, m.size, group)
            binned = np.add.reduceat(m, starts) if group > 1 else m
            lo = (self.k0 + starts) * h
            hi = (self.k0 + np.minimum(starts + group - 1, m.size - 1)) * h
            with np.errstate(divide="ignore"):
                lm = np.log(binned)
                x = np.concatenate([lm[None, :] + _LAMBDAS[:, None] * hi[None, :],
                                    lm[None, :] - _LAMBDAS[:, None] * lo[None, :]])
            top = x.max(axis=1)
            with np.errstate(invalid="ignore"):
                val = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
            self._mgf = ((h, group), np.where(np.isneginf(top), -np.inf, val))
        return self._mgf[1]


def _split(ell_hi: np.ndarray, h: float, x_a: np.ndarray, x_b: np.ndarray,
           pair: _Pair) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: P-mass sent to the lower grid point and the cell's total P-mass.

    Two-point Gauss-Legendre (exact for cubics) on pieces short enough that the Gaussian's
    exponent changes by at most 1/256 across one (width <= z/256 and <= z^2 / (256 |x - mean|));
    most cells are shorter than that already."""
    width = x_b - x_a
    z = pair.z
    dist = np.min([np.maximum(np.abs(x_a - m), np.abs(x_b - m)) for m in pair.means], axis=0)
    piece = np.minimum(_PIECE * z, _PIECE * z * z / np.maximum(dist, 1e-300))
    pieces = np.maximum(1, np.ceil(width / piece)).astype(np.int64)
    cell = np.repeat(np.arange(width.size), pieces)
    first = np.cumsum(pieces) - pieces
    j = np.arange(cell.size) - first[cell]
    step = width[cell] / pieces[cell]
    left = x_a[cell] + j * step
    half = 0.5 * step
    mid = left + half
    xs = mid[:, None] + half[:, None] * _GL_NODES[None, :]
    w = half[:, None] * _GL_WEIGHTS[None, :]
    with np.errstate(under="ignore", over="ignore", invalid="ignore"):
        ell, dens = pair.loss_and_density(xs)
        dens *= w
        a = np.expm1(ell_hi[cell][:, None] - ell) / math.expm1(h)
    a = np.clip(np.nan_to_num(a, nan=1.0, posinf=1.0), 0.0, 1.0)
    lower = np.bincount(cell, weights=(dens * a).sum(axis=1), minlength=width.size)
    total = np.bincount(cell, weights=dens.sum(axis=1), minlength=width.size)
    return lower, total


def _gaussian_pmf(pair: _Pair, h: float, budget: float) -> _Pmf:
    """Connect-the-dots PMF of one use of ``pair`` on the grid {k h} (see module doc)."""
    x_lo, x_hi = pair.x_range(budget)
    ell_lo, ell_hi = (float(v) for v in pair.loss(np.array([x_lo, x_hi])))
    if not (abs(ell_lo) < _MAX_LOSS and abs(ell_hi) < _MAX_LOSS):
        raise UnsupportedEventError(
            f"privkit's PLD: a single step's privacy loss reaches "
            f"{max(abs(ell_lo), abs(ell_hi)):.3g}"
            " nats (noise multiplier too small for a discretised PLD)")
    k_lo = math.floor(ell_lo / h)
    k_hi = max(math.ceil(ell_hi / h), k_lo + 1)
    if k_hi - k_lo > _MAX_CELLS:
        raise _TooFine(int((k_hi - k_lo) * MAX_POINTS / _MAX_CELLS))
    ks = np.arange(k_lo, k_hi + 1)
    xs = pair.x_of_loss(ks * h)
    xs = np.clip(xs, x_lo, x_hi)
    xs[0], xs[-1] = x_lo, x_hi
    lower, total = _split(ks[1:] * h, h, xs[:-1], xs[1:], pair)
    masses = np.zeros(ks.size)
    masses[:-1] += lower
    masses[1:] += total - lower
    # Below x_lo: up to the lowest grid point (its losses are <= ell_lo); above x_hi: +inf.
    masses[0] += pair.tail_below(x_lo)
    inf_mass = pair.tail_above(x_hi)
    masses *= 1 + _QUAD_RTOL
    return _Pmf(k_lo, masses, min(1.0, inf_mass))


def _rr_pmf(eps0: float, h: float) -> _Pmf:
    """Connect-the-dots PMF of randomized response RR(eps0) (both directions alike)."""
    p = 1.0 / (1.0 + math.exp(-eps0))
    k_lo, k_hi = math.floor(-eps0 / h), math.ceil(eps0 / h)
    if k_hi - k_lo > _MAX_CELLS:
        raise _TooFine(int((k_hi - k_lo) * MAX_POINTS / _MAX_CELLS))
    masses = np.zeros(k_hi - k_lo + 1)
    for ell, mass in ((eps0, p), (-eps0, 1.0 - p)):
        k = math.floor(ell / h)
        if k * h == ell or k + 1 > k_hi:
            masses[min(k, k_hi) - k_lo] += mass
            continue
        a = math.expm1((k + 1) * h - ell) / math.expm1(h)
        a = min(1.0, max(0.0, a))
        masses[k - k_lo] += mass * a
        masses[k + 1 - k_lo] += mass * (1 - a)
    return _Pmf(k_lo, masses, 0.0)


def _directions(atoms: list[tuple[Any, int]], relation: str) -> list[str]:
    if relation == "REPLACE_ONE":
        return ["replace"]
    if all(isinstance(a, PureAtom) or a.sampling_probability == 1 for a, _ in atoms):
        return ["remove"]  # the add pair is the mirror image: the same PLD
    return ["remove", "add"]


def _pmfs(atoms: list[tuple[Any, int]], direction: str, h: float,
          budget: float) -> list[tuple[_Pmf, int]]:
    out = []
    for atom, n in atoms:
        if isinstance(atom, PureAtom):
            out.append((_rr_pmf(atom.epsilon, h), n))
        else:
            pair = _Pair(direction, atom.noise_multiplier, atom.sampling_probability)
            out.append((_gaussian_pmf(pair, h, budget / n), n))
    return out


# ------------------------------------------------------------- composition
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


def _moments(pmf: _Pmf, h: float) -> tuple[float, float]:
    """Mean and variance of the finite part (normalised)."""
    m = pmf.masses
    tot = float(m.sum())
    if tot <= 0:
        return 0.0, 0.0
    k = (pmf.k0 + np.arange(m.size)) * h
    mean = float(np.dot(m, k) / tot)
    var = float(np.dot(m, (k - mean) ** 2) / tot)
    return mean, var


#: Chernoff bounds are minimised over these lam (1/nats; any lam > 0 gives a valid bound).
_LAMBDAS = np.geomspace(1e-2, 1e4, 11)


def _log_mgf(pmfs: list[tuple[_Pmf, int]], h: float,
             group: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Upper bounds on log E[e^{+lam S}] and log E[e^{-lam S}] of the composed finite parts,
    lam in _LAMBDAS."""
    total = sum(n * p.log_mgf(h, group) for p, n in pmfs)
    k = _LAMBDAS.size
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


class _TooFine(Exception):
    def __init__(self, n: int) -> None:
        self.n = n


#: Windows up to this many points hold the whole support of the composition (no wrap).
_FULL_SUPPORT = 1 << 16


def _compose(pmfs: list[tuple[_Pmf, int]], h: float, tail: float,
             extended: bool = False) -> _Composed:
    """The composition of ``n`` copies of each PMF by one FFT (module doc, step 2);
    ``extended`` does the FFT in extended precision (numpy's longdouble through scipy.fft),
    for tiny deltas. The Chernoff bounds use MGFs lumped in runs of grid points
    (:meth:`_Pmf.log_mgf`) that move the bounds by at most one standard deviation of the sum."""
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
    n = _fast_len(k_b - k_a + 1)
    if n > MAX_POINTS:
        raise _TooFine(n)
    if extended:
        from scipy import fft as fft_mod

        real: Any = np.longdouble
    else:
        fft_mod, real = np.fft, np.float64
    spec = None
    log_fin = log_all = 0.0
    for p, cnt in pmfs:
        fin = float(p.masses.sum())
        arr = np.bincount(np.arange(p.masses.size) % n, weights=p.masses, minlength=n)
        f = _power(fft_mod.rfft(arr.astype(real)), cnt)
        spec = f if spec is None else spec * f
        log_fin += cnt * math.log(fin) if fin > 0 else -math.inf
        log_all += cnt * math.log(fin + p.inf_mass)
    c = np.asarray(fft_mod.irfft(spec, n), dtype=np.float64)
    np.maximum(c, 0.0, out=c)  # rounding can leave tiny negatives: raising them is pessimistic
    c = np.roll(c, (k_lo - k_a) % n)
    # +inf mass of the composition: total mass minus finite mass (masses may exceed 1 by the
    # wrap bounds added at an earlier stage, which keeps this pessimistic).
    inf_mass = math.exp(log_all) if log_fin == -math.inf else \
        math.exp(log_fin) * math.expm1(log_all - log_fin)
    return _Composed(k_a, h, c, min(1.0, inf_mass), wrap)


def _power(x: np.ndarray, n: int) -> np.ndarray:
    """x ** n elementwise by repeated squaring (numpy's complex power is many times slower
    for some exponents; the rounding error is of the same order)."""
    out = None
    base = x
    while n:
        if n & 1:
            out = base.copy() if out is None else out * base
        n >>= 1
        if n:
            base = base * base
    assert out is not None
    return out


def _as_pmf(comp: _Composed, h: float) -> _Pmf:
    """Re-discretise a composed PMF onto the coarser grid ``h`` (connect-the-dots split of each
    point, as in step 1); the wrap bound joins the +inf mass (the wrapped copy stays, extra
    mass), so the result dominates the composition."""
    ell = (comp.k_a + np.arange(comp.pmf.size)) * comp.h
    j = np.floor(ell / h).astype(np.int64)
    j -= (j * h > ell)
    a = np.clip(np.expm1((j + 1) * h - ell) / math.expm1(h), 0.0, 1.0)
    j0 = int(j.min())
    size = int(j.max()) - j0 + 2
    masses = np.bincount(j - j0, weights=comp.pmf * a, minlength=size)
    masses += np.bincount(j - j0 + 1, weights=comp.pmf * (1 - a), minlength=size)
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
    return (comp.inf_mass + float(np.dot(comp.pmf[sel], vals))) * (1 + _READ_RTOL)


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


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class _Plan:
    """Grids and blocks: steps are composed ``block`` at a time on the fine grid, each block
    re-discretised onto the coarse grid and the blocks composed there (one stage when
    ``block == 1``, then both grids are equal)."""

    fine: float
    coarse: float
    block: int


#: Compositions of at most this many steps are done in one stage.
_ONE_STAGE = 64


def plan(atoms: list[tuple[Any, int]], eps_estimate: float, delta: float) -> _Plan:
    """Grids for a target relative error (module doc), from a cheap estimate of epsilon."""
    steps = sum(n for _, n in atoms)
    zeta = math.sqrt(2 * math.log(1 / delta))
    # The composed loss's spread, from coarse one-step PMFs (no composition).
    h0 = min(max(eps_estimate, 1e-6) / 64, 0.05)
    var = 0.0
    for atom, n in atoms:
        if isinstance(atom, PureAtom):
            var += n * atom.epsilon ** 2
            continue
        pair = _Pair("remove", atom.noise_multiplier, atom.sampling_probability)
        h1 = h0
        while True:
            try:
                var += n * _moments(_gaussian_pmf(pair, h1, 1e-12), h1)[1]
                break
            except _TooFine:
                h1 *= 8
    factor = 1 + zeta / math.sqrt(max(var, 1e-300))
    budget = 8 * RELATIVE_ERROR * max(eps_estimate, 1e-9) / factor  # sum over splits of h^2
    if steps <= _ONE_STAGE:
        h = math.sqrt(budget / steps)
        return _Plan(h, h, 1)
    block = 1 << round(math.log2(math.sqrt(steps)))
    blocks = sum(-(-n // min(block, n)) for _, n in atoms)
    return _Plan(math.sqrt(budget / (2 * steps)), math.sqrt(budget / (2 * blocks)), block)


def estimate(atoms: list[tuple[Any, int]], delta: float) -> float:
    """A cheap, smooth guess of epsilon that plans the grid when the caller has none: the CLT
    (Gaussian-DP) value with mu^2 = sum_j n_j q_j^2 (e^{1/z_j^2} - 1) (n / z^2 without sampling,
    n eps^2 for pure steps). Not a bound; it only sets how fine the grid is, and
    :func:`epsilon` re-plans once when the answer comes out far below it."""
    from privkit.accountants.gaussian import exact_epsilon

    mu2 = 0.0
    for atom, n in atoms:
        if isinstance(atom, PureAtom):
            mu2 += n * atom.epsilon ** 2
            continue
        z, q = max(atom.noise_multiplier, 1e-100), atom.sampling_probability
        inv = min(1 / (z * z), 700.0)
        mu2 += n * min(inv, q * q * math.expm1(inv))  # the unsampled value bounds it too
    return max(float(exact_epsilon(math.sqrt(mu2), delta)), 1e-6)


def choose_interval(atoms: list[tuple[Any, int]], eps_estimate: float, delta: float) -> float:
    """The (fine) grid interval :func:`plan` chooses."""
    return plan(atoms, eps_estimate, delta).fine


@dataclass(frozen=True)
class _Precision:
    """Extended precision per stage and the floating-point allowance it implies."""

    stage1: bool
    stage2: bool
    slack: float


def _precision(atoms: list[tuple[Any, int]], p: _Plan, target: float) -> _Precision:
    steps = _steps(atoms)
    factors = steps if p.block == 1 else sum(-(-n // min(p.block, n)) for _, n in atoms)
    a64 = SLACK_PER_FACTOR[False]
    ext1 = p.block > 1 and a64 * steps > _EXTENDED_ABOVE * target
    ext2 = a64 * factors > _EXTENDED_ABOVE * target
    slack = SLACK_PER_FACTOR[ext2] * factors
    if p.block > 1:
        slack += SLACK_PER_FACTOR[ext1] * steps
    return _Precision(ext1, ext2, slack)


def _composed(atoms: list[tuple[Any, int]], direction: str, p: _Plan, prec: _Precision,
              budget: float, tail: float) -> _Composed:
    if p.block == 1:
        return _compose(_pmfs(atoms, direction, p.fine, budget), p.fine, tail,
                        extended=prec.stage2)
    blocks: list[tuple[_Pmf, int]] = []
    nblocks = sum(-(-n // min(p.block, n)) for _, n in atoms)
    for (one, n) in _pmfs(atoms, direction, p.fine, budget):
        size = min(p.block, n)
        full, rest = divmod(n, size)
        for cnt, times in ((size, full), (rest, 1)):
            if cnt and times:
                comp = _compose([(one, cnt)], p.fine, tail / nblocks, prec.stage1)
                blocks.append((_as_pmf(comp, p.coarse), times))
    return _compose(blocks, p.coarse, tail, extended=prec.stage2)


def _priced(atoms: list[tuple[Any, int]], relation: str, p: _Plan, target: float,
            budget: float, tail: float) -> tuple[list[_Composed], float]:
    """The composed PMF of each direction and the floating-point allowance."""
    while True:
        prec = _precision(atoms, p, target)
        try:
            return [_composed(atoms, d, p, prec, budget, tail)
                    for d in _directions(atoms, relation)], prec.slack
        except _TooFine as exc:
            grow = 1.05 * exc.n / MAX_POINTS
            p = _Plan(p.fine * grow, p.coarse * grow, p.block)


class Curve:
    """A composed pessimistic PLD on one fixed grid, every direction, with its allowances:
    ``delta(eps)`` is non-increasing in eps (one PMF answers every query)."""

    def __init__(self, comps: list[_Composed], slack: float) -> None:
        self._comps, self.slack = comps, slack

    @property
    def interval(self) -> float:
        return self._comps[0].h

    def delta(self, eps: float) -> float:
        worst = max(_hockey(c, eps) + c.wrap_bound for c in self._comps)
        return min(1.0, worst + self.slack)

    def epsilon(self, target_delta: float) -> float:
        room = target_delta - self.slack
        if not room >= 0.5 * target_delta:
            raise UnsupportedEventError(
                f"privkit's PLD: delta {target_delta:g} is below twice its floating-point "
                "allowance")
        eps = max(_epsilon_of(c, room - c.wrap_bound) for c in self._comps)
        for i in range(64):  # rounding: verify with delta() itself, move up by ulps if needed
            if self.delta(eps) <= target_delta:
                return eps
            eps += abs(eps) * 2.0 ** (i - 52) + 5e-324
        raise NumericalError(f"privkit's PLD: epsilon {eps} did not verify")


class WindowTooLarge(ValueError):
    """The composition does not fit :data:`MAX_POINTS` on the requested grid."""


def curve(atoms: list[tuple[Any, int]], relation: str, h: float, *,
          extended: bool = False, tail: float = 1e-30) -> Curve:
    """The composition on the grid ``h`` exactly, in one stage (no re-discretisation): exact up
    to the FFT allowance for pure steps whose epsilons are multiples of ``h``.

    Raises:
        WindowTooLarge: the window would exceed :data:`MAX_POINTS` points.
    """
    steps = _steps(atoms)
    try:
        comps = [_compose(_pmfs(atoms, d, h, tail), h, tail, extended)
                 for d in _directions(atoms, relation)]
    except _TooFine as exc:
        raise WindowTooLarge(f"{exc.n} grid points at interval {h:g}") from None
    return Curve(comps, SLACK_PER_FACTOR[extended] * steps)


def _steps(atoms: list[tuple[Any, int]]) -> int:
    return sum(n for _, n in atoms)


def epsilon(atoms: list[tuple[Any, int]], target_delta: float, relation: str,
            eps_estimate: float | None = None) -> tuple[float, float]:
    """(epsilon, coarse grid interval) at ``target_delta``: an upper bound (module doc).

    Raises:
        UnsupportedEventError: the floating-point allowance leaves no room below
            ``target_delta``, or a step's loss is too large for a grid.
    """
    if eps_estimate is None:
        eps_estimate = estimate(atoms, target_delta)
    budget = _TAIL_SHARE * target_delta
    out, h = _epsilon_at(atoms, target_delta, relation, plan(atoms, eps_estimate, target_delta),
                         budget)
    if 0 < out < 0.5 * eps_estimate:
        # The estimate was far too high, so the grid was coarser than the target needs:
        # once more on the grid planned for the answer (any grid gives an upper bound).
        again, h2 = _epsilon_at(atoms, target_delta, relation,
                                plan(atoms, 1.1 * out, target_delta), budget)
        if again < out:
            out, h = again, h2
    return out, h


def _epsilon_at(atoms: list[tuple[Any, int]], target_delta: float, relation: str, p: _Plan,
                budget: float) -> tuple[float, float]:
    comps, slack = _priced(atoms, relation, p, target_delta, budget, budget)
    room = target_delta - slack
    if not room > 0.5 * target_delta:
        raise UnsupportedEventError(
            f"privkit's PLD: delta {target_delta:g} is below twice its floating-point allowance "
            f"over {_steps(atoms)} steps")
    out = 0.0
    for comp in comps:
        out = max(out, _epsilon_of(comp, room - comp.wrap_bound))
    return out, comps[0].h


def delta(atoms: list[tuple[Any, int]], eps: float, relation: str, eps_estimate: float,
          delta_estimate: float) -> float:
    """Upper bound on delta at ``eps`` (tails budgeted against ``delta_estimate``; when the
    answer comes out so small that double precision's allowance would matter, it is computed
    again in extended precision)."""
    target = max(min(delta_estimate, 0.5), 1e-300)
    for _ in range(2):
        # delta_estimate may be far above the answer (RDP's): tails get a much smaller share.
        budget = max(1e-9 * min(target, 1.0), 1e-300)
        p = plan(atoms, max(eps_estimate, eps), target)
        comps, slack = _priced(atoms, relation, p, target, budget, budget)
        worst = min(1.0, max(_hockey(c, eps) + c.wrap_bound for c in comps) + slack)
        if slack <= _EXTENDED_ABOVE * worst or worst >= target:
            return worst
        target = max(worst, 1e-300)
    return worst
