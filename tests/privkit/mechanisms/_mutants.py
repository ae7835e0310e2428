"""The L2-Laplace test battery of spec mechanisms.md section 3, and samplers that must fail it.

``battery(x, alpha)`` takes n draws (an (n, d) float64 array) and returns the p-value of each
statistical test; ``failed(p)`` applies the spec's threshold p < 1e-3 / k with k the number of
tests run. Each mutant returns an (n, d) array of draws; the first six are the samplers of
spec 2.4 / 3 ("must never ship"); the last three exist so that every test in the battery
kills at least one mutant (the spec's Rayleigh, Bingham and Spearman tests kill none of the
six, which only ever break the radius law or the direction's marginal).
"""

from __future__ import annotations

import numpy as np
from scipy import stats

LEVEL = 1e-3


def battery(x: np.ndarray, alpha: float) -> dict[str, float]:
    """p-values of the spec's tests: norm KS, Rayleigh, Bingham, Beta KS, Spearman."""
    x = np.asarray(x, dtype=np.float64)
    n, d = x.shape
    r = np.sqrt(np.einsum("ij,ij->i", x, x))
    u = x / r[:, None]
    p = {"norm_ks": stats.kstest(r, stats.gamma(d, scale=1.0 / alpha).cdf).pvalue}
    mean = u.mean(axis=0)
    p["rayleigh"] = stats.chi2.sf(n * d * float(mean @ mean), d)
    if d >= 2:
        # einsum, not u.T @ u: a multithreaded BLAS stalls badly on a busy 2-core runner.
        second = np.einsum("ij,ik->jk", u, u) / n - np.eye(d) / d
        stat = n * d * (d + 2) / 2.0 * float(np.sum(second * second))
        p["bingham"] = stats.chi2.sf(stat, (d - 1) * (d + 2) / 2.0)
        half = (d - 1) / 2.0
        p["beta_ks"] = stats.kstest((u[:, 0] + 1.0) / 2.0, stats.beta(half, half).cdf).pvalue
        p["spearman"] = stats.spearmanr(r, np.abs(u[:, 0])).pvalue
    return {k: float(v) for k, v in p.items()}


def failed(p: dict[str, float]) -> list[str]:
    """Names of the tests with p < LEVEL / k (Bonferroni over the k tests run)."""
    k = len(p)
    return sorted(name for name, value in p.items() if value < LEVEL / k)


def _sphere(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    g = rng.standard_normal((n, d))
    return g / np.linalg.norm(g, axis=1, keepdims=True)


def _cube(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    c = rng.random((n, d)) - 0.5
    return c / np.linalg.norm(c, axis=1, keepdims=True)


def correct(rng: np.random.Generator, n: int, d: int, alpha: float) -> np.ndarray:
    """Reference: Gamma(d, scale 1/alpha) radius times a uniform direction."""
    return rng.gamma(d, 1.0 / alpha, size=(n, 1)) * _sphere(rng, n, d)


def rate_scale_swapped(rng: np.random.Generator, n: int, d: int, alpha: float) -> np.ndarray:
    """numpy given a rate where it takes a scale: Gamma(d, scale alpha)."""
    return rng.gamma(d, alpha, size=(n, 1)) * _sphere(rng, n, d)


def gamma_d_minus_1(rng: np.random.Generator, n: int, d: int, alpha: float) -> np.ndarray:
    """Radius Gamma(d - 1): the polar Jacobian forgotten (d >= 2)."""
    return rng.gamma(d - 1, 1.0 / alpha, size=(n, 1)) * _sphere(rng, n, d)


def iid_laplace(rng: np.random.Generator, n: int, d: int, alpha: float) -> np.ndarray:
    """I.i.d. Laplace(1/alpha) per coordinate passed off as the L2 mechanism."""
    return rng.laplace(0.0, 1.0 / alpha, size=(n, d))


def cube_direction(rng: np.random.Generator, n: int, d: int, alpha: float) -> np.ndarray:
    """Correct radius, normalised uniform-cube direction (Upcycled-FL and MAPA code)."""
    return rng.gamma(d, 1.0 / alpha, size=(n, 1)) * _cube(rng, n, d)


def mapa_laplace_magnitude(rng: np.random.Generator, n: int, d: int, alpha: float) -> np.ndarray:
    """MAPA code: a normalised cube direction times one scalar 1-D Laplace(1/alpha) draw."""
    return rng.laplace(0.0, 1.0 / alpha, size=(n, 1)) * _cube(rng, n, d)


UPCYCLED_SHAPES = ((2, 20), (2,))  # nn.Linear(20, 2): weight and bias, d = 42
UPCYCLED_D = 42


def upcycled_per_tensor(rng: np.random.Generator, n: int, alpha: float) -> np.ndarray:
    """Upcycled-FL code for Linear(20, 2): radius Gamma(feature_len = 20, 1/alpha), one
    ``rand - 0.5`` cube per tensor, every tensor normalised by the *sum* of per-tensor norms."""
    radius = rng.gamma(20, 1.0 / alpha, size=(n, 1))
    cubes = [rng.random((n, int(np.prod(s)))) - 0.5 for s in UPCYCLED_SHAPES]
    total = sum(np.linalg.norm(c, axis=1, keepdims=True) for c in cubes)
    return radius * np.concatenate(cubes, axis=1) / total


# Extra mutants so that each of the five tests kills at least one sampler.
def shifted_direction(rng: np.random.Generator, n: int, d: int, alpha: float) -> np.ndarray:
    """A direction with a drift (g + 0.1 normalised): caught by the Rayleigh test."""
    g = rng.standard_normal((n, d)) + 0.1
    return rng.gamma(d, 1.0 / alpha, size=(n, 1)) * g / np.linalg.norm(g, axis=1, keepdims=True)


def anisotropic_direction(rng: np.random.Generator, n: int, d: int, alpha: float) -> np.ndarray:
    """A direction from N(0, diag(1.2, 1, ..., 1)) with the *second* axis stretched: the first
    coordinate's marginal barely moves, the second moment does (Bingham)."""
    g = rng.standard_normal((n, d))
    g[:, 1] *= 1.2
    return rng.gamma(d, 1.0 / alpha, size=(n, 1)) * g / np.linalg.norm(g, axis=1, keepdims=True)


def coupled_radius(rng: np.random.Generator, n: int, d: int, alpha: float) -> np.ndarray:
    """Right radius law and right direction law, but half the radii are sorted against |u_1|
    (the largest radii go with the largest |u_1|): caught only by the Spearman test."""
    u = _sphere(rng, n, d)
    r = rng.gamma(d, 1.0 / alpha, size=n)
    half = n // 2
    order = np.argsort(np.abs(u[:half, 0]))
    r_half = np.sort(r[:half])
    r[:half][order] = r_half
    return r[:, None] * u
