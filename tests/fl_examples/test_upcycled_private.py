"""Private Upcycled-FL: charging only odd iterations, theorem vectors, budget stop, noise scale."""

import json
import math

import numpy as np
import pytest
import torch

import privkit
from fl_examples.core.data import parse_dataset_spec
from fl_examples.core.privacy import PrivacyPlan
from fl_examples.upcycled import UpcycledConfig, planned_releases, run_algorithm, train
from privkit.errors import InvalidParameterError
from privkit.ledger import Ledger

PRIV = dict(dataset="digits:3", local_epochs=1, batch_size=32, lr=0.05, device="cpu",
            fraction=0.5, stragglers=0.0, seed=2, mu=0.1, lam=0.04)


@pytest.fixture(scope="module")
def digits():
    return parse_dataset_spec("digits:3", seed=2)


def test_only_odd_iterations_charge_and_counts_match_participation(tmp_path, digits):
    cfg = UpcycledConfig(privacy="output", stddev=5.0, iterations=9, **PRIV)
    res = run_algorithm("upcycled", cfg, digits, iterations=9, out=tmp_path)
    planned = planned_releases("upcycled", cfg, digits, 9)
    assert res["privacy"]["charged_rounds"] == planned
    assert sum(planned) == 5 * max(int(0.5 * digits.num_clients), 1)  # 5 odd iterations
    led = Ledger.open(tmp_path / "ledger-upcycled.jsonl")
    rounds = {json.loads(line)["round"] for line in
              (tmp_path / "ledger-upcycled.jsonl").read_text().splitlines()[1:]}
    assert rounds == {1, 2, 3, 4, 5}  # data rounds; even iterations add no entry
    assert led.epsilons()[str(int(np.argmax(planned)))] == pytest.approx(
        res["privacy"]["epsilon_max"])


def test_an_output_perturbation_run_prices_its_noise_against_twice_the_clip(tmp_path, digits):
    """The bug the relation change could bring: a replace-one mechanism's event (z = sigma /
    tau) charged on an add/remove ledger would be priced against tau instead of 2 tau, half
    the true epsilon. The run's ledger is replace-one, and its number is the exact Gaussian of
    k releases of stddev sigma and sensitivity 2 tau."""
    cfg = UpcycledConfig(privacy="output", stddev=5.0, iterations=5, **PRIV)
    res = run_algorithm("fedavg", cfg, digits, iterations=5, out=tmp_path)
    led = Ledger.open(tmp_path / "ledger-fedavg.jsonl")
    assert led.neighboring_relation.name == "REPLACE_ONE"
    k = max(res["privacy"]["charged_rounds"])
    from privkit.accountants.gaussian import exact_epsilon

    truth = float(exact_epsilon(math.sqrt(k) * (2 * cfg.l2_clip_norm) / 5.0, cfg.delta))
    assert res["privacy"]["epsilon_max"] == pytest.approx(truth, rel=1e-6)
    # the mechanism on an add/remove ledger is refused, not priced against tau
    plan = PrivacyPlan(kind="output", sizes=(10,), stddev=5.0)
    wrong = Ledger.create(None, population_id="p", delta=1e-5)
    with pytest.raises(InvalidParameterError, match="REPLACE_ONE"):
        plan.charge(wrong, [0], round_=1, run_id="t")


def test_theorem_c1_and_c2_vectors_through_the_run_accountant():
    sizes = (224,)
    out = PrivacyPlan(kind="output", sizes=sizes, l2_clip_norm=10.0, stddev=0.8,
                      sensitivity="paper")
    ev = privkit.SelfComposedDpEvent(out.mechanism(0).event(), 40)
    assert privkit.epsilon(ev, 1e-3, "moments").epsilon == pytest.approx(1.374104, abs=1e-6)
    assert privkit.epsilon(ev, 1e-3).epsilon == pytest.approx(0.8921860, abs=1e-6)
    obj = PrivacyPlan(kind="objective", sizes=sizes, alpha=20.0, proximal_mu=0.1,
                      allow_unproven=True)
    ev = privkit.SelfComposedDpEvent(obj.mechanism(0).event(), 40)
    assert privkit.epsilon(ev, 1e-3, "basic").epsilon == pytest.approx(8.392857, abs=1e-6)
    assert any(a.startswith("NOT PROVEN") for a in privkit.epsilon(ev, 1e-3).assumptions)


def test_budget_stops_before_noise_and_resume_keeps_spend(tmp_path, digits, monkeypatch):
    cfg = UpcycledConfig(privacy="output", stddev=8.0, iterations=20, checkpoint_every=1,
                         **(PRIV | {"fraction": 1.0}))
    mech = PrivacyPlan(kind="output", sizes=(1,), stddev=8.0).mechanism(0)
    one = privkit.epsilon(privkit.SelfComposedDpEvent(mech.event(), 3), 1e-3,
                          neighboring_relation=mech.neighboring_relation)  # replace-one
    # a budget that allows exactly 3 releases per client (every client is in every round)
    budget = one.epsilon * (1 + 1e-9)
    cfg = UpcycledConfig(**(cfg.__dict__ | {"epsilon_budget": budget}))
    draws = []
    import privkit.mechanisms.gaussian as gm

    real = gm.GaussianOutputPerturbation.__call__

    def spy(self, tree, *, rng):
        draws.append(1)
        return real(self, tree, rng=rng)

    monkeypatch.setattr(gm.GaussianOutputPerturbation, "__call__", spy)
    res = run_algorithm("fedprox", cfg, digits, iterations=20, out=tmp_path)
    assert res["history"][-1]["iteration"] == 3
    assert "stopped before iteration 4" in res["privacy"]["stopped"]
    assert len(draws) == 3 * digits.num_clients  # round 4 drew no noise
    spent = res["privacy"]["epsilon_max"]
    assert spent <= budget
    again = run_algorithm("fedprox", cfg, digits, iterations=20, out=tmp_path, resume=True)
    assert again["privacy"]["epsilon_max"] >= spent  # resuming never resets spend
    assert again["history"][-1]["iteration"] == 3


def test_output_noise_has_stddev_sigma_not_sigma_squared():
    plan = PrivacyPlan(kind="output", sizes=(100,), l2_clip_norm=10.0, stddev=0.5)
    mech = plan.mechanism(0)
    zero = {"w": torch.zeros(200_000)}
    noisy = mech(zero, rng=torch.Generator().manual_seed(0))["w"]
    assert float(noisy.std()) == pytest.approx(0.5, rel=0.01)  # 0.25 would be sigma^2
    assert float(noisy.mean()) == pytest.approx(0.0, abs=0.01)


def test_noise_for_epsilon_calibrates_to_target(digits):
    cfg = UpcycledConfig(privacy="output", iterations=6, noise_for_epsilon=2.0,
                         noise_target="mean", **PRIV)
    res = run_algorithm("upcycled", cfg, digits, iterations=6)
    p = res["privacy"]
    assert p["epsilon_mean"] <= 2.0
    assert p["epsilon_mean"] == pytest.approx(2.0, rel=1e-4)
    # the default target is the clients' max: one meaning of the flag in every trainer
    top = run_algorithm("upcycled", UpcycledConfig(privacy="output", iterations=6,
                                                   noise_for_epsilon=2.0, **PRIV),
                        digits, iterations=6)["privacy"]
    assert top["epsilon_max"] == pytest.approx(2.0, rel=1e-4) and top["epsilon_max"] <= 2.0
    assert p["calibrated"]["parameter"] == "stddev"


def test_objective_perturbation_runs_marked_unproven(tmp_path):
    cfg = UpcycledConfig(privacy="objective", alpha=50.0, allow_unproven=True, iterations=4,
                         **PRIV)
    res = train(cfg, compare=("fedprox",), out=tmp_path)
    for name in ("upcycled", "fedprox"):
        p = res["algorithms"][name]["privacy"]
        assert p["proven"] is False and math.isfinite(p["epsilon_mean"])
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["algorithms"]["upcycled"]["privacy"]["proven"] is False
    # same iterations for both in private runs: FedProx leaks twice as often
    assert rep["algorithms"]["fedprox"]["iterations"] == 4
    up = rep["algorithms"]["upcycled"]["privacy"]["epsilon_mean"]
    fp = rep["algorithms"]["fedprox"]["privacy"]["epsilon_mean"]
    assert fp > up


@pytest.mark.parametrize("kwargs,name", [
    (dict(privacy="objective"), "privacy"),  # needs --allow-unproven (SGD is not exact)
    (dict(privacy="objective", model="mlp", allow_unproven=False), "privacy"),
    (dict(privacy="output", epsilon_budget=0.0), "epsilon_budget"),
    (dict(privacy="output", epsilon_budget=-1.0), "epsilon_budget"),
    (dict(privacy="output", sensitivity="strongly-convex"), "lipschitz"),
    (dict(privacy="output", sensitivity="strongly-convex", lipschitz=1.0), "sensitivity"),
    (dict(privacy="none", noise_for_epsilon=1.0), "noise_for_epsilon"),
    (dict(privacy="output", stddev=0.0), "stddev"),
    (dict(privacy="output", delta=1.0), "delta"),
])
def test_contradicting_privacy_options(kwargs, name, digits):
    with pytest.raises(InvalidParameterError, match=name):
        cfg = UpcycledConfig(**(PRIV | {"iterations": 2} | kwargs))
        run_algorithm("upcycled", cfg, digits, iterations=2)


# ---------------------------------------------- sensitivity claims the code enforces
def test_paper_sensitivity_is_reported_not_proven(tmp_path):
    cfg = UpcycledConfig(privacy="output", sensitivity="paper", stddev=0.5, iterations=3,
                         **PRIV)
    res = train(cfg, out=tmp_path)
    p = res["algorithms"]["upcycled"]["privacy"]
    assert p["proven"] is False and "Sensitivity.PAPER" in p["not_proven_because"]
    from fl_examples.upcycled import final_table

    assert "NOT PROVEN" in final_table(res)
    assert privkit.Sensitivity.PAPER.value == "paper"


SC = PRIV | dict(privacy="output", sensitivity="strongly-convex", momentum=0.0, mu=1.0)


@pytest.mark.parametrize("kwargs,name", [
    (dict(), "feature_norm"),                                     # u1 needs a public bound
    (dict(feature_norm=1.0, lipschitz=0.001), "lipschitz"),       # below sqrt(2 (R^2 + 1))
    (dict(feature_norm=1.0, lr=5.0), "lr"),                       # steps must contract
])
def test_strongly_convex_conditions_are_enforced(kwargs, name):
    with pytest.raises(InvalidParameterError, match=name):
        UpcycledConfig(**(SC | {"iterations": 2} | kwargs))


def test_strongly_convex_run_clips_features_and_uses_the_smallest_minibatch(tmp_path):
    from fl_examples.core.privacy import clip_features, logreg_lipschitz, smallest_batch

    assert smallest_batch(101, 32) == 5 and smallest_batch(96, 32) == 32
    assert smallest_batch(10, 32) == 10
    ds = clip_features(parse_dataset_spec("digits:3", seed=2), 1.5)
    assert max(float(np.linalg.norm(x.astype(np.float64), axis=1).max())
               for x in ds.x_train + ds.x_test) <= 1.5
    cfg = UpcycledConfig(**(SC | {"iterations": 3, "feature_norm": 1.5, "stddev": 0.2}))
    res = train(cfg, out=tmp_path)
    p = res["algorithms"]["upcycled"]["privacy"]
    assert p["guarantee"] == "simulation"  # the maths proven; the noise seeded
    assert p["lipschitz"] == pytest.approx(logreg_lipschitz(1.5))
    sizes = [int(n) for n in ds.train_sizes]
    assert p["smallest_batch_per_client"] == [smallest_batch(n, 32) for n in sizes]
    # the event each client is charged uses its smallest minibatch: z = sigma / C with
    # C = Delta / 2, priced under replace-one (sensitivity 2C = Delta)
    plan = PrivacyPlan(kind="output", sizes=tuple(sizes), l2_clip_norm=cfg.l2_clip_norm,
                       stddev=0.2, sensitivity="strongly-convex", proximal_mu=1.0,
                       lipschitz_model=logreg_lipschitz(1.5), batch_size=32, momentum=0.0)
    for i, n in enumerate(sizes):
        delta = min(2 * cfg.l2_clip_norm, 2 * logreg_lipschitz(1.5) / (smallest_batch(n, 32)))
        assert plan.mechanism(i).event().noise_multiplier == pytest.approx(0.2 / (delta / 2))
        assert plan.mechanism(i).neighboring_relation.name == "REPLACE_ONE"
