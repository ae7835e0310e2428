"""Per-round cost of privacy: a private client-level round against a non-private one, and the
ledger's charge per round at round 10 and at round 10,000, with and without a budget.

1. The trainer (``privkit train upcycled``, logistic regression on synthetic:iid@200/100,
   FedAvg, one local epoch, no stragglers), 100 rounds: client-level DP-FedAvg (Poisson client
   sampling at q = 0.1, clip 1, noise multiplier 1, its ledger charged before every release)
   against the same run without privacy at the same expected number of clients per round
   (``--fraction 0.1``); the non-private run with the default ``--fraction 0.3`` is shown too.
   The time per round is the trainer's own wall time of its rounds (``wall_time_s`` of
   report.json: evaluation, start-up and plots excluded); each run is made twice, alternating,
   and the faster kept. Target: private <= 1.2x non-private.
2. The bookkeeping alone for 10,000 rounds: a file-backed ledger (as the trainer's, fsynced
   every round) charged as the trainer charges it (``would_exceed`` then ``spend`` of the
   population's round event, ``PoissonSampledDpEvent(0.1, GaussianDpEvent(1))``), without a
   budget, with a budget far from reached (the epsilon of 20,000 rounds), and with a budget
   reached exactly at round 10,000 (the run's last stretch is priced tightly), and an
   in-memory ledger without a budget (the accounting without the fsyncs). Per-round time at
   round 10 (median of rounds 6-15) and at round 10,000 (median of the last 10 rounds: a
   single slow fsync does not decide it), the mean over the run, and how many compositions
   were priced tightly; for scale, what pricing the whole history costs once at rounds 10
   and 10,000 (what every charge used to cost).
   Target: round 10,000 <= 1.5x round 10 with and without a budget.

Run ``python bench/private_round.py`` (``--rounds`` and ``--trainer-rounds`` to change the
sizes, ``--skip-trainer`` for part 2 only).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import privkit
from privkit.ledger import Ledger

DELTA = 1e-5
EVENT = privkit.PoissonSampledDpEvent(0.1, privkit.GaussianDpEvent(1.0))
COMMON = ["train", "upcycled", "--dataset", "synthetic:iid@200/100", "--algorithms", "fedavg",
          "--epochs", "1", "--stragglers", "0", "--quiet"]
PRIVATE = ["--privacy", "client", "--client-rate", "0.1", "--clip", "1", "--noise-multiplier",
           "1"]


def trainer_seconds_per_round(extra: list[str], rounds: int, work: Path) -> float:
    """The trainer's own wall time per round (report.json), for one run."""
    out = work / f"run-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "privkit", *COMMON, *extra, "--rounds", str(rounds),
           "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    final = json.loads((out / "report.json").read_text())["algorithms"]["fedavg"]["final"]
    shutil.rmtree(out)
    return float(final["wall_time_s"]) / int(final["iteration"])


def part_trainer(rounds: int, work: Path) -> None:
    print(f"1. trainer: {rounds} rounds of logistic-regression FedAvg (synthetic:iid@200/100), "
          "seconds per round (the faster of two runs)")
    cases = {"non-private, --fraction 0.1": ["--fraction", "0.1"],
             "non-private, --fraction 0.3": [],
             "private client-level, q = 0.1": PRIVATE}
    best = dict.fromkeys(cases, np.inf)
    for _ in range(2):
        for name, extra in cases.items():
            best[name] = min(best[name], trainer_seconds_per_round(extra, rounds, work))
    base = best["non-private, --fraction 0.1"]
    for name, t in best.items():
        print(f"  {name:<32} {t * 1e3:7.2f} ms/round  {t / base:5.2f}x non-private (q = 0.1)")
    ratio = best["private client-level, q = 0.1"] / base
    print(f"  private / non-private at the same expected clients per round: {ratio:.2f}x "
          f"(target <= 1.2x) {'OK' if ratio <= 1.2 else 'MISSED'}")


def ledger_run(rounds: int, budget: float | None,
               path: Path | None) -> tuple[np.ndarray, int, float]:
    """Per-round seconds of a trainer-like charge, the tight prices made, and the seconds of
    the final ledger.epsilons()."""
    led = Ledger.create(path, population_id="bench", delta=DELTA, epsilon_budget=budget,
                        created="2024-01-01T00:00:00+00:00")
    times = np.full(rounds, np.nan)
    for r in range(rounds):
        t0 = time.perf_counter()
        if bool(led.would_exceed(["population"], EVENT)[0]):
            break
        led.spend(["population"], EVENT, label="client-level release", round=r + 1,
                  run_id="fedavg")
        times[r] = time.perf_counter() - t0
    priced = led._states.priced  # how many compositions the budget check priced
    t0 = time.perf_counter()
    led.epsilons()
    return times, priced, time.perf_counter() - t0


def part_ledger(rounds: int, work: Path) -> None:
    eps_end = privkit.epsilon(privkit.SelfComposedDpEvent(EVENT, rounds), DELTA).epsilon
    eps_far = privkit.epsilon(privkit.SelfComposedDpEvent(EVENT, 2 * rounds), DELTA).epsilon
    print(f"\n2. bookkeeping alone: a file-backed ledger charged like the trainer, {rounds} "
          "rounds, milliseconds per round")
    for r in (10, rounds):
        t0 = time.perf_counter()
        privkit.epsilon(privkit.SelfComposedDpEvent(EVENT, r), DELTA)
        print(f"  (pricing the whole history once at round {r}: "
              f"{(time.perf_counter() - t0) * 1e3:.1f} ms; every charge used to do this)")
    cases: dict[str, tuple[float | None, Path | None]] = {
        "no budget": (None, work / "ledger-0.jsonl"),
        f"budget {eps_far:.4g} (far)": (eps_far, work / "ledger-1.jsonl"),
        f"budget {eps_end:.4g} (reached at the end)": (eps_end, work / "ledger-2.jsonl"),
        "no budget, in memory": (None, None)}
    print(f"  {'':<34} {'round 10':>9} {f'round {rounds}':>12} {'ratio':>7} {'mean':>8}  "
          "tight prices")
    for name, (budget, path) in cases.items():
        times, priced, final = ledger_run(rounds, budget, path)
        done = int(np.count_nonzero(~np.isnan(times)))
        early, late = np.median(times[5:15]), np.median(times[done - 10:done])
        ok = "OK" if late <= 1.5 * early else "MISSED"
        print(f"  {name:<34} {early * 1e3:9.3f} {late * 1e3:12.3f} {late / early:6.2f}x "
              f"{np.nanmean(times) * 1e3:8.3f}  {priced} (of {done} charges); final "
              f"epsilons() {final * 1e3:.0f} ms  {ok}")
    print("  (target: round 10,000 <= 1.5x round 10, with and without a budget)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=10_000, help="ledger rounds (part 2)")
    p.add_argument("--trainer-rounds", type=int, default=100, help="trainer rounds (part 1)")
    p.add_argument("--skip-trainer", action="store_true", help="part 2 only")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="privkit-bench-"))
    try:
        if not a.skip_trainer:
            part_trainer(a.trainer_rounds, work)
        part_ledger(a.rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
