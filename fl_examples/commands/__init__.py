"""One module per ``privkit train <name>`` command.

Each module defines ``NAME``, ``HELP``, ``DESCRIPTION``, ``add_arguments(parser)``,
``prepare(args) -> job`` and ``run(args) -> int``, and imports nothing heavy (torch, the
trainer) at module level, so building the CLI parser stays fast. ``prepare`` checks every
option, builds the trainer's configuration and checks its data-set spec, touching nothing;
it returns the job (no arguments, the exit status) that ``run`` runs
(:func:`run_prepared`). :func:`fl_examples.cli.run_train` calls ``prepare`` before it
touches ``--out``, so a bad option never changes the output directory.
:func:`fl_examples.cli.add_train_parser` finds the modules here by name; adding a trainer
command means adding a module, nothing else. Every command also gets ``--threads`` (torch CPU
threads, default :data:`fl_examples.cli.DEFAULT_THREADS`, one).

A flag that means the same in several trainers is declared here once, with its help, default
and check: ``--checkpoint-every``, ``--resume`` and ``--out`` (:func:`add_out_arguments`), the
torch trainers' ``--device`` (:func:`add_device`), distributed DP's ``--min-survivors`` and
``--colluders`` (:func:`add_survivor_arguments`); :func:`run_options` and
:func:`survivor_options` check their values for the configuration, and :func:`finish` prints
a finished run. A flag whose meaning or default differs per trainer stays in its module.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["OUT_HELP", "command_modules", "default_out", "nonnegative_int", "positive_int",
           "VOCABULARY", "noted", "split_algorithms", "run_prepared", "epsilon_target",
           "MAX_EPSILON_TARGET", "audit_canaries", "DEVICE_HELP", "RESUME_HELP",
           "add_device", "add_out_arguments", "add_survivor_arguments", "run_options",
           "survivor_options", "finish"]

#: The largest ``--noise-for-epsilon`` any trainer calibrates to: ln of the largest double.
#: Above it e^epsilon, which every (epsilon, delta) bound multiplies by, is not a finite
#: number; such a target asks for no noise at all (the calibrated noise underflows and the
#: accountants overflow), so it is refused rather than run.
MAX_EPSILON_TARGET = 709.0

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
    "device": ("--device", "auto (CUDA when available; the default) | cpu | cuda[:N]; scfl, "
               "numpy on the CPU: auto or cpu"),
}

#: The ``--out`` help every trainer command shares.
OUT_HELP = ("output directory (report.json, plots, ledgers, checkpoints); new or empty unless "
            "--resume or --overwrite (default: runs/<trainer>-<local time>, a new directory; "
            "--resume needs it given)")

#: The ``--resume`` help every trainer command shares (:func:`fl_examples.core.run.drive`).
RESUME_HELP = ("continue from OUT's checkpoints and ledgers (with the same settings; charges a "
               "crash left after the last checkpoint are adopted, never made twice)")

#: The ``--device`` help of the torch trainers (scfl computes in numpy: its own ``--device``).
DEVICE_HELP = "auto | cpu | cuda[:N] (auto: CUDA when available)"


def add_device(p: Any) -> None:
    """``--device`` of a torch trainer: :data:`DEVICE_HELP`, default ``auto``."""
    p.add_argument("--device", default="auto", help=DEVICE_HELP)


def add_out_arguments(p: Any, *, unit: str, at_end: bool = False) -> None:
    """``--checkpoint-every`` (N ``unit``, the trainer's counted steps; ``at_end``: the
    trainer also checkpoints the end of its run), ``--resume`` and ``--out``, in that order.
    :func:`run_options` checks ``--checkpoint-every``; :func:`fl_examples.cli.run_train`
    prepares ``--out``."""
    end = " (and at the end)" if at_end else ""
    p.add_argument("--checkpoint-every", type=float, default=0,
                   help=f"checkpoint every N {unit}{end} into OUT/checkpoints/<algorithm> "
                        "(0: never)")
    p.add_argument("--resume", action="store_true", help=RESUME_HELP)
    p.add_argument("--out", default=None, help=OUT_HELP)


def add_survivor_arguments(p: Any) -> None:
    """``--min-survivors``, ``--colluders`` and ``--dropout-tolerance`` of distributed DP
    (``--aggregation distributed``: :mod:`fl_examples.core.distributed`); checked by
    :func:`survivor_options` (and the configurations: ``dropout_tolerance``)."""
    p.add_argument("--min-survivors", type=float, default=None,
                   help="distributed: the fewest clients a released sum may hold (the "
                        "accounting prices that many noise shares); a data round with a smaller "
                        "cohort is skipped, releasing and charging nothing (default: the "
                        "largest n with P(cohort < n) <= 1%%; every client at --client-rate 1)")
    p.add_argument("--colluders", type=float, default=None,
                   help="distributed: clients that may collude with the server (their noise "
                        "shares are not counted; default 0)")
    p.add_argument("--dropout-tolerance", type=float, default=None, metavar="F",
                   help="distributed: F in [0, 1]; a released round of n clients adds noise "
                        "shares for max(--min-survivors, ceil((1 - F) n)) survivors, so the "
                        "sum carries the priced noise and no more when they all survive "
                        "(default 0: this simulation has no dropouts; a deployment that "
                        "tolerates dropouts sets F; 1: every client adds the share for "
                        "--min-survivors, the fixed-share protocol); the epsilon is the same")


def run_options(args: Any) -> dict[str, Any]:
    """The configuration's settings every trainer takes alike from its flags, checked:
    ``seed`` and ``checkpoint_every`` (integers >= 0), ``secure_noise``, ``eval_client_data``
    and ``audit_canaries`` (:func:`audit_canaries`)."""
    return {"seed": nonnegative_int("seed", args.seed),
            "checkpoint_every": nonnegative_int("checkpoint_every", args.checkpoint_every),
            "secure_noise": args.secure_noise, "eval_client_data": args.eval_client_data,
            "audit_canaries": audit_canaries(args)}


def survivor_options(args: Any) -> dict[str, Any]:
    """``min_survivors`` (an integer >= 1) and ``colluders`` (>= 0), None where not given,
    and ``dropout_tolerance`` as given, checked by the configuration
    (:func:`add_survivor_arguments`)."""
    return {"min_survivors": None if args.min_survivors is None
            else positive_int("min_survivors", args.min_survivors),
            "colluders": None if args.colluders is None
            else nonnegative_int("colluders", args.colluders),
            "dropout_tolerance": args.dropout_tolerance}


def finish(args: Any, res: dict[str, Any], summary: Callable[[dict[str, Any]], dict[str, Any]],
           table: Callable[[dict[str, Any]], str], footer: str | None, **dumps: Any) -> int:
    """Print the result ``res`` of a finished run: with ``--json``, ``summary(res)`` and the
    audit block (when there is one) as one JSON object (``dumps``: :func:`json.dumps`'
    options), else ``table(res)`` then ``footer`` (None: nothing more). Returns the exit
    status (:func:`fl_examples.core.canaries.audit_exit`)."""
    import json

    from fl_examples.core.canaries import audit_exit

    if args.json:
        print(json.dumps(summary(res) | ({"audit": res["audit"]} if "audit" in res else {}),
                         **dumps))
    else:
        print(table(res))
        if footer is not None:
            print(footer)
    return audit_exit(res.get("audit"), as_json=args.json)


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


def run_prepared(args: Any, prepare: Callable[[Any], Callable[[], int]]) -> int:
    """Run the job ``prepare(args)`` returns (or the one :func:`fl_examples.cli.run_train`
    prepared already, ``args._train_job``); its exit status."""
    job = vars(args).pop("_train_job", None) or prepare(args)
    return int(job() or 0)


def epsilon_target(name: str, value: float | None) -> float | None:
    """``--noise-for-epsilon`` (None: not given): finite, > 0 and at most
    :data:`MAX_EPSILON_TARGET`, else an error naming ``name``.

    >>> epsilon_target("noise_for_epsilon", 8.0)
    8.0
    """
    if value is None:
        return None
    from privkit import _validate
    from privkit.errors import InvalidParameterError

    target = _validate.positive(name, value)
    if target > MAX_EPSILON_TARGET:
        raise InvalidParameterError(
            name, value, f"at most {MAX_EPSILON_TARGET:g} (e^epsilon must be a finite number: "
            "above it no noise is left to calibrate; for a run without noise leave out the "
            "privacy options)")
    return target


def audit_canaries(args: Any) -> int:
    """``--audit-canaries M`` (every trainer; 0: no audit): an integer >= 0, refused with
    ``--resume`` (the canaries' scores are not checkpointed; :mod:`fl_examples.core.canaries`).
    The configuration refuses it where it does not apply."""
    from privkit.errors import InvalidParameterError

    m = nonnegative_int("audit_canaries", getattr(args, "audit_canaries", 0) or 0)
    if m and getattr(args, "resume", False):
        raise InvalidParameterError("audit_canaries", m, "left out with --resume (the canaries' "
                                    "scores are not checkpointed: an audit run is one "
                                    "uninterrupted run)")
    return m


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
