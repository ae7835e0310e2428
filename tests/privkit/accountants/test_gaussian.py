"""Exact analytic Gaussian and the Thm C.1 closed form: vectors, bounds, numerics."""

import math

import dp_accounting
import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privkit.accountants import gaussian
from privkit.errors import InvalidParameterError

# W2 "exact" column (../spec accounting section 3), delta = 1e-5.
W2_EXACT = [
    (0.5, 1, 9.9973), (0.5, 10, 46.211), (0.5, 100, 284.39), (0.5, 1000, 2268.77),
    (1, 1, 4.3772), (1, 10, 17.857), (1, 100, 91.817), (1, 1000, 633.93),
    (2, 1, 1.9931), (2, 10, 7.5113), (2, 100, 33.104), (2, 1000, 191.55),
    (5, 1, 0.7255), (5, 10, 2.5944), (5, 100, 9.9973), (5, 1000, 46.211),
]


@pytest.mark.parametrize("z,m,expected", W2_EXACT)
def test_w2_exact_column(z, m, expected):
    eps = gaussian.exact_epsilon(math.sqrt(m) / z, 1e-5)
    assert eps == pytest.approx(expected, rel=5e-5)


def test_spec_vectors_to_more_digits():
    assert gaussian.exact_epsilon(10.0, 1e-5) == pytest.approx(91.8173, abs=5e-5)
    assert gaussian.exact_epsilon(math.sqrt(1000) / 0.5, 1e-5) == pytest.approx(2268.7677, abs=5e-5)
    assert gaussian.exact_epsilon(math.sqrt(10), 1e-5) == pytest.approx(17.8566, abs=5e-5)
    z = 17.92
    assert gaussian.exact_epsilon(math.sqrt(40) / z, 1e-3) == pytest.approx(0.8921860, abs=5e-7)


def test_agrees_with_dp_accounting_analytic_gaussian():
    # One Gaussian with sigma = z/sqrt(M) is the M-fold composition.
    sigma = 1 / math.sqrt(100)
    theirs = dp_accounting.get_epsilon_gaussian(sigma, 1e-5)
    ours = gaussian.exact_epsilon(10.0, 1e-5)
    assert ours == pytest.approx(theirs, rel=1e-6)


def test_result_is_on_the_safe_side():
    for mu in [0.01, 0.3, 1.0, 7.0, 50.0, 300.0]:
        for d in [1e-15, 1e-10, 1e-5, 1e-2, 0.5]:
            e = gaussian.exact_epsilon(mu, d)
            assert gaussian.exact_delta(mu, e) <= d
            # and tight: a slightly smaller epsilon violates delta
            if e > 0:
                assert gaussian.exact_delta(mu, e * (1 - 1e-9)) > d * (1 - 1e-6)


def _mp_delta(mu, eps):
    mpmath.mp.dps = 50
    mu, eps = mpmath.mpf(mu), mpmath.mpf(eps)
    phi = lambda x: mpmath.ncdf(x)  # noqa: E731
    return phi(-eps / mu + mu / 2) - mpmath.e**eps * phi(-eps / mu - mu / 2)


@pytest.mark.parametrize("mu,eps", [(63.2456, 2268.77), (1.0, 3.0), (0.01, 0.001), (10.0, 91.8),
                                    (200.0, 30000.0)])
def test_log_delta_against_mpmath(mu, eps):
    ref = float(mpmath.log(_mp_delta(mu, eps)))
    assert gaussian.exact_log_delta(mu, eps) == pytest.approx(ref, rel=1e-9)


def test_vectorised_matches_scalar():
    mus = np.linspace(0.1, 30.0, 50)  # above the small-array threshold: bisection path
    vec = gaussian.exact_epsilon(mus, 1e-5)
    assert vec.shape == (50,)
    small = gaussian.exact_epsilon(mus[:4], 1e-5)  # small arrays: Newton per entry
    assert small.shape == (4,) and np.allclose(small, vec[:4], rtol=1e-13, atol=0)
    for m, e in zip(mus, vec):  # scalar (Newton) and array (bisection) paths agree
        assert e == pytest.approx(gaussian.exact_epsilon(float(m), 1e-5), rel=1e-13)


def test_degenerate_noise():
    assert gaussian.exact_epsilon(math.inf, 1e-5) == math.inf
    assert gaussian.exact_epsilon(0.0, 1e-5) == 0.0
    assert gaussian.exact_delta(math.inf, 5.0) == 1.0
    # vanishing noise gives a huge epsilon or inf, never an error or NaN
    e = gaussian.exact_epsilon(1e100, 1e-5)
    assert e > 1e190 or e == math.inf


@pytest.mark.parametrize("bad", [math.nan, -1.0])
def test_bad_mu_raises(bad):
    with pytest.raises(InvalidParameterError, match="gdp_mu"):
        gaussian.exact_epsilon(bad, 1e-5)


@pytest.mark.parametrize("bad", [0.0, 1.0, -1e-5, math.nan, math.inf])
def test_bad_delta_raises(bad):
    with pytest.raises(InvalidParameterError, match="delta"):
        gaussian.exact_epsilon(1.0, bad)


def test_theorem_c1_vector_and_inverse():
    eps = gaussian.theorem_c1_epsilon(num_releases=40, l2_clip_norm=10.0, stddev=0.8,
                                      dataset_size=224, delta=1e-3)
    assert eps == pytest.approx(1.374104, abs=5e-7)
    rho = 40 * 100 / (2 * 0.64 * 224**2)
    assert gaussian.moments_delta(rho, eps) == pytest.approx(1e-3, rel=1e-9)
    sigma = gaussian.theorem_c1_stddev(num_releases=40, l2_clip_norm=10.0, dataset_size=224,
                                       target_epsilon=eps, delta=1e-3)
    assert sigma == pytest.approx(0.8, rel=1e-9)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    mu=st.floats(1e-3, 1e3),
    log10_delta=st.floats(-15, -0.5),
)
def test_moments_closed_form_never_below_exact(mu, log10_delta):
    d = 10**log10_delta
    assert gaussian.moments_epsilon(mu * mu / 2, d) >= gaussian.exact_epsilon(mu, d) * (1 - 1e-12)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(mu1=st.floats(1e-2, 500), mu2=st.floats(1e-2, 500), d=st.floats(1e-14, 0.9))
def test_monotone_in_mu(mu1, mu2, d):
    lo, hi = sorted([mu1, mu2])
    assert gaussian.exact_epsilon(lo, d) <= gaussian.exact_epsilon(hi, d)
