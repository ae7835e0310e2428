"""Tests of privkit.accountants.pure (spec accounting.md sections 2.5 and 6)."""

from __future__ import annotations

import itertools
import math

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privkit.accountants import pure
from privkit.errors import InvalidParameterError, NumericalError

# eps0, k, optimal at delta 1e-5, advanced (raw DRV), basic -- spec 2.5 test vectors.
TABLE = [
    (0.1, 10, "0.99369", "1.6226", 1.0),
    (0.1, 100, "4.30679", "5.8502", 10.0),
    (0.1, 1000, "17.78713", "25.6914", 100.0),
    (1.0, 10, "9.99977", "32.357", 10.0),
    (1.0, 100, "79.84132", "219.81", 100.0),
    (1.0, 1000, "577.83321", "1870.02", 1000.0),
    (0.2098214, 40, "5.79188", "8.32715", 8.392857),
]
METHODS = {pure.METHOD_KOV_EXACT, pure.METHOD_GRID, pure.METHOD_PLD, pure.METHOD_KOV_CLOSED_FORM,
           pure.METHOD_ADVANCED, pure.METHOD_BASIC}


def close_to_printed(value: float, printed: str) -> bool:
    """True when ``value`` rounds to ``printed`` (half a unit in its last printed digit)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(value - float(printed)) <= 0.5 * 10.0 ** -decimals * (1 + 1e-9)


def kov_delta_mp(eps0: float, k: int, eps: float) -> mpmath.mpf:
    """KOV Thm 3.3 exact profile at 50 digits."""
    with mpmath.workdps(50):
        e0 = mpmath.mpf(eps0)
        p = mpmath.exp(e0) / (1 + mpmath.exp(e0))
        q = 1 - p
        ee = mpmath.exp(mpmath.mpf(eps))
        tot = mpmath.mpf(0)
        for ell in range(k + 1):
            t = mpmath.binomial(k, ell) * (p ** (k - ell) * q**ell - ee * q ** (k - ell) * p**ell)
            if t > 0:
                tot += t
        return tot


def brute_delta(epsilons: list[float], eps: float) -> float:
    """delta(eps) of the product of RR(eps_j), by enumerating all 2^n outcomes."""
    tot = []
    for signs in itertools.product((1, -1), repeat=len(epsilons)):
        prob, loss = 1.0, 0.0
        for s, e in zip(signs, epsilons, strict=True):
            p = 1.0 / (1.0 + math.exp(-e))
            prob *= p if s == 1 else 1.0 - p
            loss += s * e
        if loss > eps:
            tot.append(prob * -math.expm1(eps - loss))
    return math.fsum(tot)


def lattice_pmf_mp(terms: list[tuple[float, int]], h: float = 1e-4) -> tuple[list, float]:
    """The lattice PMF of prod_j RR(m_j h) at 40 digits, in the module's float64 model."""
    ms = [math.ceil(e / h) for e, _ in terms]
    ms = [m + 1 if m * h < e else m for m, (e, _) in zip(ms, terms, strict=True)]
    g = math.gcd(*ms)
    with mpmath.workdps(40):
        pmf = [mpmath.mpf(1)]
        for m, (_, c) in zip(ms, terms, strict=True):
            q = 1 / (1 + mpmath.exp(mpmath.mpf(m * h)))
            term = [mpmath.mpf(0)] * ((m // g) * c + 1)
            for ell in range(c + 1):
                term[(m // g) * ell] = mpmath.binomial(c, ell) * q**ell * (1 - q) ** (c - ell)
            out = [mpmath.mpf(0)] * (len(pmf) + len(term) - 1)
            for i, a in enumerate(pmf):
                for j, b in enumerate(term):
                    if b:
                        out[i + j] += a * b
            pmf = out
    return pmf, h * g


def lattice_delta_mp(pmf: list, step: float, eps: float) -> float:
    with mpmath.workdps(40):
        n, tot = len(pmf) - 1, mpmath.mpf(0)
        for t, pr in enumerate(pmf):
            loss = mpmath.mpf(step) * (n - 2 * t)
            if loss > eps:
                tot += pr * -mpmath.expm1(mpmath.mpf(eps) - loss)
        return float(tot)


def random_terms(rng: np.random.Generator) -> list[tuple[float, int]]:
    n = int(rng.integers(2, 5))
    return [(float(rng.uniform(0.01, 1.0)), int(rng.integers(1, 31))) for _ in range(n)]


# ------------------------------------------------------------ test vectors
@pytest.mark.parametrize(("eps0", "k", "optimal", "advanced", "basic"), TABLE)
def test_table(eps0: float, k: int, optimal: str, advanced: str, basic: float) -> None:
    terms = [(eps0, k)]
    opt = pure.optimal_epsilon(terms, 1e-5)
    assert close_to_printed(opt, optimal), opt
    assert close_to_printed(pure.drv_epsilon(terms, 1e-5), advanced)
    assert pure.basic_epsilon(terms) == pytest.approx(basic, rel=1e-6)
    adv = pure.advanced_epsilon(terms, 1e-5)
    assert adv == min(pure.drv_epsilon(terms, 1e-5), pure.basic_epsilon(terms))
    assert opt <= adv
    assert pure.tightest_epsilon(terms, 1e-5) == (opt, pure.METHOD_KOV_EXACT)


def test_table_delta_1e3() -> None:
    assert close_to_printed(pure.optimal_epsilon([(0.2098214, 40)], 1e-3), "4.35341")


def test_spec_advanced_example() -> None:
    # "at eps0 = 1, k = 100 advanced gives 219.8"; reported advanced is capped at basic.
    assert pure.drv_epsilon([(1.0, 100)], 1e-5) == pytest.approx(219.8, abs=0.05)
    assert pure.advanced_epsilon([(1.0, 100)], 1e-5) == 100.0


@pytest.mark.parametrize(("eps0", "k", "eps"), [
    (1.0, 1000, 577.83321), (1.0, 1000, 100.0), (0.1, 1000, 17.78713), (0.1, 100, 2.5),
    (0.2098214, 40, 4.35341), (0.5, 7, 0.0),
])
def test_homogeneous_delta_matches_mpmath(eps0: float, k: int, eps: float) -> None:
    got = pure.optimal_delta([(eps0, k)], eps)
    ref = kov_delta_mp(eps0, k, eps)
    assert got == pytest.approx(float(ref), rel=1e-9)


def test_delta_at_zero_is_total_variation() -> None:
    assert pure.optimal_delta([(0.7, 1)], 0.0) == pytest.approx(math.tanh(0.35), rel=1e-12)


# ------------------------------------------------------------- heterogeneous
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5, 1.0, 1.65, 2.0, 2.5, 2.65, 3.0])
def test_grid_is_exact_on_grid(eps: float) -> None:
    terms = [(0.3, 3), (0.5, 2), (0.7, 1)]
    ref = brute_delta([0.3] * 3 + [0.5] * 2 + [0.7], eps)
    got = pure.optimal_delta(terms, eps)
    assert pure.optimal_method(terms) == pure.METHOD_GRID
    assert got >= ref  # an upper bound, allowances included
    assert got == pytest.approx(ref, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("eps", [0.0, 0.3, 1.0, 2.0, 2.8])
def test_grid_is_an_upper_bound_off_grid(eps: float) -> None:
    # Off the grid a loss is split between its grid neighbours (connect-the-dots): an upper
    # bound on the exact value, and never above rounding every epsilon up to the grid.
    raw = [0.123456, 0.123456, 0.654321, 0.654321, 0.31415]
    up = [0.1235, 0.1235, 0.6544, 0.6544, 0.3142]
    got = pure.optimal_delta([(0.123456, 2), (0.654321, 2), (0.31415, 1)], eps)
    assert got >= brute_delta(raw, eps)
    assert got <= brute_delta(up, eps) * (1 + 1e-9) + 1e-300
    assert pure.optimal_delta([(0.123456, 2), (0.654321, 2), (0.31415, 1)], eps) <= \
        pure.dominating_pair_delta([(0.123456, 2), (0.654321, 2), (0.31415, 1)], eps)


def test_fft_path_is_never_below_the_exact_lattice_value() -> None:
    # 40-digit reference for the FFT path: with the FFT and rounding allowances removed the
    # float result falls below it by ~1e-14 relative; with them it must stay at or above.
    terms = [(0.3, 20), (0.5, 15), (0.7, 10)]
    pmf, step = lattice_pmf_mp(terms)
    for eps in np.linspace(0.0, 20.4, 52).tolist():
        ref = lattice_delta_mp(pmf, step, eps)
        got = pure.dominating_pair_delta(terms, eps)
        assert got >= ref
        assert got <= ref * (1 + 1e-9)


@pytest.mark.parametrize(("eps0", "k"), [(0.1, 1000), (1.0, 1000), (0.2098, 40)])
@pytest.mark.parametrize("delta", [1e-5, 1e-12])
def test_equal_terms_on_grid_agree_with_homogeneous(eps0: float, k: int, delta: float) -> None:
    hom = pure.optimal_epsilon([(eps0, k)], delta)
    # Two distinct inputs that round up to the same grid point force the FFT path.
    het = pure.dominating_pair_epsilon([(eps0, k // 2), (eps0 - 1e-9, k - k // 2)], delta)
    assert het == pytest.approx(hom, rel=1e-6)
    one = pure.dominating_pair_epsilon([(eps0, k)], delta)
    assert one == pytest.approx(hom, rel=1e-6)
    assert pure.dominating_pair_delta([(eps0, k // 2), (eps0 - 1e-9, k - k // 2)], hom) <= delta


def test_rounding_up_gives_an_upper_bound() -> None:
    eps0, up, k = 0.123456789, 0.1235, 60
    het = pure.dominating_pair_epsilon([(eps0, 20), (eps0 * (1 - 1e-12), 40)], 1e-6)
    assert het >= pure.optimal_epsilon([(eps0, k)], 1e-6)
    assert het <= pure.optimal_epsilon([(up, k)], 1e-6) * (1 + 1e-6)
    assert pure.dominating_pair_delta([(eps0, k)], 3.0) >= pure.optimal_delta([(eps0, k)], 3.0)


def test_heterogeneous_random_cases() -> None:
    rng = np.random.default_rng(20240601)
    for _ in range(10):
        terms = random_terms(rng)
        delta = float(10.0 ** rng.uniform(-12, -2))
        opt = pure.optimal_epsilon(terms, delta)
        assert pure.optimal_method(terms) == pure.METHOD_GRID
        assert opt <= pure.kov_closed_form_epsilon(terms, delta)
        assert opt <= pure.advanced_epsilon(terms, delta)
        assert opt <= pure.basic_epsilon(terms)
        assert pure.optimal_delta(terms, opt) <= delta
        assert pure.optimal_delta(terms, opt * (1 - 1e-6)) > delta
        eps, method = pure.tightest_epsilon(terms, delta)
        assert eps == opt
        assert method == pure.METHOD_GRID or opt == pure.basic_epsilon(terms)


def test_heterogeneous_small_delta_is_tight() -> None:
    # Exponential tilting keeps FFT rounding relative: the grid beats the closed form even here.
    rng = np.random.default_rng(0)
    terms = list(zip(rng.uniform(0.05, 0.15, 5).tolist(), [200] * 5, strict=True))
    for delta in (1e-5, 1e-12, 1e-30):
        opt = pure.optimal_epsilon(terms, delta)
        assert opt < pure.kov_closed_form_epsilon(terms, delta)
        assert pure.optimal_delta(terms, opt) <= delta


# ------------------------------------------------------------- round trips
@pytest.mark.parametrize("terms", [[(0.1, 10)], [(1.0, 100)], [(0.01, 3000)], [(3.0, 5)],
                                   [(0.2, 30), (0.5, 10)], [(0.0123, 50), (0.987, 3)]])
@pytest.mark.parametrize("delta", [1e-15, 1e-10, 1e-5, 1e-2, 0.5, 0.99])
def test_round_trip(terms: list[tuple[float, int]], delta: float) -> None:
    eps = pure.optimal_epsilon(terms, delta)
    assert 0.0 <= eps <= pure.basic_epsilon(terms)
    assert pure.optimal_delta(terms, eps) <= delta
    if eps > 0:
        assert pure.optimal_delta(terms, eps * (1 - 1e-7)) > delta
    else:
        assert pure.optimal_delta(terms, 0.0) <= delta


def test_advanced_delta_inverts_advanced_epsilon() -> None:
    terms = [(0.1, 100), (0.05, 300)]
    for eps in (2.0, 5.0, 9.0, 11.0):
        d = pure.advanced_delta(terms, eps)
        assert 0.0 < d < 1.0
        assert pure.advanced_epsilon(terms, d) <= eps
        assert pure.advanced_epsilon(terms, d * (1 - 1e-9)) > eps
    assert pure.advanced_delta(terms, pure.basic_epsilon(terms)) == 0.0
    assert pure.advanced_delta(terms, 0.5) == 1.0  # below sum c eps (e^eps - 1): unreachable
    assert pure.advanced_delta(terms, math.inf) == 0.0


def test_kov_closed_form_delta_inverts_epsilon() -> None:
    terms = [(0.1, 100), (0.3, 20)]
    for eps in (4.0, 6.0, 9.0):
        d = pure.kov_closed_form_delta(terms, eps)
        assert 0.0 < d < 1.0
        assert pure.kov_closed_form_epsilon(terms, d) <= eps
        assert pure.kov_closed_form_epsilon(terms, d * (1 - 1e-9)) > eps
    assert pure.kov_closed_form_delta(terms, 16.0) == 0.0


def test_infinite_epsilon_gives_zero_delta() -> None:
    for fn in (pure.optimal_delta, pure.advanced_delta, pure.kov_closed_form_delta,
               pure.dominating_pair_delta):
        assert fn([(0.1, 10), (0.2, 5)], math.inf) == 0.0
    assert pure.optimal_delta([(0.1, 10)], math.inf) == 0.0


# ------------------------------------------------------------- monotonicity
@settings(max_examples=30, derandomize=True, deadline=None)
@given(eps0=st.floats(0.01, 2.0), k=st.integers(1, 400), dk=st.integers(1, 50),
       f=st.floats(1.0, 2.0), log_d=st.floats(-15.0, -0.5), g=st.floats(1.0, 10.0))
def test_monotone(eps0: float, k: int, dk: int, f: float, log_d: float, g: float) -> None:
    d = 10.0**log_d
    base = pure.optimal_epsilon([(eps0, k)], d)
    slack = 1 + 1e-9
    assert base <= pure.optimal_epsilon([(eps0, k + dk)], d) * slack
    assert base <= pure.optimal_epsilon([(eps0 * f, k)], d) * slack
    assert pure.optimal_epsilon([(eps0, k)], min(d * g, 0.999)) <= base * slack
    assert base <= min(pure.advanced_epsilon([(eps0, k)], d), pure.basic_epsilon([(eps0, k)]))


def test_heterogeneous_monotone_in_delta_and_steps() -> None:
    terms = [(0.1, 40), (0.37, 10)]
    eps = [pure.optimal_epsilon(terms, d) for d in (0.5, 1e-2, 1e-5, 1e-9, 1e-14)]
    assert eps == sorted(eps)
    assert eps[2] <= pure.optimal_epsilon([(0.1, 41), (0.37, 10)], 1e-5)


# ------------------------------------------------------------- API, fallback, sizes
def test_terms_are_merged_and_may_be_a_generator() -> None:
    ref = pure.optimal_epsilon([(0.1, 10)], 1e-5)
    assert pure.optimal_epsilon([(0.1, 4), (0.1, 6)], 1e-5) == ref
    assert pure.optimal_epsilon(((0.1, 5) for _ in range(2)), 1e-5) == ref
    assert pure.optimal_epsilon(np.array([[0.1, 10.0]]), 1e-5) == ref
    assert pure.optimal_method([(0.1, 4), (0.1, 6)]) == pure.METHOD_KOV_EXACT


def test_fallback_is_labelled() -> None:
    big = [(0.1, 10**5), (0.1001, 10**5)]  # too wide for the 1e-4 grid: a coarser PLD grid
    assert pure.optimal_method(big) == pure.METHOD_PLD
    assert pure.optimal_epsilon(big, 1e-5) <= pure.kov_closed_form_epsilon(big, 1e-5)
    assert pure.optimal_delta(big, 100.0) <= pure.kov_closed_form_delta(big, 100.0)
    eps, method = pure.tightest_epsilon(big, 1e-5)
    assert method in METHODS and eps <= pure.drv_epsilon(big, 1e-5)
    with pytest.raises(InvalidParameterError, match="grid"):
        pure.dominating_pair_epsilon(big, 1e-5)
    assert pure.optimal_method(big, grid=1e-2) == pure.METHOD_GRID
    assert pure.optimal_method([(0.1, 10**8)]) == pure.METHOD_PLD
    # the coarser grid is still an upper bound: at least the exact homogeneous value
    assert pure.optimal_epsilon([(0.1, 10**5 + 10**5)], 1e-5) <= pure.optimal_epsilon(
        [(0.1, 10**5), (0.1000001, 10**5)], 1e-5) * (1 + 1e-9)


def test_large_k_homogeneous() -> None:
    eps = pure.optimal_epsilon([(0.01, 10**6)], 1e-5)
    assert eps <= pure.advanced_epsilon([(0.01, 10**6)], 1e-5)
    assert pure.optimal_delta([(0.01, 10**6)], eps) <= 1e-5


# ------------------------------------------------------------- bad input
GOOD = [(0.1, 10)]
BAD_TERMS = [
    ([(math.nan, 10)], "terms[0] epsilon"), ([(math.inf, 10)], "terms[0] epsilon"),
    ([(-0.1, 10)], "terms[0] epsilon"), ([(0.0, 10)], "terms[0] epsilon"),
    ([(0.1, 5), ("x", 1)], "terms[1] epsilon"), ([(0.1, 0)], "terms[0] count"),
    ([(0.1, 1.5)], "terms[0] count"), ([(0.1, math.nan)], "terms[0] count"),
    ([(0.1, -3)], "terms[0] count"), ([(0.1, True)], "terms[0] count"),
    ([], "terms"), (5, "terms"), ("ab", "terms"), ([(0.1,)], "terms[0]"), ([0.1], "terms[0]"),
]


@pytest.mark.parametrize(("terms", "name"), BAD_TERMS)
@pytest.mark.parametrize("fn", [
    lambda t: pure.basic_epsilon(t), lambda t: pure.drv_epsilon(t, 1e-5),
    lambda t: pure.advanced_epsilon(t, 1e-5), lambda t: pure.advanced_delta(t, 1.0),
    lambda t: pure.optimal_epsilon(t, 1e-5), lambda t: pure.optimal_delta(t, 1.0),
    lambda t: pure.kov_closed_form_epsilon(t, 1e-5), lambda t: pure.tightest_epsilon(t, 1e-5),
    lambda t: pure.dominating_pair_epsilon(t, 1e-5), lambda t: pure.optimal_method(t),
])
def test_bad_terms(fn, terms, name: str) -> None:  # noqa: ANN001
    with pytest.raises(InvalidParameterError) as info:
        fn(terms)
    assert name in str(info.value)


@pytest.mark.parametrize("delta", [0.0, 1.0, math.nan, -1e-5, 1.5, math.inf, None, "0.1"])
@pytest.mark.parametrize("fn", [pure.drv_epsilon, pure.advanced_epsilon, pure.optimal_epsilon,
                                pure.kov_closed_form_epsilon, pure.tightest_epsilon,
                                pure.dominating_pair_epsilon])
def test_bad_delta(fn, delta) -> None:  # noqa: ANN001
    with pytest.raises(InvalidParameterError, match="delta"):
        fn(GOOD, delta)


@pytest.mark.parametrize("epsilon", [math.nan, -1.0, -math.inf, None])
@pytest.mark.parametrize("fn", [pure.optimal_delta, pure.advanced_delta,
                                pure.kov_closed_form_delta, pure.dominating_pair_delta])
def test_bad_epsilon(fn, epsilon) -> None:  # noqa: ANN001
    with pytest.raises(InvalidParameterError, match="epsilon"):
        fn(GOOD, epsilon)


@pytest.mark.parametrize("grid", [0.0, -1e-4, math.nan, math.inf])
def test_bad_grid(grid: float) -> None:
    with pytest.raises(InvalidParameterError, match="grid"):
        pure.optimal_epsilon([(0.1, 3), (0.2, 3)], 1e-5, grid=grid)
    with pytest.raises(InvalidParameterError, match="grid"):
        pure.optimal_delta([(0.1, 3)], 1.0, grid=grid)


@pytest.mark.parametrize("rtol", [0.0, 1e-20, 0.5, math.nan])
def test_bad_rtol(rtol: float) -> None:
    with pytest.raises(InvalidParameterError, match="rtol"):
        pure.optimal_epsilon(GOOD, 1e-5, rtol=rtol)


# ------------------------------------------------------------- never clamped
def test_nan_result_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pure, "_kov_log_delta_fn", lambda eps0, k: lambda eps: math.nan)
    with pytest.raises(NumericalError):
        pure.optimal_delta(GOOD, 0.5)
    with pytest.raises(NumericalError):
        pure.optimal_epsilon(GOOD, 1e-5)


def test_negative_result_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pure, "_sums", lambda eps, counts: (-1.0, 1.0, 0.0, 0.0))
    with pytest.raises(NumericalError):
        pure.basic_epsilon(GOOD)
    with pytest.raises(NumericalError):
        pure.kov_closed_form_epsilon(GOOD, 1e-5)
