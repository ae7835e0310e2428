"""privkit.torch.ClientStreams: Philox4x32-10 known answers, per-client seeds that depend on
(seed, round, client key) only, and named errors."""

from __future__ import annotations

import pytest
import torch

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


def test_a_clients_stream_depends_on_seed_round_and_its_key_only():
    s = pt.ClientStreams(seed=7, round=1)
    seeds = s.seeds([5, 3, 11])
    assert seeds[1] == s.seeds([3])[0] and seeds[0] == s.seeds([11, 5])[1]
    assert len(set(seeds.tolist())) == 3
    others = [pt.ClientStreams(seed=7, round=2).seeds([5])[0],
              pt.ClientStreams(seed=8, round=1).seeds([5])[0], s.seeds([6])[0]]
    assert all(o != seeds[0] for o in others)
    a = [torch.randn(4, generator=g) for g in s.generators([5, 3])]
    b = torch.randn(4, generator=s.generators([3])[0])
    assert torch.equal(a[1], b) and not torch.equal(a[0], b)
    big = pt.ClientStreams(seed=2**64 - 1, round=2**32 - 1)
    assert big.generators([2**32 - 1])[0].initial_seed() >= 0


@pytest.mark.parametrize("kw,words", [
    (dict(seed=2**64), "seed"), (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"),
    (dict(seed=0, round=2**32), "round"),
])
def test_bad_streams_are_named(kw, words):
    with pytest.raises(InvalidParameterError, match=words):
        pt.ClientStreams(**kw)


def test_bad_client_keys_are_named():
    s = pt.ClientStreams(seed=0)
    for keys in ([2**32], [-1], [0.5], [[1, 2]]):
        with pytest.raises(InvalidParameterError, match="client_keys"):
            s.seeds(keys)
