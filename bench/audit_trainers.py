"""What ``--audit-canaries`` costs a trainer run: wall time and held-out accuracy.

The upcycled client-level default run at the bench settings (``privkit train upcycled
--dataset synthetic:iid@200/100 --privacy client --client-rate 0.1 --noise-for-epsilon 4
--rounds 60``: DP-FedAvg with its defaults, adaptive clipping and server momentum), with
``--audit-canaries 100`` and without, for each seed: the same seed draws the same client
sample, batches and noise in both runs (the canaries draw from their own stream), so the
accuracy difference is the canaries' own effect on the model. Wall time: each configuration
``--repeats`` times, the two interleaved (without, with, without, with, ...) so that the
machine's load hits both alike; the ratio is taken per (seed, repeat) pair and its median
printed, for the whole ``train()`` call (calibration, training, evaluation, report, and with
canaries the bounds) and for the training loop alone (the history's ``wall_time_s``).

Run ``python bench/audit_trainers.py`` (about 3 minutes on two busy cores; ``--seeds 1
--repeats 1`` for a quick check); ``--cli`` times each run as the ``privkit train upcycled``
command in its own process (interpreter start and imports included, about 4 minutes). The
end prints the release's cost and the audit's own work in it, timed
alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fl_examples.cli import set_threads  # noqa: E402
from fl_examples.core.report import quiet  # noqa: E402
from fl_examples.upcycled import UpcycledConfig, train  # noqa: E402

SETTINGS = dict(dataset="synthetic:iid@200/100", privacy="client", client_rate=0.1,
                noise_for_epsilon=4.0, iterations=60, device="cpu")


#: The same run on the command line (``--cli``: each run in its own process, as a user runs
#: it; the whole wall time, interpreter start and imports included).
COMMAND = ["train", "upcycled", "--dataset", "synthetic:iid@200/100", "--privacy", "client",
           "--client-rate", "0.1", "--noise-for-epsilon", "4", "--rounds", "60", "-q"]


def one_cli(seed: int, m: int) -> dict[str, Any]:
    import json
    import subprocess

    privkit = Path(sys.executable).with_name("privkit")
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        subprocess.run([str(privkit), *COMMAND, "--seed", str(seed), "--audit-canaries",
                        str(m), "--out", f"{d}/o"], check=True, capture_output=True)
        total = time.perf_counter() - t0
        report = json.loads(Path(f"{d}/o/report.json").read_text())
    last = report["algorithms"]["upcycled"]["history"][-1]
    return {"total": total, "loop": last["wall_time_s"], "acc": last["heldout_accuracy"],
            "audit": report.get("audit")}


def one(seed: int, m: int) -> dict[str, Any]:
    cfg = UpcycledConfig(**SETTINGS, seed=seed, audit_canaries=m)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as d, quiet():
        t0 = time.perf_counter()
        res = train(cfg, out=d)
        total = time.perf_counter() - t0
    last = res["algorithms"]["upcycled"]["history"][-1]
    return {"total": total, "loop": last["wall_time_s"], "acc": last["heldout_accuracy"],
            "audit": res.get("audit")}


def release_cost(m: int, repeat: int = 500) -> tuple[float, float]:
    """Seconds of one client-level release at the bench's settings (20 clients, the logistic
    regression's 210 parameters, adaptive clipping) and of the audit's own work in it (the
    canary rows inserted, the known part clipped and summed, the noisy sum projected and
    scored), each the fastest of ``repeat`` calls (the machine's load barely moves a minimum;
    release-with minus release-without would be a difference of two noisy numbers)."""
    import torch

    from bench._timing import best_of
    from fl_examples.core.canaries import for_plan
    from fl_examples.core.data import parse_dataset_spec
    from fl_examples.upcycled.privacy import client_plan

    cfg = UpcycledConfig(**SETTINGS)  # type: ignore[arg-type]
    plan = client_plan(cfg, parse_dataset_spec(cfg.dataset, seed=0), 1.0)
    g = torch.Generator().manual_seed(0)
    w = {"weight": torch.zeros(10, 20), "bias": torch.zeros(10)}
    local = {k: v.unsqueeze(0) + torch.randn(20, *v.shape, generator=g) for k, v in w.items()}
    delta = {k: local[k] - w[k] for k in w}
    can = for_plan(plan, m, 210, seed=0)

    def audit_work() -> None:
        stack = can.insert(delta, w, clip=1.0)
        can.observe({k: v.sum(0) for k, v in stack.items()})

    return best_of(lambda: plan.release(w, local, {}, g), repeat), best_of(audit_work, repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--canaries", type=int, default=100)
    ap.add_argument("--cli", action="store_true",
                    help="time each run as a privkit command in its own process")
    a = ap.parse_args()
    run = one_cli if a.cli else one
    set_threads(1)
    rows: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for rep in range(a.repeats):
        for seed in range(a.seeds):
            for m in (0, a.canaries):
                rows.setdefault((seed, m), []).append(run(seed, m))
                r = rows[(seed, m)][-1]
                print(f"repeat {rep} seed {seed} M {m:>3}: {r['total']:.2f} s (loop "
                      f"{r['loop']:.2f} s), held-out accuracy {r['acc']:.4f}", flush=True)
    ratios = [rows[(s, a.canaries)][i]["total"] / rows[(s, 0)][i]["total"]
              for s in range(a.seeds) for i in range(a.repeats)]
    loops = [rows[(s, a.canaries)][i]["loop"] / rows[(s, 0)][i]["loop"]
             for s in range(a.seeds) for i in range(a.repeats)]
    print(f"\n| seed | accuracy without | with M = {a.canaries} | difference (points) | "
          "audit line |")
    print("|---|---|---|---|---|")
    diffs = []
    for s in range(a.seeds):
        acc0, acc1 = rows[(s, 0)][0]["acc"], rows[(s, a.canaries)][0]["acc"]
        diffs.append(100 * (acc1 - acc0))
        line = rows[(s, a.canaries)][0]["audit"]["line"]
        print(f"| {s} | {100 * acc0:.2f}% | {100 * acc1:.2f}% | {diffs[-1]:+.2f} | {line} |")
    print(f"\nmedian wall-time ratio (with / without), whole run: "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}, "
          f"{len(ratios)} interleaved pairs); training loop: {statistics.median(loops):.3f}")
    print(f"mean accuracy difference: {statistics.mean(diffs):+.2f} points (max |diff| "
          f"{max(abs(d) for d in diffs):.2f})")
    release, work = release_cost(a.canaries)
    loop = statistics.median(r["loop"] for r in rows[(0, 0)]) / (SETTINGS["iterations"] // 2)
    print(f"one release (fastest of 500): {1e3 * release:.3f} ms; the audit's work in it "
          f"with M = {a.canaries}: {1e3 * work:.3f} ms; a data round of the loop takes "
          f"{1e3 * loop:.1f} ms (median, seed 0): the audit adds {100 * work / loop:.1f}%")


if __name__ == "__main__":
    main()
