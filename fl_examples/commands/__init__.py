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

__all__ = ["OUT_HELP", "command_modules", "default_out", "nonnegative_int", "positive_int"]

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
