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
