"""The participation schemas a banded-MF run is priced under (plain data).

Who may take part in which rounds: :class:`MinSeparation` (the server enforces a separation
and a cap), :class:`Cyclic` (fixed groups served in turn) and :class:`CyclicPoisson` (the
same groups, each client sampled within its round). Apart from
:mod:`privkit.accountants.bandmf` because the sensitivity
(``privkit.accountants._bandmf_sensitivity``) and the events both read them; the public names
are exported from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError

__all__ = ["MinSeparation", "Cyclic", "CyclicPoisson"]


@dataclass(frozen=True)
class MinSeparation:
    """A client takes part in at most ``max_participations`` rounds, any two of them at least
    ``min_separation`` rounds apart (1: any distinct rounds). The server enforces it and knows
    who took part: no amplification."""

    min_separation: int
    max_participations: int

    def __post_init__(self) -> None:
        _validate.positive_int("min_separation", self.min_separation)
        _validate.positive_int("max_participations", self.max_participations)

    def allows(self, rounds_taken: Any) -> bool:
        """Whether one client taking part in ``rounds_taken`` (0-based rounds) fits.

        Example:
            >>> MinSeparation(3, 2).allows([0, 3]), MinSeparation(3, 2).allows([0, 2])
            (True, False)
        """
        r = np.sort(_rounds_taken(rounds_taken))
        return bool(r.size <= self.max_participations
                    and np.all(np.diff(r) >= self.min_separation))


@dataclass(frozen=True)
class Cyclic:
    """The population is split into ``groups`` fixed groups before training; round ``t``
    serves group ``t mod groups`` (every client of it, or any subset the server picks: no
    amplification). A client takes part at most ``ceil(T / groups)`` times."""

    groups: int

    def __post_init__(self) -> None:
        _validate.positive_int("groups", self.groups)

    def allows(self, rounds_taken: Any, group: int) -> bool:
        """Whether a client of ``group`` (0-based) taking part in ``rounds_taken`` fits."""
        return _in_group(rounds_taken, group, int(self.groups))


def _rounds_taken(value: Any) -> np.ndarray:
    r = np.asarray(value)
    if r.ndim != 1 or (r.size and (r.dtype.kind not in "iu" or r.min() < 0)):
        raise InvalidParameterError("rounds_taken", value, "a 1-D sequence of rounds >= 0")
    if np.unique(r).size != r.size:
        raise InvalidParameterError("rounds_taken", value, "distinct rounds")
    return r.astype(np.int64)


def _in_group(rounds_taken: Any, group: Any, groups: int) -> bool:
    g = _validate.nonnegative_int("group", group)
    if not g < groups:
        raise InvalidParameterError("group", group, f"in [0, {groups})")
    return bool(np.all(_rounds_taken(rounds_taken) % groups == g))


@dataclass(frozen=True)
class CyclicPoisson:
    """:class:`Cyclic` groups, and within round ``t``'s group each client takes part
    independently with probability ``sampling_probability``, the outcome secret (amplified).
    Needs ``groups >= `` the strategy's bands."""

    groups: int
    sampling_probability: float

    def __post_init__(self) -> None:
        _validate.positive_int("groups", self.groups)
        _validate.probability("sampling_probability", self.sampling_probability)

    def allows(self, rounds_taken: Any, group: int) -> bool:
        """Whether a client of ``group`` (0-based) taking part in ``rounds_taken`` fits."""
        return _in_group(rounds_taken, group, int(self.groups))


_SCHEMAS = (MinSeparation, Cyclic, CyclicPoisson)


def _schema(value: Any) -> Any:
    if not isinstance(value, _SCHEMAS):
        raise InvalidParameterError("participation", value,
                                    "a MinSeparation, Cyclic or CyclicPoisson schema")
    return value


def _spacing(schema: Any, rounds: int) -> tuple[int, int]:
    """(s, k): the fewest rounds between two of one client's rounds, and the most rounds one
    client takes part in, in a run of ``rounds`` under ``schema``."""
    if isinstance(schema, MinSeparation):
        s, kmax = int(schema.min_separation), int(schema.max_participations)
    else:
        s, kmax = int(schema.groups), rounds
    return s, min(kmax, -(-rounds // s))
