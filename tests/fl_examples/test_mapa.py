"""MAPA / AUDP / ASGD: schedule vectors, clip-noise consistency, noise law, ledger, budget, CLI."""

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

import fl_examples.mapa.uploads as mapa_uploads
import privkit
from fl_examples.core.asyncsim import simulate
from fl_examples.core.deep_models import PooledCNN
from fl_examples.core.idx import write_idx
from fl_examples.core.models import MultinomialLogReg
from fl_examples.core.run import max_loss_factor
from fl_examples.mapa import (
    AMPLIFICATION_ASSUMPTION,
    MapaConfig,
    MapaSchedule,
    PoissonSampledPureDpEvent,
    amplified_epsilon,
    asgd_step,
    audp_step,
    final_table,
    initial_sensitivity,
    load_edges,
    noise_variance,
    run_algorithm,
    train,
    updates_to_loss,
)
from fl_examples.mapa.run import _Run
from fl_examples.mapa.schedule import _mechanism
from fl_examples.mapa.uploads import _pool
from privkit.accountants.rules import NeighboringRelation
from privkit.cli import main
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.ledger import Ledger

SMALL = dict(dataset="digits", edges=8, batch=16, updates=120, eval_every=40, seed=3,
             delta=1e-3)  # the epsilons below are priced at this delta (the default is 1e-5)
TESTBED = dict(sigma=30, batch=24, delta=1e-3, epsilon0=1, lipschitz=10, r0=50, tau=3, theta=0.5)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # the per-upload kernels are tiny: more threads only contend on a shared machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def digits8():
    return load_edges("digits", edges=8, seed=3)


# ----------------------------------------------------------------------------- schedule
def test_theorem3_initial_sensitivity_vector():
    assert initial_sensitivity(30, 24, 1e-3) == pytest.approx(111.789419, abs=5e-7)
    assert 24 * initial_sensitivity(30, 24, 1e-3) / 2 == pytest.approx(1341.47, abs=5e-3)


def test_paper_variance_stage_table():
    # spec mapa.md section 4, testbed constants, the paper's Delta_0 = 2 DeltaS^2 / eps^2
    s = MapaSchedule(**TESTBED, dim=4380, variance="paper")
    table = [(111.7894, 1341.47, 25031.25, 0.0278, 2), (55.8947, 670.74, 6285.94, 0.0279, 6),
             (27.9474, 335.37, 1599.61, 0.0284, 21), (13.9737, 167.68, 428.03, 0.0305, 75),
             (6.9868, 83.84, 135.13, 0.0385, 237)]
    start = 1
    for i, (ds, clip, db, raw, length) in enumerate(table):
        st = s.stage(i)
        assert st.delta_s == pytest.approx(ds, abs=1e-4)
        assert st.clip == pytest.approx(clip, abs=5e-3)
        assert st.delta_b == pytest.approx(db, abs=5e-3)
        assert st.raw_p == pytest.approx(raw, abs=1e-4) and st.p == 1  # the table rounds
        assert st.gamma == pytest.approx(0.0125) and st.length == length
        assert st.start == start
        start += length
    assert s.for_update(2).index == 0 and s.for_update(3).index == 1 and s.for_update(8).index == 1
    assert s.for_update(9).index == 2


def test_sound_variance_changes_the_schedule():
    # spec mapa.md section 6: with the true L2 variance, stage 0 of the testbed CNN
    s = MapaSchedule(**TESTBED, dim=4380)
    st = s.stage(0)
    assert st.delta_b == pytest.approx(2.398e11, rel=1e-3)
    assert st.p == pytest.approx(2.665e5, rel=1e-3)
    assert st.gamma == pytest.approx(4.69e-8, rel=1e-3)
    assert st.length == 9479
    assert st.delta_0 / MapaSchedule(**TESTBED, dim=4380, variance="paper").stage(0).delta_0 \
        == pytest.approx(4380 * 4381 / 2)
    l1 = MapaSchedule(**TESTBED, dim=4380, noise="l1").stage(0)
    assert l1.delta_0 == pytest.approx(2 * 4380**2 * st.delta_s**2)


@pytest.mark.parametrize("theta,variance,noise", [(0.5, "sound", "l2"), (0.8, "paper", "l2"),
                                                  (0.3, "sound", "l1")])
def test_delta_s_shrinks_by_theta_and_clip_matches_noise(theta, variance, noise):
    s = MapaSchedule(**(TESTBED | {"theta": theta}), dim=650, variance=variance, noise=noise)
    stages = [s.stage(i) for i in range(8)]
    for a, b in zip(stages, stages[1:]):
        assert b.delta_s < a.delta_s
        assert b.delta_s == pytest.approx(theta * a.delta_s, rel=1e-14)
        assert b.start == a.start + a.length
    for st in stages:
        assert st.clip == pytest.approx(24 * st.delta_s / 2)
        mech = _mechanism(st.delta_s, 24, 1.0, noise)
        assert mech.l2_clip_norm == st.clip
        assert mech.sensitivity == pytest.approx(st.delta_s, rel=1e-14)  # noise uses DeltaS_s
        if variance == "sound":
            assert st.delta_0 == pytest.approx(mech.noise_variance(650))
        assert st.gamma == pytest.approx(1 / (2 * 10 * st.p * 4))
        assert st.length == math.ceil(4 * 10 * st.p**2 * 16 * 50 / st.delta_b)


def test_step_size_formulas():
    assert audp_step(0, lipschitz=10, tau=3, delta_b=100) == pytest.approx(1 / 80)
    assert audp_step(4, lipschitz=10, tau=3, delta_b=100) == pytest.approx(1 / 100)
    assert asgd_step(0, lipschitz=10, tau=3, sigma=5, r0=50, batch=25) == pytest.approx(
        1 / (160 + 5 / 250))
    assert asgd_step(3, lipschitz=1, tau=0, sigma=5, r0=1, batch=1) == pytest.approx(1 / 11)


def test_noise_variance_modes():
    assert noise_variance(2.0, 0.5, 10, batch=4, variance="paper") == pytest.approx(32.0)
    assert noise_variance(2.0, 0.5, 10, batch=4) == pytest.approx(110 * 16)
    assert noise_variance(2.0, 0.5, 10, batch=4, noise="l1") == pytest.approx(2 * 100 * 16)


# ----------------------------------------------------------------------------- noise law
def _run(cfg, ds, ledger=None, alg="audp"):
    ops = MultinomialLogReg(ds.num_features, ds.num_classes)
    sched = simulate(cfg.edges, cfg.updates, cfg.timing(), seed=cfg.seed)
    return _Run(alg, cfg, ops, _pool(ds, torch.device("cpu")), sched, ledger,
                torch.device("cpu"))


def test_l2_noise_norm_is_gamma_d_scale(digits8):
    cfg = MapaConfig(**SMALL, epsilon=2.0)
    run = _run(cfg, digits8)
    d, b, n = run.dim, cfg.batch, 1500
    zeros = torch.zeros(n, b, d)
    ks = [i % cfg.edges for i in range(n)]
    run.delta_s[:] = 0.7
    noise = run._noisy_batched(zeros, ks, list(range(n)))  # each (edge, upload) its own stream
    norms = noise.double().norm(dim=1).numpy()
    scale = 0.7 / 2.0  # DeltaS / eps
    assert stats.kstest(norms, stats.gamma(a=d, scale=scale).cdf).pvalue > 1e-3
    assert stats.kstest(norms, stats.gamma(a=d, scale=1.1 * scale).cdf).pvalue < 1e-6
    # uniform direction: the first coordinate of u is symmetric with E u_1^2 = 1/d
    u = (noise / noise.norm(dim=1, keepdim=True))[:, 0].double()
    assert float((u**2).mean()) == pytest.approx(1 / d, rel=0.15)


def test_l1_noise_is_laplace_per_coordinate(digits8):
    cfg = MapaConfig(**SMALL, epsilon=4.0, noise="l1")
    run = _run(cfg, digits8)
    d, b = run.dim, cfg.batch
    run.delta_s[:] = 0.5
    noise = run._noisy_batched(torch.zeros(40, b, d), [0] * 40, list(range(40)))
    scale = math.sqrt(d) * 0.5 / 4.0
    assert stats.kstest(noise.double().flatten().numpy(),
                        stats.laplace(scale=scale).cdf).pvalue > 1e-3


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("alg,noise", [("mapa", "l2"), ("audp", "l1"), ("asgd", "l2")])
def test_batched_equals_the_reference_path(alg, noise, digits8):
    cfg = MapaConfig(**SMALL, noise=noise, variance="paper", epsilon=50.0)
    a = run_algorithm(alg, cfg, dataset=digits8)
    b = run_algorithm(alg, MapaConfig(**(cfg.__dict__ | {"batched": False})), dataset=digits8)
    assert torch.allclose(a["_model"], b["_model"], rtol=1e-5, atol=1e-6)
    assert a["gradient_batches"] < a["updates"]  # several uploads per computation
    assert a["updates"] == 120 and len(a["history"]) == 4  # 0, 40, 80, 120


def test_ledger_charges_each_upload_once(tmp_path, digits8):
    cfg = MapaConfig(**(SMALL | {"edges": 8}), epsilon=(1.0, 2.0) * 4, tau_max=5)
    res = train(cfg, algorithms=("mapa", "audp", "asgd"), out=tmp_path)
    sched = simulate(8, 120, cfg.timing(), seed=3, tau_max=5)
    uploads = sched.uploads_per_edge()
    assert (~sched.applied).sum() > 0  # dropped uploads exist and are charged too
    for alg in ("mapa", "audp"):
        p = res["algorithms"][alg]["privacy"]
        assert p["uploads_per_edge"] == uploads.tolist()
        led = Ledger.open(tmp_path / f"ledger-{alg}.jsonl")
        lines = (tmp_path / f"ledger-{alg}.jsonl").read_text().splitlines()[1:]
        assert len(lines) == uploads.sum()
        for k in range(8):
            atoms = led.composition(str(k)).atoms
            assert sum(n for _, n in atoms) == uploads[k]
            eps_k = 1.0 if k % 2 == 0 else 2.0
            ev = privkit.SelfComposedDpEvent(privkit.L2LaplaceDpEvent(eps_k, 650), int(uploads[k]))
            assert p["per_edge"][k] == pytest.approx(privkit.epsilon(ev, 1e-3, "optimal").epsilon)
            assert p["per_edge"][k] <= uploads[k] * eps_k + 1e-9
        hist = [h["epsilon_max"] for h in res["algorithms"][alg]["history"]]
        assert hist == sorted(hist)  # epsilon never decreases
        assert p["per_update_epsilon_paper"]["max"] == 2.0
    assert "privacy" not in res["algorithms"]["asgd"]
    assert not (tmp_path / "ledger-asgd.jsonl").exists()
    body = json.loads((tmp_path / "report.json").read_text())
    assert all("simulated_time_s" in h for h in body["algorithms"]["mapa"]["history"])
    assert body["algorithms"]["mapa"]["stages"][0]["delta_s"] == pytest.approx(
        initial_sensitivity(30, 16, 1e-3))
    assert sum(body["algorithms"]["audp"]["staleness_histogram"].values()) == 120
    assert body["algorithms"]["audp"]["staleness_max"] <= 5
    assert "comparison" in body and body["comparison"]["targets"]
    for png in ("curves_vs_simulated_time.png", "staleness.png", "schedule.png"):
        assert (tmp_path / png).stat().st_size > 0
    with pytest.raises(InvalidParameterError, match="out"):  # a ledger never resets
        train(cfg, algorithms=("mapa",), out=tmp_path)


def test_budget_stop_before_any_noise(tmp_path, digits8, monkeypatch):
    draws = []
    real = mapa_uploads.l2_laplace_noise

    def spy(tree, alpha, *, rng):
        draws.append(1)
        return real(tree, alpha, rng=rng)

    monkeypatch.setattr(mapa_uploads, "l2_laplace_noise", spy)
    one = privkit.epsilon(privkit.SelfComposedDpEvent(privkit.L2LaplaceDpEvent(1.0, 650), 5),
                          1e-3, "optimal").epsilon
    cfg = MapaConfig(**SMALL, epsilon=1.0, epsilon_budget=one * (1 + 1e-9))  # 5 uploads each
    res = run_algorithm("audp", cfg, dataset=digits8, out=tmp_path)
    p = res["privacy"]
    assert max(p["uploads_per_edge"]) == 5 and p["epsilon_max"] <= cfg.epsilon_budget
    assert "stopped before upload 6 of edge" in p["stopped"]
    assert res["updates"] < 120 and len(draws) == res["updates"] == sum(p["uploads_per_edge"])
    led = Ledger.open(tmp_path / "ledger-audp.jsonl")
    k = p["stopped"].split("of edge ")[1].split()[0]
    assert led.would_exceed([k], privkit.L2LaplaceDpEvent(1.0, 650))[0]
    assert led.epsilons()[k] == pytest.approx(one)


def test_cnn_on_a_tiny_idx_fixture(tmp_path):
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte", rng.integers(0, 256, (120, 28, 28),
                                                                 dtype=np.uint8))
    write_idx(tmp_path / "train-labels-idx1-ubyte", rng.integers(0, 10, 120, dtype=np.uint8))
    cfg = MapaConfig(dataset=f"mnist:{tmp_path}", model="cnn", edges=3, batch=8, updates=12,
                     eval_every=6, epsilon=5.0, variance="paper")
    with max_loss_factor(math.inf):  # the paper's variance blows this tiny run up (finite)
        a = run_algorithm("mapa", cfg)
        b = run_algorithm("mapa", MapaConfig(**(cfg.__dict__ | {"batched": False})))
    assert a["_model"].shape == (PooledCNN().num_parameters,) == (4380,)
    assert torch.allclose(a["_model"], b["_model"], rtol=1e-4, atol=1e-5)
    assert a["privacy"]["uploads_mean"] == pytest.approx(4.0)
    with pytest.raises(InvalidParameterError, match="model"):
        run_algorithm("asgd", MapaConfig(**(SMALL | {"model": "cnn"})))


def test_updates_to_loss():
    h = [{"iteration": 0, "train_loss": 2.0}, {"iteration": 50, "train_loss": 1.5},
         {"iteration": 100, "train_loss": 0.9}]
    assert updates_to_loss(h, 1.5) == 50 and updates_to_loss(h, 0.5) is None


# ----------------------------------------------------------- Poisson sampler, amplification
ADD_REMOVE = NeighboringRelation.ADD_OR_REMOVE_ONE


def test_amplified_epsilon_known_values():
    # eps' = log(1 + q (e^eps - 1)) (Balle, Barthe & Gaboardi 2018, Thm 8)
    assert amplified_epsilon(1.0, 0.1) == pytest.approx(math.log(1 + 0.1 * (math.e - 1)),
                                                        rel=1e-15)
    assert amplified_epsilon(1.0, 0.1) == pytest.approx(0.158565, abs=5e-7)
    assert amplified_epsilon(2.0, 1.0) == pytest.approx(2.0, rel=1e-15)  # q = 1: no gain
    for eps in (0.01, 0.5, 1.0, 5.0):
        for q in (1e-6, 0.01, 0.3, 0.999):
            assert amplified_epsilon(eps, q) < eps
    # composed optimally as pure steps: q with eps' = 0.1 and 100 uploads reproduce the
    # spec's KOV optimal-composition vector (eps0 = 0.1, k = 100, delta = 1e-5: 4.30679)
    q = math.expm1(0.1) / math.expm1(1.0)
    ev = PoissonSampledPureDpEvent(q, privkit.L2LaplaceDpEvent(1.0, 650))
    assert ev.epsilon == pytest.approx(0.1, rel=1e-12)
    rep = privkit.epsilon(privkit.SelfComposedDpEvent(ev, 100), 1e-5, "optimal",
                          neighboring_relation=ADD_REMOVE)
    assert rep.epsilon == pytest.approx(4.30679, abs=2e-5)
    assert AMPLIFICATION_ASSUMPTION in rep.assumptions
    full = PoissonSampledPureDpEvent(1.0, privkit.L2LaplaceDpEvent(1.0, 650))
    plain = privkit.SelfComposedDpEvent(privkit.L2LaplaceDpEvent(1.0, 650), 100)
    assert privkit.epsilon(privkit.SelfComposedDpEvent(full, 100), 1e-5, "optimal").epsilon \
        == privkit.epsilon(plain, 1e-5, "optimal").epsilon == pytest.approx(79.84132, abs=1e-4)
    # RDP / PLD price it through randomized response, and only under add/remove
    assert privkit.epsilon(privkit.SelfComposedDpEvent(ev, 100), 1e-5, "pld",
                           neighboring_relation=ADD_REMOVE).epsilon == pytest.approx(4.3, abs=0.1)
    with pytest.raises(UnsupportedEventError, match="ADD_OR_REMOVE_ONE"):
        privkit.epsilon(ev, 1e-5, "rdp", neighboring_relation=NeighboringRelation.REPLACE_ONE)
    with pytest.raises(InvalidParameterError, match="sampling_probability"):
        PoissonSampledPureDpEvent(0.0, privkit.L2LaplaceDpEvent(1.0, 650))
    with pytest.raises(InvalidParameterError, match="event"):
        PoissonSampledPureDpEvent(0.5, privkit.GaussianDpEvent(1.0))


def test_amplification_is_refused_without_the_poisson_sampler(tmp_path, capsys):
    with pytest.raises(InvalidParameterError, match="amplification.*poisson"):
        MapaConfig(**SMALL, amplification=True)
    with pytest.raises(InvalidParameterError, match="batch_sampler"):
        MapaConfig(**SMALL, batch_sampler="shuffle")
    argv = ["train", "mapa", "--clients", "6", "--rounds", "5", "--amplification",
            "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "amplification" in err[0] and "poisson" in err[0]
    assert not (tmp_path / "x").exists()  # nothing written


def test_poisson_batches_include_each_record_with_probability_q(digits8):
    cfg = MapaConfig(**SMALL, batch_sampler="poisson")
    run = _run(cfg, digits8)
    n, b, uploads = int(digits8.train_sizes[0]), cfg.batch, 3000
    q = b / n
    assert run.q[0] == q
    counts = np.zeros(n)
    sizes = []
    for u in range(uploads):
        rows = run._batch_rows(0, u) - int(run.data.offsets[0])
        assert len(np.unique(rows)) == len(rows)  # a record is used at most once
        counts[rows] += 1
        sizes.append(len(rows))
    # overall inclusion rate q (binomial, 4 sigma); every record's frequency within 5 sigma of
    # q (union bound over the records: false failure < 2e-4); no record favoured (chi-square)
    total, expect = counts.sum(), n * uploads * q
    assert abs(total - expect) < 4 * math.sqrt(expect * (1 - q))
    assert np.abs(counts / uploads - q).max() < 5 * math.sqrt(q * (1 - q) / uploads)
    assert stats.chisquare(counts).pvalue > 1e-4
    # batch sizes ~ Binomial(n, q): mean b, variance n q (1 - q)
    assert abs(np.mean(sizes) - b) < 4 * math.sqrt(n * q * (1 - q) / uploads)
    assert np.var(sizes) == pytest.approx(n * q * (1 - q), rel=0.15)
    distinct = _run(MapaConfig(**SMALL), digits8)
    assert all(len(distinct._batch_rows(0, u)) == b for u in range(50))


def test_poisson_release_is_the_clipped_sum_over_b(digits8):
    cfg = MapaConfig(**SMALL, batch_sampler="poisson", epsilon=1e12)  # negligible noise
    run = _run(cfg, digits8)
    b, d = cfg.batch, run.dim
    run.delta_s[:] = 2.0 / b  # C = b DeltaS / 2 = 1
    per = torch.zeros(1, 20, d)
    per[0, :, 0] = 3.0  # every row has norm 3: clipped to 1
    mask = torch.zeros(1, 20, dtype=torch.bool)
    mask[0, :5] = True  # 5 sampled records
    out = run._noisy_batched(per, [0], [0], mask)
    assert float(out[0, 0]) == pytest.approx(5 / b, abs=1e-6)  # sum of 5 clipped rows / b
    assert float(out[0, 1:].abs().max()) < 1e-6


def test_poisson_amplified_run_reports_both_numbers(tmp_path, digits8):
    # b = the smallest edge's size: that edge has q = 1 (no amplification), the others q < 1
    b = int(digits8.train_sizes.min())
    cfg = MapaConfig(**(SMALL | {"batch": b}), epsilon=2.0, batch_sampler="poisson",
                     amplification=True)
    res = train(cfg, algorithms=("audp",), out=tmp_path)
    p = res["algorithms"]["audp"]["privacy"]
    led = Ledger.open(tmp_path / "ledger-audp.jsonl")
    assert led.neighboring_relation is ADD_REMOVE
    sizes = digits8.train_sizes
    for k in range(8):
        n = p["uploads_per_edge"][k]
        base = privkit.L2LaplaceDpEvent(2.0, 650)
        amp = PoissonSampledPureDpEvent(b / int(sizes[k]), base)
        want = privkit.epsilon(privkit.SelfComposedDpEvent(amp, n), 1e-3, "optimal",
                               neighboring_relation=ADD_REMOVE).epsilon
        plain = privkit.epsilon(privkit.SelfComposedDpEvent(base, n), 1e-3, "optimal").epsilon
        assert p["per_edge"][k] == want == led.epsilons()[str(k)]
        assert p["per_edge_unamplified"][k] == plain
        if sizes[k] == b:
            assert p["per_edge"][k] == plain
        else:
            assert p["per_edge"][k] < plain
    assert p["amplified"] and p["epsilon_assumption"] == AMPLIFICATION_ASSUMPTION
    assert "stays secret" in p["amplification"] and "add/remove" in p["neighbouring_relation"]
    assert p["epsilon_max"] < p["epsilon_unamplified_max"]
    table = final_table(res)
    assert "stays secret" in table and "unamplified" in table
    hist = [h["epsilon_max"] for h in res["algorithms"]["audp"]["history"]]
    assert hist[-1] == p["epsilon_max"] and hist == sorted(hist)
    # Poisson sampling without --amplification: charged the full eps_k, replace-one
    plain_run = run_algorithm("audp", MapaConfig(**(SMALL | {"batch": b}), epsilon=2.0,
                                                 batch_sampler="poisson"), dataset=digits8)
    q = plain_run["privacy"]
    assert not q["amplified"] and "per_edge_unamplified" not in q
    assert q["per_edge"] == p["per_edge_unamplified"]


def test_poisson_batched_equals_the_reference_path_and_budget_stops(tmp_path, digits8):
    cfg = MapaConfig(**SMALL, batch_sampler="poisson", amplification=True, epsilon=50.0,
                     variance="paper")
    for alg in ("mapa", "asgd"):
        a = run_algorithm(alg, cfg, dataset=digits8)
        b = run_algorithm(alg, MapaConfig(**(cfg.__dict__ | {"batched": False})),
                          dataset=digits8)
        assert torch.allclose(a["_model"], b["_model"], rtol=1e-5, atol=1e-6)
    q0 = 16 / int(digits8.train_sizes.min())
    ev = PoissonSampledPureDpEvent(q0, privkit.L2LaplaceDpEvent(1.0, 650))
    budget = privkit.epsilon(privkit.SelfComposedDpEvent(ev, 8), 1e-3, "optimal").epsilon
    res = run_algorithm("audp", MapaConfig(**SMALL, epsilon=1.0, batch_sampler="poisson",
                                           amplification=True, epsilon_budget=budget),
                        dataset=digits8, out=tmp_path)
    p = res["privacy"]
    assert "stopped before upload" in p["stopped"] and p["epsilon_max"] <= budget
    assert p["epsilon_unamplified_max"] > budget  # the budget binds the amplified number


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw,name", [
    ({"epsilon": 0.0}, "epsilon"), ({"epsilon": -1.0}, "epsilon"),
    ({"epsilon": (1.0,) * 7 + (0.0,)}, r"epsilon\[7\]"), ({"epsilon": (1.0, 2.0)}, "epsilon"),
    ({"epsilon": float("nan")}, "epsilon"), ({"batch": 0}, "batch"), ({"batch": -3}, "batch"),
    ({"theta": 0.0}, "theta"), ({"theta": 1.0}, "theta"), ({"theta": 1.5}, "theta"),
    ({"theta": float("nan")}, "theta"), ({"delta": 0.0}, "delta"), ({"delta": 1.0}, "delta"),
    ({"delta": 2.0}, "delta"), ({"tau_max": -1}, "tau_max"), ({"updates": 0}, "updates"),
    ({"edges": 0}, "edges"), ({"noise": "gauss"}, "noise"), ({"variance": "x"}, "variance"),
    ({"speed_dist": "normal:0,1"}, "speed_dist"), ({"lipschitz": 0}, "lipschitz"),
    ({"epsilon_budget": -1}, "epsilon_budget"), ({"model": "mlp"}, "model"),
    ({"batch_sampler": "with-replacement"}, "batch_sampler"),
    ({"amplification": True}, "amplification"), ({"checkpoint_every": -1}, "checkpoint_every"),
])
def test_bad_config_is_named(kw, name):
    with pytest.raises(InvalidParameterError, match=name):
        MapaConfig(**(SMALL | kw))


def test_bad_data_is_named(digits8):
    with pytest.raises(InvalidParameterError, match="batch"):
        run_algorithm("asgd", MapaConfig(**(SMALL | {"batch": 500})), dataset=digits8)
    with pytest.raises(InvalidParameterError, match="dataset"):
        load_edges("cifar", edges=3, seed=0)
    with pytest.raises(InvalidParameterError, match="algorithms"):
        train(MapaConfig(**SMALL), algorithms=("fedavg",))
    with pytest.raises(InvalidParameterError, match="theta"):
        MapaSchedule(**(TESTBED | {"theta": 1.0}), dim=10)


def test_cli_runs_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "mapa", "--algorithms", "mapa,audp,asgd", "--clients", "6", "--upload-epsilon",
            "2", "--batch", "12", "--rounds", "60", "--eval-every", "30",
            "--speed-dist", "lognormal:0,1", "--out", str(out), "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["algorithms"]) == {"mapa", "audp", "asgd"}
    assert summary["algorithms"]["mapa"]["updates"] == 60
    assert "per_update_epsilon_paper" in summary["algorithms"]["audp"]["privacy"]
    for bad in (["--upload-epsilon", "0"], ["--batch", "0"], ["--theta", "1"], ["--delta", "0"],
                ["--upload-epsilon", "a,b"]):
        argv2 = ["train", "mapa", "--clients", "6", "--rounds", "5", "--out",
                 str(tmp_path / "bad")] + bad
        assert main(argv2) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err and err[-1].startswith("privkit: error:"), err
