"""Log-space kernels against mpmath at 50 digits."""

import mpmath
import pytest

from privkit._numerics import log1mexp, log1mexp_scalar, log_sub_exp

mpmath.mp.dps = 50


@pytest.mark.parametrize("x", [-1e-300, -1e-12, -1e-3, -0.5, -0.7, -1.0, -30.0, -700.0])
def test_log1mexp(x):
    ref = float(mpmath.log(-mpmath.expm1(mpmath.mpf(x))))
    assert log1mexp(x) == pytest.approx(ref, rel=1e-13)
    assert log1mexp_scalar(x) == pytest.approx(ref, rel=1e-13)


@pytest.mark.parametrize("a,b", [(0.0, -1e-10), (5.0, 4.999), (-1000.0, -1001.0), (2.0, -800.0)])
def test_log_sub_exp(a, b):
    ref = float(mpmath.log(mpmath.e ** mpmath.mpf(a) - mpmath.e ** mpmath.mpf(b)))
    assert log_sub_exp(a, b) == pytest.approx(ref, rel=1e-12)


def test_log_sub_exp_equal_is_minus_inf():
    assert log_sub_exp(1.0, 1.0) == -float("inf")
