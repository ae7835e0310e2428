"""Record-level DP-SGD behind a Flower strategy, beside the same run without privacy.

A Flower simulation (Ray) of FedAvg-style rounds (``PrivkitFedProx`` with mu = 0, every
client every round) where each client trains with :class:`~fl_examples.flower.DpSgdMod`;
then the same settings with plain local SGD. Prints each client's record-level epsilon after
all rounds (the composed ``round_event`` of its steps, add/remove one record, at ``delta``)
and both final accuracies (server-side evaluation on the union of the clients' test splits)::

    python fl_examples/flower/dpsgd_simulation.py --noise-multiplier 2.05

Measured results are in ``docs/flower.md``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

import privkit
from fl_examples.core.dpsgd import DpSgdSettings, round_event, steps_per_client
from fl_examples.flower import (
    PrivkitFedProx,
    central_evaluate_fn,
    initial_arrays,
    load_federated,
    make_client_app,
)
from fl_examples.flower.client import make_model
from privkit.flower import DpSgdMod


def client_epsilons(sizes: Any, *, rounds: int, local_epochs: int, settings: DpSgdSettings,
                    delta: float) -> list[float]:
    """Each client's record-level epsilon after ``rounds`` rounds of DP-SGD."""
    steps = steps_per_client(sizes, [local_epochs] * len(sizes), settings.batch_size).tolist()
    return [privkit.epsilon(privkit.SelfComposedDpEvent(round_event(int(n), int(s), settings),
                                                        rounds), delta=delta).epsilon
            for n, s in zip(sizes, steps)]


def run(*, dataset: str = "digits@10", clients: int = 10, rounds: int = 20,
        local_epochs: int = 2, batch_size: int = 32, lr: float = 0.5, momentum: float = 0.5,
        l2_clip_norm: float = 1.0, noise_multiplier: float = 2.05, delta: float = 1e-5,
        seed: int = 0) -> dict[str, Any]:
    """Run the private then the non-private simulation; returns epsilons and accuracies."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    ds = load_federated(dataset, seed, clients)
    settings = DpSgdSettings(l2_clip_norm=l2_clip_norm, noise_multiplier=noise_multiplier,
                             batch_size=batch_size)
    eps = client_epsilons(ds.train_sizes, rounds=rounds, local_epochs=local_epochs,
                          settings=settings, delta=delta)
    out: dict[str, Any] = {"epsilon_max": max(eps), "epsilon_mean": float(np.mean(eps)),
                           "delta": delta}
    app = ServerApp()

    @app.main()
    def main(grid: Any, context: Any) -> None:
        for label, action in (("dpsgd", "dpsgd"), ("non-private", "default")):
            strategy = PrivkitFedProx(clients, proximal_mu=0.0, fraction_train=1.0,
                                      fraction_evaluate=0.0, local_epochs=local_epochs,
                                      batch_size=batch_size, lr=lr, momentum=momentum,
                                      seed=seed, train_action=action)
            model = make_model("logreg", ds)
            t0 = time.perf_counter()
            result = strategy.start(grid=grid, initial_arrays=initial_arrays(model, seed),
                                    num_rounds=rounds, timeout=600.0,
                                    evaluate_fn=central_evaluate_fn(model, ds))
            evals = result.evaluate_metrics_serverapp
            out[label] = {"accuracy": float(evals[max(evals)]["accuracy"]),
                          "seconds": time.perf_counter() - t0}

    mod = DpSgdMod(l2_clip_norm=l2_clip_norm, noise_multiplier=noise_multiplier,
                   batch_size=batch_size)
    client = make_client_app(dataset=dataset, seed=seed, num_clients=clients,
                             train_actions={"dpsgd": [mod]})
    run_simulation(app, client, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    if "non-private" not in out:
        raise RuntimeError("the simulation's ServerApp failed (see the log above)")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="digits@10", help="data set spec (default digits@10)")
    p.add_argument("--clients", type=int, default=10, help="clients = simulated nodes")
    p.add_argument("--rounds", type=int, default=20, help="rounds (default 20)")
    p.add_argument("--local-epochs", type=int, default=2, help="expected passes per round")
    p.add_argument("--batch-size", type=int, default=32, help="expected DP-SGD batch size b")
    p.add_argument("--lr", type=float, default=0.5, help="local learning rate")
    p.add_argument("--clip", type=float, default=1.0, help="per-example clip norm C")
    p.add_argument("--noise-multiplier", type=float, default=2.05, help="z (default 2.05)")
    p.add_argument("--delta", type=float, default=1e-5, help="delta (default 1e-5)")
    p.add_argument("--seed", type=int, default=0, help="data, sampling and init seed")
    a = p.parse_args(argv)
    res = run(dataset=a.dataset, clients=a.clients, rounds=a.rounds,
              local_epochs=a.local_epochs, batch_size=a.batch_size, lr=a.lr,
              l2_clip_norm=a.clip, noise_multiplier=a.noise_multiplier, delta=a.delta,
              seed=a.seed)
    print(f"DP-SGD accuracy {res['dpsgd']['accuracy']:.4f} (record-level epsilon max "
          f"{res['epsilon_max']:.3f}, mean {res['epsilon_mean']:.3f} at delta {a.delta:g}) | "
          f"non-private accuracy {res['non-private']['accuracy']:.4f}")


if __name__ == "__main__":
    main()
