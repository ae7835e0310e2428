"""``privkit train ...`` and the trainer part of ``privkit demo``.

privkit's CLI imports this module lazily, so ``import privkit`` never imports the
trainers (or torch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

__all__ = ["add_train_parser", "run_train", "demo_trainers", "add_report_parser", "run_report"]


def add_report_parser(sub: Any, parser_class: Any) -> None:
    """Register ``report tradeoff`` (privacy-utility plot over run directories)."""
    from fl_examples.core import tradeoff

    tradeoff.add_report_parser(sub, parser_class)


def run_report(args: argparse.Namespace) -> int:
    from fl_examples.core import tradeoff

    return int(tradeoff.run_report(args) or 0)


def add_train_parser(sub: Any, parser_class: Any) -> None:
    """Register ``train upcycled`` on the top-level subparsers ``sub``."""
    train = sub.add_parser("train", help="run a bundled FL trainer")
    tsub = train.add_subparsers(dest="trainer", required=True, parser_class=parser_class)
    u = tsub.add_parser("upcycled", help="Upcycled-FL (and FedProx / FedAvg baselines)",
                        description="Upcycled-FL with FedProx and FedAvg baselines (non-private).")
    u.add_argument("--dataset", default="synthetic:0.5,0.5",
                   help="synthetic:ALPHA,BETA | synthetic:iid | digits[:K] | breast_cancer | "
                        "sent140tok:DIR | "
                        "leaf:DIR | femnist:DIR | sent140:DIR | mnist:DIR")
    u.add_argument("--model", default="logreg", choices=["logreg", "mlp", "cnn", "lstm"])
    u.add_argument("--mu", type=float, default=1.0, help="FedProx proximal coefficient")
    u.add_argument("--lam", type=float, default=0.42, help="lambda: c = mu / (mu + lambda)")
    u.add_argument("--lam-schedule", default="constant", choices=["constant", "sqrt"])
    u.add_argument("--iterations", type=float, default=160,
                   help="Upcycled-FL iterations (baselines in --compare run half as many)")
    u.add_argument("--fraction", type=float, default=0.3, help="clients sampled per round")
    u.add_argument("--stragglers", type=float, default=0.9, help="share of stragglers")
    u.add_argument("--epochs", type=float, default=20, help="local epochs E")
    u.add_argument("--batch-size", type=float, default=32)
    u.add_argument("--lr", type=float, default=0.05)
    u.add_argument("--momentum", type=float, default=0.5)
    u.add_argument("--compare", default="", help="comma-separated: fedprox,fedavg")
    u.add_argument("--algorithm", default="upcycled", choices=["upcycled", "fedprox", "fedavg"])
    u.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    u.add_argument("--seed", type=float, default=0)
    u.add_argument("--eval-every", type=float, default=1)
    u.add_argument("--checkpoint-every", type=float, default=0,
                   help="checkpoint every N iterations into OUT/checkpoints (0: never)")
    u.add_argument("--resume", action="store_true", help="continue from OUT's checkpoints")
    u.add_argument("--out", required=True, help="output directory (report.json, plots)")
    p = u.add_argument_group("privacy (odd iterations only; even ones are post-processing)")
    p.add_argument("--privacy", default="none", choices=["none", "output", "objective"])
    p.add_argument("--sensitivity", default="replace-one",
                   choices=["replace-one", "paper", "strongly-convex"],
                   help="output perturbation: 2*tau (default, any model), tau/|D_i| (the "
                        "paper's Thm C.1 assumption), or the strongly convex bound")
    p.add_argument("--clip", type=float, default=10.0, help="tau, the model's L2 clip norm")
    p.add_argument("--sigma", type=float, default=1.0, help="output noise stddev (absolute)")
    p.add_argument("--alpha", type=float, default=20.0, help="objective perturbation rate")
    p.add_argument("--lipschitz", type=float, default=None,
                   help="u1 for --sensitivity strongly-convex")
    p.add_argument("--delta", type=float, default=1e-3)
    p.add_argument("--epsilon-budget", type=float, default=None,
                   help="stop before any client's epsilon would exceed this")
    p.add_argument("--noise-for-epsilon", type=float, default=None,
                   help="calibrate --sigma / --alpha so the run ends at this epsilon")
    p.add_argument("--noise-target", default="mean", choices=["mean", "max"])
    p.add_argument("--allow-unproven", action="store_true",
                   help="run objective perturbation outside Thm C.2 (epsilon marked NOT PROVEN)")
    p.add_argument("--baseline-iterations", default="auto", choices=["auto", "half", "same"])
    u.add_argument("--json", action="store_true", help="print the final table as JSON")


def _int(name: str, value: float) -> int:
    from privkit import _validate

    return _validate.nonnegative_int(name, value)


def run_train(args: argparse.Namespace) -> None:
    from fl_examples.upcycled import UpcycledConfig, final_table, train

    cfg = UpcycledConfig(
        dataset=args.dataset, model=args.model, mu=args.mu, lam=args.lam,
        lam_schedule=args.lam_schedule, iterations=_int("iterations", args.iterations),
        fraction=args.fraction, stragglers=args.stragglers,
        local_epochs=_int("epochs", args.epochs), batch_size=_int("batch_size", args.batch_size),
        lr=args.lr, momentum=args.momentum, seed=_int("seed", args.seed), device=args.device,
        eval_every=_int("eval_every", args.eval_every),
        checkpoint_every=_int("checkpoint_every", args.checkpoint_every),
        privacy=args.privacy, sensitivity=args.sensitivity, l2_clip_norm=args.clip,
        stddev=args.sigma, alpha=args.alpha, lipschitz=args.lipschitz, delta=args.delta,
        epsilon_budget=args.epsilon_budget, allow_unproven=args.allow_unproven,
        noise_for_epsilon=args.noise_for_epsilon, noise_target=args.noise_target,
        baseline_iterations=args.baseline_iterations,
    )
    compare = tuple(c for c in args.compare.split(",") if c)
    res = train(cfg, compare=compare, out=args.out, resume=args.resume, algorithm=args.algorithm)
    if args.json:
        print(json.dumps({n: r["history"][-1] | ({"privacy": {k: v for k, v in r["privacy"].items()
                                                              if k != "per_client"}}
                                                 if "privacy" in r else {})
                          for n, r in res["algorithms"].items()}))
    else:
        print(final_table(res))
        print(f"\nreport: {args.out}/report.json  plots: {args.out}/curves_vs_*.png")


def demo_trainers(out: str) -> None:
    """A short Upcycled-FL vs FedProx vs FedAvg comparison for ``privkit demo``."""
    from fl_examples.upcycled import UpcycledConfig, final_table, train

    cfg = UpcycledConfig(dataset="synthetic:0.5,0.5", mu=1.0, lam=0.43, iterations=40,
                         fraction=0.3, stragglers=0.9, local_epochs=20, batch_size=32, lr=0.05,
                         seed=0, device="auto", eval_every=2)
    print("\nUpcycled-FL vs FedProx vs FedAvg on Synthetic(0.5,0.5), 30 devices, fraction 0.3, "
          "90% stragglers,\nmu=1, lambda=0.43, 40/20/20 iterations (the paper runs 160/80/80):")
    t0 = time.perf_counter()
    res = train(cfg, compare=("fedprox", "fedavg"), out=out)
    print(final_table(res))
    print(f"({time.perf_counter() - t0:.0f} s; report and plots in {out}/)", file=sys.stdout)
