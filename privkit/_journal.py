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

**Modules.** This module holds the chains and appends to the file (:class:`Journal`); what the
lines hold and how they are encoded and checked is in :mod:`privkit._journal_format`, creating a
journal and whole-file writes in :mod:`privkit._journal_files`. Their public names are
re-exported here, so that the ledger reaches the journal through this module alone.

Example:
    >>> canonical_json({"b": 1, "a": ["é", 0.5]})
    '{"a":["é",0.5],"b":1}'
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from privkit import _head
from privkit._journal_files import (
    _write_all,
    as_path,
    atomic_write_bytes,
    create_file,
    errno_text,
    fs_error,
)
from privkit._journal_format import (
    _FORK_KEYS,
    _RECOVER_KEYS,
    _SPEND_KEYS,
    _UNMACED,
    BATCH_MAC_MORE_PREFIX,
    BATCH_MAC_PREFIX,
    NOISE_READING,
    SCHEMA,
    SCHEMA_KEYED,
    SCHEMAS,
    _hash_matches,
    _is_mac,
    _is_str_or_none,
    _recover_fields_ok,
    _spend_fields_ok,
    _spend_lines,
    _with_hash,
    batch_mac,
    canonical_json,
    check_header,
    corrupt,
    eps_after,
    hash_hex,
    is_int,
    make_header,
    optional,
    parse_line,
    spend_fields,
)
from privkit.errors import LedgerError

__all__ = ["BATCH_MAC_MORE_PREFIX", "BATCH_MAC_PREFIX", "NOISE_READING", "SCHEMA",
           "SCHEMA_KEYED", "SCHEMAS", "Journal", "Staged", "as_path", "atomic_write_bytes",
           "batch_mac", "canonical_json", "check_header", "corrupt", "create_file", "eps_after",
           "errno_text", "fs_error", "hash_hex", "is_int", "make_header", "optional",
           "parse_line", "spend_fields"]


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
