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

Example:
    >>> head = Head(seq=-1, hash="ab" * 32, size=120, header_hash="ab" * 32)
    >>> Head.parse(head.to_bytes(None), None) == head
    True
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from privkit.errors import InvalidParameterError, LedgerError

__all__ = ["SCHEMA", "SCHEMA_V1", "KEY_ENV", "KEY_FILE_ENV", "MIN_KEY_BYTES", "Head",
           "HeadFile", "HeadUnreadable", "Problem", "Reading", "Slot", "check", "head_path",
           "load_key", "key_id", "open_for_write", "read_file", "read_head", "select",
           "write_head", "fsync_dir", "dir_lock", "SLOT"]

SCHEMA = "privkit.ledger-head/2"
"""Schema of the record in each slot this privkit writes (its MAC is the slot's)."""
SCHEMA_V1 = "privkit.ledger-head/1"
"""Schema of earlier privkits' records: the one-line layout, and slots of format 1 (the MAC,
a field of the record, leaves the generation out)."""
SLOT = 512
"""Bytes of each of the head file's two slots (one disk sector)."""
KEY_ENV = "PRIVKIT_LEDGER_KEY"
"""Environment variable holding the ledger key itself (UTF-8 text)."""
KEY_FILE_ENV = "PRIVKIT_LEDGER_KEY_FILE"
"""Environment variable holding the path of a file whose bytes are the ledger key (a trailing
newline is ignored)."""
MIN_KEY_BYTES = 16
_FIELDS = frozenset({"hash", "header_hash", "key_id", "schema", "seq", "size"})
_FIELDS_V1 = _FIELDS | {"mac"}
_SLOT_MAC = b"privkit.ledger-head/2 slot\n"
"""What a slot's MAC input starts with (no other MAC of the key can pass for one)."""
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
    """The last committed entry of a journal (seq -1: only the header), as recorded.

    ``key_id`` is the fingerprint of the key a record was written with (None: none);
    ``mac`` only the MAC of a record of :data:`SCHEMA_V1` (a slot of this privkit keeps its
    MAC in the slot, :class:`Slot`).
    """

    seq: int
    hash: str
    size: int
    header_hash: str
    key_id: str | None = None
    mac: str | None = None

    def _body(self) -> dict[str, Any]:
        return {"hash": self.hash, "header_hash": self.header_hash, "key_id": self.key_id,
                "schema": SCHEMA_V1, "seq": self.seq, "size": self.size}

    def _mac(self, key: bytes) -> str:
        return hmac.new(key, _encode(self._body()).encode("utf-8"), hashlib.sha256).hexdigest()

    def to_bytes(self, key: bytes | None) -> bytes:
        """The record's line in the one-line layout of earlier privkits (:data:`SCHEMA_V1`),
        authenticated with ``key`` when one is given. This privkit reads that layout and
        never writes it (:func:`write_head` writes slots)."""
        head = replace(self, key_id=None if key is None else key_id(key))
        fields = head._body() | {"mac": None if key is None else head._mac(key)}
        return (_encode(fields) + "\n").encode("utf-8")

    def record(self, key: bytes | None) -> bytes:
        """The record of a slot of this privkit (:data:`SCHEMA`; no MAC in it)."""
        return _encode({"hash": self.hash, "header_hash": self.header_hash,
                        "key_id": None if key is None else key_id(key), "schema": SCHEMA,
                        "seq": self.seq, "size": self.size}).encode("utf-8")

    def verifies(self, key: bytes) -> bool:
        """Whether the MAC of a :data:`SCHEMA_V1` record is the one ``key`` gives."""
        return self.mac is not None and hmac.compare_digest(self.mac, self._mac(key))

    def describe(self) -> str:
        return f"seq {self.seq} (hash {self.hash[:12]}..., {self.size} bytes)"

    @classmethod
    def parse(cls, data: bytes, path: str | None) -> Head:
        """The :data:`SCHEMA_V1` record in ``data`` (the MAC is not checked here).

        Raises:
            HeadUnreadable: not a head record of that schema.
        """
        obj = _json_record(data, path, SCHEMA_V1, _FIELDS_V1)
        if not ((obj["mac"] is None or _is_hex(obj["mac"], 64))
                and (obj["mac"] is None) == (obj["key_id"] is None)):
            raise HeadUnreadable(f"{path}: a field of the head record has the wrong type")
        return cls(obj["seq"], obj["hash"], obj["size"], obj["header_hash"], obj["key_id"],
                   obj["mac"])


def _json_record(data: bytes, path: str | None, schema: str,
                 fields: frozenset[str]) -> dict[str, Any]:
    """The JSON object of a head record of ``schema`` with ``fields``, its common fields
    checked."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        raise HeadUnreadable(f"{path}: not a JSON head record") from None
    if not isinstance(obj, Mapping) or obj.get("schema") != schema or set(obj) != fields:
        raise HeadUnreadable(f"{path}: not a {schema} record")
    seq, size = obj["seq"], obj["size"]
    ok = (all(isinstance(v, int) and not isinstance(v, bool) for v in (seq, size))
          and seq >= -1 and size > 0
          and all(_is_hex(obj[k], 64) for k in ("hash", "header_hash"))
          and (obj["key_id"] is None or _is_hex(obj["key_id"], 16)))
    if not ok:
        raise HeadUnreadable(f"{path}: a field of the head record has the wrong type")
    return dict(obj)


def _is_hex(value: Any, length: int) -> bool:
    return (isinstance(value, str) and len(value) == length
            and all(c in "0123456789abcdef" for c in value))


def _slot_mac(key: bytes, body: bytes) -> str:
    """The MAC of a slot whose record and generation are ``body`` (``record\\tgen``)."""
    return hmac.new(key, _SLOT_MAC + body, hashlib.sha256).hexdigest()


def _checksum(data: bytes) -> bytes:
    return hashlib.sha256(data).hexdigest()[:32].encode()


@dataclass(frozen=True)
class Slot:
    """A whole slot of a head file: its place ``index`` (0 or 1), record, generation,
    ``version`` (2: this privkit's; 1: an earlier privkit's, whose MAC is the record's and
    leaves the generation out) and, for version 2, its MAC (None: written without a key)
    and ``body``, the bytes the MAC is of (the record and the generation as written)."""

    index: int
    head: Head
    gen: int
    version: int
    mac: str | None = None
    body: bytes = field(default=b"", repr=False)

    def keyed(self) -> bool:
        """Whether the slot was written with a key."""
        return self.head.key_id is not None

    def verifies(self, key: bytes) -> bool:
        """Whether ``key`` authenticates the slot (version 1: its record only)."""
        if self.version == 1:
            return self.head.verifies(key)
        return (self.mac is not None and self.head.key_id == key_id(key)
                and hmac.compare_digest(self.mac, _slot_mac(key, self.body)))

    def describe(self) -> str:
        return f"slot {self.index}: {self.head.describe()}, generation {self.gen}"


def _slot_bytes(head: Head, gen: int, key: bytes | None) -> bytes:
    """Slot ``gen % 2`` holding ``head`` at generation ``gen``, MACed with ``key`` if given."""
    body = head.record(key) + b"\t%d" % gen
    line = body + b"\t" + (b"-" if key is None else _slot_mac(key, body).encode())
    line += b"\t" + _checksum(line) + b"\n"
    if len(line) > SLOT:  # a slot is ~390 bytes; seq and size would need ~60 digits
        raise LedgerError(f"head record of {len(line)} bytes does not fit a {SLOT}-byte slot")
    return line + b" " * (SLOT - len(line))


def _parse_slot(data: bytes, index: int, path: str | None) -> Slot | str:
    """The slot in ``data`` (:data:`SLOT` bytes) at place ``index``, or why it is not whole.

    Raises:
        HeadUnreadable: the slot is whole (its checksum holds) but holds no head record.
    """
    line, newline, pad = data.partition(b"\n")
    parts = line.split(b"\t")
    if not newline or pad.strip(b" ") or len(parts) not in (3, 4):
        return "not a slot (cut short, or overwritten)"
    if not hmac.compare_digest(_checksum(line[:line.rindex(b"\t")]), parts[-1]):
        return "its checksum fails (cut short, or changed)"
    record, gen = parts[0], parts[1]
    if not (gen.isdigit() and len(gen) <= 18 and (gen == b"0" or not gen.startswith(b"0"))):
        raise HeadUnreadable(f"{path}: slot {index} has no generation number")
    if len(parts) == 3:  # format 1: record (with its MAC), generation, checksum
        return Slot(index, Head.parse(record, path), int(gen), 1)
    obj = _json_record(record, path, SCHEMA, _FIELDS)
    mac = parts[2].decode("ascii", "replace")
    if not ((mac == "-") == (obj["key_id"] is None) and (mac == "-" or _is_hex(mac, 64))):
        raise HeadUnreadable(f"{path}: slot {index} has a malformed MAC")
    head = Head(obj["seq"], obj["hash"], obj["size"], obj["header_hash"], obj["key_id"])
    return Slot(index, head, int(gen), 2, None if mac == "-" else mac,
                record + b"\t" + gen)


@dataclass(frozen=True)
class HeadFile:
    """What a head file holds: two slots (each a :class:`Slot`, or why it is not whole), or
    one record in the one-line layout of earlier privkits (``record``)."""

    path: str
    slots: tuple[Slot | str, Slot | str] | None = None
    record: Head | None = None

    def whole(self) -> list[Slot]:
        """The whole slots, by place."""
        return [s for s in self.slots or () if isinstance(s, Slot)]

    def current(self) -> Head:
        """The record of the whole slot of the highest generation (of the first, if tied), or
        the one-line record: what the file says without a key."""
        whole = self.whole()
        if not whole:
            assert self.record is not None
            return self.record
        return max(whole, key=lambda s: s.gen).head


def read_file(path: str) -> HeadFile | None:
    """The head file at ``path``, or None if there is none.

    Raises:
        HeadUnreadable: the file is not a head record, or neither slot is whole.
        OSError: it cannot be read (a directory, no permission, ...).
    """
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except FileNotFoundError:
        return None
    if len(data) != 2 * SLOT or b"\t" not in data:
        return HeadFile(path, record=Head.parse(data, path))
    slots = (_parse_slot(data[:SLOT], 0, path), _parse_slot(data[SLOT:], 1, path))
    found = HeadFile(path, slots=slots)
    if not found.whole():
        raise HeadUnreadable(f"{path}: neither slot of the head record is whole")
    return found


def read_head(path: str) -> Head | None:
    """The current record of the head file at ``path`` as it reads without a key (the whole
    slot of the higher generation), or None if there is none.

    Raises:
        HeadUnreadable: the file is not a head record.
        OSError: it cannot be read.
    """
    found = read_file(path)
    return None if found is None else found.current()


# ------------------------------------------------------------------- judgement
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
    only when it was written with a key. With one: see the module doc.
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
