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

``--gaussian`` instead measures the Gaussian mode's accuracy table of docs/trainers/mapa.md:
``train mapa``'s defaults for ``--noise gaussian`` on digits (30 edges, expected batch 24,
2000 updates, clip 1, constant step 0.1; ``--updates N`` to change), MAPA and AUDP with z
calibrated so every edge's whole-run epsilon at delta = 1e-5 is at most 1, 2, 4 and 8, and
non-private ASGD with the same settings; seeds 0, 1, 2 (``--seeds``). Each cell is the same as
``privkit train mapa --noise gaussian --noise-for-epsilon E --seed S --out DIR``.
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


def gaussian_table(updates: int, seeds: list[int]) -> None:
    """Final test accuracy of MAPA, AUDP (Gaussian noise, calibrated) and ASGD per seed."""
    print(f"Gaussian mode, digits, 30 edges, b = 24, {updates} updates, clip 1, lr 0.1; "
          f"seeds {seeds}")
    print(f"{'epsilon':>8} {'algorithm':>9} {'z':>7} {'eps max':>8} {'test acc per seed':>24} "
          f"{'mean':>6} {'wall s':>7}")
    for eps in (1.0, 2.0, 4.0, 8.0, None):
        rows: dict[str, list[tuple[float, float, float, float]]] = {}
        for seed in seeds:
            kw = {} if eps is None else {"noise_for_epsilon": eps}
            cfg = MapaConfig(noise="gaussian", updates=updates, eval_every=updates, seed=seed,
                             **kw)
            ds = load_edges(cfg.dataset, edges=cfg.edges, seed=seed)
            for alg in ("asgd",) if eps is None else ("mapa", "audp"):
                t0 = time.perf_counter()
                res = run_algorithm(alg, cfg, dataset=ds)
                p = res.get("privacy", {})
                rows.setdefault(alg, []).append(
                    (res["history"][-1]["heldout_accuracy"], p.get("noise_multiplier", 0.0),
                     p.get("epsilon_max", 0.0), time.perf_counter() - t0))
        for alg, r in rows.items():
            accs = " ".join(f"{a:.3f}" for a, *_ in r)
            mean = sum(a for a, *_ in r) / len(r)
            label = "none" if eps is None else f"{eps:g}"
            print(f"{label:>8} {alg:>9} {r[0][1]:>7.3f} {max(x[2] for x in r):>8.4f} "
                  f"{accs:>24} {mean:>6.3f} {sum(x[3] for x in r) / len(r):>7.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gaussian", action="store_true",
                    help="the Gaussian mode's accuracy table instead of the throughput")
    ap.add_argument("--updates", type=int, default=2000, help="with --gaussian")
    ap.add_argument("--seeds", default="0,1,2", help="with --gaussian")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.gaussian:
        gaussian_table(args.updates, [int(s) for s in args.seeds.split(",")])
        return
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
