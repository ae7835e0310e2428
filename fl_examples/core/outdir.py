"""A run's output directory, checked before anything is charged or written.

Every ``privkit train`` command goes through :func:`prepare_out` before it loads data or opens
a ledger, so all trainers treat ``--out`` alike:

- ``--out`` must name a directory that can be written (a probe file is created and removed;
  directories the probe had to create are removed again), else one line naming the path.
- A new run (no ``--resume``) needs a new or empty directory: a run never adds its charges to
  another run's ledgers. ``--overwrite`` starts over explicitly: the previous run's ledgers
  (each one is named, with its entry count, on stderr), checkpoints and report are removed
  first and the run starts new ledgers.
- ``--resume`` needs a directory holding a run (it says so when there is nothing to resume).

:func:`failure_cleanup` wraps the run: a run into a new or empty directory that fails before
anything is charged or checkpointed leaves the directory as it found it (its empty ledgers
and directories are removed; a ledger with an entry, a checkpoint or a report is never
removed). :func:`check_out_file` is the same writability check for a single output file
(``report tradeoff --out``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from privkit.errors import InvalidParameterError

__all__ = ["PreparedOut", "prepare_out", "failure_cleanup", "check_out_file",
           "check_writable_dir"]

#: What a trainer writes into OUT (removed by ``--overwrite``): ledgers and their head
#: records, checkpoints, the report, the MI-DP file and the plots.
_LEDGERS = ("ledger-*.jsonl",)
_LEDGER_SIDES = ("ledger-*.jsonl.head", "ledger-*.jsonl.head.tmp")
_OUTPUTS = ("report.json", "midp-*.json", "curves_vs_*.png", "staleness.png", "schedule.png")


@dataclass
class PreparedOut:
    """The checked output directory and what preparing it did.

    Attributes:
        path: the directory (it may not exist yet: the run creates it).
        fresh: it was missing or empty before the run (see :func:`failure_cleanup`).
        existed: it existed before the run.
        created: directories above ``path`` that did not exist (removed again by a failed run
            that leaves nothing).
        notes: lines saying what ``--overwrite`` removed.
    """

    path: Path
    fresh: bool
    existed: bool = True
    created: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _bad(out: object, requirement: str) -> InvalidParameterError:
    return InvalidParameterError("out", str(out), requirement)


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its missing ancestors, innermost first (empty if ``path`` exists)."""
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    return missing


def check_writable_dir(path: str | os.PathLike[str], name: str = "out") -> list[Path]:
    """Check that ``path`` is, or can be made, a directory that can be written.

    A probe file is created in it and removed, and directories made for the probe are
    removed again. Returns the directories that did not exist (innermost first).

    Raises:
        InvalidParameterError: naming ``name`` and the path, with the operating system's
            reason (a file in the way, a read-only file system, no permission).
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InvalidParameterError(name, str(p), "a directory (it is a file)")
    missing = _missing_dirs(p)
    made: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        fd, probe = tempfile.mkstemp(dir=p, prefix=".privkit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        f = Path(exc.filename) if exc.filename else None
        where = f" ({f})" if f is not None and f != p and f.parent != p else ""
        raise InvalidParameterError(
            name, str(p), f"a directory that can be written ({exc.strerror or exc}{where})"
        ) from None
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()
    return missing


def check_out_file(path: str | os.PathLike[str], name: str = "out") -> None:
    """Check that the file ``path`` can be written (its directory can be): see
    :func:`check_writable_dir`. Nothing is left behind."""
    p = Path(path)
    if p.is_dir():
        raise InvalidParameterError(name, str(p), "a file name (it is a directory)")
    try:
        check_writable_dir(p.parent, name)
    except InvalidParameterError as exc:
        raise InvalidParameterError(name, str(p), f"a file in {exc.requirement}") from None


def _entries(p: Path) -> list[Path]:
    try:
        return sorted(p.iterdir())
    except OSError:
        return []


def prepare_out(out: str | os.PathLike[str] | None, *, resume: bool = False,
                overwrite: bool = False) -> PreparedOut | None:
    """Check ``--out`` (with ``--resume`` / ``--overwrite``) before anything is charged.

    Returns None without ``out``.

    Raises:
        InvalidParameterError: naming ``out`` (or ``resume``): an empty path, a file, a
            directory that cannot be written, a non-empty directory for a new run, nothing
            to resume, or ``resume`` with ``overwrite``.
    """
    if out is None:
        if resume:
            raise InvalidParameterError("resume", True, "used with an output directory")
        return None
    if not str(out).strip():
        raise _bad(out, "a directory path (it is empty)")
    if resume and overwrite:
        raise InvalidParameterError("overwrite", True, "left out with --resume (--resume "
                                    "continues the run in OUT, --overwrite replaces it)")
    path = Path(out)
    created = check_writable_dir(path)
    held = _entries(path)
    if resume and not held:
        raise _bad(out, "a directory holding a run to resume (it is "
                   f"{'empty' if path.exists() else 'missing'}); leave out --resume to start "
                   "a new run")
    if held and not resume and not overwrite:
        shown = ", ".join(p.name for p in held[:3]) + (", ..." if len(held) > 3 else "")
        raise _bad(out, f"a new or empty directory for a new run (it holds {shown}); a run "
                   "never adds to another run's ledgers: pass --resume to continue that run, "
                   "or --overwrite to replace it with new ledgers")
    prepared = PreparedOut(path, fresh=not held, existed=path not in created,
                           created=[d for d in created if d != path])
    if overwrite and held:
        prepared.notes = _remove_outputs(path)
        prepared.fresh = not _entries(path)
    return prepared


def _remove_outputs(path: Path) -> list[str]:
    """Remove what a trainer wrote into ``path``; lines naming each ledger removed.

    Checkpoints and reports go first and ledger journals before their head records, so a
    crash in between leaves a head record that refuses a silent restart of that ledger.
    """
    notes = []
    if (path / "checkpoints").is_dir():
        shutil.rmtree(path / "checkpoints")
    for pattern in _OUTPUTS:
        for f in sorted(path.glob(pattern)):
            f.unlink()
    for pattern in _LEDGERS:
        for f in sorted(path.glob(pattern)):
            with open(f, "rb") as fh:
                entries = max(sum(1 for _ in fh) - 1, 0)
            f.unlink()
            notes.append(f"--overwrite: removed {f} ({entries} entries; that spend is no "
                         "longer counted): this run starts a new ledger")
    for pattern in _LEDGER_SIDES:
        for f in sorted(path.glob(pattern)):
            f.unlink()
    return notes


def _only_empty_ledgers(path: Path) -> list[Path] | None:
    """The files under ``path`` if all are empty ledgers (a header, no entry) and their head
    records; None if anything else is there."""
    files = []
    for root, _dirs, names in os.walk(path):
        for n in names:
            f = Path(root) / n
            if Path(root) != path:
                return None
            if f.match("ledger-*.jsonl"):
                data = f.read_bytes()
                if data.count(b"\n") != 1 or not data.endswith(b"\n"):
                    return None
            elif not any(f.match(p) for p in _LEDGER_SIDES):
                return None
            files.append(f)
    return files


@contextlib.contextmanager
def failure_cleanup(prepared: PreparedOut | None) -> Iterator[None]:
    """Leave a new or empty OUT as it was when the run fails before anything was charged or
    checkpointed (only empty ledgers, their head records and empty directories are
    removed; anything else keeps the whole directory)."""
    try:
        yield
    except BaseException:
        if prepared is not None and prepared.fresh and prepared.path.is_dir():
            with contextlib.suppress(OSError):
                files = _only_empty_ledgers(prepared.path)
                if files is not None:
                    for f in files:
                        f.unlink()
                    for root, _dirs, _names in sorted(os.walk(prepared.path), reverse=True):
                        if Path(root) != prepared.path or not prepared.existed:
                            Path(root).rmdir()
                    for d in prepared.created if not prepared.existed else ():
                        d.rmdir()
        raise
