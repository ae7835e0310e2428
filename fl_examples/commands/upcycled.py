"""``privkit train upcycled``: Upcycled-FL with FedProx and FedAvg baselines."""

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

DATASET_HELP = (
    "the federated data set: synthetic:ALPHA,BETA[:PRESET] (Synthetic(alpha, beta), PRESET "
    "paper (default; 20 features, 10 classes), fedprox (60, 10) or released (20, 2)); "
    "synthetic:iid[:PRESET]; digits[:K] (sklearn digits over the clients, K classes per "
    "client, default 5) or digits:iid; a suffix @CLIENTS[/MAXSIZE] on synthetic and digits "
    "sets the number of clients (default 30) and, for synthetic, caps each client's records "
    "(e.g. synthetic:0.5,0.5@2000/500); breast_cancer[:CLIENTS] (default 10); leaf:DIR (any "
    "LEAF directory); femnist:DIR (LEAF FEMNIST, letters a-j); sent140:DIR (bag of words); "
    "sent140tok:DIR (token ids, for --model lstm); mnist:DIR (IDX files, IID over 30 clients)")
"""The ``--dataset`` help: the grammar of :func:`fl_examples.core.data.parse_dataset_spec`."""

NAME = "upcycled"
HELP = "Upcycled-FL (and FedProx / FedAvg baselines)"
DESCRIPTION = "Upcycled-FL with FedProx and FedAvg baselines, optionally private."


def add_arguments(u: argparse.ArgumentParser) -> None:
    """The options of ``privkit train upcycled``."""
    u.add_argument("--dataset", default="synthetic:0.5,0.5",
                   help=DATASET_HELP)
    u.add_argument("--model", default="logreg", choices=["logreg", "mlp", "cnn", "lstm"],
                   help="the model: multinomial logistic regression, a small MLP, a CNN "
                        "(images) or an LSTM (sent140tok)")
    u.add_argument("--mu", type=float, default=1.0, help="FedProx proximal coefficient")
    u.add_argument("--lam", type=float, default=0.42, help="lambda: c = mu / (mu + lambda)")
    u.add_argument("--lam-schedule", default="constant", choices=["constant", "sqrt"],
                   help="constant: lambda_m = lam (the paper's experiments); sqrt: lambda_m = "
                        "lam sqrt(m) (Corollary 4.8)")
    u.add_argument("--rounds", "--iterations", type=float, default=160,
                   action=noted("--rounds"),
                   help="Upcycled-FL iterations, odd and even (without privacy the other "
                        "algorithms run half as many: --baseline-iterations)")
    u.add_argument("--clients", type=float, default=None,
                   help="the number of clients of a synthetic or digits --dataset (the same as "
                        "its @CLIENTS suffix; default 30)")
    u.add_argument("--fraction", type=float, default=0.3, help="clients sampled per round")
    u.add_argument("--stragglers", type=float, default=0.9, help="share of stragglers")
    u.add_argument("--epochs", type=float, default=20, help="local epochs E")
    u.add_argument("--batch-size", type=float, default=32,
                   help="local minibatch size (record: the expected Poisson batch size)")
    u.add_argument("--lr", type=float, default=0.05, help="local SGD learning rate")
    u.add_argument("--momentum", type=float, default=0.5, help="local SGD momentum")
    u.add_argument("--algorithms", default=None,
                   help="comma-separated among upcycled, fedprox, fedavg; the first is the "
                        "main one (default upcycled)")
    u.add_argument("--compare", default=None, help=argparse.SUPPRESS)
    u.add_argument("--algorithm", default=None, choices=["upcycled", "fedprox", "fedavg"],
                   help=argparse.SUPPRESS)
    add_device(u)
    u.add_argument("--seed", type=float, default=0,
                   help="seed of the data, the model and every draw (the run is reproducible)")
    u.add_argument("--eval-every", type=float, default=1, help="evaluate every N iterations")
    add_out_arguments(u, unit="iterations")
    p = u.add_argument_group("privacy (odd iterations only; even ones are post-processing)")
    p.add_argument("--privacy", default="none",
                   choices=["none", "output", "objective", "client", "record"],
                   help="client: client-level DP-FedAvg (clip each update to --clip, noise the "
                        "sum once, Poisson client sampling at --client-rate); record: DP-SGD in "
                        "local training (per-example clip --clip, Poisson minibatches of "
                        "expected size --batch-size); output/objective: the paper's mechanisms")
    p.add_argument("--sensitivity", default=None,
                   choices=["replace-one", "paper", "strongly-convex"],
                   help="output perturbation: 2*tau (default replace-one, any model), "
                        "tau/|D_i| (the paper's Thm C.1 assumption), or the strongly convex "
                        "bound")
    p.add_argument("--clip", type=float, default=None,
                   help="output: tau, the model's L2 clip norm (default 10, the paper's); "
                        "client: C, each update's (default 1; the initial C under adaptive "
                        "clipping, the default with --mechanism gaussian); record: C, each "
                        "example gradient's (default 1)")
    p.add_argument("--noise-multiplier", type=float, default=None,
                   help="z for client/record: noise stddev = z * --clip (default 1; refused "
                        "with --noise-for-epsilon, which calibrates it; client with adaptive "
                        "clipping: the sum's z, the round priced at the joint z, <= 2%% lower; "
                        "--aggregation distributed: the stddev over C of a released sum's "
                        "guaranteed noise, its --min-survivors shares)")
    p.add_argument("--client-rate", type=float, default=None,
                   help="q for client: each client joins a data round with probability q "
                        "(default: --fraction)")
    p.add_argument("--server-lr", type=float, default=None,
                   help="client: server learning rate on the noisy mean update (default 1)")
    p.add_argument("--server-momentum", type=float, default=None,
                   help="client: heavy-ball server momentum on the noisy mean update "
                        "(default 0.5 with --mechanism gaussian, 0 with bandmf)")
    p.add_argument("--adaptive-clip", type=float, default=None, metavar="QUANTILE",
                   help="client, --mechanism gaussian: the clip norm tracks this quantile of "
                        "the update norms from --clip (Andrew et al. 2021; default 0.5; 0: "
                        "a fixed --clip); the noisy count (stddev max(q N / 20, 2.5 z)) and "
                        "the sum are one release, priced jointly")
    p.add_argument("--mechanism", default=None, choices=["gaussian", "bandmf"],
                   help="client: gaussian (DP-FedAvg: independent noise, Poisson sampling; "
                        "default) or bandmf (banded matrix factorization: correlated noise "
                        "under --participation, no Poisson sampling needed)")
    p.add_argument("--bands", type=float, default=None,
                   help="bandmf: b, the strategy's bands (default 4; 1: DP-FedAvg's noise "
                        "under the same participation, priced without amplification)")
    p.add_argument("--participation", default=None, choices=["minsep", "cyclic", "poisson"],
                   help="bandmf: minsep (cohorts of round(q N) among clients not in the last "
                        "b-1 data rounds; default), cyclic (group t mod g, all of it) or "
                        "poisson (group t mod g, each member with probability q; amplified)")
    p.add_argument("--groups", type=float, default=None,
                   help="bandmf with cyclic or poisson: g, clients split by id mod g "
                        "(default: --bands)")
    p.add_argument("--min-separation", type=float, default=None,
                   help="bandmf with minsep: s, data rounds between two participations of a "
                        "client (default: --bands)")
    p.add_argument("--aggregation", default=None, choices=["central", "distributed"],
                   help="client, --mechanism gaussian: central (DP-FedAvg: the server adds the "
                        "noise, a trusted aggregator; default) or distributed (no trusted "
                        "aggregator: each sampled client adds its own Skellam noise share and "
                        "the server sees only the sum modulo 2^--bits through secure "
                        "aggregation; zero-out relation; a fixed --clip)")
    p.add_argument("--bits", "--secagg-bits", type=float, default=None,
                   action=noted("--bits"),
                   help="distributed: the secure sum's modulus 2^bits (default 20)")
    add_survivor_arguments(p)
    p.add_argument("--sigma", type=float, default=None,
                   help="output noise stddev (absolute; default 1)")
    p.add_argument("--alpha", type=float, default=None,
                   help="objective perturbation rate (default 20)")
    p.add_argument("--lipschitz", type=float, default=None,
                   help="u1 for --sensitivity strongly-convex (default: sqrt(2 (R^2 + 1)) from "
                        "--feature-norm R; a smaller value is refused)")
    p.add_argument("--feature-norm", type=float, default=None,
                   help="R: clip every feature row to this public L2 norm (needed by "
                        "--sensitivity strongly-convex, whose u1 and beta it bounds)")
    p.add_argument("--delta", type=float, default=None,
                   help="delta of every epsilon (default 1e-3 for output/objective, 1e-5 for "
                        "client/record)")
    p.add_argument("--epsilon-budget", type=float, default=None,
                   help="stop before any client's epsilon would exceed this")
    p.add_argument("--noise-for-epsilon", type=float, default=None,
                   help="calibrate --sigma / --alpha / --noise-multiplier so the run ends at "
                        "this epsilon")
    p.add_argument("--noise-target", default=None, choices=["mean", "max"],
                   help="--noise-for-epsilon targets the clients' max (default) or mean "
                        "epsilon (output, objective, record; client level has one epsilon)")
    p.add_argument("--allow-unproven", action="store_true",
                   help="run objective perturbation outside Thm C.2 (epsilon marked NOT PROVEN)")
    p.add_argument("--baseline-iterations", default="auto", choices=["auto", "half", "same"],
                   help="iterations of the other --algorithms: half of --rounds (the "
                        "paper's equal client compute), the same, or auto (half, unless "
                        "private: FedProx then releases twice as often)")
    u.add_argument("--json", action="store_true", help="print the final table as JSON")


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check every option, the configuration and the data-set spec (nothing is touched);
    returns the run."""
    from fl_examples.core.data import check_dataset_spec
    from fl_examples.upcycled import UpcycledConfig

    cfg = UpcycledConfig(
        dataset=with_clients(args.dataset, args.clients), model=args.model, mu=args.mu,
        lam=args.lam,
        lam_schedule=args.lam_schedule, iterations=nonnegative_int("rounds", args.rounds),
        fraction=args.fraction, stragglers=args.stragglers,
        local_epochs=nonnegative_int("epochs", args.epochs),
        batch_size=nonnegative_int("batch_size", args.batch_size),
        lr=args.lr, momentum=args.momentum, device=args.device,
        eval_every=nonnegative_int("eval_every", args.eval_every),
        privacy=args.privacy, sensitivity=args.sensitivity, l2_clip_norm=args.clip,
        stddev=args.sigma, alpha=args.alpha, lipschitz=args.lipschitz,
        feature_norm=args.feature_norm, delta=args.delta,
        noise_multiplier=args.noise_multiplier, client_rate=args.client_rate,
        server_lr=args.server_lr, server_momentum=args.server_momentum,
        adaptive_clip=args.adaptive_clip, mechanism=args.mechanism,
        bands=None if args.bands is None else positive_int("bands", args.bands),
        participation=args.participation,
        groups=None if args.groups is None else positive_int("groups", args.groups),
        min_separation=None if args.min_separation is None else positive_int(
            "min_separation", args.min_separation),
        aggregation=args.aggregation,
        bits=None if args.bits is None else positive_int("bits", args.bits),
        **survivor_options(args),
        epsilon_budget=args.epsilon_budget, allow_unproven=args.allow_unproven,
        noise_for_epsilon=args.noise_for_epsilon, noise_target=args.noise_target,
        baseline_iterations=args.baseline_iterations, **run_options(args),
    )
    epsilon_target("noise_for_epsilon", args.noise_for_epsilon)
    main, compare = split_algorithms(args.algorithms, args.algorithm, args.compare,
                                     ("upcycled",), ("upcycled", "fedprox", "fedavg"))
    check_dataset_spec(cfg.dataset, seed=cfg.seed)
    return functools.partial(_run, args, cfg, main, compare)


def run(args: argparse.Namespace) -> int:
    return run_prepared(args, prepare)


def _run(args: argparse.Namespace, cfg: Any, main: str, compare: tuple[str, ...]) -> int:
    from fl_examples.core.report import is_quiet
    from fl_examples.upcycled import final_table, train

    res = train(cfg, compare=compare, out=args.out, resume=args.resume, algorithm=main)
    return finish(args, res, _summary, final_table, None if is_quiet() else
                  f"\nreport: {args.out}/report.json  plots: {args.out}/curves_vs_*.png")


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    """``--json``: each algorithm's final evaluation and privacy (without the per-client
    list)."""
    return {n: r["history"][-1] | ({"privacy": {k: v for k, v in r["privacy"].items()
                                                if k != "per_client"}}
                                   if "privacy" in r else {})
            for n, r in res["algorithms"].items()}


def with_clients(spec: str, clients: float | None) -> str:
    """``--dataset`` with ``--clients N`` as its ``@N`` suffix (synthetic and digits only;
    refused beside a suffix of its own)."""
    if clients is None:
        return spec
    from privkit.errors import InvalidParameterError

    n = nonnegative_int("clients", clients)
    body, at, _ = spec.partition("@")
    if at:
        raise InvalidParameterError("clients", clients, "left out when --dataset has its own "
                                    "@CLIENTS suffix")
    if body.split(":", 1)[0].strip().lower() not in ("synthetic", "digits"):
        raise InvalidParameterError("clients", clients, "given with a synthetic or digits "
                                    "--dataset (the others bring their own clients)")
    return f"{spec}@{n}"
