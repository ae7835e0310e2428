"""One module per ``privkit train <name>`` command.

Each module defines ``NAME``, ``HELP``, ``DESCRIPTION``, ``add_arguments(parser)`` and
``run(args) -> int``, and imports nothing heavy (torch, the trainer) at module level, so
building the CLI parser stays fast. :func:`fl_examples.cli.add_train_parser` finds the
modules here by name; adding a trainer command means adding a module, nothing else. Every
command also gets ``--threads`` (torch CPU threads, default
:data:`fl_examples.cli.DEFAULT_THREADS`, one).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

__all__ = ["OUT_HELP", "command_modules", "default_out", "nonnegative_int", "positive_int",
           "VOCABULARY", "noted", "split_algorithms"]

#: One vocabulary for the same concept in every trainer: concept -> (flag, what it means).
#: The trainers' older spellings still work and print a one-line note (:func:`noted`).
VOCABULARY = {
    "run length": ("--rounds", "upcycled: iterations (odd and even); mapa: applied cloud "
                   "updates; scfl: epochs; dprec: rounds"),
    "algorithms": ("--algorithms", "comma-separated, the first is the main one"),
    "clients": ("--clients", "the number of clients (mapa: edge servers)"),
    "clip": ("--clip", "the L2 clip norm of what the privacy model clips (a model, an "
             "update or each example's gradient)"),
    "noise multiplier": ("--noise-multiplier", "noise stddev over the clip norm's "
                         "sensitivity"),
    "epsilon target": ("--noise-for-epsilon", "calibrate the noise so the run ends at this "
                       "epsilon (the clients' max)"),
    "delta": ("--delta", "the delta of every epsilon"),
}

#: The ``--out`` help every trainer command shares.
OUT_HELP = ("output directory (report.json, plots, ledgers, checkpoints); new or empty unless "
            "--resume or --overwrite (default: runs/<trainer>-<local time>, a new directory; "
            "--resume needs it given)")


def default_out(trainer: str, now: float | None = None) -> str:
    """``runs/<trainer>-YYYYmmdd-HHMMSS`` (local time), with ``-2``, ``-3``, ... when that
    directory exists already (two runs started in the same second)."""
    import time
    from pathlib import Path

    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = f"runs/{trainer}-{stamp}"
    path, k = base, 2
    while Path(path).exists():
        path, k = f"{base}-{k}", k + 1
    return path


def command_modules() -> list[ModuleType]:
    """The command modules, in a stable order (upcycled first, then by name)."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    names.sort(key=lambda n: n != "upcycled")
    return [importlib.import_module(f"{__name__}.{n}") for n in names]


def nonnegative_int(name: str, value: float) -> int:
    """An integer option given as a number (``1e3`` accepted), checked and named in errors."""
    from privkit import _validate

    return _validate.nonnegative_int(name, value)


def positive_int(name: str, value: float) -> int:
    """Like :func:`nonnegative_int` but refuses 0."""
    from privkit import _validate

    return _validate.positive_int(name, value)


def noted(canonical: str, *aliases: str, action: str = "store") -> type:
    """An argparse action for ``canonical`` that also answers to ``aliases`` (the older
    spellings): an alias works and prints a one-line note on stderr naming the new flag.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser()
        >>> _ = p.add_argument("--rounds", "--iterations", type=int, action=noted("--rounds"))
        >>> p.parse_args(["--rounds", "3"]).rounds
        3
    """
    import argparse
    import sys

    base: type = argparse._StoreTrueAction if action == "store_true" \
        else argparse._StoreAction  # noqa: SLF001

    class _Noted(base):  # type: ignore[misc, valid-type]
        privkit_canonical = canonical

        def __call__(self, parser: Any, namespace: Any, values: Any,
                     option_string: str | None = None) -> None:
            if option_string is not None and option_string != canonical:
                print(f"privkit: {option_string} is now {canonical} (the old spelling still "
                      "works)", file=sys.stderr)
            super().__call__(parser, namespace, values, option_string)

    return _Noted


def split_algorithms(algorithms: str | None, algorithm: str | None, compare: str | None,
                     default: tuple[str, ...], allowed: tuple[str, ...] | None = None
                     ) -> tuple[str, tuple[str, ...]]:
    """(main algorithm, the others) from ``--algorithms`` or the older ``--algorithm`` and
    ``--compare`` (a note says so; the two spellings together are an error naming both).
    Names outside ``allowed`` (default: ``default``) are refused naming ``--algorithms``."""
    import sys

    from privkit.errors import InvalidParameterError

    if algorithms is not None:
        if algorithm is not None or compare is not None:
            raise InvalidParameterError("algorithms", algorithms, "given without --algorithm "
                                        "and --compare (their older spelling)")
        names = tuple(a.strip() for a in algorithms.split(",") if a.strip())
        if not names:
            raise InvalidParameterError("algorithms", algorithms, "at least one algorithm")
        for name in names:
            if name not in (allowed or default):
                raise InvalidParameterError("algorithms", name,
                                            f"one of {', '.join(allowed or default)}")
        if len(set(names)) != len(names):
            raise InvalidParameterError("algorithms", algorithms, "each algorithm once")
        return names[0], names[1:]
    if algorithm is None and compare is None:
        return default[0], default[1:]
    print("privkit: --algorithm and --compare are now --algorithms MAIN,OTHER,... (the old "
          "spelling still works)", file=sys.stderr)
    main = algorithm if algorithm is not None else default[0]
    others = tuple(c for c in (compare or "").split(",") if c)
    return main, others
