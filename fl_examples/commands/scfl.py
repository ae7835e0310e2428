"""``privkit train scfl``: SCFL with FL-PMA, CodedFedL-style, DP-CFL-style and CFL-FB baselines."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from fl_examples.commands import (
    add_out_arguments,
    epsilon_target,
    finish,
    noted,
    positive_int,
    run_options,
    run_prepared,
)

DATASET_HELP = (
    "the data set, over --clients clients: digits[:K] (sklearn digits, K classes per client, "
    "1..10, default 5; one-hot targets) or digits:iid; linreg[:D,O[,NOISE]] (synthetic linear "
    "regression y = x W + e with D features, O outputs and noise stddev NOISE; default "
    "20,5,0.1; continuous targets); mnist:DIR (IDX files, IID)")
"""The ``--dataset`` help: the grammar of :func:`fl_examples.scfl.data.load_data`."""

NAME = "scfl"
HELP = "SCFL: stochastic coded FL with MI-DP coded data (and its baselines)"
DESCRIPTION = ("Stochastic coded federated learning (linear regression) on a simulated "
               "straggler timing model, with FL-PMA, CodedFedL-style, DP-CFL-style and CFL-FB "
               "baselines. Each coded upload's MI-DP (nats; coded upload only) is reported per "
               "client; the per-epoch client gradients are unprotected unless "
               "--noise-multiplier or --noise-for-epsilon adds record-level "
               "DP-SGD noise to them (epsilon per client on a ledger).")

METHODS = "scfl, scfl-nomakeup, fl-pma, codedfedl, dp-cfl, cfl-fb"


def _opt_float(text: str) -> float | None:
    return None if text.lower() in ("auto", "none") else float(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``privkit train scfl``."""
    p.add_argument("--dataset", default="digits",
                   help=DATASET_HELP)
    p.add_argument("--clients", type=float, default=20, help="n, number of clients")
    p.add_argument("--coded-rows", type=float, default=500, help="c, coded rows per client")
    p.add_argument("--noise-stddev", type=float, default=1.0,
                   help="sigma, absolute feature-noise stddev of the coded data (rows have "
                        "L2 norm <= 1)")
    p.add_argument("--label-noise-stddev", type=_opt_float, default=None,
                   help="sigma_y (default: sigma); 0 = the paper's noiseless labels "
                        "(MI-DP then reports full label disclosure)")
    p.add_argument("--label-norm-bound", type=float, default=1.0,
                   help="clipping bound of continuous targets (linreg)")
    p.add_argument("--kappa", type=float, default=0.5,
                   help="weight of the client part (paper value not available)")
    p.add_argument("--deadline", type=_opt_float, default=None,
                   help="T, simulated seconds per epoch (default auto: the slowest client's "
                        "minimum time)")
    p.add_argument("--fb-deadline", type=_opt_float, default=None,
                   help="CFL-FB's deadline (default auto, with full batches)")
    p.add_argument("--server-batch", type=float, default=64, help="b_s, coded rows per epoch")
    p.add_argument("--client-batch", type=float, default=16, help="b, rows per client batch")
    p.add_argument("--batch-sampling", default=None, choices=["fixed", "bernoulli"],
                   help="client minibatches: fixed size b, or bernoulli (each row w.p. b/l_i, "
                        "Poisson); default fixed, and bernoulli (the only choice) with "
                        "gradient noise")
    g = p.add_argument_group("record-level DP on the client gradients (the paper's gradients "
                             "carry no noise)")
    g.add_argument("--noise-multiplier", "--gradient-noise-multiplier", type=_opt_float,
                   default=None, action=noted("--noise-multiplier"),
                   help="z: clip each example's gradient to --clip, add N(0, (z C)^2) to each "
                        "client's sum, Poisson minibatches; each client is charged per epoch "
                        "on OUT/ledger-<method>.jsonl")
    g.add_argument("--noise-for-epsilon", "--gradient-noise-for-epsilon", type=_opt_float,
                   default=None, action=noted("--noise-for-epsilon"),
                   help="calibrate z so every client's epsilon after --rounds epochs is at "
                        "most this")
    g.add_argument("--clip", "--gradient-clip", type=float, default=1.0,
                   action=noted("--clip"),
                   help="C, the per-example clip norm of the gradient noise")
    g.add_argument("--delta", type=float, default=1e-5, help="delta of the gradients' epsilon")
    p.add_argument("--lr", type=float, default=1.0,
                   help="step size in units of 1/(m rho^2) (m samples, rho = 1)")
    p.add_argument("--l2-reg", type=float, default=0.0,
                   help="ridge lambda added to every method (0: the paper's problem)")
    p.add_argument("--rounds", type=float, default=300, help="R epochs (a cap with --time-budget)")
    p.add_argument("--time-budget", type=_opt_float, default=None,
                   help="run every method for this many simulated seconds")
    p.add_argument("--psi", type=float, default=0.0, help="FL-PMA: fraction of slowest dropped")
    p.add_argument("--no-makeup", action="store_true", help="DP-CFL without the make-up term")
    p.add_argument("--output", default="average", choices=["average", "last"],
                   help="model the curves describe: the paper's average or the last iterate")
    p.add_argument("--algorithms", default="scfl,fl-pma", help=f"comma-separated: {METHODS}")
    p.add_argument("--secure-coding", action="store_true",
                   help="draw G and the noise from the OS CSPRNG (not reproducible)")
    p.add_argument("--device", default="auto",
                   help="auto | cpu: SCFL computes in numpy on the CPU whatever the machine "
                        "has, so auto means cpu; a GPU (cuda[:N]) is refused with one line, "
                        "never ignored")
    p.add_argument("--seed", type=float, default=0,
                   help="seed of the data, the coding and every draw (reproducible unless "
                        "--secure-coding)")
    p.add_argument("--eval-every", type=float, default=1, help="evaluate every N epochs")
    add_out_arguments(p, unit="epochs")
    p.add_argument("--json", action="store_true", help="print the final results as JSON")


def _batch_sampling(args: argparse.Namespace) -> str:
    """--batch-sampling, defaulting to bernoulli (Poisson) with gradient noise, else fixed."""
    if args.batch_sampling is not None:
        return str(args.batch_sampling)
    dp = args.noise_multiplier is not None or args.noise_for_epsilon is not None
    return "bernoulli" if dp else "fixed"


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check every option, the configuration and the data-set spec (nothing is touched);
    returns the run."""
    from fl_examples.scfl import ScflConfig

    check_device(args.device)
    cfg = ScflConfig(
        dataset=args.dataset, clients=positive_int("clients", args.clients),
        num_coded_rows=positive_int("coded_rows", args.coded_rows), stddev=args.noise_stddev,
        label_stddev=args.label_noise_stddev, label_l2_bound=args.label_norm_bound,
        kappa=args.kappa, deadline=args.deadline, fb_deadline=args.fb_deadline,
        server_batch_size=positive_int("server_batch", args.server_batch),
        client_batch_size=positive_int("client_batch", args.client_batch),
        batch_sampling=_batch_sampling(args), lr=args.lr, l2_reg=args.l2_reg,
        rounds=positive_int("rounds", args.rounds), time_budget=args.time_budget,
        psi=args.psi, makeup=not args.no_makeup, output=args.output,
        eval_every=positive_int("eval_every", args.eval_every),
        secure_coding=args.secure_coding, gradient_noise_multiplier=args.noise_multiplier,
        gradient_noise_for_epsilon=args.noise_for_epsilon,
        gradient_clip=args.clip, delta=args.delta, **run_options(args))
    epsilon_target("noise_for_epsilon", args.noise_for_epsilon)
    _check_methods(args.algorithms)
    _check_digits(cfg)
    return functools.partial(_run, args, cfg)


def run(args: argparse.Namespace) -> int:
    return run_prepared(args, prepare)


def check_device(device: str) -> str:
    """``--device``: ``auto`` or ``cpu`` (SCFL is numpy: it runs on the CPU either way); a GPU
    request is refused naming the flag, so it is never silently ignored.

    >>> check_device("auto")
    'cpu'
    """
    from privkit.errors import InvalidParameterError

    spec = device.strip().lower() if isinstance(device, str) else device
    if spec in ("auto", "cpu"):
        return "cpu"
    raise InvalidParameterError("device", device, "auto or cpu (SCFL computes in numpy on the "
                                "CPU; it has no GPU path)")


def _check_methods(algorithms: str) -> None:
    """``--algorithms``: known methods, at least one (the trainer's own check)."""
    from fl_examples.scfl import _methods

    _methods(algorithms)


def _check_digits(cfg: Any) -> None:
    """A digits ``--dataset`` over ``--clients``: every client holds a training record."""
    from fl_examples.core.data import check_digits_clients

    name, _, rest = cfg.dataset.strip().partition(":")
    if name != "digits" or not (rest in ("", "iid") or (rest.isdigit() and 1 <= int(rest) <= 10)):
        return  # other data sets (and a bad K, which the loader names) are checked there
    per = None if rest == "iid" else (int(rest) if rest else 5)
    check_digits_clients("clients", cfg.clients, num_clients=cfg.clients,
                         classes_per_client=per, seed=cfg.seed)


def _run(args: argparse.Namespace, cfg: Any) -> int:
    from fl_examples.core.report import is_quiet
    from fl_examples.scfl import final_table, train

    res = train(cfg, algorithms=args.algorithms, out=args.out, resume=args.resume)
    return finish(args, res, _summary, final_table, None if is_quiet() else
                  f"\nreport: {args.out}/report.json  plots: {args.out}/curves_vs_*.png",
                  default=str)


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    """``--json``: each method's final evaluation, privacy, time to FL-PMA's final loss and
    mean arrivals per round."""
    return {n: {"final": r["history"][-1], "privacy": r.get("privacy"),
                "time_to_fl_pma_final_loss_s": r["time_to_fl_pma_final_loss_s"],
                "mean_arrivals": (sum(r["arrivals_per_round"])
                                  / max(len(r["arrivals_per_round"]), 1))}
            for n, r in res["algorithms"].items()}
