"""Audits and sampler tests, run as rates: each real mechanism passes, its 0.8x-noise mutant fails.

tests/privkit/test_audit.py runs every audit once per fixed seed; here the same audits run
over many seeds so that the false-failure rate (real mechanism) and the power (0.8x noise)
are *measured*, and printed. CI runs the cheap batched audits (Gaussian, 20 seeds per side;
coded data, an MI-DP audit in nats, 10) and ``PRIVKIT_SOAK=1`` adds the three loop-based audits
(laplace-l2 at d = 1, laplace-l1 at d = 2, objective) over 20 seeds per side each and REC (its
0.8x mutant needs the default 1e5 draws, ~20 s per run) over 5 seeds per side.

The sampler part feeds the noise of the real mechanism objects (not the bare samplers) to
norm and direction tests at n = 20 000 draws: Gaussian output perturbation (KS against
N(0, stddev^2) per coordinate), Laplace gradient noise and the objective-perturbation linear
term (L2 shape: KS of the norm against Gamma(d, scale 1/alpha), and the direction's first
coordinate against its Beta law on the sphere). Their 0.8x-noise mutants and a
wrong-direction mutant must fail. Each test's level is 1e-4, so a correct sampler fails one
of them with probability 1e-4.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from _soak import SOAK, scaled
from scipy import stats

import privkit
from privkit import audit as A

SEEDS = scaled(20, 20)
TRIALS = {"gaussian": 100_000, "laplace-l2": 10_000, "laplace-l1": 20_000, "objective": 20_000,
          "coded": 10_000, "rec": 100_000}
SEEDS_OF = {"rec": 5, "coded": scaled(10, 50)}
EXTRA = {"laplace-l2": {"dimension": 1}}
AUDITS = ["gaussian", "coded"] + (["laplace-l2", "laplace-l1", "objective", "rec"]
                                  if SOAK else [])
assert set(TRIALS) == set(A.ALL_MECHANISMS)  # every mechanism has a rate test


@pytest.mark.parametrize("name", AUDITS)
def test_audit_false_failure_rate_and_power(name):
    kw = {"trials": TRIALS[name], **EXTRA.get(name, {})}
    seeds = SEEDS_OF.get(name, SEEDS)
    real = [A.audit(name, seed=1000 + s, **kw) for s in range(seeds)]
    mutant = [A.audit(name, noise_scale=0.8, seed=2000 + s, **kw) for s in range(seeds)]
    false_failures = sum(not r.passed for r in real)
    caught = sum(not r.passed for r in mutant)
    worst_real = max(r.empirical_epsilon_lower for r in real)
    best_mutant = min(r.empirical_epsilon_lower for r in mutant)
    print(f"\naudit {name}: real fails {false_failures}/{seeds} (max lower bound "
          f"{worst_real:.3f}, claim {real[0].claimed_epsilon:.3f}); 0.8x noise caught "
          f"{caught}/{seeds} (min lower bound {best_mutant:.3f})")
    assert false_failures == 0
    assert caught == seeds


# ------------------------------------------------------------- samplers of real mechanisms
N = 20_000
LEVEL = 1e-4
D = 5
ALPHA = 2.0


def _gaussian_draws(noise_scale: float) -> np.ndarray:
    mech = privkit.GaussianOutputPerturbation.from_stddev(1.0, 0.5, _noise_scale=noise_scale)
    return mech({"w": np.zeros(N)}, rng=np.random.default_rng(3))["w"]


@functools.cache
def _laplace_draws(noise_scale: float, direction: str = "sphere") -> np.ndarray:
    """n draws of LaplaceGradientNoise (L2 shape, d = D) on a zero batch: pure noise."""
    mech = privkit.LaplaceGradientNoise(l2_clip_norm=1.0, batch_size=1, epsilon=ALPHA * 2.0,
                                        _noise_scale=noise_scale)
    assert mech.alpha == pytest.approx(ALPHA)
    rng = np.random.default_rng(4)
    if direction != "sphere":
        x = None
    else:
        x = np.stack([mech({"g": np.zeros((1, D))}, rng=rng)["g"] for _ in range(N)])
    if direction == "cube":  # mutant: keep the norm, take the direction from a cube
        x = _laplace_draws(noise_scale)
        c = rng.random((N, D)) - 0.5
        x = np.linalg.norm(x, axis=1, keepdims=True) * c / np.linalg.norm(c, axis=1,
                                                                          keepdims=True)
    return x


def _objective_draws(noise_scale: float) -> np.ndarray:
    mech = privkit.ObjectivePerturbation(alpha=ALPHA, dataset_size=100, proximal_mu=1.0,
                                         _noise_scale=noise_scale)
    rng = np.random.default_rng(5)
    return np.stack([mech.linear_term({"w": np.zeros(D)}, rng=rng)["w"] for _ in range(N)])


def _l2_tests(x: np.ndarray, alpha: float) -> dict[str, float]:
    r = np.linalg.norm(x, axis=1)
    u1 = x[:, 0] / r
    half = (x.shape[1] - 1) / 2
    return {"norm": stats.kstest(r, stats.gamma(x.shape[1], scale=1 / alpha).cdf).pvalue,
            "direction": stats.kstest((u1 + 1) / 2, stats.beta(half, half).cdf).pvalue}


def test_gaussian_output_perturbation_scale():
    p_real = stats.kstest(_gaussian_draws(1.0), stats.norm(scale=0.5).cdf).pvalue
    p_mutant = stats.kstest(_gaussian_draws(0.8), stats.norm(scale=0.5).cdf).pvalue
    assert p_real > LEVEL and p_mutant < LEVEL, (p_real, p_mutant)


@pytest.mark.parametrize("draws", [_laplace_draws, _objective_draws],
                         ids=["laplace-gradient-noise", "objective-linear-term"])
def test_l2_laplace_mechanisms_norm_and_direction(draws):
    real = _l2_tests(draws(1.0), ALPHA)
    assert min(real.values()) > LEVEL, real
    mutant = _l2_tests(draws(0.8), ALPHA)
    assert mutant["norm"] < LEVEL, mutant  # 0.8x noise: the norm law is off


def test_wrong_direction_mutant_is_caught():
    p = _l2_tests(_laplace_draws(1.0, direction="cube"), ALPHA)
    assert p["norm"] > LEVEL and p["direction"] < LEVEL, p
