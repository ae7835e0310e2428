"""A run's output directory, checked before anything is charged or written.

Every ``privkit train`` command goes through :func:`prepare_out` after its flags, its
configuration and its data-set spec were checked and before it loads data or opens a ledger,
so all trainers treat ``--out`` alike:

- ``--out`` must name a directory that can be written (a probe file is created and removed;
  directories the probe had to create are removed again), else one line naming the path.
- A new run (no ``--resume``) needs a new or empty directory: a run never adds its charges to
  another run's ledgers.
- ``--overwrite`` starts over explicitly. A ledger journal that holds entries (charges) is
  never removed: without ``--discard-ledger`` as well, ``--overwrite`` refuses (one line
  naming the ledger and the flag) and changes nothing; with it, the journal and its head
  record are renamed ``ledger-<algorithm>.jsonl.discarded-<UTC time>`` (and ``....head``),
  kept beside the new run (``privkit ledger verify`` still reads them) and no longer counted.
  The previous run's other outputs (checkpoints, report, plots, empty ledgers) are first
  moved into a hidden ``.privkit-overwrite-<UTC time>/`` directory, removed once the new run
  has written something.
- ``--resume`` needs a directory holding a run (it says so when there is nothing to resume).

:func:`failure_cleanup` wraps the run: a run that fails before anything is charged,
checkpointed or reported leaves the directory as it found it (the empty ledgers and
directories it created are removed; with ``--overwrite`` the previous run's files are put
back, byte for byte); a ledger with an entry, a checkpoint or a report is never removed.
:func:`check_out_file` is the same writability check for a single output file
(``report tradeoff --out``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from privkit.errors import InvalidParameterError

__all__ = ["PreparedOut", "prepare_out", "failure_cleanup", "check_out_file",
           "check_writable_dir", "ledger_entries", "DISCARDED", "STAGE_PREFIX"]

#: What a trainer writes into OUT (set aside by ``--overwrite``): ledgers and their head
#: records, checkpoints, the report, the MI-DP file and the plots.
_LEDGERS = ("ledger-*.jsonl",)
_LEDGER_SIDES = ("ledger-*.jsonl.head", "ledger-*.jsonl.head.tmp")
_OUTPUTS = ("report.json", "midp-*.json", "curves_vs_*.png", "staleness.png", "schedule.png")
#: The hidden directory ``--overwrite`` moves the previous run's outputs into until the new
#: run has written something (a run killed meanwhile leaves it; the next ``--overwrite``
#: removes it with the other outputs).
STAGE_PREFIX = ".privkit-overwrite-"
#: A discarded ledger journal is renamed ``<journal>.discarded-<UTC time>`` (its head record
#: ``<journal>.discarded-<UTC time>.head``): kept, never deleted, no longer counted.
DISCARDED = ".discarded-"


@dataclass
class PreparedOut:
    """The checked output directory and what preparing it did.

    Attributes:
        path: the directory (it may not exist yet: the run creates it).
        fresh: it was missing or empty before the run (see :func:`failure_cleanup`).
        existed: it existed before the run.
        created: directories above ``path`` that did not exist (removed again by a failed run
            that leaves nothing).
        notes: lines saying what ``--overwrite`` set aside, printed once the new run has
            written something (:meth:`commit`).
        moves: ``(original, now)`` of every file ``--overwrite`` moved (put back by
            :meth:`restore`).
        stage: the hidden directory holding the previous run's other outputs, or None.
        before: the names in ``path`` when the run started (anything else is the run's).
        resume: the run continues the one in ``path``.
    """

    path: Path
    fresh: bool
    existed: bool = True
    created: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    moves: list[tuple[Path, Path]] = field(default_factory=list)
    stage: Path | None = None
    before: frozenset[str] = frozenset()
    resume: bool = False

    @property
    def guarded(self) -> bool:
        """A failed new run puts the directory back as it was (new, empty or overwritten); a
        resumed one leaves it (its ledgers and checkpoints are the run's record)."""
        return not self.resume

    def commit(self) -> list[str]:
        """The new run has written something: remove the previous run's staged outputs (the
        discarded ledgers stay, renamed); returns the notes to print."""
        if self.stage is not None:
            shutil.rmtree(self.stage, ignore_errors=True)
        self.stage, self.moves = None, []
        notes, self.notes = self.notes, []
        return notes

    def restore(self) -> None:
        """Put every moved file back (nothing of the new run is left)."""
        for original, now in reversed(self.moves):
            if not original.exists():
                with contextlib.suppress(OSError):
                    os.rename(now, original)
        if self.stage is not None:
            with contextlib.suppress(OSError):
                self.stage.rmdir()
        self.stage, self.moves, self.notes = None, [], []


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


def ledger_entries(journal: Path) -> int | None:
    """The entries (lines after the header) of a ledger journal; None if it cannot be read
    (then it counts as holding charges: a ledger is never given up on a guess)."""
    try:
        data = journal.read_bytes()
    except OSError:
        return None
    return sum(1 for line in data.split(b"\n")[1:] if line.strip())


def _stamp(path: Path, names: list[str]) -> str:
    """A UTC time stamp no discarded or staged name in ``path`` uses yet."""
    base = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    stamp, k = base, 2
    while (path / f"{STAGE_PREFIX}{stamp}").exists() or any(
            (path / f"{n}{DISCARDED}{stamp}").exists()
            or (path / f"{n}{DISCARDED}{stamp}.head").exists() for n in names):
        stamp, k = f"{base}-{k}", k + 1
    return stamp


def prepare_out(out: str | os.PathLike[str] | None, *, resume: bool = False,
                overwrite: bool = False, discard_ledger: bool = False) -> PreparedOut | None:
    """Check ``--out`` (with ``--resume`` / ``--overwrite`` / ``--discard-ledger``) before
    anything is charged; with ``--overwrite``, set the previous run's outputs aside.

    Returns None without ``out``.

    Raises:
        InvalidParameterError: naming ``out`` (or ``resume``, ``overwrite``,
            ``discard_ledger``): an empty path, a file, a directory that cannot be written, a
            non-empty directory for a new run, nothing to resume, ``resume`` with
            ``overwrite``, ``discard_ledger`` without ``overwrite``, or ``overwrite`` of a
            directory whose ledger holds charges without ``discard_ledger`` (nothing is
            changed then).
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
    if discard_ledger and not overwrite:
        raise InvalidParameterError("discard_ledger", True, "given with --overwrite (it lets "
                                    "--overwrite set aside a ledger that holds charges)")
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
                   "or --overwrite to replace it with new ledgers (and --discard-ledger to "
                   "set aside a ledger that holds charges)")
    prepared = PreparedOut(path, fresh=not held, existed=path not in created,
                           created=[d for d in created if d != path], resume=resume)
    if overwrite and held:
        _set_aside(prepared, discard_ledger)
        prepared.fresh = False
    prepared.before = frozenset(p.name for p in _entries(path))
    return prepared


def _charged(path: Path) -> list[tuple[Path, int | None]]:
    """The ledger journals in ``path`` that hold entries (or cannot be read), with their entry
    counts, and head records whose journal is missing (count None): what ``--overwrite``
    never removes."""
    found: list[tuple[Path, int | None]] = []
    for pattern in _LEDGERS:
        for f in sorted(path.glob(pattern)):
            n = ledger_entries(f)
            if n != 0:
                found.append((f, n))
    for f in sorted(path.glob("ledger-*.jsonl.head")):
        journal = f.with_name(f.name[: -len(".head")])
        if not journal.exists():
            found.append((journal, None))
    return found


def _set_aside(prepared: PreparedOut, discard_ledger: bool) -> None:
    """``--overwrite``: rename the charged ledgers aside (refused without ``discard_ledger``)
    and move the previous run's other outputs into the stage directory. All or nothing."""
    path = prepared.path
    charged = _charged(path)
    if charged and not discard_ledger:
        journal, n = charged[0]
        held = (f"holds {n} entries" if n is not None else
                "cannot be read" if journal.exists() else
                "was deleted but its head record remains")
        raise InvalidParameterError(
            "discard_ledger", False,
            f"given for --overwrite to replace the run in {path}: its ledger {journal} {held} "
            "(charges a new run would no longer count); with --discard-ledger it is renamed "
            f"{journal.name}{DISCARDED}<UTC time>, kept and never deleted; or pass --resume to "
            "continue that run, or use a new --out")
    stamp = _stamp(path, [j.name for j, _ in charged])
    stage = path / f"{STAGE_PREFIX}{stamp}"
    moves: list[tuple[Path, Path]] = []
    for journal, n in charged:
        kept = journal.with_name(f"{journal.name}{DISCARDED}{stamp}")
        if journal.exists():
            moves.append((journal, kept))
            count = "unreadable" if n is None else f"{n} entries"
            prepared.notes.append(
                f"--overwrite --discard-ledger: {journal} ({count}; that spend is no longer "
                f"counted) was set aside as {kept.name} (kept, never deleted): this run "
                "started a new ledger")
        head = Path(f"{journal}.head")
        if head.exists():
            moves.append((head, Path(f"{kept}.head")))
    aside = {m[0] for m in moves}
    staged = [p for p in _outputs(path) if p not in aside]
    moves += [(p, stage / p.name) for p in staged]
    done: list[tuple[Path, Path]] = []
    try:
        if staged:
            stage.mkdir()
        for original, now in moves:
            os.rename(original, now)
            done.append((original, now))
    except OSError as exc:
        prepared.moves, prepared.stage = done, stage if staged else None
        prepared.restore()
        raise _bad(path, f"a directory whose previous run --overwrite can set aside "
                   f"({exc.filename}: {exc.strerror or exc})") from None
    prepared.moves, prepared.stage = moves, stage if staged else None


def _outputs(path: Path) -> list[Path]:
    """What a trainer (or an earlier ``--overwrite``) wrote into ``path``, top level."""
    found = [path / "checkpoints"] if (path / "checkpoints").is_dir() else []
    for pattern in (*_OUTPUTS, *_LEDGERS, *_LEDGER_SIDES, f"{STAGE_PREFIX}*"):
        found += sorted(path.glob(pattern))
    return list(dict.fromkeys(found))


def _run_left_nothing(path: Path, before: frozenset[str]) -> tuple[list[Path], list[Path]] | None:
    """(files, directories) the run added to ``path`` if they are only empty ledgers (a
    header, no entry), their head records and empty directories; None if it wrote anything
    else (a charge, a checkpoint, a report, a plot)."""
    files: list[Path] = []
    dirs: list[Path] = []
    for entry in _entries(path):
        if entry.name in before:
            continue
        if entry.is_dir() and not entry.is_symlink():
            for root, _subdirs, names in os.walk(entry):
                if names:
                    return None
                dirs.append(Path(root))
        elif entry.match("ledger-*.jsonl"):
            data = entry.read_bytes()
            if data.count(b"\n") != 1 or not data.endswith(b"\n"):
                return None
            files.append(entry)
        elif any(entry.match(p) for p in _LEDGER_SIDES):
            files.append(entry)
        else:
            return None
    return files, sorted(dirs, key=lambda d: len(d.parts), reverse=True)


def _note(lines: list[str]) -> None:
    for line in lines:
        print(f"privkit: {line}", file=sys.stderr)


@contextlib.contextmanager
def failure_cleanup(prepared: PreparedOut | None) -> Iterator[None]:
    """Run the block; leave a new, empty or overwritten OUT as it was when the run fails before
    anything was charged, checkpointed or reported (only the empty ledgers, head records and
    empty directories the run created are removed, then ``--overwrite``'s moves are undone).
    Once the run has written something (or ends), ``--overwrite`` is done: its staged files
    are removed and its notes printed on stderr."""
    try:
        yield
    except BaseException:
        if prepared is not None and prepared.guarded:
            with contextlib.suppress(OSError):
                left = _run_left_nothing(prepared.path, prepared.before) \
                    if prepared.path.is_dir() else ([], [])
                if left is None:
                    _note(prepared.commit())
                else:
                    files, dirs = left
                    for f in files:
                        f.unlink()
                    for d in dirs:
                        d.rmdir()
                    prepared.restore()
                    if not prepared.existed and prepared.path.is_dir():
                        prepared.path.rmdir()
                        for d in prepared.created:
                            d.rmdir()
        raise
    if prepared is not None:
        _note(prepared.commit())
