"""The journal's lines: header, entries, canonical JSON, hashes and batch MACs (no I/O).

The formats (:data:`SCHEMA`, :data:`SCHEMA_KEYED`), how a header is made and checked
(:func:`make_header`, :func:`check_header`), how a spend batch is encoded (:func:`spend_fields`,
``_spend_lines``, its MAC :func:`batch_mac`) and the checks of a line read back
(:func:`parse_line`, the field checks of each kind of entry). Apart from the file I/O
(:mod:`privkit._journal_files`) and the chains (:class:`privkit._journal.Journal`): these are
functions of values, which the ledger also uses to check a charge before anything is staged.
:mod:`privkit._journal` describes the format and re-exports every public name here.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from privkit import _validate
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


