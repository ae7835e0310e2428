"""Clipping: the float64 norm of what is returned is <= C, for every dtype and backend.

"<= C" is checked exactly (sum of squares as Fractions against C**2) and with three float64
algorithms (privkit's l2_norm, numpy's norm, math.hypot): privkit keeps a margin so that the
guarantee does not depend on the summation order.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privkit.errors import InvalidParameterError, NumericalError
from privkit.mechanisms import clipping
from privkit.mechanisms.clipping import clip_l2, clip_per_example, l2_norm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BACKEND_DTYPES = [
    ("numpy", "float16"),
    ("numpy", "float32"),
    ("numpy", "float64"),
    ("torch", "float16"),
    ("torch", "bfloat16"),
    ("torch", "float32"),
    ("torch", "float64"),
]
# log10 range of the norms drawn: 1e-30..1e30, within what the dtype can hold.
LOG10_RANGE = {
    "float16": (-6.0, 4.0),
    "bfloat16": (-30.0, 30.0),
    "float32": (-30.0, 30.0),
    "float64": (-30.0, 30.0),
}


def make(values: np.ndarray, backend: str, dtype: str, device: str = "cpu"):
    if backend == "numpy":
        return np.asarray(values, dtype=np.float64).astype(dtype)
    return torch.tensor(np.asarray(values, dtype=np.float64)).to(device, getattr(torch, dtype))


def f64(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return x.detach().to("cpu", torch.float64).numpy()


def eps_of(x) -> float:
    return float(np.finfo(x.dtype).eps) if isinstance(x, np.ndarray) else torch.finfo(x.dtype).eps


def tiny_of(x) -> float:
    """Smallest positive subnormal of x's dtype."""
    if isinstance(x, np.ndarray):
        return float(np.finfo(x.dtype).smallest_subnormal)
    return float(torch.finfo(x.dtype).tiny) * float(torch.finfo(x.dtype).eps)


def slack(x, d: int) -> float:
    """How far below C a clipped norm may land: a few roundings of the dtype plus privkit's
    order-independence margin 2 (d + 8) 2**-53."""
    return 12 * eps_of(x) + 4 * (d + 8) * 2.0**-53


def exact_sq_norm(values: np.ndarray) -> Fraction:
    return sum((Fraction(float(v)) ** 2 for v in values.ravel()), Fraction(0))


def assert_within(y, bound: float) -> None:
    """Every float64 view of ||y|| is <= bound, and so is the exact value."""
    v = f64(y).ravel()
    assert exact_sq_norm(v) <= Fraction(bound) ** 2
    assert l2_norm(y) <= bound
    assert math.hypot(*v) <= bound
    assert np.linalg.norm(v) <= bound


def same_kind(x, y) -> None:
    assert type(x) is type(y) and x.shape == y.shape and x.dtype == y.dtype
    if isinstance(x, torch.Tensor):
        assert x.device == y.device and not y.requires_grad


@st.composite
def clip_cases(draw):
    backend, dtype = draw(st.sampled_from(BACKEND_DTYPES))
    n = draw(st.integers(1, 40))
    lo, hi = LOG10_RANGE[dtype]
    pattern = draw(st.sampled_from(["gaussian", "one_huge", "denormals", "constant"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    v = rng.standard_normal(n) if pattern != "constant" else np.ones(n)
    if pattern == "one_huge":
        v[rng.integers(n)] = 1e12 * (1 + np.abs(v).max())
    v *= 10.0 ** draw(st.floats(lo, hi)) / np.linalg.norm(v)
    x = make(v, backend, dtype)
    if pattern == "denormals":  # half the coordinates at the dtype's subnormal scale
        sub = make(rng.integers(1, 8, n) * tiny_of(x), backend, dtype)
        mask = np.arange(n) % 2 == 0
        x = (
            np.where(mask, sub, x)
            if backend == "numpy"
            else torch.where(torch.from_numpy(mask), sub, x)
        )
    stored = float(np.sqrt(float(exact_sq_norm(f64(x)))))
    if draw(st.booleans()) or stored == 0.0:
        bound = 10.0 ** draw(st.floats(lo, hi))
    else:  # close to the norm, where rounding decides
        bound = stored * (1.0 + draw(st.sampled_from([-1e-3, -1e-7, -1e-12, 0.0, 1e-12])))
    return x, bound


@settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(clip_cases())
def test_clip_property(case):
    x, bound = case
    before = f64(x).copy()
    y = clip_l2(x, bound)
    same_kind(x, y)
    assert y is not x and np.array_equal(f64(x), before)  # input untouched
    assert_within(y, bound)
    xs, ys = f64(x).ravel(), f64(y).ravel()
    norm_x = math.sqrt(float(exact_sq_norm(xs)))
    if norm_x <= bound * (1 - 1e-6):
        assert np.array_equal(xs, ys)  # within the ball: unchanged
    else:
        # Scaled by one common factor in (0, 1): signs kept, magnitudes not increased, and
        # the result is as close to the sphere as the dtype allows.
        assert np.all(np.abs(ys) <= np.abs(xs)) and np.all(ys * xs >= 0)
        # (Subnormal spacing is absolute: allow two steps of it per coordinate.)
        lower = min(bound, norm_x) * (1 - slack(x, xs.size)) - 2 * math.sqrt(xs.size) * tiny_of(x)
        assert math.sqrt(float(exact_sq_norm(ys))) >= lower


@settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.lists(clip_cases(), min_size=1, max_size=6), st.floats(-6.0, 4.0))
def test_per_example_property(cases, log_bound):
    # Rows drawn like the single vectors above, padded to a common length, one dtype.
    backend, dtype = cases[0][0].__class__, cases[0][0].dtype
    rows = [f64(x) for x, _ in cases if x.__class__ is backend and x.dtype == dtype]
    width = max(r.size for r in rows)
    raw = np.zeros((len(rows), width))
    for i, r in enumerate(rows):
        raw[i, : r.size] = r
    x = np.asarray(raw, dtype=dtype) if backend is np.ndarray else torch.tensor(raw).to(dtype)
    bound = 10.0**log_bound
    y = clip_per_example(x, bound)
    same_kind(x, y)
    xs, ys = f64(x), f64(y)
    for i in range(len(rows)):
        assert_within(ys[i], bound)
        if math.sqrt(float(exact_sq_norm(xs[i]))) <= bound * (1 - 1e-6):
            assert np.array_equal(xs[i], ys[i])


def test_bfloat16_factor_cast_to_dtype_would_overshoot():
    # The Opacus-style risk: a factor cast to bfloat16 rounds up and leaves the norm ~0.4%
    # above C. Here even the exact product rounds up (1/sqrt(1000) lies above the midpoint of
    # two bfloat16 values), so only the re-check of the stored values catches it; privkit
    # then shrinks by (1 - 4 eps) as the spec says.
    x = torch.ones(1000, dtype=torch.bfloat16)
    factor = 1.0 / math.sqrt(1000)
    naive = x * torch.tensor(factor, dtype=torch.bfloat16)
    assert l2_norm(naive) > 1.0
    assert l2_norm((x.float() * factor).to(torch.bfloat16)) > 1.0
    y = clip_l2(x, 1.0)
    assert_within(y, 1.0)
    assert l2_norm(y) > 1.0 - 5 * torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_raises_naming_the_leaf(backend, dtype, bad):
    tree = {
        "fc.weight": make([1.0, bad, 2.0], backend, dtype),
        "fc.bias": make([1.0], backend, dtype),
    }
    for fn in (lambda: clip_l2(tree, 1.0), lambda: l2_norm(tree)):
        with pytest.raises(InvalidParameterError, match=r"^tree\['fc.weight'\] must be finite"):
            fn()
    batch = {"g": make(np.ones((4, 3)), backend, dtype)}
    batch["g"][2, 1] = bad
    with pytest.raises(InvalidParameterError, match=r"^batch\['g'\]\[2\] must be finite"):
        clip_per_example(batch, 1.0)


def test_non_finite_float64_with_huge_values():
    # Float64 squares overflow here, so the cheap norm is inf either way; the scaled path
    # must still tell a real inf from an overflow.
    x = np.array([1e300, np.inf])
    with pytest.raises(InvalidParameterError, match="^tree must be finite"):
        clip_l2(x, 1.0)
    with pytest.raises(InvalidParameterError, match=r"^tree\[1\] must be finite"):
        l2_norm([np.ones(2), torch.tensor([1e300, math.nan], dtype=torch.float64)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
def test_zero_vector_unchanged(backend, dtype, device):
    x = make(np.zeros(7), backend, dtype, device)
    y = clip_l2(x, 1e-30)
    same_kind(x, y)
    assert y is not x and not np.any(f64(y))
    y2 = clip_per_example(make(np.zeros((3, 2)), backend, dtype, device), 1.0)
    assert not np.any(f64(y2))


@pytest.mark.parametrize("device", DEVICES)
def test_tree_is_clipped_jointly(device):
    x = {
        "a": torch.tensor([[3.0, 0.0], [0.0, 0.0]], device=device, requires_grad=True),
        "b": [np.array([0.0, 8.0], np.float32), torch.tensor([0.0], dtype=torch.float64)],
        "c": (torch.zeros(0, device=device),),
    }  # total norm sqrt(9 + 64) ~ 8.544
    y = clip_l2(x, 1.0)
    norm = math.sqrt(73.0)
    assert f64(y["a"])[0, 0] == pytest.approx(3.0 / norm, rel=1e-6)
    assert f64(y["b"][0])[1] == pytest.approx(8.0 / norm, rel=1e-6)
    assert_within(np.concatenate([f64(y["a"]).ravel(), f64(y["b"][0]), f64(y["b"][1])]), 1.0)
    assert l2_norm(y) >= 1.0 - 1e-6
    same_kind(x["a"], y["a"])
    assert y["c"][0].shape == (0,)
    assert x["a"].requires_grad and f64(x["a"])[0, 0] == 3.0


def test_norm_is_overflow_and_underflow_safe():
    assert l2_norm(np.array([1e300, 1e300])) == pytest.approx(math.sqrt(2) * 1e300, rel=1e-15)
    assert l2_norm(np.array([3e-170, 4e-170])) == pytest.approx(5e-170, rel=1e-15, abs=0)
    assert l2_norm(torch.full((4,), 1e-200, dtype=torch.float64)) == pytest.approx(
        2e-200, rel=1e-14, abs=0
    )
    assert l2_norm(np.full(100, 60000.0, np.float16)) == pytest.approx(600000.0, rel=1e-3)
    assert l2_norm({}) == 0.0
    with pytest.raises(NumericalError):
        l2_norm(np.full(4, 1e308))
    y = clip_l2(np.full(4, 1e308), 1.0)  # the norm overflows float64; the clip does not
    np.testing.assert_allclose(y, 0.5, rtol=1e-12)
    assert l2_norm(y) <= 1.0
    tiny = clip_l2(np.full(4, 1e-300), 1e-301)
    assert l2_norm(tiny) <= 1e-301 and l2_norm(tiny) > 0.99e-301


@pytest.mark.parametrize("bad", [math.nan, 0.0, -1.0, math.inf, None, "1"])
def test_bad_clip_norm_raises(bad):
    for fn in (clip_l2, clip_per_example):
        with pytest.raises(InvalidParameterError, match="^l2_clip_norm must be"):
            fn(np.ones((2, 2)), bad)


def test_bad_leaves_raise():
    with pytest.raises(InvalidParameterError, match=r"^tree\['i'\] must be"):
        clip_l2({"i": np.ones(2, np.int64)}, 1.0)
    with pytest.raises(InvalidParameterError, match=r"^batch\['b'\] must be .*leading"):
        clip_per_example({"a": np.ones((3, 2)), "b": np.ones((2, 2))}, 1.0)
    with pytest.raises(InvalidParameterError, match=r"^batch must be"):
        clip_per_example(torch.tensor(1.0), 1.0)


# ---------------------------------------------------------------------------- per example
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
def test_per_example_rows(backend, dtype, device):
    if backend == "numpy" and device != "cpu":
        return
    rng = np.random.default_rng(0)
    lo, hi = LOG10_RANGE[dtype]
    b = 64
    raw = rng.standard_normal((b, 3, 5))
    raw *= (np.logspace(max(lo, -3), min(hi, 3), b) / np.linalg.norm(raw.reshape(b, -1), axis=1))[
        :, None, None
    ]
    raw[5] = 0.0
    x = make(raw, backend, dtype, device)
    before = f64(x).copy()
    y = clip_per_example(x, 1.0)
    same_kind(x, y)
    assert np.array_equal(f64(x), before)
    xs, ys = f64(x).reshape(b, -1), f64(y).reshape(b, -1)
    for i in range(b):
        assert_within(ys[i], 1.0)
        norm_x = math.sqrt(float(exact_sq_norm(xs[i])))
        if norm_x <= 1 - 1e-6:
            assert np.array_equal(xs[i], ys[i])
        else:
            assert math.sqrt(float(exact_sq_norm(ys[i]))) >= 1 - slack(x, 15)


def test_per_example_float64_extremes():
    x = np.zeros((5, 4))
    x[0] = 1e200  # squares overflow
    x[1] = 1e-200  # squares underflow
    x[2] = [3.0, 4.0, 0.0, 0.0]
    x[4, 0] = 1e-320  # subnormal
    y = clip_per_example(x, 1e-250)
    for i in range(5):
        assert_within(y[i], 1e-250)
    np.testing.assert_allclose(y[0], 0.5e-250, rtol=1e-12, atol=0)
    np.testing.assert_allclose(y[1], 0.5e-250, rtol=1e-12, atol=0)
    np.testing.assert_allclose(y[2], [0.6e-250, 0.8e-250, 0, 0], rtol=1e-12, atol=0)
    assert np.array_equal(y[3], x[3]) and np.array_equal(y[4], x[4])


def test_per_example_tree_rows_are_joint():
    rng = np.random.default_rng(1)
    w = torch.tensor(rng.standard_normal((8, 4, 3)), dtype=torch.float32)
    bias = rng.standard_normal((8, 3)).astype(np.float32)
    y = clip_per_example({"w": w, "b": bias}, 1.5)
    joint = np.concatenate([f64(y["w"]).reshape(8, -1), f64(y["b"])], axis=1)
    raw = np.concatenate([f64(w).reshape(8, -1), bias.astype(np.float64)], axis=1)
    for i in range(8):
        assert_within(joint[i], 1.5)
        norm_x = np.linalg.norm(raw[i])
        expected = raw[i] * min(1.0, 1.5 / norm_x)
        assert np.allclose(joint[i], expected, rtol=1e-6, atol=0)


def test_per_example_is_vectorised(monkeypatch):
    calls = []
    real = clipping._row_norms_fast
    monkeypatch.setattr(clipping, "_row_norms_fast", lambda x2: calls.append(1) or real(x2))
    x = torch.randn(5000, 20) * torch.logspace(-2, 2, 5000)[:, None]
    y = clip_per_example(x, 1.0)
    assert len(calls) <= 4  # norms of the input and of the stored rows, not one per row
    assert torch.linalg.vector_norm(y.double(), dim=1).max() <= 1.0


def test_per_example_empty_batch():
    y = clip_per_example(np.zeros((0, 3)), 1.0)
    assert y.shape == (0, 3)


def test_sum_of_clipped_fp32_clients_matches_fsum():
    # 1e4 clipped float32 client vectors, accumulated in float64, stay within C * 1e-6 of the
    # math.fsum reference (spec section 1, "Summation").
    rng = np.random.default_rng(2)
    n, d, bound = 10_000, 50, 1.0
    updates = rng.standard_normal((n, d)).astype(np.float32)
    updates *= np.logspace(-1, 2, n, dtype=np.float32)[:, None]
    clipped = clip_per_example(updates, bound)
    assert clipped.dtype == np.float32
    rows = clipped.astype(np.float64)
    assert np.max(np.sqrt(np.einsum("ij,ij->i", rows, rows))) <= bound
    total = rows.sum(axis=0)  # float64, pairwise
    reference = np.array([math.fsum(rows[:, j]) for j in range(d)])
    assert np.max(np.abs(total - reference)) <= bound * 1e-6
    assert np.linalg.norm(reference) <= n * bound


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_l2_norms_are_float64_norms_and_refuse_what_is_not_rows(backend, dtype):
    from privkit.mechanisms import row_l2_norms

    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 333)).astype(dtype)
    x[7, 3] = np.nan
    x[9, 0] = np.inf
    leaf = x if backend == "numpy" else torch.from_numpy(x)
    got = row_l2_norms(leaf)
    assert isinstance(got, np.ndarray) and got.dtype == np.float64 and got.shape == (50,)
    ref = np.sqrt((x.astype(np.float64) ** 2).sum(1))
    ok = np.isfinite(ref)
    np.testing.assert_allclose(got[ok], ref[ok], rtol=1e-13)
    assert not np.isfinite(got[7]) and not np.isfinite(got[9])
    assert row_l2_norms(np.zeros((0, 4), np.float32)).shape == (0,)
    for bad in (np.ones(3), np.ones((2, 2, 2)), {"a": np.ones((2, 2))}, np.ones((2, 2), int)):
        with pytest.raises(InvalidParameterError, match="rows"):
            row_l2_norms(bad)
