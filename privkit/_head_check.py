"""The judgement of a head file and of a journal against its head record (no I/O).

:func:`select` says which record of a head file is current and whether the file is refused
whatever the journal holds; :func:`check` whether a journal agrees with the record (a
:class:`Problem` if not). Apart from the record's bytes (:mod:`privkit._head_slots`) and the
file's writing (:mod:`privkit._head`, which re-exports every public name here): these are the
acceptance rules of the module doc of :mod:`privkit._head`, which :mod:`privkit._reopen`
applies when a ledger is opened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from privkit._head_slots import KEY_ENV, KEY_FILE_ENV, Head, HeadFile, head_path, key_id


@dataclass(frozen=True)
class Problem:
    """How a journal disagrees with its head record: ``kind`` (a short code: ``missing``,
    ``unreadable``, ``other``, ``unauthenticated``, ``needs-key``, ``bad-mac``, ``one-line``,
    ``slots``, ``ambiguous``, ``spoilt``, ``behind``, ``diverged``, ``ahead``, and
    ``batch-mac`` for a batch of the journal that the key does not authenticate,
    :mod:`privkit._reopen`) and a one-line ``message``."""

    kind: str
    message: str


@dataclass(frozen=True)
class Reading:
    """What :func:`select` makes of a head file: the current record (None: there is none),
    a ``problem`` that refuses the file whatever the journal holds (None: none), and
    ``spoilt``, when a key is set and one slot is not whole, which one and why (the journal
    must then be ahead of ``head``, :func:`check`)."""

    head: Head | None
    problem: Problem | None = None
    spoilt: str | None = None


def select(found: HeadFile | None, *, journal: str, key: bytes | None) -> Reading:
    """The current record of the head file ``found`` (None: there is none) of the journal
    ``journal``, and whether it is refused before the journal is compared with it.

    Without a key: the whole slot of the higher generation (or the one-line record); refused
    only when it was written with a key. With one: see the module doc of :mod:`privkit._head`.
    """
    where = head_path(journal)
    if found is None:
        if key is None:
            return Reading(None)
        return Reading(None, Problem("missing", f"{journal}: no head record ({where} is "
                                     "missing) although a ledger key is set: deleting it "
                                     "could hide a rollback"))
    head = found.current()
    if key is None:
        if head.key_id is None:
            return Reading(head)
        return Reading(head, Problem("needs-key", f"{journal}: the head record {where} is "
                                     f"authenticated (key id {head.key_id}); set {KEY_ENV} or "
                                     f"{KEY_FILE_ENV} to open this ledger"))
    if found.slots is None:
        what = "carries no MAC" if head.key_id is None else f"key id {head.key_id}"
        return Reading(head, Problem(
            "one-line", f"{journal}: the head record {where} is in the one-line layout of an "
            f"earlier privkit ({head.describe()}, {what}): with a ledger key set it is refused, "
            "since it has no generation under a MAC and a copy of an older record looks the "
            "same"))
    whole = found.whole()
    for s in whole:
        if not s.keyed():
            return Reading(head, Problem(
                "unauthenticated", f"{journal}: the head record {where} carries no MAC "
                f"({s.describe()}) although a ledger key is set (written without the key, or "
                "forged)"))
        if not s.verifies(key):
            return Reading(head, Problem(
                "bad-mac", f"{journal}: the head record {where} does not verify with this "
                f"ledger key (key id {key_id(key)}; {s.describe()}, key id {s.head.key_id}): "
                "forged, changed (its generation raised?), or written with another key"))
    if len(whole) == 1:
        spoilt = next(f"slot {i} ({why})" for i, why in enumerate(found.slots)
                      if isinstance(why, str))
        return Reading(head, spoilt=spoilt)
    new, old = sorted(whole, key=lambda s: s.gen, reverse=True)
    both = f"{new.describe()}; {old.describe()}"
    if new.version != old.version or new.head.header_hash != old.head.header_hash:
        return Reading(head, Problem(
            "slots", f"{journal}: the slots of the head record {where} do not belong together "
            f"({both}; formats {new.version} and {old.version}): privkit never writes such a "
            "file"))
    if new.version == 1 and new.head.seq <= old.head.seq:
        return Reading(head, Problem(
            "ambiguous", f"{journal}: the head record {where} was written by an earlier privkit "
            "(slot format 1, generations not under the MAC) and cannot be told from a copy of "
            f"an older record ({both}: the current one does not name a later entry)"))
    if new.gen != old.gen + 1 or any(s.index != s.gen % 2 for s in whole):
        return Reading(head, Problem(
            "slots", f"{journal}: the slots of the head record {where} do not hold "
            f"consecutive generations in their places ({both}): privkit never writes such a "
            "file"))
    return Reading(head)


def check(head: Head | None, *, journal: str, header_hash: str, journal_seq: int,
          hash_at: Callable[[int], str], size_at: int | None,
          spoilt: str | None = None, batches_ahead: int | None = None) -> Problem | None:
    """Whether the journal (``journal_seq``: its last committed entry; ``hash_at(seq)``: the
    hash of an entry; ``size_at``: its length through the batch that ends at ``head.seq``,
    None if none does) agrees with the head record ``head`` that :func:`select` chose (None:
    there is none and none is needed).

    None means it does: the journal holds every committed entry, and perhaps a write more
    (a crash between the journal's fsync and the head record's). With ``spoilt`` (one slot
    not whole, a key set) the journal must be ahead of ``head``: that is what a crash
    leaves, and a journal that ends at ``head`` means the newer record was destroyed. With
    ``batches_ahead`` (a key set: the number of writes the journal holds after ``head.seq``)
    it may be one write ahead at most: a crash leaves no more, and a journal further ahead
    lies beside an older copy of its head record, from which it may have been cut anywhere.
    """
    where = head_path(journal)
    if head is None:
        return None
    if head.header_hash != header_hash:
        return Problem("other", f"{journal}: the head record {where} belongs to another journal "
                       f"(header hash {head.header_hash[:12]}..., this one {header_hash[:12]}...)")
    if journal_seq < head.seq:
        return Problem("behind", f"{journal}: the journal ends at seq {journal_seq} (hash "
                       f"{hash_at(journal_seq)[:12]}...) but its head record {where} says "
                       f"{head.describe()} was committed: {head.seq - journal_seq} entries are "
                       "missing (a deleted batch, a cut, or an older copy of the journal)")
    if hash_at(head.seq) != head.hash:
        return Problem("diverged", f"{journal}: entry {head.seq} has hash "
                       f"{hash_at(head.seq)[:12]}... but its head record {where} says "
                       f"{head.hash[:12]}...: the journal was rewritten")
    if size_at != head.size:
        got = "no batch ending there" if size_at is None else f"{size_at} bytes"
        return Problem("diverged", f"{journal}: the journal holds {got} through entry "
                       f"{head.seq} but its head record {where} says {head.size}: the journal "
                       "was rewritten")
    if batches_ahead is not None and batches_ahead > 1:
        return Problem("ahead", f"{journal}: the journal holds {batches_ahead} writes after "
                       f"the entry its head record {where} names ({head.describe()}); a crash "
                       "leaves one at most (a batch, or deferred charges written together), so "
                       "an older copy of the head record was put back (and the journal may "
                       "have been cut after it)")
    if spoilt is not None and journal_seq == head.seq:
        return Problem("spoilt", f"{journal}: {spoilt} of the head record {where} is not whole "
                       f"and the journal ends at the other slot's record ({head.describe()}): a "
                       "crash leaves the journal a batch ahead of that record, so the newer "
                       "record was destroyed (a rollback, or damage to the head file)")
    return None
