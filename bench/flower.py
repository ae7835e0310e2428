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

The private variant times the same FedProx experiment with client-level DP-FedAvg: Poisson
client sampling at q = 0.5, each update clipped to C = 1, noise multiplier z = 1 on the sum,
delta 1e-5, in both engines:

- privkit: ``run_algorithm`` with ``privacy="client"`` (what ``privkit train upcycled
  --privacy client`` runs), its ledger charged each round;
- Flower: :class:`fl_examples.flower.ClientLevelDP` around the same ``PrivkitFedProx``
  (``fraction_train=1.0``: the wrapper samples) in ``run_simulation``.

Both are seeded (sampling and noise reproducible: experiments only), but they draw different
clients and noise (the wrapper samples Flower's node ids), so only the expected work per round
(q N = 15 local solves) and the epsilon, which both ledgers charge for the same events, are
the same; their final models are not compared.

Run ``python bench/flower.py`` (``--rounds N`` to change the 6 rounds; ``--no-private`` skips
the private variant).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

import numpy as np

SPEC, SEED, MU, EPOCHS, BATCH, LR, MOMENTUM = "synthetic:0.5,0.5", 0, 1.0, 20, 32, 0.05, 0.5
#: the private variant: client rate q, clip C, noise multiplier z, delta
Q, CLIP, Z, DELTA = 0.5, 1.0, 1.0, 1e-5


def simulator(rounds: int, private: bool = False) -> tuple[float, dict[str, np.ndarray],
                                                           float | None]:
    """(seconds per round, final model, epsilon or None) of privkit's batched simulator."""
    from fl_examples.flower import load_federated
    from fl_examples.upcycled import UpcycledConfig, run_algorithm

    ds = load_federated(SPEC, SEED)
    dp: dict[str, Any] = dict(privacy="client", client_rate=Q, l2_clip_norm=CLIP,
                              noise_multiplier=Z, delta=DELTA) if private else {}
    cfg = UpcycledConfig(dataset=SPEC, mu=MU, iterations=rounds, fraction=1.0, stragglers=0.0,
                         local_epochs=EPOCHS, batch_size=BATCH, lr=LR, momentum=MOMENTUM,
                         seed=SEED, device="cpu", eval_every=rounds, **dp)
    res = run_algorithm("fedprox", cfg, ds, iterations=rounds)
    eps = float(res["privacy"]["epsilon_max"]) if private else None
    return res["history"][-1]["wall_time_s"] / rounds, {k: v.numpy()
                                                         for k, v in res["model"].items()}, eps


def flower(rounds: int, private: bool = False
           ) -> tuple[float, dict[str, np.ndarray], int, float | None]:
    """(seconds per round after round 1, final model, client actors, epsilon or None) of
    Flower's simulation (``private``: ClientLevelDP around the strategy)."""
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    from flwr.simulation import run_simulation

    logging.getLogger("flwr").setLevel(logging.WARNING)  # a finished simulation resets it

    from fl_examples.flower import (
        PrivkitFedProx,
        initial_arrays,
        load_federated,
        make_client_app,
        make_server_app,
    )
    from fl_examples.flower.client import make_model
    from privkit.flower import ClientLevelDP

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

    def make(ctx: Any) -> Any:
        inner = Timed(ds.num_clients, proximal_mu=MU, fraction_train=1.0, local_epochs=EPOCHS,
                      batch_size=BATCH, lr=LR, momentum=MOMENTUM, seed=SEED,
                      fraction_evaluate=0.0)
        if not private:
            return inner
        return ClientLevelDP(inner, num_clients=ds.num_clients, client_rate=Q,
                             l2_clip_norm=CLIP, noise_multiplier=Z, delta=DELTA, seed=SEED)

    app = make_server_app(
        make, lambda ctx: initial_arrays(make_model("logreg", ds), SEED), rounds,
        on_result=lambda result, strategy: out.update(result=result, strategy=strategy))
    cpus = os.cpu_count() or 1
    run_simulation(app, make_client_app(dataset=SPEC, seed=SEED), num_supernodes=ds.num_clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    per_round = (marks[rounds + 1] - marks[2]) / (rounds - 1)
    model = {k: v.numpy() for k, v in out["result"].arrays.items()}
    eps = float(out["strategy"].epsilon()) if private else None
    return per_round, model, cpus, eps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="FedProx rounds (>= 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads of the batched simulator (default 1)")
    parser.add_argument("--no-private", action="store_true",
                        help="skip the private variant (client-level DP in both engines)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (round 1 is Flower's warm-up)")
    logging.getLogger("flwr").setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)
    sim_s, sim_model, _ = simulator(args.rounds)
    fl_s, fl_model, actors, _ = flower(args.rounds)
    err = max(float(np.abs(sim_model[k] - fl_model[k]).max()) for k in sim_model)
    print(f"FedProx, {SPEC}, 30 clients x E={EPOCHS}, {args.rounds} rounds, CPU "
          f"({actors} CPUs, one Ray client actor per CPU; simulator {args.threads} thread(s))")
    print(f"{'engine':<44} {'s / round':>10} {'ms / client task':>17}")
    print(f"{'privkit batched simulator':<44} {sim_s:>10.4f} {1000 * sim_s / 30:>17.2f}")
    print(f"{'Flower simulation (Ray)':<44} {fl_s:>10.4f} {1000 * fl_s / 30:>17.2f}")
    print(f"ratio Flower / privkit: {fl_s / sim_s:.1f}x")
    print(f"max |w_flower - w_privkit| after {args.rounds} rounds: {err:.3g}")
    if args.no_private:
        return
    psim_s, _, psim_eps = simulator(args.rounds, private=True)
    pfl_s, _, _, pfl_eps = flower(args.rounds, private=True)
    k = Q * 30  # expected local solves per round
    print(f"\nprivate: client-level DP-FedAvg, q={Q:g} (expected {k:g} clients per round), "
          f"C={CLIP:g}, z={Z:g}, delta={DELTA:g}")
    print(f"{'engine':<44} {'s / round':>10} {'ms / client task':>17}")
    print(f"{'privkit simulator, privacy=client':<44} {psim_s:>10.4f} "
          f"{1000 * psim_s / k:>17.2f}")
    print(f"{'Flower simulation, ClientLevelDP(FedProx)':<44} {pfl_s:>10.4f} "
          f"{1000 * pfl_s / k:>17.2f}")
    print(f"ratio Flower / privkit (private): {pfl_s / psim_s:.1f}x")
    print(f"epsilon after {args.rounds} rounds: privkit {psim_eps:.4f}, Flower {pfl_eps:.4f}")


if __name__ == "__main__":
    main()
