"""Banded matrix factorization in the synchronous trainers (``--privacy client --mechanism
bandmf``).

The bugs feared most: a client let in twice within b rounds (the sensitivity then does not
hold), charges that do not compose to the priced event, a resume that loses the noise state
(the correlated noise then restarts and the released sums are wrongly distributed) or
re-spends, even Upcycled-FL iterations that advance the noise, and a divisor that depends on
who took part.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import privkit
from fl_examples.core.banded import BandedDpPlan, banded_plan
from fl_examples.core.data import parse_dataset_spec
from fl_examples.core.seeds import SeedTree
from fl_examples.upcycled import UpcycledConfig, run_algorithm
from privkit.accountants.bandmf import MinSeparation, bandmf_event
from privkit.cli import main
from privkit.errors import InvalidParameterError

BASE = dict(dataset="synthetic:iid@60/40", local_epochs=1, batch_size=16, lr=0.1,
            device="cpu", stragglers=0.0, seed=2, mu=0.01, lam=0.04, privacy="client",
            mechanism="bandmf", l2_clip_norm=1.0)


@pytest.fixture(scope="module")
def data():
    return parse_dataset_spec(BASE["dataset"], seed=2)


def _walk(plan: BandedDpPlan, rounds: int, seed: int = 0) -> dict[int, list[int]]:
    """Select and release ``rounds`` rounds with zero updates; each client's rounds."""
    tree, state = SeedTree(seed), {}
    w = {"w": torch.zeros(3)}
    taken: dict[int, list[int]] = {c: [] for c in range(plan.num_clients)}
    for r in range(1, rounds + 1):
        sel = plan.select(tree, r, None, state)
        for c in sel.tolist():
            taken[c].append(r)
        local = {"w": torch.zeros(len(sel), 3)}
        w = plan.release(w, local, state, tree.torch(r, "noise", torch.device("cpu")),
                         sel=sel, data_round=r)
    return taken


@pytest.mark.parametrize("bands,rate", [(4, 0.2), (3, 0.3), (7, 0.14), (1, 0.5)])
def test_minsep_never_lets_a_client_in_twice_within_b_rounds(bands, rate):
    plan, _ = banded_plan(num_clients=50, rounds=40, bands=bands, participation="minsep",
                          client_rate=rate, groups=None, l2_clip_norm=1.0,
                          noise_multiplier=1.0, noise_for_epsilon=None, delta=1e-5)
    taken = _walk(plan, 40, seed=bands)
    schema = MinSeparation(bands, plan.max_participations)
    for c, rounds in taken.items():
        assert schema.allows([r - 1 for r in rounds]), (c, rounds)
    per_round = np.bincount([r for rs in taken.values() for r in rs], minlength=41)[1:]
    assert per_round.max() <= plan.cohort
    assert (per_round == plan.cohort).mean() > 0.9  # the cohort is filled (50 >= m b)


def test_cyclic_and_poisson_serve_the_rounds_group_only():
    for part, rate in (("cyclic", 1.0), ("poisson", 0.5)):
        plan, _ = banded_plan(num_clients=23, rounds=20, bands=3, participation=part,
                              client_rate=rate, groups=5, l2_clip_norm=1.0,
                              noise_multiplier=1.0, noise_for_epsilon=None, delta=1e-5)
        taken = _walk(plan, 20)
        for c, rounds in taken.items():
            assert all((r - 1) % 5 == c % 5 for r in rounds), (part, c, rounds)
            if part == "cyclic":
                assert len(rounds) == 4
        assert plan.divisor(1) == (5.0 if part == "cyclic" else 2.5)  # |group| = 5 for j = 0


def test_noise_on_zero_updates_has_the_factorisations_stddev():
    """Zero updates, server lr 1: the model moves by (C^-1 Z)_t / m, each coordinate with
    stddev z C_clip ||row t of C^-1|| / m."""
    plan, _ = banded_plan(num_clients=40, rounds=6, bands=3, participation="minsep",
                          client_rate=0.25, groups=None, l2_clip_norm=2.0,
                          noise_multiplier=1.5, noise_for_epsilon=None, delta=1e-5)
    inv = np.linalg.inv(plan.strategy.matrix(6))
    tree, state, d = SeedTree(1), {}, 200_000
    w = {"w": torch.zeros(d, dtype=torch.float64)}
    for r in range(1, 7):
        sel = plan.select(tree, r, None, state)
        new = plan.release(w, {"w": torch.zeros(len(sel), d, dtype=torch.float64)}, state,
                           tree.torch(r, "noise", torch.device("cpu")), sel=sel, data_round=r)
        step = (new["w"] - w["w"]).numpy()
        want = 1.5 * 2.0 * np.linalg.norm(inv[r - 1]) / plan.cohort
        assert step.std() == pytest.approx(want, rel=0.01), r  # 200k draws: 0.3% s.e.
        w = new


def test_ledger_charges_compose_to_the_priced_event(data):
    cfg = UpcycledConfig(**BASE, bands=3, client_rate=0.2, noise_multiplier=2.0,
                         iterations=9)
    res = run_algorithm("fedavg", cfg, data, iterations=9)
    p = res["privacy"]
    plan, _ = banded_plan(num_clients=60, rounds=9, bands=3, participation="minsep",
                          client_rate=0.2, groups=None, l2_clip_norm=1.0,
                          noise_multiplier=2.0, noise_for_epsilon=None, delta=1e-5)
    whole = privkit.epsilon(bandmf_event(plan.strategy, noise_multiplier=2.0, rounds=9,
                                         participation=plan.schema), 1e-5).epsilon
    assert p["epsilon_max"] == pytest.approx(whole, rel=1e-9)
    assert p["charged_rounds"] == 9 and p["epsilon_unamplified"]["epsilon_whole_run"] == \
        p["epsilon_max"]
    assert p["epsilon_replace_one"] > p["epsilon_max"]


def test_upcycled_even_iterations_do_not_advance_the_noise(data, tmp_path):
    cfg = UpcycledConfig(**BASE, bands=2, client_rate=0.2, noise_multiplier=2.0,
                         iterations=7)
    res = run_algorithm("upcycled", cfg, data, iterations=7, out=tmp_path)
    assert res["privacy"]["charged_rounds"] == 4  # 7 iterations, 4 data rounds
    import json

    lines = (tmp_path / "ledger-upcycled.jsonl").read_text().splitlines()
    rounds = [json.loads(x)["round"] for x in lines if json.loads(x)["kind"] == "spend"]
    assert rounds == [1, 2, 3, 4]  # one charge per data round, none for even iterations


def test_resume_restores_the_noise_state_bitwise_and_spends_once(data, tmp_path):
    cfg = UpcycledConfig(**BASE, bands=3, client_rate=0.2, noise_multiplier=1.5,
                         iterations=8, checkpoint_every=3)
    whole = run_algorithm("fedprox", cfg, data, iterations=8)
    run_algorithm("fedprox", cfg, data, iterations=8, out=tmp_path, stop_after=5)
    resumed = run_algorithm("fedprox", cfg, data, iterations=8, out=tmp_path, resume=True)
    for k in whole["model"]:
        assert torch.equal(whole["model"][k], resumed["model"][k]), k
    assert resumed["privacy"]["epsilon_max"] == pytest.approx(whole["privacy"]["epsilon_max"],
                                                              rel=1e-12)
    assert resumed["privacy"]["charged_rounds"] == 8


@pytest.mark.parametrize("over, needle", [
    (dict(mechanism="gaussian", bands=3), "bands"),
    (dict(groups=3), "groups"),
    (dict(bands=0), "bands"),
    (dict(participation="random"), "participation"),
    (dict(participation="poisson", groups=2, bands=3, client_rate=0.5), "groups"),
    (dict(adaptive_clip=0.5), "adaptive_clip"),
    (dict(participation="cyclic", client_rate=0.3), "client_rate"),
])
def test_bad_banded_settings_are_named(over, needle, data):
    with pytest.raises(InvalidParameterError, match=needle):
        cfg = UpcycledConfig(**(BASE | {"iterations": 4} | over))
        run_algorithm("fedavg", cfg, data, iterations=4)


def test_more_bands_than_rounds_is_named(data):
    cfg = UpcycledConfig(**BASE, bands=5, iterations=4, client_rate=0.2)
    with pytest.raises(InvalidParameterError, match="bands"):
        run_algorithm("fedavg", cfg, data, iterations=4)


def test_cli_runs_and_reports_banded_mf(tmp_path, capsys):
    code = main(["train", "upcycled", "--dataset", "synthetic:iid@60/40", "--algorithms",
                 "fedavg", "--privacy", "client", "--mechanism", "bandmf", "--bands", "2",
                 "--participation", "cyclic", "--groups", "3", "--noise-for-epsilon", "4",
                 "--rounds", "6", "--epochs", "1", "--stragglers", "0", "--eval-every", "3",
                 "--device", "cpu", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "banded MF: 2 bands" in out and "cyclic over 3 groups" in out and "eps 4" in out
    import json

    p = json.loads((tmp_path / "o" / "report.json").read_text())["algorithms"]["fedavg"][
        "privacy"]
    assert p["epsilon_max"] <= 4.0 and p["participation"] == "cyclic"
    assert "bandmf" not in json.dumps(p.get("public", []))  # the noise state is not public


@pytest.mark.parametrize("flag, value", [("--bands", "nan"), ("--bands", "0"),
                                         ("--groups", "0"), ("--min-separation", "0")])
def test_cli_counts_must_be_positive_integers(flag, value, tmp_path, capsys):
    extra = {"--groups": ["--participation", "cyclic"]}.get(flag, [])
    code = main(["train", "upcycled", "--dataset", "synthetic:iid@60/40", "--algorithms",
                 "fedavg", "--privacy", "client", "--mechanism", "bandmf", *extra, flag, value,
                 "--rounds", "4", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and f"{flag} must be an integer >= 1, got {value}" in err
