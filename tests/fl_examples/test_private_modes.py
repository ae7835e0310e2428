"""Client-level DP-FedAvg and record-level DP-SGD in the synchronous trainers.

The bugs feared most: DP-SGD that clips the batch mean instead of each example (a record's
influence is then unbounded), a round with no sampled client that skips the noise, charges
that do not match the steps run, and an epsilon the ledger reports that dp-accounting would
not reproduce.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from dp_accounting.dp_event import GaussianDpEvent as DpaG
from dp_accounting.dp_event import PoissonSampledDpEvent as DpaP
from dp_accounting.dp_event import SelfComposedDpEvent as DpaS
from dp_accounting.pld import pld_privacy_accountant

import privkit
from fl_examples.core import dpsgd
from fl_examples.core.data import parse_dataset_spec
from fl_examples.core.dp_modes import POPULATION, ClientDpPlan, adaptive_count_stddev
from fl_examples.core.dpsgd import DpSgdSettings, local_dpsgd
from fl_examples.core.local import pad_clients
from fl_examples.core.models import MLP, MultinomialLogReg
from fl_examples.core.seeds import SeedTree
from fl_examples.upcycled import UpcycledConfig, run_algorithm
from fl_examples.upcycled.privacy import planned_steps
from privkit.cli import main
from privkit.errors import InvalidParameterError
from privkit.ledger import Ledger

BASE = dict(dataset="digits:3", local_epochs=1, batch_size=16, lr=0.1, device="cpu",
            fraction=0.5, stragglers=0.0, seed=3, mu=0.01, lam=0.04)


@pytest.fixture(scope="module")
def digits():
    return parse_dataset_spec("digits:3", seed=3)


def _dpa_epsilon(event, delta: float) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(event)
    return acc.get_epsilon(delta)


def _dpa_epsilon_ro(event, delta: float) -> float:
    from dp_accounting import NeighboringRelation

    acc = pld_privacy_accountant.PLDAccountant(
        NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-4)
    acc.compose(event)
    return acc.get_epsilon(delta)


# -- client level ------------------------------------------------------------------------------

def test_poisson_client_rates_match_q():
    plan = ClientDpPlan(num_clients=200, client_rate=0.05, l2_clip_norm=1.0,
                        noise_multiplier=1.0)
    tree = SeedTree(0)
    counts = np.zeros(200)
    rounds = 400
    sizes = []
    for r in range(1, rounds + 1):
        sel = plan.select(tree, r)
        counts[sel] += 1
        sizes.append(len(sel))
    # every client independently at rate q: the round sizes are Binomial(200, 0.05)
    assert abs(np.mean(sizes) - 10) < 4 * math.sqrt(200 * 0.05 * 0.95 / rounds)
    assert np.var(sizes) == pytest.approx(200 * 0.05 * 0.95, rel=0.25)
    assert abs(counts.mean() / rounds - 0.05) < 0.003
    assert 0 in sizes or min(sizes) < 5  # sizes vary: not a fixed-size sample


def test_empty_round_still_releases_noise():
    plan = ClientDpPlan(num_clients=10, client_rate=0.1, l2_clip_norm=1.0, noise_multiplier=1.0)
    w = {"w": torch.zeros(50), "b": torch.zeros(5)}
    local = {k: v.unsqueeze(0)[:0] for k, v in w.items()}  # nobody sampled
    new = plan.release(w, local, {}, torch.Generator().manual_seed(0))
    # noise of stddev z C / (q N) = 1 per coordinate
    assert 0.7 < float(new["w"].std()) < 1.3


def test_client_event_has_amplification_only_when_sampled():
    sampled = ClientDpPlan(num_clients=10, client_rate=0.2, l2_clip_norm=1.0,
                           noise_multiplier=1.3)
    assert sampled.entries(1) == [(POPULATION, privkit.PoissonSampledDpEvent(
        0.2, privkit.GaussianDpEvent(1.3)))]
    full = ClientDpPlan(num_clients=10, client_rate=1.0, l2_clip_norm=1.0, noise_multiplier=1.3)
    assert full.entries(1) == [(POPULATION, privkit.GaussianDpEvent(1.3))]


def test_client_mode_run_charges_each_data_round_and_dp_accounting_agrees(tmp_path, digits):
    cfg = UpcycledConfig(privacy="client", l2_clip_norm=1.0, noise_multiplier=0.8,
                         client_rate=0.4, iterations=7, adaptive_clip=0, **BASE)
    res = run_algorithm("upcycled", cfg, digits, iterations=7, out=tmp_path)
    p = res["privacy"]
    assert p["charged_rounds"] == 4  # iterations 1, 3, 5, 7; even ones are free
    assert p["delta"] == 1e-5
    assert p["assumptions"][0].startswith("trusted aggregator: the server sees the clipped")
    assert "secure aggregation alone" in p["trust"]
    led = Ledger.open(tmp_path / "ledger-upcycled.jsonl")
    assert led.neighboring_relation == privkit.NeighboringRelation.ADD_OR_REMOVE_ONE
    theirs = _dpa_epsilon(DpaS(DpaP(0.4, DpaG(0.8)), 4), 1e-5)
    assert theirs * 0.99 <= p["epsilon_max"] <= theirs * 1.01
    assert p["per_client"] == [p["epsilon_max"]] * digits.num_clients
    # a private run evaluates on the public held-out set only
    assert all(math.isfinite(h["heldout_accuracy"]) for h in res["history"])
    assert not any("test_accuracy" in h or "train_loss" in h for h in res["history"])
    # beside add/remove: replace-one and the server's (unamplified) epsilon; dp-accounting's
    # replace-one Gaussian(z) is this mechanism (each update of norm <= C, noise z C)
    ro = _dpa_epsilon_ro(DpaS(DpaP(0.4, DpaG(0.8)), 4), 1e-5)
    assert ro * 0.99 <= p["epsilon_replace_one"] <= ro * 1.01
    u = p["epsilon_unamplified"]
    assert u["expected_participations"] == 2  # ceil(0.4 * 4)
    assert u["epsilon_at_expected"] == pytest.approx(
        privkit.epsilon(privkit.SelfComposedDpEvent(privkit.GaussianDpEvent(0.8), 2),
                        1e-5).epsilon, rel=1e-9)
    assert p["guarantee"] == "simulation" and p["proven"] is False
    assert "N = 30" in p["public"][0]


def test_client_mode_calibrates_to_the_target(digits):
    cfg = UpcycledConfig(privacy="client", l2_clip_norm=1.0, noise_for_epsilon=2.0,
                         client_rate=0.3, iterations=10, adaptive_clip=0, **BASE)
    res = run_algorithm("fedavg", cfg, digits, iterations=10)
    p = res["privacy"]
    assert p["epsilon_max"] <= 2.0 and p["epsilon_max"] > 1.9
    z = res["privacy"]["noise_multiplier"]
    assert _dpa_epsilon(DpaS(DpaP(0.3, DpaG(z)), 10), 1e-5) == pytest.approx(2.0, rel=0.01)


def test_adaptive_clipping_is_charged_as_one_release_with_the_sum(digits):
    """The count and the sum use the same Poisson sample: one Gaussian a round with the joint
    noise multiplier (the count centred: sensitivity 1/2), never two independent charges."""
    cfg = UpcycledConfig(privacy="client", l2_clip_norm=1.0, noise_multiplier=1.0,
                         client_rate=0.5, adaptive_clip=0.5, iterations=3, **BASE)
    res = run_algorithm("fedprox", cfg, digits, iterations=3)
    comp = res["privacy"]
    count_sd = adaptive_count_stddev(0.5 * digits.num_clients, 1.0)  # max(q N / 20, 2.5 z)
    assert count_sd == 2.5
    z_eff = (1.0 + (2 * count_sd) ** -2) ** -0.5
    joint = DpaS(DpaP(0.5, DpaG(z_eff)), 3)
    assert comp["epsilon_max"] >= _dpa_epsilon(joint, 1e-5) * (1 - 1e-3)
    assert comp["charged_rounds"] == 3
    assert comp["adaptive_clipping"]["joint_noise_multiplier"] == pytest.approx(z_eff)


def test_the_issues_adaptive_clip_run_is_priced_jointly():
    """synthetic:iid@1000/60, fedavg, q 0.02, C 1, z 1.1, adaptive 0.5, 10 rounds: the round
    is PoissonSampled(0.02, Gaussian(z_eff)), z_eff below the sum's own z (the count is
    charged)."""
    cfg = UpcycledConfig(dataset="synthetic:iid@1000/60", privacy="client",
                         adaptive_clip=0.5, client_rate=0.02, l2_clip_norm=1.0,
                         noise_multiplier=1.1, iterations=10, local_epochs=1, stragglers=0.0,
                         device="cpu")
    ds = parse_dataset_spec(cfg.dataset, seed=0)
    p = run_algorithm("fedavg", cfg, ds, iterations=10)["privacy"]
    # count stddev max(q N / 20, 2.5 z) = 2.75, centred (sensitivity 1/2)
    z_eff = (1.1 ** -2 + (2 * 2.75) ** -2) ** -0.5
    assert p["adaptive_clipping"]["count_stddev"] == pytest.approx(2.75)
    assert p["epsilon_max"] >= _dpa_epsilon(DpaS(DpaP(0.02, DpaG(z_eff)), 10), 1e-5) * 0.999
    assert p["epsilon_max"] > _dpa_epsilon(DpaS(DpaP(0.02, DpaG(1.1)), 10), 1e-5) * 1.005


def test_adaptive_clip_calibration_hits_the_joint_target_even_for_a_small_cohort(digits):
    # 30 clients at q 0.5: q N / 20 = 0.75 would make the count's noise multiplier 1.5, below
    # the z that epsilon 3 needs; its floor 2.5 z keeps every target reachable
    cfg = UpcycledConfig(privacy="client", l2_clip_norm=1.0, noise_for_epsilon=8.0,
                         client_rate=0.5, adaptive_clip=0.5, iterations=6, **BASE)
    p = run_algorithm("fedavg", cfg, digits, iterations=6)["privacy"]
    assert 7.9 < p["epsilon_max"] <= 8.0
    z_eff = p["adaptive_clipping"]["joint_noise_multiplier"]
    assert _dpa_epsilon(DpaS(DpaP(0.5, DpaG(z_eff)), 6), 1e-5) <= 8.0 * 1.01
    low = UpcycledConfig(privacy="client", l2_clip_norm=1.0, noise_for_epsilon=3.0,
                         client_rate=0.5, adaptive_clip=0.5, iterations=6, **BASE)
    p = run_algorithm("fedavg", low, digits, iterations=6)["privacy"]
    assert 2.9 < p["epsilon_max"] <= 3.0 * (1 + 1e-9)
    z_eff = p["adaptive_clipping"]["joint_noise_multiplier"]
    assert p["noise_multiplier"] == pytest.approx(z_eff * 1.04 ** 0.5)  # the count: <= 2%


def test_adaptive_clip_with_z_equal_to_the_count_noise_runs(digits):
    """Two equal events used to give a duplicate-id charge; now one event a round."""
    count_sd = adaptive_count_stddev(0.5 * digits.num_clients, 0.75)
    assert count_sd == 0.75 * 2.5  # the floor; q N / 20 = 0.75 is the old rule's
    cfg = UpcycledConfig(privacy="client", l2_clip_norm=1.0, noise_multiplier=count_sd,
                         client_rate=0.5, adaptive_clip=0.5, iterations=2, **BASE)
    assert run_algorithm("fedavg", cfg, digits, iterations=2)["privacy"]["charged_rounds"] == 2


# -- record level ------------------------------------------------------------------------------

def _clients(sizes, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, features)) for n in sizes]
    ys = [rng.integers(0, classes, size=n) for n in sizes]
    return pad_clients(xs, ys, dtype=torch.float64), xs, ys


class _Materialised:
    """The MLP without its ghost-norm clipped sum: DP-SGD materialises per-example grads."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name == "clipped_grad_sum":
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize("model_name", ["logreg", "mlp", "mlp-materialised"])
def test_batched_dpsgd_equals_the_per_client_loop(model_name):
    """The trainers' DP-SGD is privkit.torch's engine: K clients batched equal each client run
    alone with its own stream (its draws never depend on the other clients)."""
    sizes, ids, epochs = [7, 12, 3, 20], [11, 4, 29, 8], [2, 1, 3, 0]
    data, xs, ys = _clients(sizes)
    model = MultinomialLogReg(6, 3) if model_name == "logreg" else MLP(6, 5, 3)
    if model_name == "mlp-materialised":
        model = _Materialised(model)
        assert not hasattr(model, "clipped_grad_sum")
    p = model.init(4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bar = {k: v[0] for k, v in p.items()}
    s = DpSgdSettings(l2_clip_norm=0.5, noise_multiplier=0.7, batch_size=4)
    kw = dict(settings=s, lr=0.2, momentum=0.5, proximal_mu=0.1,
              rng=dpsgd.client_streams(5, 3))
    a = local_dpsgd(model, p, bar, data, epochs=torch.tensor(epochs), clients=ids, **kw)
    for i in range(4):
        one = pad_clients([xs[i]], [ys[i]], dtype=torch.float64)
        b = local_dpsgd(model, {k: v[i:i + 1] for k, v in p.items()}, bar, one,
                        epochs=torch.tensor([epochs[i]]), clients=[ids[i]], **kw)
        for k in a:
            torch.testing.assert_close(a[k][i], b[k][0], rtol=1e-9, atol=1e-9)
    for k in a:  # client 3 runs no step
        torch.testing.assert_close(a[k][3], p[k][3])


def _one_step_change(records_x, records_y, lr, clip):
    """theta after one full-batch (q = 1), almost noiseless DP-SGD step from zero."""
    data = pad_clients([records_x], [records_y], dtype=torch.float64)
    model = MultinomialLogReg(records_x.shape[1], 3)
    init = model.init(1, generator=torch.Generator(), dtype=torch.float64)
    p = {k: torch.zeros_like(v) for k, v in init.items()}
    bar = {k: v[0] for k, v in p.items()}
    s = DpSgdSettings(l2_clip_norm=clip, noise_multiplier=1e-12, batch_size=len(records_y))
    out = local_dpsgd(model, p, bar, data, epochs=torch.tensor([1]), settings=s, lr=lr,
                      momentum=0.0, proximal_mu=0.0, clients=[0],
                      rng=dpsgd.client_streams(0, 1))
    return torch.cat([v.reshape(-1) for v in out.values()])


def _influence_bounded() -> bool:
    """Replacing one record by an extreme one moves a step by <= lr 2C / n (per-example clip)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 4)) * 0.01
    y = rng.integers(0, 3, size=8)
    lr, clip = 1.0, 0.1
    base = _one_step_change(x, y, lr, clip)
    x2 = x.copy()
    x2[0] = 1e4  # a record with an enormous gradient
    moved = _one_step_change(x2, y, lr, clip)
    return float(torch.linalg.vector_norm(moved - base)) <= lr * 2 * clip / len(y) * (1 + 1e-6)


def test_per_example_clipping_bounds_each_record():
    assert _influence_bounded()


def test_a_mutant_that_clips_the_batch_mean_fails(monkeypatch):
    def mutant(model):
        def clip_mean(theta, x, y, factor):
            g = model.per_example_grads(theta, x, y)  # (K, B, d)
            w = (factor(torch.zeros(g.shape[:2], dtype=torch.float64)) > 0).to(g.dtype)
            mean = (g * w[:, :, None]).sum(1) / w.sum(1, keepdim=True)  # the batch mean
            f = factor(torch.linalg.vector_norm(mean.to(torch.float64), dim=1,
                                                keepdim=True).expand_as(w))[:, :1]
            return mean * f.to(g.dtype) * w.sum(1, keepdim=True)

        return clip_mean

    monkeypatch.setattr(dpsgd, "clipped_sum_fn", mutant)
    assert not _influence_bounded()


def test_record_mode_charges_every_step_and_dp_accounting_agrees(tmp_path, digits):
    cfg = UpcycledConfig(privacy="record", l2_clip_norm=1.0, noise_multiplier=1.1,
                         iterations=3, **BASE)
    res = run_algorithm("fedprox", cfg, digits, iterations=3, out=tmp_path)
    planned = planned_steps("fedprox", cfg, digits, 3)
    p = res["privacy"]
    assert p["charged_steps"] == planned
    assert sum(planned) > 0
    led = Ledger.open(tmp_path / "ledger-fedprox.jsonl")
    eps = led.epsilons([str(i) for i in range(digits.num_clients)])
    for i, steps in enumerate(planned):
        if steps == 0:
            assert eps[str(i)] == 0
            continue
        q = 16 / int(digits.train_sizes[i])
        theirs = _dpa_epsilon(DpaS(DpaP(q, DpaG(1.1)), steps), 1e-5)
        assert theirs * 0.99 <= eps[str(i)] <= theirs * 1.01, i
    assert p["per_client"] == [eps[str(i)] for i in range(digits.num_clients)]
    # the ledger's entries name the round's Poisson rate b / n_i of each client
    lines = [json.loads(x) for x in
             (tmp_path / "ledger-fedprox.jsonl").read_text().splitlines()[1:]]
    assert lines and all("round" in x for x in lines)


def test_record_mode_needs_per_example_gradients(digits):
    class NoPerExample:
        pass

    data, _, _ = _clients([4])
    with pytest.raises(InvalidParameterError, match="model"):
        local_dpsgd(NoPerExample(), {"w": torch.zeros(1, 3)}, {"w": torch.zeros(3)}, data,
                    epochs=torch.tensor([1]), settings=DpSgdSettings(1.0, 1.0, 2), lr=0.1,
                    momentum=0.0, proximal_mu=0.0, clients=[0],
                    rng=dpsgd.client_streams(0, 1))


def test_record_mode_learns_and_resumes_without_double_charging(tmp_path, digits):
    cfg = UpcycledConfig(privacy="record", l2_clip_norm=1.0, noise_multiplier=1.0,
                         iterations=4, checkpoint_every=1, **BASE)
    whole = run_algorithm("fedavg", cfg, digits, iterations=4)
    run_algorithm("fedavg", cfg, digits, iterations=4, out=tmp_path, stop_after=2)
    resumed = run_algorithm("fedavg", cfg, digits, iterations=4, out=tmp_path, resume=True)
    assert resumed["privacy"]["charged_steps"] == whole["privacy"]["charged_steps"]
    assert resumed["privacy"]["epsilon_max"] == pytest.approx(whole["privacy"]["epsilon_max"])
    assert resumed["history"][-1]["heldout_accuracy"] == pytest.approx(
        whole["history"][-1]["heldout_accuracy"])
    p = whole["privacy"]
    assert p["epsilon_replace_one_max"] > p["epsilon_max"]  # n_i public: replace-one beside
    assert any("n_i" in item for item in p["public"])


# -- the CLI -----------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, needle", [
    (["--privacy", "client", "--client-rate", "0"], "--client-rate"),
    (["--privacy", "client", "--client-rate", "1.5"], "--client-rate"),
    (["--privacy", "client", "--clip", "0"], "--clip"),
    (["--privacy", "record", "--clip", "-1"], "--clip"),
    (["--privacy", "record", "--noise-multiplier", "nan"], "--noise-multiplier"),
    (["--privacy", "output", "--client-rate", "0.5"], "--client-rate"),
    # the silent drops a new user hit: each flag that does not apply is an error
    (["--clip", "1", "--noise-multiplier", "2"], "--clip must be given only with --privacy"),
    (["--privacy", "client", "--noise-for-epsilon", "8", "--noise-multiplier", "2"],
     "--noise-multiplier must be left out with --noise-for-epsilon"),
    (["--privacy", "record", "--sigma", "2"], "--sigma must be given only with --privacy output"),
    (["--privacy", "record", "--noise-for-epsilon", "8", "--epsilon-budget", "4"],
     "--noise-for-epsilon must be <= --epsilon-budget 4"),
    (["--privacy", "client", "--noise-target", "mean"], "--noise-target"),
    (["--secure-noise"], "--secure-noise must be given only with --privacy"),
    (["--eval-client-data"], "--eval-client-data must be given only with --privacy"),
    (["--privacy", "client", "--alpha", "3"], "--alpha"),
    (["--privacy", "output", "--lipschitz", "3"], "--lipschitz"),
])
def test_cli_bad_flags_name_the_flag(tmp_path, capsys, flags, needle):
    rc = main(["train", "upcycled", "--dataset", "digits:3", "--rounds", "2",
               "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert needle in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists()  # refused before anything is written


@pytest.mark.parametrize("model_name", ["logreg", "mlp"])
def test_closed_form_clipped_sum_equals_per_example_autograd(model_name):
    """The trainers' models clip with closed-form norms (no per-example tensor): the sum must
    equal clipping each per-example gradient from autograd (an underestimated norm would let
    a record move the model by more than C)."""
    rng = np.random.default_rng(4)
    x = torch.as_tensor(rng.normal(size=(2, 9, 12)) * 3)
    y = torch.as_tensor(rng.integers(0, 4, size=(2, 9)))
    model = MultinomialLogReg(12, 4) if model_name == "logreg" else MLP(12, 16, 4)
    p = model.init(2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    theta = torch.cat([v.reshape(2, -1) for v in p.values()], dim=1)
    g = model.per_example_grads(theta, x, y)  # (2, 9, d) by torch.func

    def factor(norms):
        return torch.clamp(0.3 / norms, max=1.0)

    brute = torch.einsum("kb,kbd->kd", factor(g.norm(dim=2)), g)
    assert torch.allclose(model.clipped_grad_sum(theta, x, y, factor), brute, atol=1e-12)


def test_record_mode_noise_has_stddev_z_c_over_the_batch():
    """One step on the whole data (q = 1), two noise streams: the models differ by
    lr (N1 - N2) / B, each coordinate with stddev lr sqrt(2) z C / B."""
    data, _, _ = _clients([20], features=64, classes=10, seed=2)
    model = MLP(64, 100, 10)
    p = model.init(1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bar = {k: v[0] for k, v in p.items()}
    s = DpSgdSettings(l2_clip_norm=0.7, noise_multiplier=1.3, batch_size=20)
    out = [torch.cat([v.reshape(-1) for v in local_dpsgd(
        model, {k: v.clone() for k, v in p.items()}, bar, data, epochs=torch.tensor([1]),
        settings=s, lr=0.5, momentum=0.0, proximal_mu=0.0, clients=[0],
        rng=dpsgd.client_streams(seed, 1)).values()]) for seed in (1, 2)]
    want = 0.5 * math.sqrt(2) * 1.3 * 0.7 / 20
    # d = 7610 coordinates: the sample stddev is within 3% of the truth (about 3.7 s.e.)
    assert float((out[0] - out[1]).std()) == pytest.approx(want, rel=0.03)
