"""``privkit train ...`` and the trainer part of ``privkit demo``.

privkit's CLI imports this module lazily, so ``import privkit`` never imports the
trainers (or torch).
"""

from __future__ import annotations

import argparse
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
    """Register ``train <name>`` for every module in :mod:`fl_examples.commands`."""
    from fl_examples.commands import command_modules

    train = sub.add_parser("train", help="run a bundled FL trainer")
    tsub = train.add_subparsers(dest="trainer", required=True, parser_class=parser_class)
    for module in command_modules():
        p = tsub.add_parser(module.NAME, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(p)
        default = getattr(module, "DEFAULT_THREADS", None)
        p.add_argument("--threads", type=float, default=default,
                       help="CPU threads for torch during the run (default: "
                            + ("torch's own choice" if default is None else str(default))
                            + "); 1 is fastest for small models on a busy machine")
        p.set_defaults(_train_command=module.run)


def set_threads(threads: float | None) -> int | None:
    """Apply ``--threads`` (validated) to torch's intra-op pool; returns the previous count."""
    if threads is None:
        return None
    from privkit import _validate

    n = _validate.positive_int("threads", threads)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def run_train(args: argparse.Namespace) -> int:
    """Run the ``train`` command chosen on the command line (threads restored afterwards)."""
    before = set_threads(args.threads)
    try:
        return int(args._train_command(args) or 0)
    finally:
        if before is not None:
            set_threads(before)


def demo_trainers(out: str) -> None:
    """A short Upcycled-FL vs FedProx vs FedAvg comparison for ``privkit demo``.

    The models are tiny, so one torch thread is fastest (and several threads spin badly
    when the machine is busy).
    """
    from fl_examples.upcycled import UpcycledConfig, final_table, train

    cfg = UpcycledConfig(dataset="synthetic:0.5,0.5", mu=1.0, lam=0.43, iterations=40,
                         fraction=0.3, stragglers=0.9, local_epochs=20, batch_size=32, lr=0.05,
                         seed=0, device="auto", eval_every=2)
    print("\nUpcycled-FL vs FedProx vs FedAvg on Synthetic(0.5,0.5), 30 devices, fraction 0.3, "
          "90% stragglers,\nmu=1, lambda=0.43, 40/20/20 iterations (the paper runs 160/80/80):")
    t0 = time.perf_counter()
    set_threads(1)
    res = train(cfg, compare=("fedprox", "fedavg"), out=out)
    print(final_table(res))
    print(f"({time.perf_counter() - t0:.0f} s; report and plots in {out}/)", file=sys.stdout)
