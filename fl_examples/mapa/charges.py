"""What a MAPA run charges, and how a resumed run recognises charges a crash left behind.

Each edge's uploads are charged on its ledger before their noise is drawn (write-ahead), one
spend call per distinct event among the edges of a computation. A crash can leave charges after
the checkpoint's ledger pointer; :meth:`ChargesMixin.adopt` matches them, spend call by spend
call, against the calls the run makes from the checkpoint to its next one
(:meth:`ChargesMixin._plan` replays the loop's control flow without computing anything).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from fl_examples.mapa.privacy import _method, _price, _relation
from privkit._journal import canonical_json
from privkit.errors import BudgetExceededError, LedgerRollbackError
from privkit.events import DpEvent, event_to_dict
from privkit.ledger import Ledger, LedgerPointer

__all__: list[str] = []

_Call = tuple[tuple[str, ...], str, int, int]
"""One spend call: (edge ids, canonical event JSON, ledger ``round``, ledger ``step``)."""


class ChargesMixin:
    """Charging, planning and adoption of a MAPA run (mixed into
    :class:`fl_examples.mapa.run._Run`)."""

    algorithm: str
    cfg: Any
    sched: Any
    ledger: Ledger | None
    private: bool
    edge_events: list[DpEvent]
    charged: np.ndarray
    ready: np.ndarray
    next_upload: np.ndarray
    applied: int
    events_done: int
    end: int
    precharged: deque[_Call]
    _json_cache: dict[DpEvent, str]
    _eps_cache: dict[tuple[DpEvent, int], float]
    _meta: dict[str, Any]

    # and the run's ``_will_apply(k, next_upload)``

    def _event_json(self, event: DpEvent) -> str:
        text = self._json_cache.get(event)
        if text is None:
            text = self._json_cache[event] = canonical_json(event_to_dict(event))
        return text

    def _groups(self, edges: list[int]) -> list[tuple[DpEvent, list[int]]]:
        """The spend calls charging one upload to each of ``edges``: one per distinct event."""
        groups: dict[DpEvent, list[int]] = {}
        for k in edges:
            groups.setdefault(self.edge_events[k], []).append(k)
        return list(groups.items())

    def _charge(self, edges: list[int]) -> None:
        """Charge one upload to each edge (write-ahead: before its noise is drawn).

        Entries record ``round`` = updates applied so far and ``step`` = the cloud event being
        served; an edge's ``client_seq`` is its upload number. On resume, charges a crashed run
        already wrote for these very uploads (:attr:`precharged`) are adopted, not repeated.
        """
        if not self.private or not edges:
            return
        assert self.ledger is not None
        for ev, ks in self._groups(edges):
            ids = tuple(str(k) for k in ks)
            if self.precharged:
                want = self.precharged.popleft()
                if want != (ids, self._event_json(ev), self.applied, self.events_done):
                    raise LedgerRollbackError(
                        f"the ledger's entries after the checkpoint are not the charges this "
                        f"run makes at cloud event {self.events_done}; resume from the latest "
                        "checkpoint with the same settings (spend is never rolled back)")
            else:
                try:
                    self.ledger.spend(list(ids), ev, label="upload", run_id=self.algorithm,
                                      round=self.applied, step=self.events_done, meta=self._meta)
                except BudgetExceededError as exc:  # the precomputed stop makes it unreachable
                    raise RuntimeError(f"budget stop and ledger disagree: {exc}") from exc
            self.charged[ks] += 1

    def _plan(self, stop: int) -> list[_Call]:
        """The spend calls this run makes from its current state through cloud event ``stop``.

        It replays the loop's control flow (flushes, drops, pulls) on copies of the flags,
        without computing anything: what is charged never depends on gradient values.
        """
        sched, calls = self.sched, []
        ready, nxt = self.ready.copy(), self.next_upload.copy()
        applied = self.applied

        def charge(edges: list[int], step: int) -> None:
            for ev, ks in self._groups(edges):
                calls.append((tuple(str(k) for k in ks), self._event_json(ev), applied, step))

        if not self.cfg.batched and self.events_done == 0:
            first = [k for k in range(self.cfg.edges) if self._will_apply(k, nxt)]
            for k in first:
                charge([k], 0)
            ready[first] = True
        for j in range(self.events_done, stop):
            k = int(sched.edge[j])
            if sched.applied[j]:
                if not ready[k]:
                    pend = [i for i in np.flatnonzero(~ready).tolist() if self._will_apply(i, nxt)]
                    charge(pend, j)
                    ready[pend] = True
                applied = int(sched.version[j])
            else:
                charge([k], j)
            nxt[k] += 1
            ready[k] = False
            if not self.cfg.batched and self._will_apply(k, nxt):
                charge([k], j + 1)
                ready[k] = True
        return calls

    def _window_end(self) -> int:
        """Cloud events up to the next checkpoint (after the next multiple of N updates)."""
        n = self.cfg.checkpoint_every
        if n:
            target = (self.applied // n + 1) * n
            hit = np.flatnonzero(self.sched.version[self.events_done:self.end] == target)
            if hit.size:
                return self.events_done + int(hit[0]) + 1
        return self.end

    def adopt(self, pointer: LedgerPointer) -> None:
        """Check the ledger against the state at ``pointer``; never lose or redo spend.

        Entries after the pointer are allowed only if they are the write-ahead charges this run
        makes before its next checkpoint (a crash after charging and before that checkpoint),
        in the same spend calls (edges, event, model version, cloud event). Replaying those
        uploads draws the same batches and noise (streams keyed by seed, edge and upload), so
        their charges are adopted rather than made twice. Anything else is refused.

        Raises:
            LedgerMismatchError: the ledger lacks the pointer's entry (an older ledger).
            LedgerRollbackError: the state is older than spend that later states depend on.
        """
        assert self.ledger is not None
        pending = self.ledger.entries_since(pointer)
        calls: list[list[dict[str, Any]]] = []
        for e in pending:
            if calls and e.get("batch_end") == calls[-1][0].get("batch_end"):
                calls[-1].append(e)
            else:
                calls.append([e])
        plan = self._plan(self._window_end()) if calls else []
        secure = bool(self.cfg.secure_noise)
        for i, es in enumerate(calls):
            # seeded: the i-th planned call; secure noise: any planned call (several crashed
            # attempts may have charged the same uploads, each a release of its own)
            want = [plan[i]] if i < len(plan) and not secure else (plan if secure else [])
            ok = any(all(
                e.get("kind") == "spend" and e["run_id"] == self.algorithm
                and e["label"] == "upload" and e["count"] == 1 and e["round"] == w[2]
                and e["step"] == w[3] and canonical_json(e["event"]) == w[1]
                for e in es) and tuple(e["client_id"] for e in es) == w[0] for w in want)
            if not ok:
                raise LedgerRollbackError(
                    f"the checkpoint at cloud event {self.events_done} ({self.applied} updates, "
                    f"ledger seq {pointer.seq}) is older than the ledger (head seq "
                    f"{self.ledger.head().seq}): entry {es[0]['seq']} is spend that a later state "
                    "depends on, not an interrupted upload of this run; resume from the latest "
                    "checkpoint (spend is never rolled back)")
        # seeded: replaying draws the same batches and noise, so the charges are adopted;
        # secure noise: a replay is a new release, so it is charged again
        self.precharged = deque([] if secure else plan[:len(calls)])

    def _epsilon_max(self) -> float:
        """The largest edge epsilon after this run's charges (as the ledger replays it)."""
        top: dict[DpEvent, int] = {}
        for k in np.flatnonzero(self.charged).tolist():
            ev, n = self.edge_events[k], int(self.charged[k])
            if n > top.get(ev, 0):
                top[ev] = n
        return max((self._epsilon(ev, n) for ev, n in top.items()), default=0.0)

    def _epsilon(self, event: DpEvent, n: int, relation: str | None = None) -> float:
        key = (event, n)
        e = self._eps_cache.get(key)
        if e is None:
            e = self._eps_cache[key] = _price(event, n, self.cfg.delta,
                                              relation or _relation(self.cfg),
                                              _method(self.cfg))
        return e
