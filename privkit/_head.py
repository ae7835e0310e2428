"""The ledger's head record: evidence against rollback and tail loss (no accounting).

A journal (:mod:`privkit._journal`) is append-only, but a file can still lose its end: a
restore from an older backup, a deleted last batch, a cut to the header. Each such journal is
a valid ledger on its own, so the journal alone cannot tell. The head record, kept beside the
journal as ``<journal>.head``, is one line of canonical JSON::

    {"hash": ..., "header_hash": ..., "key_id": ..., "mac": ..., "schema": "privkit.ledger-head/1",
     "seq": ..., "size": ...}

``seq`` and ``hash`` are the last committed entry (seq -1 and the header's hash for a journal
without entries), ``size`` the journal's length in bytes through that entry, and
``header_hash`` names the journal it belongs to. It moves after every batch, once the batch
is durable in the journal, so a journal is never behind its head record except when it lost
committed entries.

The file holds the record twice over, in two slots of :data:`SLOT` bytes (the record, a
generation number and a checksum of both, then padding); the current record is the one of the
higher generation among the slots whose checksum holds. A batch writes the *other* slot in
place and fsyncs the file (one fsync, no new name): a write cut short by a crash spoils at most
that slot, and the other still names the batch before, which the journal is then one batch
ahead of (accepted, see :func:`check`). Creating the file, or replacing a file in the earlier
one-line layout, is atomic instead (temporary file, fsync, rename, fsync of the directory).

With a ledger key (``key=`` or the environment: :data:`KEY_ENV` holds the key text,
:data:`KEY_FILE_ENV` the path of a file holding it; at least :data:`MIN_KEY_BYTES` bytes),
``mac`` is HMAC-SHA256 of the record's other fields and ``key_id`` a fingerprint of the key
(never the key). Each entry's hash covers the entry before it, so the MAC over ``hash``
authenticates the whole chain up to ``seq``: a re-hashed, forged chain needs a new head
record, and only a key holder can write one.

Example:
    >>> head = Head(seq=-1, hash="ab" * 32, size=120, header_hash="ab" * 32)
    >>> Head.parse(head.to_bytes(None), None) == head
    True
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from privkit.errors import InvalidParameterError, LedgerError

__all__ = ["SCHEMA", "KEY_ENV", "KEY_FILE_ENV", "MIN_KEY_BYTES", "Head", "HeadUnreadable",
           "Problem", "check", "head_path", "load_key", "key_id", "read_head", "write_head",
           "fsync_dir", "dir_lock", "SLOT"]

SCHEMA = "privkit.ledger-head/1"
SLOT = 512
"""Bytes of each of the head file's two slots (one disk sector)."""
KEY_ENV = "PRIVKIT_LEDGER_KEY"
"""Environment variable holding the ledger key itself (UTF-8 text)."""
KEY_FILE_ENV = "PRIVKIT_LEDGER_KEY_FILE"
"""Environment variable holding the path of a file whose bytes are the ledger key (a trailing
newline is ignored)."""
MIN_KEY_BYTES = 16
_FIELDS = frozenset({"hash", "header_hash", "key_id", "mac", "schema", "seq", "size"})
_encode = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                           allow_nan=False).encode


def head_path(journal: str) -> str:
    """Where the head record of the journal ``journal`` lives: ``<journal>.head``."""
    return journal + ".head"


# --------------------------------------------------------------------------- keys
def load_key(key: Any = None) -> bytes | None:
    """The ledger key: ``key`` (bytes or str) if given, else from the environment, else None.

    Raises:
        InvalidParameterError: a key shorter than :data:`MIN_KEY_BYTES`, of another type, or
            both environment variables set.
        LedgerError: the key file cannot be read (names it).
    """
    name = "key"
    if key is None:
        text, path = os.environ.get(KEY_ENV), os.environ.get(KEY_FILE_ENV)
        if text is not None and path is not None:
            raise InvalidParameterError(KEY_ENV, "(set)", f"unset when {KEY_FILE_ENV} is set "
                                        "(one source of the ledger key)")
        if path is not None:
            try:
                with open(path, "rb") as f:
                    key = f.read().rstrip(b"\r\n")
            except OSError as exc:
                raise LedgerError(f"{KEY_FILE_ENV}: cannot read the ledger key file {path!r} "
                                  f"({exc.strerror or exc})") from None
            name = KEY_FILE_ENV
        elif text is not None:
            key, name = text, KEY_ENV
        else:
            return None
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, (bytes, bytearray)):
        raise InvalidParameterError(name, type(key).__name__, "bytes or a str")
    if len(key) < MIN_KEY_BYTES:
        raise InvalidParameterError(name, f"{len(key)} bytes", f"at least {MIN_KEY_BYTES} bytes")
    return bytes(key)


def key_id(key: bytes) -> str:
    """A public fingerprint of ``key`` (16 hex digits): tells keys apart, reveals nothing."""
    return hmac.new(key, b"privkit.ledger-head key id", hashlib.sha256).hexdigest()[:16]


# ------------------------------------------------------------------------- record
class HeadUnreadable(Exception):
    """A head record that is not one this privkit writes (the message says why)."""


@dataclass(frozen=True)
class Head:
    """The last committed entry of a journal (seq -1: only the header), as recorded."""

    seq: int
    hash: str
    size: int
    header_hash: str
    key_id: str | None = None
    mac: str | None = None

    def _body(self) -> dict[str, Any]:
        return {"hash": self.hash, "header_hash": self.header_hash, "key_id": self.key_id,
                "schema": SCHEMA, "seq": self.seq, "size": self.size}

    def _mac(self, key: bytes) -> str:
        return hmac.new(key, _encode(self._body()).encode("utf-8"), hashlib.sha256).hexdigest()

    def to_bytes(self, key: bytes | None) -> bytes:
        """The record's line, authenticated with ``key`` when one is given."""
        head = replace(self, key_id=None if key is None else key_id(key))
        fields = head._body() | {"mac": None if key is None else head._mac(key)}
        return (_encode(fields) + "\n").encode("utf-8")

    def verifies(self, key: bytes) -> bool:
        """Whether the record's MAC is the one ``key`` gives."""
        return self.mac is not None and hmac.compare_digest(self.mac, self._mac(key))

    def describe(self) -> str:
        return f"seq {self.seq} (hash {self.hash[:12]}..., {self.size} bytes)"

    @classmethod
    def parse(cls, data: bytes, path: str | None) -> Head:
        """The record in ``data`` (the MAC is not checked here).

        Raises:
            HeadUnreadable: not a head record of this schema.
        """
        try:
            obj = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError):
            raise HeadUnreadable(f"{path}: not a JSON head record") from None
        if not isinstance(obj, Mapping) or obj.get("schema") != SCHEMA or set(obj) != _FIELDS:
            raise HeadUnreadable(f"{path}: not a {SCHEMA} record")
        seq, size = obj["seq"], obj["size"]
        ok = (all(isinstance(v, int) and not isinstance(v, bool) for v in (seq, size))
              and seq >= -1 and size > 0
              and all(_is_hex(obj[k], 64) for k in ("hash", "header_hash"))
              and (obj["mac"] is None or _is_hex(obj["mac"], 64))
              and (obj["key_id"] is None or _is_hex(obj["key_id"], 16))
              and (obj["mac"] is None) == (obj["key_id"] is None))
        if not ok:
            raise HeadUnreadable(f"{path}: a field of the head record has the wrong type")
        return cls(seq, obj["hash"], size, obj["header_hash"], obj["key_id"], obj["mac"])


@dataclass(frozen=True)
class Problem:
    """How a journal disagrees with its head record: ``kind`` (a short code: ``missing``,
    ``unreadable``, ``other``, ``unauthenticated``, ``needs-key``, ``bad-mac``, ``behind``,
    ``diverged``) and a one-line ``message``."""

    kind: str
    message: str


def check(head: Head | None, *, journal: str, header_hash: str, journal_seq: int,
          hash_at: Callable[[int], str], size_at: int | None,
          key: bytes | None) -> Problem | None:
    """Whether the journal (``journal_seq``: its last committed entry; ``hash_at(seq)``: the
    hash of an entry; ``size_at``: its length through the batch that ends at ``head.seq``,
    None if none does) agrees with its head record ``head`` (None: there is none).

    None means it does: the journal holds every committed entry, and perhaps a batch more
    (a crash between the journal's fsync and the head record's). A missing head record is a
    problem only when a key is set (without one it is a ledger from before head records).
    """
    where = head_path(journal)
    if head is None:
        if key is None:
            return None
        return Problem("missing", f"{journal}: no head record ({where} is missing) although a "
                       "ledger key is set: deleting it could hide a rollback")
    if head.header_hash != header_hash:
        return Problem("other", f"{journal}: the head record {where} belongs to another journal "
                       f"(header hash {head.header_hash[:12]}..., this one {header_hash[:12]}...)")
    if key is None and head.mac is not None:
        return Problem("needs-key", f"{journal}: the head record {where} is authenticated (key "
                       f"id {head.key_id}); set {KEY_ENV} or {KEY_FILE_ENV} to open this ledger")
    if key is not None and head.mac is None:
        return Problem("unauthenticated", f"{journal}: the head record {where} carries no MAC "
                       "although a ledger key is set (written without the key, or forged)")
    if key is not None and not head.verifies(key):
        return Problem("bad-mac", f"{journal}: the head record {where} does not verify with this "
                       f"ledger key (key id {key_id(key)}, the record's {head.key_id}): forged, "
                       "or written with another key")
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
    return None


def _is_hex(value: Any, length: int) -> bool:
    return (isinstance(value, str) and len(value) == length
            and all(c in "0123456789abcdef" for c in value))


# -------------------------------------------------------------------------- files
def _slot_bytes(record: bytes, gen: int) -> bytes:
    """One slot: ``record<TAB>gen<TAB>checksum`` and a newline, padded to :data:`SLOT`."""
    body = record.rstrip(b"\n") + b"\t%d" % gen
    line = body + b"\t" + hashlib.sha256(body).hexdigest()[:32].encode() + b"\n"
    if len(line) > SLOT:  # a record is ~330 bytes; seq and size would need ~90 digits
        raise LedgerError(f"head record of {len(line)} bytes does not fit a {SLOT}-byte slot")
    return line + b" " * (SLOT - len(line))


def _slots(data: bytes, path: str | None) -> tuple[Head, int] | None:
    """The current (record, generation) of a two-slot file, None if ``data`` is not one;
    :class:`HeadUnreadable` if it is one but no slot's checksum holds."""
    if len(data) != 2 * SLOT or b"\t" not in data:
        return None
    best: tuple[Head, int] | None = None
    for i in (0, 1):
        line = data[i * SLOT:(i + 1) * SLOT].split(b"\n", 1)[0]
        body, _, check_ = line.rpartition(b"\t")
        record, _, gen = body.rpartition(b"\t")
        if (not gen.isdigit() or len(check_) != 32
                or not hmac.compare_digest(hashlib.sha256(body).hexdigest()[:32].encode(),
                                           check_)):
            continue  # a slot whose write never completed
        head = Head.parse(record, path)
        if best is None or int(gen) > best[1]:
            best = (head, int(gen))
    if best is None:
        raise HeadUnreadable(f"{path}: neither slot of the head record is whole")
    return best


def read_head(path: str) -> Head | None:
    """The head record at ``path`` (the current slot's), or None if there is none.

    Raises:
        HeadUnreadable: the file is not a head record.
        OSError: it cannot be read.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except FileNotFoundError:
        return None
    found = _slots(data, path)
    return Head.parse(data, path) if found is None else found[0]


_datasync = getattr(os, "fdatasync", os.fsync)


def fsync_dir(directory: str) -> None:
    """fsync a directory (persists a rename or a new name in it; POSIX)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_head(path: str, head: Head, key: bytes | None) -> None:
    """Make ``head`` the head record at ``path``, durably.

    A two-slot file whose current slot is readable gets ``head`` in its other slot, in place,
    with the next generation (one write, one fsync). Otherwise (no file, the one-line layout, no
    whole slot) the file is replaced atomically by one whose slots both hold ``head``. The
    temporary file has a fixed name (``<path>.tmp``): callers hold the journal's lock, so no two
    writers use it at once, and a crash leaves at most that one file behind.
    """
    record = head.to_bytes(key)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        fd = -1
    if fd >= 0:
        try:
            try:
                found = _slots(os.pread(fd, 2 * SLOT + 1, 0), path)
            except HeadUnreadable:
                found = None
            if found is not None:
                gen = found[1] + 1
                data = _slot_bytes(record, gen)
                if os.pwrite(fd, data, (gen % 2) * SLOT) != len(data):
                    raise OSError(28, "short write of the head record")
                _datasync(fd)  # the file's size and name do not change
                return
        finally:
            os.close(fd)
    data = _slot_bytes(record, 0) * 2
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
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
