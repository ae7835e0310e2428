"""Canaries (privkit.audit.canaries), the DP-SGD hook, and the saved scores (runs)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import privkit
from privkit import ClientLevelGaussian
from privkit.audit import (
    CanaryRun,
    WhiteBoxScorer,
    canary_rows,
    cosine_scores,
    final_model_estimate,
    flatten,
    make_canaries,
    recompute,
    two_run_scores,
    with_canaries,
)
from privkit.audit.runs import SCHEMA, SCORES_FILE
from privkit.errors import InvalidParameterError

DELTA = 1e-5


def test_dirac_and_random_canaries():
    d = make_canaries(50, 80, norm=3.0, seed=4)
    assert d.m == 50 and len(set(d.coordinates.tolist())) == 50
    assert 10 < d.included.sum() < 40  # fair coins
    v = d.vectors(np.ones(50, bool))
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 3.0)
    np.testing.assert_allclose(d.project(v[7]), np.eye(50)[7] * 3.0)
    r = make_canaries(20, 5000, norm=1.0, seed=4, kind="random")
    g = r.matrix @ r.matrix.T
    np.testing.assert_allclose(np.diag(g), 1.0)
    assert np.abs(g - np.eye(20)).max() < 0.1  # nearly orthogonal in high dimension
    # the same seed gives the same canaries; the coins come from their own stream
    assert (make_canaries(50, 80, norm=3.0, seed=4).included == d.included).all()
    with pytest.raises(InvalidParameterError, match="m must be at most dim"):
        make_canaries(81, 80, norm=1.0, seed=0)
    with pytest.raises(InvalidParameterError, match="kind"):
        make_canaries(1, 8, norm=1.0, seed=0, kind="gauss")


def test_rows_follow_the_trees_layout_numpy_and_torch():
    torch = pytest.importorskip("torch")
    like = {"a": np.zeros((2, 3)), "b": np.zeros(4, np.float32)}
    c = make_canaries(10, 10, norm=1.0, seed=0).with_included(True)
    rows = canary_rows(c, like)
    assert rows["a"].shape == (10, 2, 3) and rows["b"].dtype == np.float32
    flat = np.stack([flatten({"a": rows["a"][i], "b": rows["b"][i]}) for i in range(10)])
    np.testing.assert_allclose(flat, c.vectors())
    net = torch.nn.Linear(3, 2)
    trows = canary_rows(make_canaries(8, 8, norm=1.0, seed=1).with_included(True),
                        dict(net.named_parameters()))
    assert trows["weight"].shape == (8, 2, 3) and trows["bias"].dtype == torch.float32
    stack = with_canaries({"w": torch.zeros(3, 4)}, make_canaries(4, 4, norm=1.0, seed=0))
    assert isinstance(stack["w"], torch.Tensor) and stack["w"].shape[1] == 4


def test_canary_clients_are_clipped_like_clients_and_scored_in_noise_units():
    can = make_canaries(300, 300, norm=10.0, seed=2)  # above C: the mechanism must clip
    agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=0.8)
    sc = WhiteBoxScorer(can, stddev=agg.stddev, l2_clip_norm=1.0)
    assert sc.shift == pytest.approx(1.25)
    rng = np.random.default_rng(0)
    for _ in range(9):
        real = {"w": rng.normal(size=(4, 300))}
        sc.add(agg(with_canaries(real, can), rng=rng), known={"w": agg.clip(real)["w"].sum(0)})
    ins, outs = sc.in_out()
    assert ins.mean() == pytest.approx(3 * 1.25, abs=0.2)  # sqrt(9) / z
    assert outs.mean() == pytest.approx(0.0, abs=0.2)
    assert outs.std() == pytest.approx(1.0, abs=0.15)


def test_llr_statistic_for_poisson_sampled_canaries():
    can = make_canaries(2000, 2000, norm=1.0, seed=3)
    z, q = 0.7, 0.3
    sc = WhiteBoxScorer(can, stddev=z, l2_clip_norm=1.0, sampling_probability=q)
    assert sc.statistic == "llr"
    rng = np.random.default_rng(1)
    for _ in range(10):
        take = can.poisson(q, rng)
        sc.add(can.vectors(take).sum(0) + rng.normal(0.0, z, 2000))
    ins, outs = sc.in_out()
    # an out-canary's log-likelihood ratio has negative mean (-KL), an in-canary's positive
    assert outs.mean() < 0 < ins.mean()
    # sum over 10 releases of log(1 - q + q e^{a x - a^2 / 2}) with x = N(0, 1): exact mean
    a = 1 / z
    xs = np.random.default_rng(9).normal(size=200_000)
    want = 10 * np.mean(np.logaddexp(math.log1p(-q), math.log(q) + a * xs - a * a / 2))
    assert outs.mean() == pytest.approx(want, abs=0.15)  # ~3 standard errors


def test_eligible_releases_only_count_for_their_canaries():
    can = make_canaries(4, 4, norm=1.0, seed=0).with_included(True)
    sc = WhiteBoxScorer(can, stddev=1.0, l2_clip_norm=1.0)
    sc.add(np.array([1.0, 1.0, 1.0, 1.0]))
    sc.add(np.array([3.0, 3.0, 3.0, 3.0]), eligible=np.array([True, False, True, False]))
    np.testing.assert_allclose(sc.scores, [4 / math.sqrt(2), 1.0, 4 / math.sqrt(2), 1.0])
    with pytest.raises(InvalidParameterError, match="eligible"):
        sc.add(np.zeros(4), eligible=np.ones(3, bool))


def test_final_model_canaries_give_an_estimate():
    # Andrew et al.: canary clients with random directions; cosines with the final change
    rng = np.random.default_rng(0)
    d = 5000
    can = make_canaries(400, d, norm=1.0, seed=5, kind="random")
    change = can.vectors().sum(0) + rng.normal(0.0, 2.0, d)
    ins, outs = can.split(cosine_scores(change, can))
    est = final_model_estimate(ins, outs, delta=DELTA)
    assert est.note == "an estimate, not a bound" and est.epsilon_estimate > 0
    run = CanaryRun(ins, outs, "final-model", DELTA, accounted_epsilon=100.0)
    audit = run.audit()
    assert run.threat_model == "final-model"
    assert [e.method for e in audit.estimates] == ["andrew-et-al-final-model"]
    assert {b.method for b in audit.bounds} == {"one-run", "gaussian-one-run"}


def test_scores_saved_as_json_and_recomputed(tmp_path):
    ins, outs = two_run_scores(lambda inc, rng: 0.8 * inc + rng.normal(), 400, seed=3)
    run = CanaryRun(ins, outs, "two-run", DELTA, accounted_epsilon=3.0, statistic="sum",
                    settings={"noise_multiplier": 1.25, "rounds": 1})
    path = run.save(tmp_path)
    assert path.name == SCORES_FILE
    obj = json.loads(path.read_text())
    assert obj["schema"] == SCHEMA and len(obj["in_scores"]) == 400
    again = recompute(tmp_path)
    first = run.audit()
    assert [b.to_dict() for b in again.bounds] == [b.to_dict() for b in first.bounds]
    assert again.to_dict()["exceeded"] is False and again.lines()[0].startswith("accounted")
    assert again.joint_confidence == pytest.approx(0.85)
    obj["schema"] = "other"
    path.write_text(json.dumps(obj))
    with pytest.raises(InvalidParameterError, match="schema"):
        recompute(path)
    with pytest.raises(InvalidParameterError, match="path"):
        recompute(tmp_path / "missing.json")
    with pytest.raises(InvalidParameterError, match="mode"):
        CanaryRun([1.0], [0.0], "three-run", DELTA)


# ------------------------------------------------------------------ DP-SGD (make_private)
torch = pytest.importorskip("torch")


def _dpsgd(noise_multiplier, *, m=1000, steps=2, seed=0, nonoise=False):
    """make_private on a linear model, full batches (q = 1); m Dirac canary examples added to
    every step through ``extra_gradients``; each release scored white-box."""
    import privkit.torch as pt

    torch.manual_seed(seed)
    net = torch.nn.Linear(500, 2)
    x = torch.randn(64, 500)
    y = (x[:, 0] > 0).long()
    data = torch.utils.data.TensorDataset(x, y)
    z = 1e-9 if nonoise else noise_multiplier
    dp = pt.make_private(net, torch.optim.SGD(net.parameters(), lr=0.5), dataset=data,
                         expected_batch_size=64, max_grad_norm=1.0, delta=DELTA,
                         noise_multiplier=z, generator=torch.Generator().manual_seed(seed))
    params = dict(net.named_parameters())
    can = make_canaries(m, sum(p.numel() for p in params.values()), norm=5.0, seed=seed)
    sc = WhiteBoxScorer(can, stddev=noise_multiplier * 1.0, l2_clip_norm=1.0)
    releases = []
    for _ in range(steps):
        for xb, yb in dp.epoch():
            known = pt.clipped_grad_sum(net, xb, yb, l2_clip_norm=1.0).grads
            dp.step(xb, yb, extra_gradients=canary_rows(can, params))
            release = {n: p.grad.detach() * dp.expected_batch_size for n, p in params.items()}
            releases.append((release, known))
            sc.add(release, known=known)
    return dp, can, sc, releases


def test_extra_gradients_are_clipped_examples_charged_as_usual():
    dp, can, _, releases = _dpsgd(1.0, m=10, steps=1, nonoise=True)
    release, known = releases[0]
    diff = flatten(release) - flatten(known)
    np.testing.assert_allclose(diff, can.vectors().sum(0) / can.norm, atol=1e-5)  # each -> C
    assert dp.steps == 1 and dp.epsilon().epsilon > 0
    with pytest.raises(InvalidParameterError, match="extra_gradients"):
        dp.step(torch.randn(2, 500), torch.tensor([0, 1]),
                extra_gradients={"weight": torch.zeros(1, 2, 500)})


def test_dpsgd_audit_sees_half_noise_and_not_the_correct_code():
    z = privkit.calibrate_noise_multiplier(target_epsilon=2.0, delta=DELTA, steps=2,
                                           sampling_probability=1.0).noise_multiplier
    dp, can, sc, _ = _dpsgd(z)
    eps = dp.epsilon().epsilon
    ok = CanaryRun(*sc.in_out(), "one-run", DELTA, accounted_epsilon=eps).audit()
    assert not ok.exceeded, ok.lines()
    # the bug: the loop was built with half the noise, the report still prints z's epsilon
    # (the scores' units do not matter to the bounds: ranks, or a fitted variance)
    _, _, bad_sc, _ = _dpsgd(z / 2)
    bad = CanaryRun(*bad_sc.in_out(), "one-run", DELTA, accounted_epsilon=eps).audit()
    assert bad.exceeded, bad.lines()
