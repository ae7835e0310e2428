"""The ``privkit`` command line: epsilon, calibrate, midp, demo, audit, ledger (and train,
report).

Errors in arguments print one line naming the argument (by the flag typed: ``--sigma``, not
the parameter it sets) and exit with status 2; so do data errors and operating-system errors
(an unwritable ``--out``, a missing file: the line names the path).
With ``--json`` stdout is exactly one JSON object. ``privkit audit`` exits with
status 0 when the audit passed and 1 when it found a violation; ``privkit audit run OUT``
(a training run's canary audit, recomputed from ``OUT/audit_scores.json``) likewise: 0 when
its lower bounds are below the accounted epsilon, 1 when one is above.

``train`` and ``report`` (and the training part of ``demo``) come from the bundled trainers,
which privkit never imports: they register themselves in the entry-point group
``privkit.commands`` (see :data:`COMMAND_GROUP`), and this module loads whatever is registered
there. Without the trainers' dependencies those commands print one line saying which extra to
install and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from privkit import _validate
from privkit import audit as _audit
from privkit.accountants import Method, NeighboringRelation, epsilon
from privkit.accountants.accountant import relation_label as epsilon_report_label
from privkit.accountants.calibration import calibrate_noise_multiplier, calibrate_steps
from privkit.accountants.schedule import schedule
from privkit.errors import InvalidParameterError, PrivkitError
from privkit.events import NOISE_MULTIPLIER_NOTE, gaussian_steps_event, pure_steps_event

__all__ = ["main", "version", "COMMAND_GROUP", "EXAMPLES_INSTALL", "EXAMPLES_MODULES",
           "HelpFormatter", "add_quiet"]

COMMAND_GROUP = "privkit.commands"
"""Entry-point group of the subcommands other packages add (the bundled trainers: ``train``,
``report`` and ``demo``). Each entry point loads to an object with ``add_parser(subparsers,
parser_class)`` (None for ``demo``) and ``run(args) -> int``."""

#: How to install the trainers' extra: from a checkout of this project (its distribution,
#: privkit-fl, is not on the package registry; the registry's "privkit" is another project).
EXAMPLES_INSTALL = "pip install -e '.[examples]' from a checkout of privkit"
"""What to run when a command needs the bundled trainers."""

#: This project's distribution name (the import package is ``privkit``).
DISTRIBUTION = "privkit-fl"

EXAMPLES_MODULES = frozenset({"fl_examples", "torch", "sklearn", "matplotlib", "safetensors",
                              "tqdm"})
"""Top-level modules of the bundled trainers and the ``examples`` extra: a command that fails
to import one of them prints one line naming :data:`EXAMPLES_INSTALL` and exits with status 2."""


def _missing_extra(exc: BaseException) -> bool:
    """Whether ``exc`` is a module of :data:`EXAMPLES_MODULES` that is not installed."""
    name = getattr(exc, "name", None)
    return isinstance(exc, ModuleNotFoundError) and isinstance(name, str) \
        and name.split(".")[0] in EXAMPLES_MODULES


#: Commands whose parser and implementation come from :data:`COMMAND_GROUP` (with the help
#: shown when they are missing).
_PLUGIN_COMMANDS = {"train": "run a bundled FL trainer", "report": "summaries across "
                    "finished runs"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help (``(default: ...)``, left out where the help already
    says it or there is none to say), and descriptions and epilogs shown as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower() or any(
                action.default is x for x in (None, False, argparse.SUPPRESS)) \
                or action.nargs == 0:
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """Also record, as ``_flags``, the options of the innermost (sub)command parsed: dest
        -> the flag (errors name the flag the user typed)."""
        ns, rest = super().parse_known_args(args, namespace)
        if "_flags" not in vars(ns):
            ns._flags = {a.dest: _flag_of(a) for a in self._actions
                         if a.option_strings and a.dest != "help"}
        return ns, rest


def _flag_of(action: argparse.Action) -> str:
    """The flag an error names: an action's canonical spelling (``privkit_canonical``, when
    it also answers to older ones), else its longest (``--quiet`` rather than ``-q``)."""
    return str(getattr(action, "privkit_canonical", None)
               or max(action.option_strings, key=len))


def error_line(exc: BaseException, args: argparse.Namespace | None = None) -> str:
    """The one line a command prints for ``exc``: a bad parameter named by its flag (through
    ``args._flags`` and, for parameters named otherwise than their flag, ``args._aliases``),
    an operating-system error with its path."""
    if isinstance(exc, InvalidParameterError):
        flags, aliases = getattr(args, "_flags", {}), getattr(args, "_aliases", {})
        flag = flags.get(aliases.get(exc.name, exc.name))
        if flag is not None:
            return f"{flag} must be {exc.requirement}, got {exc.value!r}"
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc) or type(exc).__name__
        where = exc.filename if exc.filename is not None else None
        if where is not None and exc.filename2 is not None:
            where = f"{where} -> {exc.filename2}"
        return f"{where}: {what}" if where is not None else what
    return " ".join(str(exc).split("\n"))


def version() -> str:
    """privkit's version: the installed distribution's, else ``privkit.__version__``."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        import privkit

        return str(getattr(privkit, "__version__", "unknown"))


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _integer_or_number(text: str) -> int | float:
    try:
        return int(text)  # exact for large seeds
    except ValueError:
        return _number(text)  # validated (and named) by the command


def _methods() -> list[str]:
    """The methods that price Gaussian steps (the pure-DP ones are ``epsilon pure``'s)."""
    return [m.value for m in Method if m.value not in ("optimal", "advanced", "basic")]


def _check_gaussian_method(method: str, sampling_probability: float | None) -> None:
    """exact and moments price Gaussian steps without sampling: say so naming --method."""
    if method in ("exact", "moments") and (sampling_probability is None
                                           or sampling_probability < 1):
        q = "" if sampling_probability is None else f"q = {sampling_probability:g}; "
        raise InvalidParameterError(
            "method", method, "auto, pld, pld-fft or rdp when steps are sampled "
            f"({q}{method} prices Gaussian steps without sampling)")


_DELTA_HELP = "the delta in (0, 1) the epsilon holds at"
_METHOD_HELP = ("accounting method: exact, pld / pld-fft (privacy-loss distributions), rdp, "
                "moments; auto: the tightest valid bound")


def add_quiet(parser: argparse.ArgumentParser) -> None:
    """``--quiet`` after a command (the same as ``privkit --quiet COMMAND``)."""
    parser.add_argument("--quiet", "-q", action="store_true", default=argparse.SUPPRESS,
                        help="no progress bars and no non-essential output (as privkit "
                        "--quiet)")


_add_quiet = add_quiet

_RELATIONS = {"add-remove": "ADD_OR_REMOVE_ONE", "replace-one": "REPLACE_ONE",
              "zero-out": "REPLACE_SPECIAL"}


def _add_relation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--relation", default="add-remove", choices=list(_RELATIONS),
        help="neighbouring relation to price under: add-remove (one record added or removed; "
        "sensitivity C), zero-out (one record replaced by a null one that contributes "
        "nothing; C) or replace-one (one record replaced by another; 2C). "
        "--noise-multiplier is stddev / C (C the clip norm) under every relation, as in "
        "Opacus and dp-accounting's PLD")


def _add_schedule(parser: argparse.ArgumentParser, *, steps: bool) -> None:
    """The run's length (``--steps`` or ``--epochs``) and its sampling probability
    (``--sampling-probability`` or ``--batch-size`` with ``--dataset-size``)."""
    if steps:
        length = parser.add_mutually_exclusive_group(required=True)
        length.add_argument("--steps", type=_integer_or_number, help="number of releases T")
        length.add_argument("--epochs", type=_number,
                            help="passes over the data instead of --steps (Opacus style)")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--sampling-probability", type=_number, default=None,
                      help="Poisson sampling probability q in (0, 1] (default 1: no sampling, "
                      "or batch size / dataset size)")
    rate.add_argument("--batch-size", type=_integer_or_number,
                      help="expected batch size B (Poisson sampling at q = B / N; needs "
                      "--dataset-size)")
    parser.add_argument("--dataset-size", type=_integer_or_number,
                        help="number of records N (with --batch-size)")


def _load_commands() -> dict[str, Any]:
    """name -> the loaded entry point of :data:`COMMAND_GROUP`, or the ImportError loading
    it raised (the trainers' dependencies are not installed)."""
    found: dict[str, Any] = {}
    for ep in importlib.metadata.entry_points(group=COMMAND_GROUP):
        try:
            found[ep.name] = ep.load()
        except ImportError as exc:
            found[ep.name] = exc
    return found


def _needs_examples(command: str, exc: BaseException | None = None) -> int:
    """One line on stderr: ``command`` needs the bundled trainers' extra; exit status 2."""
    missing = getattr(exc, "name", None)
    detail = f" (missing module {missing!r})" if missing else ""
    print(f"privkit: {command!r} needs the bundled trainers: {EXAMPLES_INSTALL}{detail}",
          file=sys.stderr)
    return 2


def _build_parser(commands: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    commands = _load_commands() if commands is None else commands
    p = _Parser(prog="privkit", description="Differential privacy for federated learning.",
                epilog="Every command takes --help.\nExit status: 0 on success, 2 for bad "
                "arguments or data (one line on stderr),\n1 for a failed audit or a diverged "
                "run.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                   help="print the version and exit")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars and no non-essential output (so does "
                   "TQDM_DISABLE=1 for the progress bars)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser,
                           metavar="COMMAND")

    eps = sub.add_parser("epsilon", help="epsilon for given settings")
    eps_sub = eps.add_subparsers(dest="mechanism", required=True, parser_class=_Parser)
    g = eps_sub.add_parser(
        "gaussian", help="(subsampled) Gaussian steps",
        description="The epsilon of a run of (Poisson-subsampled) Gaussian steps at noise "
        "multiplier z (stddev / sensitivity under --relation), given by --steps or by "
        "--epochs, exactly as 'privkit calibrate gaussian' takes them (one epoch is "
        "ceil(N / B) steps with --batch-size B and --dataset-size N, ceil(1 / q) with "
        "--sampling-probability q; rounded up).")
    g.add_argument("--noise-multiplier", type=_number, required=True,
                   help="stddev / L2 sensitivity (z)")
    _add_schedule(g, steps=True)
    g.add_argument("--delta", type=_number, required=True, help=_DELTA_HELP)
    g.add_argument("--method", default="auto", choices=_methods(), help=_METHOD_HELP)
    _add_relation(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")

    pu = eps_sub.add_parser("pure", help="k-fold composition of epsilon0-DP steps")
    pu.add_argument("--epsilon", type=_number, required=True, help="per-step epsilon0")
    pu.add_argument("--steps", type=_integer_or_number, required=True, help="number of steps k")
    pu.add_argument("--delta", type=_number, required=True, help=_DELTA_HELP)
    pu.add_argument("--method", default="auto", choices=["auto", "optimal", "advanced", "basic",
                                                          "pld", "rdp"],
                    help="optimal, advanced or basic composition, a PLD or RDP; auto: the "
                    "tightest")
    pu.add_argument("--json", action="store_true", help="print one JSON object")

    cal = sub.add_parser("calibrate", help="noise (or steps) for a target epsilon")
    cal_sub = cal.add_subparsers(dest="mechanism", required=True, parser_class=_Parser)
    cg = cal_sub.add_parser(
        "gaussian", help="noise multiplier for (subsampled) Gaussian steps",
        description="The smallest noise multiplier z (stddev / sensitivity under --relation) "
        "whose verified epsilon is at most the target, for a run given by --steps or by "
        "--epochs (one epoch is ceil(N / B) steps with --batch-size B and --dataset-size N, "
        "ceil(1 / q) with --sampling-probability q; rounded up).")
    cg.add_argument("--target-epsilon", type=_number, required=True,
                    help="the epsilon the noise must reach (the result never exceeds it)")
    cg.add_argument("--delta", type=_number, required=True, help=_DELTA_HELP)
    _add_schedule(cg, steps=True)
    cg.add_argument("--method", default="auto", choices=_methods(),
                    help=_METHOD_HELP + " (it both solves and verifies)")
    _add_relation(cg)
    cg.add_argument("--json", action="store_true", help="print one JSON object")
    cs = cal_sub.add_parser(
        "steps", help="the most (subsampled) Gaussian steps within a target epsilon",
        description="The largest number of steps at noise multiplier z (stddev / sensitivity "
        "under --relation) whose verified epsilon is at most the target, and the epochs they "
        "make.")
    cs.add_argument("--noise-multiplier", type=_number, required=True,
                    help="stddev / L2 sensitivity (z)")
    cs.add_argument("--target-epsilon", type=_number, required=True,
                    help="the epsilon the steps must stay within")
    cs.add_argument("--delta", type=_number, required=True, help=_DELTA_HELP)
    _add_schedule(cs, steps=False)
    cs.add_argument("--method", default="auto", choices=_methods(), help=_METHOD_HELP)
    _add_relation(cs)
    cs.add_argument("--json", action="store_true", help="print one JSON object")

    demo = sub.add_parser("demo", help="epsilons for standard settings, then a short "
                          "Upcycled-FL vs FedProx vs FedAvg run")
    demo.add_argument("--out", default="runs/demo", help="where the demo run writes its report")
    demo.add_argument("--no-train", action="store_true", help="only the epsilon table")
    demo.add_argument("--json", action="store_true",
                      help="print one JSON object (the epsilon table and the run's final "
                      "results) instead of the tables")
    _add_quiet(demo)

    for name, help_text in _PLUGIN_COMMANDS.items():
        command = commands.get(name)
        if command is None or isinstance(command, BaseException):
            sub.add_parser(name, help=f"{help_text} (needs {EXAMPLES_INSTALL})",
                           description=f"Needs the bundled trainers: {EXAMPLES_INSTALL}")
        else:
            command.add_parser(sub, _Parser)

    au = sub.add_parser(
        "audit", help="statistical audit: empirical lower bound on a mechanism's epsilon "
        "(or recompute a training run's)",
        description="Run a real privkit mechanism on neighbouring inputs and compare an "
        "empirical lower bound on its epsilon (confidence 1 - 1e-3) with its claim; or, with "
        "'run OUT', recompute the audit of a training run from OUT/audit_scores.json (what "
        "privkit train ... --audit-canaries M saved) and print its lines again.",
        epilog="exit status: 0 if the audit passed (lower bound <= claim), 1 if it found a "
        "violation, 2 for bad arguments (for 'run': a missing or malformed scores file, "
        "named).")
    au.add_argument("mechanism", choices=[*_audit.ALL_MECHANISMS, "run"],
                    help="gaussian: GDP trade-off audit of GaussianOutputPerturbation; "
                    "objective: ObjectivePerturbation on a 1-parameter GLM; laplace-l2 / "
                    "laplace-l1: LaplaceGradientNoise (d = 2) with that noise shape; rec: "
                    "Renyi-2 audit of the REC encoder; coded: mutual-information audit of SCFL's "
                    "coded upload; run: a training run's canary audit, recomputed from OUT")
    au.add_argument("out", nargs="?", default=None, metavar="OUT",
                    help="with run: the run's output directory (or its audit_scores.json)")
    au.add_argument("--trials", type=_number, default=None,
                    help="draws per neighbour (per half for threshold audits; default 1e5)")
    au.add_argument("--noise-scale", type=_number, default=None,
                    help="factor on the noise; < 1 builds a deliberately broken mechanism "
                    "(default 1)")
    au.add_argument("--seed", type=_integer_or_number, default=None,
                    help="integer seed for a reproducible run (default: fresh entropy)")
    au.add_argument("--json", action="store_true", help="print one JSON object")
    _add_midp_parser(sub)
    _add_ledger_parser(sub)
    return p


def _emit(obj: dict[str, Any], as_json: bool, text: str) -> None:
    if as_json:
        print(json.dumps(obj, allow_nan=True))
    else:
        print(text)


def _cmd_epsilon(a: argparse.Namespace) -> None:
    run = ""
    if a.mechanism == "gaussian":
        sched = schedule(steps=a.steps, epochs=a.epochs,
                         sampling_probability=a.sampling_probability,
                         batch_size=a.batch_size, dataset_size=a.dataset_size)
        _check_gaussian_method(a.method, sched.sampling_probability)
        ev = gaussian_steps_event(a.noise_multiplier, sched.steps, sched.sampling_probability)
        settings = {"noise_multiplier": a.noise_multiplier, "steps": sched.steps,
                    "sampling_probability": sched.sampling_probability, "relation": a.relation,
                    "noise_multiplier_note": NOISE_MULTIPLIER_NOTE}
        if a.epochs is not None:
            settings["epochs"] = a.epochs
        if a.epochs is not None or a.batch_size is not None:
            run = f"; {sched.steps} steps at q={sched.sampling_probability:.6g}"
    else:
        ev = pure_steps_event(a.epsilon, _validate.positive_int("steps", a.steps))
        settings = {"epsilon0": a.epsilon, "steps": int(a.steps)}
    relation = getattr(a, "relation", "add-remove")
    r = epsilon(ev, a.delta, a.method,
                neighboring_relation=NeighboringRelation[_RELATIONS[relation]])
    out = r.to_dict() | settings
    first, *rest = r.summary().split("\n")  # the run's steps end the first line, as in calibrate
    text = "\n".join([first + run, *rest])
    if a.mechanism == "gaussian":
        text += f"\n  - {NOISE_MULTIPLIER_NOTE}"
    _emit(out, a.json, text)


def _cmd_calibrate(a: argparse.Namespace) -> None:
    relation = NeighboringRelation[_RELATIONS[a.relation]]
    rel_note = "" if a.relation == "add-remove" else \
        f"; neighbouring relation: {epsilon_report_label(relation.name)}"
    if a.batch_size is not None or (a.sampling_probability or 1.0) < 1:
        _check_gaussian_method(a.method, a.sampling_probability)
    if a.mechanism == "steps":
        s = calibrate_steps(noise_multiplier=a.noise_multiplier, target_epsilon=a.target_epsilon,
                            delta=a.delta, sampling_probability=a.sampling_probability,
                            batch_size=a.batch_size, dataset_size=a.dataset_size,
                            method=a.method, neighboring_relation=relation)
        out = {"steps": s.steps, "epochs": s.epochs, "epsilon": s.epsilon, "delta": s.delta,
               "method": s.method, "target_epsilon": s.target_epsilon,
               "noise_multiplier": a.noise_multiplier,
               "sampling_probability": s.sampling_probability, "relation": a.relation,
               "noise_multiplier_note": NOISE_MULTIPLIER_NOTE}
        run = (f"; {s.epochs:.6g} epochs at q={s.sampling_probability:.6g}"
               if s.sampling_probability < 1 else "")
        _emit(out, a.json, f"steps = {s.steps} (verified eps <= {s.epsilon:.6g} at "
              f"delta={s.delta:.3g}, {s.method}{rel_note}){run}\n  - {NOISE_MULTIPLIER_NOTE}")
        return
    r = calibrate_noise_multiplier(target_epsilon=a.target_epsilon, delta=a.delta,
                                   steps=a.steps, epochs=a.epochs,
                                   sampling_probability=a.sampling_probability,
                                   batch_size=a.batch_size, dataset_size=a.dataset_size,
                                   method=a.method, neighboring_relation=relation)
    out = {"noise_multiplier": r.noise_multiplier, "epsilon": r.epsilon, "delta": r.delta,
           "method": r.method, "target_epsilon": r.target_epsilon, "steps": r.steps,
           "sampling_probability": r.sampling_probability, "relation": a.relation,
           "noise_multiplier_note": NOISE_MULTIPLIER_NOTE}
    if a.epochs is not None:
        out["epochs"] = a.epochs
    run = (f"; {r.steps} steps at q={r.sampling_probability:.6g}" if a.epochs is not None
           or a.batch_size is not None else "")
    _emit(out, a.json, f"noise_multiplier = {r.noise_multiplier:.6g} "
          f"(verified eps <= {r.epsilon:.6g} at delta={r.delta:.3g}, {r.method}{rel_note})"
          f"{run}\n  - {NOISE_MULTIPLIER_NOTE}")


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


def _examples_missing(name: str, commands: dict[str, Any]) -> BaseException | None:
    """Why the registered command ``name`` cannot run (its entry point did not load, or a
    module of the examples extra is not installed), or None. Looks modules up without
    importing them."""
    import importlib.util

    command = commands.get(name)
    if command is None or isinstance(command, BaseException):
        return command if isinstance(command, BaseException) else ModuleNotFoundError(
            "No module named 'fl_examples'", name="fl_examples")
    for module in sorted(EXAMPLES_MODULES):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a finder that refuses it, or a None module
            found = False
        if not found:
            return ModuleNotFoundError(f"No module named {module!r}", name=module)
    return None


def _cmd_demo(a: argparse.Namespace, commands: dict[str, Any]) -> int:
    # the training part needs the examples extra: say so at once, before any table
    missing = None if a.no_train else _examples_missing("demo", commands)
    if missing is not None:
        return _needs_examples("demo", missing)
    rows = demo_rows()
    if a.json:
        a.demo_json = {"epsilons": [
            {"setting": name, "method": method, "delta": float(d), "epsilon": eps,
             "seconds": secs} for name, method, eps, d, secs in rows], "training": None}
        code = 0 if a.no_train else _run_command("demo", a, commands)
        if code == 0:
            _emit(a.demo_json, True, "")
        return code
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    if not a.quiet:
        print("privkit demo: epsilon upper bounds for standard settings\n")
    print(f"{'setting':<{w0}}  {'method':<{w1}}  {'delta':>6}  {'epsilon':>10}  {'time':>8}")
    print("-" * (w0 + w1 + 34))
    last = None
    for name, method, eps, d, secs in rows:
        shown = name if name != last else ""
        last = name
        print(f"{shown:<{w0}}  {method:<{w1}}  {d:>6}  {eps:>10.4f}  {secs * 1e3:>6.1f}ms")
    if not a.quiet:
        print("\n'auto' is the tightest valid bound; every number is an upper bound on epsilon.")
    if a.no_train:
        return 0
    return _run_command("demo", a, commands)


def _run_command(name: str, a: argparse.Namespace, commands: dict[str, Any]) -> int:
    """Run the registered command ``name``; one line and status 2 if the trainers (or one of
    their dependencies) are missing."""
    command = commands.get(name)
    if command is None or isinstance(command, BaseException):
        return _needs_examples(name, command)
    try:
        return int(command.run(a) or 0)
    except ModuleNotFoundError as exc:  # e.g. torch: installed without the examples extra
        if not _missing_extra(exc):
            raise
        return _needs_examples(name, exc)


def _cmd_audit(a: argparse.Namespace) -> int:
    if a.mechanism == "run":
        return _cmd_audit_run(a)
    if a.out is not None:
        raise InvalidParameterError("OUT", a.out, f"given only with 'privkit audit run' (not "
                                    f"with {a.mechanism})")
    r = _audit.audit(a.mechanism, trials=a.trials,
                     noise_scale=1.0 if a.noise_scale is None else a.noise_scale, seed=a.seed)
    out = r.to_dict()
    verdict = "PASSED (no violation found)" if r.passed else "FAILED (privacy claim violated)"
    det = r.details
    if "d2_claimed" in det:
        claim = (f"claimed Renyi divergence D_{det['renyi_order']} <= {det['d2_claimed']:.4f} "
                 f"(K = {det['num_candidates']}, C/sigma = {det['c']:g})")
        found = f"empirical lower bound D_{det['renyi_order']} >= {det['d2_lower']:.4f}"
    elif "mi_dp_claimed_nats" in det:
        claim = (f"claimed MI-DP I(record; upload) <= {det['mi_dp_claimed_nats']:.4f} nats "
                 f"(c = {det['num_coded_rows']}, sigma = {det['stddev_claimed']:g}, "
                 f"rho = {det['row_l2_bound']:g}, d = 1; not an epsilon)")
        found = f"empirical lower bound I >= {det['mi_lower_nats']:.4f} nats"
    elif "gdp_mu_claimed" in det:
        claim = (f"claimed gdp_mu = {det['gdp_mu_claimed']:.4f} (eps = {r.claimed_epsilon:.4f} "
                 f"at delta = {det['delta']:g})")
        found = (f"empirical lower bound gdp_mu >= {det['gdp_mu_lower']:.4f} "
                 f"(eps >= {r.empirical_epsilon_lower:.4f})")
    else:
        claim = f"claimed eps = {r.claimed_epsilon:.4f} (pure DP)"
        found = f"empirical lower bound eps >= {r.empirical_epsilon_lower:.4f}"
    text = (f"privkit audit {r.mechanism}: {verdict}\n"
            f"  {claim}; {found} at confidence 1 - {det['alpha']:g}\n"
            f"  {r.trials} draws per neighbour{' per half' if 'orientation' in det else ''}, "
            f"noise_scale = {r.noise_scale:g}, "
            f"seed = {det['seed'] if det['seed'] is not None else det['seed_entropy']}, "
            f"{det['seconds']:.2f}s")
    _emit(out, a.json, text)
    return 0 if r.passed else 1


def _cmd_audit_run(a: argparse.Namespace) -> int:
    """``privkit audit run OUT``: the run's audit recomputed from its saved scores (the same
    line its trainer printed, then each bound); 0 consistent, 1 a bound above the accounted
    epsilon, 2 a missing or malformed scores file (the error names its path)."""
    from pathlib import Path

    from privkit.audit.runs import SCHEMA, SCORES_FILE

    for dest in ("trials", "noise_scale", "seed"):
        if getattr(a, dest) is not None:
            raise InvalidParameterError(dest, getattr(a, dest), "left out with 'privkit audit "
                                        "run' (a mechanism audit's setting)")
    if a.out is None:
        raise InvalidParameterError("OUT", None, "given: the run's output directory (privkit "
                                    "audit run OUT)")
    path = Path(a.out)
    file = path / SCORES_FILE if path.is_dir() else path
    try:
        result = _audit.recompute(file)
    except InvalidParameterError as exc:
        if exc.name == "path":
            raise
        raise InvalidParameterError("path", str(file), f"an audit scores file of schema "
                                    f"{SCHEMA} ({exc})") from None
    out = {"path": str(file), "line": result.summary(), **result.to_dict()}
    _emit(out, a.json, "\n".join([result.summary(), *result.lines()]))
    return 1 if result.exceeded else 0


# ------------------------------------------------------------------ privkit midp
def _add_midp_parser(sub: Any) -> None:
    """``privkit midp coded``: MI-DP (nats) of one client's SCFL coded upload."""
    mi = sub.add_parser("midp", help="mutual-information DP (nats) of a release; not an epsilon")
    mi_sub = mi.add_subparsers(dest="mechanism", required=True, parser_class=_Parser)
    c = mi_sub.add_parser(
        "coded", help="SCFL coded upload G X + sigma N (and G Y + sigma_y N_y)",
        description="MI-DP upper bound (Cuff-Yu, nats) of one client's one-time coded upload. "
        "It covers the coded upload only (SCFL's per-epoch client gradients are unprotected) "
        "and implies only (0, sqrt(2 nats))-DP: it is not an epsilon.")
    c.add_argument("--rows", type=_number, required=True, help="c, number of coded rows")
    c.add_argument("--noise-stddev", type=_number, required=True,
                   help="sigma, absolute stddev of the feature noise (0: no privacy)")
    c.add_argument("--norm-bound", type=_number, required=True,
                   help="rho, L2 bound the feature rows are clipped to (bias column included)")
    c.add_argument("--dim", type=_number, required=True, help="d, number of feature columns")
    c.add_argument("--label-dim", type=_number, default=0,
                   help="o, label columns uploaded as G Y (+ noise); 0 (default): no labels")
    c.add_argument("--label-noise-stddev", type=_number, default=None,
                   help="sigma_y (default: sigma); 0 is the paper's noiseless labels")
    c.add_argument("--label-norm-bound", type=_number, default=None,
                   help="rho_y, labels' L2 bound (one-hot: 1; required for continuous labels)")
    c.add_argument("--label-kind", default="one-hot", choices=["one-hot", "continuous"],
                   help="one-hot (categorical, default) or continuous labels")
    c.add_argument("--bits", action="store_true", help="print bits instead of nats (text)")
    c.add_argument("--json", action="store_true", help="print one JSON object")


def _cmd_midp(a: argparse.Namespace) -> None:
    from privkit.accountants.midp import CodedDataMiEvent, LabelMode, midp_coded_release

    o = _validate.nonnegative_int("label_dim", a.label_dim)
    categorical = a.label_kind == "one-hot"
    sigma = _validate.nonnegative("noise_stddev", a.noise_stddev)
    if o == 0:
        for name in ("label_noise_stddev", "label_norm_bound"):
            if getattr(a, name) is not None:
                raise InvalidParameterError(name, getattr(a, name), "used with --label-dim >= 1")
        mode, sy, ry = LabelMode.NONE, 0.0, None
    else:
        sy = sigma if a.label_noise_stddev is None else _validate.nonnegative(
            "label_noise_stddev", a.label_noise_stddev)
        mode = LabelMode.NOISY if sy > 0 else LabelMode.PAPER_NOISELESS
        if categorical:
            if a.label_norm_bound not in (None, 1.0):
                raise InvalidParameterError("label_norm_bound", a.label_norm_bound,
                                            "1 (or omitted) for one-hot labels")
            ry = 1.0
        else:
            ry = (None if a.label_norm_bound is None
                  else _validate.positive("label_norm_bound", a.label_norm_bound))
            if ry is None and mode is LabelMode.NOISY:
                raise InvalidParameterError("label_norm_bound", None,
                                            "given for continuous labels with label noise")
    ev = CodedDataMiEvent(
        num_coded_rows=_validate.positive_int("rows", a.rows), stddev=sigma,
        row_l2_bound=_validate.positive("norm_bound", a.norm_bound),
        dim=_validate.positive_int("dim", a.dim), label_mode=mode, label_stddev=sy,
        label_l2_bound=ry, label_dim=o, categorical_labels=categorical and o > 0)
    r = midp_coded_release(ev)
    out = r.to_dict() | {"rows": ev.num_coded_rows, "noise_stddev": sigma,
                         "norm_bound": ev.row_l2_bound, "dim": ev.dim, "label_dim": o,
                         "label_noise_stddev": sy, "label_norm_bound": ry,
                         "label_kind": a.label_kind if o else None}
    value = f"{r.bits:.6g} bits" if a.bits else f"{r.nats:.6g} nats"
    flag = "  [labels fully disclosed]" if r.labels_fully_disclosed else ""
    tv = out["implied_tv_delta"]
    implied = (f"implies only (0, {tv:.3g})-DP" if tv < 1
               else "implies no (epsilon, delta)-DP guarantee (sqrt(2 nats) >= 1)")
    text = (f"MI-DP <= {value} per record  [{r.method}]{flag}\n"
            f"  label mode: {r.label_mode.value}; covers: {r.covers}\n"
            f"  average-case (Cuff-Yu); {implied}; not an epsilon")
    _emit(out, a.json, text)


# ---------------------------------------------------------------- privkit ledger
def _add_ledger_parser(sub: Any) -> None:
    """``privkit ledger verify`` and ``privkit ledger recover``."""
    le = sub.add_parser("ledger", help="verify a ledger journal, or recover one that lost "
                        "committed entries")
    le_sub = le.add_subparsers(dest="action", required=True, parser_class=_Parser)
    v = le_sub.add_parser(
        "verify", help="open (verify chains and head record) and summarise",
        description="Open a ledger journal: every hash chain, sequence number and event is "
        "verified, and the journal must hold every entry its head record (PATH.head) says was "
        "committed. Exit status 0 if it opens, 2 if not. Set PRIVKIT_LEDGER_KEY or "
        "PRIVKIT_LEDGER_KEY_FILE for a ledger whose head record is authenticated.")
    v.add_argument("path", metavar="PATH", help="the journal (e.g. OUT/ledger-upcycled.jsonl)")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    r = le_sub.add_parser(
        "recover", help="continue a journal that disagrees with its head record, as it is",
        description="For a journal that is behind its head record (entries lost by a restore "
        "from backup, a cut, a deleted batch) or disagrees with it otherwise: continue from "
        "the journal as it is. The lost spend is not restored; a recover entry (the problem, "
        "the head record found, the reason, the time) is appended and the head record moved "
        "to it. Refused when there is nothing to recover.")
    r.add_argument("path", metavar="PATH", help="the journal")
    r.add_argument("--accept-rollback", action="store_true",
                   help="required: accept that the spend the journal lost is forgotten")
    r.add_argument("--reason", default="accepted with privkit ledger recover --accept-rollback",
                   help="why (recorded in the recover entry)")
    r.add_argument("--json", action="store_true", help="print one JSON object")


def _cmd_ledger(a: argparse.Namespace) -> None:
    from privkit.ledger import Ledger

    if a.action == "recover":
        if not a.accept_rollback:
            raise InvalidParameterError(
                "accept_rollback", False, "given: recovery continues from the journal as it "
                "is and forgets the spend its head record says was committed")
        led = Ledger.recover(a.path, reason=a.reason)
    else:
        led = Ledger.open(a.path)
    rep = led.report()
    head = led.head()
    out = {"path": led.path, "population_id": led.population_id, "head_seq": head.seq,
           "head_hash": head.hash, "clients": len(rep.client_ids), "epsilon_max": rep.max,
           "epsilon_mean": rep.mean, "delta": led.delta, "method": led.method.value,
           "epsilon_budget": led.epsilon_budget, "discarded_bytes": led.discarded_bytes,
           "head_note": led.head_note}
    verb = "recovered" if a.action == "recover" else "verified"
    text = (f"{led.path}: {verb}: head seq {head.seq} ({head.hash[:12]}...), "
            f"{len(rep.client_ids)} clients, epsilon max {rep.max:.6g} mean {rep.mean:.6g} at "
            f"delta={led.delta:g} [{led.method.value}]"
            + (f"\n  {led.head_note}" if led.head_note else ""))
    _emit(out, a.json, text)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``privkit`` command.

    Returns 0 on success, 2 for bad arguments, and for ``audit`` 1 when the
    audit found a violation.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except ModuleNotFoundError as exc:  # a missing extra raised outside a command's run
        if not _missing_extra(exc):
            raise
        command = next((x for x in argv if not x.startswith("-")), "privkit")
        return _needs_examples(command, exc)


def _main(argv: list[str]) -> int:
    plugins = _load_commands()
    if argv and argv[0] in _PLUGIN_COMMANDS:
        command = plugins.get(argv[0])
        if command is None or isinstance(command, BaseException):
            return _needs_examples(argv[0], command)
    parser = _build_parser(plugins)
    if not argv:  # bare ``privkit``: the usage and the commands, not only "required: command"
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        if args.command in _PLUGIN_COMMANDS:
            code = _run_command(args.command, args, plugins)
        elif args.command == "demo":
            code = _cmd_demo(args, plugins)
        else:
            handlers = {"epsilon": _cmd_epsilon, "calibrate": _cmd_calibrate,
                        "audit": _cmd_audit, "midp": _cmd_midp, "ledger": _cmd_ledger}
            code = handlers[args.command](args) or 0
    except (PrivkitError, OSError) as exc:  # bad input, data or path: one line naming it
        print(f"privkit: error: {error_line(exc, args)}", file=sys.stderr)
        return 2
    except FloatingPointError as exc:  # a trainer diverged: a run failure, not a bad argument
        print(f"privkit: error: {error_line(exc)}", file=sys.stderr)
        return 1
    return code or 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
