"""Samplers: the L2-Laplace battery with its mutants, Gaussian / Laplace laws, trees, secure mode.

False-failure rates. The battery (spec mechanisms.md section 3) fails when any p-value is
below 1e-3 / k (k = number of tests in that battery), so a correct sampler fails one battery
with probability <= 1e-3. Everything seeded (numpy, torch, the mutants) is deterministic: it
either always passes or always fails. Secure mode cannot be seeded: its 4 batteries fail a
correct sampler with probability <= 4e-3 per run and its 13 one-sample KS tests (threshold
1e-4 each) with probability <= 1.3e-3, so about 0.5% of runs in all; two instances agree
with probability ~2**-53.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import random
import subprocess
import sys
import textwrap

import _mutants as M
import numpy as np
import pytest
import torch
from scipy import stats

from privkit._rng import RngKind, check_rng
from privkit.errors import InvalidParameterError
from privkit.mechanisms.sampling import (
    SecureRandom,
    gaussian_noise,
    l2_laplace_noise,
    l2_laplace_variance,
    laplace_noise,
    num_coordinates,
    tree_map,
)

ALPHA = 2.0
N = 20_000
DIMS = (1, 2, 10, 100)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BACKENDS = ["numpy", "torch"] + (["cuda"] if torch.cuda.is_available() else []) + ["secure"]


def make_rng(backend: str, seed: int):
    if backend == "numpy":
        return np.random.default_rng(seed)
    if backend == "secure":
        return SecureRandom()
    return torch.Generator(device="cuda" if backend == "cuda" else "cpu").manual_seed(seed)


def to_numpy(leaf) -> np.ndarray:
    if isinstance(leaf, np.ndarray):
        return leaf.astype(np.float64)
    return leaf.detach().to("cpu", torch.float64).numpy()


def flat(tree) -> np.ndarray:
    leaves: list[np.ndarray] = []
    tree_map(lambda leaf: leaves.append(to_numpy(leaf).ravel()), tree)
    return np.concatenate(leaves)


def like_tree(backend: str, d: int):
    """A tree with d coordinates over several leaves (the norm is taken over all of them)."""
    if backend == "numpy" or backend == "secure":
        shapes = {1: [(1,)], 2: [(1,), (1,)], 10: [(3, 3), (1,)], 100: [(10, 5), (50,)]}[d]
        return [np.zeros(s) for s in shapes]
    device = "cuda" if backend == "cuda" else "cpu"
    shapes = {1: [(1,)], 2: [(2,)], 10: [(2, 4), (2,)], 100: [(4, 5, 5)]}[d]
    return {f"p{i}": torch.zeros(s, device=device) for i, s in enumerate(shapes)}


@functools.cache
def l2_draws(backend: str, d: int) -> np.ndarray:
    """N draws of the public l2_laplace_noise, one call per draw, as an (N, d) array."""
    rng = make_rng(backend, 7_000 + d)
    tree = like_tree(backend, d)
    return np.stack([flat(l2_laplace_noise(tree, ALPHA, rng=rng)) for _ in range(N)])


# ---------------------------------------------------------------------------- the battery
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_l2_laplace_passes_battery(backend, d):
    x = l2_draws(backend, d)
    assert x.shape == (N, d)
    p = M.battery(x, ALPHA)
    assert len(p) == (2 if d == 1 else 5)
    assert M.failed(p) == [], p


def test_l2_laplace_second_moment():
    x = l2_draws("numpy", 10)
    mean_sq = float(np.mean(np.sum(x * x, axis=1)))
    assert mean_sq == pytest.approx(l2_laplace_variance(10, ALPHA), rel=0.05)


@pytest.mark.parametrize("d", (2, 10, 100))
def test_l2_laplace_numpy_vs_torch(d):
    a, b = l2_draws("numpy", d), l2_draws("torch", d)
    assert stats.ks_2samp(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)).pvalue > 1e-3
    assert stats.ks_2samp(a[:, 0], b[:, 0]).pvalue > 1e-3


# Which mutant must fail which test at which d (spec section 3 table), and where it must pass.
MUST_FAIL = [
    ("rate_scale_swapped", (1, 2, 10, 100), {"norm_ks"}),
    ("gamma_d_minus_1", (2, 10, 100), {"norm_ks"}),
    ("iid_laplace", (2, 10, 100), {"norm_ks", "beta_ks"}),
    ("cube_direction", (2, 10, 100), {"beta_ks"}),
    ("mapa_laplace_magnitude", (2, 10, 100), {"norm_ks"}),
    ("shifted_direction", (1, 2, 10, 100), {"rayleigh"}),
    ("anisotropic_direction", (2, 10, 100), {"bingham"}),
    ("coupled_radius", (2, 10, 100), {"spearman"}),
]
# At d = 1 these are the correct law (identical in distribution), so they must pass.
MUST_PASS_AT_D1 = ["iid_laplace", "cube_direction", "mapa_laplace_magnitude"]


@functools.cache
def mutant_failures(name: str, d: int) -> tuple[tuple[str, ...], dict[str, float]]:
    x = getattr(M, name)(np.random.default_rng(9_000 + d), N, d, ALPHA)
    p = M.battery(x, ALPHA)
    return tuple(M.failed(p)), p


@pytest.mark.parametrize("name,d,caught_by", [(n, d, c) for n, dims, c in MUST_FAIL for d in dims])
def test_mutant_fails_battery(name, d, caught_by):
    failures, p = mutant_failures(name, d)
    assert caught_by <= set(failures), (failures, p)


def test_cube_mutant_is_caught_only_by_beta_ks():
    # The cube's symmetry makes E[u u^T] = I/d exactly: the moment tests are blind to it.
    for d in (2, 10, 100):
        failures, p = mutant_failures("cube_direction", d)
        assert failures == ("beta_ks",)
        assert p["beta_ks"] <= 2.5e-10


def test_gamma_d_minus_1_norm_p_value_is_tiny_even_at_d_100():
    assert mutant_failures("gamma_d_minus_1", 100)[1]["norm_ks"] <= 3e-28


@pytest.mark.parametrize("name", MUST_PASS_AT_D1)
def test_mutants_identical_at_d1_pass(name):
    assert mutant_failures(name, 1)[0] == ()


def test_upcycled_fl_sampler_fails():
    p = M.battery(M.upcycled_per_tensor(np.random.default_rng(42), N, ALPHA), ALPHA)
    assert {"norm_ks", "beta_ks"} <= set(M.failed(p)), p
    assert p["norm_ks"] < 1e-100 and p["beta_ks"] < 1e-30


def test_every_test_kills_a_mutant():
    killers = set()
    for name, dims, _ in MUST_FAIL:
        for d in dims:
            killers |= set(mutant_failures(name, d)[0])
    assert killers == {"norm_ks", "rayleigh", "bingham", "beta_ks", "spearman"}


# ---------------------------------------------------------------------------- Gaussian, Laplace
def _leaf(kind: str, dtype: str, n: int, device: str = "cpu"):
    if kind == "numpy":
        return np.zeros(n, dtype=dtype)
    return torch.zeros(n, dtype=getattr(torch, dtype), device=device)


LAW_CASES = [
    ("numpy", "numpy", "float64"),
    ("numpy", "torch", "float32"),
    ("torch", "torch", "float32"),
    ("torch", "torch", "float16"),
    ("torch", "torch", "bfloat16"),
    ("torch", "numpy", "float64"),
    ("secure", "torch", "float32"),
    ("secure", "numpy", "float64"),
    ("secure", "torch", "bfloat16"),
    ("secure", "numpy", "float16"),
] + ([("cuda", "torch", "float32")] if torch.cuda.is_available() else [])


def _threshold(backend: str) -> float:
    return 1e-4 if backend == "secure" else 1e-3


@pytest.mark.parametrize("backend,leaf_kind,dtype", LAW_CASES)
def test_gaussian_ks(backend, leaf_kind, dtype):
    device = "cuda" if backend == "cuda" else "cpu"
    noise = gaussian_noise(_leaf(leaf_kind, dtype, N, device), 3.0, rng=make_rng(backend, 11))
    x = to_numpy(noise)
    assert stats.kstest(x, stats.norm(scale=3.0).cdf).pvalue > _threshold(backend)


@pytest.mark.parametrize("backend,leaf_kind,dtype", LAW_CASES)
def test_laplace_ks(backend, leaf_kind, dtype):
    device = "cuda" if backend == "cuda" else "cpu"
    noise = laplace_noise(_leaf(leaf_kind, dtype, N, device), 0.5, rng=make_rng(backend, 12))
    x = to_numpy(noise)
    assert stats.kstest(x, stats.laplace(scale=0.5).cdf).pvalue > _threshold(backend)


@pytest.mark.parametrize("sampler,param", [(gaussian_noise, 2.0), (laplace_noise, 0.7)])
def test_numpy_vs_torch_two_sample(sampler, param):
    a = to_numpy(sampler(np.zeros(N), param, rng=np.random.default_rng(1)))
    b = to_numpy(sampler(torch.zeros(N), param, rng=torch.Generator().manual_seed(1)))
    assert stats.ks_2samp(a, b).pvalue > 1e-3


def test_torch_laplace_tails_are_finite_and_symmetric():
    x = to_numpy(laplace_noise(torch.zeros(200_000), 1.0, rng=torch.Generator().manual_seed(3)))
    assert np.isfinite(x).all()
    assert abs(np.mean(x > 0) - 0.5) < 0.01


# ---------------------------------------------------------------------------- trees and devices
Pair = collections.namedtuple("Pair", "first second")


def rich_tree(device: str = "cpu"):
    return {
        "w": torch.ones(3, 2, dtype=torch.bfloat16, device=device, requires_grad=True),
        "layers": [
            np.ones((2, 2), dtype=np.float16),
            (torch.ones(4, dtype=torch.float64, device=device), np.ones(1, np.float32)),
        ],
        "named": Pair(torch.ones(1, 5, dtype=torch.float16, device=device), np.ones(3)),
        "ordered": collections.OrderedDict(b=torch.ones(2, device=device)),
    }


def _same_structure(a, b):
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
        assert not b.requires_grad
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            _same_structure(a[k], b[k])
    else:
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same_structure(x, y)


@pytest.mark.parametrize("sampler", [gaussian_noise, laplace_noise, l2_laplace_noise])
@pytest.mark.parametrize("backend", BACKENDS)
def test_structure_dtype_device_preserved(sampler, backend):
    for device in DEVICES:
        tree = rich_tree(device)
        before = flat(tree)
        out = sampler(tree, 1.5, rng=make_rng(backend, 5))
        _same_structure(tree, out)
        assert np.array_equal(flat(tree), before)  # input untouched
        values = flat(out)
        assert np.isfinite(values).all() and np.count_nonzero(values) > values.size // 2


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("sampler", [gaussian_noise, laplace_noise, l2_laplace_noise])
def test_fast_modes_are_reproducible(backend, sampler):
    a = flat(sampler(rich_tree(), 1.0, rng=make_rng(backend, 3)))
    b = flat(sampler(rich_tree(), 1.0, rng=make_rng(backend, 3)))
    c = flat(sampler(rich_tree(), 1.0, rng=make_rng(backend, 4)))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_draws_on_generator_device(device):
    g = torch.Generator(device=device).manual_seed(0)
    out = gaussian_noise(torch.zeros(5, device=device), 1.0, rng=g)
    assert out.device.type == device
    # A numpy leaf with a torch generator comes back as numpy.
    assert isinstance(l2_laplace_noise(np.zeros(3), 1.0, rng=g), np.ndarray)


def test_l2_laplace_d1_is_laplace():
    x = l2_draws("numpy", 1)[:, 0]
    assert stats.kstest(x, stats.laplace(scale=1.0 / ALPHA).cdf).pvalue > 1e-3
    assert l2_laplace_variance(1, ALPHA) == pytest.approx(2.0 / ALPHA**2)
    assert np.var(x) == pytest.approx(2.0 / ALPHA**2, rel=0.05)


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "sampler,name",
    [(gaussian_noise, "stddev"), (laplace_noise, "scale"), (l2_laplace_noise, "alpha")],
)
@pytest.mark.parametrize("bad", [math.nan, 0.0, -1.0, math.inf, "1", None])
def test_bad_parameter_raises(sampler, name, bad):
    with pytest.raises(InvalidParameterError, match=f"^{name} must be"):
        sampler(np.zeros(2), bad, rng=np.random.default_rng(0))


@pytest.mark.parametrize("bad", [None, 3, random.Random(0), np.random.RandomState(0), "x"])
def test_bad_rng_raises(bad):
    with pytest.raises(InvalidParameterError, match="^rng must be"):
        gaussian_noise(np.zeros(2), 1.0, rng=bad)


@pytest.mark.parametrize(
    "tree,name",
    [
        ({}, "tree"),
        ([], "tree"),
        ({"a": np.zeros(0)}, r"tree\['a'\]"),
        ([np.zeros(2, dtype=np.int64)], r"tree\[0\]"),
        ({"t": torch.zeros(2, dtype=torch.int32)}, r"tree\['t'\]"),
        ([1.0, 2.0], r"tree\[0\]"),
        ({"c": torch.zeros(2, dtype=torch.complex64)}, r"tree\['c'\]"),
    ],
)
@pytest.mark.parametrize("sampler", [gaussian_noise, laplace_noise, l2_laplace_noise])
def test_bad_tree_raises(sampler, tree, name):
    with pytest.raises(InvalidParameterError, match=f"^{name} must be"):
        sampler(tree, 1.0, rng=np.random.default_rng(0))


def test_check_rng_kinds():
    assert check_rng(np.random.default_rng(0)) is RngKind.NUMPY
    assert check_rng(torch.Generator()) is RngKind.TORCH
    assert check_rng(SecureRandom()) is RngKind.SECURE


def test_variance_and_counting_helpers():
    assert l2_laplace_variance(42, 0.5) == 42 * 43 / 0.25
    with pytest.raises(InvalidParameterError, match="^d must be"):
        l2_laplace_variance(0, 1.0)
    with pytest.raises(InvalidParameterError, match="^alpha must be"):
        l2_laplace_variance(3, math.nan)
    assert num_coordinates(rich_tree()) == 6 + 4 + 4 + 1 + 5 + 3 + 2
    assert num_coordinates({}) == 0
    summed = tree_map(lambda a, b: a + b, {"x": np.ones(2)}, {"x": np.ones(2)})
    assert summed["x"].tolist() == [2.0, 2.0]
    with pytest.raises(InvalidParameterError, match="structure"):
        tree_map(lambda a, b: a, {"x": np.ones(2)}, {"y": np.ones(2)})


# ---------------------------------------------------------------------------- secure mode
@pytest.mark.parametrize(
    "kwargs", [{"seed": 0}, {"seed": 12345}, {"key": b"0123456789abcdef"}, {"seed": 0.0}]
)
def test_secure_refuses_seeds(kwargs):
    (name,) = kwargs  # the error names the argument given (seed or key)
    with pytest.raises(InvalidParameterError, match=f"^{name} must be None .*seeds are refused"):
        SecureRandom(**kwargs)


def test_secure_refuses_positional_seed():
    with pytest.raises(InvalidParameterError, match="^seed must be"):
        SecureRandom(7)


def test_secure_instances_differ():
    a, b = SecureRandom(), SecureRandom()
    assert not np.array_equal(a.gaussian(1.0, 4), b.gaussian(1.0, 4))
    tree = {"w": torch.zeros(8)}
    assert not torch.equal(
        gaussian_noise(tree, 1.0, rng=SecureRandom())["w"],
        gaussian_noise(tree, 1.0, rng=SecureRandom())["w"],
    )


def test_secure_entropy_failure_propagates(monkeypatch):
    rng = SecureRandom()

    def broken(n):
        raise OSError("entropy source unavailable")

    monkeypatch.setattr(os, "urandom", broken)
    for call in (
        lambda: SecureRandom(),
        lambda: rng.uniform(3),
        lambda: gaussian_noise(np.zeros(3), 1.0, rng=rng),
        lambda: laplace_noise(torch.zeros(3), 1.0, rng=rng),
        lambda: l2_laplace_noise({"w": np.zeros(3)}, 1.0, rng=rng),
        lambda: rng.gaussian(1.0, 3 << 20),  # the threaded, chunked path
    ):
        with pytest.raises(OSError, match="entropy source unavailable"):
            call()


def test_secure_gaussian_is_four_draws_per_element(monkeypatch):
    rng = SecureRandom()
    drawn: list[int] = []
    nbytes: list[int] = []
    real_normal = SecureRandom.standard_normal
    real_urandom = os.urandom

    def spy_normal(self, size=None):
        drawn.append(int(np.prod(size)))
        return real_normal(self, size)

    def spy_urandom(n):
        nbytes.append(n)
        return real_urandom(n)

    monkeypatch.setattr(SecureRandom, "standard_normal", spy_normal)
    monkeypatch.setattr(os, "urandom", spy_urandom)
    n = 1_000
    out = gaussian_noise({"a": np.zeros(n // 2), "b": torch.zeros(n // 2)}, 1.0, rng=rng)
    assert sum(drawn) == 4 * n
    # 4 normals = 2 Box-Muller pairs = 4 uniforms = 32 bytes of OS entropy per element.
    assert sum(nbytes) == 32 * n
    assert out["a"].dtype == np.float64 and out["b"].dtype == torch.float32
    # Laplace: 4 uniforms per element too.
    nbytes.clear()
    laplace_noise(np.zeros(n), 1.0, rng=rng)
    assert sum(nbytes) == 32 * n


def test_secure_uniform_and_gamma():
    rng = SecureRandom()
    u = rng.uniform(N)
    assert 0.0 < u.min() and u.max() < 1.0 and u.dtype == np.float64
    assert stats.kstest(u, "uniform").pvalue > 1e-4
    for shape in (0.25, 1.0, 3.5, 1e6):
        g = rng.gamma(shape, 2.0, N // 4)
        assert stats.kstest(g, stats.gamma(shape, scale=2.0).cdf).pvalue > 1e-4
    with pytest.raises(InvalidParameterError, match="^shape must be"):
        rng.gamma(0.0)


def test_secure_gamma_fixed_work(monkeypatch):
    rng = SecureRandom()
    nbytes: list[int] = []
    real_urandom = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: nbytes.append(n) or real_urandom(n))
    # shape 50: every candidate is accepted with probability > 0.99, so all 100 elements are
    # settled by the first 4 candidates except with probability < 1e-6.
    rng.gamma(50.0, 1.0, 100)
    assert sum(nbytes) == 100 * 4 * (8 + 8)  # 4 normals and 4 uniforms per element


def test_secure_zero_word_is_redrawn(monkeypatch):
    # A word whose top 53 bits are 0 would give u = 0 and log(0); it is redrawn instead.
    rng = SecureRandom()
    real_urandom = os.urandom
    requests: list[int] = []

    def first_word_zero(n):
        data = bytearray(real_urandom(n))
        if not requests:
            data[:8] = bytes(8)
        requests.append(n)
        return bytes(data)

    monkeypatch.setattr(os, "urandom", first_word_zero)
    u = rng.uniform(4)
    assert requests == [32, 8] and 0.0 < u.min() and u.max() < 1.0
    requests.clear()
    z = rng.standard_normal(4)
    assert requests == [32, 8] and np.isfinite(z).all()


def test_works_without_torch():
    # torch is optional: samplers and clipping never import it. Run in a fresh interpreter
    # where importing torch fails.
    code = textwrap.dedent(
        """
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is not installed")

        sys.meta_path.insert(0, NoTorch())
        import numpy as np
        from privkit._rng import check_rng
        from privkit.mechanisms.clipping import clip_l2, clip_per_example, l2_norm
        from privkit.mechanisms.sampling import (
            SecureRandom, gaussian_noise, l2_laplace_noise, laplace_noise)

        tree = {"w": np.full(3, 2.0, np.float32), "b": [np.ones(2)]}
        assert l2_norm(clip_l2(tree, 1.0)) <= 1.0
        assert clip_per_example(np.ones((4, 3)), 1.0).shape == (4, 3)
        for rng in (np.random.default_rng(0), SecureRandom()):
            for sampler in (gaussian_noise, laplace_noise, l2_laplace_noise):
                assert sampler(tree, 1.0, rng=rng)["w"].dtype == np.float32
        try:
            check_rng(object())
        except ValueError:
            pass
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
