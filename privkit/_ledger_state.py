"""The ledger's private half: each client's composition, the interned events, replay.

:class:`_LedgerState`, the base of :class:`privkit.ledger.Ledger`, keeps per client (by index)
the id of its composition state and its cached ``eps_after``, checks an event (or a mechanism
charged in its place) and interns it as a delta between composition states
(:mod:`privkit.accountants.budget`), and applies an entry of a journal being reopened; it also
holds the two steps on the journal that several public methods share (writing the deferred
charges, checking a pointer against the chain). Apart from the public methods
(:mod:`privkit.ledger`: creating and opening a ledger, charging, syncing, pointers, reports),
which read and change the state through these; the ledger's ``__init__`` sets it up.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from privkit import _journal, _validate
from privkit._dpa import dp_event
from privkit._journal import Journal, canonical_json, is_int
from privkit._ledger_values import LedgerPointer
from privkit.accountants.budget import States
from privkit.accountants.rules import NeighboringRelation, flatten
from privkit.errors import InvalidParameterError, LedgerMismatchError, PrivkitError
from privkit.events import event_from_dict, event_to_dict

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent
else:
    DpEvent = dp_event.DpEvent


class _LedgerState:
    """The per-client composition states, interned events and shared journal steps of a
    :class:`privkit.ledger.Ledger` (its base; the ledger's ``__init__`` sets the attributes)."""

    neighboring_relation: NeighboringRelation
    _ids: list[str]
    _index: dict[str, int]
    _state: list[int]
    _cached: list[float | None]
    _states: States
    _deltas: dict[tuple[str, int], int]
    _journal: Journal

    if TYPE_CHECKING:
        @property
        def path(self) -> str | None: ...

    def _replay(self, e: dict[str, Any], lineno: int) -> None:
        """Apply one spend entry that :meth:`~privkit.ledger.Ledger.open` verified (all but
        its event)."""
        cid, count = e["client_id"], e["count"]
        key = (canonical_json(e["event"]), count)
        did = self._deltas.get(key)
        if did is None:
            try:
                comp = flatten(event_from_dict(e["event"]), count)
            except PrivkitError as exc:
                raise _journal.corrupt(self.path, lineno, f"bad event: {exc}") from None
            did = self._deltas[key] = self._states.add_delta(comp, check=False)
        i = self._index.get(cid, -1)
        new = self._states.next(self._state[i] if i >= 0 else 0, did)
        self._record(cid, i, new, _journal.eps_after(e))

    # ------------------------------------------------------------- state
    def _record(self, cid: str, i: int, state: int, eps: float | None) -> None:
        if i < 0:
            self._index[cid] = len(self._ids)
            self._ids.append(cid)
            self._state.append(state)
            self._cached.append(eps)
        else:
            self._state[i], self._cached[i] = state, eps

    def _state_of(self, cid: str) -> int:
        i = self._index.get(cid, -1)
        return self._state[i] if i >= 0 else 0

    def _epsilons_of(self, states: list[int]) -> np.ndarray:
        return self._states.prices(states)

    def _event_of(self, event: Any) -> Any:
        """``event`` itself, or a mechanism's event for this ledger's relation.

        A privkit mechanism (``.event()`` and ``.neighboring_relation``) may be charged in
        place of its event: one whose ``event`` takes a relation is priced under the ledger's;
        one whose sensitivity holds for another relation only is refused, rather than charged
        under a relation its sensitivity is not for.
        """
        if isinstance(event, DpEvent):
            return event
        make, rel = getattr(event, "event", None), getattr(event, "neighboring_relation", None)
        if not callable(make) or not isinstance(rel, NeighboringRelation):
            return event  # refused below, named
        import inspect

        try:
            takes = "neighboring_relation" in inspect.signature(make).parameters
        except (TypeError, ValueError):
            takes = False
        if takes:
            return make(neighboring_relation=self.neighboring_relation)
        if rel != self.neighboring_relation:
            raise InvalidParameterError(
                "event", type(event).__name__,
                f"a mechanism whose sensitivity is for the ledger's relation "
                f"{self.neighboring_relation.name} (it is for {rel.name}): create the ledger "
                f"with neighboring_relation={rel.name}")
        return make()

    def _event_delta(self, event: Any, count: Any) -> tuple[str, int]:
        """Validate ``event`` and ``count``; return the event's canonical JSON and delta id."""
        event = self._event_of(event)
        if not isinstance(event, DpEvent):
            raise InvalidParameterError("event", event, "a dp_accounting DpEvent")
        count = _validate.positive_int("count", count)
        try:
            ev_json = canonical_json(event_to_dict(event))
        except (TypeError, ValueError):
            flatten(event, count)  # raises naming the bad field, if it can
            raise InvalidParameterError("event", event, "made of JSON data") from None
        did = self._deltas.get((ev_json, count))
        if did is None:
            if event_from_dict(json.loads(ev_json)) != event:
                raise InvalidParameterError("event", event, "one that round-trips through JSON")
            did = self._states.add_delta(flatten(event, count))
            self._deltas[(ev_json, count)] = did
        return ev_json, did

    # ------------------------------------------------------- journal steps
    def _flush_locked(self) -> None:
        """Write the deferred charges (the lock held)."""
        if self._journal.staged_entries:
            self._journal.check_usable()
            self._journal.flush()

    def _check_pointer(self, pointer: LedgerPointer) -> None:
        seq, head = pointer.seq, self._journal.head_seq
        if not (is_int(seq) and -1 <= seq <= head):
            raise LedgerMismatchError(f"pointer seq {seq!r} is not in this ledger (head seq "
                                      f"{head}): the state depends on a missing entry")
        if not (isinstance(pointer.hash, str) and self._journal.hash_at(seq) == pointer.hash):
            raise LedgerMismatchError(f"ledger entry {seq} has another hash than the pointer: "
                                      "another ledger, or a rewritten one")
