"""Poisson client sampling in time proportional to the sample (``rounds.poisson_sample``).

Every client must be in independently with probability q (a Bernoulli process over the ids:
geometric gaps), whether client c is in must not depend on the population's size or on the
other clients (the add/remove coupling), and the work must follow the sample, not N.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import fl_examples.core.rounds as rounds
from fl_examples.core.dp_modes import ClientDpPlan
from fl_examples.core.rounds import POISSON_BLOCK, poisson_sample
from privkit.seeds import SeedTree

LEVEL = 1e-4


def _binom_p(count: int, n: int, q: float) -> float:
    return float(stats.binomtest(count, n, q).pvalue)


@pytest.mark.parametrize("q", [0.03, 0.5, 0.97])
def test_each_client_is_in_independently_with_probability_q(q):
    """60 clients over 1,500 rounds: every client's rate (a chi-square over the 60 counts),
    the rate of a pair of neighbours (q^2: independence) and the round sizes' variance (the
    binomial's N q (1 - q), not a fixed-size sample's 0)."""
    t = SeedTree(3)
    n, rounds_ = 60, 1500
    hits = np.zeros((rounds_, n), dtype=bool)
    for r in range(rounds_):
        hits[r, poisson_sample(t, r + 1, n, q)] = True
    counts = hits.sum(axis=0)
    expected = rounds_ * q
    chi2 = float((((counts - expected) ** 2) / (expected * (1 - q))).sum())
    assert stats.chi2.sf(chi2, n) > LEVEL
    both = int((hits[:, :-1] & hits[:, 1:]).sum())
    assert _binom_p(both, rounds_ * (n - 1), q * q) > LEVEL
    sizes = hits.sum(axis=1)
    assert np.var(sizes) == pytest.approx(n * q * (1 - q), rel=0.2)


def test_the_gaps_are_geometric_across_a_block_boundary():
    """Around the first block boundary (ids 65,526 .. 65,545), over 4,000 rounds at q = 0.2:
    each id's rate, and the pair that straddles the boundary (independent blocks)."""
    t = SeedTree(9)
    lo = POISSON_BLOCK - 10
    hits = np.zeros((4000, 20), dtype=bool)
    for r in range(4000):
        s = poisson_sample(t, r, POISSON_BLOCK + 10, 0.2)
        s = s[s >= lo] - lo
        hits[r, s] = True
    assert all(_binom_p(int(c), 4000, 0.2) > LEVEL / 20 for c in hits.sum(axis=0))
    straddle = int((hits[:, 9] & hits[:, 10]).sum())
    assert _binom_p(straddle, 4000, 0.04) > LEVEL


def test_nobody_moves_when_the_population_grows_or_shrinks():
    t = SeedTree(1)
    for q in (0.001, 0.1, 0.6):
        big = poisson_sample(t, 5, 3 * POISSON_BLOCK + 17, q)
        for n in (1, 2, 1000, POISSON_BLOCK, POISSON_BLOCK + 1, 2 * POISSON_BLOCK + 5):
            assert np.array_equal(poisson_sample(t, 5, n, q), big[big < n])
    assert not np.array_equal(poisson_sample(t, 5, 5000, 0.1), poisson_sample(t, 6, 5000, 0.1))
    assert not np.array_equal(poisson_sample(t, 5, 5000, 0.1),
                              poisson_sample(SeedTree(2), 5, 5000, 0.1))


def test_edges():
    t = SeedTree(0)
    assert np.array_equal(poisson_sample(t, 1, 7, 1.0), np.arange(7))
    assert poisson_sample(t, 1, 0, 0.5).size == 0
    assert poisson_sample(t, 1, 10**6, 1e-12).size == 0  # (with probability 1 - 1e-6)
    s = poisson_sample(t, 1, 1000, 0.999)
    assert s.size > 980 and np.array_equal(s, np.unique(s)) and s.max() < 1000


def test_the_work_follows_the_sample_not_the_population(monkeypatch):
    """At a fixed expected sample of 100, the words drawn stay within a small multiple of
    the sample plus a few per block, from N = 10^3 to 10^6 (a per-client coin would draw N)."""
    drawn: list[int] = []
    real = rounds._counter_words

    def counting(*args, **kw):
        out = real(*args, **kw)
        drawn.append(out.size)
        return out

    monkeypatch.setattr(rounds, "_counter_words", counting)
    t = SeedTree(4)
    for n in (10**3, 10**4, 10**5, 10**6):
        drawn.clear()
        sizes = [poisson_sample(t, r, n, 100 / n).size for r in range(20)]
        blocks = -(-n // POISSON_BLOCK)
        assert sum(drawn) / 20 < 3 * 100 + 40 * blocks + 200
        assert 60 < np.mean(sizes) < 140


def test_the_client_level_plan_samples_with_it():
    plan = ClientDpPlan(num_clients=5000, client_rate=0.02, l2_clip_norm=1.0,
                        noise_multiplier=1.0)
    t = SeedTree(7)
    assert np.array_equal(plan.select(t, 3), poisson_sample(t, 3, 5000, 0.02))
