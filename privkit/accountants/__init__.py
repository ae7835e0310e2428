"""Accountants: price privacy events as (epsilon, delta) upper bounds.

Start with :func:`epsilon` / :func:`delta` (any event, any composition) or the
stateful :class:`Accountant`; calibrate noise with
:mod:`privkit.accountants.calibration`.
"""

# Imported for their side effect: each registers the pricing rules of its events
# (objective: L2LaplaceDpEvent, ObjectivePerturbationDpEvent; rec: RecDpEvent and sampling
# with replacement; midp: CodedDataMiEvent, refused as an epsilon; amplification:
# PoissonSampledPureDpEvent; distributed: SkellamDpEvent) and allows them to be rebuilt from a
# ledger in a fresh process.
from privkit.accountants import amplification as _amplification  # noqa: F401
from privkit.accountants import distributed as _distributed  # noqa: F401
from privkit.accountants import midp as _midp  # noqa: F401
from privkit.accountants import objective as _objective  # noqa: F401
from privkit.accountants import rec as _rec  # noqa: F401
from privkit.accountants.accountant import (
    Accountant,
    EpsilonReport,
    Method,
    delta,
    epsilon,
    epsilon_batch,
    epsilon_batch_compositions,
)
from privkit.accountants.bandmf import (
    BandMFCalibration,
    BandMFSensitivity,
    Cyclic,
    CyclicPoisson,
    MinSeparation,
    bandmf_assumptions,
    bandmf_event,
    bandmf_round_events,
    bandmf_sensitivity,
    calibrate_bandmf,
)
from privkit.accountants.distributed import (
    DistributedCalibration,
    SkellamDpEvent,
    calibrate_distributed,
    wraparound_probability,
)
from privkit.accountants.rules import NeighboringRelation

__all__ = [
    "Accountant",
    "BandMFCalibration",
    "BandMFSensitivity",
    "Cyclic",
    "CyclicPoisson",
    "MinSeparation",
    "bandmf_assumptions",
    "bandmf_event",
    "bandmf_round_events",
    "bandmf_sensitivity",
    "calibrate_bandmf",
    "DistributedCalibration",
    "SkellamDpEvent",
    "calibrate_distributed",
    "wraparound_probability",
    "EpsilonReport",
    "Method",
    "NeighboringRelation",
    "delta",
    "epsilon",
    "epsilon_batch",
    "epsilon_batch_compositions",
]
