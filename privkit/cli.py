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

This module builds the command line, dispatches and runs ``demo`` and the registered
commands; the command groups are private modules beside it: ``privkit._cli_accounting``
(``epsilon``, ``calibrate``, ``midp``), ``privkit._cli_audit``, ``privkit._cli_ledger``, on
the parser and output of ``privkit._cli_base``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from collections.abc import Sequence
from typing import Any

from privkit._cli_accounting import (
    add_calibrate_parser,
    add_epsilon_parser,
    add_midp_parser,
    run_calibrate,
    run_epsilon,
    run_midp,
)
from privkit._cli_audit import add_audit_parser, run_audit
from privkit._cli_base import HelpFormatter, Parser, add_quiet, emit
from privkit._cli_ledger import add_ledger_parser, run_ledger
from privkit.accountants import epsilon
from privkit.errors import InvalidParameterError, PrivkitError
from privkit.events import gaussian_steps_event, pure_steps_event

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
    p = Parser(prog="privkit", description="Differential privacy for federated learning.",
               epilog="Every command takes --help.\nExit status: 0 on success, 2 for bad "
               "arguments or data (one line on stderr),\n1 for a failed audit or a diverged "
               "run.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                   help="print the version and exit")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars and no non-essential output (so does "
                   "TQDM_DISABLE=1 for the progress bars)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser,
                           metavar="COMMAND")
    add_epsilon_parser(sub)
    add_calibrate_parser(sub)

    demo = sub.add_parser("demo", help="epsilons for standard settings, then a short "
                          "Upcycled-FL vs FedProx vs FedAvg run")
    demo.add_argument("--out", default="runs/demo", help="where the demo run writes its report")
    demo.add_argument("--no-train", action="store_true", help="only the epsilon table")
    demo.add_argument("--json", action="store_true",
                      help="print one JSON object (the epsilon table and the run's final "
                      "results) instead of the tables")
    add_quiet(demo)

    for name, help_text in _PLUGIN_COMMANDS.items():
        command = commands.get(name)
        if command is None or isinstance(command, BaseException):
            sub.add_parser(name, help=f"{help_text} (needs {EXAMPLES_INSTALL})",
                           description=f"Needs the bundled trainers: {EXAMPLES_INSTALL}")
        else:
            command.add_parser(sub, Parser)

    add_audit_parser(sub)
    add_midp_parser(sub)
    add_ledger_parser(sub)
    return p


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
            emit(a.demo_json, True, "")
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
            handlers = {"epsilon": run_epsilon, "calibrate": run_calibrate,
                        "audit": run_audit, "midp": run_midp, "ledger": run_ledger}
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
