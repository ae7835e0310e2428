"""Reopening a ledger journal against its head record (no accounting).

:meth:`privkit.ledger.Ledger.open` and :meth:`~privkit.ledger.Ledger.recover` read the head
record first and the journal after it, under a shared lock on the journal (writers hold it
exclusively while they append a batch and move the head record), so a reader never sees a
head record ahead of the journal it reads. :func:`privkit._head.check` then says whether the
two agree; :func:`settle` creates a missing head record (a ledger from before head records)
or moves one the journal is a batch ahead of (a crash between their writes).
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


def read(cls: Any, path: str | os.PathLike[str], key: Any) -> tuple[Any, Any, Any]:
    """``(ledger, problem, head)``: the journal at ``path`` verified into a ``cls`` (a
    :class:`~privkit.ledger.Ledger`), how it disagrees with its head record (a
    :class:`privkit._head.Problem`, None if it does not) and the head record (None: missing
    or unreadable).

    Raises:
        LedgerError: no journal at ``path``.
        LedgerCorruptError: the journal itself is damaged.
    """
    path = os.fspath(path)
    k = _head.load_key(key)
    head_file = _head.head_path(path)
    try:
        f = open(path, "rb")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        also = (f"; its head record {head_file} exists: the journal was deleted or moved"
                if os.path.isfile(head_file) else "")
        raise LedgerError(f"no ledger at {path!r} ({exc.strerror}){also}") from None
    unreadable = None
    with f:
        with contextlib.suppress(OSError):  # writers hold it exclusively while appending
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        try:  # the head record first: it is never ahead of the journal read after it
            head = _head.read_head(head_file)
        except _head.HeadUnreadable as exc:
            head, unreadable = None, str(exc)
        first = f.readline()
        header = _journal.check_header(_journal.parse_line(first), path)
        ledger = cls(header, path, len(first), k)
        j = ledger._journal
        ledger.discarded_bytes = j.load(f, ledger._replay,
                                        mark=None if head is None else head.seq)
    if unreadable is not None:
        return ledger, _head.Problem("unreadable", f"{path}: the head record is unreadable "
                                     f"({unreadable})"), None
    problem = _head.check(head, journal=path, header_hash=j.header_hash,
                          journal_seq=j.head_seq, hash_at=j.hash_at, size_at=j.marked_size,
                          key=k)
    return ledger, problem, head


def refusal(problem: _head.Problem, path: str) -> LedgerHeadError:
    """The error :meth:`~privkit.ledger.Ledger.open` raises for ``problem`` (one line)."""
    advice = ("" if problem.kind == "needs-key" else
              "; refused: spend is never rolled back (if the loss is accepted, Ledger.recover "
              f"or `privkit ledger recover {path} --accept-rollback` continues from the "
              "journal as it is and records the recovery in it)")
    return LedgerHeadError(problem.message + advice, kind=problem.kind, path=path)


def settle(ledger: Any, head: _head.Head | None) -> None:
    """Create a missing head record, or move one the journal is ahead of (best effort: a
    read-only directory is said in ``ledger.head_note``, not refused)."""
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
    try:
        journal.write_head()
    except OSError as exc:
        note += f" (not written: {exc.strerror or exc})"
    ledger.head_note = note
    (log.warning if head is None else log.info)("%s: %s", ledger.path, note)
