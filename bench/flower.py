"""Time per round of one FedProx experiment: privkit's batched simulator vs Flower's simulation.

Both run the same experiment on this machine in this run: FedProx (mu = 1) on
``synthetic:0.5,0.5`` (30 clients, multinomial logistic regression, 20 features, 10 classes),
every client in every round (fraction 1, no stragglers), E = 20 local epochs, batch 32,
lr 0.05, momentum 0.5, seed 0.

- privkit: :func:`fl_examples.upcycled.run_algorithm` (all 30 local solves in one batched
  call), time per round = its wall time (evaluation excluded) / rounds, with ``--threads``
  torch CPU threads (1 by default, like each Flower client; on a loaded machine more threads
  than free cores can make torch's CPU kernels many times slower).
- Flower: :class:`fl_examples.flower.PrivkitFedProx` with the example ClientApp in
  ``run_simulation`` (Ray, one CPU and one torch thread per client actor, so as many actors
  as CPUs). Time per round is measured inside the strategy, from the start of round 2 to the
  end of the last round (Ray and actor start-up and the first round's imports excluded);
  federated evaluation is off.

Both runs draw the same clients, batch orders and initial model, so the final models must
agree to float rounding; the largest difference is printed too.

Run ``python bench/flower.py`` (``--rounds N`` to change the 6 rounds).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

import numpy as np

SPEC, SEED, MU, EPOCHS, BATCH, LR, MOMENTUM = "synthetic:0.5,0.5", 0, 1.0, 20, 32, 0.05, 0.5


def simulator(rounds: int) -> tuple[float, dict[str, np.ndarray]]:
    """(seconds per round, final model) of privkit's batched simulator."""
    from fl_examples.flower import load_federated
    from fl_examples.upcycled import UpcycledConfig, run_algorithm

    ds = load_federated(SPEC, SEED)
    cfg = UpcycledConfig(dataset=SPEC, mu=MU, iterations=rounds, fraction=1.0, stragglers=0.0,
                         local_epochs=EPOCHS, batch_size=BATCH, lr=LR, momentum=MOMENTUM,
                         seed=SEED, device="cpu", eval_every=rounds)
    res = run_algorithm("fedprox", cfg, ds, iterations=rounds)
    return res["history"][-1]["wall_time_s"] / rounds, {k: v.numpy()
                                                         for k, v in res["model"].items()}


def flower(rounds: int) -> tuple[float, dict[str, np.ndarray], int]:
    """(seconds per round after round 1, final model, client actors) of Flower's simulation."""
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    from flwr.simulation import run_simulation

    from fl_examples.flower import (
        PrivkitFedProx,
        initial_arrays,
        load_federated,
        make_client_app,
        make_server_app,
    )
    from fl_examples.flower.client import make_model

    ds = load_federated(SPEC, SEED)
    marks: dict[int, float] = {}

    class Timed(PrivkitFedProx):
        def configure_train(self, server_round: int, *args: Any) -> Any:
            marks.setdefault(server_round, time.perf_counter())
            return super().configure_train(server_round, *args)

        def aggregate_train(self, server_round: int, replies: Any) -> Any:
            out = super().aggregate_train(server_round, replies)
            marks[rounds + 1] = time.perf_counter()
            return out

    out: dict[str, Any] = {}
    app = make_server_app(
        lambda ctx: Timed(ds.num_clients, proximal_mu=MU, fraction_train=1.0,
                          local_epochs=EPOCHS, batch_size=BATCH, lr=LR, momentum=MOMENTUM,
                          seed=SEED, fraction_evaluate=0.0),
        lambda ctx: initial_arrays(make_model("logreg", ds), SEED), rounds,
        on_result=lambda result, strategy: out.update(result=result))
    cpus = os.cpu_count() or 1
    run_simulation(app, make_client_app(dataset=SPEC, seed=SEED), num_supernodes=ds.num_clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    per_round = (marks[rounds + 1] - marks[2]) / (rounds - 1)
    model = {k: v.numpy() for k, v in out["result"].arrays.items()}
    return per_round, model, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="FedProx rounds (>= 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads of the batched simulator (default 1)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (round 1 is Flower's warm-up)")
    logging.getLogger("flwr").setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)
    sim_s, sim_model = simulator(args.rounds)
    fl_s, fl_model, actors = flower(args.rounds)
    err = max(float(np.abs(sim_model[k] - fl_model[k]).max()) for k in sim_model)
    print(f"FedProx, {SPEC}, 30 clients x E={EPOCHS}, {args.rounds} rounds, CPU "
          f"({actors} CPUs, one Ray client actor per CPU; simulator {args.threads} thread(s))")
    print(f"{'engine':<30} {'s / round':>10} {'ms / client task':>17}")
    print(f"{'privkit batched simulator':<30} {sim_s:>10.4f} {1000 * sim_s / 30:>17.2f}")
    print(f"{'Flower simulation (Ray)':<30} {fl_s:>10.4f} {1000 * fl_s / 30:>17.2f}")
    print(f"ratio Flower / privkit: {fl_s / sim_s:.1f}x")
    print(f"max |w_flower - w_privkit| after {args.rounds} rounds: {err:.3g}")


if __name__ == "__main__":
    main()
