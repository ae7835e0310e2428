"""The checks of a ledger's arguments: client ids, and the time its header records.

A client id is a non-empty string or an integer (stored as its decimal string: ``7`` and
``"7"`` are one client); ``created`` is an ISO-8601 UTC timestamp, by default now or
``SOURCE_DATE_EPOCH``. Apart from :mod:`privkit.ledger`, which calls them: checks of plain
values, which need no ledger.
"""

from __future__ import annotations

import numbers
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np

from privkit.errors import InvalidParameterError


def _one_id(value: Any) -> str:
    if isinstance(value, str) and value:
        try:
            value.encode("utf-8")
            return str(value)
        except UnicodeEncodeError:
            pass
    elif isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        return str(int(value))
    raise InvalidParameterError("client_ids", value, "made of non-empty strings or integers")


def _client_ids(value: Any, *, unique: bool = False) -> list[str]:
    if isinstance(value, (str, numbers.Integral)):
        ids = [_one_id(value)]
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)):
        ids = [_one_id(v) for v in value]
    else:
        raise InvalidParameterError("client_ids", value, "a client id or a sequence of them")
    if not ids:
        raise InvalidParameterError("client_ids", value, "non-empty")
    if unique and len(set(ids)) != len(ids):
        dup = next(c for c, n in Counter(ids).items() if n > 1)
        raise InvalidParameterError("client_ids", dup, "free of duplicates within one spend")
    return ids


def _created(value: Any) -> str:
    """``value`` if it is an ISO-8601 UTC timestamp with a time (as :func:`_now_iso` writes),
    else :class:`InvalidParameterError` naming ``created``."""
    when = None
    if isinstance(value, str) and "T" in value:
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            pass
    if when is None or when.utcoffset() != timedelta(0):
        raise InvalidParameterError("created", value, "an ISO-8601 UTC timestamp such as "
                                    "'2024-01-01T00:00:00+00:00' (or None: now)")
    return str(value)


def _now_iso() -> str:
    """Now (UTC, seconds), or ``SOURCE_DATE_EPOCH`` when set: deterministic runs then write
    byte-identical ledgers (the header's time is the only wall-clock field)."""
    fixed = os.environ.get("SOURCE_DATE_EPOCH")
    if fixed is not None:
        try:
            when = datetime.fromtimestamp(int(fixed), timezone.utc)
        except (ValueError, OverflowError, OSError):
            raise InvalidParameterError("SOURCE_DATE_EPOCH", fixed,
                                        "an integer number of seconds since 1970") from None
        return when.isoformat(timespec="seconds")
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
