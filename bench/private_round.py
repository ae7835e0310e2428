"""Per-round cost of privacy in the trainer: a private client-level round against a non-private
one at the same expected cohort, how a private round scales with the population, and the
ledger's charge per round.

1. Private against non-private rounds of ``privkit train upcycled`` (logistic regression,
   FedAvg, one local epoch, no stragglers), at cohorts of 20 (``synthetic:iid@200/100``, q =
   0.1) and 10^4 (``synthetic:iid@100000/10``, q = 0.1). Non-private: ``--fraction 0.1`` (the
   same clients per round as the private run's expected Poisson cohort). Private:
   ``--privacy client --clip 1 --noise-multiplier 1 --client-rate 0.1`` with the client-level
   defaults (adaptive clipping at the median, server momentum 0.5), and with ``--adaptive-clip
   0 --server-momentum 0`` (a fixed clip, no momentum: the non-private run's server), each
   with its file-backed ledger. The rounds run as :func:`fl_examples.core.run.drive` runs them
   (charges deferred, the ledger synced at publication points; here every ``--sync-every``
   rounds, as a checkpoint or a shown evaluation would) without the evaluations; a block of
   rounds includes its sync. ``durable every round`` syncs after every round (what a progress
   bar showing every evaluation costs, and the cost before deferred durability). Contenders
   are timed in turns, a block each, the order rotated (bench/_timing.py), ``--reps`` blocks
   each; the median per round and the load average are printed. Target: private <= 1.2x
   non-private.
2. Where a private round's time goes (``--breakdown``): the trainer's own pieces timed inside
   the same rounds (selection, batch orders, local SGD, the ledger charge, the release).
3. Population scaling: private rounds (defaults, deferred) at an expected cohort of 100 for N =
   10^3 ... 10^6 (``synthetic:iid@N/10``, q = 100 / N), beside non-private rounds of 100
   clients. Target: N = 10^6 within 1.5x of N = 10^3.
4. The ledger alone for 10,000 rounds, charged as the trainer charges it (``would_exceed``
   then ``spend`` of ``PoissonSampledDpEvent(0.1, GaussianDpEvent(1))``), durable each round
   and deferred (synced every 25 rounds), without a budget and with one reached at the end:
   per-round time at round 10 and at round 10,000 (medians of 10 rounds). Target: round
   10,000 <= 1.5x round 10.

``--busy`` adds a busy-looping process for the whole run (one core of load). Run ``python
bench/private_round.py`` (``--quick`` for fewer repetitions and N up to 10^5; ``--skip``
to leave parts out).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import busy, interleaved, load, median  # noqa: E402

import privkit  # noqa: E402
from fl_examples.core.data import parse_dataset_spec  # noqa: E402
from fl_examples.core.rounds import resolve_device  # noqa: E402
from fl_examples.upcycled import run as upcycled_run  # noqa: E402
from fl_examples.upcycled.config import UpcycledConfig  # noqa: E402
from fl_examples.upcycled.privacy import _privacy_plan  # noqa: E402
from privkit.ledger import Ledger  # noqa: E402

DELTA = 1e-5
EVENT = privkit.PoissonSampledDpEvent(0.1, privkit.GaussianDpEvent(1.0))
COHORTS = {20: ("synthetic:iid@200/100", 0.1), 10_000: ("synthetic:iid@100000/10", 0.1)}


# ----------------------------------------------------------------------------- runs
def make_run(spec: str, ds: Any, rate: float, privacy: dict[str, Any] | None, work: Path) -> Any:
    """A FedAvg run of the upcycled trainer as ``privkit train upcycled`` builds it (one local
    epoch, no stragglers, cpu), with a file-backed ledger in ``work`` when private."""
    kw: dict[str, Any] = dict(dataset=spec, iterations=10**9, local_epochs=1, stragglers=0.0,
                              fraction=rate, eval_every=10**9, checkpoint_every=0, device="cpu")
    if privacy is not None:
        kw |= dict(privacy="client", client_rate=rate, l2_clip_norm=1.0,
                   noise_multiplier=1.0) | privacy
    cfg = UpcycledConfig(**kw)
    plan, calibration = _privacy_plan("fedavg", cfg, ds, 10**9)
    ledger = None
    if plan is not None:
        out = Path(tempfile.mkdtemp(dir=work))
        ledger = upcycled_run._open_ledger("fedavg", cfg, out, False, plan.neighboring_relation)
    return upcycled_run._Run("fedavg", cfg, ds, resolve_device("cpu"), plan, ledger,
                             iterations=10**9, calibration=calibration)


def block(run: Any, rounds: int, sync_every: int) -> Callable[[], None]:
    """``rounds`` rounds of ``run`` as drive runs them (charges deferred), synced every
    ``sync_every`` rounds and at the end of the block."""
    def go() -> None:
        ctx = run.ledger.deferred() if run.ledger is not None else contextlib.nullcontext()
        with ctx:
            for i in range(rounds):
                run.step()
                if run.ledger is not None and (i + 1) % sync_every == 0:
                    run.ledger.sync()
    return go


@contextlib.contextmanager
def timers(names: dict[str, tuple[Any, str]]) -> Iterator[dict[str, float]]:
    """Seconds spent in each ``(owner, attribute)`` callable while the block runs."""
    spent: dict[str, float] = collections.defaultdict(float)
    saved = []
    for key, (owner, attr) in names.items():
        real = getattr(owner, attr)

        def wrapped(*a: Any, _real: Any = real, _key: str = key, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                spent[_key] += time.perf_counter() - t0

        saved.append((owner, attr, real))
        setattr(owner, attr, wrapped)
    try:
        yield spent
    finally:
        for owner, attr, real in saved:
            setattr(owner, attr, real)


# ---------------------------------------------------------------------------- part 1
def part_rounds(reps: int, sync_every: int, work: Path, breakdown: bool) -> None:
    print("1. private vs non-private rounds (logistic regression, FedAvg, 1 local epoch, no "
          "stragglers, cpu, 1 torch thread), milliseconds per round: median of the blocks")
    for cohort, (spec, q) in COHORTS.items():
        ds = parse_dataset_spec(spec, seed=0)
        per_block = 25 if cohort <= 100 else 3
        runs = {
            "non-private (--fraction 0.1)": make_run(spec, ds, q, None, work),
            "private, defaults (adaptive clip, momentum 0.5)": make_run(spec, ds, q, {}, work),
            "private, fixed clip, no momentum": make_run(
                spec, ds, q, {"adaptive_clip": 0.0, "server_momentum": 0.0}, work),
            "private, defaults, durable every round": make_run(spec, ds, q, {}, work),
        }
        syncs = {name: (1 if "durable every round" in name else sync_every) for name in runs}
        contenders = {name: block(run, per_block, syncs[name]) for name, run in runs.items()}
        for fn in contenders.values():  # warm up (imports, first allocations)
            fn()
        before = load()
        got = interleaved(contenders, reps)
        after = load()
        base = median(got["non-private (--fraction 0.1)"]) / per_block
        print(f"\n  cohort {cohort:,} ({spec}, q = {q}; {reps} blocks of {per_block} rounds "
              f"each, in turns; ledger synced every {sync_every} rounds unless said; load "
              f"average {before:.2f} -> {after:.2f})")
        for name, times in got.items():
            t = median(times) / per_block
            ratio = t / base
            mark = "" if name.startswith("non-private") else (
                f"  (target <= 1.2x: {'OK' if ratio <= 1.2 else 'MISSED'})")
            print(f"    {name:<48} {t * 1e3:9.2f} ms  {ratio:5.2f}x{mark}")
        if breakdown:
            part_breakdown(runs, per_block, sync_every)
        del runs, contenders, ds


def part_breakdown(runs: dict[str, Any], per_block: int, sync_every: int) -> None:
    from fl_examples.core import dp_modes, local, rounds

    pieces = {"selection (sample, epochs)": (upcycled_run._Run, "_selection"),
              "batch orders": (upcycled_run, "client_orders"),
              "local SGD": (upcycled_run, "local_sgd"),
              "ledger charge (deferred)": (upcycled_run._Run, "_charge"),
              "release (clip, noise, server step)": (dp_modes.ClientDpPlan, "release"),
              "aggregate (non-private)": (upcycled_run, "aggregate")}
    del local, rounds
    print("    where the time goes (ms per round, one block each, inside the rounds above):")
    for name in ("non-private (--fraction 0.1)",
                 "private, defaults (adaptive clip, momentum 0.5)"):
        with timers(pieces) as spent:
            t0 = time.perf_counter()
            block(runs[name], per_block, sync_every)()
            total = time.perf_counter() - t0
        parts = ", ".join(f"{k} {v / per_block * 1e3:.2f}" for k, v in spent.items() if v)
        print(f"      {name.split(' (')[0]:<18} total {total / per_block * 1e3:.2f}: {parts}")


# ---------------------------------------------------------------------------- part 3
def part_population(sizes: list[int], reps: int, work: Path) -> None:
    print("\n3. population scaling at an expected cohort of 100 (synthetic:iid@N/10, q = 100/N; "
          "non-private: 100 clients a round), milliseconds per round")
    print(f"  {'N':>9} {'private':>9} {'non-private':>12} {'private vs N = ' + f'{sizes[0]:,}':>20}"
          f"  load")
    first = None
    for n in sizes:
        spec = f"synthetic:iid@{n}/10"
        t0 = time.perf_counter()
        ds = parse_dataset_spec(spec, seed=0)
        built = time.perf_counter() - t0
        q = 100 / n
        runs = {"private": make_run(spec, ds, q, {}, work),
                "non-private": make_run(spec, ds, q, None, work)}
        contenders = {k: block(r, 10, 10) for k, r in runs.items()}
        for fn in contenders.values():
            fn()
        got = interleaved(contenders, reps)
        p, np_ = median(got["private"]) / 10, median(got["non-private"]) / 10
        first = first or p
        print(f"  {n:>9,} {p * 1e3:9.2f} {np_ * 1e3:12.2f} {p / first:19.2f}x  {load():.2f}"
              f"  (data built in {built:.0f} s)")
        del runs, contenders, ds
    print("  (target: N = 10^6 within 1.5x of N = 10^3)")


# ---------------------------------------------------------------------------- part 4
def ledger_run(rounds: int, budget: float | None, path: Path | None,
               sync_every: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per-round seconds of a trainer-like charge (``sync_every``: deferred, synced so often;
    None: durable each round), and the seconds of each sync (deferred only), apart."""
    led = Ledger.create(path, population_id="bench", delta=DELTA, epsilon_budget=budget,
                        created="2024-01-01T00:00:00+00:00")
    times = np.full(rounds, np.nan)
    syncs: list[float] = []
    durable = sync_every is None
    for r in range(rounds):
        t0 = time.perf_counter()
        if bool(led.would_exceed(["population"], EVENT)[0]):
            break
        led.spend(["population"], EVENT, label="client-level release", round=r + 1,
                  run_id="fedavg", durable=durable)
        times[r] = time.perf_counter() - t0
        if not durable and (r + 1) % sync_every == 0:
            t1 = time.perf_counter()
            led.sync()
            syncs.append(time.perf_counter() - t1)
    led.sync()
    return times, np.asarray(syncs)


def part_ledger(rounds: int, work: Path) -> None:
    eps_end = privkit.epsilon(privkit.SelfComposedDpEvent(EVENT, rounds), DELTA).epsilon
    print(f"\n4. the ledger alone: {rounds:,} rounds charged like the trainer, milliseconds per "
          "round (median charge; a deferred round's share of the median sync added)")
    print(f"  {'':<44} {'round 10':>9} {f'round {rounds:,}':>13} {'ratio':>6} {'mean':>7}")
    cases = {"file, durable each round, no budget": (None, "a", None),
             "file, deferred (sync every 25), no budget": (None, "b", 25),
             f"file, durable, budget {eps_end:.4g} (reached at the end)": (eps_end, "c", None),
             f"file, deferred, budget {eps_end:.4g}": (eps_end, "d", 25),
             "in memory, no budget": (None, None, None)}
    for name, (budget, tag, sync_every) in cases.items():
        path = work / f"ledger-{tag}.jsonl" if tag else None
        times, syncs = ledger_run(rounds, budget, path, sync_every)
        done = int(np.count_nonzero(~np.isnan(times)))
        # the same statistic for every case: the median charge of rounds 5-15 and of the last
        # 10 rounds, plus (deferred) the median sync spread over the rounds it covers
        share = float(np.median(syncs)) / sync_every if sync_every and len(syncs) else 0.0
        early = float(np.median(times[5:15])) + share
        late = float(np.median(times[done - 10:done])) + share
        ok = "OK" if late <= 1.5 * early else "MISSED"
        print(f"  {name:<44} {early * 1e3:9.3f} {late * 1e3:13.3f} {late / early:5.2f}x "
              f"{(np.nansum(times) + syncs.sum()) / done * 1e3:7.3f}  {ok}")
    print("  (target: round 10,000 <= 1.5x round 10)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=9, help="timed blocks per contender (parts 1, 3)")
    p.add_argument("--sync-every", type=int, default=25,
                   help="rounds between the ledger's syncs in part 1 (a publication point)")
    p.add_argument("--rounds", type=int, default=10_000, help="ledger rounds (part 4)")
    p.add_argument("--max-n", type=float, default=1e6, help="largest population (part 3)")
    p.add_argument("--quick", action="store_true", help="5 blocks, N up to 10^5, 2,000 "
                                                        "ledger rounds")
    p.add_argument("--busy", action="store_true", help="add a busy-looping process meanwhile")
    p.add_argument("--breakdown", action="store_true", help="part 2 (where the time goes)")
    p.add_argument("--skip", default="", help="parts to leave out, e.g. 3,4")
    a = p.parse_args()
    if a.quick:
        a.reps, a.max_n, a.rounds = 5, min(a.max_n, 1e5), 2_000
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    torch.set_num_threads(1)  # privkit train's default (--threads 1)
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1700000000")
    work = Path(tempfile.mkdtemp(prefix="privkit-bench-"))
    sizes = [n for n in (10**3, 10**4, 10**5, 10**6) if n <= a.max_n]
    print(f"{os.cpu_count()} cores, load average {load():.2f}"
          f"{'; with a busy-looping process added (--busy)' if a.busy else ''}")
    try:
        with busy(1 if a.busy else 0):
            if "1" not in skip:
                part_rounds(a.reps, a.sync_every, work, a.breakdown)
            if "3" not in skip:
                part_population(sizes, a.reps, work)
            if "4" not in skip:
                part_ledger(a.rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
