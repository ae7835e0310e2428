"""Audit what you train: empirical lower bounds on epsilon next to the accounted epsilon.

For each setting and each target epsilon (2, 4, 8 at delta 1e-5; z calibrated by privkit so
that the run's accounted epsilon is the target), the bench prints, every bound at 95%
confidence:

- **two runs** (Nasr et al. 2023): ``--trials`` runs with one canary and as many without, the
  canary scored white-box from every release. ``GDP`` is the GDP method with the threshold
  fixed in advance at half the claimed shift (q = 1; the equal-error test of the claimed
  mechanism) or over all thresholds with the simultaneous band (q < 1, where the scores are
  log-likelihood ratios); ``CP`` is Clopper-Pearson over all thresholds (no GDP assumption).
- **one run**: ``--canaries`` canaries with fair coins in one run: Steinke, Nasr & Jagielski's
  bound (``Steinke``) and the Gaussian one-run bound (``Gauss``), each the median [range] of
  ``--seeds`` runs (a single run's bound moves by a third from seed to seed).

Settings (synthetic tasks, the real privkit code in every release):

- ``fedavg q=1``: client-level DP-FedAvg, :class:`privkit.ClientLevelGaussian`, 10 clients
  of a linear-regression task every round, 2 rounds, a model of 16 coordinates (two runs)
  or 1000 (one run: room for the Dirac canaries); canary clients of norm C, the real
  clients' clipped sum known to the auditor (the server audits itself); score: the
  normalised sum of the canary's projections. 10000 trials per side.
- ``fedavg q=0.1``: the same with 100 clients Poisson-sampled at q = 0.1 (canaries too),
  10 rounds, 1000 trials per side; score: the summed log-likelihood ratio of a
  Poisson-sampled canary (the sample stays secret from the score). The accounted epsilon
  uses amplification.
- ``dp-sgd``: :func:`privkit.torch.make_private` on a 120-16-2 MLP, 64 records, expected
  batch 16 (q = 0.25), 4 steps, 400 trials per side; canary examples through
  ``DpSgd.step(extra_gradients=)``
  (Poisson-sampled at q like records) on first-layer weights of input features that are zero
  in the real data (their real gradient is exactly 0, so the known part is 0 there);
  score: log-likelihood ratios.

Then the overhead of auditing: a DP-FedAvg run on a synthetic logistic-regression task
(1000 clients a round, 30 rounds, epsilon 4) with M = 100 random canary clients (inserted and
scored every round) against the same run without, over several seeds: the wall-time ratio
and the test-accuracy drop.

The one-run methods' ceiling: beside each setting's one-run bounds, ``ideal`` gives the
median (and range) over ``--seeds`` seeds of what the same two methods certify when each
canary's score is the accounted mechanism itself (a unit-variance Gaussian shifted by 1/z in
each round it is sampled, scored by its exact log-likelihood ratio; no model, no other
clients), with the run's m canaries and with ten times as many. It is the most a one-run audit
with that many canaries can show, so a run's one-run bound is read against it, not only
against the accounted epsilon. Steinke et al. (NeurIPS 2023) and Agrawal et al. (2026, "Let's
Ask Gauss") plot their one-run bounds for DP-SGD on CIFAR-10; this bench prints no number
from their papers (docs/audit-runs.md says why).

Run ``python bench/audit_runs.py`` (2-6 minutes on two shared cores), ``--quick`` for a
CI-size check (about 30 seconds: epsilon 4 only, a tenth of the trials).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

import privkit
from privkit import ClientLevelGaussian
from privkit.audit import (
    Canaries,
    WhiteBoxScorer,
    clipped_sum,
    clopper_pearson_bound,
    gaussian_bound,
    gdp_bound,
    make_canaries,
    one_run_bound,
    two_run_scores,
    with_canaries,
)

DELTA = 1e-5
C = 1.0
LOCAL_STEPS = 5  # local gradient steps of a client in the overhead task (FedAvg's E)


def calibrate(eps: float, steps: int, q: float) -> float:
    return privkit.calibrate_noise_multiplier(target_epsilon=eps, delta=DELTA, steps=steps,
                                              sampling_probability=q).noise_multiplier


def accounted(z: float, steps: int, q: float) -> float:
    inner: Any = privkit.GaussianDpEvent(z)
    ev = inner if q == 1 else privkit.PoissonSampledDpEvent(q, inner)
    return privkit.epsilon(privkit.SelfComposedDpEvent(ev, steps), DELTA).epsilon


# ------------------------------------------------------------------ DP-FedAvg
class FedAvg:
    """Client-level DP-FedAvg on a synthetic linear-regression task (numpy)."""

    def __init__(self, *, population: int, q: float, rounds: int, dim: int, z: float,
                 seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.targets = rng.normal(0.0, 1.0 / math.sqrt(dim), (population, dim))
        self.population, self.q, self.rounds, self.dim = population, q, rounds, dim
        self.agg = ClientLevelGaussian(C, z, q)
        self.z = z

    def run(self, canaries: Canaries, rng: np.random.Generator, scorer: WhiteBoxScorer
            ) -> None:
        w = np.zeros(self.dim)
        for _ in range(self.rounds):
            sampled = rng.random(self.population) < self.q
            updates = {"w": 0.5 * (self.targets[sampled] - w)}
            known = clipped_sum(updates, C)
            take = canaries.poisson(self.q, rng)
            noisy = self.agg(with_canaries(updates, canaries, take), rng=rng)
            scorer.add(noisy, known={"w": known})
            w = w + noisy["w"] / (self.q * self.population)


def fedavg_two_run(task: FedAvg, trials: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    can = make_canaries(1, task.dim, norm=C, seed=seed)

    def run(include: bool, rng: np.random.Generator) -> float:
        c = can.with_included(include)
        sc = WhiteBoxScorer(c, stddev=task.z * C, l2_clip_norm=C, sampling_probability=task.q)
        task.run(c, rng, sc)
        return float(sc.scores[0])

    return two_run_scores(run, trials, seed=seed)


def fedavg_one_run(task: FedAvg, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    can = make_canaries(m, task.dim, norm=C, seed=seed)
    sc = WhiteBoxScorer(can, stddev=task.z * C, l2_clip_norm=C, sampling_probability=task.q)
    task.run(can, np.random.default_rng(seed + 1), sc)
    return sc.in_out()


# ------------------------------------------------------------------ DP-SGD
class DpSgdTask:
    """make_private on a small MLP; canary examples on dead-feature weights."""

    N, BATCH, STEPS, REAL, DEAD, HIDDEN = 64, 16, 4, 20, 100, 16

    def __init__(self, z: float, seed: int = 0) -> None:
        import torch

        import privkit.torch as pt

        torch.set_num_threads(1)
        self.torch, self.z = torch, z
        g = torch.Generator().manual_seed(seed)
        x = torch.zeros(self.N, self.REAL + self.DEAD)
        x[:, :self.REAL] = torch.randn(self.N, self.REAL, generator=g)
        y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
        self.net = torch.nn.Sequential(torch.nn.Linear(self.REAL + self.DEAD, self.HIDDEN),
                                       torch.nn.ReLU(), torch.nn.Linear(self.HIDDEN, 2))
        self.init = {k: v.clone() for k, v in self.net.state_dict().items()}
        self.params = dict(self.net.named_parameters())
        self.dim = sum(p.numel() for p in self.params.values())
        self.dp = pt.make_private(
            self.net, torch.optim.SGD(self.net.parameters(), lr=0.5),
            dataset=torch.utils.data.TensorDataset(x, y), expected_batch_size=self.BATCH,
            max_grad_norm=C, delta=DELTA, noise_multiplier=z,
            generator=torch.Generator().manual_seed(seed + 1))
        self.q = self.dp.sampling_probability
        # flat coordinates of first-layer weights of the dead features (zero real gradient)
        cols = np.arange(self.REAL, self.REAL + self.DEAD)
        self.dead = (np.arange(self.HIDDEN)[:, None] * (self.REAL + self.DEAD) + cols).ravel()

    def canaries(self, m: int, seed: int) -> Canaries:
        rng = np.random.default_rng(seed)
        coords = np.sort(rng.choice(self.dead, m, replace=False))
        coins = rng.random(m) < 0.5
        return Canaries(self.dim, C, coins, "dirac", seed, coordinates=coords)

    def run(self, can: Canaries, rng: np.random.Generator, scorer: WhiteBoxScorer) -> None:
        from privkit.audit import canary_rows

        torch = self.torch
        self.net.load_state_dict(self.init)
        self.dp.generator.manual_seed(int(rng.integers(2**62)))
        expected = self.dp.expected_batch_size
        for _ in range(self.STEPS // self.dp.steps_per_epoch):
            for xb, yb in self.dp.epoch():
                take = can.poisson(self.q, rng)
                extra = canary_rows(can, self.params, take)
                self.dp.step(xb, yb, extra_gradients=extra)
                with torch.no_grad():
                    scorer.add({n: p.grad * expected for n, p in self.params.items()})


def dpsgd_two_run(task: DpSgdTask, trials: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    can = task.canaries(1, seed)

    def run(include: bool, rng: np.random.Generator) -> float:
        c = can.with_included(include)
        sc = WhiteBoxScorer(c, stddev=task.z * C, l2_clip_norm=C, sampling_probability=task.q)
        task.run(c, rng, sc)
        return float(sc.scores[0])

    return two_run_scores(run, trials, seed=seed)


def dpsgd_one_run(task: DpSgdTask, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    can = task.canaries(m, seed)
    sc = WhiteBoxScorer(can, stddev=task.z * C, l2_clip_norm=C, sampling_probability=task.q)
    task.run(can, np.random.default_rng(seed + 1), sc)
    return sc.in_out()


# ------------------------------------------------------------------ the one-run ceiling
def ideal_one_run(z: float, rounds: int, q: float, m: int, seed: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """In/out scores of m canaries against the accounted mechanism itself: fair coins; an
    included canary shifts each of its rounds' unit-variance Gaussian by 1/z when Poisson-
    sampled (probability q); the score is the exact log-likelihood ratio summed over rounds."""
    rng = np.random.default_rng(seed)
    mu = 1.0 / z
    inc = rng.random(m) < 0.5
    shift = (rng.random((m, rounds)) < q) & inc[:, None]
    llr = mu * (shift * mu + rng.standard_normal((m, rounds))) - mu * mu / 2
    s = llr.sum(1) if q == 1 else np.log1p(q * np.expm1(llr)).sum(1)
    return s[inc], s[~inc]


def ideal_line(z: float, rounds: int, q: float, m: int, seeds: int) -> str:
    cells = []
    for mm in (m, 10 * m):
        st, ga, _, _ = one_run_cells([ideal_one_run(z, rounds, q, mm, 1000 + seed)
                                      for seed in range(seeds)])
        cells.append(f"m={mm}: Steinke {st}, Gauss {ga}")
    return f"{'':<13} ideal one run: " + "; ".join(cells)


def separation(ins: np.ndarray, outs: np.ndarray) -> float:
    """(mean in - mean out) / the pooled standard deviation of the scores."""
    return float((ins.mean() - outs.mean()) / math.sqrt((ins.var() + outs.var()) / 2))


def agreement(seeds: int, m: int) -> list[str]:
    """At epsilon 4, each sampled setting's real one-run scores against the ideal's over many
    seeds: the Gaussian bound's mean and the in/out separation, with standard errors."""
    lines = []
    z = calibrate(4.0, 10, 0.1)
    fed = FedAvg(population=100, q=0.1, rounds=10, dim=max(1000, m), z=z)
    zs = calibrate(4.0, DpSgdTask.STEPS, DpSgdTask.BATCH / DpSgdTask.N)
    task = DpSgdTask(zs)
    for name, real, zz, rounds, q, mm in (
            ("fedavg q=0.1", lambda k: fedavg_one_run(fed, m, 4 + 100 * k), z, 10, 0.1, m),
            ("dp-sgd q=.25", lambda k: dpsgd_one_run(task, min(m, 1600), 6 + 100 * k), zs,
             DpSgdTask.STEPS, task.q, min(m, 1600))):
        cells = []
        for label, draw in (("run", real),
                            ("ideal", lambda k: ideal_one_run(zz, rounds, q, mm, 2000 + k))):
            pairs = [draw(k) for k in range(seeds)]
            b = [gaussian_bound(i, o, delta=DELTA).epsilon_lower_bound for i, o in pairs]
            sep = [separation(i, o) for i, o in pairs]
            cells.append(f"{label}: Gauss bound mean {np.mean(b):.3f} +- "
                         f"{np.std(b, ddof=1) / math.sqrt(seeds):.3f}, separation "
                         f"{np.mean(sep):.4f} +- {np.std(sep, ddof=1) / math.sqrt(seeds):.4f}")
        lines.append(f"  {name}, epsilon 4, {seeds} seeds: " + "; ".join(cells))
    return lines


# ------------------------------------------------------------------ the table
def one_run_cells(runs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[str, str, float, float]:
    """Median [range] over seeds of Steinke et al.'s and the Gaussian one-run bound."""
    st = [one_run_bound(i, o, delta=DELTA).epsilon_lower_bound for i, o in runs]
    ga = [gaussian_bound(i, o, delta=DELTA).epsilon_lower_bound for i, o in runs]

    def cell(v: list[float]) -> str:
        return f"{np.median(v):.3f} [{min(v):.2f}-{max(v):.2f}]"

    return cell(st), cell(ga), float(np.median(st)), float(np.median(ga))


def row(name: str, eps: float, acc: float, two: tuple[np.ndarray, np.ndarray],
        ones: list[tuple[np.ndarray, np.ndarray]], fixed: float | None, seconds: float) -> str:
    ins, outs = two
    gdp = gdp_bound(ins, outs, delta=DELTA, thresholds="all" if fixed is None else fixed)
    cp = clopper_pearson_bound(ins, outs, delta=DELTA)
    st, ga, st_med, ga_med = one_run_cells(ones)
    two_cells = " ".join(f"{v:6.3f} ({100 * v / acc:3.0f}%)"
                         for v in (gdp.epsilon_lower_bound, cp.epsilon_lower_bound))
    return (f"{name:<13} {eps:>3g} {acc:7.3f}  {two_cells}  Steinke {st} "
            f"({100 * st_med / acc:.0f}%)  Gauss {ga} ({100 * ga_med / acc:.0f}%)  "
            f"{seconds:4.0f}s")


def overhead(seeds: int, rounds: int, repeat: int) -> list[str]:
    """M = 100 random canary clients vs none: wall time (the fastest of ``repeat`` timed runs
    of each, alternating, so that a busy machine disturbs both alike) and test accuracy."""
    clients, per, dim, m = 1000, 20, 100, 100
    z = calibrate(4.0, rounds, 1.0)
    agg = ClientLevelGaussian(C, z)
    out = []
    ratios, drops = [], []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        w_true = rng.normal(size=dim)
        x = rng.normal(size=(clients, per, dim))
        y = (x @ w_true + 0.5 * rng.normal(size=(clients, per)) > 0).astype(float)
        xt = rng.normal(size=(5000, dim))
        yt = (xt @ w_true > 0)

        def train(with_can: bool) -> float:
            r = np.random.default_rng(seed + 100)
            can = make_canaries(m, dim, norm=C, seed=seed, kind="random")
            sc = WhiteBoxScorer(can, stddev=z * C, l2_clip_norm=C)
            w = np.zeros(dim)
            for _ in range(rounds):
                local = np.tile(w, (clients, 1))
                for _ in range(LOCAL_STEPS):  # each client's local gradient steps
                    p = 1 / (1 + np.exp(-np.einsum("knd,kd->kn", x, local)))
                    local -= np.einsum("kn,knd->kd", p - y, x) / per
                upd = {"w": local - w}
                if with_can:
                    noisy = agg(with_canaries(upd, can), rng=r)
                    sc.add(noisy, known=clipped_sum(upd, C))
                else:
                    noisy = agg(upd, rng=r)
                w = w + noisy["w"] / clients
            return float(np.mean((xt @ w > 0) == yt))

        secs = {False: float("inf"), True: float("inf")}
        acc = {}
        for _ in range(repeat):
            for with_can in (False, True):
                t0 = time.perf_counter()
                acc[with_can] = train(with_can)
                secs[with_can] = min(secs[with_can], time.perf_counter() - t0)
        ratio = secs[True] / secs[False]
        drop = 100 * (acc[False] - acc[True])
        ratios.append(ratio)
        drops.append(drop)
        out.append(f"  seed {seed}: {secs[False]:.2f} s -> {secs[True]:.2f} s (x{ratio:.3f}), "
                   f"accuracy {100 * acc[False]:.2f}% -> {100 * acc[True]:.2f}% "
                   f"(drop {drop:+.2f} points)")
    out.append(f"  median wall-time ratio x{np.median(ratios):.3f}, mean accuracy drop "
               f"{np.mean(drops):+.2f} points (M = {m} canaries, {clients} clients a round, "
               f"{LOCAL_STEPS} local steps, {rounds} rounds, epsilon 4; time: fastest of "
               f"{repeat})")
    out.append(_per_round_costs(x, y, agg, m, dim))
    return out


def _per_round_costs(x: np.ndarray, y: np.ndarray, agg: ClientLevelGaussian, m: int,
                     dim: int) -> str:
    """The same round's parts, each the fastest of many timed calls: what the audit adds
    to a round, free of the machine's load."""
    from _timing import best_of

    clients, per = x.shape[:2]
    w = np.zeros(dim)
    rng = np.random.default_rng(0)
    can = make_canaries(m, dim, norm=C, seed=0, kind="random")
    sc = WhiteBoxScorer(can, stddev=float(agg.stddev), l2_clip_norm=C)

    def local() -> dict[str, np.ndarray]:
        loc = np.tile(w, (clients, 1))
        for _ in range(LOCAL_STEPS):
            p = 1 / (1 + np.exp(-np.einsum("knd,kd->kn", x, loc)))
            loc -= np.einsum("kn,knd->kd", p - y, x) / per
        return {"w": loc - w}

    upd = local()
    stack = with_canaries(upd, can)
    noisy = agg(stack, rng=rng)
    known = clipped_sum(upd, C)
    train = best_of(local, 5)
    release = best_of(lambda: agg(upd, rng=rng), 30)
    extra = (best_of(lambda: with_canaries(upd, can), 30)
             + best_of(lambda: agg(stack, rng=rng), 30) - release
             + best_of(lambda: clipped_sum(upd, C), 30)
             + best_of(lambda: sc.add(noisy, known=known), 30))
    return (f"  one round, fastest of many calls: local training {1e3 * train:.2f} ms, release "
            f"{1e3 * release:.2f} ms; the audit adds {1e3 * extra:.2f} ms (insert, "
            f"{can.included.sum()} more rows, the known part, scoring): "
            f"+{100 * extra / (train + release):.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: epsilon 4, fewer trials")
    ap.add_argument("--trials", type=int, default=None, help="two-run trials per side")
    ap.add_argument("--canaries", type=int, default=1000, help="one-run canaries")
    ap.add_argument("--agreement", type=int, default=0, metavar="N",
                    help="also compare the sampled settings' one-run scores with the ideal's "
                         "over N seeds at epsilon 4 (N >= 2)")
    ap.add_argument("--seeds", type=int, default=None,
                    help="seeds of each one-run cell and of its ideal (default 5; 2 with --quick)")
    a = ap.parse_args()
    epsilons = (4.0,) if a.quick else (2.0, 4.0, 8.0)
    trials = a.trials or (1000 if a.quick else 10_000)
    seeds = a.seeds or (2 if a.quick else 5)
    if a.canaries < 10 or seeds < 1 or (a.trials is not None and a.trials < 100) \
            or a.agreement == 1 or a.agreement < 0:
        ap.error("--canaries must be >= 10, --seeds >= 1, --trials >= 100, --agreement 0 "
                 "or >= 2")
    t_start = time.perf_counter()
    print(f"two runs: trials per side {trials} (fedavg q=1), {trials // 10} (q=0.1), "
          f"{max(100, trials // 25)} (dp-sgd); one run: {a.canaries} canaries; every bound "
          f"at 95% confidence, delta {DELTA:g}")
    print(f"{'setting':<13} {'eps':>3} {'account':>7}  {'2-run GDP':>14} {'2-run CP':>14}  "
          f"1-run bounds, median [range] of {seeds} seeds (share of accounted)")
    for eps in epsilons:
        t0 = time.perf_counter()
        z = calibrate(eps, 2, 1.0)
        # two runs on a 16-coordinate model (cheap), one run on 1000 (room for m Dirac canaries)
        task = FedAvg(population=10, q=1.0, rounds=2, dim=16, z=z)
        two = fedavg_two_run(task, trials, seed=1)
        big = FedAvg(population=10, q=1.0, rounds=2, dim=max(1000, a.canaries), z=z)
        ones = [fedavg_one_run(big, a.canaries, seed=2 + 100 * k) for k in range(seeds)]
        fixed = math.sqrt(task.rounds) / z / 2  # half the claimed shift, in noise units
        print(row("fedavg q=1", eps, accounted(z, 2, 1.0), two, ones, fixed,
                  time.perf_counter() - t0), flush=True)
        print(ideal_line(z, 2, 1.0, a.canaries, seeds), flush=True)
    for eps in epsilons:
        t0 = time.perf_counter()
        z = calibrate(eps, 10, 0.1)
        task = FedAvg(population=100, q=0.1, rounds=10, dim=16, z=z)
        two = fedavg_two_run(task, trials // 10, seed=3)
        big = FedAvg(population=100, q=0.1, rounds=10, dim=max(1000, a.canaries), z=z)
        ones = [fedavg_one_run(big, a.canaries, seed=4 + 100 * k) for k in range(seeds)]
        print(row("fedavg q=0.1", eps, accounted(z, 10, 0.1), two, ones, None,
                  time.perf_counter() - t0), flush=True)
        print(ideal_line(z, 10, 0.1, a.canaries, seeds), flush=True)
    for eps in epsilons:
        t0 = time.perf_counter()
        z = calibrate(eps, DpSgdTask.STEPS, DpSgdTask.BATCH / DpSgdTask.N)
        task = DpSgdTask(z)
        two = dpsgd_two_run(task, max(100, trials // 25), seed=5)
        ones = [dpsgd_one_run(task, min(a.canaries, 1600), seed=6 + 100 * k)
                for k in range(seeds)]
        print(row("dp-sgd q=.25", eps, accounted(z, task.STEPS, task.q), two, ones, None,
                  time.perf_counter() - t0), flush=True)
        print(ideal_line(z, task.STEPS, task.q, min(a.canaries, 1600), seeds), flush=True)
    if a.agreement:
        print("one run against its ideal, many seeds:")
        for line in agreement(a.agreement, a.canaries):
            print(line, flush=True)
    print("overhead of auditing (M = 100 canary clients, white-box scored, vs none):")
    for line in overhead(2 if a.quick else 5, 10 if a.quick else 30, 2 if a.quick else 5):
        print(line, flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
