"""``privkit train dprec``: DP-REC (compressed private FedAvg) with DP-FedAvg and FedAvg."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from fl_examples.commands import (
    add_device,
    add_out_arguments,
    add_survivor_arguments,
    epsilon_target,
    finish,
    nonnegative_int,
    noted,
    positive_int,
    run_options,
    run_prepared,
    split_algorithms,
    survivor_options,
)

NAME = "dprec"
HELP = "DP-REC (relative entropy coding) and DP-FedAvg at the same epsilon"
DESCRIPTION = ("DP-REC: clipped client updates sent as a seed plus a few bits through relative "
               "entropy coding (the sampling is the privacy noise), with a client-level "
               "DP-FedAvg baseline at the same central epsilon and a non-private FedAvg "
               "reference.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``privkit train dprec``."""
    p.add_argument("--dataset", default="digits",
                   help="digits | synthetic:ALPHA,BETA | femnist:DIR | mnist:DIR | leaf:DIR")
    p.add_argument("--clients", type=float, default=None,
                   help="N clients (digits only; default 100)")
    p.add_argument("--digits-classes", type=float, default=None,
                   help="classes per digits client (digits only; default 0: IID)")
    p.add_argument("--model", default="logreg", choices=["logreg", "cnn"],
                   help="logreg: multinomial logistic regression; cnn: a small CNN (3 "
                        "channels, one hidden layer of 100)")
    p.add_argument("--algorithms", default=None,
                   help="comma-separated among dprec, dpfedavg, fedavg (the non-private "
                        "reference); the first is the main one (default dprec,dpfedavg,fedavg)")
    p.add_argument("--algorithm", default=None, choices=["dprec", "dpfedavg", "fedavg"],
                   help=argparse.SUPPRESS)
    p.add_argument("--compare", default=None, help=argparse.SUPPRESS)
    p.add_argument("--clients-per-round", type=float, default=None,
                   help="|S'|: DP-REC's draws per round (with replacement); default min(30, "
                        "N): 30, or every client of a federation of N <= 30 (so --clients 20 "
                        "alone draws 20)")
    p.add_argument("--client-rate", type=float, default=None,
                   help="q: DP-FedAvg's (and FedAvg's) Poisson rate, each client joins a round "
                        "with probability q, in (0, 1] (default: clients-per-round / N)")
    p.add_argument("--rounds", type=float, default=50, help="T, communication rounds")
    p.add_argument("--bits", type=float, default=None,
                   help="DP-REC: bits per group (K = 2**bits; default 8)")
    p.add_argument("--groups", default=None,
                   help="DP-REC: per-layer (default) | whole | per-parameter | chunks:N")
    p.add_argument("--clip", "--l2-clip", type=float, default=0.5, action=noted("--clip"),
                   help="C, each client update's L2 clip norm (DP-REC and DP-FedAvg)")
    p.add_argument("--stddev", type=float, default=None,
                   help="DP-REC: sigma of the REC prior/target (default 1; refused with "
                        "--noise-for-epsilon, which calibrates it)")
    p.add_argument("--epochs", type=float, default=5, help="local epochs")
    p.add_argument("--batch-size", type=float, default=16, help="local SGD minibatch size")
    p.add_argument("--lr", type=float, default=0.5, help="local learning rate")
    p.add_argument("--server-lr", type=float, default=1.0,
                   help="server step size on the averaged update")
    p.add_argument("--server-momentum", type=float, default=0.0,
                   help="heavy-ball momentum of the server step, in [0, 1)")
    p.add_argument("--delta", type=float, default=1e-5, help="delta of every epsilon")
    p.add_argument("--noise-for-epsilon", "--epsilon", type=float, default=None,
                   action=noted("--noise-for-epsilon"),
                   help="target central epsilon: calibrate DP-REC's --stddev and DP-FedAvg's "
                        "noise to reach it after --rounds rounds (default: DP-REC uses "
                        "--stddev and DP-FedAvg matches its epsilon)")
    p.add_argument("--epsilon-budget", type=float, default=None,
                   help="stop before the central epsilon would exceed this")
    p.add_argument("--noise-multiplier", "--dpfedavg-noise", type=float, default=None,
                   action=noted("--noise-multiplier"),
                   help="DP-FedAvg's noise multiplier z, the noise stddev of the sum / --clip "
                        "(default: calibrated)")
    p.add_argument("--relation", default=None, choices=["add-remove", "replace-one"],
                   help="neighbouring federations differ by adding/removing one client or by "
                        "replacing one (default: DP-FedAvg add-remove, DP-REC replace-one, "
                        "the only relation its bound is proven under: add-remove is refused "
                        "when DP-REC runs)")
    p.add_argument("--aggregation", default=None, choices=["central", "distributed"],
                   help="DP-FedAvg: central (the server adds the noise, a trusted aggregator; "
                        "default) or distributed (no trusted aggregator: each sampled client "
                        "adds its own Skellam noise share and the server sees only the sum "
                        "modulo 2^--secagg-bits through secure aggregation; zero-out relation, "
                        "or --relation replace-one)")
    p.add_argument("--secagg-bits", type=float, default=None,
                   help="distributed: the secure sum's modulus 2^bits (default 20; --bits is "
                        "DP-REC's)")
    add_survivor_arguments(p)
    p.add_argument("--no-history-compression", action="store_true",
                   help="always send the full model downlink")
    add_device(p)
    p.add_argument("--seed", type=float, default=0,
                   help="root of the seed tree (data split, sampling, batches, noise)")
    p.add_argument("--eval-every", type=float, default=5, help="rounds between evaluations")
    add_out_arguments(p, unit="rounds", at_end=True)
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check every option, the configuration and the data-set spec (nothing is touched);
    returns the run."""
    from fl_examples.core.data import check_dataset_spec, check_digits_clients
    from fl_examples.dprec import DPRecConfig
    from fl_examples.dprec.config import check_relation
    from privkit.errors import InvalidParameterError

    cfg = DPRecConfig(
        dataset=args.dataset,
        clients=None if args.clients is None else positive_int("clients", args.clients),
        digits_classes=None if args.digits_classes is None
        else nonnegative_int("digits_classes", args.digits_classes),
        model=args.model,
        clients_per_round=None if args.clients_per_round is None
        else positive_int("clients_per_round", args.clients_per_round),
        client_rate=args.client_rate,
        rounds=positive_int("rounds", args.rounds),
        bits=None if args.bits is None else positive_int("bits", args.bits),
        groups=args.groups, l2_clip=args.clip, stddev=args.stddev,
        local_epochs=positive_int("epochs", args.epochs),
        batch_size=positive_int("batch_size", args.batch_size), lr=args.lr,
        server_lr=args.server_lr, server_momentum=args.server_momentum, delta=args.delta,
        epsilon=args.noise_for_epsilon, epsilon_budget=args.epsilon_budget,
        dpfedavg_noise=args.noise_multiplier, relation=args.relation,
        history_compression=False if args.no_history_compression else None,
        device=args.device, aggregation=args.aggregation,
        secagg_bits=None if args.secagg_bits is None else positive_int(
            "secagg_bits", args.secagg_bits),
        **survivor_options(args),
        eval_every=positive_int("eval_every", args.eval_every),
        **run_options(args),
    )
    epsilon_target("noise_for_epsilon", args.noise_for_epsilon)
    main, compare = split_algorithms(args.algorithms, args.algorithm, args.compare,
                                     ("dprec", "dpfedavg", "fedavg"))
    names = tuple(dict.fromkeys((main, *compare)))
    for name in names:
        check_relation(cfg, name)
    cfg.resolved(names)  # refuses settings of algorithms that do not run
    if cfg.dataset.strip().lower() == "digits":
        n = cfg.clients or 100
        check_digits_clients("clients", n, num_clients=n,
                             classes_per_client=cfg.digits_classes or None, seed=cfg.seed)
        if (cfg.clients_per_round or 0) > n:  # as the loader says, before anything is touched
            raise InvalidParameterError("clients_per_round", cfg.clients_per_round,
                                        f"at most the number of clients ({n})")
    else:
        check_dataset_spec(cfg.dataset, seed=cfg.seed)
    return functools.partial(_run, args, cfg, main, compare)


def run(args: argparse.Namespace) -> int:
    return run_prepared(args, prepare)


def _run(args: argparse.Namespace, cfg: Any, main: str, compare: tuple[str, ...]) -> int:
    from fl_examples.dprec import final_table, train

    res = train(cfg, compare=compare, out=args.out, resume=args.resume, algorithm=main)
    return finish(args, res, _summary, final_table,
                  f"\nreport: {args.out}/report.json  plots: {args.out}/curves_vs_*.png")


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    """``--json``: each algorithm's final evaluation, communication and privacy (without the
    per-client and per-round lists)."""
    return {n: {"final": r["history"][-1], "communication": r["communication"],
                "privacy": {k: v for k, v in r["privacy"].items()
                            if k not in ("per_client", "epsilon_per_round")}}
            for n, r in res["algorithms"].items()}
