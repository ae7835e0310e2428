"""MI-DP of SCFL's coded upload: the spec's test vectors, properties, label modes, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import privkit
from privkit.accountants.midp import (
    COVERS,
    CodedDataMiEvent,
    LabelMode,
    compose_midp,
    implied_tv_delta,
    midp_coded_features,
    midp_coded_release,
    midp_per_client,
    nats_to_bits,
)
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.events import event_from_dict, event_to_dict
from privkit.ledger import Ledger

# (c, sigma, rho, d, eps_x) from the spec's table (7.2), 6 significant digits.
VECTORS = [
    (1, 1, 1, 1, 0.0298301),
    (10, 0.5, 1, 1, 0.701207),
    (100, 2, 1, 1, 0.241717),
    (10, 0.25, 1, 2, 4.39445),
    (50, 1, 1, 3, 4.24748),
    (100, 1, 1, 10, 11.9895),
    (1000, 1, 1, 784, 153.108),
    (1000, 4, 1, 784, 0.936444),
    (1000, 4, math.sqrt(2), 794, 3.60356),
]

# d = 1 numerical check (5.3): (c, sigma, min bound, Blahut-Arimoto capacity lower value).
CAPACITY = [
    (1, 0.25, 0.33358, 0.26414), (1, 0.5, 0.15638, 0.11952), (1, 1, 0.02983, 0.02754),
    (1, 2, 0.00311, 0.00274), (1, 4, 0.00023, 0.00009), (10, 0.25, 1.17205, 0.89229),
    (10, 0.5, 0.70121, 0.58636), (10, 1, 0.23418, 0.22662), (10, 2, 0.03110, 0.02984),
    (10, 4, 0.00230, 0.00193), (100, 0.25, 2.30595, 1.75684), (100, 0.5, 1.75078, 1.31026),
    (100, 1, 0.97074, 0.76144), (100, 2, 0.24172, 0.23863), (100, 4, 0.02297, 0.02224),
]


@pytest.mark.parametrize("c,sigma,rho,d,expected", VECTORS)
def test_spec_vectors(c, sigma, rho, d, expected):
    assert midp_coded_features(c, sigma, rho, d) == pytest.approx(expected, rel=5e-6)


@pytest.mark.parametrize("c,sigma,bound,capacity", CAPACITY)
def test_d1_numerical_check_min_bound_and_above_capacity(c, sigma, bound, capacity):
    got = midp_coded_features(c, sigma, 1.0, 1)
    assert got == pytest.approx(bound, abs=6e-6)
    assert got >= capacity  # an upper bound on the channel capacity (the exact MI-DP)


def test_d2_bound_above_capacity_lower_bounds():
    for rho, low in ((1, 0.05789), (2, 0.27707), (4, 0.71389)):
        assert midp_coded_features(1, 1.0, rho, 2) >= low


def _psi(d: float, snr: float, mu: np.ndarray) -> np.ndarray:
    return d * np.log1p(mu * snr / d) - mu * np.log1p(snr)


def test_psi_uses_the_maximiser_not_the_mu_equals_one_shortcut():
    # psi_2(16) = 1.81651 (mu* = 0.5809) while the mu = 1 shortcut gives 1.56124; with c = 2
    # the G-secret term (c/2) psi is the minimum.
    assert midp_coded_features(2, 0.25, 1.0, 2) == pytest.approx(1.81651, rel=5e-6)
    assert _psi(2, 16, np.array(1.0)) == pytest.approx(1.56124, rel=5e-6)
    assert midp_coded_features(2, 0.25, 1.0, 3) == pytest.approx(2.72476, rel=5e-6)


@pytest.mark.parametrize("c,sigma,d", [(3, 0.5, 1), (2, 0.25, 2), (4, 0.4, 3), (20, 1.0, 5),
                                       (2, 0.1, 7)])
def test_equals_brute_force_over_a_fine_mu_grid(c, sigma, d):
    snr = 1.0 / sigma**2
    mu = np.arange(0.0, 1.0 + 2.5e-6, 5e-6)
    brute = min(c / 2 * _psi(d, snr, mu).max(), d / 2 * math.log1p(c * snr / d))
    got = midp_coded_features(c, sigma, 1.0, d)
    if d == 1:
        assert got <= brute + 1e-8  # B3 may be smaller still
    else:
        assert got == pytest.approx(brute, abs=1e-8)


def test_small_snr_asymptote_d1():
    for snr in (1e-3, 1e-5, 1e-7):
        got = midp_coded_features(10, 1 / math.sqrt(snr), 1.0, 1)
        assert 16 * got / (10 * snr**2) == pytest.approx(1.0, abs=2e-3)


@settings(max_examples=60, deadline=None)
@given(c=st.integers(1, 3000), sigma=st.floats(0.05, 20), rho=st.floats(0.05, 5),
       d=st.integers(1, 1000))
def test_monotone_and_below_naive(c, sigma, rho, d):
    e = midp_coded_features(c, sigma, rho, d)
    assert 0 <= e <= c * d / 2 * math.log1p(rho**2 / sigma**2 / d) * (1 + 1e-12) + 1e-15
    assert midp_coded_features(c + 1, sigma, rho, d) >= e - 1e-12      # more rows: more leak
    assert midp_coded_features(c, sigma * 1.1, rho, d) <= e + 1e-12    # more noise: less
    assert midp_coded_features(c, sigma, rho * 1.1, d) >= e - 1e-12    # larger rows: more


def test_vectorised_matches_scalars_and_bits():
    c = np.array([1, 10, 100, 1000])
    s = np.array([[0.5], [2.0]])
    got = midp_coded_features(c, s, 1.0, 3)
    assert got.shape == (2, 4)
    for i in range(2):
        for j in range(4):
            assert got[i, j] == midp_coded_features(int(c[j]), float(s[i, 0]), 1.0, 3)
    assert midp_coded_features(c, 1.0, 1.0, 3, bits=True) == pytest.approx(
        midp_coded_features(c, 1.0, 1.0, 3) / math.log(2))
    assert nats_to_bits(math.log(2)) == pytest.approx(1.0)


def test_zero_noise_is_inf_and_zero_rows_is_zero():
    assert midp_coded_features(10, 0.0, 1.0, 3) == math.inf
    assert midp_coded_features(10, 1.0, 0.0, 3) == 0.0


@pytest.mark.parametrize("kwargs,name", [
    (dict(num_coded_rows=0), "num_coded_rows"), (dict(num_coded_rows=2.5), "num_coded_rows"),
    (dict(stddev=-1.0), "stddev"), (dict(stddev=math.nan), "stddev"),
    (dict(stddev=math.inf), "stddev"), (dict(row_l2_bound=math.nan), "row_l2_bound"),
    (dict(dim=0), "dim"),
])
def test_bad_input_names_the_argument(kwargs, name):
    args = dict(num_coded_rows=10, stddev=1.0, row_l2_bound=1.0, dim=3) | kwargs
    with pytest.raises(InvalidParameterError, match=name):
        midp_coded_features(**args)


def _event(mode="NOISY", categorical=True, sy=4.0, ry=1.0, o=10, d=784, sigma=4.0, c=1000):
    return CodedDataMiEvent(c, sigma, 1.0, d, mode, sy, ry, o, categorical)


def test_label_modes():
    noisy = midp_coded_release(_event())
    assert noisy.nats == pytest.approx(3.60356, rel=5e-6) and not noisy.labels_fully_disclosed
    paper = midp_coded_release(_event("PAPER_NOISELESS", sy=0.0, ry=None))
    # log 10 + 30.0669, never the features-only 0.936444
    assert paper.nats == pytest.approx(math.log(10) + 392 * math.log1p(1000 * 0.0625 / 784))
    assert paper.labels_fully_disclosed and paper.label_mode is LabelMode.PAPER_NOISELESS
    assert paper.nats > 30 and "fully disclosed" in " ".join(paper.assumptions)
    cont = midp_coded_release(_event("PAPER_NOISELESS", categorical=False, sy=0.0, ry=None))
    assert cont.nats == math.inf and cont.labels_fully_disclosed
    feats = midp_coded_release(CodedDataMiEvent(1000, 4.0, 1.0, 784, "NONE"))
    assert feats.nats == pytest.approx(0.936444, rel=5e-6)
    # one-hot NOISY: the smaller of the augmented bound and the categorical bound
    small = midp_coded_release(_event(sigma=0.1, sy=0.1))
    assert small.nats == pytest.approx(math.log(10) + 392 * math.log1p(1000 * 100 / 784))
    d = noisy.to_dict()
    assert d["mi_dp_nats"] == noisy.nats and "epsilon" not in d and d["covers"] == COVERS
    assert d["mi_dp_bits"] == pytest.approx(noisy.nats / math.log(2))


def test_per_client_vectorised_and_composition():
    evs = [_event(), _event(sigma=2.0, sy=2.0), _event("PAPER_NOISELESS", sy=0.0, ry=None)]
    per = midp_per_client(evs)
    assert per.tolist() == [midp_coded_release(e).nats for e in evs]
    assert compose_midp(evs[:2]) == pytest.approx(per[0] + per[1])
    with pytest.raises(InvalidParameterError):
        compose_midp([])


def test_implied_delta():
    assert implied_tv_delta(0.01) == pytest.approx(math.sqrt(0.02))
    assert implied_tv_delta(2.0) == 1.0 and implied_tv_delta(math.inf) == 1.0


@pytest.mark.parametrize("kwargs", [
    dict(label_mode="NOISY", label_stddev=0.0, label_l2_bound=1.0, label_dim=2),
    dict(label_mode="NOISY", label_stddev=1.0, label_l2_bound=None, label_dim=2),
    dict(label_mode="PAPER_NOISELESS", label_stddev=1.0, label_dim=2),
    dict(label_mode="NONE", label_dim=2),
    dict(label_mode="NOISY", label_stddev=1.0, label_l2_bound=1.0, label_dim=0),
    dict(label_mode="bogus"),
])
def test_event_validation(kwargs):
    with pytest.raises(InvalidParameterError):
        CodedDataMiEvent(10, 1.0, 1.0, 3, **kwargs)


def test_event_json_round_trip():
    ev = _event()
    again = event_from_dict(event_to_dict(ev))
    assert again == ev and again.label_mode is LabelMode.NOISY


def test_epsilon_accountants_and_ledger_refuse_it():
    ev = _event()
    with pytest.raises(UnsupportedEventError, match="MI-DP"):
        privkit.epsilon(ev, 1e-5)
    with pytest.raises(UnsupportedEventError, match="not an \\(epsilon, delta\\)"):
        privkit.epsilon(privkit.ComposedDpEvent([privkit.GaussianDpEvent(1.0), ev]), 1e-5,
                        "rdp")
    led = Ledger.create(None, population_id="p", delta=1e-5)
    with pytest.raises(UnsupportedEventError):
        led.spend(["a"], ev, label="coded upload")
    assert led.epsilons() == {}
