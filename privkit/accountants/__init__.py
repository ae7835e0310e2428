"""Accountants: price privacy events as (epsilon, delta) upper bounds.

Start with :func:`epsilon` / :func:`delta` (any event, any composition) or the
stateful :class:`Accountant`; calibrate noise with
:mod:`privkit.accountants.calibration`.
"""

# objective is imported for its side effect: it registers the rules of
# L2LaplaceDpEvent and ObjectivePerturbationDpEvent.
from privkit.accountants import objective as _objective  # noqa: F401
from privkit.accountants.accountant import (
    Accountant,
    EpsilonReport,
    Method,
    delta,
    epsilon,
    epsilon_batch,
    epsilon_batch_compositions,
)
from privkit.accountants.rules import NeighboringRelation

__all__ = [
    "Accountant",
    "EpsilonReport",
    "Method",
    "NeighboringRelation",
    "delta",
    "epsilon",
    "epsilon_batch",
    "epsilon_batch_compositions",
]
