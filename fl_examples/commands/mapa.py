"""``privkit train mapa``: MAPA with its AUDP and ASGD baselines (asynchronous, simulated)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from fl_examples.commands import (
    add_device,
    add_out_arguments,
    epsilon_target,
    finish,
    nonnegative_int,
    noted,
    positive_int,
    run_options,
    run_prepared,
)

NAME = "mapa"
HELP = "MAPA (and AUDP / ASGD baselines): asynchronous FL, Laplace or Gaussian gradient noise"
DESCRIPTION = ("Asynchronous FL on a deterministic event simulator: edges upload clipped, "
               "noised gradients (pure epsilon-DP each, or with --noise gaussian DP-SGD's "
               "Poisson-sampled Gaussian steps); the cloud applies them FIFO. MAPA shrinks the "
               "clip bound stage by stage; AUDP keeps it fixed; ASGD adds no noise.")


def add_arguments(u: argparse.ArgumentParser) -> None:
    """The options of ``privkit train mapa``."""
    u.add_argument("--algorithms", default="mapa,audp,asgd",
                   help="comma-separated, among mapa, audp, asgd")
    u.add_argument("--dataset", default="digits",
                   help="digits[:iid|:K] | synthetic:ALPHA,BETA[:paper|:fedprox] | "
                        "synthetic:iid | mnist:DIR (IDX files you provide)")
    u.add_argument("--model", default="logreg", choices=["logreg", "cnn"],
                   help="cnn: the paper's CNN (28x28 images, d = 4380)")
    u.add_argument("--clients", "--edges", type=float, default=30, action=noted("--clients"),
                   help="K, the number of edge servers (the clients of the cloud)")
    u.add_argument("--upload-epsilon", "--epsilon", default=None,
                   action=noted("--upload-epsilon"),
                   help="per-upload epsilon of every edge, or K comma-separated values "
                        "(default 1; l2/l1 only: --noise gaussian sets its noise with "
                        "--noise-for-epsilon or --noise-multiplier)")
    u.add_argument("--batch", type=float, default=24,
                   help="b, records per upload (distinct), or the expected number (poisson)")
    u.add_argument("--batch-sampler", default=None, choices=["distinct", "poisson"],
                   help="distinct: b distinct records per upload (default for l2/l1); "
                        "poisson: each record independently with probability b/n_k, clipped "
                        "sum divided by b (default and required for --noise gaussian)")
    u.add_argument("--amplification", action="store_true",
                   help="price uploads with amplification by Poisson subsampling (add/remove "
                        "neighbours; assumes the sampler's outcome stays secret); needs "
                        "--batch-sampler poisson")
    u.add_argument("--rounds", "--updates", type=float, default=2000,
                   action=noted("--rounds"), help="T, the applied cloud updates")
    u.add_argument("--delta", type=float, default=1e-5,
                   help="the delta of every reported epsilon and of --epsilon-budget (default "
                        "1e-5, as in every trainer)")
    u.add_argument("--theorem3-delta", type=float, default=None,
                   help="l2/l1 only: Theorem 3's failure probability, which sets MAPA's first "
                        "clip C_0 = b DeltaS_0 / 2 (default 1e-3, the paper's testbed setting: "
                        "C_0 = 1341 at sigma 30, b 24). A schedule constant, not a privacy "
                        "parameter: every upload is clipped, and every epsilon is at --delta")
    u.add_argument("--epsilon-budget", type=float, default=None,
                   help="stop before any edge's epsilon (at --delta) would exceed this")
    u.add_argument("--noise", default="l2", choices=["l2", "l1", "gaussian"],
                   help="l2: L2-norm Laplace (default); l1: per-coordinate Laplace; gaussian: "
                        "N(0, (z C)^2 I) on the clipped sum of a Poisson-sampled batch (DP-SGD; "
                        "epsilon per edge at --delta, add/remove one record)")
    g = u.add_argument_group("gaussian noise (--noise gaussian)")
    g.add_argument("--noise-multiplier", type=float, default=None,
                   help="z: noise stddev / clip on the summed clipped gradients (default 1)")
    g.add_argument("--noise-for-epsilon", type=float, default=None,
                   help="calibrate z so that every edge's whole-run epsilon at --delta is at "
                        "most this (instead of --noise-multiplier)")
    g.add_argument("--clip", type=float, default=None,
                   help="C: per-example clip, AUDP's fixed clip and MAPA's first-stage clip "
                        "(default 1)")
    u.add_argument("--variance", default="sound", choices=["sound", "paper"],
                   help="Delta_0 in the step sizes: the noise's true E||eta||^2 (sound) or the "
                        "paper's 2 DeltaS^2/eps^2")
    u.add_argument("--tau-max", type=float, default=None,
                   help="drop uploads staler than this and use it in the step sizes "
                        "(default: drop nothing, step sizes use K - 1)")
    u.add_argument("--theta", type=float, default=0.5, help="MAPA's per-stage shrink factor")
    u.add_argument("--sigma", type=float, default=30.0, help="MAPA/AUDP sigma (gradient noise)")
    u.add_argument("--lipschitz", type=float, default=10.0, help="L, the smoothness constant")
    u.add_argument("--r0", type=float, default=50.0, help="R, the estimate of f(x_1) - f*")
    u.add_argument("--audp-clip", type=float, default=None,
                   help="AUDP's fixed clip G (default 4; l2/l1 only, --noise gaussian uses "
                        "--clip)")
    u.add_argument("--step-schedule", default="auto", choices=["auto", "paper", "constant"],
                   help="paper: the paper's step sizes; constant: --lr for every update; auto "
                        "(default): constant for ASGD and --noise gaussian, paper for AUDP and "
                        "MAPA with l2/l1")
    u.add_argument("--lr", type=float, default=0.1,
                   help="the constant step size (--step-schedule constant or auto)")
    u.add_argument("--asgd-sigma", type=float, default=5.0, help="ASGD's sigma")
    t = u.add_argument_group("simulator (simulated seconds)")
    t.add_argument("--speed-dist", default="lognormal:0,1",
                   help="per-edge compute speeds: constant[:V] | exponential:MEAN | "
                        "lognormal:MU,SIGMA | uniform:A,B")
    t.add_argument("--link-dist", default="constant", help="per-edge link speeds (same forms)")
    t.add_argument("--compute-time", type=float, default=1.0,
                   help="mean seconds per gradient at speed 1")
    t.add_argument("--link-time", type=float, default=0.1,
                   help="mean seconds per transfer (each way) at link speed 1")
    t.add_argument("--cloud-time", type=float, default=0.0,
                   help="cloud seconds per upload (> 0: uploads queue in the FIFO buffer)")
    t.add_argument("--jitter", default="exponential", choices=["exponential", "none"],
                   help="exponential: each job's compute and link time is the edge's mean "
                        "times an Exp(1) draw; none: the mean itself")
    u.add_argument("--seed", type=float, default=0,
                   help="root of the seed tree (data split, speeds, batches, noise)")
    u.add_argument("--eval-every", type=float, default=50,
                   help="applied updates between evaluations")
    u.add_argument("--target-loss", type=float, default=None,
                   help="an extra training-loss target for the updates-to-loss comparison")
    u.add_argument("--naive", action="store_true",
                   help="compute uploads one at a time (the reference path; slower)")
    add_device(u)
    add_out_arguments(u, unit="applied updates", at_end=True)
    u.add_argument("--json", action="store_true", help="print the final results as JSON")


def _epsilon(text: str) -> Any:
    """``--upload-epsilon``: one number or one per edge, each at most
    :data:`~fl_examples.commands.MAX_EPSILON_TARGET` (e^epsilon must be finite; the noise of a
    larger one vanishes)."""
    from fl_examples.commands import MAX_EPSILON_TARGET
    from privkit.errors import InvalidParameterError

    try:
        vals = tuple(float(v) for v in str(text).split(","))
    except ValueError:
        raise InvalidParameterError("upload_epsilon", text, "a number or comma-separated "
                                    "numbers") from None
    for i, e in enumerate(vals):
        if e > MAX_EPSILON_TARGET:
            raise InvalidParameterError(
                "upload_epsilon", text, f"at most {MAX_EPSILON_TARGET:g} per upload (edge {i}: "
                "e^epsilon must be a finite number; above it the noise vanishes)")
    return vals if len(vals) > 1 else vals[0]


def _pure_only(args: argparse.Namespace) -> None:
    """Refuse the pure-DP noises' per-upload options with --noise gaussian (never ignored)."""
    from privkit.errors import InvalidParameterError

    if args.noise != "gaussian":
        return
    if args.upload_epsilon is not None:
        raise InvalidParameterError(
            "upload_epsilon", args.upload_epsilon, "left out with --noise gaussian (a "
            "per-upload pure epsilon; set the whole-run epsilon with --noise-for-epsilon)")
    if args.audp_clip is not None:
        raise InvalidParameterError("audp_clip", args.audp_clip,
                                    "left out with --noise gaussian (its clip is --clip)")


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check every option, the configuration and the data-set spec (nothing is touched);
    returns the run."""
    from fl_examples.mapa import ALGORITHMS, MapaConfig
    from fl_examples.mapa.config import check_edges_spec
    from privkit.errors import InvalidParameterError

    _pure_only(args)
    algorithms = tuple(a.strip() for a in args.algorithms.split(",") if a.strip())
    if not algorithms:
        raise InvalidParameterError("algorithms", args.algorithms, "at least one algorithm")
    for name in algorithms:
        if name not in ALGORITHMS:
            raise InvalidParameterError("algorithms", name, f"among {', '.join(ALGORITHMS)}")
    cfg = MapaConfig(
        dataset=args.dataset, model=args.model, edges=positive_int("clients", args.clients),
        batch=positive_int("batch", args.batch), updates=positive_int("rounds", args.rounds),
        epsilon=_epsilon("1" if args.upload_epsilon is None else args.upload_epsilon),
        delta=args.delta, theorem3_delta=args.theorem3_delta,
        theta=args.theta, sigma=args.sigma, lipschitz=args.lipschitz, r0=args.r0,
        tau_max=None if args.tau_max is None else nonnegative_int("tau_max", args.tau_max),
        noise=args.noise, variance=args.variance,
        audp_clip=4.0 if args.audp_clip is None else args.audp_clip,
        asgd_sigma=args.asgd_sigma, speed_dist=args.speed_dist, link_dist=args.link_dist,
        compute_time_s=args.compute_time, link_time_s=args.link_time,
        cloud_time_s=args.cloud_time, jitter=args.jitter,
        eval_every=positive_int("eval_every", args.eval_every),
        epsilon_budget=args.epsilon_budget, target_loss=args.target_loss, device=args.device,
        batched=not args.naive, batch_sampler=args.batch_sampler,
        amplification=args.amplification,
        noise_multiplier=args.noise_multiplier, noise_for_epsilon=args.noise_for_epsilon,
        clip=args.clip, step_schedule=args.step_schedule, lr=args.lr, **run_options(args),
    )
    epsilon_target("noise_for_epsilon", args.noise_for_epsilon)
    check_edges_spec(cfg.dataset, edges=cfg.edges, seed=cfg.seed)
    return functools.partial(_run, args, cfg, algorithms)


def run(args: argparse.Namespace) -> int:
    return run_prepared(args, prepare)


def _run(args: argparse.Namespace, cfg: Any, algorithms: tuple[str, ...]) -> int:
    from fl_examples.mapa import final_table, train

    res = train(cfg, algorithms=algorithms, out=args.out, resume=args.resume)
    return finish(args, res, _summary, final_table,
                  f"\nreport: {args.out}/report.json  plots: {args.out}/curves_vs_*.png, "
                  "staleness.png" + (", schedule.png" if "mapa" in res["algorithms"] else ""))


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    """``--json``: each algorithm's final evaluation, updates, staleness and privacy (without
    the per-edge lists), and the comparison."""
    summary = {}
    for name, r in res["algorithms"].items():
        entry = {"final": r["history"][-1], "updates": r["updates"],
                 "staleness_mean": r["staleness_mean"], "staleness_max": r["staleness_max"]}
        if "privacy" in r:
            entry["privacy"] = {k: v for k, v in r["privacy"].items()
                                if k not in ("per_edge", "uploads_per_edge",
                                             "per_edge_unamplified")}
        summary[name] = entry
    return {"algorithms": summary, "comparison": res["comparison"]}
