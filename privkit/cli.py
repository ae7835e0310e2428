"""The ``privkit`` command line: epsilon, calibrate, demo.

Errors in arguments print one line naming the argument and exit with status 2.
With ``--json`` stdout is exactly one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from privkit import _validate
from privkit.accountants import Method, epsilon
from privkit.accountants.calibration import calibrate_noise_multiplier
from privkit.errors import PrivkitError
from privkit.events import gaussian_steps_event, pure_steps_event

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _methods() -> list[str]:
    return [m.value for m in Method]


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="privkit", description="Differential privacy for federated learning.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    eps = sub.add_parser("epsilon", help="epsilon for given settings")
    eps_sub = eps.add_subparsers(dest="mechanism", required=True, parser_class=_Parser)
    g = eps_sub.add_parser("gaussian", help="(subsampled) Gaussian steps")
    g.add_argument("--noise-multiplier", type=_number, required=True,
                   help="stddev / L2 sensitivity (z)")
    g.add_argument("--steps", type=_number, required=True, help="number of releases T")
    g.add_argument("--sampling-probability", type=_number, default=1.0,
                   help="Poisson sampling probability q in (0, 1] (default 1: no sampling)")
    g.add_argument("--delta", type=_number, required=True)
    g.add_argument("--method", default="auto", choices=_methods())
    g.add_argument("--json", action="store_true", help="print one JSON object")

    pu = eps_sub.add_parser("pure", help="k-fold composition of epsilon0-DP steps")
    pu.add_argument("--epsilon", type=_number, required=True, help="per-step epsilon0")
    pu.add_argument("--steps", type=_number, required=True, help="number of steps k")
    pu.add_argument("--delta", type=_number, required=True)
    pu.add_argument("--method", default="auto", choices=["auto", "optimal", "advanced", "basic",
                                                          "pld", "rdp"])
    pu.add_argument("--json", action="store_true")

    cal = sub.add_parser("calibrate", help="noise for a target epsilon")
    cal_sub = cal.add_subparsers(dest="mechanism", required=True, parser_class=_Parser)
    cg = cal_sub.add_parser("gaussian", help="noise multiplier for (subsampled) Gaussian steps")
    cg.add_argument("--target-epsilon", type=_number, required=True)
    cg.add_argument("--delta", type=_number, required=True)
    cg.add_argument("--steps", type=_number, required=True)
    cg.add_argument("--sampling-probability", type=_number, default=1.0)
    cg.add_argument("--method", default="auto", choices=_methods())
    cg.add_argument("--json", action="store_true")

    sub.add_parser("demo", help="a table of epsilons for standard settings")
    return p


def _emit(obj: dict[str, Any], as_json: bool, text: str) -> None:
    if as_json:
        print(json.dumps(obj, allow_nan=True))
    else:
        print(text)


def _cmd_epsilon(a: argparse.Namespace) -> None:
    if a.mechanism == "gaussian":
        ev = gaussian_steps_event(a.noise_multiplier, _validate.positive_int("steps", a.steps),
                                  a.sampling_probability)
        settings = {"noise_multiplier": a.noise_multiplier, "steps": int(a.steps),
                    "sampling_probability": a.sampling_probability}
    else:
        ev = pure_steps_event(a.epsilon, _validate.positive_int("steps", a.steps))
        settings = {"epsilon0": a.epsilon, "steps": int(a.steps)}
    r = epsilon(ev, a.delta, a.method)
    out = r.to_dict() | settings
    _emit(out, a.json, str(r))


def _cmd_calibrate(a: argparse.Namespace) -> None:
    r = calibrate_noise_multiplier(target_epsilon=a.target_epsilon, delta=a.delta,
                                   steps=_validate.positive_int("steps", a.steps),
                                   sampling_probability=a.sampling_probability, method=a.method)
    out = {"noise_multiplier": r.noise_multiplier, "epsilon": r.epsilon, "delta": r.delta,
           "method": r.method, "target_epsilon": r.target_epsilon, "steps": int(a.steps),
           "sampling_probability": a.sampling_probability}
    _emit(out, a.json, f"noise_multiplier = {r.noise_multiplier:.6g} "
          f"(verified eps <= {r.epsilon:.6g} at delta={r.delta:.3g}, {r.method})")


def demo_rows() -> list[tuple[str, str, float, str, float]]:
    """(setting, method, epsilon, delta, seconds) rows of the demo table."""
    rows = []
    cases: list[tuple[str, Any, float, list[str]]] = [
        ("DP-SGD z=1.1 q=0.01 T=1e3", gaussian_steps_event(1.1, 1000, 0.01), 1e-5,
         ["auto", "rdp"]),
        ("DP-SGD z=1.1 q=0.01 T=1e4", gaussian_steps_event(1.1, 10_000, 0.01), 1e-5,
         ["auto", "rdp"]),
        ("Gaussian z=1, M=100 (no sampling)", gaussian_steps_event(1.0, 100), 1e-5,
         ["auto", "rdp", "moments"]),
        ("Upcycled-FL Thm C.1: z=17.92, M=40", gaussian_steps_event(17.92, 40), 1e-3,
         ["auto", "moments"]),
        ("pure eps0=1, k=100", pure_steps_event(1.0, 100), 1e-5, ["auto", "basic"]),
        ("pure eps0=0.1, k=1000", pure_steps_event(0.1, 1000), 1e-5,
         ["auto", "advanced", "basic"]),
    ]
    for name, ev, d, methods in cases:
        for m in methods:
            t0 = time.perf_counter()
            r = epsilon(ev, d, m)
            rows.append((name, r.method if m == "auto" else m, r.epsilon, f"{d:g}",
                         time.perf_counter() - t0))
    return rows


def _cmd_demo(_: argparse.Namespace) -> None:
    rows = demo_rows()
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print("privkit demo: epsilon upper bounds for standard settings\n")
    print(f"{'setting':<{w0}}  {'method':<{w1}}  {'delta':>6}  {'epsilon':>10}  {'time':>8}")
    print("-" * (w0 + w1 + 34))
    last = None
    for name, method, eps, d, secs in rows:
        shown = name if name != last else ""
        last = name
        print(f"{shown:<{w0}}  {method:<{w1}}  {d:>6}  {eps:>10.4f}  {secs * 1e3:>6.1f}ms")
    print("\n'auto' is the tightest valid bound; every number is an upper bound on epsilon.")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``privkit`` command."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        commands = {"epsilon": _cmd_epsilon, "calibrate": _cmd_calibrate, "demo": _cmd_demo}
        commands[args.command](args)
    except PrivkitError as exc:
        print(f"privkit: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
