"""MAPA / AUDP with ``noise="gaussian"`` (DP-SGD uploads) and the step-size rules.

Each Gaussian upload is the sum of the per-example gradients of a Poisson-sampled batch, each
clipped to the stage's C, plus N(0, (z C)^2 I), divided by the expected batch size b; it is
charged ``PoissonSampledDpEvent(b / n_k, GaussianDpEvent(z))`` (add/remove one record) before
its noise is drawn, and each edge's uploads compose on privkit's PLD.
"""

import functools
import json
import math

import numpy as np
import pytest
import torch
from dp_accounting.dp_event import GaussianDpEvent as DpaG
from dp_accounting.dp_event import PoissonSampledDpEvent as DpaP
from dp_accounting.dp_event import SelfComposedDpEvent as DpaS
from dp_accounting.pld import pld_privacy_accountant
from scipy import stats

import fl_examples.mapa.uploads as mapa_uploads
import privkit
from fl_examples.core import checkpoint
from fl_examples.core.asyncsim import simulate
from fl_examples.core.models import MultinomialLogReg
from fl_examples.mapa import MapaConfig, final_table, load_edges, run_algorithm, train
from fl_examples.mapa.privacy import GAUSSIAN_ASSUMPTION, _price, gaussian_noise_multiplier
from fl_examples.mapa.run import _Run
from fl_examples.mapa.schedule import asgd_step, audp_step, step_rule
from fl_examples.mapa.uploads import _pool
from privkit.accountants.rules import NeighboringRelation
from privkit.cli import main
from privkit.errors import InvalidParameterError
from privkit.ledger import Ledger

SMALL = dict(dataset="digits", edges=8, batch=16, updates=120, eval_every=40, seed=3,
             noise="gaussian")


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # byte-equal ledger headers
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def digits8():
    return load_edges("digits", edges=8, seed=3)


def _run(cfg, ds, alg="audp"):
    ops = MultinomialLogReg(ds.num_features, ds.num_classes)
    sched = simulate(cfg.edges, cfg.updates, cfg.timing(), seed=cfg.seed)
    return _Run(alg, cfg, ops, _pool(ds, torch.device("cpu")), sched, None, torch.device("cpu"))


@functools.cache
def _dpa_epsilon(q: float, z: float, n: int, delta: float) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(DpaS(DpaP(q, DpaG(z)), n))
    return acc.get_epsilon(delta)


# ----------------------------------------------------------------------------- the release
def test_noise_on_zero_gradients_has_stddev_z_c_over_b(digits8):
    cfg = MapaConfig(**SMALL, noise_multiplier=1.7)
    run = _run(cfg, digits8)
    d, b, n = run.dim, cfg.batch, 600
    ks = [i % cfg.edges for i in range(n)]
    run.delta_s[:] = 2 * 0.8 / b  # C = b DeltaS / 2 = 0.8 for edges 0..3 ...
    run.delta_s[4:] = 2 * 3.0 / b  # ... and 3.0 for edges 4..7 (a later MAPA stage's clip)
    noise = run._noisy_batched(torch.zeros(n, b, d), ks, list(range(n))).double().numpy()
    for edges, clip in (([0, 1, 2, 3], 0.8), ([4, 5, 6, 7], 3.0)):
        sample = noise[np.isin(ks, edges)].ravel()
        sd = 1.7 * clip / b
        assert stats.kstest(sample, stats.norm(scale=sd).cdf).pvalue > 1e-3
        assert stats.kstest(sample, stats.norm(scale=1.05 * sd).cdf).pvalue < 1e-6
        assert float(sample.std()) == pytest.approx(sd, rel=0.01)
    # each upload draws from its own stream: (edge, upload) pairs never repeat a draw
    assert not np.allclose(noise[0], noise[8])


def _influence(ds) -> tuple[float, float]:
    """(how far one record moves an almost noiseless Gaussian upload, C / b): the record is
    added to a Poisson batch, once as it is and once with an enormous gradient."""
    cfg = MapaConfig(**SMALL, noise_multiplier=1e-12, clip=0.05)
    run = _run(cfg, ds)
    b = cfg.batch
    rows = torch.as_tensor(run._batch_rows(0, 0))[None]
    xb, yb = run.data.x[rows].clone(), run.data.y[rows]
    params = run.pulled[[0]]
    mask = torch.ones(rows.shape, dtype=torch.bool)
    without = mask.clone()
    without[0, 0] = False  # the batch without record 0
    worst = 0.0
    for scale in (1.0, 1e4):
        x = xb.clone()
        x[0, 0] *= scale
        per = run.model.per_example_grads(params, x, yb)
        a = run._noisy_batched(per, [0], [0], mask)
        c = run._noisy_batched(per, [0], [0], without)
        worst = max(worst, float((a - c).double().norm()))
    return worst, cfg.clip / b


def test_each_example_contribution_is_clipped(digits8):
    moved, bound = _influence(digits8)
    assert 0 < moved <= bound * (1 + 1e-5)


def test_a_mutant_that_clips_the_batch_mean_fails(digits8, monkeypatch):
    def clip_mean(rows, bound):  # scales the rows so that their mean has norm <= bound
        mean = rows.double().mean(0)
        return rows * min(1.0, bound / max(float(mean.norm()), 1e-300))

    monkeypatch.setattr(mapa_uploads, "clip_per_example", clip_mean)
    moved, bound = _influence(digits8)
    assert moved > 3 * bound


# ----------------------------------------------------------------------------- accounting
def test_ledger_charges_each_upload_and_dp_accounting_agrees(digits8):
    cfg = MapaConfig(**SMALL, noise_multiplier=2.0, tau_max=5)
    res = train(cfg, algorithms=("mapa", "audp"))  # in-memory ledgers (see _ledger)
    sched = simulate(8, 120, cfg.timing(), seed=3, tau_max=5)
    uploads = sched.uploads_per_edge()
    assert (~sched.applied).sum() > 0  # dropped uploads were released: charged too
    sizes = digits8.train_sizes
    for alg in ("mapa", "audp"):
        p = res["algorithms"][alg]["privacy"]
        assert p["uploads_per_edge"] == uploads.tolist()
        assert p["delta"] == 1e-5 and cfg.delta == 1e-5  # the Gaussian mode's default
        assert p["epsilon_assumption"] == GAUSSIAN_ASSUMPTION
        assert "add/remove one record" in p["neighbouring_relation"]
        assert p["noise_multiplier"] == 2.0
        led = res["algorithms"][alg]["_ledger"]
        assert led.neighboring_relation is NeighboringRelation.ADD_OR_REMOVE_ONE
        assert led.delta == 1e-5
        for k in range(8):
            q = 16 / int(sizes[k])
            want_event = privkit.PoissonSampledDpEvent(q, privkit.GaussianDpEvent(2.0))
            atoms = led.composition(str(k)).atoms
            assert atoms == ((want_event, int(uploads[k])),)  # one event, every upload
            assert p["per_edge"][k] == led.epsilons()[str(k)]
            if alg == "audp":  # (MAPA's numbers are the same: checked below)
                theirs = _dpa_epsilon(q, 2.0, int(uploads[k]), 1e-5)
                assert theirs * 0.99 <= p["per_edge"][k] <= theirs * 1.01, k
        hist = [h["epsilon_max"] for h in res["algorithms"][alg]["history"]]
        assert hist == sorted(hist) and hist[-1] == p["epsilon_max"]
    # MAPA's stage clip changes C, not z: the same event, whatever the stage
    assert res["algorithms"]["mapa"]["privacy"]["per_edge"] == \
        res["algorithms"]["audp"]["privacy"]["per_edge"]
    table = final_table(res)
    assert GAUSSIAN_ASSUMPTION in table and "delta=1e-05" in table


def test_stages_change_the_clip_but_not_the_charged_event(tmp_path, digits8):
    # a huge first clip makes MAPA's stages short: several stages within 120 updates
    cfg = MapaConfig(**(SMALL | {"sigma": 0.01}), noise_multiplier=1.0, clip=1000.0,
                     step_schedule="paper")  # (the paper's tiny step: such a clip's noise
    # would blow the model up with lr; the stage lengths are then the paper's for its step)
    res = run_algorithm("mapa", cfg, dataset=digits8, out=tmp_path)
    stages = res["stages"]
    assert len(stages) >= 3
    assert stages[1]["clip"] == pytest.approx(500.0) and stages[2]["clip"] == pytest.approx(250.0)
    led = Ledger.open(tmp_path / "ledger-mapa.jsonl")
    for k in range(8):
        assert len(led.composition(str(k)).atoms) == 1


def test_calibrated_noise_meets_the_target_tightly(digits8):
    cfg = MapaConfig(**SMALL, noise_for_epsilon=3.0)
    sched = simulate(8, 120, cfg.timing(), seed=3)
    z, info = gaussian_noise_multiplier(cfg, sched, digits8.train_sizes)
    counts = sched.uploads_per_edge()
    sizes = digits8.train_sizes

    def eps_max(zz: float) -> float:
        return max(_price(privkit.PoissonSampledDpEvent(16 / int(n), privkit.GaussianDpEvent(zz)),
                          int(c), 1e-5, "ADD_OR_REMOVE_ONE", "auto")
                   for c, n in zip(counts, sizes) if c)

    assert eps_max(z) <= 3.0 < eps_max(z * 0.999)
    assert info["target_epsilon"] == 3.0 and info["planned_epsilon_max"] == eps_max(z)
    res = run_algorithm("audp", cfg, dataset=digits8)
    p = res["privacy"]
    assert p["noise_multiplier"] == z and p["calibrated"]["value"] == z
    assert 3.0 * 0.999 < p["epsilon_max"] <= 3.0


def test_charges_are_written_before_the_noise_is_drawn(tmp_path, digits8, monkeypatch):
    # The ledger's charges are recorded before the noise is drawn; their durable write is
    # grouped (drive() syncs before anything derived from a release leaves the process, which
    # tests/fl_examples/test_publication_points.py checks).
    real, draws, charges = mapa_uploads.gaussian_noise, [], []
    real_spend = privkit.ledger.Ledger.spend

    def spend(self, ids, *a, **kw):
        out = real_spend(self, ids, *a, **kw)
        charges.extend(ids)  # one upload per edge charged
        return out

    def spy(tree, stddev, *, rng):
        draws.append(1)
        assert len(charges) >= len(draws), "noise drawn before its upload was charged"
        return real(tree, stddev, rng=rng)

    monkeypatch.setattr(privkit.ledger.Ledger, "spend", spend)
    monkeypatch.setattr(mapa_uploads, "gaussian_noise", spy)
    one = _price(privkit.PoissonSampledDpEvent(16 / int(digits8.train_sizes.min()),
                                               privkit.GaussianDpEvent(1.0)), 6, 1e-5,
                 "ADD_OR_REMOVE_ONE", "auto")
    cfg = MapaConfig(**SMALL, noise_multiplier=1.0, epsilon_budget=one)
    res = run_algorithm("audp", cfg, dataset=digits8, out=tmp_path)
    p = res["privacy"]
    assert "stopped before upload" in p["stopped"] and p["epsilon_max"] <= one
    assert len(draws) == res["updates"] == sum(p["uploads_per_edge"])  # no draw uncharged


class _Crash(BaseException):
    """Stands for SIGKILL: nothing after the raise point runs."""


def test_resume_adopts_the_charges_and_never_charges_twice(tmp_path, digits8, monkeypatch):
    cfg = MapaConfig(**(SMALL | {"eval_every": 20, "updates": 80}), noise_for_epsilon=4.0,
                     checkpoint_every=15)
    ref = run_algorithm("mapa", cfg, dataset=digits8, out=tmp_path / "ref")
    real = checkpoint.save

    def save(directory, round_, tensors, state):
        if state["applied"] == 45:  # dies after charging uploads no checkpoint covers
            raise _Crash
        return real(directory, round_, tensors, state)

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "save", save)
        with pytest.raises(_Crash):
            run_algorithm("mapa", cfg, dataset=digits8, out=tmp_path / "run")
    led = Ledger.open(tmp_path / "run" / "ledger-mapa.jsonl")
    ck = tmp_path / "run" / "checkpoints" / "mapa"
    ptr = json.loads((ck / (ck / "LATEST").read_text() / "state.json").read_text())
    assert ptr["ledger_pointer"]["seq"] < led.head().seq  # charged, not checkpointed
    res = run_algorithm("mapa", cfg, dataset=digits8, out=tmp_path / "run", resume=True)
    assert torch.equal(ref["_model"], res["_model"])
    assert (tmp_path / "ref" / "ledger-mapa.jsonl").read_bytes() == \
        (tmp_path / "run" / "ledger-mapa.jsonl").read_bytes()
    assert res["privacy"]["uploads_per_edge"] == ref["privacy"]["uploads_per_edge"]
    assert res["privacy"]["epsilon_max"] == ref["privacy"]["epsilon_max"] <= 4.0


def test_gaussian_learns_at_epsilon_8():
    ds = load_edges("digits", edges=30, seed=0)
    cfg = MapaConfig(noise="gaussian", noise_for_epsilon=8.0, updates=300, eval_every=300)
    res = run_algorithm("audp", cfg, dataset=ds)
    assert res["privacy"]["epsilon_max"] <= 8.0
    assert res["history"][-1]["heldout_accuracy"] > 0.5  # chance is 0.1


# ----------------------------------------------------------------------------- step sizes
def test_auto_step_rule_keeps_the_paper_for_the_pure_dp_noises():
    assert step_rule("auto", "asgd", "l2") == "constant"
    assert step_rule("auto", "audp", "l2") == step_rule("auto", "mapa", "l1") == "paper"
    assert step_rule("auto", "audp", "gaussian") == step_rule("auto", "mapa", "gaussian") \
        == "constant"
    assert step_rule("paper", "asgd", "gaussian") == "paper"
    assert step_rule("constant", "audp", "l2") == "constant"
    ds = load_edges("digits", edges=8, seed=3)
    cfg = MapaConfig(**(SMALL | {"noise": "l2"}))
    audp, asgd = _run(cfg, ds, "audp"), _run(cfg, ds, "asgd")
    assert audp.step_size(5) == audp_step(4, lipschitz=10, tau=7, delta_b=audp.audp_delta_b)
    assert asgd.step_size(5) == 0.1
    paper = _run(MapaConfig(**(SMALL | {"noise": "l2", "step_schedule": "paper"})), ds, "asgd")
    assert paper.step_size(5) == asgd_step(4, lipschitz=10, tau=7, sigma=5, r0=50, batch=16)


def test_asgd_default_step_learns_on_digits():
    ds = load_edges("digits", edges=30, seed=0)
    cfg = MapaConfig(updates=300, eval_every=300)
    new = run_algorithm("asgd", cfg, dataset=ds)["history"][-1]["test_accuracy"]
    old = run_algorithm("asgd", MapaConfig(updates=300, eval_every=300, step_schedule="paper"),
                        dataset=ds)["history"][-1]["test_accuracy"]
    assert new > 0.8 > 0.3 > old  # the paper's 1/(tau+1)^2 step barely moves in 300 updates


def test_cli_runs_the_gaussian_mode(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "mapa", "--noise", "gaussian", "--noise-for-epsilon", "8", "--clients", "6",
            "--batch", "12", "--rounds", "40", "--eval-every", "20", "--out", str(out),
            "--algorithms", "audp,asgd", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)["algorithms"]
    for alg in ("audp",):
        p = summary[alg]["privacy"]
        assert p["delta"] == 1e-5 and p["epsilon_max"] <= 8.0
        assert p["epsilon_assumption"] == GAUSSIAN_ASSUMPTION
        assert p["calibrated"]["target_epsilon"] == 8.0
        assert Ledger.open(out / f"ledger-{alg}.jsonl").epsilons()
    assert "privacy" not in summary["asgd"]
    body = json.loads((out / "report.json").read_text())
    assert body["config"]["noise"] == "gaussian" and body["config"]["clip"] == 1.0
    assert body["algorithms"]["audp"]["step_size"]["schedule"] == "constant"


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("extra,flag", [
    (["--noise-multiplier", "0"], "--noise-multiplier"),
    (["--noise-multiplier", "-1"], "--noise-multiplier"),
    (["--noise-multiplier", "nan"], "--noise-multiplier"),
    (["--noise-multiplier", "inf"], "--noise-multiplier"),
    (["--clip", "0"], "--clip"), (["--clip", "-2"], "--clip"), (["--clip", "nan"], "--clip"),
    (["--noise-for-epsilon", "0"], "--noise-for-epsilon"),
    (["--noise-for-epsilon", "nan"], "--noise-for-epsilon"),
    (["--noise-for-epsilon", "2", "--noise-multiplier", "1"], "--noise-for-epsilon"),
    (["--batch", "500"], "--batch"),  # a Poisson rate b / n_k above 1
    (["--batch", "0"], "--batch"),
    (["--batch-sampler", "distinct"], "--batch-sampler"),
    (["--amplification"], "--amplification"),
    (["--upload-epsilon", "2"], "--upload-epsilon"), (["--audp-clip", "2"], "--audp-clip"),
    (["--lr", "0"], "--lr"), (["--lr", "nan"], "--lr"),
])
def test_bad_gaussian_input_names_the_flag(extra, flag, tmp_path, capsys):
    out = tmp_path / "x"
    argv = ["train", "mapa", "--noise", "gaussian", "--clients", "6", "--rounds", "5",
            "--out", str(out)] + extra
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "Traceback" not in err[0], err
    assert not out.exists() or not any(out.iterdir())  # nothing written


@pytest.mark.parametrize("kw,name", [
    ({"noise_multiplier": 1.0}, "noise_multiplier"), ({"noise_for_epsilon": 1.0},
                                                      "noise_for_epsilon"),
    ({"clip": 1.0}, "clip"), ({"step_schedule": "sqrt"}, "step_schedule"),
])
def test_gaussian_only_settings_are_refused_with_the_pure_noises(kw, name):
    with pytest.raises(InvalidParameterError, match=name):
        MapaConfig(**(SMALL | {"noise": "l2"} | kw))


def test_pure_modes_keep_their_defaults():
    cfg = MapaConfig()
    assert (cfg.delta, cfg.batch_sampler, cfg.clip) == (1e-5, "distinct", None)
    # Theorem 3's failure probability stays the paper's 1e-3 (C_0 = 1341.47 at sigma 30,
    # b 24): a schedule constant, apart from the delta every epsilon is reported at
    assert (cfg.theorem3_delta, cfg.schedule_delta(), cfg.device) == (None, 1e-3, "auto")
    assert MapaConfig(theorem3_delta=1e-5).schedule_delta() == 1e-5
    g = MapaConfig(noise="gaussian")
    assert (g.delta, g.batch_sampler, g.clip) == (1e-5, "poisson", 1.0)
    assert math.isclose(MapaConfig(noise="gaussian", delta=1e-6).delta, 1e-6)
    with pytest.raises(InvalidParameterError, match="theorem3_delta"):
        MapaConfig(noise="gaussian", theorem3_delta=1e-3)  # its first clip is clip
    with pytest.raises(InvalidParameterError, match="theorem3_delta"):
        MapaConfig(theorem3_delta=1.5)


def test_gaussian_stage_lengths_come_from_the_uploads_variance_and_the_step():
    """The Gaussian mode's Delta_b bounds what an upload really varies by (a Poisson sum of
    gradients clipped to C_s, over b: sampling <= C_s^2 / b, noise d (z C_s / b)^2), and a
    stage lasts R / (L step^2 Delta_b) updates for the step the run takes: the default digits
    run's first stage is 428 updates (4 944 445 with the testbed's sigma and gamma)."""
    from fl_examples.mapa.schedule import MapaSchedule

    common = dict(sigma=30, batch=24, delta=1e-5, epsilon0=1, lipschitz=10, r0=50, tau=29,
                  theta=0.5, dim=650, noise="gaussian", noise_multiplier=1.0, initial_clip=1.0)
    s = MapaSchedule(**common, step=0.1)
    first, second = s.stage(0), s.stage(1)
    assert first.delta_b == pytest.approx(1.0**2 / 24 + 650 * (1.0 / 24) ** 2)
    assert first.length == math.ceil(50 / (10 * 0.1**2 * first.delta_b)) == 428
    assert (second.start, second.clip, second.step) == (429, 0.5, 0.1)
    assert second.delta_b == pytest.approx(first.delta_b / 4)  # both terms scale with C_s^2
    assert second.length == 1710 and s.for_update(2000).index == 1  # a default run switches
    # the paper's step: the paper's length, which is R / (L gamma^2 Delta_b) for its gamma
    paper = MapaSchedule(**common).stage(0)
    assert paper.step is None and paper.delta_b == first.delta_b
    assert paper.length == math.ceil(4 * 10 * paper.p**2 * 30**2 * 50 / paper.delta_b)
    assert paper.length == math.ceil(50 / (10 * paper.gamma**2 * paper.delta_b) - 1e-6)
    # the sampling term is sigma^2 / b while sigma is below the clip, and for the Laplace noises
    assert MapaSchedule(**(common | {"sigma": 0.5})).stage(0).delta_b == pytest.approx(
        0.25 / 24 + 650 / 576)
    l2 = MapaSchedule(sigma=30, batch=24, delta=1e-3, epsilon0=1, lipschitz=10, r0=50, tau=3,
                      theta=0.5, dim=4380).stage(0)
    assert l2.delta_b == pytest.approx(900 / 24 + l2.delta_0)
    # the trainer passes lr exactly when MAPA steps with it in the Gaussian mode
    assert MapaConfig(noise="gaussian").stage_step() == 0.1
    assert MapaConfig(noise="gaussian", step_schedule="paper").stage_step() is None
    assert MapaConfig(step_schedule="constant").stage_step() is None  # Laplace: the paper's


def _spy_figures(monkeypatch) -> dict:
    from matplotlib.figure import Figure

    seen: dict = {}
    original = Figure.savefig

    def spy(fig, path, *a, **k):
        seen[str(path).rsplit("/", 1)[-1]] = [(ax.get_xlabel(), ax.get_ylabel(), ax.get_title())
                                              for ax in fig.get_axes()]
        return original(fig, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", spy)
    return seen


def test_a_run_inside_stage_0_says_so_and_draws_the_planned_stages(tmp_path, digits8,
                                                                    monkeypatch, capsys):
    seen = _spy_figures(monkeypatch)
    cfg = MapaConfig(**SMALL, noise_multiplier=1.0)  # T_0 = 193 > 120 updates
    res = train(cfg, algorithms=("mapa", "audp"), out=tmp_path / "one")
    mapa = res["algorithms"]["mapa"]
    assert len(mapa["stages"]) == 1 and mapa["stages"][0]["length"] == 193
    note = mapa["stage_note"]
    assert "does not switch stage" in note and "T_0 = 193" in note and "the run 120" in note
    assert "MAPA is AUDP here" in note
    assert torch.equal(mapa["_model"], res["algorithms"]["audp"]["_model"])
    assert [s["index"] for s in mapa["stages_after_run"]] == [1, 2]
    body = json.loads((tmp_path / "one" / "report.json").read_text())
    assert body["algorithms"]["mapa"]["stage_note"] == note
    lines = [ln for ln in final_table(res).splitlines() if "does not switch" in ln]
    assert lines == [f"mapa: {note}"]  # one line
    # not three one-point panels: the clip against the update, the run's end marked
    ((x, y, title),) = seen["schedule.png"]
    assert x == "applied update $t$" and "clip" in y and "never left stage 0" in title
    # a noisier run switches stages within the run: no note, three panels per stage
    seen.clear()
    cfg = MapaConfig(**SMALL, noise_multiplier=3.0)
    res = train(cfg, algorithms=("mapa", "audp"), out=tmp_path / "many")
    mapa = res["algorithms"]["mapa"]
    assert len(mapa["stages"]) >= 3 and "stage_note" not in mapa
    assert [s["clip"] for s in mapa["stages"][:3]] == [1.0, 0.5, 0.25]
    assert not torch.equal(mapa["_model"], res["algorithms"]["audp"]["_model"])
    assert len(seen["schedule.png"]) == 3
    assert "for the step lr = 0.1" in seen["schedule.png"][2][1]
    # the Laplace modes say so too (their first clip is Theorem 3's, not AUDP's)
    laplace = run_algorithm("mapa", MapaConfig(**(SMALL | {"noise": "l2"})), dataset=digits8)
    assert "AUDP's fixed clip is 4" in laplace["stage_note"]
