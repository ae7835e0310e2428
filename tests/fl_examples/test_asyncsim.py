"""The asynchronous event simulator: determinism, FIFO, staleness, participation, tau_max."""

import numpy as np
import pytest

from fl_examples.core.asyncsim import Dist, TimingModel, parse_dist, simulate
from privkit.errors import InvalidParameterError

FIELDS = ("edge", "upload", "pull_version", "staleness", "applied", "version", "arrival_s",
          "done_s")


def same(a, b):
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


def test_deterministic_for_a_seed_and_seed_matters():
    t = TimingModel(speed_dist="exponential:1", link_dist="lognormal:0,0.5", cloud_time_s=0.02)
    a = simulate(20, 500, t, seed=4)
    b = simulate(20, 500, t, seed=4)
    c = simulate(20, 500, t, seed=5)
    assert same(a, b) and np.array_equal(a.speeds, b.speeds)
    assert not np.array_equal(a.edge, c.edge)


@pytest.mark.parametrize("tau_max", [None, 4])
def test_vectorized_and_event_paths_agree(tau_max):
    t = TimingModel(speed_dist="lognormal:0,1", link_time_s=0.3)
    a = simulate(15, 800, t, seed=1, tau_max=tau_max, method="vectorized")
    b = simulate(15, 800, t, seed=1, tau_max=tau_max, method="events")
    assert same(a, b)
    assert a.method == "vectorized" and b.method == "events"


def test_fifo_order_with_a_busy_cloud():
    # the cloud is slower than the edges' combined upload rate, so uploads queue
    t = TimingModel(speed_dist="uniform:0.5,2", compute_time_s=1.0, link_time_s=0.1,
                    cloud_time_s=0.2)
    s = simulate(10, 400, t, seed=3)
    assert s.method == "events"
    assert np.all(np.diff(s.arrival_s) >= 0)  # served in arrival order
    assert np.all(np.diff(s.done_s) >= 0.2 - 1e-12)  # one at a time
    wait = s.done_s - 0.2 - s.arrival_s
    assert np.all(wait >= -1e-12) and wait.max() > 0.5  # the buffer really held uploads
    # a FIFO server starts each upload at max(its arrival, the previous one's end)
    start = s.done_s - 0.2
    expect = np.maximum(s.arrival_s[1:], s.done_s[:-1])
    assert np.allclose(start[1:], expect)


@pytest.mark.parametrize("tau_max,cloud", [(None, 0.0), (None, 0.05), (3, 0.0), (6, 0.05)])
def test_staleness_is_updates_applied_between_pull_and_apply(tau_max, cloud):
    t = TimingModel(speed_dist="lognormal:0,1", cloud_time_s=cloud)
    s = simulate(8, 300, t, seed=7, tau_max=tau_max)
    applied_so_far = np.cumsum(s.applied)  # after each event
    last = {}
    for j, k in enumerate(s.edge.tolist()):
        prev = last.get(k)
        pull = 0 if prev is None else int(applied_so_far[prev])
        between = int(s.applied[(prev + 1 if prev is not None else 0):j].sum())
        assert s.pull_version[j] == pull
        assert s.staleness[j] == between
        assert s.upload[j] == (0 if prev is None else s.upload[prev] + 1)
        last[k] = j
    assert np.array_equal(s.version[s.applied], np.arange(1, s.num_applied + 1))
    assert s.num_applied == 300
    if tau_max is not None:
        assert s.staleness[s.applied].max() <= tau_max
        assert (~s.applied).sum() > 0 and np.all(s.staleness[~s.applied] > tau_max)
        assert np.all(s.version[~s.applied] == -1)


def test_round_robin_with_equal_speeds():
    s = simulate(4, 12, TimingModel(speed_dist="constant", jitter="none"), seed=0)
    assert s.edge.tolist() == [0, 1, 2, 3] * 3
    assert s.staleness.tolist() == [0, 1, 2, 3] + [3] * 8  # K - 1 in steady state
    assert s.staleness_histogram() == {0: 1, 1: 1, 2: 1, 3: 9}


def test_heterogeneous_speeds_give_the_expected_participation():
    t = TimingModel(speed_dist="lognormal:0,0.8", link_dist="uniform:0.5,2", link_time_s=0.2)
    s = simulate(6, 30000, t, seed=11)
    expected = s.expected_participation(t)
    assert expected.max() / expected.min() > 2  # really heterogeneous
    assert np.allclose(s.participation(), expected, atol=0.006)
    # the mean staleness of K always-busy edges is K - 1 (a counting argument)
    assert s.staleness.mean() == pytest.approx(5, abs=0.05)


def test_too_small_tau_max_is_refused():
    # with tau_max = 0 only one of 20 round-robin edges gets applied per round
    t = TimingModel(speed_dist="constant", jitter="none")
    s = simulate(20, 10, t, seed=0, tau_max=0)
    assert s.edge[s.applied].tolist() == [0] * 10 and s.num_events == 20 * 9 + 1
    for method in ("vectorized", "events"):
        with pytest.raises(InvalidParameterError, match="tau_max"):
            simulate(20, 50, t, seed=0, tau_max=0, method=method, max_events=200)


@pytest.mark.parametrize("bad", ["", "normal:0,1", "lognormal:0", "exponential:0",
                                 "uniform:2,1", "lognormal:0,-1", "constant:0", "uniform:a,b",
                                 "lognormal:nan,1", 3])
def test_bad_distributions_are_named(bad):
    with pytest.raises(InvalidParameterError, match="speed_dist"):
        TimingModel(speed_dist=bad)


def test_bad_simulator_arguments():
    with pytest.raises(InvalidParameterError, match="num_edges"):
        simulate(0, 10, seed=0)
    with pytest.raises(InvalidParameterError, match="num_updates"):
        simulate(3, 0, seed=0)
    with pytest.raises(InvalidParameterError, match="tau_max"):
        simulate(3, 10, seed=0, tau_max=-1)
    with pytest.raises(InvalidParameterError, match="method"):
        simulate(3, 10, TimingModel(cloud_time_s=0.1), seed=0, method="vectorized")
    with pytest.raises(InvalidParameterError, match="compute_time_s"):
        TimingModel(compute_time_s=0)
    with pytest.raises(InvalidParameterError, match="jitter"):
        TimingModel(jitter="gaussian")


def test_dist_draws_are_positive():
    rng = np.random.default_rng(0)
    for spec in ("exponential:2", "lognormal:0,1", "uniform:1,3", "constant:2"):
        d = parse_dist(spec)
        assert isinstance(d, Dist) and np.all(d.draw(rng, 1000) > 0)
    assert parse_dist("exponential:2").draw(rng, 100000).mean() == pytest.approx(2, rel=0.02)
