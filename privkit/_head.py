"""The ledger's head record: evidence against rollback and tail loss (no accounting).

A journal (:mod:`privkit._journal`) is append-only, but a file can still lose its end: a
restore from an older backup, a deleted last batch, a cut to the header. Each such journal is
a valid ledger on its own, so the journal alone cannot tell. The head record, kept beside the
journal as ``<journal>.head``, names the last committed entry: ``seq`` and ``hash`` (seq -1
and the header's hash for a journal without entries), ``size`` (the journal's length in bytes
through that entry) and ``header_hash`` (the journal it belongs to). It moves after every
write (a batch, or the batches of deferred charges written together: :mod:`privkit._journal`),
once the write is durable in the journal, so a journal is never behind its head record except
when it lost committed entries.

**Slots.** The file holds the record twice over, in two slots of :data:`SLOT` bytes, each one
line padded with spaces::

    <record>\\t<generation>\\t<mac>\\t<checksum>\\n

``record`` is canonical JSON (schema :data:`SCHEMA`: ``hash``, ``header_hash``, ``key_id``,
``schema``, ``seq``, ``size``), ``generation`` a decimal number, ``mac`` the slot's MAC (below;
``-`` without a key) and ``checksum`` the first 32 hex digits of the SHA-256 of all before it:
a slot whose checksum fails was cut short by a crash (it is not *whole*). The slot of
generation ``g`` is slot ``g % 2``, the two hold consecutive generations, and the current
record is the higher one's. A batch writes the *other* slot in place with the next generation
and fsyncs the file (one fsync, no new name): a write cut short by a crash spoils at most that
slot, and the other still names the batch before, which the journal is then one batch ahead
of (accepted, see :func:`check`). Creating the file, or replacing one in an earlier layout or
without a usable slot, is atomic instead (temporary file, fsync, rename, fsync of the
directory), its two slots holding the record at consecutive generations.

**The key.** With a ledger key (``key=`` or the environment: :data:`KEY_ENV` holds the key
text, :data:`KEY_FILE_ENV` the path of a file holding it; at least :data:`MIN_KEY_BYTES`
bytes), ``key_id`` is a fingerprint of the key (never the key) and ``mac`` HMAC-SHA256 under
the key of the slot's record and generation; every other byte of the slot follows from them,
so the MAC covers the whole slot, its place (``g % 2``) included. Each entry's hash covers the
entry before it, so the MAC over ``hash`` authenticates the whole chain up to ``seq``: a
re-hashed, forged chain needs a new head record, and only a key holder can write one. With a
key, a head file is accepted only in a state that privkit's writes and crashes leave
(:func:`select`, :func:`check`):

* both slots whole and authentic, at consecutive generations in their places: the higher one
  is current;
* one slot not whole: only when the journal is *ahead* of the other slot's record (a crash
  after the batch's fsync, during the slot's write); a journal that ends at that record means
  the newer record was destroyed, and is refused;
* the journal at most one write ahead of the current record (a crash leaves no more; further
  ahead, an older copy of the head file was put back: refused, ``ahead``), and that write's
  batches, like every other, authenticated by their MACs (:mod:`privkit._journal`, which also
  authenticate where a write ends): the record authenticates the chain up to ``seq``, the
  MACs the write a crash leaves beyond it, so no batch can be substituted for it;
* the one-line layout of earlier privkits (one record, no generation): refused, since a copy
  of an older authentic record looks the same;
* two slots of an earlier privkit (format 1: the MAC, inside the record, leaves the generation
  out): read by the same rules, and the current record must name a later entry than the
  other (identical slots, or a current record behind the other, may be a copy of the older
  record: refused, see the message). The next write replaces the file in the current format.

Without a key nothing is authenticated: the current record is the whole slot of the higher
generation, whatever the journal (any number of batches ahead of it), and anyone who can write
the directory can write a head record and re-hash the journal (``docs/reliability.md``, the
threat model).

**Modules.** This module writes the head file (:func:`write_head`, :func:`open_for_write`,
:func:`fsync_dir`, :func:`dir_lock`) and re-exports the rest, so that the journal and the
ledger reach the head record through it alone: the record's bytes (keys, records, slots,
reading a file back) are in :mod:`privkit._head_slots`, the judgement (:func:`select`,
:func:`check`) in :mod:`privkit._head_check`.

Example:
    >>> head = Head(seq=-1, hash="ab" * 32, size=120, header_hash="ab" * 32)
    >>> Head.parse(head.to_bytes(None), None) == head
    True
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator

from privkit._head_check import Problem, Reading, check, select
from privkit._head_slots import (
    KEY_ENV,
    KEY_FILE_ENV,
    MIN_KEY_BYTES,
    SCHEMA,
    SCHEMA_V1,
    SLOT,
    Head,
    HeadFile,
    HeadUnreadable,
    Slot,
    _parse_slot,
    _slot_bytes,
    head_path,
    key_id,
    load_key,
    read_file,
    read_head,
)

__all__ = ["SCHEMA", "SCHEMA_V1", "KEY_ENV", "KEY_FILE_ENV", "MIN_KEY_BYTES", "Head",
           "HeadFile", "HeadUnreadable", "Problem", "Reading", "Slot", "check", "head_path",
           "load_key", "key_id", "open_for_write", "read_file", "read_head", "select",
           "write_head", "fsync_dir", "dir_lock", "SLOT"]


# -------------------------------------------------------------------------- files
_datasync = getattr(os, "fdatasync", os.fsync)


def fsync_dir(directory: str) -> None:
    """fsync a directory (persists a rename or a new name in it; POSIX)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_for_write(path: str) -> int:
    """A descriptor of the head file at ``path`` open for reading and writing (for
    :func:`write_head`), or -1 if there is none.

    Raises:
        OSError: it cannot be opened so (a directory, no permission, a read-only file system).
    """
    try:
        return os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return -1


def _current_for(data: bytes, key: bytes | None, header_hash: str) -> tuple[Slot | None, int]:
    """The current slot of the two-slot ``data`` that a write with ``key`` for the journal
    of ``header_hash`` may keep (whole, of this format, of that journal, authenticated by
    ``key`` or written without a key as this write is; None if none is), and the highest
    generation among such slots (-1: none)."""
    if len(data) != 2 * SLOT:
        return None, -1
    usable = []
    for i in (0, 1):
        try:
            s = _parse_slot(data[i * SLOT:(i + 1) * SLOT], i, None)
        except HeadUnreadable:
            continue
        if (isinstance(s, Slot) and s.version == 2 and s.head.header_hash == header_hash
                and (s.verifies(key) if key is not None else not s.keyed())):
            usable.append(s)
    if not usable:
        return None, -1
    best = max(usable, key=lambda s: s.gen)
    return best, best.gen


def write_head(path: str, head: Head, key: bytes | None, fd: int | None = None, *,
               fresh: bool = False) -> None:
    """Make ``head`` the head record at ``path``, durably.

    A head file whose current slot is usable (whole, of this format, of the same journal,
    authenticated as this write is, in its place) gets ``head`` in its other slot, in place,
    with the next generation (one write, one fsync). Otherwise (no file, an earlier layout or
    format, no usable slot) the file is replaced atomically by one whose slots both hold
    ``head``, at consecutive generations. The temporary file has a fixed name
    (``<path>.tmp``): callers hold the journal's lock, so no two writers use it at once, and a
    crash leaves at most that one file behind (removed when the write fails).

    Args:
        path: the head file.
        head: the record.
        key: the ledger key (None: none).
        fd: a descriptor from :func:`open_for_write` to use (-1: there was no file); None:
            open it here.
        fresh: replace the file whatever it holds (a new ledger's: an earlier record at seq
            -1 may be another journal's).

    Raises:
        OSError: the file cannot be written.
    """
    own = fd is None
    if fd is None:
        fd = -1 if fresh else open_for_write(path)
    gen = 0
    try:
        if fd >= 0 and not fresh:
            current, top = _current_for(os.pread(fd, 2 * SLOT + 1, 0), key, head.header_hash)
            gen = top + 1
            if current is not None and current.index == current.gen % 2:
                data = _slot_bytes(head, gen, key)
                if os.pwrite(fd, data, (gen % 2) * SLOT) != len(data):
                    raise OSError(errno.ENOSPC, "short write of the head record")
                _datasync(fd)  # the file's size and name do not change
                return
    finally:
        if own and fd >= 0:
            os.close(fd)
    first, second = _slot_bytes(head, gen, key), _slot_bytes(head, gen + 1, key)
    data = first + second if gen % 2 == 0 else second + first
    tmp = path + ".tmp"
    tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                  0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(tfd, view):]
            os.fsync(tfd)
        finally:
            os.close(tfd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def dir_lock(directory: str) -> Iterator[None]:
    """An exclusive lock on ``directory`` (serialises ledger creation in it), best effort."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
