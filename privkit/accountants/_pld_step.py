"""privkit's PLD, step 1: the one-step connect-the-dots PMFs of the dominating pairs.

See :mod:`privkit.accountants.fftpld` for the method and its guarantees.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privkit.accountants._atoms import PureAtom
from privkit.errors import UnsupportedEventError

#: Largest FFT window (grid points); beyond it the grid is made coarser. One step's PMF may
#: hold at most ``MAX_CELLS`` points. These caps bound time and memory (~0.5 GB at most).
MAX_POINTS = 1 << 22
MAX_CELLS = 1 << 20
#: Largest |loss| on the grid (exp of it must stay finite); beyond, pricing is refused.
_MAX_LOSS = 600.0
#: Gauss-Legendre nodes per piece and the widest piece, in units of the noise std.
#: (np.polynomial.legendre.leggauss(2), written out: importing numpy.polynomial costs start-up.)
_GL_NODES = np.array([-math.sqrt(1 / 3), math.sqrt(1 / 3)])
_GL_WEIGHTS = np.array([1.0, 1.0])
_PIECE = 1.0 / 256
#: Bound on the quadrature's relative error per cell (tested against exact Gaussian cell
#: masses); every mass is raised by this factor, so the masses stay on the safe side.
_QUAD_RTOL = 1e-12
_TINY = 1e-300
#: Chernoff bounds are minimised over these lam (1/nats; any lam > 0 gives a valid bound).
_LAMBDAS = np.geomspace(1e-2, 1e4, 11)


class _TooFine(Exception):
    def __init__(self, n: int) -> None:
        self.n = n


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
        if t.size and float(t.max()) <= 700.0:  # the usual case: one branch, no copies
            return np.log1p(np.expm1(t) * self.q)
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


def _nodes(x_a: np.ndarray, width: np.ndarray, piece: np.ndarray, edge: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, int]:
    """The cells [x_a, x_a + width] cut into pieces no longer than ``piece``, and each piece's
    two Gauss-Legendre nodes: (nodes, half of each piece's width, ``edge`` of each piece's
    cell, the cell of each piece (None when every cell is one piece), number of pieces). The
    nodes are flat, the first nodes of all pieces and then the second ones."""
    pieces = np.maximum(1, np.ceil(width / piece)).astype(np.int64)
    cell: np.ndarray | None = None
    if width.size and int(pieces.max()) == 1:  # every cell is one piece
        left, half, edge_of = x_a, 0.5 * width, edge
    else:
        cell = np.repeat(np.arange(width.size), pieces)
        first = np.cumsum(pieces) - pieces
        j = np.arange(cell.size) - first[cell]
        step = width[cell] / pieces[cell]
        left = x_a[cell] + j * step
        half = 0.5 * step
        edge_of = edge[cell]
    mid = left + half
    n = mid.size
    xs = np.empty(2 * n)
    np.add(mid, half * _GL_NODES[0], out=xs[:n])
    np.add(mid, half * _GL_NODES[1], out=xs[n:])
    return xs, half, edge_of, cell, n


def _split(ell_hi: np.ndarray, h: float, x_a: np.ndarray, x_b: np.ndarray,
           pair: _Pair) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: P-mass sent to the lower grid point and the cell's total P-mass.

    Two-point Gauss-Legendre (exact for cubics) on pieces short enough that the Gaussian's
    exponent changes by at most 1/256 across one (width <= z/256 and <= z^2 / (256 |x - mean|));
    most cells are shorter than that already. The nodes are kept in flat arrays (one per node,
    evaluated together): numpy is several times slower on arrays of shape (n, 2)."""
    width = x_b - x_a
    z = pair.z
    dist = None
    for m in pair.means:
        d = np.maximum(np.abs(x_a - m), np.abs(x_b - m))
        dist = d if dist is None else np.minimum(dist, d)
    assert dist is not None
    piece = np.minimum(_PIECE * z, _PIECE * z * z / np.maximum(dist, 1e-300))
    xs, half, top, cell, n = _nodes(x_a, width, piece, ell_hi)
    with np.errstate(under="ignore", over="ignore", invalid="ignore"):
        ell, dens = pair.loss_and_density(xs)
        dens[:n] *= half * _GL_WEIGHTS[0]
        dens[n:] *= half * _GL_WEIGHTS[1]
        ell -= np.concatenate([top, top])
        np.negative(ell, out=ell)
        a = np.expm1(ell, out=ell)
        a /= math.expm1(h)
    a = np.clip(np.nan_to_num(a, nan=1.0, posinf=1.0, copy=False), 0.0, 1.0, out=a)
    a *= dens
    lower = a[:n] + a[n:]
    total = dens[:n] + dens[n:]
    if cell is None:
        return lower, total
    return (np.bincount(cell, weights=lower, minlength=width.size),
            np.bincount(cell, weights=total, minlength=width.size))


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
    if k_hi - k_lo > MAX_CELLS:
        raise _TooFine(int((k_hi - k_lo) * MAX_POINTS / MAX_CELLS))
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


def _gaussian_pmf_pair(z: float, q: float, h: float, budget: float) -> tuple[_Pmf, _Pmf]:
    """The ``remove`` and ``add`` PMFs of a Poisson-subsampled Gaussian (q < 1) from one
    quadrature: the add pair is the remove pair swapped, so the add direction's loss at x is
    minus the remove direction's and its P is the remove direction's Q = N(0, z^2). The cells
    (where the remove loss crosses grid points) are the add direction's cells mirrored, and
    the pieces are short enough for both densities (each piece's exponent changes by at most
    1/256 for the nearest component and for N(0)). The same connect-the-dots split as
    :func:`_gaussian_pmf`; the tails of N(0) beyond the remove range go to +inf (below) and up
    to the add PMF's lowest grid point (above), each at most ``budget``."""
    pair = _Pair("remove", z, q)
    x_lo, x_hi = pair.x_range(budget)
    ell_lo, ell_hi = (float(v) for v in pair.loss(np.array([x_lo, x_hi])))
    if not (abs(ell_lo) < _MAX_LOSS and abs(ell_hi) < _MAX_LOSS):
        raise UnsupportedEventError(
            f"privkit's PLD: a single step's privacy loss reaches "
            f"{max(abs(ell_lo), abs(ell_hi)):.3g}"
            " nats (noise multiplier too small for a discretised PLD)")
    k_lo = math.floor(ell_lo / h)
    k_hi = max(math.ceil(ell_hi / h), k_lo + 1)
    if k_hi - k_lo > MAX_CELLS:
        raise _TooFine(int((k_hi - k_lo) * MAX_POINTS / MAX_CELLS))
    ks = np.arange(k_lo, k_hi + 1)
    grid = ks * h
    xs = np.clip(pair.x_of_loss(grid), x_lo, x_hi)
    xs[0], xs[-1] = x_lo, x_hi
    low_r, tot_r, low_a, tot_a = _split_both(grid[:-1], h, xs[:-1], xs[1:], pair)
    rem = np.zeros(ks.size)
    rem[:-1] += low_r
    rem[1:] += tot_r - low_r
    rem[0] += pair.tail_below(x_lo)
    rem *= 1 + _QUAD_RTOL
    # add: grid point -k at index k_hi - k (reversed); remove cell [k, k+1] is add cell
    # [-(k+1), -k], whose lower point gets low_a
    add = np.zeros(ks.size)
    add[:-1] += low_a[::-1]
    add[1:] += (tot_a - low_a)[::-1]
    from scipy.special import ndtr

    add[0] += float(ndtr(-x_hi / z))  # N(0) above the range: losses below the lowest point
    add *= 1 + _QUAD_RTOL
    return (_Pmf(k_lo, rem, min(1.0, pair.tail_above(x_hi))),
            _Pmf(-k_hi, add, min(1.0, float(ndtr(x_lo / z)))))


def _split_both(ell_lo: np.ndarray, h: float, x_a: np.ndarray, x_b: np.ndarray, pair: _Pair
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_split` for the remove pair and, on the same nodes, for its swap (module doc of
    :func:`_gaussian_pmf_pair`): per cell, (remove lower, remove total, add lower, add
    total), the add lower being the mass sent to the add cell's lower point -(ell_lo + h)."""
    width = x_b - x_a
    z = pair.z
    dist = np.maximum(np.abs(x_a), np.abs(x_b))  # to N(0)'s mean, 0
    for m in pair.means:
        if m != 0.0:
            dist = np.minimum(dist, np.maximum(np.abs(x_a - m), np.abs(x_b - m)))
    # remove's criterion (the nearest component) and N(0)'s (its own mean)
    near0 = np.maximum(np.abs(x_a), np.abs(x_b))
    piece = np.minimum(_PIECE * z, _PIECE * z * z / np.maximum(np.maximum(dist, near0),
                                                               1e-300))
    xs, half, bot, cell, n = _nodes(x_a, width, piece, ell_lo)
    norm = -math.log(z * math.sqrt(2 * math.pi))
    scale = math.expm1(h)
    with np.errstate(under="ignore", over="ignore", invalid="ignore"):
        base = xs / z
        base *= base
        base *= -0.5
        base += norm
        dens_a = np.exp(base, out=base)  # N(0)'s density
        t = (2 * xs - 1) / (2 * z * z)
        if float(t.max()) <= 700.0:
            # the remove loss log(1 - q + q e^t) and the mixture's density N(0) e^loss,
            # sharing expm1(t)
            mix = np.expm1(t, out=t)
            mix *= pair.q
            ell = np.log1p(mix)
            mix += 1.0
            dens_r = mix
            dens_r *= dens_a
        else:
            ell = pair.loss(xs)
            dens_r = dens_a * np.exp(ell)
        for d in (dens_r, dens_a):
            d[:n] *= half * _GL_WEIGHTS[0]
            d[n:] *= half * _GL_WEIGHTS[1]
        # the add split a_a = expm1(ell - bot) / expm1(h) and the remove split
        # a_r = expm1(top - ell) / expm1(h) = (expm1(h) - u) / ((1 + u) expm1(h)) with
        # u = expm1(ell - bot), top - bot = h: one expm1 for both
        u = np.concatenate([bot, bot])
        np.subtract(ell, u, out=u)
        np.expm1(u, out=u)
        a_a = u / scale
        a_r = (scale - u) / scale
        u += 1.0
        a_r /= u
    out = []
    for a, d in ((a_r, dens_r), (a_a, dens_a)):
        a = np.clip(np.nan_to_num(a, nan=1.0, posinf=1.0, copy=False), 0.0, 1.0, out=a)
        a *= d
        lower: np.ndarray = a[:n] + a[n:]
        total: np.ndarray = d[:n] + d[n:]
        if cell is not None:
            lower = np.bincount(cell, weights=lower, minlength=width.size)
            total = np.bincount(cell, weights=total, minlength=width.size)
        out += [lower, total]
    return out[0], out[1], out[2], out[3]


#: The last few pairs of one-step PMFs (remove, add), by (z, q, h, budget): the two
#: directions of one composition are priced one after the other.
_PAIRS: dict[tuple[float, float, float, float], tuple[_Pmf, _Pmf]] = {}


def _rr_pmf(eps0: float, h: float) -> _Pmf:
    """Connect-the-dots PMF of randomized response RR(eps0) (both directions alike)."""
    p = 1.0 / (1.0 + math.exp(-eps0))
    k_lo, k_hi = math.floor(-eps0 / h), math.ceil(eps0 / h)
    if k_hi - k_lo > MAX_CELLS:
        raise _TooFine(int((k_hi - k_lo) * MAX_POINTS / MAX_CELLS))
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
        elif direction in ("remove", "add") and atom.sampling_probability < 1:
            key = (atom.noise_multiplier, atom.sampling_probability, h, budget / n)
            both = _PAIRS.get(key)
            if both is None:
                if len(_PAIRS) >= 8:
                    _PAIRS.clear()
                both = _PAIRS[key] = _gaussian_pmf_pair(*key)
            out.append((both[0] if direction == "remove" else both[1], n))
        else:
            pair = _Pair(direction, atom.noise_multiplier, atom.sampling_probability)
            out.append((_gaussian_pmf(pair, h, budget / n), n))
    return out


def _moments(pmf: _Pmf, h: float) -> tuple[float, float]:
    """Mean and variance of the finite part (normalised)."""
    m = pmf.masses
    tot = float(m.sum())
    if tot <= 0:
        return 0.0, 0.0
    k = (pmf.k0 + np.arange(m.size)) * h
    # Products summed by numpy's pairwise sum, not np.dot: BLAS would spin up its threads
    # for one vector, which costs more than the sum on a busy machine (bench/accounting.py).
    mean = float((m * k).sum() / tot)
    var = float((m * (k - mean) ** 2).sum() / tot)
    return mean, var
