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

__all__ = ["add_train_parser", "run_train", "demo_trainers"]


def add_train_parser(sub: Any, parser_class: Any) -> None:
    """Register ``train upcycled`` on the top-level subparsers ``sub``."""
    train = sub.add_parser("train", help="run a bundled FL trainer")
    tsub = train.add_subparsers(dest="trainer", required=True, parser_class=parser_class)
    u = tsub.add_parser("upcycled", help="Upcycled-FL (and FedProx / FedAvg baselines)",
                        description="Upcycled-FL with FedProx and FedAvg baselines (non-private).")
    u.add_argument("--dataset", default="synthetic:0.5,0.5",
                   help="synthetic:ALPHA,BETA | synthetic:iid | digits[:K] | breast_cancer | "
                        "leaf:DIR | femnist:DIR | sent140:DIR | mnist:DIR")
    u.add_argument("--model", default="logreg", choices=["logreg", "mlp"])
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
    )
    compare = tuple(c for c in args.compare.split(",") if c)
    res = train(cfg, compare=compare, out=args.out, resume=args.resume, algorithm=args.algorithm)
    if args.json:
        print(json.dumps({n: r["history"][-1] for n, r in res["algorithms"].items()}))
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
