"""``--audit-canaries M`` with ``--aggregation distributed``: canary clients in the secure sum.

The bugs feared most: a canary that moves an honest client's encoding (its rounding coins or
noise share), a canary counted as a survivor or a noise share (a round released that should
have been skipped, or the calibration's guaranteed noise lowered), a canary that adds noise
(the audit then blind to clients that add too little), a score in the wrong units (not unit
noise for a canary left out), a skipped round scored, and an audit blind to clients whose
noise shares are half what the ledger prices.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import privkit.mechanisms.distributed as mdist
from fl_examples.core.canaries import CONFIDENCE, EXIT_EXCEEDED, SCORES_NOTE, for_plan
from fl_examples.core.distributed import DistributedDpPlan, distributed_plan, rotation_seed
from fl_examples.core.seeds import SeedTree
from fl_examples.dprec import DPRecConfig
from fl_examples.upcycled import UpcycledConfig
from privkit.cli import main
from privkit.mechanisms.distributed import center_modular


def _plan(**kw):
    args = dict(num_clients=6, client_rate=1.0, l2_clip_norm=1.0, dim=400, bits=20,
                rounds=16, delta=1e-5, noise_multiplier=2.0) | kw
    return distributed_plan(**args)[0]


def _local(w, k, gen, scale=1.0):
    return {n: v.unsqueeze(0) + scale * torch.randn(k, *v.shape, generator=gen, dtype=v.dtype)
            for n, v in w.items()}


def _model(d):
    return {"w": torch.zeros(d // 4, 3, dtype=torch.float64),
            "b": torch.zeros(d - 3 * (d // 4), dtype=torch.float64)}


# ------------------------------------------------------------------ the releases themselves
def test_canaries_leave_the_honest_encodings_and_the_divisor_as_they_were(monkeypatch):
    """The same round with and without canaries: every honest client sends the same residues
    (its own stream; the canaries round with their own coins), the canaries send no noise
    (their integers are the noiseless encoder's), the decoded sum differs by exactly the
    canaries' decoded integers, which sit on their coordinates (C each, divided by q N)."""
    plan = _plan(num_clients=5, dim=40)
    d, tree, sel = 40, SeedTree(7), np.arange(5)
    w = _model(d)
    local = _local(w, 5, torch.Generator().manual_seed(1))
    sent: list = []
    orig_client, orig_canary = DistributedDpPlan.client_input, DistributedDpPlan.canary_input

    def spy_client(self, c, update, **kw):
        y, x = orig_client(self, c, update, **kw)
        sent.append(("client", c, y.copy()))
        return y, x

    def spy_canary(self, vector, **kw):
        y, x = orig_canary(self, vector, **kw)
        sent.append(("canary", vector.copy(), x.copy()))
        return y, x

    monkeypatch.setattr(DistributedDpPlan, "client_input", spy_client)
    monkeypatch.setattr(DistributedDpPlan, "canary_input", spy_canary)
    plain = plan.release(w, local, {}, sel=sel, data_round=3, tree=tree)
    honest = list(sent)
    sent.clear()
    can = for_plan(plan, 30, d, seed=4)
    audited = plan.release(w, local, {}, sel=sel, data_round=3, tree=tree, canaries=can)
    clients = [s for s in sent if s[0] == "client"]
    canaries = [s for s in sent if s[0] == "canary"]
    assert len(clients) == 5 and all(a[1] == b[1] and np.array_equal(a[2], b[2])
                                     for a, b in zip(honest, clients))
    inc = can.canaries.included
    assert len(canaries) == inc.sum() > 0 and can.releases == 1
    seed = rotation_seed(tree, 3)
    mech = plan.mechanism()
    ints = np.zeros(plan.padded_dim, dtype=np.int64)
    for _, vector, x in canaries:
        assert np.linalg.norm(vector) == pytest.approx(2.0)  # 2 C: the encoder clips it
        assert int(x @ x) <= mech.norm_bound_sq  # the clients' norm bound: no noise in x
        # the noiseless encoder, redrawn with the same coins (rounding only: |x - y| < 1)
        rot = mdist.hadamard_rotate(np.pad(vector / 2.0, (0, plan.padded_dim - d)), seed)
        assert np.abs(x - rot / plan.granularity).max() < 1
        ints += x
    contrib = mdist.inverse_hadamard_rotate(ints * plan.granularity, seed)[:d] / 5.0
    step = torch.cat([(audited[k] - plain[k]).reshape(-1) for k in w]).numpy()
    np.testing.assert_allclose(step, contrib, atol=1e-9)
    want = np.zeros(d)
    want[can.canaries.coordinates[inc]] = 1.0 / 5  # C on each included canary's coordinate
    np.testing.assert_allclose(step, want, atol=plan.granularity * math.sqrt(len(canaries)))
    assert can.canaries.project(step)[~inc] == pytest.approx(0.0, abs=1e-3)


def test_canary_residues_reduce_the_noiseless_integers():
    plan = _plan(bits=16)
    seed = rotation_seed(SeedTree(0), 1)
    v = np.zeros(400)
    v[17] = 2.0
    y, x = plan.canary_input(v, rng=np.random.default_rng(3), rotation_seed=seed)
    assert np.array_equal(np.mod(x, 1 << 16).astype(np.uint64), y)
    direct = plan.noiseless().encode(v, rng=np.random.default_rng(3), rotation_seed=seed)
    assert np.array_equal(center_modular(direct, 62), x)
    assert not plan.noiseless()._noise and plan.mechanism()._noise


def test_a_skipped_round_draws_releases_and_scores_nothing():
    """A cohort below min_survivors is skipped whatever the canaries: they are not
    survivors, draw no coin, and the round is not scored."""
    plan = _plan(min_survivors=5)
    can = for_plan(plan, 50, 400, seed=1)
    before = can._rng.bit_generator.state
    w = _model(400)
    state: dict = {}
    new = plan.release(w, _local(w, 4, torch.Generator().manual_seed(0)), state,
                       sel=np.arange(4), data_round=1, tree=SeedTree(0), canaries=can)
    assert torch.equal(new["w"], w["w"]) and state["distributed"]["skipped"] == 1
    assert can.releases == 0 and can._pending is None
    assert can._rng.bit_generator.state == before
    assert plan.entries(1, np.arange(4)) == []  # nothing charged either


def test_scores_are_unit_noise_for_canaries_left_out_and_shift_1_over_z():
    """Scores from the decoded sums in units of C: out-scores N(0, 1) (the Skellam shares of
    the honest clients, rotated back: near Gaussian), in-scores shifted sqrt(T) / z, with
    real updates of norm far above C in the sums (clipped: more noise to a score)."""
    z, t, d = 2.0, 16, 400
    plan = _plan(noise_multiplier=z, dim=d)
    can = for_plan(plan, 300, d, seed=2)
    assert can.z == pytest.approx(plan.noise_multiplier) and can.q == 1.0
    assert can.describe()["noise_stddev_of_sum"] == pytest.approx(z * plan.l2_clip_norm)
    w, tree, state = _model(d), SeedTree(1), {}
    gen = torch.Generator().manual_seed(0)
    for r in range(1, t + 1):
        plan.release(w, _local(w, 6, gen, scale=5.0), state, sel=np.arange(6), data_round=r,
                     tree=tree, canaries=can)
    assert can.releases == t and state["distributed"]["wrapped"] == 0
    ins, outs = can.canaries.split(can.scores())
    assert abs(outs.mean()) < 4 / math.sqrt(outs.size)
    assert 0.8 < outs.std() < 1.2
    assert abs(ins.mean() - math.sqrt(t) / z) < 4 / math.sqrt(ins.size)


def test_canaries_are_sampled_at_the_released_rounds_rate():
    """Poisson sampling: a canary takes part in a released round with q' (the rate the
    ledger amplifies a released round at), scored by the log-likelihood ratio."""
    plan = _plan(num_clients=40, client_rate=0.3, min_survivors=10)
    can = for_plan(plan, 20, 400, seed=0)
    assert can.q == pytest.approx(plan.released_rate) and can.q > 0.3
    assert can.statistic == "llr"
    block = can.describe()
    assert block["sampling_probability"] == plan.released_rate
    assert "no noise share" in block["where"] and "adding no noise share" in block["note"]
    assert 0 < block["wrap_bound_per_round"] <= 1


# ------------------------------------------------------------------ the trainers
def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# q = 1, 650 coordinates, 600 canaries, 10 data rounds, epsilon 2 (the central mode's test)
UPCYCLED = ["train", "upcycled", "--dataset", "digits:iid@20", "--privacy", "client",
            "--aggregation", "distributed", "--client-rate", "1", "--noise-for-epsilon", "2",
            "--rounds", "20", "--epochs", "1", "--eval-every", "20", "--audit-canaries", "600",
            "-q"]


def test_a_distributed_run_audits_below_its_accounted_epsilon(tmp_path, capsys):
    out = tmp_path / "o"
    code, stdout, err = _run([*UPCYCLED, "--seed", "0", "--out", str(out)], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    block = report["audit"]
    assert block["m"] == 600 and block["confidence"] == CONFIDENCE
    assert block["exceeded"] is False
    assert 0 <= block["epsilon_lower_bound"] < block["accounted_epsilon"]
    assert block["accounted_epsilon"] == pytest.approx(2.0, rel=1e-6)
    assert set(block["lower_bounds"]) == {"one-run", "gaussian-one-run"}
    assert block["lower_bounds"]["gaussian-one-run"] > 0.2 * block["accounted_epsilon"]
    p = report["algorithms"]["upcycled"]["privacy"]
    assert p["aggregation"] == "distributed" and p["wrapped_rounds"] == 0
    assert p["charged_rounds"] == 10 and p["canaries"]["releases"] == 10
    assert p["canaries"]["scores"] == SCORES_NOTE and "no noise share" in p["canaries"]["where"]
    assert block["canaries"]["noise_multiplier"] == pytest.approx(p["noise_multiplier"])
    assert [x for x in stdout.splitlines() if x.startswith("audit: ")] == [block["line"]]
    code, again, _ = _run(["audit", "run", str(out)], capsys)
    assert code == 0 and again.splitlines()[0] == block["line"]


def _quarter_variance(monkeypatch):
    """Every noise share at a quarter of its variance (half its standard deviation, the
    central mode's half-noise test), the ledger still pricing the full shares."""
    orig = mdist.skellam_noise

    def half(size, mu, *, rng):
        return orig(size, mu / 4.0, rng=rng)

    monkeypatch.setattr(mdist, "skellam_noise", half)


@pytest.mark.parametrize("seed", [0, 1])
def test_half_the_noise_shares_are_caught_above_the_accounted_epsilon(seed, tmp_path, capsys,
                                                                      monkeypatch):
    _quarter_variance(monkeypatch)
    out = tmp_path / "o"
    code, _, err = _run([*UPCYCLED, "--seed", str(seed), "--out", str(out)], capsys)
    assert code == EXIT_EXCEEDED, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "exceeds the accounted epsilon" in lines[0]
    block = json.loads((out / "report.json").read_text())["audit"]
    assert block["exceeded"] is True
    assert block["lower_bounds"]["gaussian-one-run"] > 1.2 * block["accounted_epsilon"]


def test_dprec_dpfedavg_distributed_run_with_canaries(tmp_path, capsys, monkeypatch):
    """dprec's DP-FedAvg under distributed DP takes canaries too: a correct run stays below,
    the same run with no noise shares at all is flagged (exit 3)."""
    argv = ["train", "dprec", "--algorithms", "dpfedavg", "--clients", "12", "--rounds", "8",
            "--client-rate", "1", "--aggregation", "distributed", "--noise-for-epsilon", "2",
            "--epochs", "1", "--eval-every", "8", "--audit-canaries", "400", "-q"]
    code, _, err = _run([*argv, "--out", str(tmp_path / "a")], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    block = report["audit"]
    assert not block["exceeded"] and block["epsilon_lower_bound"] < block["accounted_epsilon"]
    p = report["algorithms"]["dpfedavg"]["privacy"]
    assert p["aggregation"] == "distributed" and p["canaries"]["m"] == 400
    assert block["accounted_epsilon"] == pytest.approx(p["epsilon_central"])
    orig = mdist.skellam_noise
    monkeypatch.setattr(mdist, "skellam_noise",
                        lambda size, mu, *, rng: orig(size, 1e-12, rng=rng))
    code, _, err = _run([*argv, "--out", str(tmp_path / "b")], capsys)
    assert code == EXIT_EXCEEDED, err
    assert json.loads((tmp_path / "b" / "report.json").read_text())["audit"]["exceeded"]


def test_the_configurations_accept_canaries_with_distributed_aggregation():
    cfg = UpcycledConfig(dataset="synthetic:iid@40/40", privacy="client",
                         aggregation="distributed", audit_canaries=10, iterations=4)
    assert cfg.audit_canaries == 10 and cfg.adaptive_clip == 0.0
    assert DPRecConfig(aggregation="distributed", audit_canaries=5).audit_canaries == 5


def test_with_sampling_only_released_rounds_are_scored(tmp_path):
    """q = 0.3 of 40 clients, min_survivors 12: some rounds are skipped; the canaries are
    scored in exactly the charged (released) rounds, at q', and the run's epsilon is the
    plain run's (a canary is no survivor: the same rounds skipped, the same charges)."""
    from fl_examples.core.data import parse_dataset_spec
    from fl_examples.upcycled import run_algorithm

    base = dict(dataset="synthetic:iid@40/40", local_epochs=1, batch_size=16, lr=0.1,
                device="cpu", stragglers=0.0, seed=3, mu=0.01, lam=0.04, privacy="client",
                aggregation="distributed", l2_clip_norm=1.0, client_rate=0.3,
                min_survivors=12, noise_multiplier=1.5, bits=16, iterations=8)
    data = parse_dataset_spec(base["dataset"], seed=3)
    plain = run_algorithm("fedavg", UpcycledConfig(**base), data, iterations=8)
    res = run_algorithm("fedavg", UpcycledConfig(**base, audit_canaries=30), data,
                        iterations=8, out=tmp_path)
    p, q = res["privacy"], plain["privacy"]
    assert 0 < p["skipped_rounds"] == q["skipped_rounds"]
    assert p["charged_rounds"] == q["charged_rounds"] == p["canaries"]["releases"]
    assert p["epsilon_max"] == q["epsilon_max"]
    assert p["canaries"]["sampling_probability"] == pytest.approx(p["released_rate"])
    assert res["_canaries"].statistic == "llr"
