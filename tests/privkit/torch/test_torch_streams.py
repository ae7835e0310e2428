"""privkit.torch.ClientStreams: Philox4x32-10 known answers, the laws of the draws (fixed
seeds, stated false-failure rates, a wrong sampler fails), per-client independence of the
batch, and named errors."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

import privkit.torch as pt
from privkit.errors import InvalidParameterError
from privkit.torch.streams import philox4x32_10


def _hex(words):
    return [f"{int(w):08x}" for w in words]


def test_philox_matches_random123_known_answers():
    z = torch.zeros(1, dtype=torch.int64)
    ones = torch.full((1,), 0xFFFFFFFF, dtype=torch.int64)
    assert _hex(philox4x32_10([z, z, z, z], (0, 0))) == [
        "6627e8d5", "e169c58d", "bc57ac4c", "9b00dbd8"]
    assert _hex(philox4x32_10([ones] * 4, (0xFFFFFFFF, 0xFFFFFFFF))) == [
        "408f276d", "41c83b0e", "a20bc7c6", "6d5451fd"]
    pi = [torch.tensor([v]) for v in (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)]
    assert _hex(philox4x32_10(pi, (0xA4093822, 0x299F31D0))) == [
        "d16cfe09", "94fdcceb", "5001e420", "24126ea1"]


def test_uniforms_and_normals_have_their_laws():
    # KS tests on 2e5 draws at fixed seeds: false-failure rate 1e-6 each
    s = pt.ClientStreams(seed=12345)
    u = s.uniforms(torch.arange(4), 3, 50_000).reshape(-1)
    assert float(u.min()) > 0 and float(u.max()) <= 1
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-6
    for dtype in (torch.float32, torch.float64):
        z = s.normals(torch.arange(4), 3, 50_000, dtype=dtype).reshape(-1)
        assert z.dtype == dtype
        assert stats.kstest(z.double().numpy(), "norm").pvalue > 1e-6
        assert stats.kstest(1.03 * z.double().numpy(), "norm").pvalue < 1e-6  # a wrong scale
    # Poisson inclusion u < q: Binomial(2e5, 0.05), 5 standard deviations (6e-7)
    sd = (2e5 * 0.05 * 0.95) ** 0.5
    assert abs(int((u < 0.05).sum()) - 1e4) <= 5 * sd


def test_a_clients_draws_depend_on_its_key_step_and_round_only():
    s = pt.ClientStreams(seed=7, round=1)
    many = s.normals([5, 3, 11], 4, 10)
    assert torch.equal(s.normals([3], 4, 10)[0], many[1])
    assert torch.equal(s.normals([11, 5], 4, 6)[1], many[0, :6])  # fewer, prefix, reordered
    steps = s.uniforms([3, 5], torch.tensor([2, 4]), 9)
    assert steps.shape == (2, 2, 9)
    assert torch.equal(steps[1], s.uniforms([3, 5], 4, 9))
    others = [pt.ClientStreams(seed=7, round=2).normals([5], 4, 10)[0],
              pt.ClientStreams(seed=8, round=1).normals([5], 4, 10)[0],
              s.normals([5], 5, 10)[0], s.normals([6], 4, 10)[0]]
    assert all(not torch.equal(o, many[0]) for o in others)


@pytest.mark.parametrize("kw,words", [
    (dict(seed=2**64), "seed"), (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"),
    (dict(seed=0, round=2**30), "round"),
])
def test_bad_streams_are_named(kw, words):
    with pytest.raises(InvalidParameterError, match=words):
        pt.ClientStreams(**kw)


def test_bad_draw_arguments_are_named():
    s = pt.ClientStreams(seed=0)
    with pytest.raises(InvalidParameterError, match="client_keys"):
        s.uniforms([2**32], 0, 3)
    with pytest.raises(InvalidParameterError, match="client_keys"):
        s.uniforms([0.5], 0, 3)
    with pytest.raises(InvalidParameterError, match="step"):
        s.normals([0], -1, 3)
    with pytest.raises(InvalidParameterError, match="dtype"):
        s.normals([0], 0, 3, dtype=torch.float16)
