"""Exceptions raised by privkit.

Every error is a :class:`ValueError` subclass so that callers that already
guard numeric input with ``except ValueError`` keep working; the subclasses
let them tell bad input, unsupported events, budget refusals and ledger
problems apart.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PrivkitError",
    "InvalidParameterError",
    "UnsupportedEventError",
    "NumericalError",
    "BudgetExceededError",
    "LedgerError",
    "LedgerCorruptError",
    "LedgerMismatchError",
    "LedgerRollbackError",
    "LedgerHeadError",
]


class PrivkitError(ValueError):
    """Base class of every error privkit raises on purpose."""


class InvalidParameterError(PrivkitError):
    """A parameter is NaN, infinite, out of range or of the wrong type.

    The message names the argument and shows the offending value, e.g.
    ``noise_multiplier must be finite and > 0, got nan``.
    """

    def __init__(self, name: str, value: Any, requirement: str) -> None:
        self.name = name
        self.value = value
        self.requirement = requirement
        super().__init__(f"{name} must be {requirement}, got {value!r}")


class UnsupportedEventError(PrivkitError):
    """The requested accounting method cannot price this event."""


class NumericalError(PrivkitError):
    """A computation produced NaN, a negative or an otherwise impossible value.

    privkit never clamps such a value (e.g. to epsilon 0); it raises instead.
    """


class BudgetExceededError(PrivkitError):
    """A spend would take a client above its privacy budget; nothing changed."""


class LedgerError(PrivkitError):
    """Base class of ledger persistence errors."""


class LedgerCorruptError(LedgerError):
    """A ledger journal is malformed, its hash chain is broken, or it was edited."""


class LedgerMismatchError(LedgerError):
    """A checkpoint points at a ledger entry that does not exist or has another hash."""


class LedgerRollbackError(LedgerError):
    """Loading would forget spend recorded after the state being loaded."""


class LedgerHeadError(LedgerRollbackError):
    """A ledger journal disagrees with its head record: it is behind it (committed entries
    were lost: a deleted batch, a cut, an older copy), was rewritten, or the record is
    missing, unreadable or not authenticated by the ledger key.

    ``kind`` is the short code of the problem (see :class:`privkit._head.Problem`) and
    ``path`` the journal. ``Ledger.recover`` (``privkit ledger recover``) continues from the
    journal as it is and records that it did.
    """

    def __init__(self, message: str, *, kind: str, path: str) -> None:
        self.kind, self.path = kind, path
        super().__init__(message)
