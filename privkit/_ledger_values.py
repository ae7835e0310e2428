"""What a ledger hands out: pointers to its entries, receipts of charges, reports.

:class:`LedgerPointer` (what a checkpoint stores to name the ledger state it depends on),
:class:`SpendReceipt` (a charge, durable or deferred) and :class:`LedgerReport` (replayed
epsilons), all exported by :mod:`privkit.ledger`. Apart from the ledger because they are values
its callers keep, store and compare; a receipt reaches back into the ledger that made it only
to sync it or to price its clients (``_Charging`` says what it uses).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from privkit import _journal
from privkit._journal import is_int
from privkit.accountants.accountant import Method
from privkit.errors import InvalidParameterError, LedgerError


@dataclass(frozen=True)
class LedgerPointer:
    """(``seq``, ``hash``) of the last ledger entry a state depends on (-1: the header)."""

    seq: int
    hash: str

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "hash": self.hash}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LedgerPointer:
        seq, h = data.get("seq"), data.get("hash")
        if not (is_int(seq) and isinstance(h, str)):
            raise InvalidParameterError("pointer", data, "a dict with int 'seq' and str 'hash'")
        return cls(seq, h)


class _Charging(Protocol):
    """What a receipt uses of the ledger that made it (a :class:`privkit.ledger.Ledger`, not
    imported here: that module imports this one)."""

    _lock: threading.Lock

    def sync(self) -> LedgerPointer: ...

    def _flush_locked(self) -> None: ...

    def _epsilons_of(self, states: list[int]) -> np.ndarray: ...


class _LazyPrices:
    """The epsilons of a receipt's clients, priced on first use (a charge prices nothing)."""

    def __init__(self, ledger: _Charging, states: list[int]) -> None:
        self._ledger: _Charging | None = ledger
        self._states = states
        self._value: np.ndarray | None = None

    def get(self) -> np.ndarray:
        if self._value is None:
            assert self._ledger is not None
            with self._ledger._lock:
                self._ledger._flush_locked()  # what the ledger tells is durable
                eps = self._ledger._epsilons_of(self._states)
            eps.flags.writeable = False
            self._value, self._ledger = eps, None
        return self._value


@dataclass(frozen=True, eq=False)
class SpendReceipt:
    """A charge: durable on disk, or deferred until the ledger's next sync (:attr:`durable`).

    Attributes:
        seq: the highest seq of the charge (the release must carry it); ``hash`` its hash.
        first_seq: the seq of the charge's first entry.
        client_ids: the clients charged, in entry order.
        epsilons: their epsilons after the charge (read-only array), priced when first read
            (a charge itself does not price the clients' compositions).
        durable: whether the charge is written and fsynced. ``hash``, ``pointer`` and
            ``epsilons`` of a deferred charge sync the ledger first (a hash is known once
            its write is).
    """

    seq: int
    first_seq: int
    client_ids: tuple[str, ...]
    _prices: _LazyPrices = field(repr=False)
    _staged: _journal.Staged = field(repr=False)
    _ledger: _Charging = field(repr=False)

    @property
    def durable(self) -> bool:
        return self._staged.hashes is not None

    @property
    def hash(self) -> str:
        if self._staged.hashes is None:
            self._ledger.sync()
        if self._staged.hashes is None:  # dropped: the ledger could not write it
            raise LedgerError("the charge was never written (its write failed); nothing "
                              "derived from its release may be published")
        return self._staged.hashes[-1]

    @property
    def epsilons(self) -> np.ndarray:
        return self._prices.get()

    @property
    def pointer(self) -> LedgerPointer:
        return LedgerPointer(self.seq, self.hash)


@dataclass(frozen=True, eq=False)
class LedgerReport:
    """Replayed per-client epsilon upper bounds at ``delta`` under ``method``.

    ``epsilons`` (read-only) is aligned with ``client_ids`` (0 if never charged);
    ``mean`` and ``max`` are 0 when there are no clients; ``head`` is the last
    entry reflected.
    """

    client_ids: tuple[str, ...]
    epsilons: np.ndarray
    mean: float
    max: float
    method: Method
    delta: float
    epsilon_budget: float | None
    head: LedgerPointer
