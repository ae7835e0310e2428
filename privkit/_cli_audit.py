"""``privkit audit``: a mechanism's statistical audit, or a training run's canary audit
recomputed (``privkit audit run OUT``).

Its parser and what it prints; exit status 0 when the audit passed, 1 when it found a
violation. Apart from :mod:`privkit.cli` because it is the one command whose status reports
a finding rather than an error, and the only one that imports :mod:`privkit.audit`.
"""

from __future__ import annotations

import argparse
from typing import Any

from privkit import audit as _audit
from privkit._cli_base import add_json, emit, integer_or_number, number
from privkit.errors import InvalidParameterError

__all__ = ["add_audit_parser", "run_audit"]


def add_audit_parser(sub: Any) -> None:
    """``privkit audit MECHANISM`` and ``privkit audit run OUT``."""
    au = sub.add_parser(
        "audit", help="statistical audit: empirical lower bound on a mechanism's epsilon "
        "(or recompute a training run's)",
        description="Run a real privkit mechanism on neighbouring inputs and compare an "
        "empirical lower bound on its epsilon (confidence 1 - 1e-3) with its claim; or, with "
        "'run OUT', recompute the audit of a training run from OUT/audit_scores.json (what "
        "privkit train ... --audit-canaries M saved) and print its lines again.",
        epilog="exit status: 0 if the audit passed (lower bound <= claim), 1 if it found a "
        "violation, 2 for bad arguments (for 'run': a missing or malformed scores file, "
        "named).")
    au.add_argument("mechanism", choices=[*_audit.ALL_MECHANISMS, "run"],
                    help="gaussian: GDP trade-off audit of GaussianOutputPerturbation; "
                    "objective: ObjectivePerturbation on a 1-parameter GLM; laplace-l2 / "
                    "laplace-l1: LaplaceGradientNoise (d = 2) with that noise shape; rec: "
                    "Renyi-2 audit of the REC encoder; coded: mutual-information audit of SCFL's "
                    "coded upload; run: a training run's canary audit, recomputed from OUT")
    au.add_argument("out", nargs="?", default=None, metavar="OUT",
                    help="with run: the run's output directory (or its audit_scores.json)")
    au.add_argument("--trials", type=number, default=None,
                    help="draws per neighbour (per half for threshold audits; default 1e5)")
    au.add_argument("--noise-scale", type=number, default=None,
                    help="factor on the noise; < 1 builds a deliberately broken mechanism "
                    "(default 1)")
    au.add_argument("--seed", type=integer_or_number, default=None,
                    help="integer seed for a reproducible run (default: fresh entropy)")
    add_json(au)


def run_audit(a: argparse.Namespace) -> int:
    if a.mechanism == "run":
        return _run_audit_of_run(a)
    if a.out is not None:
        raise InvalidParameterError("OUT", a.out, f"given only with 'privkit audit run' (not "
                                    f"with {a.mechanism})")
    r = _audit.audit(a.mechanism, trials=a.trials,
                     noise_scale=1.0 if a.noise_scale is None else a.noise_scale, seed=a.seed)
    out = r.to_dict()
    verdict = "PASSED (no violation found)" if r.passed else "FAILED (privacy claim violated)"
    det = r.details
    if "d2_claimed" in det:
        claim = (f"claimed Renyi divergence D_{det['renyi_order']} <= {det['d2_claimed']:.4f} "
                 f"(K = {det['num_candidates']}, C/sigma = {det['c']:g})")
        found = f"empirical lower bound D_{det['renyi_order']} >= {det['d2_lower']:.4f}"
    elif "mi_dp_claimed_nats" in det:
        claim = (f"claimed MI-DP I(record; upload) <= {det['mi_dp_claimed_nats']:.4f} nats "
                 f"(c = {det['num_coded_rows']}, sigma = {det['stddev_claimed']:g}, "
                 f"rho = {det['row_l2_bound']:g}, d = 1; not an epsilon)")
        found = f"empirical lower bound I >= {det['mi_lower_nats']:.4f} nats"
    elif "gdp_mu_claimed" in det:
        claim = (f"claimed gdp_mu = {det['gdp_mu_claimed']:.4f} (eps = {r.claimed_epsilon:.4f} "
                 f"at delta = {det['delta']:g})")
        found = (f"empirical lower bound gdp_mu >= {det['gdp_mu_lower']:.4f} "
                 f"(eps >= {r.empirical_epsilon_lower:.4f})")
    else:
        claim = f"claimed eps = {r.claimed_epsilon:.4f} (pure DP)"
        found = f"empirical lower bound eps >= {r.empirical_epsilon_lower:.4f}"
    text = (f"privkit audit {r.mechanism}: {verdict}\n"
            f"  {claim}; {found} at confidence 1 - {det['alpha']:g}\n"
            f"  {r.trials} draws per neighbour{' per half' if 'orientation' in det else ''}, "
            f"noise_scale = {r.noise_scale:g}, "
            f"seed = {det['seed'] if det['seed'] is not None else det['seed_entropy']}, "
            f"{det['seconds']:.2f}s")
    emit(out, a.json, text)
    return 0 if r.passed else 1


def _run_audit_of_run(a: argparse.Namespace) -> int:
    """``privkit audit run OUT``: the run's audit recomputed from its saved scores (the same
    line its trainer printed, then each bound); 0 consistent, 1 a bound above the accounted
    epsilon, 2 a missing or malformed scores file (the error names its path)."""
    from pathlib import Path

    from privkit.audit.runs import SCHEMA, SCORES_FILE

    for dest in ("trials", "noise_scale", "seed"):
        if getattr(a, dest) is not None:
            raise InvalidParameterError(dest, getattr(a, dest), "left out with 'privkit audit "
                                        "run' (a mechanism audit's setting)")
    if a.out is None:
        raise InvalidParameterError("OUT", None, "given: the run's output directory (privkit "
                                    "audit run OUT)")
    path = Path(a.out)
    file = path / SCORES_FILE if path.is_dir() else path
    try:
        result = _audit.recompute(file)
    except InvalidParameterError as exc:
        if exc.name == "path":
            raise
        raise InvalidParameterError("path", str(file), f"an audit scores file of schema "
                                    f"{SCHEMA} ({exc})") from None
    out = {"path": str(file), "line": result.summary(), **result.to_dict()}
    emit(out, a.json, "\n".join([result.summary(), *result.lines()]))
    return 1 if result.exceeded else 0
