"""Statistical privacy audits: empirical lower bounds on epsilon for the mechanisms, and
for training runs (canaries).

**Auditing what you train** (docs/audit-runs.md): :mod:`privkit.audit.canaries` makes
canaries, inserts them into a run's releases (:func:`with_canaries` for
:class:`~privkit.ClientLevelGaussian`, ``extra_gradients=`` of
:meth:`privkit.torch.DpSgd.step`, :class:`CanaryClients` in the Flower wrappers) and scores
them (:class:`WhiteBoxScorer`, :func:`cosine_scores`, :func:`two_run_scores`);
:mod:`privkit.audit.scores` turns in- and out-scores into high-confidence **lower** bounds
on epsilon (:func:`clopper_pearson_bound`, :func:`gdp_bound`, :func:`one_run_bound`,
:func:`gaussian_bound`, :class:`CanaryScoreAuditor`), each stating its confidence and
assumptions, and labelled estimates (:class:`EpsilonEstimate`); :mod:`privkit.audit.runs`
saves a run's scores as JSON (:class:`CanaryRun`) and recomputes the bounds from it
(:func:`recompute`). The rest of this docstring is about the mechanism audits
(:func:`audit`).

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
import time
from collections.abc import Mapping

from privkit import _validate
from privkit.audit.bounds import (
    binary_mi_lower_bound,
    clopper_pearson_lower,
    clopper_pearson_upper,
    gdp_mu_lower_bound,
    renyi2_lower_bound,
    threshold_epsilon_lower_bound,
)
from privkit.audit.canaries import (
    Canaries,
    CanaryClients,
    WhiteBoxScorer,
    canary_rows,
    clipped_sum,
    cosine_scores,
    flatten,
    make_canaries,
    two_run_scores,
    with_canaries,
)
from privkit.audit.coded import _audit_coded
from privkit.audit.dp import _audit_gaussian, _audit_laplace, _audit_objective
from privkit.audit.rec import _audit_rec
from privkit.audit.result import REPORT_DELTA, AuditResult
from privkit.audit.runs import CanaryRun, RunAudit, final_model_estimate, recompute
from privkit.audit.scores import (
    CanaryScoreAuditor,
    EpsilonEstimate,
    EpsilonLowerBound,
    clopper_pearson_bound,
    gaussian_bound,
    gaussian_estimate,
    gaussian_pair_epsilon,
    gdp_bound,
    one_run_bound,
    one_run_p_value,
)
from privkit.errors import InvalidParameterError

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
    # auditing a training run (canaries; docs/audit-runs.md)
    "Canaries",
    "make_canaries",
    "flatten",
    "canary_rows",
    "with_canaries",
    "clipped_sum",
    "WhiteBoxScorer",
    "CanaryClients",
    "cosine_scores",
    "two_run_scores",
    "EpsilonLowerBound",
    "EpsilonEstimate",
    "CanaryScoreAuditor",
    "clopper_pearson_bound",
    "gdp_bound",
    "one_run_bound",
    "one_run_p_value",
    "gaussian_bound",
    "gaussian_estimate",
    "gaussian_pair_epsilon",
    "final_model_estimate",
    "CanaryRun",
    "RunAudit",
    "recompute",
]

MECHANISMS: tuple[str, ...] = ("gaussian", "objective", "laplace-l2", "laplace-l1")
"""Names accepted by :func:`audit` and ``privkit audit``."""

ALL_MECHANISMS: tuple[str, ...] = (*MECHANISMS, "rec", "coded")
"""Every audit :func:`audit` runs: :data:`MECHANISMS` plus ``rec`` (relative entropy coding)
and ``coded`` (SCFL coded data, an MI-DP audit in nats)."""

DEFAULT_TRIALS: Mapping[str, int] = {name: 100_000 for name in ALL_MECHANISMS}
"""Draws per neighbour (per half for threshold audits): the spec's CI recipe."""


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
