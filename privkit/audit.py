"""Statistical privacy audits: empirical lower bounds on epsilon for the mechanisms.

An audit runs a real mechanism object (``privkit.mechanisms``) many times on two
neighbouring inputs, turns what it sees into a high-confidence **lower** bound on
the privacy loss, and compares it with what the mechanism claims. It is a
regression test against miscalibrated noise (mechanisms.md section 5), not a proof:
a black-box audit cannot see bugs that only show on rare inputs, nor accountant
bugs or floating-point porosity.

Design (mechanisms.md 5):

* **Neighbours.** Raw inputs of norm 1000 along a unit direction ``u``, so that
  clipping is exercised; after clipping the two centres are one sensitivity apart
  (the worst case of the replace-one relation).
* **Real code, no re-implemented noise.** Every noise draw comes from the
  mechanism's own ``__call__`` / ``linear_term`` with a ``numpy.random.Generator``:

  - ``gaussian``: one call of the mechanism on a zero tree with ``2 * trials``
    coordinates gives that many i.i.d. noise draws (the noise is i.i.d. per
    coordinate and clipping returns the zero vector unchanged).
  - ``laplace-l2`` / ``laplace-l1``: the noise spans all d coordinates of one
    output, so one call gives one draw: ``trials`` calls per half on an all-zero
    batch. The same draws serve both neighbours (valid: the two confidence bounds
    are combined by a union bound, which needs no independence).
  - In both, the clipped centres of the neighbours are measured with the real
    mechanism as ``M(x; rng_s) - M(0; rng_s)`` for 16 seeds ``s``, and the audit
    refuses (NumericalError) unless that difference is the same for every seed,
    i.e. unless the noise is additive and independent of the input, which is what
    makes these draws equivalent to calling the mechanism on ``x`` itself.
  - ``objective``: ``linear_term`` is called once per draw (it never sees the
    data); the perturbed objective of a one-parameter GLM is then solved to machine
    precision for both neighbouring datasets (vectorised Newton).
* **Halves.** The threshold ``t`` (and the orientation of the event) of a threshold
  audit is chosen on a calibration half and the counts are taken on a fresh
  evaluation half (re-using samples biases the bound upwards). ``trials`` is the
  number of draws per neighbour per half; the GDP audit fixes ``t = Delta/2`` in
  advance and so has no calibration half (``trials`` draws per neighbour).
* **Bounds.** One-sided Clopper-Pearson. Threshold audit (pure DP, delta = 0):
  ``eps_lb = max(ln(TPR_lo / FPR_hi), ln((1 - FPR_hi) / (1 - TPR_lo)))`` with
  ``alpha/4`` per bound (conservative). GDP audit:
  ``gdp_mu_lb = Phi^-1(1 - FPR_hi) - Phi^-1(FNR_hi)`` with ``alpha/2`` each.
  An audit fails (a violation) when the lower bound exceeds the claim.

Power and false-failure rates at the defaults (``trials = 1e5``, ``alpha = 1e-3``),
measured with the real mechanisms over fresh seeds (5 per cell for the loop-based
audits, 50 for ``gaussian``; the spec's 1-D Laplace row is 40/40 at 0.8x):

==================  ====================  ==========================  =====================
audit               claim                 noise 1.0: lower bound      noise 0.8
==================  ====================  ==========================  =====================
gaussian (GDP)      mu 0.268 (eps 1.00)   mu_lb 0.241 (max 0.255)     fails 50/50 (min .297)
laplace-l2, d = 2   eps 1                 0.912 (max 0.915), 0 fail   fails 5/5 (min 1.142)
laplace-l1, d = 2   eps 1                 0.957 (max 0.960), 0 fail   fails 5/5 (min 1.171)
objective           eps 1.014             0.968 (max 0.975), 0 fail   fails 5/5 (min 1.200)
==================  ====================  ==========================  =====================

REC (``rec``, relative entropy coding, K = 64, c = C/sigma = 0.5 per one-coordinate group)
is audited in the Renyi domain: the claim is the accountant's D_2 bound 1.0225 (the exact
D_2 of the full view is ~0.978 by Monte Carlo, of the 0.8x-noise view ~1.52); the lower bound
is :func:`renyi2_lower_bound` on the view's log-likelihood ratio (of the claimed mechanism)
binned on fixed edges. ``noise_scale`` s makes the selection target ``u / s``, which is REC
with stddev ``s sigma`` under the same claim. Measured over fresh seeds with the real
mechanism:

==================  ====================  ==========================  =====================
rec, draws          claim (D_2)           real: lower bound           0.8x noise
==================  ====================  ==========================  =====================
1e5 (3 seeds)       1.0225                0.712-0.740, 0/3 fail       1.157-1.188, 3/3 fail
4e3 (3 seeds)       1.0225                0.323-0.339, 0/3 fail       4x target: 3.75-3.82
==================  ====================  ==========================  =====================

The previous design (K = 16, the decoded value binned) was blind to 0.8x noise even at 1e5
(lower bounds 0.74-0.79 at 2e4 against a claim of 1.093): the decoded value loses most of the
view's divergence, and at K = 16 the accountant's bound is 20% above the exact D_2. 0.8x is
caught only from ~1e5 draws (at 2e4 the simulated lower bound of the mutant is ~0.95 x claim),
and a run at 1e5 takes ~20 s on one free core (one encode of 1e5 groups of 64 candidates plus
their regeneration, per neighbour), so CI tests one 0.8x mutant run and ``make soak`` the rates.

Coded data (``coded``, SCFL's one-time upload ``G X + sigma N``, :mod:`privkit.mechanisms.coded`)
is audited in the MI-DP domain (nats): d = 1, c = 64, rho = 1, sigma = 2; one record is 0 or
rho (raw 1000, clipped by the mechanism), the client has no other record (Theorem F's worst
case). The claim is :func:`~privkit.accountants.midp.midp_coded_features` = 0.16805 nats; the
lower bound is :func:`binary_mi_lower_bound` (binary-channel MI of the event
``||Y||^2 / c >= t`` under a prior pi on the record, both chosen on a calibration half; at
least Fano's ``log 2 - H_b(P_e)``). The setting is chosen where Theorem F is nearly tight
(small snr: the bound tends to the capacity ``c snr^2 / 16``), so that 0.8x noise (1.56x the
snr, ~2.4x the MI) is visible through a binary quantisation. Measured with the real mechanism:

==================  ====================  ==========================  =====================
coded, draws        claim (nats)          real: lower bound           0.8x noise
==================  ====================  ==========================  =====================
1e5 (50 seeds)      0.16805               0.109-0.113, 0/50 fail      0.219-0.225, 50/50
2e4 (50 seeds)      0.16805               0.101-0.110, 0/50 fail      0.209-0.220, 50/50
1e4 (20 seeds)      0.16805               0.096-0.106, 0/20 fail      0.200-0.213, 20/20
==================  ====================  ==========================  =====================

Smaller miscalibrations: 0.85x noise fails 20/20 at 1e5 (min 0.183) and 20/20 at 2e4 (min
0.171, a thin margin); 0.9x passes 20/20 at 1e5 (max 0.158): the audit cannot see 0.9x, because
the binary quantisation keeps only ~2/3 of the true information (real: ~0.11 of at most
0.168). The false-failure rate is at most alpha = 1e-3 by construction whenever the claim is
a true upper bound (the lower bound holds with probability >= 1 - alpha); with 50/50
detections the power at 0.8x is >= 0.94 at 95% confidence (the margin is ~10 standard
deviations, so it is in fact ~1). The same holds for ``rec`` with its own claim; 3/3 runs per
side at 1e5 only show power >= 0.37 at 95% confidence, but the mutant's bounds sit ~0.15 above
the claim with a run-to-run spread of ~0.015.

Cost on 2 CPU cores: ``gaussian`` ~0.02 s; a call of the Laplace mechanism takes
~0.06 ms, so ``laplace-*`` at 1e5 takes ~12 s; ``objective`` ~6 s. The tests run the
loop-based audits at 1e4-3e4 draws, where 20 fresh seeds still gave 0 false
failures and 20/20 detections (margins in tests/privkit/test_audit.py). Power
against 0.9x noise was not measured here (the spec's GDP audit catches it ~73% of
the time).

Statistics. For the d = 2 Laplace audits the projection ``<y, u>`` of the spec is
weak (in a simulation at 1e5 it caught 0.8x noise in only 11/20 runs for the L2
shape and never for the L1 shape), so the event family is ``{s(y) >= t}`` with the
likelihood-ratio statistic of the *claimed* noise shape,
``s(y) = (||y - c_D||_p - ||y - c_D'||_p) / Delta_p`` (``p = 2`` or ``1``), from the
nominal clipped centres and rounded to 1e-9 (see :func:`_distance_statistic`). At
d = 1 it is a monotone function of the projection, i.e. the spec's test. Any fixed
statistic gives a valid lower bound. The L1 audit shifts along ``(1, 1)/sqrt(2)``,
where the L1 distance equals the mechanism's ``l1_sensitivity(2)``, so a wrong
``sqrt(d)`` factor would show; ``dimension=1`` runs the spec's 1-D audit.

The objective audit uses a one-parameter GLM with the margin-softplus loss
``l(z) = softplus(beta (1 - z)) / beta`` (convex, ``u1 = 1``, ``u2 = beta/4``) on
features in ``[-1, 1]``: near ``w = 0`` its per-example gradient is ``-y x``, so
flipping one label moves the gradient by the full ``2 u1 / |D|`` that Thm C.2
charges for, which makes the audit tight. (The logistic loss cannot do this in one
dimension: ``sigma(w) + sigma(-w) = 1`` halves the gradient change, so a 0.8x-noise
mechanism would pass.)
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from scipy import special, stats

from privkit import _validate
from privkit.errors import InvalidParameterError, NumericalError

__all__ = [
    "AuditResult",
    "MECHANISMS",
    "DEFAULT_TRIALS",
    "REPORT_DELTA",
    "audit",
    "clopper_pearson_upper",
    "clopper_pearson_lower",
    "threshold_epsilon_lower_bound",
    "gdp_mu_lower_bound",
    "ALL_MECHANISMS",
    "renyi2_lower_bound",
    "binary_mi_lower_bound",
]

MECHANISMS: tuple[str, ...] = ("gaussian", "objective", "laplace-l2", "laplace-l1")
"""Names accepted by :func:`audit` and ``privkit audit``."""

ALL_MECHANISMS: tuple[str, ...] = (*MECHANISMS, "rec", "coded")
"""Every audit :func:`audit` runs: :data:`MECHANISMS` plus ``rec`` (relative entropy coding)
and ``coded`` (SCFL coded data, an MI-DP audit in nats)."""

DEFAULT_TRIALS: Mapping[str, int] = {name: 100_000 for name in ALL_MECHANISMS}
"""Draws per neighbour (per half for threshold audits): the spec's CI recipe."""

REPORT_DELTA = 1e-5
"""delta at which the Gaussian audit converts gdp_mu into epsilon."""

RAW_NORM = 1000.0  # raw input norm, far above every clip norm: clipping is exercised

# Gaussian: the analytic-Gaussian sigma of eps = 1 at delta = 1e-5 (mechanisms.md 5).
_GAUSS_CLIP = 0.5  # replace-one sensitivity of a clipped output: 2 C = 1
_GAUSS_Z = 3.7306

# Laplace gradient noise: sensitivity 2 G / b = 1, epsilon 1.
_LAP_CLIP = 2.0
_LAP_BATCH = 4
_LAP_EPS = 1.0

# Objective perturbation (Thm C.2): step epsilon = 2 a u1/|D| + 1.4 r u2/(|D| mu) = 1.014.
_OBJ_SIZE = 100
_OBJ_MU = 10.0
_OBJ_ALPHA = 50.0
_OBJ_BETA = 20.0  # loss sharpness; u2 = beta / 4
_OBJ_MARGIN = 1.0

# REC: K = 64 candidates, c = C / sigma = 0.5 per one-coordinate group; claim D_2 <= 1.0225
# (Theorem R; the exact D_2 of the full view is ~0.978 by Monte Carlo, of a 0.8x-noise view ~1.52).
_REC_BITS = 6
_REC_C = 0.5
_REC_EDGES = np.array([0.0, 1.0, 1.75, 2.35, 3.0])  # on the log-likelihood-ratio statistic
_REC_D2_VIEW = 0.978
_REC_DECODE_CHECK = 4096  # up to this many draws, decode() is checked against xi_{k*}

# Coded data (SCFL): d = 1, c = 64 coded rows, rho = 1, sigma = 2 (snr = 1/4); the record is
# 0 or (raw 1000, clipped to) rho, the other records 0. Claim: Theorem F, 0.16805 nats.
_CODED_ROWS = 64
_CODED_SIGMA = 2.0
_CODED_RHO = 1.0
_CODED_CHUNK = 8192  # trials per call of the mechanism (c * chunk coded rows)
_CODED_PRIORS = np.linspace(0.1, 0.9, 17)

_CENTRE_SEEDS = 16  # seeds used to measure the clipped centres / check additivity
_ADDITIVITY_RTOL = 1e-9


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """Outcome of one audit.

    Attributes:
        mechanism: the audited name (one of :data:`ALL_MECHANISMS`).
        claimed_epsilon: epsilon the mechanism claims for one use (for ``gaussian``
            the exact epsilon of its gdp_mu at ``delta = 1e-5``; for ``rec`` the Renyi D_2
            and for ``coded`` the MI-DP bound, both in nats).
        empirical_epsilon_lower: the audit's lower bound on the true epsilon, at
            confidence ``1 - alpha`` (clamped at 0; for ``gaussian`` converted from
            ``gdp_mu_lb`` the same way as the claim).
        passed: True when no violation was found (lower bound <= claim).
        trials: draws per neighbour (per half for threshold audits).
        noise_scale: factor on the noise (1.0 = the real mechanism; < 1 builds a
            deliberately broken one).
        statistic: the test that was run.
        details: JSON-ready numbers behind the verdict (counts, bounds, threshold,
            the mechanism's settings, the seed entropy, seconds).
    """

    mechanism: str
    claimed_epsilon: float
    empirical_epsilon_lower: float
    passed: bool
    trials: int
    noise_scale: float
    statistic: str
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``details`` copied)."""
        return {
            "mechanism": self.mechanism,
            "claimed_epsilon": self.claimed_epsilon,
            "empirical_epsilon_lower": self.empirical_epsilon_lower,
            "passed": self.passed,
            "trials": self.trials,
            "noise_scale": self.noise_scale,
            "statistic": self.statistic,
            "details": dict(self.details),
        }


# ------------------------------------------------------------------ bounds


def clopper_pearson_upper(k: Any, n: int, a: float) -> np.ndarray:
    """One-sided upper (1 - a) Clopper-Pearson bound on p from k successes in n (vectorised)."""
    k = np.asarray(k, dtype=np.float64)
    out = stats.beta.ppf(1.0 - a, k + 1.0, np.maximum(n - k, 1.0))
    return np.where(k >= n, 1.0, out)


def clopper_pearson_lower(k: Any, n: int, a: float) -> np.ndarray:
    """One-sided lower (1 - a) Clopper-Pearson bound on p from k successes in n (vectorised)."""
    k = np.asarray(k, dtype=np.float64)
    out = stats.beta.ppf(a, np.maximum(k, 1.0), n - k + 1.0)
    return np.where(k <= 0, 0.0, out)


def threshold_epsilon_lower_bound(
    k0: Any, k1: Any, n: int, alpha: float, delta: float = 0.0
) -> np.ndarray:
    """eps lower bound from k0 of n draws of M(D) and k1 of n draws of M(D') in an event S.

    ``max(ln((TPR_lo - delta) / FPR_hi), ln((1 - FPR_hi - delta) / (1 - TPR_lo)))``,
    each Clopper-Pearson bound at ``alpha/4`` (mechanisms.md 5). ``-inf`` where
    both logarithms are undefined.
    """
    fpr_hi = clopper_pearson_upper(k0, n, alpha / 4)
    tpr_lo = clopper_pearson_lower(k1, n, alpha / 4)
    with np.errstate(divide="ignore", invalid="ignore"):
        e1 = np.log((tpr_lo - delta) / fpr_hi)
        e2 = np.log((1.0 - fpr_hi - delta) / (1.0 - tpr_lo))
    out = np.fmax(e1, e2)
    return np.where(np.isnan(out), -np.inf, out)


def gdp_mu_lower_bound(false_pos: int, false_neg: int, n: int, alpha: float) -> float:
    """``Phi^-1(1 - FPR_hi) - Phi^-1(FNR_hi)``, each bound at ``alpha/2`` (mechanisms.md 5)."""
    fpr_hi = float(clopper_pearson_upper(false_pos, n, alpha / 2))
    fnr_hi = float(clopper_pearson_upper(false_neg, n, alpha / 2))
    return float(stats.norm.ppf(1.0 - fpr_hi) - stats.norm.ppf(fnr_hi))


def _count_at_least(sorted_s: np.ndarray, t: Any) -> np.ndarray:
    return sorted_s.size - np.searchsorted(sorted_s, t, side="left")


def _threshold_audit(
    cal0: np.ndarray, cal1: np.ndarray, ev0: np.ndarray, ev1: np.ndarray, alpha: float
) -> dict[str, Any]:
    """Choose an orientation and t on the calibration half; bound eps on the evaluation half.

    The event is ``S = {sign * s >= t}``. The bound's formula needs S to favour D'
    (its first term) or its complement to favour D (second term), so both signs are
    tried on the calibration half and the better one is kept.
    """
    n_cal, n_ev = cal0.size, ev0.size
    best: tuple[float, float, float] = (-np.inf, 1.0, float(np.median(cal0)))
    for sign in (1.0, -1.0):
        c0, c1 = np.sort(sign * cal0), np.sort(sign * cal1)
        pooled = np.sort(np.concatenate([c0, c1]))
        m = pooled.size
        frac = np.geomspace(min(5.0 / m, 0.5), 0.5, 200)
        idx = np.clip(np.concatenate([frac * m, (1.0 - frac) * m]).astype(np.int64), 0, m - 1)
        cands = np.unique(pooled[idx])
        scores = threshold_epsilon_lower_bound(
            _count_at_least(c0, cands), _count_at_least(c1, cands), n_cal, alpha
        )
        i = int(np.argmax(scores))
        if scores[i] > best[0]:
            best = (float(scores[i]), sign, float(cands[i]))
    score, sign, t = best
    k0 = int(np.count_nonzero(sign * ev0 >= t))
    k1 = int(np.count_nonzero(sign * ev1 >= t))
    eps_lb = float(threshold_epsilon_lower_bound(k0, k1, n_ev, alpha))
    return {
        "threshold": t,
        "orientation": sign,
        "calibration_epsilon_lower": score,
        "count_D": k0,
        "count_D_prime": k1,
        "fpr_hi": float(clopper_pearson_upper(k0, n_ev, alpha / 4)),
        "tpr_lo": float(clopper_pearson_lower(k1, n_ev, alpha / 4)),
        "epsilon_lower_raw": eps_lb,
    }


# ------------------------------------------------------------- helpers


def _spawn(seed: int | None, k: int) -> tuple[int, list[np.random.Generator]]:
    ss = np.random.SeedSequence(seed)
    entropy = int(ss.entropy)  # type: ignore[arg-type]  # an int for int or None seeds
    return entropy, [np.random.default_rng(c) for c in ss.spawn(k)]


def _measured_difference(
    call_a: Callable[[np.random.Generator], Any],
    call_b: Callable[[np.random.Generator], Any],
    seed_rng: np.random.Generator,
    what: str,
) -> np.ndarray:
    """``call_b(rng_s) - call_a(rng_s)`` for fresh seeds s; refuses if it varies with s.

    A constant difference means the noise is additive and does not depend on the
    input, which is what lets the audit batch or couple its draws.
    """
    seeds = seed_rng.integers(0, 2**63 - 1, size=_CENTRE_SEEDS)
    diffs, scale = [], 0.0
    for s in seeds:
        a = np.asarray(call_a(np.random.default_rng(int(s))), dtype=np.float64)
        b = np.asarray(call_b(np.random.default_rng(int(s))), dtype=np.float64)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise NumericalError(f"audit: the mechanism returned a non-finite output ({what})")
        diffs.append(b - a)
        scale = max(scale, float(np.max(np.abs(a))), float(np.max(np.abs(b))))
    d = np.stack(diffs)
    spread = float(np.max(np.abs(d - d[0])))
    if spread > _ADDITIVITY_RTOL * max(scale, 1.0):
        raise NumericalError(
            f"audit: M(x; rng) - M(x'; rng) varies with the seed ({what}; spread {spread:.3g}): "
            "the noise is not additive and input independent, so this audit does not apply"
        )
    return d.mean(axis=0)


def _direction(d: int) -> np.ndarray:
    return np.full(d, 1.0 / math.sqrt(d))


# ------------------------------------------------------------- gaussian


def _audit_gaussian(trials: int, noise_scale: float, seed: int | None, alpha: float
                    ) -> AuditResult:
    from privkit.accountants.gaussian import exact_epsilon
    from privkit.mechanisms.gaussian import GaussianOutputPerturbation

    mech = GaussianOutputPerturbation(
        l2_clip_norm=_GAUSS_CLIP, noise_multiplier=_GAUSS_Z, _noise_scale=noise_scale
    )
    entropy, (g_centre, g_noise) = _spawn(seed, 2)
    x0 = np.array([-RAW_NORM])  # clips to -C e_1
    x1 = np.array([RAW_NORM])   # clips to +C e_1
    zero = np.zeros(1)

    def on(x: np.ndarray) -> Callable[[np.random.Generator], Any]:
        return lambda g: mech(x, rng=g)

    c0 = float(_measured_difference(on(zero), on(x0), g_centre, "D")[0])
    c1 = float(_measured_difference(on(zero), on(x1), g_centre, "D'")[0])
    noise = np.asarray(mech(np.zeros(2 * trials), rng=g_noise), dtype=np.float64)
    if noise.shape != (2 * trials,) or not np.isfinite(noise).all():
        raise NumericalError("audit: the Gaussian mechanism returned a wrong or non-finite batch")
    sign = 1.0 if c1 >= c0 else -1.0  # project on the direction from D to D'
    y0 = sign * (c0 + noise[:trials])
    y1 = sign * (c1 + noise[trials:])
    # t = Delta/2 from the nominal centres -C, +C (fixed before sampling).
    t = 0.0
    fp = int(np.count_nonzero(y0 > t))
    fn = int(np.count_nonzero(y1 <= t))
    mu_claim = 1.0 / mech.noise_multiplier
    mu_lb = gdp_mu_lower_bound(fp, fn, trials, alpha)
    eps_claim = float(exact_epsilon(mu_claim, REPORT_DELTA))
    eps_lb = float(exact_epsilon(mu_lb, REPORT_DELTA)) if mu_lb > 0 else 0.0
    details = {
        "gdp_mu_claimed": mu_claim,
        "gdp_mu_lower": mu_lb,
        "delta": REPORT_DELTA,
        "alpha": alpha,
        "threshold": t,
        "false_positives": fp,
        "false_negatives": fn,
        "fpr_hi": float(clopper_pearson_upper(fp, trials, alpha / 2)),
        "fnr_hi": float(clopper_pearson_upper(fn, trials, alpha / 2)),
        "centre_D": c0,
        "centre_D_prime": c1,
        "sensitivity": float(mech.sensitivity),
        "stddev_claimed": float(mech.stddev),
        "l2_clip_norm": mech.l2_clip_norm,
        "noise_multiplier": mech.noise_multiplier,
        "seed_entropy": entropy,
    }
    return AuditResult("gaussian", eps_claim, eps_lb, bool(mu_lb <= mu_claim), trials,
                       noise_scale, "gdp trade-off at t = Delta/2 (<y, e_1> > t)", details)


# ------------------------------------------------------------- laplace


def _distance_statistic(y: np.ndarray, c0: np.ndarray, c1: np.ndarray, p: int) -> np.ndarray:
    """``(||y - c0||_p - ||y - c1||_p) / ||c1 - c0||_p``, rounded to 1e-9, in [-1, 1].

    The rounding matters: in the regions where the statistic is constant (+-1) its
    unrounded value varies in the last bits with y, and those bits differ
    systematically between outputs near c0 and near c1, so a threshold placed
    inside that rounding noise measures floating-point structure (a bound of ~4.4
    against a true 1 was seen at d = 1), not the privacy loss the audit is for.
    """
    span = float(np.linalg.norm(c1 - c0, ord=p))
    s = (np.linalg.norm(y - c0, ord=p, axis=1) - np.linalg.norm(y - c1, ord=p, axis=1)) / span
    return np.round(s, 9)


def _audit_laplace(shape_name: str, trials: int, noise_scale: float, seed: int | None,
                   alpha: float, dimension: int) -> AuditResult:
    from privkit.mechanisms.laplace import LaplaceGradientNoise, NoiseShape

    shape = NoiseShape.L2 if shape_name == "l2" else NoiseShape.L1
    mech = LaplaceGradientNoise(l2_clip_norm=_LAP_CLIP, batch_size=_LAP_BATCH,
                                epsilon=_LAP_EPS, shape=shape, _noise_scale=noise_scale)
    d = dimension
    u = _direction(d)
    # Rows 1..b-1 are shared; row 0 is -1000 u in D and +1000 u in D'.
    others = {1: [[500.0], [-0.3], [0.0]], 2: [[500.0, -800.0], [0.3, -0.4], [0.0, 0.0]]}[d]
    base = np.concatenate([np.zeros((1, d)), np.asarray(others)])
    x0, x1 = base.copy(), base.copy()
    x0[0], x1[0] = -RAW_NORM * u, RAW_NORM * u

    def clipped_mean(x: np.ndarray) -> np.ndarray:  # nominal centre, only for the statistic
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        f = np.minimum(1.0, _LAP_CLIP / np.where(norms > 0, norms, 1.0))
        return (x * f).mean(axis=0)

    nom0, nom1 = clipped_mean(x0), clipped_mean(x1)
    p = 2 if shape is NoiseShape.L2 else 1
    entropy, (g_centre, g_cal, g_ev) = _spawn(seed, 3)
    zero = np.zeros_like(base)

    def on(x: np.ndarray) -> Callable[[np.random.Generator], Any]:
        return lambda g: mech(x, rng=g)

    c0 = _measured_difference(on(zero), on(x0), g_centre, "D")
    c1 = _measured_difference(on(zero), on(x1), g_centre, "D'")

    def draws(g: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        # One real call per draw (the noise spans all d coordinates of one output); the
        # same draws serve both neighbours, which is valid for the union-bounded CIs.
        noise = np.empty((trials, d))
        for i in range(trials):
            noise[i] = np.asarray(mech(zero, rng=g), dtype=np.float64).reshape(d)
        if not np.isfinite(noise).all():
            raise NumericalError("audit: the Laplace mechanism returned a non-finite output")
        y0, y1 = c0 + noise, c1 + noise
        return _distance_statistic(y0, nom0, nom1, p), _distance_statistic(y1, nom0, nom1, p)

    cal0, cal1 = draws(g_cal)
    ev0, ev1 = draws(g_ev)
    res = _threshold_audit(cal0, cal1, ev0, ev1, alpha)
    claim = float(mech.epsilon)
    eps_lb = res.pop("epsilon_lower_raw")
    details = {
        **res,
        "alpha": alpha,
        "dimension": d,
        "noise_shape": shape.name,
        "l2_clip_norm": mech.l2_clip_norm,
        "batch_size": mech.batch_size,
        "sensitivity": float(mech.sensitivity),
        "l1_sensitivity": float(mech.l1_sensitivity(d)),
        "centre_D": [float(v) for v in c0],
        "centre_D_prime": [float(v) for v in c1],
        "measured_shift": [float(v) for v in c1 - c0],
        "seed_entropy": entropy,
    }
    stat = f"threshold: (||y - c_D||_{p} - ||y - c_D'||_{p}) / Delta_{p} >= t (d = {d})"
    return AuditResult(f"laplace-{shape_name}", claim, max(eps_lb, 0.0), bool(eps_lb <= claim),
                       trials, noise_scale, stat, details)


# ------------------------------------------------------------- objective


def _glm_data() -> tuple[np.ndarray, np.ndarray]:
    """a_i = y_i x_i for D and D' (record 0: x = 1 with label +1 in D, -1 in D')."""
    rest = np.linspace(-1.0, 1.0, _OBJ_SIZE - 1) * np.where(np.arange(_OBJ_SIZE - 1) % 2, -1, 1)
    return np.concatenate([[1.0], rest]), np.concatenate([[-1.0], rest])


def _solve_perturbed(a: np.ndarray, n: np.ndarray) -> np.ndarray:
    """argmin_w mean_i l(a_i w) + (mu/2) w^2 + n w for every n (vectorised Newton)."""
    beta, m, mu = _OBJ_BETA, _OBJ_MARGIN, _OBJ_MU

    def grad_hess(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        z = np.multiply.outer(w, a)  # (trials, |D|)
        s = special.expit(beta * (m - z))  # -l'(z)
        g = -(s * a).mean(axis=1)
        h = (beta * s * (1.0 - s) * a * a).mean(axis=1)
        return g + mu * w + n, h + mu

    w = -(grad_hess(np.zeros_like(n))[0]) / mu
    for _ in range(50):
        g, h = grad_hess(w)
        step = g / h
        w = w - step
        if np.max(np.abs(step)) <= 1e-15 * max(1.0, float(np.max(np.abs(w)))):
            break
    g, _ = grad_hess(w)
    if not np.isfinite(w).all() or np.max(np.abs(g)) > 1e-12 * max(1.0, float(np.max(np.abs(n)))):
        raise NumericalError("audit: Newton's method did not reach the exact minimiser")
    return w


def _audit_objective(trials: int, noise_scale: float, seed: int | None, alpha: float
                     ) -> AuditResult:
    from privkit.mechanisms.objective import ObjectivePerturbation

    mech = ObjectivePerturbation(
        alpha=_OBJ_ALPHA, dataset_size=_OBJ_SIZE, proximal_mu=_OBJ_MU, lipschitz=1.0,
        smoothness=_OBJ_BETA / 4, _noise_scale=noise_scale,
    )
    a0, a1 = _glm_data()
    entropy, (g_cal, g_ev) = _spawn(seed, 2)
    like = np.zeros(1)

    def draws(g: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        n = np.empty(trials)
        for i in range(trials):
            n[i] = float(np.asarray(mech.linear_term(like, rng=g), dtype=np.float64).reshape(1)[0])
        if not np.isfinite(n).all():
            raise NumericalError("audit: linear_term returned a non-finite draw")
        # The same noise serves both datasets: linear_term never sees the data.
        return _solve_perturbed(a0, n), _solve_perturbed(a1, n)

    cal0, cal1 = draws(g_cal)
    ev0, ev1 = draws(g_ev)
    res = _threshold_audit(cal0, cal1, ev0, ev1, alpha)
    claim = float(mech.step_epsilon)
    eps_lb = res.pop("epsilon_lower_raw")
    details = {
        **res,
        "alpha": alpha,
        "loss": f"softplus({_OBJ_BETA:g} (1 - y x w)) / {_OBJ_BETA:g}",
        "dataset_size": mech.dataset_size,
        "proximal_mu": mech.proximal_mu,
        "noise_alpha": mech.alpha,
        "lipschitz": mech.lipschitz,
        "smoothness": mech.smoothness,
        "rank": mech.rank,
        "proven": bool(mech.proven),
        "seed_entropy": entropy,
    }
    return AuditResult("objective", claim, max(eps_lb, 0.0), bool(eps_lb <= claim), trials,
                       noise_scale, "threshold on the exact minimiser w* >= t", details)


# ------------------------------------------------------------- rec


def renyi2_lower_bound(k0: Any, k1: Any, n: int, alpha: float) -> float:
    """Lower bound on max(D_2(P1||P0), D_2(P0||P1)) from binned counts (n draws each).

    With Clopper-Pearson bounds at ``alpha / (4 B)`` per bin (B bins, union bound), every
    ``P1_b >= lo1_b`` and ``P0_b <= hi0_b`` (and the reverse) hold together with probability
    >= 1 - alpha, so ``log sum_b lo1_b^2 / hi0_b`` is below the binned D_2(P1||P0), which is
    below the true one (data processing). Clamped at 0.
    """
    k0, k1 = np.asarray(k0, dtype=np.float64), np.asarray(k1, dtype=np.float64)
    a = alpha / (4 * k0.size)
    lo0, hi0 = clopper_pearson_lower(k0, n, a), clopper_pearson_upper(k0, n, a)
    lo1, hi1 = clopper_pearson_lower(k1, n, a), clopper_pearson_upper(k1, n, a)
    fwd = float(np.sum(lo1**2 / hi0))
    bwd = float(np.sum(lo0**2 / hi1))
    return max(0.0, math.log(fwd) if fwd > 0 else 0.0, math.log(bwd) if bwd > 0 else 0.0)


def _audit_rec(trials: int, noise_scale: float, seed: int | None, alpha: float) -> AuditResult:
    """Renyi-2 audit of REC: one-coordinate groups, antipodal targets -c, +c (sigma = 1).

    One real ``encode`` of ``trials`` coordinates with ``per-parameter`` groups gives that
    many independent one-dimensional REC messages (each group has its own candidates and
    selection draw); the raw input has norm 1000 sqrt(trials) and is clipped to
    ``C = c sqrt(trials)``, i.e. to -c or +c per coordinate. The statistic is a function of
    the server's view (seed, indices) only: the log-likelihood ratio of the *claimed*
    mechanism between the targets +c and -c,
    ``L = 2 c xi_{k*} - log sum_k e^{c xi_k} + log sum_k e^{-c xi_k}``, with every candidate
    ``xi_k`` regenerated from the seed by :func:`~privkit.mechanisms.rec.candidate_normals`;
    it is binned on fixed edges. (It is sufficient for the pair, so only binning and the
    confidence bounds lose divergence; the decoded value alone loses much more.) The claim is
    the accountant's D_2 bound of one group. ``noise_scale`` s makes the selection target
    ``u / s``, which selects exactly as REC with stddev ``s sigma`` does (the view is a
    function of the logits ``<xi_k, u> / sigma``): s = 0.8 is the 0.8x-noise mutant.
    """
    import torch

    from privkit.accountants.rec import rec_rdp
    from privkit.mechanisms.rec import candidate_normals, decode, encode

    entropy, (g_seed, g_sel) = _spawn(seed, 2)
    clip = _REC_C * math.sqrt(trials)
    k = 1 << _REC_BITS
    stats_: list[np.ndarray] = []
    means: list[float] = []
    for sign in (-1.0, 1.0):
        x = np.full(trials, sign * RAW_NORM)
        msg = encode(x, l2_clip_norm=clip, stddev=1.0, bits=_REC_BITS, groups="per-parameter",
                     seed=g_seed.bytes(16), rng=g_sel, _target_scale=1.0 / noise_scale)
        xi = candidate_normals(msg.seed, torch.arange(trials).repeat_interleave(k),
                               torch.arange(k).repeat(trials), 1).reshape(trials, k).numpy()
        chosen = xi[np.arange(trials), np.asarray(msg.indices, dtype=np.int64)]
        if not np.isfinite(xi).all():
            raise NumericalError("audit: REC produced a non-finite candidate")
        lse_p = special.logsumexp(_REC_C * xi, axis=1)
        lse_m = special.logsumexp(-_REC_C * xi, axis=1)
        stats_.append(2.0 * _REC_C * chosen - lse_p + lse_m)
        if trials <= _REC_DECODE_CHECK:  # the decoder returns the regenerated candidate
            if not np.array_equal(decode(msg, (trials,)).numpy(), chosen):
                raise NumericalError("audit: REC decode differs from the regenerated candidate")
        means.append(float(chosen.mean()))
    y0, y1 = stats_
    k0 = np.bincount(np.searchsorted(_REC_EDGES, y0), minlength=_REC_EDGES.size + 1)
    k1 = np.bincount(np.searchsorted(_REC_EDGES, y1), minlength=_REC_EDGES.size + 1)
    d2_lb = renyi2_lower_bound(k0, k1, trials, alpha)
    d2_claim = float(rec_rdp([2.0], 1.0 / _REC_C, k)[0])
    eps_claim = d2_claim  # for rec the "epsilon" fields carry the Renyi D_2 (nats)
    details = {
        "renyi_order": 2,
        "d2_claimed": d2_claim,
        "d2_lower": d2_lb,
        "d2_exact_view": _REC_D2_VIEW,
        "num_candidates": k,
        "c": _REC_C,
        "alpha": alpha,
        "bin_edges": _REC_EDGES.tolist(),
        "counts_D": k0.tolist(),
        "counts_D_prime": k1.tolist(),
        "mean_D": means[0],
        "mean_D_prime": means[1],
        "seed_entropy": entropy,
    }
    return AuditResult("rec", eps_claim, d2_lb, bool(d2_lb <= d2_claim), trials, noise_scale,
                       "Renyi D_2 lower bound from the binned log-likelihood ratio of the view "
                       "(one-coordinate groups)", details)


# ------------------------------------------------------------- coded data (MI-DP)


def _entropy2(p: np.ndarray) -> np.ndarray:
    """Binary entropy in nats (0 at p = 0 or 1)."""
    return special.entr(p) + special.entr(1.0 - p)


def binary_mi_lower_bound(k0: Any, k1: Any, n: int, alpha: float, prior: float) -> np.ndarray:
    """Lower bound (nats) on I(X; Y) for X ~ Bernoulli(prior) from an event's counts.

    ``k0`` of ``n`` draws of Y given X = 0 and ``k1`` of ``n`` given X = 1 fell in an event S.
    By data processing ``I(X; Y) >= I(X; 1_S(Y)) = f(p0, p1)``, the mutual information of a
    binary channel. For a fixed input law f is convex in the channel ``(p0, p1)`` and zero on
    ``p0 = p1``, so it increases in p1 and decreases in p0 while ``p0 <= p1``; with
    Clopper-Pearson bounds ``p0 <= hi0``, ``p1 >= lo1`` (``alpha / 2`` each, holding together
    with probability >= 1 - alpha) ``f(p0, p1) >= f(hi0, lo1)`` when ``lo1 > hi0`` (else 0).
    (For ``prior = 1/2`` this is at least Fano's ``log 2 - H_b(P_e)``.) Vectorised over counts.
    """
    hi0 = clopper_pearson_upper(k0, n, alpha / 2)
    lo1 = clopper_pearson_lower(k1, n, alpha / 2)
    mix = prior * lo1 + (1.0 - prior) * hi0
    mi = _entropy2(mix) - prior * _entropy2(lo1) - (1.0 - prior) * _entropy2(hi0)
    return np.where(lo1 > hi0, np.maximum(mi, 0.0), 0.0)


def _coded_statistic(values: np.ndarray, sigma: float, trials: int, g: np.random.Generator
                     ) -> np.ndarray:
    """``||Y||^2 / c`` of ``trials`` independent uploads of the one-record client ``values``."""
    from privkit.mechanisms.coded import code_client_data

    c = _CODED_ROWS
    out = np.empty(trials)
    for lo in range(0, trials, _CODED_CHUNK):
        m = min(_CODED_CHUNK, trials - lo)
        up = code_client_data(values, num_coded_rows=c * m, stddev=sigma,
                              row_l2_bound=_CODED_RHO, rng=g)
        y = np.asarray(up.coded_features, dtype=np.float64).reshape(m, c)
        if not np.isfinite(y).all():
            raise NumericalError("audit: the coded upload is not finite")
        out[lo:lo + m] = np.einsum("ij,ij->i", y, y) / c
    return out


def _audit_coded(trials: int, noise_scale: float, seed: int | None, alpha: float
                 ) -> AuditResult:
    """MI-DP audit of SCFL coded data: a lower bound on I(x_j; upload) against Theorem F.

    One client, d = 1, one record x_j in {0, x_1} (raw 1000, clipped by the mechanism to
    rho = 1), no other records (the worst case of Theorem F's proof) and no labels. A call
    of :func:`~privkit.mechanisms.coded.code_client_data` with ``c * m`` coded rows gives m
    independent c-row uploads (its rows are iid given the record: rows of G and N are iid),
    so the audit makes ``trials`` uploads per record value per half in a few calls. The
    statistic ``||Y||^2 / c`` is sufficient for d = 1 with G secret
    (``||Y||^2 = (sigma^2 + x^2) chi2_c``). On a calibration half the audit picks the event
    ``{T >= t}`` (or its complement) and a prior ``pi`` on x_j = x_1 that maximise
    :func:`binary_mi_lower_bound`; on a fresh half that bound is an at-(1 - alpha) lower bound
    on ``I(x_j; upload)`` under that input law, which MI-DP bounds by the claim
    (:func:`~privkit.accountants.midp.midp_coded_features`, nats). ``noise_scale`` s feeds
    ``stddev = s sigma`` to the mechanism while the claim stays at sigma.
    """
    from privkit.accountants.midp import midp_coded_features, midp_coded_release
    from privkit.mechanisms.coded import code_client_data

    sigma = _CODED_SIGMA
    claim = float(midp_coded_features(_CODED_ROWS, sigma, _CODED_RHO, 1))
    event_nats = midp_coded_release(code_client_data(
        np.zeros((1, 1)), num_coded_rows=_CODED_ROWS, stddev=sigma, row_l2_bound=_CODED_RHO,
        rng=np.random.default_rng(0)).event).nats
    if not math.isclose(event_nats, claim, rel_tol=1e-12):
        raise NumericalError("audit: the upload's event does not price to Theorem F")
    x0, x1 = np.zeros((1, 1)), np.full((1, 1), RAW_NORM)
    entropy, gens = _spawn(seed, 4)
    s = sigma * noise_scale
    cal0, cal1 = (_coded_statistic(x, s, trials, g) for x, g in ((x0, gens[0]), (x1, gens[1])))
    ev0, ev1 = (_coded_statistic(x, s, trials, g) for x, g in ((x0, gens[2]), (x1, gens[3])))

    best: tuple[float, float, float, float] = (-1.0, 1.0, float(np.median(cal0)), 0.5)
    for sign in (1.0, -1.0):
        c0, c1 = np.sort(sign * cal0), np.sort(sign * cal1)
        cands = np.unique(np.quantile(np.concatenate([c0, c1]), np.linspace(0.01, 0.99, 99)))
        n0, n1 = _count_at_least(c0, cands), _count_at_least(c1, cands)
        for prior in _CODED_PRIORS:
            scores = binary_mi_lower_bound(n0, n1, trials, alpha, float(prior))
            i = int(np.argmax(scores))
            if scores[i] > best[0]:
                best = (float(scores[i]), sign, float(cands[i]), float(prior))
    score, sign, t, prior = best
    k0 = int(np.count_nonzero(sign * ev0 >= t))
    k1 = int(np.count_nonzero(sign * ev1 >= t))
    mi_lb = float(binary_mi_lower_bound(k0, k1, trials, alpha, prior))
    details = {
        "mi_dp_claimed_nats": claim,
        "mi_lower_nats": mi_lb,
        "calibration_mi_lower_nats": score,
        "num_coded_rows": _CODED_ROWS,
        "stddev_claimed": sigma,
        "stddev_used": s,
        "row_l2_bound": _CODED_RHO,
        "dim": 1,
        "prior": prior,
        "threshold": t,
        "orientation": sign,
        "count_D": k0,
        "count_D_prime": k1,
        "fpr_hi": float(clopper_pearson_upper(k0, trials, alpha / 2)),
        "tpr_lo": float(clopper_pearson_lower(k1, trials, alpha / 2)),
        "alpha": alpha,
        "seed_entropy": entropy,
    }
    return AuditResult("coded", claim, mi_lb, bool(mi_lb <= claim), trials, noise_scale,
                       "binary-channel MI lower bound: ||Y||^2 / c >= t (d = 1, record 0 or rho)",
                       details)


# ------------------------------------------------------------- entry point


def audit(
    mechanism_name: str,
    *,
    trials: int | None = None,
    noise_scale: float = 1.0,
    seed: int | None = None,
    alpha: float = 1e-3,
    dimension: int | None = None,
) -> AuditResult:
    """Audit one mechanism and return an empirical lower bound on its epsilon.

    Args:
        mechanism_name: ``"rec"`` (REC, Renyi D_2 audit; the epsilon fields then hold D_2 in
            nats), ``"coded"`` (SCFL coded data, MI-DP audit; the epsilon fields then hold
            mutual information in nats, never an epsilon), ``"gaussian"``
            (GaussianOutputPerturbation, GDP trade-off audit; claim
            ``gdp_mu = 1/noise_multiplier``), ``"laplace-l2"`` /
            ``"laplace-l1"`` (LaplaceGradientNoise with the L2 / L1 noise shape,
            threshold audit; claim = its epsilon) or ``"objective"``
            (ObjectivePerturbation on a one-parameter GLM, threshold audit on the
            exact minimiser; claim = its step_epsilon).
        trials: draws per neighbour (per half for threshold audits); default
            :data:`DEFAULT_TRIALS` (1e5, the spec's CI recipe).
        noise_scale: written into the mechanism's private ``_noise_scale`` (``rec``: the
            selection target ``u / s``; ``coded``: ``stddev = s sigma``); values below 1
            build a mechanism that breaks its claim and should fail.
        seed: makes the audit deterministic; ``None`` draws fresh entropy (reported
            in ``details["seed_entropy"]`` so the run can be repeated).
        alpha: total error probability of the confidence bounds, in (0, 1).
        dimension: coordinates of the Laplace audits, 1 or 2 (default 2). Only for
            ``laplace-*``.

    Returns:
        An :class:`AuditResult`; ``passed`` is False when the lower bound exceeds
        the claim.

    Raises:
        InvalidParameterError: a bad argument (the message names it).
        NumericalError: the mechanism returned non-finite values or its noise is not
            additive (the audit's batching would not be valid).
    """
    if not isinstance(mechanism_name, str) or mechanism_name not in ALL_MECHANISMS:
        raise InvalidParameterError("mechanism", mechanism_name,
                                    f"one of {', '.join(ALL_MECHANISMS)}")
    n = DEFAULT_TRIALS[mechanism_name] if trials is None else _validate.positive_int(
        "trials", trials)
    scale = _validate.positive("noise_scale", noise_scale)
    a = _validate.real("alpha", alpha)
    if not 0.0 < a < 1.0:
        raise InvalidParameterError("alpha", alpha, "in the open interval (0, 1)")
    s = None if seed is None else _validate.nonnegative_int("seed", seed)
    if dimension is not None and not mechanism_name.startswith("laplace"):
        raise InvalidParameterError("dimension", dimension, "None except for laplace-l1/-l2")
    dim = 2 if dimension is None else _validate.positive_int("dimension", dimension)
    if dim not in (1, 2):
        raise InvalidParameterError("dimension", dimension, "1 or 2")

    t0 = time.perf_counter()
    if mechanism_name == "gaussian":
        result = _audit_gaussian(n, scale, s, a)
    elif mechanism_name == "objective":
        result = _audit_objective(n, scale, s, a)
    elif mechanism_name == "rec":
        result = _audit_rec(n, scale, s, a)
    elif mechanism_name == "coded":
        result = _audit_coded(n, scale, s, a)
    else:
        result = _audit_laplace(mechanism_name.split("-")[1], n, scale, s, a, dim)
    details = dict(result.details)
    details["seed"] = s
    details["seconds"] = time.perf_counter() - t0
    return dataclasses.replace(result, details=details)
