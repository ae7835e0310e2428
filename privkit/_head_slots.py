"""The head record's bytes: where it lives, the ledger key, the record and its two slots.

:class:`Head` (a record), :class:`Slot` (a whole slot of a head file) and :class:`HeadFile`
(what a file holds), the key that authenticates them (:func:`load_key`, :func:`key_id`), how a
slot is made (``_slot_bytes``) and read back (:func:`read_file`, :func:`read_head`). Apart from
the judgement of a file against its journal (:mod:`privkit._head_check`) and its writing
(:mod:`privkit._head`, which re-exports every public name here): this is the layout both of
them read, described in :mod:`privkit._head`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from privkit.errors import InvalidParameterError, LedgerError

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

