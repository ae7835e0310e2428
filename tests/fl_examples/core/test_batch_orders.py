"""Counter-based per-client batch orders (``rounds.client_orders``, ``local.keyed_batch_orders``).

A sampled client's epoch orders sort its own counter-based words (keyed by the seed, the data
round and its id), with no generator per client: they must be exactly uniform permutations,
independent across epochs, and a client's block must never depend on who else was sampled.
Exactness rests on rejecting ties; the test with a tiny key space shows both that index-order
tie-breaking is biased (the test can fail) and that the rejection removes the bias.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from fl_examples.core.local import _sort_segments, batch_orders, keyed_batch_orders
from fl_examples.core.rounds import client_orders, order_words
from privkit.seeds import SeedTree, _splitmix64

LEVEL = 1e-4  # each chi-square test's false-failure rate (fixed seeds: deterministic)


def _chi2_p(counts: np.ndarray) -> float:
    expected = np.full(counts.size, counts.sum() / counts.size)
    return float(stats.chisquare(counts, expected).pvalue)


def _perm_index(perms: np.ndarray) -> np.ndarray:
    """Each row (a permutation of 0..n-1) as its rank among the n! permutations."""
    n = perms.shape[1]
    table = {p: i for i, p in enumerate(itertools.permutations(range(n)))}
    return np.array([table[tuple(r)] for r in perms.tolist()])


def test_order_words_are_the_documented_splitmix_construction():
    t = SeedTree(11)
    ids = np.array([0, 5, 10**6 - 1, 2**40])
    rows = np.repeat(np.arange(4), 7)
    pos = np.tile(np.arange(7, dtype=np.uint64), 4)
    got = order_words(t, 9, ids, rows, pos, attempt=2)
    k0, k1 = t.sequence(9, "batch-orders/2").generate_state(2, np.uint64)
    g = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        want = _splitmix64(_splitmix64(ids.astype(np.uint64) ^ k0)[rows]
                           ^ _splitmix64(k1 + pos * g))
    assert (got == want).all()
    assert not (got == order_words(t, 9, ids, rows, pos, attempt=3)).any()
    assert not (got == order_words(t, 10, ids, rows, pos, attempt=2)).any()


def test_every_segment_is_a_permutation_and_the_layout_is_batch_orders():
    rng = np.random.default_rng(0)
    sizes = torch.tensor(rng.integers(0, 300, 60))
    sizes[3] = 3000  # a bucket of its own
    epochs = torch.tensor(rng.integers(0, 4, 60))
    ids = np.sort(rng.choice(10**6, 60, replace=False))
    o = client_orders(SeedTree(1), 2, ids, sizes, epochs, "cpu")
    ref = batch_orders(sizes, epochs, generator=torch.Generator().manual_seed(0))
    assert torch.equal(o.offsets, ref.offsets) and o.order.shape == ref.order.shape
    for i, (n, e) in enumerate(zip(sizes.tolist(), epochs.tolist())):
        for ep in range(e):
            assert sorted(o.permutation(i, ep, n).tolist()) == list(range(n))


def test_a_clients_orders_never_depend_on_who_else_was_sampled():
    t = SeedTree(3)
    rng = np.random.default_rng(4)
    ids = np.sort(rng.choice(5000, 40, replace=False))
    sizes = torch.tensor(rng.integers(1, 200, 40))
    epochs = torch.tensor(rng.integers(1, 4, 40))
    together = client_orders(t, 7, ids, sizes, epochs, "cpu")
    for i in (0, 17, 39):
        alone = client_orders(t, 7, ids[i:i + 1], sizes[i:i + 1], epochs[i:i + 1], "cpu")
        start = int(together.offsets[i])
        block = together.order[start:start + int(sizes[i] * epochs[i])]
        assert torch.equal(block, alone.order)
        # with other cohorts around it (another subset, other sizes of the others)
        keep = np.sort(np.unique(np.r_[i, rng.choice(40, 10)]))
        other = sizes[keep].clone()
        j = int(np.flatnonzero(keep == i)[0])
        other[np.arange(keep.size) != j] = torch.tensor(rng.integers(1, 4000, keep.size - 1))
        sub = client_orders(t, 7, ids[keep], other, epochs[keep], "cpu")
        start = int(sub.offsets[j])
        assert torch.equal(sub.order[start:start + block.numel()], block)


def test_client_orders_are_uniform_and_independent_across_epochs():
    """4,800 clients of 3 samples, 2 epochs, over rounds: each epoch's permutation is
    uniform over the 6, and the pair (epoch 0, epoch 1) uniform over the 36."""
    t = SeedTree(5)
    firsts, pairs = [], []
    for r in range(1, 17):
        ids = np.arange(300) * 7 + r
        o = client_orders(t, r, ids, torch.full((300,), 3), torch.full((300,), 2), "cpu")
        blocks = o.order.reshape(300, 2, 3).numpy()
        a, b = _perm_index(blocks[:, 0]), _perm_index(blocks[:, 1])
        firsts.append(a)
        pairs.append(a * 6 + b)
    assert _chi2_p(np.bincount(np.concatenate(firsts), minlength=6)) > LEVEL
    assert _chi2_p(np.bincount(np.concatenate(pairs), minlength=36)) > LEVEL


def _tiny_words(bits: int):
    """Words with only ``bits`` random top bits (the rest 0), counter-based on (row id,
    position, attempt): ties are frequent, so exactness rests on their rejection."""
    def words(rows: np.ndarray, pos: np.ndarray, attempt: int) -> np.ndarray:
        with np.errstate(over="ignore"):
            z = _splitmix64(_splitmix64(rows.astype(np.uint64) * np.uint64(1_000_003)
                                        + np.uint64(attempt)) ^ pos)
        return (z >> np.uint64(64 - bits)) << np.uint64(64 - bits)
    return words


def test_ties_are_redrawn_so_orders_stay_exactly_uniform():
    """Keys of 2 random bits for 3 samples tie in 62.5% of draws. Breaking ties by index
    (what a sort does) favours the identity: the chi-square test sees it at once, so the test
    can fail. With the rejection the 6 permutations are uniform."""
    k = 6000
    sizes, epochs = torch.full((k,), 3), torch.ones(k, dtype=torch.long)
    words = _tiny_words(2)
    o = keyed_batch_orders(sizes, epochs, words)
    counts = np.bincount(_perm_index(o.order.reshape(k, 3).numpy()), minlength=6)
    assert _chi2_p(counts) > LEVEL
    # the same keys sorted once, ties kept in index order: biased towards the identity
    naive = np.empty(3 * k, dtype=np.int64)
    raw = words(np.repeat(np.arange(k), 3), np.tile(np.arange(3, dtype=np.uint64), k), 0)
    _sort_segments(naive, np.arange(k), np.full(k, 3), raw)
    biased = np.bincount(_perm_index(naive.reshape(k, 3)), minlength=6)
    assert _chi2_p(biased) < 1e-30 and biased[0] > 1.5 * counts[0]


def test_a_redrawn_client_still_depends_on_itself_alone():
    """A client whose keys tie is redrawn with its own next attempt: its result with others
    around (who may tie or not) equals its result alone, and theirs are untouched."""
    words = _tiny_words(3)
    sizes = torch.tensor([3, 5, 2, 4, 3])
    epochs = torch.tensor([2, 1, 3, 1, 2])
    together = keyed_batch_orders(sizes, epochs, words)
    for i in range(5):
        def alone_words(rows, pos, attempt, i=i):
            return words(np.full_like(rows, i), pos, attempt)
        alone = keyed_batch_orders(sizes[i:i + 1], epochs[i:i + 1], alone_words)
        start = int(together.offsets[i])
        assert torch.equal(together.order[start:start + int(sizes[i] * epochs[i])],
                           alone.order)


def test_large_epochs_and_empty_clients():
    """A segment above 2^20 samples is sorted on its own (62 bits); empty clients and zero
    epochs give empty blocks; a cohort of nobody gives an empty order."""
    t = SeedTree(0)
    big = (1 << 20) + 3
    o = client_orders(t, 1, [4, 9, 12], torch.tensor([big, 0, 5]), torch.tensor([1, 3, 0]),
                      "cpu")
    assert o.order.numel() == big and o.offsets.tolist() == [0, big, big]
    perm = o.order.numpy()
    assert np.array_equal(np.sort(perm), np.arange(big)) and not np.array_equal(perm[:50],
                                                                               np.arange(50))
    empty = client_orders(t, 1, np.zeros(0, dtype=np.int64), torch.zeros(0, dtype=torch.long),
                          torch.zeros(0, dtype=torch.long), "cpu")
    assert empty.order.numel() == 0


@pytest.mark.parametrize("n", [2, 5])
def test_a_position_is_uniform_over_the_epoch(n):
    """Where sample 0 lands, over many clients: uniform on the n places (a weak check that
    also sees a shifted or reversed order)."""
    t = SeedTree(8)
    ids = np.arange(5000)
    o = client_orders(t, 3, ids, torch.full((5000,), n), torch.ones(5000, dtype=torch.long),
                      "cpu")
    place = np.argmax(o.order.reshape(5000, n).numpy() == 0, axis=1)
    assert _chi2_p(np.bincount(place, minlength=n)) > LEVEL
    assert math.isclose(place.mean(), (n - 1) / 2, abs_tol=0.1)
