"""``--audit-canaries M``: canaries in the trainers' own releases, and ``privkit audit run``.

The bugs feared most: canary rows that change the real clients' part of a release (their
noise, their clipping, the adaptive clip norm, the divisor); a score that is not pure noise
for a canary left out (banded MF's correlated noise left in, a wrong unit); an audit blind
to a trainer whose noise is half what it prices; a correct trainer flagged; a flag silently
ignored where it cannot apply; ``privkit audit run`` disagreeing with the run.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fl_examples.core.banded import banded_plan
from fl_examples.core.canaries import (
    CONFIDENCE,
    EXIT_EXCEEDED,
    NORM_FACTOR,
    SCORES_NOTE,
    TrainerCanaries,
    decorrelated_scores,
    for_plan,
)
from fl_examples.core.dp_modes import ClientDpPlan
from fl_examples.core.seeds import SeedTree
from privkit.audit import CanaryRun, recompute
from privkit.audit.canaries import CANARY_NOTE
from privkit.cli import main
from privkit.mechanisms.aggregate import AdaptiveClipping, ClientLevelGaussian

CPU = torch.device("cpu")


def _model(d: int = 40) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(d // 4, 3), "b": torch.zeros(d - 3 * (d // 4))}


# ------------------------------------------------------------------ the releases themselves
@pytest.mark.parametrize("adaptive", [False, True])
def test_canary_rows_leave_the_real_part_of_the_release_as_it_was(adaptive):
    """Same generator with and without canaries: the noisy sum differs by exactly the
    canaries' clipped vectors (norm 2 C clipped to C), the adaptive clip norm is the same
    (canaries are not in the count) and the divisor q N is unchanged."""
    d = 40
    ad = AdaptiveClipping(0.5, learning_rate=0.2, count_stddev=2.0,
                          sampling_probability=1.0) if adaptive else None
    plan = ClientDpPlan(5, 1.0, 0.7, 1.3, adaptive=ad)
    w = _model(d)
    g = torch.Generator().manual_seed(3)
    local = {k: v.unsqueeze(0) + torch.randn(5, *v.shape, generator=g) for k, v in w.items()}
    can = for_plan(plan, 30, d, seed=4)
    s0, s1 = {}, {}
    plain = plan.release(w, local, s0, torch.Generator().manual_seed(9))
    audited = plan.release(w, local, s1, torch.Generator().manual_seed(9), canaries=can)
    assert s0.get("clip") == s1.get("clip")  # the count never sees a canary
    step = torch.cat([(audited[k] - plain[k]).reshape(-1) for k in w]).double().numpy()
    inc = can.canaries.included
    want = np.zeros(d)
    want[can.canaries.coordinates[inc]] = 0.7 / 5  # clipped to C, divided by q N = 5
    np.testing.assert_allclose(step, want, atol=1e-5)
    assert NORM_FACTOR > 1  # the rows were above C: the mechanism clipped them


def test_dp_fedavg_scores_are_unit_noise_for_canaries_left_out_and_shift_1_over_z():
    """Poisson q = 1 (sum statistic): out-scores N(0, 1), in-scores N(sqrt(T) / z, 1), with
    real updates of norm far above C in the release (clipped; to a score from the release
    alone they are more noise, centred here)."""
    d, t, z = 400, 16, 2.0
    plan = ClientDpPlan(6, 1.0, 1.0, z)
    can = for_plan(plan, 300, d, seed=1)
    w = _model(d)
    g = torch.Generator().manual_seed(0)
    state: dict = {}
    for _ in range(t):
        local = {k: v.unsqueeze(0) + 5 * torch.randn(6, *v.shape, generator=g)
                 for k, v in w.items()}
        plan.release(w, local, state, g, canaries=can)
    ins, outs = can.canaries.split(can.scores())
    assert abs(outs.mean()) < 4 / math.sqrt(outs.size)
    assert 0.8 < outs.std() < 1.2
    assert abs(ins.mean() - math.sqrt(t) / z) < 4 / math.sqrt(ins.size)


@pytest.mark.parametrize("participation", ["minsep", "cyclic"])
def test_banded_scores_undo_the_correlated_noise(participation):
    """The real BandMF releases: after decorrelation a canary left out scores N(0, 1) and one
    taken part scores ||C 1_S|| / z; scoring the raw releases instead gives out-scores whose
    spread is not 1 (the correlated noise), which this test would catch."""
    z = 1.5
    plan, _ = banded_plan(num_clients=12, rounds=12, bands=4, participation=participation,
                          client_rate=0.25, groups=4 if participation == "cyclic" else None,
                          l2_clip_norm=1.0, noise_multiplier=z, noise_for_epsilon=None,
                          delta=1e-5)
    d = 1200
    can = for_plan(plan, 1000, d, seed=2)
    assert can.strategy is not None and len(can.strategy) == 4
    w, tree, state = _model(d), SeedTree(5), {}
    for r in range(1, 13):
        sel = plan.select(tree, r, None, state)
        local = {k: v.unsqueeze(0) + torch.randn(len(sel), *v.shape,
                                                 generator=tree.torch(r, "x", CPU))
                 for k, v in w.items()}
        plan.release(w, local, state, tree.torch(r, "noise", CPU), sel=sel, data_round=r,
                     canaries=can)
    ins, outs = can.canaries.split(can.scores())
    eligible = np.array([(r - 1) % 4 == 0 for r in range(1, 13)])
    c = np.asarray(plan.strategy.coefficients)
    pattern = np.array([sum(c[t - s] for s in range(t + 1) if eligible[s] and t - s < 4)
                        for t in range(12)])
    assert abs(outs.mean()) < 4 / math.sqrt(outs.size)
    assert 0.88 < outs.std() < 1.12
    assert abs(ins.mean() - np.linalg.norm(pattern) / z) < 4 / math.sqrt(ins.size)
    raw = np.array(can._signals)  # the undecorrelated projections: not unit noise
    assert raw[:, ~can.canaries.included].sum(0).std() / math.sqrt(12) < 0.8


def test_decorrelation_inverts_the_strategy():
    c = np.array([1.0, -0.4, 0.1])
    t, m = 7, 3
    rng = np.random.default_rng(0)
    z = rng.normal(size=(t, m))
    cm = sum(np.eye(t, k=-j) * c[j] for j in range(3))
    y = np.linalg.solve(cm, z)  # releases with correlated noise C^-1 Z, no canary
    e = np.zeros(t, bool)
    e[0] = True
    s = decorrelated_scores(y, e, c)
    w = cm @ e.astype(float)
    np.testing.assert_allclose(s, w @ z / np.linalg.norm(w))


# ------------------------------------------------------------------ the trainers
def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


TRAINERS = {
    "upcycled": ["train", "upcycled", "--dataset", "digits:iid@10", "--privacy", "client",
                 "--client-rate", "1", "--noise-for-epsilon", "4", "--rounds", "4",
                 "--epochs", "1", "--eval-every", "4"],
    "upcycled-bandmf": ["train", "upcycled", "--dataset", "digits:iid@12", "--privacy",
                        "client", "--mechanism", "bandmf", "--bands", "2", "--participation",
                        "cyclic", "--groups", "2", "--noise-for-epsilon", "4", "--rounds",
                        "8", "--epochs", "1", "--eval-every", "8"],
    "dprec": ["train", "dprec", "--algorithms", "dpfedavg", "--clients", "12", "--rounds", "3",
              "--clients-per-round", "6", "--noise-for-epsilon", "4", "--epochs", "1",
              "--eval-every", "3"],
    "mapa": ["train", "mapa", "--algorithms", "mapa,asgd", "--noise", "gaussian",
             "--noise-for-epsilon", "4", "--clients", "4", "--rounds", "40", "--eval-every",
             "40"],
    "scfl": ["train", "scfl", "--algorithms", "scfl", "--clients", "4", "--noise-for-epsilon",
             "4", "--rounds", "6", "--eval-every", "6"],
}


@pytest.mark.parametrize("name", list(TRAINERS))
def test_each_trainer_writes_the_scores_the_block_and_the_line(name, tmp_path, capsys):
    out = tmp_path / "o"
    code, stdout, err = _run([*TRAINERS[name], "--audit-canaries", "60", "--out", str(out),
                              "-q"], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    block = report["audit"]
    assert block["m"] == 60 and block["m_in"] + block["m_out"] == 60
    assert block["confidence"] == CONFIDENCE and block["exceeded"] is False
    assert set(block["lower_bounds"]) == {"one-run", "gaussian-one-run"}
    assert 0 <= block["epsilon_lower_bound"] <= block["accounted_epsilon"]
    assert block["epsilon_lower_bound"] == max(block["lower_bounds"].values())
    line = [x for x in stdout.splitlines() if x.startswith("audit: ")]
    assert line == [block["line"]]
    assert f"beside the accounted {block['accounted_epsilon']:.2f}" in line[0]
    assert "99%" in line[0]
    # the run's privacy section says the canaries were there and what is not covered
    entry = next(e for e in report["algorithms"].values()
                 if "canaries" in e.get("gradient_privacy", e.get("privacy", {})))
    priv = entry.get("gradient_privacy", entry.get("privacy"))
    assert priv["canaries"]["m"] == 60 and priv["canaries"]["note"] == CANARY_NOTE
    assert priv["canaries"]["scores"] == SCORES_NOTE  # from the releases alone: covered
    assert not any("audit" in n["field"] for n in priv["not_covered"])
    # privkit audit run OUT recomputes the same numbers and prints the same line
    code, again, _ = _run(["audit", "run", str(out)], capsys)
    assert code == 0 and again.splitlines()[0] == block["line"]
    code, js, _ = _run(["audit", "run", str(out), "--json"], capsys)
    obj = json.loads(js)
    assert code == 0 and obj["line"] == block["line"] and obj["exceeded"] is False
    assert {b["method"]: b["epsilon_lower_bound"] for b in obj["bounds"]} == \
        block["lower_bounds"]
    assert obj["accounted_epsilon"] == block["accounted_epsilon"]


# a test the CI can afford: 650 coordinates, 600 canaries, q = 1, 10 data rounds
BUG = ["train", "upcycled", "--dataset", "digits:iid@20", "--privacy", "client",
       "--client-rate", "1", "--noise-for-epsilon", "2", "--rounds", "20", "--epochs", "1",
       "--eval-every", "20", "--audit-canaries", "600", "-q"]


@pytest.mark.parametrize("seed", [0, 1])
def test_half_the_noise_is_caught_above_the_accounted_epsilon(seed, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.setattr(ClientLevelGaussian, "stddev",
                        property(lambda s: 0.5 * s.noise_multiplier * s.l2_clip_norm))
    out = tmp_path / "o"
    code, _, err = _run([*BUG, "--seed", str(seed), "--out", str(out)], capsys)
    assert code == EXIT_EXCEEDED
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "exceeds the accounted epsilon" in lines[0]
    block = json.loads((out / "report.json").read_text())["audit"]  # written before the exit
    assert block["exceeded"] is True
    assert block["lower_bounds"]["gaussian-one-run"] > 1.5 * block["accounted_epsilon"]
    code, stdout, _ = _run(["audit", "run", str(out)], capsys)
    assert code == 1 and "ABOVE" in stdout.splitlines()[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_correct_trainer_is_not_flagged(seed, tmp_path, capsys):
    out = tmp_path / "o"
    code, _, err = _run([*BUG, "--seed", str(seed), "--out", str(out)], capsys)
    assert code == 0, err
    block = json.loads((out / "report.json").read_text())["audit"]
    assert not block["exceeded"]
    assert block["lower_bounds"]["gaussian-one-run"] > 0.3 * block["accounted_epsilon"]


def test_half_the_noise_in_banded_mf_is_caught(tmp_path, capsys, monkeypatch):
    from privkit.mechanisms.bandmf import BandMF

    monkeypatch.setattr(BandMF, "stddev",
                        property(lambda s: 0.5 * s.noise_multiplier * s.l2_clip_norm))
    out = tmp_path / "o"
    code, _, err = _run(["train", "upcycled", "--dataset", "digits:iid@20", "--privacy",
                         "client", "--mechanism", "bandmf", "--bands", "3", "--participation",
                         "cyclic", "--groups", "3", "--noise-for-epsilon", "2", "--rounds",
                         "24", "--epochs", "1", "--eval-every", "24", "--audit-canaries",
                         "600", "-q", "--out", str(out)], capsys)
    assert code == EXIT_EXCEEDED, err
    assert json.loads((out / "report.json").read_text())["audit"]["exceeded"] is True


# ------------------------------------------------------------------ refused, saying why
@pytest.mark.parametrize("argv, needle", [
    (["train", "upcycled", "--dataset", "digits:3", "--rounds", "2"], "a non-private run"),
    (["train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--privacy", "record"],
     "never released"),
    (["train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--privacy", "output"],
     "privkit audit gaussian"),
    (["train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--privacy",
      "objective"], "privkit audit objective"),
    (["train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--privacy", "client",
      "--checkpoint-every", "1"], "not checkpointed"),
    (["train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--privacy", "client",
      "--resume"], "not checkpointed"),
    (["train", "dprec", "--algorithms", "dprec,fedavg", "--rounds", "2"], "REC selections"),
    (["train", "mapa", "--rounds", "20"], "--noise l2"),
    (["train", "mapa", "--rounds", "20", "--algorithms", "asgd", "--noise", "gaussian"],
     "a private algorithm"),
    (["train", "scfl", "--rounds", "2"], "without gradient noise"),
    (["train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--privacy", "client",
      "--audit-canaries", "1000"], "at most 650"),
])
def test_the_flag_is_refused_where_it_cannot_apply(argv, needle, tmp_path, capsys):
    out = tmp_path / "o"
    extra = [] if "--audit-canaries" in argv else ["--audit-canaries", "50"]
    code, _, err = _run([*argv, *extra, "--out", str(out)], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("privkit: error: --audit-canaries")
    assert needle in lines[0]
    assert not out.exists() or not any(out.iterdir())  # refused before anything is written


def test_audit_canaries_must_be_a_count(tmp_path, capsys):
    code, _, err = _run(["train", "upcycled", "--privacy", "client", "--audit-canaries", "-3",
                         "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--audit-canaries" in err


# ------------------------------------------------------------------ privkit audit run
def test_audit_run_exits_1_above_and_2_on_a_bad_file(tmp_path, capsys):
    rng = np.random.default_rng(0)
    CanaryRun(rng.normal(3, 1, 400), rng.normal(0, 1, 400), "one-run", 1e-5,
              accounted_epsilon=1.0).save(tmp_path)
    code, out, _ = _run(["audit", "run", str(tmp_path)], capsys)
    assert code == 1 and "ABOVE" in out.splitlines()[0]
    assert recompute(tmp_path).exceeded
    missing = tmp_path / "nowhere"
    code, out, err = _run(["audit", "run", str(missing)], capsys)
    assert code == 2 and out == "" and str(missing) in err and len(err.splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "privkit.audit-run/1"}')
    code, _, err = _run(["audit", "run", str(bad)], capsys)
    assert code == 2 and str(bad) in err and "mode" in err
    bad.write_text("not json")
    code, _, err = _run(["audit", "run", str(bad)], capsys)
    assert code == 2 and str(bad) in err


@pytest.mark.parametrize("argv, needle", [
    (["audit", "run"], "OUT"),
    (["audit", "run", ".", "--trials", "10"], "--trials"),
    (["audit", "run", ".", "--seed", "1"], "--seed"),
    (["audit", "gaussian", "."], "OUT"),
])
def test_audit_run_refuses_the_mechanism_settings(argv, needle, capsys):
    code, _, err = _run(argv, capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_trainer_canaries_refuse_more_canaries_than_coordinates():
    from privkit.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="at most 10"):
        TrainerCanaries(11, 10, seed=0, noise_multiplier=1.0, where="x")
