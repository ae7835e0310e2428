"""The Renyi-2 audit of relative entropy coding (:mod:`privkit.mechanisms.rec`).

See :mod:`privkit.audit` for the setting and the measured power.
"""

from __future__ import annotations

import math

import numpy as np

from privkit._lazy import LazyModule
from privkit.audit.bounds import renyi2_lower_bound
from privkit.audit.result import RAW_NORM, AuditResult, _spawn
from privkit.errors import NumericalError

special = LazyModule("scipy.special")

# REC: K = 64 candidates, c = C / sigma = 0.5 per one-coordinate group; claim D_2 <= 1.0225
# (Theorem R; the exact D_2 of the full view is ~0.978 by Monte Carlo, of a 0.8x-noise view ~1.52).
_REC_BITS = 6
_REC_C = 0.5
_REC_EDGES = np.array([0.0, 1.0, 1.75, 2.35, 3.0])  # on the log-likelihood-ratio statistic
_REC_D2_VIEW = 0.978
_REC_DECODE_CHECK = 4096  # up to this many draws, decode() is checked against xi_{k*}


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
