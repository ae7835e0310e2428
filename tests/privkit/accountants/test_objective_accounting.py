"""objective_step_epsilon and the rules of L2LaplaceDpEvent / ObjectivePerturbationDpEvent."""

import json
import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from hypothesis import given, settings
from hypothesis import strategies as st

import privkit
from privkit.accountants import Accountant, rules
from privkit.accountants.objective import objective_step_epsilon
from privkit.accountants.rdp import ORDERS
from privkit.errors import InvalidParameterError
from privkit.events import (
    L2LaplaceDpEvent,
    LaplaceDpEvent,
    ObjectivePerturbationDpEvent,
    PureDpEvent,
    SelfComposedDpEvent,
    event_from_dict,
    event_to_dict,
)

PAPER = dict(alpha=20, lipschitz=1, smoothness=0.25, rank=2, dataset_size=224, proximal_mu=0.1)
REL = rules.NeighboringRelation.ADD_OR_REMOVE_ONE


def op_event(proven=True, **kw):
    p = dict(PAPER, **kw)
    return ObjectivePerturbationDpEvent(epsilon=objective_step_epsilon(**p), proven=proven, **p)


# ----------------------------------------------------------- the formula
def test_thm_c2_vector():
    e = objective_step_epsilon(**PAPER)
    assert e == pytest.approx(2 * 20 / 224 + 2.8 * 0.25 / (224 * 0.1), rel=1e-15)
    assert e == pytest.approx(0.2098214285714, rel=1e-12)
    assert 40 * e == pytest.approx(8.392857, abs=1e-6)
    assert 41 * e == pytest.approx(8.602679, abs=1e-6)  # the paper's m = 0..M sum


def test_rank_is_explicit():
    e4 = objective_step_epsilon(**dict(PAPER, rank=4))
    assert e4 - objective_step_epsilon(**PAPER) == pytest.approx(1.4 * 2 * 0.25 / 22.4)


def test_condition_d_names_smoothness_and_dataset_size():
    with pytest.raises(InvalidParameterError, match="smoothness") as exc:
        objective_step_epsilon(**dict(PAPER, dataset_size=4))
    assert "dataset_size" in str(exc.value) and "proximal_mu" in str(exc.value)
    assert objective_step_epsilon(**dict(PAPER, smoothness=0.0)) == pytest.approx(40 / 224)


@pytest.mark.parametrize("field,bad", [
    ("alpha", math.nan), ("alpha", 0), ("lipschitz", math.inf), ("smoothness", -1),
    ("rank", 0), ("rank", 1.5), ("dataset_size", 0), ("proximal_mu", math.nan),
])
def test_bad_arguments_named(field, bad):
    with pytest.raises(InvalidParameterError, match=field):
        objective_step_epsilon(**dict(PAPER, **{field: bad}))


def test_keyword_only():
    with pytest.raises(TypeError):
        objective_step_epsilon(20, 1, 0.25, 2, 224, 0.1)


@settings(max_examples=50, deadline=None)
@given(a=st.floats(1e-3, 1e3), n=st.integers(10, 10**6), k=st.floats(1.01, 10))
def test_monotone(a, n, k):
    e = objective_step_epsilon(**dict(PAPER, alpha=a, dataset_size=n))
    assert objective_step_epsilon(**dict(PAPER, alpha=a * k, dataset_size=n)) > e
    assert objective_step_epsilon(**dict(PAPER, alpha=a, dataset_size=n * 2)) < e


# ------------------------------------------------------------ the events
def test_event_validation():
    with pytest.raises(InvalidParameterError, match="ObjectivePerturbationDpEvent.epsilon"):
        ObjectivePerturbationDpEvent(epsilon=0.1, proven=True, **PAPER)  # not the formula
    with pytest.raises(InvalidParameterError, match="ObjectivePerturbationDpEvent.proven"):
        op_event(proven=1)
    with pytest.raises(InvalidParameterError, match="ObjectivePerturbationDpEvent.smoothness"):
        ObjectivePerturbationDpEvent(epsilon=1.0, proven=True, **dict(PAPER, dataset_size=1))
    with pytest.raises(InvalidParameterError, match="L2LaplaceDpEvent.epsilon"):
        L2LaplaceDpEvent(math.nan, 3)
    with pytest.raises(InvalidParameterError, match="L2LaplaceDpEvent.dimension"):
        L2LaplaceDpEvent(1.0, 0)


@pytest.mark.parametrize("ev", [
    L2LaplaceDpEvent(0.5, 7),
    op_event(),
    op_event(proven=False),
    dp_event.ComposedDpEvent([SelfComposedDpEvent(op_event(), 3), L2LaplaceDpEvent(1.0, 1)]),
])
def test_json_round_trip(ev):
    text = json.dumps(event_to_dict(ev), allow_nan=False)
    assert event_from_dict(json.loads(text)) == ev


# ------------------------------------------------------------ the rules
def test_pure_epsilon_rules():
    assert rules.pure_epsilon(L2LaplaceDpEvent(0.7, 5)) == 0.7
    assert rules.pure_epsilon(op_event()) == objective_step_epsilon(**PAPER)


@pytest.mark.parametrize("ev", [L2LaplaceDpEvent(0.7, 1), L2LaplaceDpEvent(0.7, 5),
                                op_event(), op_event(proven=False)])
def test_rdp_is_randomized_response(ev):
    e = rules.pure_epsilon(ev)
    assert np.array_equal(rules.rdp_curve(ev, ORDERS, REL),
                          rules.rdp_curve(PureDpEvent(e), ORDERS, REL))


def test_pld_rules():
    vdi = 1e-4
    rr = rules.pld_of(PureDpEvent(0.7), vdi, REL).get_epsilon_for_delta(1e-3)
    assert rules.pld_of(L2LaplaceDpEvent(0.7, 5), vdi, REL).get_epsilon_for_delta(1e-3) == rr
    # d = 1 is the 1-D Laplace mechanism with parameter 1/epsilon:
    lap = pld_lib.from_laplace_mechanism(1 / 0.7, value_discretization_interval=vdi)
    one = rules.pld_of(L2LaplaceDpEvent(0.7, 1), vdi, REL)
    for d in (1e-2, 1e-4):
        assert one.get_epsilon_for_delta(d) == lap.get_epsilon_for_delta(d)
    e = objective_step_epsilon(**PAPER)
    assert (rules.pld_of(op_event(), vdi, REL).get_epsilon_for_delta(1e-3)
            == rules.pld_of(PureDpEvent(e), vdi, REL).get_epsilon_for_delta(1e-3))


def test_composition_vectors():
    run = SelfComposedDpEvent(op_event(), 40)
    assert privkit.epsilon(run, 1e-3, "basic").epsilon == pytest.approx(8.392857, abs=1e-6)
    assert privkit.epsilon(run, 1e-3, "optimal").epsilon == pytest.approx(4.35341, abs=1e-5)
    assert privkit.epsilon(run, 1e-5, "optimal").epsilon == pytest.approx(5.79188, abs=1e-5)
    assert privkit.epsilon(run, 1e-3).epsilon == pytest.approx(4.35341, abs=1e-5)  # AUTO
    assert privkit.epsilon(run, 1e-3, "rdp").epsilon >= 4.35341
    assert privkit.epsilon(run, 1e-3, "pld").epsilon >= 4.35341 - 1e-9


def test_l2_laplace_d1_priced_as_laplace():
    a = privkit.epsilon(SelfComposedDpEvent(L2LaplaceDpEvent(1.0, 1), 10), 1e-5, "pld")
    b = privkit.epsilon(SelfComposedDpEvent(LaplaceDpEvent(1.0), 10), 1e-5, "pld")
    assert a.epsilon == b.epsilon
    many = privkit.epsilon(SelfComposedDpEvent(L2LaplaceDpEvent(1.0, 10), 10), 1e-5)
    assert many.epsilon == pytest.approx(9.99977, abs=1e-5)  # optimal pure composition
    assert a.epsilon < many.epsilon


def test_not_proven_mark_on_every_report():
    bad = op_event(proven=False)
    mixed = dp_event.ComposedDpEvent([privkit.gaussian_steps_event(2.0, 5), bad])
    reports = [
        privkit.epsilon(bad, 1e-5),
        privkit.epsilon(mixed, 1e-5),
        privkit.epsilon(SelfComposedDpEvent(bad, 3), 1e-5, "basic"),
        privkit.delta(SelfComposedDpEvent(bad, 3), 1.0),
    ]
    acc = Accountant()
    acc.compose(bad, count=2)
    reports.append(acc.report(1e-5))
    for r in reports:
        assert any(a.startswith("NOT PROVEN:") for a in r.assumptions), r
    good = privkit.epsilon(op_event(), 1e-5)
    assert not any("NOT PROVEN" in a for a in good.assumptions)
    assert any("Thm C.2" in a for a in good.assumptions)
