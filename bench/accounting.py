"""Accounting benchmark: privkit vs dp-accounting (and Opacus / prv_accountant if installed).

Every ratio compares numbers measured in this same run on this machine: the contenders of a
workload are timed in turns (the order rotated every round), each the same number of times,
and every time printed is the **median** over those rounds; the 1-minute load average is
printed beside each ratio. Every call is **cold**: before each one, every memo privkit keeps
(its ``functools`` caches and its dict memos, e.g. the one-step PMF pairs of the PLD,
:func:`clear_memos`, listed at the start) is cleared; dp-accounting keeps none. Imports and
library caches (numpy, scipy) are warm for both sides (a warm-up call first).
``--busy`` runs ``--busy-procs`` busy-looping processes (default 1) beside the whole
measurement; numpy's default BLAS threads throughout (printed). ``--quick`` skips the slowest
dp-accounting PLD cells of W2 (a minute each) and takes fewer rounds.

Workloads (delta = 1e-5 throughout):
  W1 Poisson-subsampled Gaussian z=1.1, q=0.01, T in {1e3, 1e4, 1e5}
  W2 non-subsampled Gaussian z in {0.5, 1, 2}, M in {1, 10, 100, 1000}
  W3 pure eps0 in {0.1, 1}, k in {10, 100, 1000}
  W4 noise calibration for eps in {1, 8}, q=0.01, T=1e4
  W5 per-client epsilon for 10^4 clients with heterogeneous dataset sizes
  W6 heterogeneous composition (mixed q and z across rounds, as the trainers produce)

Targets, with and without ``--busy``: W1 privkit AUTO >= 10x faster than dp-accounting's PLD
at equal or better tightness (epsilon ratio <= 1 + 1e-5) and within 2x of dp-accounting's RDP
time; W4 <= 0.25 s.

    python bench/accounting.py [--busy] [--quick] [--only w1 --only w4]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from _timing import busy, interleaved, load, median, threads_line  # bench/ is on sys.path
from dp_accounting import dp_event as E
from dp_accounting import get_epsilon_gaussian
from dp_accounting.mechanism_calibration import LowerEndpointAndGuess, calibrate_dp_mechanism
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

import privkit
from privkit import Method

DELTA = 1e-5
# prv_accountant's rigorous lower bounds on W1 (measured with prv-accountant 0.2.0).
W1_LOWER = {1000: 1.5053, 10_000: 5.1823, 100_000: 21.0787}


#: module-level dicts of privkit that are memos (by name): cleared before a cold call
DICT_MEMOS = ("_PAIRS", "_CURVES")


def _memos() -> list[tuple[str, Any]]:
    """Every memo of a loaded privkit module, by qualified name: its ``functools`` caches and
    its dict memos (:data:`DICT_MEMOS`, or a module-level dict named ``*CACHE*``/``*MEMO*``)."""
    out = []
    for name, mod in sorted(sys.modules.items()):
        if not name.startswith("privkit") or mod is None:
            continue
        for attr, v in vars(mod).items():
            if hasattr(v, "cache_clear") and getattr(v, "__module__", None) == name:
                out.append((f"{name}.{attr}", v.cache_clear))
            elif isinstance(v, dict) and (attr in DICT_MEMOS or "CACHE" in attr.upper()
                                          or "MEMO" in attr.upper()):
                out.append((f"{name}.{attr}", v.clear))
    return out


def memos() -> list[str]:
    """The names of the memos :func:`clear_memos` clears (those loaded now)."""
    return [n for n, _ in _memos()]


def clear_memos() -> None:
    """Clear every memo privkit keeps, so that the next call is cold."""
    for _, clear in _memos():
        clear()


def cold(fns: dict[str, Callable[[], Any]], rounds: int) -> tuple[dict[str, Any], dict[str, float]]:
    """Results and median seconds of cold calls: ``rounds`` interleaved rounds, memos cleared
    before every call."""
    results: dict[str, Any] = {}

    def keep(name: str, fn: Callable[[], Any]) -> Callable[[], None]:
        def call() -> None:
            results[name] = fn()
        return call

    times = interleaved({k: keep(k, f) for k, f in fns.items()}, rounds, before=clear_memos)
    return results, {k: median(v) for k, v in times.items()}


def dp_pld(ev: Any, vdi: float = 1e-4) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=vdi)
    acc.compose(ev)
    return acc.get_epsilon(DELTA)


def dp_rdp(ev: Any) -> float:
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(ev)
    return acc.get_epsilon(DELTA)


def optional_baselines() -> dict[str, Callable[[float, float, int], float]]:
    out: dict[str, Callable[[float, float, int], float]] = {}
    try:
        from opacus.accountants import PRVAccountant  # type: ignore

        def opacus_prv(z: float, q: float, t: int) -> float:
            a = PRVAccountant()
            a.history = [(z, q, t)]
            return a.get_epsilon(DELTA)

        out["opacus PRV"] = opacus_prv
    except ImportError:
        pass
    try:
        from prv_accountant import Accountant as PrvAcc  # type: ignore

        def prv(z: float, q: float, t: int) -> float:
            a = PrvAcc(noise_multiplier=z, sampling_probability=q, delta=DELTA,
                       eps_error=0.01, max_compositions=t)
            return a.compute_epsilon(num_compositions=t)[2]

        out["prv_accountant"] = prv
    except ImportError:
        pass
    return out


def row(*cols: Any) -> None:
    print("  ".join(f"{c:>12}" if not isinstance(c, str) else f"{c:<12}" for c in cols))


def ms(t: float) -> str:
    return f"{t * 1e3:.1f}ms" if t < 10 else f"{t:.1f}s"


def w1(rounds: int) -> None:
    print(f"\nW1  Poisson-subsampled Gaussian z=1.1 q=0.01 (privkit AUTO vs dp-accounting), "
          f"median of {rounds} cold calls each, interleaved")
    row("T", "privkit", "dp PLD 1e-4", "dp RDP", "lower bnd", "eps ratio", "t privkit",
        "t dp PLD", "t dp RDP", "vs dp PLD", "vs dp RDP", "load")
    extra = optional_baselines()
    for t in (1000, 10_000, 100_000):
        ev = privkit.gaussian_steps_event(1.1, t, 0.01)
        fns: dict[str, Callable[[], Any]] = {
            "privkit": lambda: privkit.epsilon(ev, DELTA).epsilon,
            "dp PLD": lambda: dp_pld(ev), "dp RDP": lambda: dp_rdp(ev)}
        for name, fn in extra.items():
            fns[name] = lambda fn=fn, t=t: fn(1.1, 0.01, t)  # type: ignore[misc]
        l0 = load()
        r, tm = cold(fns, rounds)
        l1 = load()
        tp, td, tr = tm["privkit"], tm["dp PLD"], tm["dp RDP"]
        eps, e_pld = r["privkit"], r["dp PLD"]
        tight = W1_LOWER[t] <= eps <= e_pld * (1 + 1e-5)
        fast = td / tp >= 10 and tp / tr <= 2
        verdict = "OK" if tight and fast else "MISSED"
        row(t, f"{eps:.5f}", f"{e_pld:.5f}", f"{r['dp RDP']:.4f}", f"{W1_LOWER[t]:.4f}",
            f"{eps / e_pld:.6f}", ms(tp), ms(td), ms(tr), f"{td / tp:.1f}x faster",
            f"{tp / tr:.2f}x its time", f"{l0:.1f}-{l1:.1f} {verdict}")
        SUMMARY.append(f"W1 T={t:<6}: {td / tp:5.1f}x faster than dp PLD ({ms(tp)} vs {ms(td)}), "
                       f"{tp / tr:.2f}x dp RDP's time, eps ratio {eps / e_pld:.7f} "
                       f"[load {l0:.1f}-{l1:.1f}]  {verdict}")
        for name in extra:
            row("", f"{name}: {r[name]:.4f}", ms(tm[name]))
    print("  (privkit AUTO = min(RDP, privkit's PLD, the unsampled exact bound); targets: "
          ">= 10x faster than dp PLD at eps ratio <= 1 + 1e-5, <= 2x dp RDP's time)")


def w2(quick: bool, rounds: int) -> None:
    print("\nW2  Gaussian without subsampling (privkit exact vs dp-accounting PLD), median of "
          f"{rounds} cold calls each (1 each where dp PLD takes ~a minute)")
    row("z", "M", "privkit", "dp PLD", "analytic", "eps ratio", "t privkit", "t dp PLD",
        "speedup", "load")
    speedups = []
    for z in (0.5, 1.0, 2.0):
        for m in (1, 10, 100, 1000):
            ev = privkit.gaussian_steps_event(z, m)
            slow = z * z * 4 < m / 10  # the minute-long dp-accounting cells
            analytic = get_epsilon_gaussian(z / math.sqrt(m), DELTA)
            if quick and slow:
                r, tm = cold({"privkit": lambda: privkit.epsilon(ev, DELTA).epsilon}, rounds)
                row(z, m, f"{r['privkit']:.4f}", "skipped", f"{analytic:.4f}", "",
                    f"{tm['privkit'] * 1e3:.2f}ms")
                continue
            l0 = load()
            r, tm = cold({"privkit": lambda: privkit.epsilon(ev, DELTA).epsilon,
                          "dp PLD": lambda: dp_pld(ev)}, 1 if slow else rounds)
            tp, td = tm["privkit"], tm["dp PLD"]
            speedups.append(td / tp)
            row(z, m, f"{r['privkit']:.4f}", f"{r['dp PLD']:.4f}", f"{analytic:.4f}",
                f"{r['privkit'] / r['dp PLD']:.6f}", f"{tp * 1e3:.2f}ms", ms(td),
                f"{td / tp:.0f}x", f"{l0:.1f}")
    print(f"  min speedup over dp PLD: {min(speedups):.0f}x (target >= 1000x); "
          "privkit exact is never below analytic (it is the analytic value, upper end)")


def w3(rounds: int) -> None:
    print(f"\nW3  pure eps0-DP steps (privkit AUTO for PureDpEvent = optimal composition), "
          f"median of {rounds} cold calls each")
    row("eps0", "k", "privkit", "min(adv,bas)", "basic", "dp PLD Lap", "t privkit", "t dp PLD",
        "load")
    for e0 in (0.1, 1.0):
        for k in (10, 100, 1000):
            ev = privkit.pure_steps_event(e0, k)
            lap = E.SelfComposedDpEvent(E.LaplaceDpEvent(1 / e0), k)
            l0 = load()
            r, tm = cold({"privkit": lambda: privkit.epsilon(ev, DELTA).epsilon,
                          "dp PLD": lambda: dp_pld(lap)}, rounds)
            adv = privkit.epsilon(ev, DELTA, Method.ADVANCED).epsilon
            row(e0, k, f"{r['privkit']:.5f}", f"{adv:.4f}", f"{e0 * k:g}", f"{r['dp PLD']:.4f}",
                f"{tm['privkit'] * 1e3:.2f}ms", ms(tm["dp PLD"]), f"{l0:.1f}")
    print("  (dp PLD Lap prices the 1-D Laplace mechanism only; privkit's optimal bound holds "
          "for any eps0-DP step)")


def w4(rounds: int) -> None:
    print(f"\nW4  calibration: noise multiplier for target eps, q=0.01, T=1e4, median of "
          f"{rounds} cold calls each, interleaved")
    row("target", "privkit z", "PLD check", "dp z", "dp check", "t privkit", "(all runs)",
        "t dp", "speedup", "load")
    for target in (1.0, 8.0):
        def ours(target: float = target) -> Any:
            return privkit.calibrate_noise_multiplier(
                target_epsilon=target, delta=DELTA, steps=10_000, sampling_probability=0.01)

        def dp_cal(target: float = target) -> float:
            return calibrate_dp_mechanism(
                lambda: pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4),
                lambda z: privkit.gaussian_steps_event(z, 10_000, 0.01), target, DELTA,
                LowerEndpointAndGuess(0.3, 1.0), tol=1e-3)

        runs: list[float] = []

        def ours_timed(ours: Callable[[], Any] = ours) -> Any:
            import time

            t0 = time.perf_counter()
            out = ours()
            runs.append(time.perf_counter() - t0)
            return out

        l0 = load()
        r, tm = cold({"privkit": ours_timed, "dp": dp_cal}, rounds)
        l1 = load()
        res, zd = r["privkit"], r["dp"]
        tp, td = tm["privkit"], tm["dp"]
        check = privkit.epsilon(privkit.gaussian_steps_event(res.noise_multiplier, 10_000, 0.01),
                                DELTA, Method.PLD).epsilon
        dcheck = dp_pld(privkit.gaussian_steps_event(zd, 10_000, 0.01))
        ok = "OK" if tp <= 0.25 and res.epsilon <= target else \
            "SLOW" if tp > 0.25 else "FAIL"
        row(target, f"{res.noise_multiplier:.5f}", f"{check:.5f}", f"{zd:.5f}", f"{dcheck:.5f}",
            f"{tp:.3f}s {ok}", f"{min(runs):.3f}-{max(runs):.3f}s", f"{td:.1f}s",
            f"{td / tp:.0f}x", f"{l0:.1f}-{l1:.1f}")
        SUMMARY.append(f"W4 eps={target:<4g}: {tp:.3f} s (runs {min(runs):.3f}-{max(runs):.3f} s;"
                       f" target <= 0.25 s), {td / tp:.0f}x faster than dp-accounting's "
                       f"calibration [load {l0:.1f}-{l1:.1f}]  {ok}")


def w5(rounds: int) -> None:
    print("\nW5  per-client epsilon, 10^4 clients, heterogeneous |D_i| (output perturbation,"
          f" sensitivity tau/|D_i|, 40 odd rounds), median of {rounds} cold calls each")
    rng = np.random.default_rng(0)
    sizes = (rng.lognormal(4, 2, 10_000) + 50).astype(int)
    rounds_ = rng.integers(20, 41, 10_000)
    tau, sigma = 10.0, 0.8
    z = sigma * sizes / tau
    events = [privkit.gaussian_steps_event(float(zi), int(m)) for zi, m in zip(z, rounds_)]
    sub = slice(0, 500)

    def baseline() -> list[float]:
        return [get_epsilon_gaussian(float(zi) / math.sqrt(m), 1e-3)
                for zi, m in zip(z[sub], rounds_[sub])]

    l0 = load()
    r, tm = cold({"privkit": lambda: privkit.epsilon_batch(events, 1e-3), "dp": baseline},
                 rounds)
    eps, ref_arr = r["privkit"], np.array(r["dp"])
    tp, tb = tm["privkit"], tm["dp"]
    tb_full = tb * 10_000 / 500
    err = float(np.max(np.abs(eps[sub] - ref_arr) / np.maximum(ref_arr, 1e-12)))
    print(f"  privkit epsilon_batch: {tp:.3f}s for 10^4 clients (target <= 1 s); "
          f"mean eps {eps.mean():.4f}, max {eps.max():.4f}")
    print(f"  dp-accounting get_epsilon_gaussian loop: {tb:.3f}s for 500 -> ~{tb_full:.1f}s for "
          f"10^4 (speedup ~{tb_full / tp:.0f}x); max rel. difference {err:.2e} [load {l0:.1f}]")


def w6(rounds: int) -> None:
    print("\nW6  heterogeneous composition: 300 rounds at q=0.01 z=1.1, 200 at q=0.05 z=2, "
          f"500 at q=0.002 z=0.9, 5 unsampled z=10 (one client's ledger), median of {rounds} "
          "cold calls each")
    parts = [(0.01, 1.1, 300), (0.05, 2.0, 200), (0.002, 0.9, 500), (1.0, 10.0, 5)]
    ev = E.ComposedDpEvent([
        E.SelfComposedDpEvent(E.GaussianDpEvent(z) if q == 1 else
                              E.PoissonSampledDpEvent(q, E.GaussianDpEvent(z)), n)
        for q, z, n in parts])
    l0 = load()
    r, tm = cold({"privkit": lambda: privkit.epsilon(ev, DELTA).epsilon,
                  "dp PLD": lambda: dp_pld(ev), "dp RDP": lambda: dp_rdp(ev)}, rounds)
    row("", "privkit", "dp PLD 1e-4", "dp RDP", "eps ratio", "t privkit", "t dp PLD",
        "t dp RDP", "load")
    row("", f"{r['privkit']:.5f}", f"{r['dp PLD']:.5f}", f"{r['dp RDP']:.4f}",
        f"{r['privkit'] / r['dp PLD']:.6f}", ms(tm["privkit"]),
        f"{ms(tm['dp PLD'])} ({tm['dp PLD'] / tm['privkit']:.1f}x)", ms(tm["dp RDP"]),
        f"{l0:.1f}")


SUMMARY: list[str] = []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="skip minute-long dp-accounting cells; fewer rounds")
    p.add_argument("--only", choices=["w1", "w2", "w3", "w4", "w5", "w6"], action="append")
    p.add_argument("--busy", action="store_true",
                   help="busy-looping processes beside the whole measurement")
    p.add_argument("--busy-procs", type=int, default=1,
                   help="how many busy-looping processes with --busy (default 1)")
    a = p.parse_args()
    todo = a.only or ["w1", "w2", "w3", "w4", "w5", "w6"]
    rounds = 3 if a.quick else 5
    privkit.epsilon(privkit.gaussian_steps_event(1.1, 100, 0.01), DELTA)  # warm-up: imports
    privkit.calibrate_noise_multiplier(target_epsilon=2.0, delta=DELTA, steps=100,
                                       sampling_probability=0.01)
    dp_pld(privkit.gaussian_steps_event(1.1, 10, 0.01))
    dp_rdp(privkit.gaussian_steps_event(1.1, 10, 0.01))
    print(f"bench/accounting.py: {threads_line()}; "
          f"{f'{a.busy_procs} busy-looping process(es) added' if a.busy else 'no added load'}; "
          f"load average at the start {load():.2f} (other processes count too)")
    print(f"cold calls: before each, privkit's memos are cleared: {', '.join(memos())}")
    with busy(a.busy_procs if a.busy else 0):
        for name in todo:
            {"w1": lambda: w1(rounds), "w2": lambda: w2(a.quick, 3), "w3": lambda: w3(rounds),
             "w4": lambda: w4(1 if a.quick else 3), "w5": lambda: w5(3),
             "w6": lambda: w6(rounds)}[name]()
    if SUMMARY:
        print("\nSummary:")
        for line in SUMMARY:
            print("  " + line)


if __name__ == "__main__":
    main()
