"""The ledger's on-disk format and durable file I/O (no accounting).

:class:`privkit.ledger.Ledger` decides what to charge; this module turns its
charges into bytes, verifies them when a journal is read back, and makes them
durable. It stores events and cached epsilons as JSON but never prices them.

Format ``privkit.ledger/2`` (JSON Lines): line 1 is the header, every further
line an entry, each with ``hash`` = SHA-256 of its canonical JSON without
``hash`` (sorted keys, no spaces, UTF-8, no NaN). Entries chain globally
(``prev_hash``) and per client (``client_prev_hash``, with ``client_seq``
counting a client's entries from 0), both from the header's hash. A ``spend``
entry charges one client; a ``fork`` entry records continuing from an older
entry (``from_seq``, ``from_hash``); a ``recover`` entry records an explicit recovery from a
journal that disagreed with its head record (:mod:`privkit._head`): the head record it
found (or None), the problem, the reason given and when. One charge is one batch, whose entries
share ``batch_end`` (the seq of its last entry). A *write* is one ``os.write`` and one
``os.fsync`` of one or more whole batches: a durable charge is a write of its own batch; charges
deferred (:meth:`privkit.ledger.Ledger.spend` with ``durable=False``) are staged in memory and
written together, each still its own batch, at the next sync (:meth:`Journal.flush`), so a
journal's bytes do not depend on how its charges were grouped into writes (without a key).
Unparsable trailing lines and an incomplete final batch (with a key: an incomplete final write,
below) come from a write whose fsync never returned: they are ignored on load and cut off before
the next append. After every write the head record beside the journal is replaced
(:mod:`privkit._head`), so a journal that lost committed entries is told apart from one cut by a
crash.

A spend entry's ``eps_after`` caches the client's epsilon after the charge when the ledger
priced it (``"inf"`` for no noise), else null: a charge is priced only when the budget check
needed it (never without a budget). Format ``privkit.ledger/1``, the same but with a number in
every ``eps_after``, is still read and appended to in its own format.

**Batch MACs.** With a ledger key, the last entry of every batch carries ``mac``: HMAC-SHA256
under the key of :data:`BATCH_MAC_PREFIX` and the entry's canonical JSON without ``hash`` and
``mac`` (:func:`batch_mac`); ``hash`` is then computed over the entry with its ``mac``, as
always. In a write of several batches (deferred charges) every batch but the last is MACed under
:data:`BATCH_MAC_MORE_PREFIX` instead: the write goes on. The MAC thus also authenticates where
each write ends, and a keyed journal is read write by write: a final write without its last batch
(cut short by a crash, or by someone) is ignored like a torn tail, and the head record's rule
that a crash leaves the journal at most one write ahead of it (:mod:`privkit._head`) counts
writes. The entry names its seq, its batch and, through ``prev_hash``, the whole chain before
it, so one MAC per batch authenticates the batch and everything before it: the batch a crash
can leave beyond the head record (written and synced before the record) is accepted only if it
verifies, and no one without the key can append, substitute or re-hash a batch. A ledger
created with a key is of format :data:`SCHEMA_KEYED` (``privkit.ledger/3``: otherwise
``privkit.ledger/2``), in which every batch must carry a MAC that verifies; in a keyed journal
of format ``/2`` or ``/1`` (written before batch MACs) batches without one are accepted only up
to the authenticated head record and before the first batch with one, and every batch
appended carries one. A ``recover`` entry that is itself authenticated vouches for the
batches before it (the recovery accepted the journal as it was). Without a key nothing is
written or checked, and a keyless journal is byte for byte what it was.

Example:
    >>> canonical_json({"b": 1, "a": ["é", 0.5]})
    '{"a":["é",0.5],"b":1}'
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import hmac
import json
import math
import os
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeGuard

from privkit import _head, _validate
from privkit.accountants.accountant import Method
from privkit.errors import InvalidParameterError, LedgerCorruptError, LedgerError
from privkit.events.mechanisms import as_relation

SCHEMA = "privkit.ledger/2"
"""The format of a ledger created without a key."""
SCHEMA_KEYED = "privkit.ledger/3"
"""The format of a ledger created with a key: ``/2`` with a MAC in every batch (module doc)."""
#: Formats this privkit reads: ``/1`` (every ``eps_after`` a number), ``/2`` (``eps_after``
#: may be null) and ``/3`` (``/2``, every batch MACed); it appends to a journal in the format of
#: its header (with a MAC in each batch whenever a key is set).
SCHEMAS = ("privkit.ledger/1", SCHEMA, SCHEMA_KEYED)
BATCH_MAC_PREFIX = b"privkit.ledger/3 batch\n"
"""What a batch MAC's input starts with (no other MAC of the ledger key can pass for one)."""
BATCH_MAC_MORE_PREFIX = b"privkit.ledger/3 batch, its write goes on\n"
"""What the MAC input of a batch that is not the last of its write starts with (a write of
deferred charges): a write that lost its last batch is told apart from a whole one."""
NOISE_READING = "per-contribution"
"""What a noise multiplier means in a journal's events, recorded in every new header
(``noise_reading``): stddev / C, C the bound on one contribution, under every relation (the
accountant doubles the sensitivity under REPLACE_ONE, as Opacus and dp-accounting's PLD do). A
header without it was written when a REPLACE_ONE noise multiplier meant stddev / (2C); under
ADD_OR_REMOVE_ONE both readings are one."""
canonical_json = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
"""The canonical JSON text of a value (what entry hashes are computed over)."""
_SPEND_KEYS = frozenset({
    "batch_end", "client_id", "client_prev_hash", "client_seq", "count", "eps_after", "event",
    "hash", "kind", "label", "meta", "prev_hash", "round", "run_id", "seq", "step"})
_FORK_KEYS = frozenset(
    {"batch_end", "from_hash", "from_seq", "hash", "kind", "prev_hash", "run_id", "seq"})
_RECOVER_KEYS = frozenset(
    {"at", "batch_end", "hash", "head_record", "kind", "prev_hash", "problem", "reason", "seq"})
_UNMACED = frozenset({"hash", "mac"})


# ------------------------------------------------------- values and hashes
def hash_hex(fields: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of ``fields``."""
    return hashlib.sha256(canonical_json(fields).encode("utf-8")).hexdigest()


def batch_mac(key: bytes, body: str, more: bool = False) -> str:
    """The MAC of a batch whose last entry, without ``hash`` and ``mac``, has the canonical
    JSON ``body``: HMAC-SHA256 under ``key`` of :data:`BATCH_MAC_PREFIX` and ``body`` (of
    :data:`BATCH_MAC_MORE_PREFIX` with ``more``: a batch that its write's next batch follows)."""
    prefix = BATCH_MAC_MORE_PREFIX if more else BATCH_MAC_PREFIX
    return hmac.new(key, prefix + body.encode("utf-8"), hashlib.sha256).hexdigest()


def _hash_matches(body: Mapping[str, Any], expected: Any) -> bool:
    try:
        return hash_hex(body) == expected
    except (TypeError, ValueError):
        return False


def is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_mac(value: Any) -> bool:
    """A MAC as written: 64 lower-case hex digits."""
    return (isinstance(value, str) and len(value) == 64
            and all(c in "0123456789abcdef" for c in value))


def _is_str_or_none(value: Any) -> bool:
    return value is None or isinstance(value, str)


def optional(name: str, value: Any, kind: type) -> Any:
    """None, or a str (``kind=str``) or an int >= 0 (``kind=int``)."""
    if value is None or (kind is str and isinstance(value, str)):
        return value
    if kind is int:
        return _validate.nonnegative_int(name, value)
    raise InvalidParameterError(name, value, "a string or None")


def eps_after(entry: Mapping[str, Any]) -> float | None:
    """The cached epsilon of a verified spend entry (``"inf"`` is infinity; None: the charge
    was not priced)."""
    eps = entry["eps_after"]
    return None if eps is None else math.inf if eps == "inf" else float(eps)


def errno_text(exc: OSError) -> str:
    """``ENOSPC: No space left on device`` for an OSError (its text if it has no errno)."""
    code = exc.errno
    name = errno.errorcode.get(code) if isinstance(code, int) else None
    if code is None or name is None:
        return str(exc.strerror or exc)
    return f"{name}: {exc.strerror or os.strerror(code)}"


def fs_error(path: str, action: str, exc: OSError, then: str = "") -> LedgerError:
    """The :class:`LedgerError` for a file-system error: ``<path>: cannot <action> (<errno
    name>: <strerror>)`` and ``then`` (e.g. what was or was not changed)."""
    return LedgerError(f"{path}: cannot {action} ({errno_text(exc)}){then}")


def as_path(value: Any) -> str:
    """``value`` as a journal path (a non-empty str or os.PathLike of one).

    Raises:
        InvalidParameterError: anything else (naming ``path``).
    """
    try:
        path = os.fspath(value)
    except TypeError:
        path = None
    if not (isinstance(path, str) and path and "\0" not in path):
        raise InvalidParameterError("path", value, "a file path (a non-empty str or "
                                    "os.PathLike)")
    return path


def corrupt(path: str | None, lineno: int, msg: str) -> LedgerCorruptError:
    """The error for a bad line ``lineno`` (1: the header) of the journal ``path``."""
    return LedgerCorruptError(f"{path}: line {lineno}: {msg}")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def parse_line(line: bytes) -> dict[str, Any] | None:
    """The JSON object on a complete ``line``, else None (json only; nothing is unpickled)."""
    if not line.endswith(b"\n"):
        return None
    try:
        obj = json.loads(line.decode("utf-8"), parse_constant=_no_constants)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


# ------------------------------------------------------------------ header
def make_header(population_id: Any, delta: Any, epsilon_budget: Any, method: Any,
                neighboring_relation: Any, created: Any, schema: Any = SCHEMA,
                noise_reading: Any = NOISE_READING) -> dict[str, Any]:
    """A validated header (without its hash) of format ``schema`` (one of :data:`SCHEMAS`)
    recording ``noise_reading`` (:data:`NOISE_READING`; None: a header of an earlier privkit,
    without the field)."""
    if not (isinstance(population_id, str) and population_id):
        raise InvalidParameterError("population_id", population_id, "a non-empty string")
    relation = as_relation(neighboring_relation)
    header = {
        "schema": schema, "kind": "header", "population_id": population_id,
        "delta": _validate.delta("delta", delta),
        "epsilon_budget": (None if epsilon_budget is None
                           else _validate.positive("epsilon_budget", epsilon_budget)),
        "method": Method.parse(method).value, "neighboring_relation": relation.name,
        "created": optional("created", created, str),
    }
    if noise_reading is not None:
        if noise_reading != NOISE_READING:
            raise InvalidParameterError("noise_reading", noise_reading, repr(NOISE_READING))
        header["noise_reading"] = noise_reading
    return header


def check_header(h: dict[str, Any] | None, path: str) -> dict[str, Any]:
    """``h`` (line 1 of ``path``, parsed) if it is a valid, unedited header of this schema."""
    def bad(msg: str) -> LedgerCorruptError:
        return corrupt(path, 1, msg)

    if h is None:
        raise bad("not a ledger header (a JSON object line)")
    schema, prefix = h.get("schema"), SCHEMA.split("/")[0] + "/"
    if schema not in SCHEMAS:
        version = str(schema)[len(prefix):] if str(schema).startswith(prefix) else ""
        if version.isdigit() and int(version) > 1:
            raise bad(f"schema {schema!r} is newer than this privkit reads ({SCHEMAS[-1]!r}); "
                      "upgrade privkit")
        raise bad(f"unknown schema {schema!r}; expected {SCHEMA!r} or {SCHEMA_KEYED!r}")
    body = {k: v for k, v in h.items() if k != "hash"}
    if not _hash_matches(body, h.get("hash")):
        raise bad("header hash mismatch (the header was edited or damaged)")
    reading = body.get("noise_reading")
    if "noise_reading" in body and reading != NOISE_READING:
        raise LedgerError(f"{path}: line 1: unknown noise_reading {reading!r} (this privkit "
                          f"reads {NOISE_READING!r}): written by another privkit version, "
                          "whose meaning of a noise multiplier this one would not apply; open "
                          "it with that version")
    try:
        ok = make_header(*(body.get(k) for k in ("population_id", "delta", "epsilon_budget",
                                                 "method", "neighboring_relation",
                                                 "created", "schema", "noise_reading"))) == body
    except InvalidParameterError as exc:
        raise bad(f"invalid header: {exc}") from None
    if not ok:
        raise bad(f"unexpected header fields {sorted(h)}")
    relation = body["neighboring_relation"]
    if reading is None and relation == "REPLACE_ONE":
        raise LedgerError(
            f"{path}: the ledger was written when a REPLACE_ONE noise multiplier meant stddev "
            "/ (2C); its epsilons would be re-read under the new reading (stddev / C, the "
            "accountant doubling the sensitivity); it cannot be continued by this version; "
            "report it with the version that wrote it, or start a new ledger")
    if reading is None and relation != "ADD_OR_REMOVE_ONE":
        raise LedgerError(
            f"{path}: the ledger was written under {relation} before privkit recorded what a "
            f"noise multiplier means ({NOISE_READING!r}: stddev / C), so its epsilons could be "
            "re-read under another reading; it cannot be continued by this version; report it "
            "with the version that wrote it, or start a new ledger")
    return h


# ----------------------------------------------------------------- entries
def _meta_json(meta: Any) -> str:
    """Canonical JSON of ``meta``, which must read back to the same text."""
    try:
        text = canonical_json(None if meta is None else dict(meta))
        ok = ((meta is None or isinstance(meta, Mapping))
              and canonical_json(json.loads(text)) == text)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidParameterError("meta", meta, "None or a JSON object (str keys, finite)")
    return text


def spend_fields(label: Any, meta: Any, round_: Any, step: Any, run_id: Any) -> dict[str, str]:
    """Validate fields that all entries of a spend batch share; return their canonical JSON.

    Raises:
        InvalidParameterError: a bad value (named in the message).
    """
    if not (isinstance(label, str) and label):
        raise InvalidParameterError("label", label, "a non-empty string")
    return {"label": _str_json(label), "meta": "null" if meta is None else _meta_json(meta),
            "round": _int_json(optional("round", round_, int)),
            "step": _int_json(optional("step", step, int)),
            "run_id": _str_json(optional("run_id", run_id, str))}


def _int_json(value: int | None) -> str:
    """Canonical JSON of None or an int (what ``canonical_json`` gives, without the encoder)."""
    return "null" if value is None else str(int(value))


@functools.lru_cache(maxsize=256)
def _str_json(value: str | None) -> str:
    """Canonical JSON of None or a str (labels and run ids repeat: cached)."""
    return canonical_json(value)


def _recover_fields_ok(e: Mapping[str, Any]) -> bool:
    """Types of a recover entry's own fields."""
    record = e["head_record"]
    return (isinstance(e["problem"], str) and isinstance(e["reason"], str) and bool(e["reason"])
            and _is_str_or_none(e["at"])
            and (record is None or (isinstance(record, dict)
                                    and set(record) == {"hash", "seq", "size"}
                                    and is_int(record["seq"]) and is_int(record["size"])
                                    and isinstance(record["hash"], str))))


def _spend_fields_ok(e: Mapping[str, Any], null_eps: bool) -> bool:
    """Types and ranges of a spend entry's own fields (not its chain links); ``null_eps``:
    the format allows a null ``eps_after``."""
    eps = e["eps_after"]
    return (is_int(e["count"]) and e["count"] >= 1 and isinstance(e["label"], str)
            and isinstance(e["event"], dict) and isinstance(e["meta"], (dict, type(None)))
            and (eps == "inf" or (eps is None and null_eps)
                 or (isinstance(eps, (int, float)) and eps >= 0 and not isinstance(eps, bool)))
            and _is_str_or_none(e["run_id"])
            and all(e[k] is None or (is_int(e[k]) and e[k] >= 0) for k in ("round", "step")))


def _spend_lines(first: int, prev: str, ids: list[str], links: list[tuple[int, str]],
                 eps: Sequence[float | None], fixed: Mapping[str, str],
                 events: Sequence[tuple[str, str]] | None = None,
                 key: bytes | None = None, more: bool = False) -> tuple[bytes, list[str]]:
    """The lines of one spend batch starting at seq ``first`` after hash ``prev``, and hashes.

    ``links`` holds each client's (client_seq, client_prev_hash); ``fixed`` the
    canonical JSON of the fields every entry shares (count, event, label, meta,
    round, run_id, step); ``events``, if given, each entry's own (event, count) JSON instead;
    ``key``, if given, the ledger key that MACs the batch (in its last entry, :func:`batch_mac`;
    ``more``: another batch of the same write follows).
    """
    # Canonical JSON built by hand (keys in sorted order) for speed; Journal.load
    # re-checks every hash and MAC with the generic encoder.
    lines, hashes = [], []
    end = first + len(ids) - 1
    label = '"kind":"spend","label":' + fixed["label"]
    post = label + ',"meta":' + fixed["meta"] + ',"prev_hash":"'
    last = ',"round":' + fixed["round"] + ',"run_id":' + fixed["run_id"] + ',"seq":'
    step = ',"step":' + fixed["step"] + "}"
    for k, (cid, (cseq, cprev)) in enumerate(zip(ids, links, strict=True)):
        e = eps[k]
        e_json = "null" if e is None else repr(e) if math.isfinite(e) else '"inf"'
        event, count = (fixed["event"], fixed["count"]) if events is None else events[k]
        head = (f'{{"batch_end":{end},"client_id":{canonical_json(cid)},'
                f'"client_prev_hash":"{cprev}","client_seq":{cseq},"count":{count},'
                f'"eps_after":{e_json},"event":{event},')
        rest = f'{post}{prev}"{last}{first + k}{step}'
        if key is not None and k == len(ids) - 1:  # "mac" sorts between "label" and "meta"
            mac = batch_mac(key, head + rest, more)
            rest = f'{label},"mac":"{mac}"{rest[len(label):]}'
        prev = hashlib.sha256((head + rest).encode("utf-8")).hexdigest()
        lines.append(f'{head}"hash":"{prev}",{rest}\n')
        hashes.append(prev)
    return "".join(lines).encode("utf-8"), hashes


def _with_hash(entry: dict[str, Any], key: bytes | None) -> dict[str, Any]:
    """A one-entry batch ``entry`` (without ``hash``) with its ``mac`` (with ``key``) and
    ``hash``."""
    if key is not None:
        entry["mac"] = batch_mac(key, canonical_json(entry))
    entry["hash"] = hash_hex(entry)
    return entry


# ------------------------------------------------------------------- files
def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _temp_file(path: str) -> tuple[int, str]:
    """A new temporary file beside ``path``, open for writing, with the mode an ordinary file
    gets (0o666 less the umask, like the plots and the head record beside it) rather than
    ``mkstemp``'s 0o600: nothing privkit writes is meant to be more private than the directory
    it is in."""
    directory = os.path.dirname(os.path.abspath(path))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary file name", path)


def _durable_temp(path: str, data: bytes) -> str:
    fd, tmp = _temp_file(path)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically (temp file, fsync, rename, fsync directory)."""
    path = os.fspath(path)
    tmp = _durable_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    _head.fsync_dir(os.path.dirname(os.path.abspath(path)))


def create_file(path: str, header: Mapping[str, Any], key: bytes | None = None) -> int:
    """Create the journal ``path`` holding the (hashed) ``header`` whole; return its size.

    The head record (seq -1) is written first and the journal linked into place after it,
    so a crash leaves either no journal or a journal with its head record. Creation in one
    directory is serialised by a lock on the directory. A failed write leaves no journal (at
    most a head record at seq -1, which a later creation replaces).

    Raises:
        LedgerError: ``path`` exists (it is never clobbered), or it does not but a head
            record says entries of it were committed (the journal was deleted or moved); its
            directory does not exist; a file cannot be written (names it and the error).
    """
    data = (canonical_json(header) + "\n").encode("utf-8")
    head_file = _head.head_path(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.lexists(directory) else "does not exist"
        raise LedgerError(f"{path}: cannot create the ledger: its directory {directory!r} "
                          f"{what}")
    nothing = "; nothing was created"
    try:
        tmp = _durable_temp(path, data)
    except OSError as exc:
        raise fs_error(path, "create the ledger", exc, nothing) from exc
    try:
        with _head.dir_lock(directory):
            if os.path.lexists(path):
                raise _exists(path)
            try:
                old = _head.read_file(head_file)
            except _head.HeadUnreadable as exc:
                raise LedgerError(f"{path}: cannot create the ledger: {exc}; remove "
                                  f"{head_file} to start a new ledger deliberately") from None
            except OSError as exc:
                raise fs_error(head_file, "read", exc, nothing) from exc
            seq = -1 if old is None else max(
                [s.head.seq for s in old.whole()] or [old.current().seq])
            if seq >= 0:
                raise LedgerError(
                    f"{path} is missing but its head record {head_file} says entries up to "
                    f"seq {seq} were committed: the journal was deleted or moved; restore "
                    f"it (spend is never reset), or remove {head_file} too to start a new "
                    "ledger deliberately")
            try:
                _head.write_head(head_file, _head.Head(-1, header["hash"], len(data),
                                                       header["hash"]), key, fresh=True)
            except OSError as exc:
                raise fs_error(head_file, "write", exc, nothing) from exc
            try:
                os.link(tmp, path)  # atomic, never clobbers (needs a POSIX file system)
            except FileExistsError:
                raise _exists(path) from None
            except OSError as exc:
                raise fs_error(path, "create the ledger", exc, nothing) from exc
            try:
                _head.fsync_dir(directory)
            except OSError as exc:  # not durable: undo, so that a retry starts afresh
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise fs_error(path, "create the ledger (syncing its directory)", exc,
                               nothing) from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return len(data)


def _exists(path: str) -> LedgerError:
    return LedgerError(f"ledger {path!r} already exists; use Ledger.open to continue it "
                       "(spend is never reset)")


# ----------------------------------------------------------------- journal
class Staged:
    """A spend batch staged for the next write (:meth:`Journal.stage_spends`): its clients,
    epsilons and fields as :meth:`Journal.append_spends` takes them; ``hashes`` is None until
    the write that holds it is durable, then its entries' hashes."""

    __slots__ = ("ids", "eps", "fixed", "events", "hashes")

    def __init__(self, ids: list[str], eps: Sequence[float | None], fixed: Mapping[str, str],
                 events: Sequence[tuple[str, str]] | None) -> None:
        self.ids, self.eps, self.fixed = ids, list(eps), dict(fixed)
        self.events = None if events is None else list(events)
        self.hashes: list[str] | None = None


class Journal:
    """The hash chains of one ledger and, unless ``path`` is None, its file.

    Holds the global chain (every entry's hash, by seq) and each client's
    chain link, verifies entries read back (:meth:`load`) and appends whole
    batches durably, one write at a time: a batch alone, or the batches staged since the last
    write (:meth:`stage_spends`, :meth:`flush`). Not thread-safe: the ledger serialises calls.
    """

    def __init__(self, header_hash: str, path: str | None, size: int = 0,
                 key: bytes | None = None, schema: str = SCHEMA) -> None:
        """``size``: bytes of the file already read or written (the header line); ``key``:
        the ledger key that authenticates the head record and MACs each batch (None: none);
        ``schema``: the header's format."""
        self.path = path
        self.null_eps = schema != SCHEMAS[0]
        """Whether the format allows a null ``eps_after`` (not ``privkit.ledger/1``)."""
        self.head_file = None if path is None else _head.head_path(path)
        self._key = key
        self._before_macs = schema != SCHEMA_KEYED  # written before batch MACs: may lack them
        self._maced = False  # a batch whose MAC verifies was read
        self.unauthenticated: tuple[int, int, int, str] | None = None
        """With a key: the first batch, after the last authenticated ``recover`` entry, that
        nothing authenticates, as (line of its last entry, its seq, the offset where it
        starts, why); set by :meth:`load`, None if there is none."""
        self.batches_after_mark = 0
        """The number of writes :meth:`load` read after the seq it was asked to mark (without a
        key every batch counts as a write: nothing tells where a write of several ends)."""
        self.header_hash = header_hash
        self.head_seq, self.head_hash = -1, header_hash
        self._new_link = (0, header_hash)
        self._digests = bytearray.fromhex(header_hash)  # seq s at [32(s+1), 32(s+2))
        # client -> (client_seq, client_prev_hash) of its next entry; (0, header_hash) if new
        self._links: dict[str, tuple[int, str]] = {}
        self._valid_size = self._known_size = size
        self._broken: str | None = None
        #: bytes of the journal through the batch that ends at the seq :meth:`load` was asked
        #: to mark (None: no batch ends there)
        self.marked_size: int | None = None
        self._staged: list[Staged] = []  # batches for the next write, in order
        self.staged_entries = 0
        """Entries staged for the next write (deferred charges not yet durable)."""

    @property
    def next_seq(self) -> int:
        """The seq the next staged or appended entry gets."""
        return self.head_seq + 1 + self.staged_entries

    def hash_at(self, seq: int) -> str:
        """The hash of entry ``seq`` (-1: the header); ``-1 <= seq <= head_seq``."""
        return bytes(self._digests[32 * (seq + 1):32 * (seq + 2)]).hex()

    # ----------------------------------------------------------- reading
    def load(self, lines: Iterable[bytes],
             on_spend: Callable[[dict[str, Any], int], None], mark: int | None = None) -> int:
        """Verify the entries after the header; return the bytes of a torn tail ignored.

        Each line's hash, seq and batch_end is checked as it is read; once a
        batch is complete (with a key: once its write is, the last batch MACed under
        :data:`BATCH_MAC_PREFIX`), each of its entries is checked against the chains and, if a
        spend, passed to ``on_spend(entry, lineno)``, in order.
        :attr:`marked_size` is set to the journal's length through the batch
        that ends at seq ``mark`` (-1: the header alone; ``mark`` is the head record's seq),
        :attr:`batches_after_mark` to the number of writes after it and, with a key,
        :attr:`unauthenticated` to the first batch that no MAC authenticates (the caller
        refuses it, :mod:`privkit._reopen`).

        Raises:
            LedgerCorruptError: a malformed, edited or missing entry (names the line).
        """
        offset = committed = batch_start = self._valid_size
        if mark == self.head_seq:
            self.marked_size = committed
        done: list[tuple[dict[str, Any], int]] = []  # whole batches of the write being read
        pending: list[tuple[dict[str, Any], int]] = []  # the batch being read
        bad_line = 0
        for lineno, line in enumerate(lines, start=2):
            offset += len(line)
            entry = parse_line(line)
            if entry is None:
                bad_line = bad_line or lineno  # a torn tail, unless a valid line follows
                continue
            if bad_line:
                raise corrupt(self.path, bad_line, "not a JSON object line")
            if not _hash_matches({k: v for k, v in entry.items() if k != "hash"},
                                 entry.get("hash")):
                raise corrupt(self.path, lineno, "hash mismatch (entry edited or damaged)")
            seq, end = entry.get("seq"), entry.get("batch_end")
            expected = self.head_seq + 1 + len(done) + len(pending)
            if seq != expected or not is_int(seq):
                raise corrupt(self.path, lineno, f"seq {seq!r}, expected {expected} "
                                                 "(an entry is missing, duplicated or reordered)")
            if not (is_int(end) and end >= seq
                    and (not pending or pending[0][0]["batch_end"] == end)):
                raise corrupt(self.path, lineno, f"bad batch_end {end!r}")
            if "mac" in entry and not (seq == end and _is_mac(entry["mac"])):
                raise corrupt(self.path, lineno, "a malformed MAC, or a MAC on an entry that "
                                                 "does not end its batch")
            pending.append((entry, lineno))
            if seq == end:
                more = (self._key is not None
                        and self._authenticate(entry, lineno, mark, batch_start))
                done += pending
                pending, batch_start = [], offset
                if more:  # the write goes on: its batches count once it is whole
                    continue
                for e, n in done:
                    self._chain(e, n, on_spend)
                if mark is not None and seq > mark:
                    self.batches_after_mark += 1
                done, committed = [], offset
                if seq == mark:
                    self.marked_size = committed
        self._valid_size, self._known_size = committed, offset
        return offset - committed

    def _authenticate(self, e: dict[str, Any], lineno: int, mark: int | None,
                      offset: int) -> bool:
        """Check the MAC of the batch that ``e`` (at ``lineno``) ends and that starts at byte
        ``offset``, with the key; note it in :attr:`unauthenticated` if nothing authenticates
        it (``mark``: the head record's seq, which authenticates the chain up to it). True: the
        MAC says another batch of the same write follows (:data:`BATCH_MAC_MORE_PREFIX`)."""
        assert self._key is not None
        mac, seq = e.get("mac"), e["seq"]
        body = canonical_json({k: v for k, v in e.items() if k not in _UNMACED}) \
            if mac is not None else ""
        if mac is not None and hmac.compare_digest(mac, batch_mac(self._key, body)):
            self._maced = True
        elif mac is not None and hmac.compare_digest(mac, batch_mac(self._key, body, True)):
            self._maced = True
            return True
        elif not (mac is None and self._before_macs and not self._maced and mark is not None
                  and seq <= mark):
            if self.unauthenticated is None:
                why = ("has a MAC that this ledger key does not give" if mac is not None
                       else "carries no MAC although batches before it do" if self._maced
                       else "carries no MAC" if not self._before_macs or mark is None
                       else f"carries no MAC and comes after the entry its head record names "
                            f"(seq {mark}; a privkit from before batch MACs leaves such a "
                            "batch when it crashes before writing the head record)")
                self.unauthenticated = (lineno, seq, offset, why)
            return False
        if e["kind"] == "recover":  # an authenticated recovery accepted what is before it
            self.unauthenticated = None
        return False

    def _chain(self, e: dict[str, Any], lineno: int,
               on_spend: Callable[[dict[str, Any], int], None]) -> None:
        """Verify one hash-checked entry of a complete batch against the chains; add it."""
        if e.get("prev_hash") != self.head_hash:
            raise corrupt(self.path, lineno, "prev_hash does not match the previous entry")
        kind, fields = e.get("kind"), e.keys() - {"mac"}
        if kind == "spend" and fields == _SPEND_KEYS:
            cid = e["client_id"]
            valid_id = isinstance(cid, str) and bool(cid)
            cseq, cprev = self._links.get(cid, self._new_link) if valid_id else self._new_link
            if not valid_id or e["client_seq"] != cseq or not is_int(e["client_seq"]):
                raise corrupt(self.path, lineno, f"client_seq {e['client_seq']!r} of client "
                                                 f"{cid!r}, expected {cseq}")
            if e["client_prev_hash"] != cprev:
                raise corrupt(self.path, lineno,
                              f"client_prev_hash breaks the chain of client {cid!r}")
            if not _spend_fields_ok(e, self.null_eps):
                raise corrupt(self.path, lineno, "a field has the wrong type or range")
            on_spend(e, lineno)
            self._links[cid] = (cseq + 1, e["hash"])
        elif kind == "fork" and fields == _FORK_KEYS:
            src = e["from_seq"]
            if not (is_int(src) and -1 <= src < e["seq"] == e["batch_end"]
                    and self.hash_at(src) == e["from_hash"] and _is_str_or_none(e["run_id"])):
                raise corrupt(self.path, lineno, "fork entry does not point at an earlier entry")
        elif kind == "recover" and fields == _RECOVER_KEYS:
            if not (e["seq"] == e["batch_end"] and _recover_fields_ok(e)):
                raise corrupt(self.path, lineno, "a recover entry's field has the wrong type")
        else:
            raise corrupt(self.path, lineno, f"unknown entry kind {kind!r} or fields {sorted(e)}")
        self._extend([e["hash"]])

    # ----------------------------------------------------------- writing
    def check_usable(self) -> None:
        """Raise LedgerError if a failed write left the file in an unknown state."""
        if self._broken:
            raise LedgerError(f"ledger unusable after a failed write ({self._broken}); reopen it")

    def append_spends(self, ids: list[str], eps: Sequence[float | None],
                      fixed: Mapping[str, str],
                      events: Sequence[tuple[str, str]] | None = None) -> list[str]:
        """Durably append one spend batch, an entry per client (after any batches staged
        before it, in the same write); return their hashes.

        ``eps`` are the clients' epsilons after the charge (None: not priced; only in a
        format that allows it, :attr:`null_eps`); ``events``, if given, each entry's own
        (event, count) canonical JSON (a batch of several charges); ``fixed`` is
        :func:`spend_fields` with the canonical JSON of ``event`` and ``count``. If the write
        fails this batch is dropped (nothing of it is recorded) and earlier staged ones stay.
        """
        staged = self.stage_spends(ids, eps, fixed, events)
        try:
            self.flush()
        except BaseException:
            self.unstage(staged)
            raise
        assert staged.hashes is not None
        return staged.hashes

    def stage_spends(self, ids: list[str], eps: Sequence[float | None],
                     fixed: Mapping[str, str],
                     events: Sequence[tuple[str, str]] | None = None) -> Staged:
        """Stage one spend batch (as :meth:`append_spends` takes it) for the next write; its
        entries get the seqs from :attr:`next_seq` on. Nothing is written or hashed: hashes
        depend on the write (with a key, its MACs), so they are known once it is durable."""
        staged = Staged(ids, eps, fixed, events)
        self._staged.append(staged)
        self.staged_entries += len(ids)
        return staged

    def unstage(self, staged: Staged) -> None:
        """Drop the last staged batch ``staged`` (its write failed)."""
        if self._staged and self._staged[-1] is staged:
            self._staged.pop()
            self.staged_entries -= len(staged.ids)

    def flush(self) -> None:
        """Durably append every staged batch in one write (one ``os.write``, one fsync and the
        head record moved once), each batch as :meth:`append_spends` writes it; with a key,
        every batch but the last MACed as one that its write goes on after. Nothing is
        recorded if the write fails (the batches stay staged, and the write may be retried).
        """
        if not self._staged:
            return
        seq, prev = self.head_seq + 1, self.head_hash
        links: dict[str, tuple[int, str]] = {}
        chunks: list[bytes] = []
        written: list[list[str]] = []
        last = len(self._staged) - 1
        for i, b in enumerate(self._staged):
            lk = [links.get(c) or self._links.get(c, self._new_link) for c in b.ids]
            data, hashes = _spend_lines(seq, prev, b.ids, lk, b.eps, b.fixed, b.events,
                                        self._key, more=i < last)
            links.update(zip(b.ids, [(s + 1, h) for (s, _), h in zip(lk, hashes, strict=True)],
                             strict=True))
            chunks.append(data)
            written.append(hashes)
            seq, prev = seq + len(hashes), hashes[-1]
        self._append(b"".join(chunks), [h for hs in written for h in hs])
        self._links.update(links)
        for b, hs in zip(self._staged, written, strict=True):
            b.hashes = hs
        self._staged, self.staged_entries = [], 0

    def append_recover(self, problem: str, found: _head.Head | None, reason: str,
                       at: str | None) -> None:
        """Durably append a ``recover`` entry (then the head record moves to it)."""
        assert not self._staged, "flush staged batches first"
        seq = self.head_seq + 1
        record = None if found is None else {"hash": found.hash, "seq": found.seq,
                                             "size": found.size}
        entry: dict[str, Any] = {
            "at": at, "batch_end": seq, "head_record": record, "kind": "recover",
            "prev_hash": self.head_hash, "problem": problem, "reason": reason, "seq": seq}
        _with_hash(entry, self._key)
        self._append((canonical_json(entry) + "\n").encode("utf-8"), [entry["hash"]])

    def write_head(self) -> None:
        """Replace the head record by the journal's current head (under the journal's lock;
        skipped when the file changed since it was read: its writer moves the head itself).

        Raises:
            OSError: the head record cannot be written.
        """
        assert self.path is not None and self.head_file is not None
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by close
            if os.fstat(fd).st_size != self._known_size:
                return
            _head.write_head(self.head_file, self._head_record(), self._key)
        finally:
            os.close(fd)

    def _head_record(self) -> _head.Head:
        return _head.Head(self.head_seq, self.head_hash, self._valid_size, self.header_hash)

    def append_fork(self, from_seq: int, from_hash: str, run_id: str | None) -> None:
        """Durably append a fork entry continuing from entry ``from_seq``."""
        assert not self._staged, "flush staged batches first"
        seq = self.head_seq + 1
        entry: dict[str, Any] = {
            "batch_end": seq, "from_hash": from_hash, "from_seq": from_seq, "kind": "fork",
            "prev_hash": self.head_hash, "run_id": run_id, "seq": seq}
        _with_hash(entry, self._key)
        self._append((canonical_json(entry) + "\n").encode("utf-8"), [entry["hash"]])

    def _append(self, data: bytes, hashes: list[str]) -> None:
        if self.path is not None:
            self._write(self.path, data, self.head_seq + len(hashes), hashes[-1])
        self._extend(hashes)

    def _extend(self, hashes: list[str]) -> None:
        self.head_seq, self.head_hash = self.head_seq + len(hashes), hashes[-1]
        self._digests += bytes.fromhex("".join(hashes))

    def _write(self, path: str, data: bytes, seq: int, last_hash: str) -> None:
        """One write and fsync at the end of ``path`` (cutting off a torn tail first), then
        the head record moved to ``seq`` (``last_hash``), all under the journal's lock.

        A file-system error before the batch is durable leaves the journal as it was (the
        write is cut off) and raises :class:`LedgerError`; nothing is recorded, and the same
        charge may be retried. The head file is opened for writing first, so one that cannot
        be written (a directory, no permission, a read-only file system) is refused before
        the journal is touched.
        """
        assert self.head_file is not None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise fs_error(path, "open the journal for appending", exc, _NOTHING) from exc
        head_fd = -1
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # released by close
                size = os.fstat(fd).st_size
            except OSError as exc:
                raise fs_error(path, "lock the journal", exc, _NOTHING) from exc
            if size != self._known_size:
                raise LedgerError(f"{path} changed since it was read (another writer?); "
                                  "reopen it")
            try:
                head_fd = _head.open_for_write(self.head_file)
            except OSError as exc:
                raise fs_error(self.head_file, "write", exc, _NOTHING) from exc
            try:
                if self._valid_size != self._known_size:
                    os.ftruncate(fd, self._valid_size)  # bytes no fsync ever acknowledged
                    self._known_size = self._valid_size
                _write_all(fd, data)
                os.fsync(fd)
            except BaseException as exc:
                self._cut(fd, exc)
                if isinstance(exc, OSError):
                    then = (_NOTHING if self._broken is None else
                            "; it could not be cut off either: reopen the ledger")
                    raise fs_error(path, "write the journal", exc, then) from exc
                raise
            self._valid_size = self._known_size = self._valid_size + len(data)
            head = _head.Head(seq, last_hash, self._valid_size, self.header_hash)
            try:
                _head.write_head(self.head_file, head, self._key, fd=head_fd)
            except OSError as exc:
                # The batch is durable: the journal is one batch ahead of its head record,
                # which the next open accepts and repairs. Refuse to go on until then.
                self._broken = f"head record not updated: {exc!r}"
                raise LedgerError(
                    f"{path}: the charge is durable in the journal but its head record "
                    f"{self.head_file} could not be updated ({errno_text(exc)}); reopen "
                    "the ledger") from exc
        finally:
            if head_fd >= 0:
                os.close(head_fd)
            os.close(fd)

    def _cut(self, fd: int, exc: BaseException) -> None:
        """Cut an unacknowledged write off the journal, so the file stays whole batches. The
        cut needs no fsync of its own: the next batch's fsync makes it durable, and a crash
        before leaves at most that write, complete (counted: over, never under) or torn
        (ignored). Only when the cut fails is the ledger refused until reopened."""
        try:
            os.ftruncate(fd, self._valid_size)
        except OSError:
            self._broken = repr(exc)
            return
        self._known_size = self._valid_size
        with contextlib.suppress(OSError):
            os.fsync(fd)


_NOTHING = "; nothing was recorded"
