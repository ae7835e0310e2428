"""MAPA simulator throughput: applied updates per second, batched vs naive, 100 and 1000 edges.

Every ratio compares numbers measured in this same run on this machine. Run
``python bench/mapa.py`` (``--quick``: fewer updates; ``--threads``: torch CPU threads, 1 by
default for every path).

Part 1, the event schedule alone (:func:`fl_examples.core.asyncsim.simulate`): the
vectorized path (one sort of all arrival times; valid when the cloud never queues) against the
event path (a heap over the K in-flight uploads, one Python step per upload), for the same
schedule (they are tested to agree exactly).

Part 2, training (AUDP, the private baseline; logistic regression on Synthetic(0.5, 0.5), 20
features, 10 classes, d = 210; b = 24, eps = 1 per upload, lognormal(0, 1) edge speeds; an
in-memory ledger): the batched path (pending uploads computed together: per-example gradients
for many model versions in one bmm, clipping of all rows in one call, noise per upload from
its own stream) against the naive path (each upload computed when its edge pulls, through
``LaplaceGradientNoise.__call__``). Both give the same model (tested). Timed: the training loop
(gradients, clipping, noise, ledger charges, model updates), not the evaluations.
"""

from __future__ import annotations

import argparse
import time

import torch

from fl_examples.core.asyncsim import TimingModel, simulate
from fl_examples.mapa import MapaConfig, load_edges, run_algorithm


def sim_rate(edges: int, updates: int, method: str) -> float:
    t0 = time.perf_counter()
    s = simulate(edges, updates, TimingModel(), seed=0, method=method)
    dt = time.perf_counter() - t0
    assert s.num_applied == updates
    return updates / dt


def train_rate(edges: int, updates: int, batched: bool, ds: object) -> tuple[float, int]:
    cfg = MapaConfig(dataset="synthetic:0.5,0.5", edges=edges, batch=24, updates=updates,
                     epsilon=1.0, eval_every=updates, batched=batched, seed=0)
    res = run_algorithm("audp", cfg, dataset=ds)  # type: ignore[arg-type]
    return updates / res["history"][-1]["wall_time_s"], res["gradient_batches"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sim_updates = 20_000 if args.quick else 100_000
    print(f"part 1: event schedule, {sim_updates} applied updates")
    print(f"{'edges':>6} {'vectorized upd/s':>17} {'events upd/s':>13} {'ratio':>7}")
    for edges in (100, 1000):
        v = max(sim_rate(edges, sim_updates, "vectorized") for _ in range(2))
        e = max(sim_rate(edges, sim_updates, "events") for _ in range(2))
        print(f"{edges:>6} {v:>17.0f} {e:>13.0f} {v / e:>7.1f}")
    print("\npart 2: AUDP training, synthetic(0.5,0.5) logreg, b = 24")
    print(f"{'edges':>6} {'updates':>7} {'batched upd/s':>14} {'naive upd/s':>12} "
          f"{'ratio':>7} {'uploads per batch':>18}")
    for edges in (100, 1000):
        ds = load_edges("synthetic:0.5,0.5", edges=edges, seed=0)
        n_b = 2000 if args.quick else 10_000
        n_n = 1000 if args.quick else 3000
        rb, batches = train_rate(edges, n_b, True, ds)
        rn, _ = train_rate(edges, n_n, False, ds)
        print(f"{edges:>6} {n_b:>7} {rb:>14.0f} {rn:>12.0f} {rb / rn:>7.1f} "
              f"{n_b / batches:>18.1f}")


if __name__ == "__main__":
    main()
