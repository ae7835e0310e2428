"""Event serialisation round-trips and refuses unknown classes."""

import json
import math

import pytest
from dp_accounting import dp_event as E

from privkit.errors import InvalidParameterError
from privkit.events import PureDpEvent, event_from_dict, event_to_dict, gaussian_steps_event


@pytest.mark.parametrize("ev", [
    gaussian_steps_event(1.1, 100, 0.01),
    E.ComposedDpEvent([E.GaussianDpEvent(2.0), E.SelfComposedDpEvent(PureDpEvent(0.5), 3)]),
    E.LaplaceDpEvent(1.5),
    E.NoOpDpEvent(),
])
def test_round_trip_through_json(ev):
    text = json.dumps(event_to_dict(ev), allow_nan=False)
    assert event_from_dict(json.loads(text)) == ev


def test_unknown_module_refused():
    with pytest.raises(InvalidParameterError, match="event.type"):
        event_from_dict({"type": "os:system", "command": "true"})
    with pytest.raises(InvalidParameterError, match="event.type"):
        event_from_dict({"type": "privkit.events:event_to_dict"})


def test_non_finite_refused_naming_the_field():
    with pytest.raises(InvalidParameterError, match="GaussianDpEvent.noise_multiplier"):
        event_to_dict(E.GaussianDpEvent(math.nan))
    with pytest.raises(InvalidParameterError, match="GaussianDpEvent.noise_multiplier"):
        event_from_dict(json.loads('{"type": "dp_accounting.dp_event:GaussianDpEvent", '
                                   '"noise_multiplier": 1e999}'))


def test_ledgers_written_before_the_events_moved_still_reopen():
    # privkit's own event classes used to live beside their pricing rules; JSON written then
    # names those modules, which keep re-exporting the classes.
    from privkit.events import (
        CodedDataMiEvent,
        L2LaplaceDpEvent,
        PoissonSampledPureDpEvent,
        RecDpEvent,
        event_from_dict,
        event_to_dict,
    )

    rec = {"type": "privkit.accountants.rec:RecDpEvent", "noise_multiplier": 2.0,
           "num_candidates": 16, "num_groups": 1, "neighboring_relation": "REPLACE_ONE"}
    assert event_from_dict(rec) == RecDpEvent(2.0, 16)
    amp = {"type": "privkit.accountants.amplification:PoissonSampledPureDpEvent",
           "sampling_probability": 0.5,
           "event": {"type": "privkit.events:L2LaplaceDpEvent", "epsilon": 1.0, "dimension": 3}}
    assert event_from_dict(amp) == PoissonSampledPureDpEvent(0.5, L2LaplaceDpEvent(1.0, 3))
    coded = CodedDataMiEvent(10, 1.0, 1.0, 3, "NONE")
    old = event_to_dict(coded) | {"type": "privkit.accountants.midp:CodedDataMiEvent"}
    assert event_from_dict(old) == coded
    assert event_to_dict(RecDpEvent(2.0, 16))["type"] == "privkit.events:RecDpEvent"
