"""The harness must fail on the two couplings earlier sessions found broken; these tests keep
it able to (each pins a small setting where it does, and checks the mode as shipped passes on
the same setting). Plus the registry: every entry's name is unique."""

from __future__ import annotations

from typing import Any

import pytest

import fl_examples.upcycled.privacy as up_privacy
from fl_examples.core.banded import BandedDpPlan
from fl_examples.core.rounds import straggler_epochs

from . import (
    test_coupling_dprec,
    test_coupling_mapa,
    test_coupling_scfl,
    test_coupling_torch,
    test_coupling_upcycled,
)
from .harness import ADD_REMOVE, ZERO_OUT, Entry, Report, Tap, assert_coupled, check
from .test_coupling_upcycled import run_banded, run_client

try:
    from .test_coupling_flower import ENTRIES as FLOWER
except pytest.skip.Exception:  # without Flower
    FLOWER = []

#: Banded MF, participation ``minsep`` (cohorts of m = round(q N) = 2 among the eligible,
#: separation 2), 3 clients and a fourth, the target, in D'; FedAvg, 3 data rounds, C = 0.05.
MINSEP = {"algorithm": "fedavg", "clients": 3, "bands": 2, "groups": 1, "q": 0.5,
          "clip": 0.05, "seed": 3, "data": 0, "target": 0, "iterations": 3,
          "participation": "minsep"}

#: Client-level FedAvg, q = 1, stragglers 0.5, 3 local epochs, 2 clients and the target in
#: D'; 3 data rounds, C = 0.05.
STRAGGLERS = {"algorithm": "fedavg", "clients": 2, "q": 1.0, "clip": 0.05, "seed": 3,
              "data": 0, "iterations": 3, "stragglers": 0.5, "epochs": 3}


def _worst(report: Report) -> Any:
    found = report.sensitivity_violations()
    assert found, f"the harness missed it: {report.describe()}"
    return max(found, key=lambda v: v.measured / v.bound)


def test_minsep_under_add_remove_is_detected() -> None:
    """A fixed cohort of m = round(q N) clients among the eligible: the added client takes a
    place in round 1 and pushes another client out (and, with separation 2, moves that
    client's later rounds). The round's sum then moves by the target's clipped update minus
    the displaced client's, more than the C that is priced: minsep is priced under zero-out,
    which the same setting satisfies."""
    entry = Entry("bandmf-minsep-under-add-remove", ADD_REMOVE, None, run_banded)
    report = check(entry, MINSEP | {"relation": ADD_REMOVE})
    worst = _worst(report)
    assert worst.measured > 1.5 * worst.bound  # 0.0815 vs C = 0.05 (1.63 C)
    assert {"membership", "leak"} <= {v.kind for v in report.violations}
    stated = BandedDpPlan(3, 3, 2, "minsep", 0.5, 2, 0.05, 1.0).neighboring_relation
    assert stated == ZERO_OUT
    assert_coupled(Entry("bandmf-minsep", ZERO_OUT, None, run_banded),
                   MINSEP | {"relation": ZERO_OUT})


def old_straggler_rule(tree: Any, data_round: int, clients: Any, fraction: float,
                       local_epochs: int) -> Any:
    """Last wave's rule: round(s K) stragglers among the K *realised* sampled clients."""
    return straggler_epochs(tree, data_round, len(clients), fraction, local_epochs)


def run_old_stragglers(s: dict[str, Any], tap: Tap) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(up_privacy, "independent_straggler_epochs", old_straggler_rule)
        run_client(s, tap)


def test_old_straggler_coupling_is_detected() -> None:
    """With the stragglers drawn as round(s K) of the realised sample, adding the target
    changes K and so who straggles; FedAvg drops its stragglers, so a client that trained
    in D is dropped in D' (or the other way round) and the sum moves by up to 2C. The
    per-client rule of the trainer passes on the same setting."""
    report = check(Entry("old-stragglers", ADD_REMOVE, None, run_old_stragglers), STRAGGLERS)
    worst = _worst(report)
    assert worst.measured > 1.5 * worst.bound  # 0.0777 vs C = 0.05 (1.55 C)
    assert "membership" in {v.kind for v in report.violations}
    assert_coupled(Entry("stragglers", ADD_REMOVE, None, run_client), STRAGGLERS)


def test_entry_names_are_unique() -> None:
    names = [e.name for m in (test_coupling_upcycled, test_coupling_mapa, test_coupling_dprec,
                              test_coupling_scfl, test_coupling_torch)
             for e in m.ENTRIES] + [e.name for e in FLOWER]
    assert len(names) == len(set(names)), names
