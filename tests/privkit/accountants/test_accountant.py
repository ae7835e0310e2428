"""Pricing any event: method agreement (one-sided), interop, contract, bad input."""

import math

import pytest
from dp_accounting import dp_event as E
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

from privkit.accountants import Accountant, Method, delta, epsilon, epsilon_batch
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.events import PureDpEvent, gaussian_steps_event, pure_steps_event


def eps(ev, d=1e-5, m=Method.AUTO):
    return epsilon(ev, d, m).epsilon


# ------------------------------------------------------------ agreement
@pytest.mark.parametrize("z,m", [(0.5, 1), (1, 10), (2, 100), (5, 3)])
def test_ordering_non_subsampled(z, m):
    ev = gaussian_steps_event(z, m)
    exact = eps(ev, m=Method.EXACT)
    assert eps(ev) == exact  # auto is exact here
    assert eps(ev, m=Method.RDP) >= exact
    assert eps(ev, m=Method.PLD) >= exact * (1 - 1e-9)  # pessimistic PLD never below exact
    assert eps(ev, m=Method.MOMENTS) >= eps(ev, m=Method.RDP) - 1e-9
    assert eps(ev, m=Method.RDP) >= eps(ev, m=Method.PLD) - 1e-3 * exact


# prv_accountant rigorous lower bounds for W1 (z=1.1, q=0.01, delta=1e-5).
W1_LOWER = {1000: 1.5053, 10_000: 5.1823}
W1_PLD = {1000: 1.5154, 10_000: 5.1926}


@pytest.mark.parametrize("t", [1000, 10_000])
def test_w1_auto_between_lower_bound_and_pld(t):
    ev = gaussian_steps_event(1.1, t, 0.01)
    r = epsilon(ev, 1e-5)
    assert r.method.startswith("pld")
    assert r.epsilon >= W1_LOWER[t]
    assert r.epsilon <= W1_PLD[t] * 1.001  # within 0.1% of PLD at 1e-4
    assert eps(ev, m=Method.RDP) >= r.epsilon


def test_pld_method_equals_dp_accounting():
    # dp-accounting's own number, read at delta minus privkit's allowance for its
    # floating-point error (SLACK_PER_STEP per composed step), which keeps it an upper bound.
    from privkit.accountants.pld import SLACK_PER_STEP

    ev = gaussian_steps_event(1.1, 1000, 0.01)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(ev)
    ours = eps(ev, m=Method.PLD)
    assert ours == pytest.approx(acc.get_epsilon(1e-5 - SLACK_PER_STEP * 1000), rel=1e-9)
    assert ours >= acc.get_epsilon(1e-5)


def test_rdp_matches_dp_accounting_on_its_own_grid():
    from privkit.accountants import rdp

    ev = gaussian_steps_event(1.1, 1000, 0.01)
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(ev)
    ours, _ = rdp.epsilon_from_rdp(acc.orders, acc.rdp, 1e-5)
    assert ours == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    # privkit's grid is a superset: never looser
    assert eps(ev, m=Method.RDP) <= acc.get_epsilon(1e-5) + 1e-12


def test_rdp_c1_vector():
    ev = gaussian_steps_event(17.92, 40)
    assert eps(ev, 1e-3, Method.RDP) == pytest.approx(1.028117, abs=2e-6)
    assert eps(ev, 1e-3, Method.MOMENTS) == pytest.approx(1.374104, abs=5e-7)
    assert eps(ev, 1e-3) == pytest.approx(0.8921860, abs=5e-7)


def test_pure_methods_and_laplace():
    ev = pure_steps_event(1.0, 100)
    assert eps(ev) == pytest.approx(79.84132, rel=1e-6)
    assert eps(ev, m=Method.BASIC) == 100.0
    assert eps(ev, m=Method.ADVANCED) == 100.0  # min(advanced, basic)
    lap = E.SelfComposedDpEvent(E.LaplaceDpEvent(1.0), 100)
    # The Laplace-specific PLD (68.25) beats the generic optimal bound (79.84).
    r = epsilon(lap, 1e-5)
    assert r.method.startswith("pld")
    assert 68.0 < r.epsilon < 68.5
    assert eps(lap, m=Method.OPTIMAL) == pytest.approx(79.84132, rel=1e-6)


def test_mixed_gaussian_and_pure_uses_pld_or_rdp():
    ev = E.ComposedDpEvent([gaussian_steps_event(2.0, 10), pure_steps_event(0.1, 10)])
    r = epsilon(ev, 1e-5)
    assert r.method.startswith(("pld", "rdp"))
    assert r.epsilon >= eps(gaussian_steps_event(2.0, 10))
    assert r.epsilon <= eps(ev, m=Method.RDP)


# ------------------------------------------------------------ both directions
@pytest.mark.parametrize("ev", [gaussian_steps_event(1.0, 10), pure_steps_event(0.5, 20),
                                gaussian_steps_event(1.1, 1000, 0.01)])
def test_delta_round_trip(ev):
    for d in [1e-8, 1e-5, 1e-2]:
        r = epsilon(ev, d)
        back = delta(ev, r.epsilon).delta
        assert back <= d * (1 + 1e-3)


def test_delta_of_infinite_epsilon_and_no_noise():
    assert delta(gaussian_steps_event(1.0, 10), math.inf).delta == 0.0
    assert eps(E.GaussianDpEvent(0.0)) == math.inf
    assert eps(E.NonPrivateDpEvent()) == math.inf
    assert delta(E.GaussianDpEvent(0.0), 3.0).delta == 1.0
    assert eps(E.NoOpDpEvent()) == 0.0


# ------------------------------------------------------------ contract
CONTRACT_EVENTS = [
    E.GaussianDpEvent(1.3),
    E.PoissonSampledDpEvent(0.05, E.GaussianDpEvent(1.0)),
    E.LaplaceDpEvent(2.0),
    PureDpEvent(0.3),
]


@pytest.mark.parametrize("ev", CONTRACT_EVENTS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("method", [Method.AUTO, Method.RDP, Method.PLD])
def test_k_fold_equals_self_composed_equals_composed(ev, method):
    k = 7
    a = Accountant(method)
    for _ in range(k):
        a.compose(ev)
    via_loop = a.get_epsilon(1e-5)
    via_self = eps(E.SelfComposedDpEvent(ev, k), m=method)
    via_list = eps(E.ComposedDpEvent([ev] * k), m=method)
    nested = eps(E.ComposedDpEvent([E.SelfComposedDpEvent(ev, 3), E.SelfComposedDpEvent(ev, 4)]),
                 m=method)
    assert via_loop == via_self == via_list == nested


# ------------------------------------------------------------ properties
@settings(max_examples=40, deadline=None, derandomize=True)
@given(z=st.floats(0.6, 5), q=st.floats(1e-3, 0.2), t=st.integers(1, 300),
       d=st.sampled_from([1e-3, 1e-5, 1e-7]))
def test_monotone_subsampled(z, q, t, d):
    base = eps(gaussian_steps_event(z, t, q), d)
    assert eps(gaussian_steps_event(z, t + 25, q), d) >= base - 1e-9 * base
    assert eps(gaussian_steps_event(z, t, min(1.0, q * 1.5)), d) >= base - 1e-9 * base
    assert eps(gaussian_steps_event(z * 1.2, t, q), d) <= base + 1e-9 * base
    assert eps(gaussian_steps_event(z, t, q), d / 10) >= base - 1e-9 * base


@settings(max_examples=100, deadline=None, derandomize=True)
@given(z=st.floats(0.1, 50), t=st.integers(1, 10_000), d=st.floats(1e-15, 0.5))
def test_monotone_and_ordered_non_subsampled(z, t, d):
    e = eps(gaussian_steps_event(z, t), d)
    assert e >= 0 and math.isfinite(e)  # 0 is exact when delta(0) <= d (huge delta)
    if d < 1e-2:
        assert e > 0
    assert eps(gaussian_steps_event(z, t + 1), d) >= e
    assert eps(gaussian_steps_event(z * 1.01, t), d) <= e
    assert eps(gaussian_steps_event(z, t), d, Method.MOMENTS) >= e


def test_batch_matches_single_and_groups():
    evs = [gaussian_steps_event(z, t) for z, t in [(1, 10), (2, 10), (1, 10), (0.7, 3)]]
    evs.append(gaussian_steps_event(1.1, 100, 0.01))
    evs.append(pure_steps_event(1.0, 5))
    out = epsilon_batch(evs, 1e-5)
    for ev, e in zip(evs, out):
        assert e == pytest.approx(eps(ev), rel=1e-12)


# ------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad", [math.nan, 0.0, 1.0, -0.1, math.inf, 2.0])
def test_bad_delta(bad):
    with pytest.raises(InvalidParameterError, match="delta"):
        epsilon(gaussian_steps_event(1.0, 10), bad)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(noise_multiplier=math.nan, steps=10), "noise_multiplier"),
        (dict(noise_multiplier=-1.0, steps=10), "noise_multiplier"),
        (dict(noise_multiplier=0.0, steps=10), "noise_multiplier"),
        (dict(noise_multiplier=math.inf, steps=10), "noise_multiplier"),
        (dict(noise_multiplier=1.0, steps=2.5), "steps"),
        (dict(noise_multiplier=1.0, steps=0), "steps"),
        (dict(noise_multiplier=1.0, steps=10, sampling_probability=0.0), "sampling_probability"),
        (dict(noise_multiplier=1.0, steps=10, sampling_probability=1.5), "sampling_probability"),
        (dict(noise_multiplier=1.0, steps=10, sampling_probability=math.nan),
         "sampling_probability"),
    ],
)
def test_bad_builder_args(kwargs, name):
    with pytest.raises(InvalidParameterError, match=name):
        gaussian_steps_event(**kwargs)


@pytest.mark.parametrize("ev,name", [
    (E.GaussianDpEvent(math.nan), "noise_multiplier"),
    (E.GaussianDpEvent(-2.0), "noise_multiplier"),
    (E.PoissonSampledDpEvent(math.nan, E.GaussianDpEvent(1.0)), "sampling_probability"),
    (E.PoissonSampledDpEvent(1.2, E.GaussianDpEvent(1.0)), "sampling_probability"),
    (E.SelfComposedDpEvent(E.GaussianDpEvent(1.0), -3), "count"),
])
def test_bad_dp_accounting_events_rejected(ev, name):
    with pytest.raises(InvalidParameterError, match=name):
        epsilon(ev, 1e-5)


def test_pure_event_validates_at_construction():
    for bad in [math.nan, 0.0, -1.0, math.inf]:
        with pytest.raises(InvalidParameterError, match="epsilon"):
            PureDpEvent(bad)


def test_method_cannot_price_event():
    with pytest.raises(UnsupportedEventError):
        epsilon(gaussian_steps_event(1.0, 10, 0.1), 1e-5, Method.EXACT)
    with pytest.raises(UnsupportedEventError):
        epsilon(gaussian_steps_event(1.0, 10), 1e-5, Method.OPTIMAL)
    with pytest.raises(InvalidParameterError, match="method"):
        epsilon(gaussian_steps_event(1.0, 10), 1e-5, "nonsense")
    with pytest.raises(UnsupportedEventError):
        epsilon(E.UnsupportedDpEvent(), 1e-5)


def test_pld_refuses_delta_below_its_floor_and_auto_uses_privkits_pld():
    ev = gaussian_steps_event(1.1, 100, 0.01)
    with pytest.raises(InvalidParameterError, match="delta"):
        epsilon(ev, 1e-14, Method.PLD)
    r = epsilon(ev, 1e-14)
    assert r.method.startswith("pld-fft")
    assert math.isfinite(r.epsilon) and r.epsilon <= epsilon(ev, 1e-14, "rdp").epsilon


def test_replace_one_relation_passes_through():
    # Fixed-size sampling without replacement: RDP under REPLACE_ONE (PLD lacks it).
    ev = E.SelfComposedDpEvent(E.SampledWithoutReplacementDpEvent(1000, 10, E.GaussianDpEvent(1.0)),
                               100)
    r = epsilon(ev, 1e-5, neighboring_relation=NeighboringRelation.REPLACE_ONE)
    assert r.method.startswith("rdp") and math.isfinite(r.epsilon) and r.epsilon > 0
    assert "replace_one" in r.assumptions[0]
    # Poisson sampling is not defined for REPLACE_ONE in RDP: refused, not mispriced.
    with pytest.raises(UnsupportedEventError):
        epsilon(gaussian_steps_event(1.1, 100, 0.01), 1e-5, Method.RDP,
                neighboring_relation=NeighboringRelation.REPLACE_ONE)


@pytest.mark.parametrize("ev", [
    E.SelfComposedDpEvent(E.LaplaceDpEvent(2.0), 20),
    E.SelfComposedDpEvent(E.PoissonSampledDpEvent(0.1, E.LaplaceDpEvent(1.0)), 50),
    E.ComposedDpEvent([E.GaussianDpEvent(3.0), E.SelfComposedDpEvent(E.LaplaceDpEvent(4.0), 3)]),
], ids=["laplace", "poisson-laplace", "mixed"])
def test_pld_interop_matches_dp_accounting(ev):
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(ev)
    assert eps(ev, m=Method.PLD) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    assert delta(ev, 2.0, Method.PLD).delta == pytest.approx(acc.get_delta(2.0), rel=1e-6)


def test_rdp_interop_matches_dp_accounting_for_laplace():
    from privkit.accountants import rdp

    ev = E.SelfComposedDpEvent(E.LaplaceDpEvent(2.0), 20)
    acc = rdp_privacy_accountant.RdpAccountant(list(rdp.ORDERS))
    acc.compose(ev)
    assert eps(ev, m=Method.RDP) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
