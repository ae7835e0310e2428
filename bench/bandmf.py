"""Banded MF benchmark: noise and error at equal epsilon, and the per-round streaming cost.

Part 1 (deterministic): T rounds, each client in at most k of them, any two at least T / k
apart (``MinSeparation``). For the identity (DP-FedAvg without amplification), binary-tree
DP-FTRL and banded Toeplitz strategies optimised for the prefix sums (b = 4, 16, 64), at the
same epsilon: the sensitivity, the noise multiplier z that ``calibrate_bandmf`` returns, and
the RMSE of the T prefix sums of the noisy releases (per coordinate, clip norm 1), with its
ratio to the identity's. Then the amplified variant (``CyclicPoisson``: T / k groups, Poisson
rate q within the round's group): the noise multiplier for the same epsilon, the same for every
strategy with b <= T / k (each participation is one subsampled Gaussian at the column norm 1).

Part 2 (timing): every strategy's ``BandMF.noise`` runs side by side on a d-coordinate float64
model (numpy generator), the strategies interleaved round by round; the best per-round time in
a window of rounds starting at 100, 1,000 and 10,000 is printed with its ratio to the
identity's in the same window. Banded strategies cost O(b d) per round whatever the round; the
tree's cost follows the number of nodes a round closes.

Run ``python bench/bandmf.py`` (``--no-timing`` for part 1 only).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from privkit.accountants import (
    CyclicPoisson,
    MinSeparation,
    bandmf_sensitivity,
    calibrate_bandmf,
)
from privkit.mechanisms import BandedToeplitzStrategy, BandMF, TreeStrategy


def strategies(rounds: int) -> list[tuple[str, object]]:
    return [("identity (b = 1)", BandedToeplitzStrategy.identity()),
            ("tree (DP-FTRL)", TreeStrategy()),
            *[(f"banded b = {b}", BandedToeplitzStrategy.optimized(b, rounds))
              for b in (4, 16, 64)]]


def table(rounds: int, k: int, epsilon: float, delta: float) -> None:
    schema = MinSeparation(min_separation=rounds // k, max_participations=k)
    print(f"T = {rounds}, {schema}, epsilon {epsilon} at delta {delta:g}")
    print(f"{'strategy':18} {'state':>7} {'sensitivity':>17} {'z':>8} {'RMSE':>8} {'vs id':>6}")
    base = None
    for name, s in strategies(rounds):
        sens = bandmf_sensitivity(s, rounds=rounds, participation=schema)
        cal = calibrate_bandmf(s, target_epsilon=epsilon, delta=delta, rounds=rounds,
                               participation=schema)
        rmse = cal.noise_multiplier * s.workload_error(rounds)
        base = rmse if base is None else base
        held = (f"{s.num_bands - 1}" if isinstance(s, BandedToeplitzStrategy)
                else f"<={rounds.bit_length()}")
        shown = (f"{sens.value:.4f}" if sens.exact
                 else f"[{sens.lower_bound:.3f}, {sens.value:.3f}]")
        print(f"{name:18} {held:>7} {shown:>17} {cal.noise_multiplier:8.3f} {rmse:8.2f} "
              f"{rmse / base:6.3f}")
    groups = rounds // k
    for q in (0.2, 0.5):
        amp = CyclicPoisson(groups, q)
        zs = [calibrate_bandmf(s, target_epsilon=epsilon, delta=delta, rounds=rounds,
                               participation=amp).noise_multiplier
              for name, s in strategies(rounds) if isinstance(s, BandedToeplitzStrategy)]
        print(f"amplified, {amp}: z = " + ", ".join(f"{z:.4f}" for z in zs)
              + " (identity, b = 4, 16, 64)")


def timing(dim: int, windows: tuple[int, ...], width: int) -> None:
    mechs = [(name, BandMF(s, 1.0, 1.0)) for name, s in strategies(1000)]
    like = {"w": np.zeros(dim)}
    states = [m.initial_state() for _, m in mechs]
    rngs = [np.random.default_rng(i) for i in range(len(mechs))]
    best = {(w, i): math.inf for w in windows for i in range(len(mechs))}
    last = max(windows) + width
    for t in range(last):
        window = next((w for w in windows if w <= t < w + width), None)
        for i, (_, m) in enumerate(mechs):
            t0 = time.perf_counter()
            _, states[i] = m.noise(like, states[i], rng=rngs[i])
            dt = time.perf_counter() - t0
            if window is not None:
                best[window, i] = min(best[window, i], dt)
    print(f"\nper-round noise cost, d = {dim}, best of {width} rounds from round ...")
    print(f"{'strategy':18}" + "".join(f" {w:>17,}" for w in windows))
    for i, (name, _) in enumerate(mechs):
        cells = "".join(f" {best[w, i] * 1e3:7.3f} ms {best[w, i] / best[w, 0]:5.2f}x"
                        for w in windows)
        print(f"{name:18}{cells}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--participations", type=int, default=10)
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--delta", type=float, default=1e-6)
    p.add_argument("--dim", type=int, default=1 << 14)
    p.add_argument("--width", type=int, default=50)
    p.add_argument("--no-timing", action="store_true")
    a = p.parse_args()
    table(a.rounds, a.participations, a.epsilon, a.delta)
    if not a.no_timing:
        timing(a.dim, (100, 1000, 10_000), a.width)


if __name__ == "__main__":
    main()
