"""The bundled trainers' ``privkit`` subcommands: ``train``, ``report``, the rest of ``demo``.

privkit never imports this module. ``pyproject.toml`` registers the commands below in the
entry-point group ``privkit.commands`` (``train = "fl_examples.cli:TRAIN"``, ...), and privkit's
CLI loads them by name when it builds its parser, so the import arrow points from the trainers
down to the library. Each entry point is a :class:`Command`. Building the parser stays fast:
nothing here imports torch or a trainer until a command runs.

Every ``train`` command also gets ``--threads``, ``--overwrite`` (with ``--discard-ledger``)
and ``--max-loss-factor``, and :func:`run_train` treats ``--out`` the same way for all of them
before the trainer starts, once every option was checked
(:func:`fl_examples.core.outdir.prepare_out`: writable, new or empty unless ``--resume`` or
``--overwrite``; a ledger holding charges is never removed; a run that fails before writing
anything leaves it as it was).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Command", "TRAIN", "REPORT", "DEMO", "DEFAULT_THREADS", "add_train_parser",
           "run_train", "set_threads", "demo_trainers", "add_report_parser", "run_report"]

DEFAULT_THREADS = 1
"""torch CPU threads of every ``privkit train`` command unless ``--threads`` says otherwise."""

#: Per trainer: configuration parameters named otherwise than the flag that sets them
#: (parameter -> the flag's dest), so that an error names the flag the user typed.
PARAMETER_FLAGS: dict[str, dict[str, str]] = {
    "upcycled": {"local_epochs": "epochs", "l2_clip_norm": "clip", "stddev": "sigma",
                 "iterations": "rounds"},
    "mapa": {"compute_time_s": "compute_time", "link_time_s": "link_time",
             "cloud_time_s": "cloud_time", "updates": "rounds", "edges": "clients",
             "epsilon": "upload_epsilon"},
    "scfl": {"stddev": "noise_stddev", "label_stddev": "label_noise_stddev",
             "label_l2_bound": "label_norm_bound", "num_coded_rows": "coded_rows",
             "server_batch_size": "server_batch", "client_batch_size": "client_batch",
             "local_epochs": "epochs", "gradient_clip": "clip",
             "gradient_noise_multiplier": "noise_multiplier",
             "gradient_noise_for_epsilon": "noise_for_epsilon"},
    "dprec": {"local_epochs": "epochs", "history_compression": "no_history_compression",
              "l2_clip": "clip", "dpfedavg_noise": "noise_multiplier",
              "epsilon": "noise_for_epsilon"},
}


@dataclass(frozen=True)
class Command:
    """One subcommand that privkit's CLI discovers through the ``privkit.commands`` group.

    Attributes:
        add_parser: ``add_parser(subparsers, parser_class)`` registers the subcommand (its name
            is the entry point's) on privkit's subparsers; None for ``demo``, whose parser is
            privkit's own.
        run: ``run(args) -> int``, the exit status (0 on success).
    """

    add_parser: Callable[[Any, Any], None] | None
    run: Callable[[argparse.Namespace], int]


TRAIN_EPILOG = """\
data sets (--dataset), for upcycled and dprec:
  synthetic:ALPHA,BETA[:PRESET]  Synthetic(alpha, beta); PRESET paper (default),
                                 fedprox or released; e.g. synthetic:0.5,0.5
  synthetic:iid[:PRESET]         the IID variant
  digits[:K] | digits:iid        sklearn digits, K classes per client (default 5)
  ...@CLIENTS[/MAXSIZE]          suffix on synthetic and digits: the number of clients
                                 (default 30) and, for synthetic, each client's maximum
                                 records; e.g. digits:3@10, synthetic:1,1@2000/500
  breast_cancer[:CLIENTS]        sklearn breast cancer (default 10 clients)
  leaf:DIR | femnist:DIR | sent140:DIR | sent140tok:DIR   LEAF directories
  mnist:DIR                      MNIST IDX files, IID
scfl: digits[:K] | digits:iid | linreg[:D,O[,NOISE]] | mnist:DIR
mapa (over its edges): digits[:K] | digits:iid | synthetic:ALPHA,BETA[:PRESET] |
  synthetic:iid[:PRESET] | mnist:DIR
One vocabulary in every trainer: --rounds (run length), --algorithms A,B (the first is
the main one), --clients, --clip, --noise-multiplier, --noise-for-epsilon (the clients' max
epsilon), --delta (1e-5 by default; 1e-3 for upcycled's output and objective perturbation),
--device (auto by default; scfl, numpy on the CPU: auto or cpu), --secure-noise,
--eval-client-data; older spellings still work and print a note. Every trainer takes --help
(its options, with their defaults)."""
"""The epilog of ``privkit train --help``: the data-set specs."""


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

    train = sub.add_parser("train", help="run a bundled FL trainer",
                           description="Run a bundled federated-learning trainer; each "
                           "writes OUT/report.json, plots and (private runs) ledgers.",
                           epilog=TRAIN_EPILOG)
    tsub = train.add_subparsers(dest="trainer", required=True, parser_class=parser_class,
                                metavar="TRAINER")
    for module in command_modules():
        p = tsub.add_parser(module.NAME, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(p)
        p.add_argument("--quiet", "-q", action="store_true", default=argparse.SUPPRESS,
                       help="no progress bar and no non-essential output (as privkit "
                            "--quiet; TQDM_DISABLE=1 turns the progress bar off too)")
        p.add_argument("--threads", type=float, default=DEFAULT_THREADS,
                       help=f"CPU threads for torch during the run (default {DEFAULT_THREADS}: "
                            "the bundled models are small, and on a busy machine more threads "
                            "only contend; N > 1 raises it)")
        p.add_argument("--overwrite", action="store_true",
                       help="start over in a non-empty OUT: its checkpoints, report and plots "
                            "are replaced and the run starts new ledgers (without it a new run "
                            "needs a new or empty OUT); a ledger holding charges also needs "
                            "--discard-ledger. Checked after every other option: a run that "
                            "fails before writing anything puts OUT back as it was")
        p.add_argument("--discard-ledger", action="store_true",
                       help="with --overwrite: set aside OUT's ledgers that hold charges (renamed "
                            "ledger-ALGORITHM.jsonl.discarded-UTCTIME, with their head records; "
                            "kept, never deleted, no longer counted) instead of refusing")
        p.add_argument("--secure-noise", action="store_true",
                       help="a private run draws its client and minibatch sampling and its "
                            "noise from the OS CSPRNG (without it, a private run is a seeded "
                            "simulation: its guarantee holds only against someone who does "
                            "not know --seed, which the report records)")
        p.add_argument("--eval-client-data", action="store_true",
                       help="a private run also evaluates on the clients' own training and "
                            "test data (by default only on the public held-out set); those "
                            "metrics are listed in the report as not covered by its epsilon")
        p.add_argument("--audit-canaries", type=float, default=0, metavar="M",
                       help="a private run plants M white-box canaries (fair coins) in its "
                            "noisy releases, scores them from the released values alone and "
                            "prints an empirical lower bound on epsilon beside the "
                            "accounted one (OUT/audit_scores.json, "
                            "report.json's audit block; exit status 3 if the bound exceeds "
                            "it). Upcycled and dprec's client level (DP-FedAvg, banded MF, "
                            "--aggregation distributed), "
                            "mapa --noise gaussian, scfl with gradient noise; refused, saying "
                            "why, elsewhere (docs/audit-runs.md)")
        p.add_argument("--max-loss-factor", type=float, default=None,
                       help="stop with exit status 1 when the training loss exceeds this "
                            "many times its first evaluated value (default "
                            "100; inf: only a non-finite loss stops the run)")
        p.set_defaults(_train_command=module.run, _train_prepare=module.prepare,
                       _aliases=PARAMETER_FLAGS.get(module.NAME, {}))


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
    """Run the ``train`` command chosen on the command line (threads restored afterwards).

    Everything the command line says is checked before OUT is touched: the options, the
    trainer's configuration and its data-set spec (the command's ``prepare``), ``--threads``,
    then ``--out`` (:func:`~fl_examples.core.outdir.prepare_out`: ``--overwrite`` refuses a
    ledger that holds charges without ``--discard-ledger``, and sets the previous run aside
    only now). A run that fails before it writes anything puts OUT back as it was
    (:func:`~fl_examples.core.outdir.failure_cleanup`); what ``--overwrite`` set aside is said
    on stderr once the run has written something.
    """
    from fl_examples.core import outdir
    from fl_examples.core.report import quiet
    from fl_examples.core.run import DEFAULT_MAX_LOSS_FACTOR, max_loss_factor

    factor = getattr(args, "max_loss_factor", None)
    with max_loss_factor(DEFAULT_MAX_LOSS_FACTOR if factor is None else factor), \
            quiet(bool(getattr(args, "quiet", False))):
        if getattr(args, "out", "") is None:  # no --out: a new directory per run
            if getattr(args, "resume", False):
                from privkit.errors import InvalidParameterError

                raise InvalidParameterError("out", None, "given with --resume (the directory "
                                            "of the run to continue)")
            from fl_examples.commands import default_out

            args.out = default_out(args.trainer)
        prepare = getattr(args, "_train_prepare", None)
        if prepare is not None:  # the options, the configuration, the data-set spec
            args._train_job = prepare(args)
        if args.threads is not None:
            from privkit import _validate

            _validate.positive_int("threads", args.threads)
        prepared = outdir.prepare_out(args.out, resume=bool(getattr(args, "resume", False)),
                                      overwrite=bool(getattr(args, "overwrite", False)),
                                      discard_ledger=bool(getattr(args, "discard_ledger",
                                                                  False)))
        before = set_threads(args.threads)
        try:
            with outdir.failure_cleanup(prepared):
                return int(args._train_command(args) or 0)
        finally:
            if before is not None:
                set_threads(before)


def demo_trainers(out: str, *, as_json: bool = False) -> dict[str, Any]:
    """A short Upcycled-FL vs FedProx vs FedAvg comparison for ``privkit demo``; returns each
    algorithm's final evaluation (and data rounds), the report path and the seconds taken.

    Prints the final table unless ``as_json``, and the narration unless that or
    :func:`~fl_examples.core.report.quiet`. The models are tiny, so one torch thread is
    fastest (and several threads spin badly when the machine is busy).
    """
    from fl_examples.core.report import is_quiet
    from fl_examples.upcycled import UpcycledConfig, final_table, train

    cfg = UpcycledConfig(dataset="synthetic:0.5,0.5", mu=1.0, lam=0.43, iterations=40,
                         fraction=0.3, stragglers=0.9, local_epochs=20, batch_size=32, lr=0.05,
                         seed=0, device="auto", eval_every=2)
    chatty = not (as_json or is_quiet())
    if chatty:
        print("\nUpcycled-FL vs FedProx vs FedAvg on Synthetic(0.5,0.5), 30 devices, fraction "
              "0.3, 90% stragglers,\nmu=1, lambda=0.43, 40/20/20 iterations (the paper runs "
              "160/80/80):")
    t0 = time.perf_counter()
    before = set_threads(DEFAULT_THREADS)
    try:
        res = train(cfg, compare=("fedprox", "fedavg"), out=out)
    finally:
        set_threads(before)
    seconds = time.perf_counter() - t0
    if not as_json:
        print(("" if chatty else "\n") + final_table(res))
    if chatty:
        print(f"({seconds:.0f} s; report and plots in {out}/)", file=sys.stdout)
    return {"algorithms": {n: r["history"][-1] | {"data_rounds": r.get("data_rounds")}
                           for n, r in res["algorithms"].items()},
            "report": f"{out}/report.json", "seconds": seconds}


def _run_demo(args: argparse.Namespace) -> int:
    """The training part of ``privkit demo``: with ``--json`` its results go into
    ``args.demo_json["training"]`` (privkit prints the one object)."""
    from fl_examples.core.report import quiet

    as_json = bool(getattr(args, "json", False))
    with quiet(bool(getattr(args, "quiet", False))):
        result = demo_trainers(args.out, as_json=as_json)
    if as_json and isinstance(getattr(args, "demo_json", None), dict):
        args.demo_json["training"] = result
    return 0


TRAIN = Command(add_train_parser, run_train)
"""``privkit train <trainer> ...``."""

REPORT = Command(add_report_parser, run_report)
"""``privkit report tradeoff RUN_DIRS...``."""

DEMO = Command(None, _run_demo)
"""The trainer part of ``privkit demo`` (after privkit's own epsilon table)."""
