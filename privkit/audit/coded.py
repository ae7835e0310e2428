"""The mutual-information audit of SCFL's coded data (:mod:`privkit.mechanisms.coded`), in nats.

See :mod:`privkit.audit` for the setting and the measured power.
"""

from __future__ import annotations

import math

import numpy as np

from privkit.audit.bounds import (
    _count_at_least,
    binary_mi_lower_bound,
    clopper_pearson_lower,
    clopper_pearson_upper,
)
from privkit.audit.result import RAW_NORM, AuditResult, _spawn
from privkit.errors import NumericalError

# Coded data (SCFL): d = 1, c = 64 coded rows, rho = 1, sigma = 2 (snr = 1/4); the record is
# 0 or (raw 1000, clipped to) rho, the other records 0. Claim: Theorem F, 0.16805 nats.
_CODED_ROWS = 64
_CODED_SIGMA = 2.0
_CODED_RHO = 1.0
_CODED_CHUNK = 8192  # trials per call of the mechanism (c * chunk coded rows)
_CODED_PRIORS = np.linspace(0.1, 0.9, 17)


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
