"""Per-client privacy budget ledger: an append-only, hash-chained JSON Lines journal.

A :class:`Ledger` records every privacy charge of one population (a dataset and
its client ids), one entry per client per charge, and refuses a charge that
would take any client over budget *before* anything changes. It is the authority
on privacy spent: epsilons are replayed from the recorded events with the
header's accountant; each entry's ``eps_after`` is only a cache (null when the
charge was not priced).

A charge costs O(1) amortised however long the history: without a budget no
composition is priced until epsilons are asked for; with one, the check that the
budget holds is reached by cheap valid bounds while far from it and by tight
prices only near it (:mod:`privkit.accountants.budget`). The decision is the one
the tight price gives, and :meth:`Ledger.epsilons` always reports tight prices.

The journal (format ``privkit.ledger/2``; ``/3`` with a ledger key) is written one fsynced
batch per charge and verified when reopened (a charge is durable when :meth:`Ledger.spend`
returns, unless deferred: below); :mod:`privkit._journal` describes the format
and does the file I/O, this module the accounting. After every batch a head
record beside the journal (``<journal>.head``, :mod:`privkit._head`) records the
last committed entry, optionally authenticated with a ledger key, so that a
journal that lost committed entries (rolled back to an older copy, cut short)
is refused on open; with the key every batch carries a MAC too, so that none can be forged
or substituted. :meth:`Ledger.recover` continues from such a journal explicitly and records
that it did.

**Deferred durability.** A charge made with ``durable=False`` (or inside :meth:`Ledger.deferred`)
is checked against the budget and counted at once, like any other, but written only at the next
:meth:`Ledger.sync`, together with every charge deferred before it: one write, one fsync and one
head-record move for all of them. The rule that makes this safe is the caller's: nothing derived
from a release may leave the process (a file, a console line, a message) before the release's
charge is durable, so sync at every such *publication point*. A crash before the sync then
loses only charges of releases that never left the process. Whatever the ledger itself tells
(pointers, epsilons, compositions, reports, entries, a receipt's hash) is durable: those reads
sync first. Without a deferral every charge is durable when it returns, as before.

Example:
    >>> from privkit.events import GaussianDpEvent
    >>> ledger = Ledger.create(None, population_id="demo", delta=1e-5, epsilon_budget=10.0)
    >>> ledger.spend(["a", "b"], GaussianDpEvent(2.0), label="round").seq
    1
    >>> round(ledger.epsilons()["a"], 4)
    1.9931
    >>> with ledger.deferred():  # two releases, one write at the end of the block
    ...     r = ledger.spend(["a"], GaussianDpEvent(2.0), label="round")
    ...     _ = ledger.spend(["b"], GaussianDpEvent(2.0), label="round")
    ...     (r.durable, ledger.pending)
    (False, 2)
    >>> (r.durable, ledger.pending)
    (True, 0)
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from privkit import _head, _journal, _reopen, _validate
from privkit._dpa import dp_event
from privkit._journal import (
    NOISE_READING,
    SCHEMA,
    SCHEMA_KEYED,
    atomic_write_bytes,
    is_int,
    optional,
)
from privkit._ledger_args import _client_ids, _created, _now_iso, _one_id
from privkit._ledger_state import _LedgerState
from privkit._ledger_values import LedgerPointer, LedgerReport, SpendReceipt, _LazyPrices
from privkit.accountants.accountant import Method
from privkit.accountants.budget import States
from privkit.accountants.rules import Composition, NeighboringRelation
from privkit.errors import (
    BudgetExceededError,
    InvalidParameterError,
    LedgerCorruptError,
    LedgerError,
    LedgerRollbackError,
)

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent
else:
    DpEvent = dp_event.DpEvent

__all__ = ["NOISE_READING", "SCHEMA", "SCHEMA_KEYED", "LedgerPointer", "SpendReceipt",
           "LedgerReport", "Ledger", "atomic_write_bytes"]


class Ledger(_LedgerState):
    """Append-only per-client privacy ledger of one population.

    Start one with :meth:`create` (``path=None``: in memory, never persisted)
    and continue it with :meth:`open`. Client ids are strings; integer ids are
    stored as decimal strings (``7`` and ``"7"`` are one client). Calls are
    serialised by a lock; an append to a file that changed since it was read
    (another writer) is refused.
    """

    def __init__(self, header: Mapping[str, Any], path: str | None, size: int = 0,
                 key: bytes | None = None) -> None:
        """Use :meth:`create` or :meth:`open`; ``header`` is trusted here."""
        self.population_id: str = header["population_id"]
        self.delta = float(header["delta"])
        budget = header["epsilon_budget"]
        self.epsilon_budget = None if budget is None else float(budget)
        self.method = Method.parse(header["method"])
        self.neighboring_relation = NeighboringRelation[header["neighboring_relation"]]
        self.created: str | None = header["created"]
        self.noise_reading: str | None = header.get("noise_reading")
        """What a noise multiplier means in the ledger's events (:data:`NOISE_READING`; None:
        a ledger of an earlier privkit under ADD_OR_REMOVE_ONE, where the readings agree)."""
        self._journal = _journal.Journal(header["hash"], path, size, key,
                                         header["schema"])  # chains and file
        # per client (by index): composition state id, cached eps_after (None: not priced)
        self._ids: list[str] = []
        self._index: dict[str, int] = {}
        self._state: list[int] = []
        self._cached: list[float | None] = []
        # compositions are interned as states, priced only when needed (accountants.budget)
        self._states = States(self.delta, self.method, self.neighboring_relation,
                              self.epsilon_budget)
        self._deltas: dict[tuple[str, int], int] = {}  # (event JSON, count) -> delta id
        self._lock = threading.Lock()
        self._deferring = 0  # depth of deferred() blocks: charges default to durable=False
        self.discarded_bytes = 0
        """Bytes of an unfinished final write that :meth:`open` ignored."""
        self.head_note: str | None = None
        """What :meth:`open` or :meth:`recover` did to the head record (None: nothing)."""

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str] | None,
        *,
        population_id: str,
        delta: float,
        epsilon_budget: float | None = None,
        method: Method | str = Method.AUTO,
        neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE,
        created: str | None = None,
        key: bytes | str | None = None,
    ) -> Ledger:
        """Start the ledger of a new population.

        Args:
            path: journal file to create (refused if it exists); None: in memory.
            population_id: non-empty id of the population (dataset + client ids).
            delta: target delta in (0, 1) of every reported epsilon.
            epsilon_budget: per-client budget, finite and > 0; None: no budget.
            method: the accounting method (upper bounds), fixed for the ledger.
            neighboring_relation: dp-accounting's relation (or its name: ``"add-remove"``,
                ``"replace-one"``, ``"zero-out"``, ...). Noise multipliers are stddev / C, C the
                bound on one contribution, under every relation (:data:`NOISE_READING`,
                recorded in the header).
            created: header timestamp, an ISO-8601 UTC timestamp such as
                ``"2024-01-01T00:00:00+00:00"`` (default: the time given by the
                ``SOURCE_DATE_EPOCH`` environment variable if it is set, the
                reproducible-builds convention, else now); fix it for byte-identical ledgers
                across runs.
            key: the ledger key that authenticates the head record and every batch
                (HMAC-SHA256; at least 16 bytes); None: the ``PRIVKIT_LEDGER_KEY`` environment
                variable (the key text) or ``PRIVKIT_LEDGER_KEY_FILE`` (a file holding it),
                else no key. A ledger created with a key is of format :data:`SCHEMA_KEYED`
                (each batch carries a MAC), one without of :data:`SCHEMA`.

        Raises:
            InvalidParameterError: a bad argument (named in the message).
            LedgerError: ``path`` already exists, or its head record says a journal of
                that name held entries (it was deleted: spend is never reset); its directory
                does not exist; a file cannot be written (named, with the error: nothing is
                created).
        """
        created = _now_iso() if created is None else _created(created)
        if path is not None:
            path = _journal.as_path(path)
        k = None if path is None else _head.load_key(key)
        header = _journal.make_header(population_id, delta, epsilon_budget, method,
                                      neighboring_relation, created,
                                      SCHEMA if k is None else SCHEMA_KEYED)
        header["hash"] = _journal.hash_hex(header)
        if path is None:
            return cls(header, None)
        return cls(header, path, _journal.create_file(path, header, k), k)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, key: bytes | str | None = None) -> Ledger:
        """Reopen a journal, verifying schema, hash chains, sequence numbers, events and the
        head record.

        The journal must hold every entry its head record says was committed. It may hold a
        batch more (a crash between the journal's fsync and the head record's): the head
        record is then moved forward. A ledger without a head record (written before privkit
        kept one) opens, and its head record is created (logged; :attr:`head_note` says so),
        unless a key is set.

        Args:
            path: the journal.
            key: the ledger key (see :meth:`create`); None: from the environment, if set.

        Raises:
            InvalidParameterError: ``path`` is not a file path, or a bad key.
            LedgerCorruptError: a malformed, edited or missing entry (the message
                names the line), or an unknown or newer schema.
            LedgerHeadError: the journal is behind its head record, was rewritten, or the
                record is unreadable, missing (with a key) or not authenticated by the key;
                with a key, also a head file that privkit's writes and crashes cannot leave
                (a destroyed current slot, slots out of order, the one-line layout of
                earlier privkits: :mod:`privkit._head`), a journal more than one batch ahead
                of its head record (``ahead``), and a batch that the key's MAC does not
                authenticate (``batch-mac``, naming the line: :mod:`privkit._journal`).
            LedgerError: there is no journal at ``path``; a file cannot be read (named, with
                the error); the header was written when a REPLACE_ONE noise multiplier meant
                stddev / (2C) (no ``noise_reading``, :data:`NOISE_READING`), or records a
                reading this privkit does not know.
        """
        ledger, problem, head = _reopen.read(cls, path, key)
        if problem is not None:
            raise _reopen.refusal(problem, str(ledger.path))
        _reopen.settle(ledger, head)
        return ledger

    @classmethod
    def recover(cls, path: str | os.PathLike[str], *, reason: str,
                key: bytes | str | None = None) -> Ledger:
        """Continue a journal that disagrees with its head record, as it is, and say so.

        The lost entries cannot be restored: epsilons after a recovery count only what the
        journal holds. A ``recover`` entry (the problem, the head record found, ``reason``
        and the time) is appended and the head record moved to it, both durably; a warning
        is logged (logger ``privkit.ledger``). Use it when the loss is known and accepted,
        e.g. a restore from backup after a disk failure.

        Raises:
            InvalidParameterError: ``reason`` is not a non-empty string.
            LedgerError: there is nothing to recover (the journal agrees with its head
                record), or no journal at ``path``; a file cannot be read or written; the
                header records another reading of the noise multiplier (as :meth:`open`).
            LedgerCorruptError: the journal itself is damaged (recovery does not mend it).
        """
        if not (isinstance(reason, str) and reason.strip()):
            raise InvalidParameterError("reason", reason, "a non-empty string")
        ledger, problem, head = _reopen.read(cls, path, key)
        if problem is None:
            raise LedgerError(f"{ledger.path}: nothing to recover: the journal agrees with its "
                              "head record")
        if problem.kind == "needs-key":  # recovering would write a keyless head over it
            raise _reopen.refusal(problem, str(ledger.path))
        with ledger._lock:
            ledger._journal.check_usable()
            ledger._journal.append_recover(problem.kind, head, reason, _now_iso())
        ledger.head_note = (f"recovered ({problem.kind}): {problem.message}; continued from "
                            f"the journal as it is (recover entry seq {ledger.head().seq}, "
                            f"reason {reason!r})")
        _reopen.log.warning("%s: %s", ledger.path, ledger.head_note)
        return ledger

    # ---------------------------------------------------------- charging
    def would_exceed(self, client_ids: Any, event: DpEvent, count: int = 1) -> np.ndarray:
        """Bool array: would ``count`` more uses of ``event`` take each client over budget?

        A pure check (nothing is recorded); all False when the ledger has no budget (then
        nothing is priced). The answer is what pricing each would-be composition would give,
        usually reached without pricing it (:mod:`privkit.accountants.budget`).
        """
        ids = _client_ids(client_ids)
        with self._lock:
            _, did = self._event_delta(event, count)
            if self.epsilon_budget is None:
                return np.zeros(len(ids), dtype=bool)
            before = [self._state_of(c) for c in ids]
            after = [self._states.next(b, did) for b in before]
            return ~self._states.within_budget(before, did, after)

    def spend(
        self,
        client_ids: Any,
        event: DpEvent,
        *,
        label: str,
        count: int = 1,
        round: int | None = None,  # noqa: A002 - the spec's field name
        step: int | None = None,
        run_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
        durable: bool | None = None,
    ) -> SpendReceipt:
        """Charge ``count`` uses of ``event`` to every client, durably, or refuse.

        Every client's would-be epsilon is checked first; if one exceeds the
        budget nothing changes. Otherwise all entries are written in one write
        and fsynced, and only then is the in-memory state updated. Draw noise
        after this returns; the release carries ``receipt.seq``.

        With ``durable=False`` (the default inside :meth:`deferred`) the charge is checked and
        counted the same way (later budget checks and epsilons include it) but written at the
        next :meth:`sync`, with the other deferred charges: sync before anything derived from
        the release leaves the process. ``durable=True`` writes it now (with any charges
        deferred before it), inside :meth:`deferred` too.

        Args:
            client_ids: one id or a non-empty sequence of distinct ids (str or int).
            event: the privacy event of one use (dp-accounting or privkit event), or a
                privkit mechanism: its event, checked against the ledger's relation.
            label: what was released, non-empty.
            count: uses, an integer >= 1.
            round: round (model version) counter, step: step (e.g. upload)
                counter, run_id: the run; each optional.
            meta: optional JSON object (backend, secure flag, rng stream id);
                never keys or generator states.
            durable: write the charge now (True), at the next :meth:`sync` (False), or as
                the context says (None: False inside :meth:`deferred`, else True).

        Raises:
            BudgetExceededError: a client would exceed the budget (names them).
            InvalidParameterError: a bad argument (named in the message).
            UnsupportedEventError: the ledger's method cannot price the event.
            LedgerError: the journal cannot be appended to: another writer, or a file-system
                error (the file and the error named; nothing is recorded and the charge may
                be retried, unless the message says the charge is durable: then reopen).
        """
        return self.spend_many([(client_ids, event, count)], label=label, round=round,
                               step=step, run_id=run_id, meta=meta, durable=durable)

    def spend_many(
        self,
        charges: Iterable[tuple[Any, DpEvent] | tuple[Any, DpEvent, int]],
        *,
        label: str,
        round: int | None = None,  # noqa: A002 - the spec's field name
        step: int | None = None,
        run_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
        durable: bool | None = None,
    ) -> SpendReceipt:
        """Several charges as one: ``(client_ids, event)`` or ``(client_ids, event, count)``
        each (say, a round's clients grouped by their event), all or nothing, in one write and
        one fsync (:meth:`spend` is one charge of it; ``durable`` as there).

        Every client of every charge is checked first; if one would exceed the budget nothing
        changes. A client appears in one charge at most.

        Raises:
            BudgetExceededError: a client would exceed the budget (names them).
            InvalidParameterError: a bad argument, or a client in two charges (named).
            UnsupportedEventError: the ledger's method cannot price an event.
            LedgerError: the journal cannot be appended to: another writer, or a file-system
                error (the file and the error named; nothing is recorded and the charge may
                be retried, unless the message says the charge is durable: then reopen).
        """
        groups = []
        for charge in charges:
            if not (isinstance(charge, tuple) and len(charge) in (2, 3)):
                raise InvalidParameterError("charges", charge, "(client_ids, event) or "
                                            "(client_ids, event, count) tuples")
            groups.append((_client_ids(charge[0], unique=True), charge[1],
                           charge[2] if len(charge) == 3 else 1))
        if not groups:
            raise InvalidParameterError("charges", [], "at least one charge")
        ids = [c for g in groups for c in g[0]]
        if len(set(ids)) != len(ids):
            dup = next(c for c, n in Counter(ids).items() if n > 1)
            raise InvalidParameterError("client_ids", dup, "in one charge of a batch at most")
        fixed = _journal.spend_fields(label, meta, round, step, run_id)
        with self._lock:
            events, states, ok = [], [], []
            for gids, event, count in groups:
                ev_json, did = self._event_delta(event, count)
                events += [(ev_json, str(_validate.positive_int("count", count)))] * len(gids)
                before = [self._state_of(c) for c in gids]
                after = [self._states.next(b, did) for b in before]
                states += after
                ok.append(self._states.within_budget(before, did, after))
            self._journal.check_usable()
            over = np.flatnonzero(~np.concatenate(ok))
            if len(over):
                eps = self._states.prices([states[k] for k in over[:5]])
                shown = ", ".join(f"{ids[k]!r} (epsilon {e:.6g})"
                                  for k, e in zip(over[:5], eps.tolist(), strict=True))
                raise BudgetExceededError(
                    f"spend {label!r} would exceed epsilon_budget={self.epsilon_budget:g} "
                    f"(delta={self.delta:g}) for {len(over)} client(s): {shown}"
                    f"{' ...' if len(over) > 5 else ''}; nothing was recorded")
            journal = self._journal
            first = journal.next_seq
            if journal.null_eps:
                cached = [self._states.known(s) for s in states]
            else:  # a privkit.ledger/1 journal: every entry carries its epsilon
                cached = self._states.prices(states).tolist()
            if len(groups) == 1:
                fixed["event"], fixed["count"] = events[0]
                staged = journal.stage_spends(ids, cached, fixed)
            else:
                staged = journal.stage_spends(ids, cached, fixed, events)
            now = self._deferring == 0 if durable is None else bool(durable)
            if now:
                try:  # with any charges deferred before it: one write
                    journal.flush()
                except BaseException:
                    journal.unstage(staged)  # this charge is not recorded; earlier ones stay
                    raise
            for cid, s, e in zip(ids, states, cached, strict=True):
                self._record(cid, self._index.get(cid, -1), s, e)
        return SpendReceipt(first + len(ids) - 1, first, tuple(ids), _LazyPrices(self, states),
                            staged, self)

    # ------------------------------------------------------- durability
    @property
    def pending(self) -> int:
        """Entries of deferred charges not yet durable (0: everything charged is on disk)."""
        return self._journal.staged_entries

    def sync(self) -> LedgerPointer:
        """Make every deferred charge durable: one write and one fsync for all of them, then
        the head record moved once. Returns the head (a no-op when nothing is deferred).

        Call it at every publication point of deferred charges: before anything derived from
        their releases leaves the process.

        Raises:
            LedgerError: the journal cannot be appended to (as :meth:`spend`): nothing is
                written, the charges stay deferred and the sync may be retried; publish
                nothing derived from their releases.
        """
        with self._lock:
            self._flush_locked()
            return LedgerPointer(self._journal.head_seq, self._journal.head_hash)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[Ledger]:
        """Within the block, charges default to ``durable=False``; the block's end syncs
        (also when it ends by an exception: an error message may carry a release-derived
        number). Blocks nest; the outermost one syncs.

        Example:
            >>> from privkit.events import GaussianDpEvent
            >>> led = Ledger.create(None, population_id="demo", delta=1e-5)
            >>> with led.deferred():
            ...     for r in range(3):
            ...         _ = led.spend(["a"], GaussianDpEvent(2.0), label="round", round=r)
            ...     led.pending
            3
            >>> led.pending, led.head().seq
            (0, 2)
        """
        with self._lock:
            self._deferring += 1
        try:
            yield self
        finally:
            with self._lock:
                self._deferring -= 1
                last = self._deferring == 0
            if last:
                self.sync()

    # ---------------------------------------------------------- pointers
    def head(self) -> LedgerPointer:
        """Pointer to the last entry (seq -1 and the header's hash when there is none), after
        making deferred charges durable (:meth:`sync`): a state that records it depends on
        durable charges only."""
        return self.sync()

    def origin(self) -> LedgerPointer:
        """Pointer to the header (seq -1): the state before any entry."""
        return LedgerPointer(-1, self._journal.header_hash)

    def verify_pointer(self, pointer: LedgerPointer, *, fork: bool = False,
                       run_id: str | None = None) -> LedgerPointer:
        """Check a checkpoint's pointer against the ledger, refusing rollback.

        Args:
            pointer: (seq, hash) stored with the state being loaded.
            fork: allow continuing from a state older than the head: a ``fork``
                entry (with ``run_id``) is appended; all spend carries over.

        Returns:
            The head after the check (the fork entry if one was appended).

        Raises:
            LedgerMismatchError: the ledger has no entry with that seq and hash.
            LedgerRollbackError: the pointer is older than the head and not ``fork``.
        """
        if not isinstance(pointer, LedgerPointer):
            raise InvalidParameterError("pointer", pointer, "a LedgerPointer")
        run_id = optional("run_id", run_id, str)
        with self._lock:
            self._flush_locked()
            seq, head = pointer.seq, self._journal.head_seq
            self._check_pointer(pointer)
            if seq < head and not fork:
                raise LedgerRollbackError(
                    f"pointer seq {seq} is older than the ledger head {head}: loading it would "
                    "forget later spend; pass fork=True to continue from it (spend carries over)")
            if seq < head:
                self._journal.check_usable()
                self._journal.append_fork(seq, pointer.hash, run_id)
            return LedgerPointer(self._journal.head_seq, self._journal.head_hash)

    def entries_since(self, pointer: LedgerPointer) -> list[dict[str, Any]]:
        """The entries recorded after ``pointer``, oldest first, read back from the journal.

        A resuming trainer uses them to tell a charge whose release never happened (a crash
        between charging and checkpointing) from spend that a later state depends on. Each
        entry is checked against the verified hash chain.

        Raises:
            LedgerMismatchError: the ledger has no entry with the pointer's seq and hash.
            LedgerError: an in-memory ledger (nothing to read back).
            LedgerCorruptError: the journal changed on disk since it was verified.
        """
        if not isinstance(pointer, LedgerPointer):
            raise InvalidParameterError("pointer", pointer, "a LedgerPointer")
        with self._lock:
            self._flush_locked()
            seq, head = pointer.seq, self._journal.head_seq
            self._check_pointer(pointer)
            if seq == head:
                return []
            if self.path is None:
                raise LedgerError("an in-memory ledger keeps no entries to read back")
            out: list[dict[str, Any]] = []
            with open(self.path, "rb") as f:
                f.readline()  # the header
                for line in f:
                    e = _journal.parse_line(line)
                    s = e.get("seq") if e is not None else None
                    if not (is_int(s) and seq < s <= head):
                        continue
                    if e is None or e.get("hash") != self._journal.hash_at(s):
                        raise LedgerCorruptError(f"{self.path}: entry {s} changed on disk "
                                                 "since the ledger was opened")
                    out.append(e)
            if [e["seq"] for e in out] != list(range(seq + 1, head + 1)):
                raise LedgerCorruptError(f"{self.path}: entries after seq {seq} are missing "
                                         "on disk")
            return out

    # ----------------------------------------------------------- reports
    @property
    def path(self) -> str | None:
        """The journal file, or None for an in-memory ledger."""
        return self._journal.path

    @property
    def client_ids(self) -> tuple[str, ...]:
        """Clients charged so far, in order of their first charge."""
        return tuple(self._ids)

    def epsilons(self, client_ids: Any = None) -> dict[str, float]:
        """Replayed epsilon at the ledger's delta per client (default: all charged; 0 if never)."""
        ids = self.client_ids if client_ids is None else _client_ids(client_ids)
        with self._lock:
            self._flush_locked()
            eps = self._epsilons_of([self._state_of(c) for c in ids])
        return dict(zip(ids, eps.tolist(), strict=True))

    def composition(self, client_id: Any) -> Composition:
        """The composed events charged to ``client_id`` (atoms with counts; empty if never)."""
        cid = _one_id(client_id)
        with self._lock:
            self._flush_locked()
            return self._states.comps[self._state_of(cid)]

    def report(self, client_ids: Any = None) -> LedgerReport:
        """Per-client epsilons (default: all charged clients) with mean and max."""
        ids = self.client_ids if client_ids is None else tuple(_client_ids(client_ids))
        with self._lock:
            self._flush_locked()
            eps = self._epsilons_of([self._state_of(c) for c in ids])
            head = LedgerPointer(self._journal.head_seq, self._journal.head_hash)
        eps.flags.writeable = False
        mean, top = (float(eps.mean()), float(eps.max())) if eps.size else (0.0, 0.0)
        return LedgerReport(tuple(ids), eps, mean, top, self.method, self.delta,
                            self.epsilon_budget, head)

    def stale_eps_after(self, rtol: float = 1e-9) -> dict[str, tuple[float, float]]:
        """Clients whose last cached ``eps_after`` differs from the replay: id -> (cached, replay).

        A difference means the accountant changed since the entry was written;
        the replay (what :meth:`epsilons` reports) is the authority.
        """
        priced = [(c, e) for c, e in zip(self._ids, self._cached, strict=True) if e is not None]
        replay = self.epsilons([c for c, _ in priced]) if priced else {}
        return {c: (e, replay[c]) for c, e in priced
                if not math.isclose(e, replay[c], rel_tol=rtol)}

    def __repr__(self) -> str:
        more = f", pending={self.pending}" if self.pending else ""
        return (f"Ledger(path={self.path!r}, population_id={self.population_id!r}, "
                f"clients={len(self._ids)}, head_seq={self._journal.head_seq}{more})")

