"""Reopening a ledger journal against its head record (no accounting).

:meth:`privkit.ledger.Ledger.open` and :meth:`~privkit.ledger.Ledger.recover` read the head
record first and the journal after it, under a shared lock on the journal (writers hold it
exclusively while they append a write and move the head record), so a reader never sees a
head record ahead of the journal it reads. :func:`privkit._head.select` says which record is
current (and refuses a head file that privkit's writes and crashes cannot leave, when a key
is set), :func:`privkit._head.check` whether the journal agrees with it; with a key, a batch
that its MAC does not authenticate (:mod:`privkit._journal`) is refused too; :func:`settle` creates
a missing head record (a ledger from before head records) or moves one the journal is a write
ahead of (a crash between their writes).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from typing import Any

from privkit import _head, _journal
from privkit.errors import LedgerError, LedgerHeadError

__all__ = ["log", "read", "refusal", "settle"]

log = logging.getLogger("privkit.ledger")
"""Where reopening says what it did to a head record, and recovery that it recovered."""


def read(cls: Any, path: Any, key: Any) -> tuple[Any, Any, Any]:
    """``(ledger, problem, head)``: the journal at ``path`` verified into a ``cls`` (a
    :class:`~privkit.ledger.Ledger`), how it disagrees with its head record (a
    :class:`privkit._head.Problem`, None if it does not) and the current head record (None:
    missing or unreadable).

    Raises:
        InvalidParameterError: ``path`` is not a file path, or a bad key.
        LedgerError: no journal at ``path``, or a file cannot be read (names it and the
            error); the header records another reading of the noise multiplier.
        LedgerCorruptError: the journal itself is damaged.
    """
    path = _journal.as_path(path)
    k = _head.load_key(key)
    head_file = _head.head_path(path)
    try:
        f = open(path, "rb")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        also = (f"; its head record {head_file} exists: the journal was deleted or moved"
                if os.path.isfile(head_file) else "")
        raise LedgerError(f"no ledger at {path!r} ({exc.strerror}){also}") from None
    except OSError as exc:
        raise _journal.fs_error(path, "read the journal", exc) from exc
    unreadable = None
    with f:
        with contextlib.suppress(OSError):  # writers hold it exclusively while appending
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        try:  # the head record first: it is never ahead of the journal read after it
            found = _head.read_file(head_file)
        except _head.HeadUnreadable as exc:
            found, unreadable = None, str(exc)
        except OSError as exc:
            raise _journal.fs_error(head_file, "read the head record", exc) from exc
        reading = _head.select(found, journal=path, key=k)
        head = None if unreadable is not None else reading.head
        try:
            first = f.readline()
            header = _journal.check_header(_journal.parse_line(first), path)
            ledger = cls(header, path, len(first), k)
            j = ledger._journal
            ledger.discarded_bytes = j.load(f, ledger._replay,
                                            mark=None if head is None else head.seq)
        except OSError as exc:
            raise _journal.fs_error(path, "read the journal", exc) from exc
    if unreadable is not None:
        return ledger, _head.Problem("unreadable", f"{path}: the head record is unreadable "
                                     f"({unreadable})"), None
    if reading.problem is not None:
        return ledger, reading.problem, head
    problem = _head.check(head, journal=path, header_hash=j.header_hash,
                          journal_seq=j.head_seq, hash_at=j.hash_at, size_at=j.marked_size,
                          spoilt=reading.spoilt,
                          batches_ahead=None if k is None else j.batches_after_mark)
    if problem is None and j.unauthenticated is not None:
        assert k is not None
        lineno, seq, offset, why = j.unauthenticated
        problem = _head.Problem(
            "batch-mac", f"{path}: line {lineno}: the batch ending at seq {seq} (from byte "
            f"{offset}) {why}: with a ledger key (key id {_head.key_id(k)}) every batch "
            "carries its MAC, so the batch was forged or changed, or written without this "
            "key")
    if problem is None and reading.spoilt is not None:  # said by settle, which repairs it
        ledger.head_note = (f"{reading.spoilt} of the head record was not whole (a crash "
                            "during its write)")
    return ledger, problem, head


def refusal(problem: _head.Problem, path: str) -> LedgerHeadError:
    """The error :meth:`~privkit.ledger.Ledger.open` raises for ``problem`` (one line)."""
    if problem.kind == "needs-key":
        advice = ""
    elif problem.kind == "batch-mac":
        advice = ("; refused: a batch the key does not authenticate is never counted or "
                  "continued from (if it is not genuine, cut the journal at that byte; to accept "
                  f"the journal as it is, Ledger.recover or `privkit ledger recover {path} "
                  "--accept-rollback` continues from it and records the recovery in it)")
    elif problem.kind in ("one-line", "ambiguous", "spoilt", "slots"):
        advice = ("; refused: spend is never rolled back (if the journal is known to be whole, "
                  f"or its loss is accepted, Ledger.recover or `privkit ledger recover {path} "
                  "--accept-rollback` continues from the journal as it is, records the "
                  "recovery in it and writes the head record afresh)")
    else:
        advice = ("; refused: spend is never rolled back (if the loss is accepted, "
                  f"Ledger.recover or `privkit ledger recover {path} --accept-rollback` "
                  "continues from the journal as it is and records the recovery in it)")
    return LedgerHeadError(problem.message + advice, kind=problem.kind, path=path)


def settle(ledger: Any, head: _head.Head | None) -> None:
    """Create a missing head record, or move one the journal is ahead of (best effort: a
    read-only directory is said in ``ledger.head_note``, not refused; so is a slot that
    :func:`read` found not whole)."""
    journal = ledger._journal
    seq = journal.head_seq
    if head is not None and head.seq == seq:
        return
    if head is None:
        note = (f"no head record (a ledger written before privkit kept one); created "
                f"{journal.head_file} at seq {seq}: a rollback is refused from now on")
    else:
        note = (f"the journal is {seq - head.seq} entries ahead of its head record (a crash "
                f"between their writes); head record moved to seq {seq}")
    if ledger.head_note:
        note += f"; {ledger.head_note}"
    try:
        journal.write_head()
    except OSError as exc:
        note += f" (not written: {_journal.errno_text(exc)})"
    ledger.head_note = note
    (log.warning if head is None else log.info)("%s: %s", ledger.path, note)
