"""Distributed DP in the synchronous trainers (``--privacy client --aggregation distributed``
in ``privkit train upcycled``; DP-FedAvg's ``--aggregation distributed`` in ``privkit train
dprec``).

The bugs feared most: a skipped round that is charged or released anyway (or a released one
not charged), charges that do not compose to the priced Skellam event, a ledger under the
wrong relation, residues that are not what the client's mechanism sends, a resume that counts
or charges twice, and flags accepted where they do not apply.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from scipy import stats

import privkit
from fl_examples.core.data import parse_dataset_spec
from fl_examples.core.distributed import (
    NOISE_STREAM,
    DistributedDpPlan,
    cohort_bound,
    default_min_survivors,
    distributed_plan,
    released_rate,
    rotation_seed,
    share_survivors,
)
from fl_examples.core.dp_modes import POPULATION, ClientDpPlan
from fl_examples.core.seeds import SeedTree
from fl_examples.dprec import DPRecConfig
from fl_examples.dprec import train as dprec_train
from fl_examples.upcycled import UpcycledConfig, final_table, run_algorithm
from privkit.cli import main
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.events.mechanisms import NeighboringRelation
from privkit.mechanisms import DISTRIBUTED_TRUST_ASSUMPTION
from privkit.mechanisms.distributed import center_modular

BASE = dict(dataset="synthetic:iid@40/40", local_epochs=1, batch_size=16, lr=0.1,
            device="cpu", stragglers=0.0, seed=3, mu=0.01, lam=0.04, privacy="client",
            aggregation="distributed", l2_clip_norm=1.0)


@pytest.fixture(scope="module")
def data():
    return parse_dataset_spec(BASE["dataset"], seed=3)


# --------------------------------------------------------------------------- the cohort
@pytest.mark.parametrize("n, p", [(2000, 0.05), (100, 0.3), (40, 0.5), (7, 0.9), (30, 1.0)])
def test_default_min_survivors_skips_at_most_one_round_in_a_hundred(n, p):
    k = default_min_survivors(n, p)
    assert stats.binom.cdf(k - 1, n, p) <= 0.01  # P(cohort < k) <= 1%
    if p < 1:
        assert stats.binom.cdf(k, n, p) > 0.01  # and k is the largest such
    else:
        assert k == n


def test_released_rate_is_the_conditional_inclusion_probability():
    """q' = P(client in the cohort | cohort >= n_min), checked by simulation."""
    rng = np.random.default_rng(0)
    n, p, k = 30, 0.2, 8
    coins = rng.random((200_000, n)) < p
    big = coins.sum(1) >= k
    freq = coins[big, 0].mean()
    q = released_rate(n, p, k)
    assert q > p and abs(freq - q) < 4 * np.sqrt(q * (1 - q) / big.sum())


def test_cohort_bound_is_exceeded_rarely():
    m = cohort_bound(2000, 0.05)
    assert stats.binom.sf(m, 2000, 0.05) <= 1e-9 < stats.binom.sf(m - 1, 2000, 0.05)
    assert cohort_bound(50, 1.0) == 50


# --------------------------------------------------------------------------- the plan
def _plan(**kw):
    args = dict(num_clients=20, client_rate=1.0, l2_clip_norm=1.0, dim=300, bits=16,
                rounds=5, delta=1e-5, noise_multiplier=1.0) | kw
    return distributed_plan(**args)[0]


def test_client_input_is_what_the_clients_mechanism_sends():
    """The residues the plan sums are ``mechanism().encode`` bit for bit (the same draws), and
    the unwrapped integers reduce to them."""
    plan = _plan()
    u = np.random.default_rng(1).normal(size=300) * 0.1
    seed = rotation_seed(SeedTree(0), 1)
    y, x = plan.client_input(3, u, rng=np.random.default_rng(9), rotation_seed=seed)
    direct = plan.mechanism().encode(u, rng=np.random.default_rng(9), rotation_seed=seed)
    assert np.array_equal(y, direct)
    assert np.array_equal(np.mod(x, 1 << 16).astype(np.uint64), direct)
    assert x.dtype == np.int64 and np.abs(x).max() < 1 << 40


def test_noise_multiplier_gives_the_sum_that_stddev_and_fits_the_bits():
    plan = _plan(noise_multiplier=2.0, min_survivors=15, colluders=3)
    sd = plan.granularity * np.sqrt(plan.honest_shares * plan.noise_per_client)
    assert sd == pytest.approx(2.0 * plan.l2_clip_norm, rel=1e-9)
    assert plan.noise_multiplier == pytest.approx(2.0) and plan.honest_shares == 12
    assert plan.wrap_bound <= 1e-6 * 1.01


def test_the_event_is_zero_out_and_refused_under_add_remove():
    plan = _plan()
    ev = privkit.SelfComposedDpEvent(plan.round_event(), 5)
    eps = privkit.epsilon(ev, 1e-5, neighboring_relation="zero-out").epsilon
    assert eps > 0 and plan.neighboring_relation == NeighboringRelation.REPLACE_SPECIAL
    with pytest.raises(UnsupportedEventError, match="ADD_OR_REMOVE_ONE"):
        privkit.epsilon(ev, 1e-5)


def test_a_wrapped_round_is_counted():
    """Too few bits for the noise: the decoded sum wraps and the simulation counts it."""
    plan = DistributedDpPlan(num_clients=4, client_rate=1.0, l2_clip_norm=1.0,
                             noise_per_client=1e6, granularity=1e-3, bits=8, dim=10,
                             min_survivors=4)
    w = {"w": torch.zeros(10)}
    state: dict = {}
    plan.release(w, {"w": torch.zeros(4, 10)}, state, sel=np.arange(4), data_round=1,
                 tree=SeedTree(0))
    assert state["distributed"] == {"released": 1, "skipped": 0, "wrapped": 1}


def test_a_skipped_round_releases_nothing():
    plan = _plan(min_survivors=5)
    w = {"w": torch.arange(300.0)}
    state: dict = {}
    new = plan.release(w, {"w": torch.ones(4, 300)}, state, sel=np.arange(4), data_round=1,
                       tree=SeedTree(0))
    assert torch.equal(new["w"], w["w"]) and state["distributed"]["skipped"] == 1
    assert plan.entries(1, np.arange(4)) == [] and len(plan.entries(1, np.arange(5))) == 1


def test_the_noise_share_is_the_clients_own_stream():
    """Each client's residues come from its own stream ``distributed-noise/<id>``: another
    client joining or leaving does not move them."""
    plan = _plan(client_rate=1.0)
    tree, seed = SeedTree(5), rotation_seed(SeedTree(5), 2)
    u = np.full(300, 0.01)
    alone = plan.client_input(7, u, rng=tree.numpy(2, f"{NOISE_STREAM}/7"), rotation_seed=seed)
    again = plan.client_input(7, u, rng=tree.numpy(2, f"{NOISE_STREAM}/7"), rotation_seed=seed)
    other = plan.client_input(8, u, rng=tree.numpy(2, f"{NOISE_STREAM}/8"), rotation_seed=seed)
    assert np.array_equal(alone[0], again[0]) and not np.array_equal(alone[0], other[0])


# --------------------------------------------------------------------------- runs
def test_run_charges_released_rounds_only_and_reports_the_model(data, tmp_path):
    """q = 0.3 of 40 clients with min_survivors 12: some rounds are skipped; the ledger holds
    exactly one zero-out charge per released round, priced as the plan's event."""
    cfg = UpcycledConfig(**BASE, client_rate=0.3, min_survivors=12, noise_multiplier=1.5,
                         bits=16, iterations=8)
    res = run_algorithm("fedavg", cfg, data, iterations=8, out=tmp_path)
    p = res["privacy"]
    assert p["skipped_rounds"] > 0 and p["charged_rounds"] == 8 - p["skipped_rounds"]
    lines = [json.loads(x) for x in (tmp_path / "ledger-fedavg.jsonl").read_text().splitlines()]
    head = next(x for x in lines if x.get("kind") not in ("spend",))
    assert "REPLACE_SPECIAL" in json.dumps(head)
    plan, _ = distributed_plan(num_clients=40, client_rate=0.3, l2_clip_norm=1.0,
                               dim=_dim(data), bits=16, rounds=8, delta=1e-5, min_survivors=12,
                               noise_multiplier=1.5)
    want = privkit.epsilon(privkit.SelfComposedDpEvent(plan.round_event(), p["charged_rounds"]),
                           1e-5, neighboring_relation="zero-out").epsilon
    assert p["epsilon_max"] == pytest.approx(want, rel=1e-9)
    assert p["trust"] == DISTRIBUTED_TRUST_ASSUMPTION
    assert p["neighboring_relation"].startswith("zero-out")
    assert p["released_rate"] == released_rate(40, 0.3, 12) > 0.3
    assert p["epsilon_unamplified"]["epsilon_every_round"] > p["epsilon_max"]
    assert p["epsilon_replace_one"] > p["epsilon_max"]
    for key in ("bits", "granularity", "noise_per_client", "min_survivors",
                "rounded_norm_bound_sq", "wrap_bound_per_round", "wrapped_rounds"):
        assert key in p, key
    assert p["wrapped_rounds"] == 0


def _dim(data) -> int:
    return data.num_features * data.num_classes + data.num_classes


def test_calibrated_every_client_every_round_meets_the_target(data):
    cfg = UpcycledConfig(**BASE, client_rate=1.0, noise_for_epsilon=3.0, iterations=5)
    res = run_algorithm("upcycled", cfg, data, iterations=5)
    p = res["privacy"]
    assert p["skipped_rounds"] == 0 and p["charged_rounds"] == 3
    assert p["epsilon_max"] <= 3.0 and p["epsilon_max"] == pytest.approx(3.0, rel=1e-6)
    assert p["released_rate"] == 1.0 and p["min_survivors"] == 40
    # no amplification: the epsilon holds against the server too
    assert p["epsilon_unamplified"]["epsilon_every_round"] == pytest.approx(p["epsilon_max"])
    text = final_table({"algorithms": {"upcycled": {**res, "iterations": 5, "data_rounds": 3}}})
    assert "distributed DP (secure aggregation" in text
    assert "assumes distributed DP: an honest-but-curious server" in text
    assert "every client in every round, no amplification" in text


def test_resume_counts_and_charges_once(data, tmp_path):
    cfg = UpcycledConfig(**BASE, client_rate=0.3, min_survivors=12, noise_multiplier=1.5,
                         bits=16, iterations=8, checkpoint_every=3)
    whole = run_algorithm("fedavg", cfg, data, iterations=8)
    run_algorithm("fedavg", cfg, data, iterations=8, out=tmp_path, stop_after=5)
    resumed = run_algorithm("fedavg", cfg, data, iterations=8, out=tmp_path, resume=True)
    for k in whole["model"]:
        assert torch.equal(whole["model"][k], resumed["model"][k]), k
    for key in ("charged_rounds", "skipped_rounds", "wrapped_rounds", "epsilon_max",
                "mean_noise_per_client", "mean_released_noise_multiplier"):
        assert resumed["privacy"][key] == whole["privacy"][key], key


def test_secure_noise_draws_each_share_from_the_os(data):
    cfg = UpcycledConfig(**BASE, client_rate=1.0, noise_multiplier=1.0, bits=12,
                         secure_noise=True, iterations=2)
    res = run_algorithm("fedavg", cfg, data, iterations=2)
    assert res["privacy"]["guarantee"] == "proven" and res["privacy"]["charged_rounds"] == 2


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("over, name", [
    (dict(mechanism="bandmf"), "aggregation"),
    (dict(adaptive_clip=0.5), "adaptive_clip"),
    (dict(aggregation="central", bits=16), "bits"),
    (dict(aggregation="central", min_survivors=3), "min_survivors"),
    (dict(aggregation="central", colluders=1), "colluders"),
    (dict(min_survivors=3, colluders=3), "colluders"),
    (dict(bits=63), "bits"),
    (dict(aggregation="secure"), "aggregation"),
    (dict(privacy="record"), "aggregation"),
])
def test_flags_that_do_not_apply_or_conflict_are_named(over, name):
    with pytest.raises(InvalidParameterError) as err:
        UpcycledConfig(**(BASE | {"iterations": 4} | over))
    assert err.value.name == name


def test_min_survivors_above_the_clients_is_named_before_a_ledger_exists(data, tmp_path):
    cfg = UpcycledConfig(**BASE, min_survivors=41, iterations=2)
    with pytest.raises(InvalidParameterError) as err:
        run_algorithm("fedavg", cfg, data, iterations=2, out=tmp_path)
    assert err.value.name == "min_survivors" and not list(tmp_path.iterdir())


def test_cli_refuses_in_one_line_naming_the_flag(tmp_path, capsys):
    code = main(["train", "upcycled", "--dataset", "synthetic:iid@40/40", "--privacy",
                 "client", "--aggregation", "distributed", "--mechanism", "bandmf",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "aggregation" in err[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("over, name", [
    (dict(aggregation="distributed", relation="add-remove"), "relation"),
    (dict(secagg_bits=16), "secagg_bits"),
])
def test_dprec_refusals_are_named(over, name):
    with pytest.raises(InvalidParameterError) as err:
        DPRecConfig(**over)
    assert err.value.name == name


def test_dprec_aggregation_without_dpfedavg_is_named():
    with pytest.raises(InvalidParameterError) as err:
        DPRecConfig(aggregation="distributed").resolved(("dprec",))
    assert err.value.name == "aggregation"


def test_dprec_dpfedavg_distributed_run(tmp_path):
    cfg = DPRecConfig(dataset="digits", clients=20, rounds=3, epsilon=4.0, client_rate=1.0,
                      aggregation="distributed", secagg_bits=16, local_epochs=1,
                      eval_every=3, device="cpu")
    res = dprec_train(cfg, compare=(), out=tmp_path, algorithm="dpfedavg")
    p = res["algorithms"]["dpfedavg"]["privacy"]
    assert p["relation"] == "zero-out" and p["aggregation"] == "distributed"
    assert p["epsilon_central"] == pytest.approx(4.0, rel=1e-6) and p["epsilon_central"] <= 4
    assert p["epsilon_ledger"] == pytest.approx(p["epsilon_central"], rel=1e-9)
    assert p["trust_assumption"] == DISTRIBUTED_TRUST_ASSUMPTION
    comm = res["algorithms"]["dpfedavg"]["communication"]
    assert comm["uplink_bits"] == 3 * 20 * 16 * 1024  # bits per rotated coordinate
    lines = (tmp_path / "ledger-dpfedavg.jsonl").read_text().splitlines()
    assert sum(json.loads(x).get("kind") == "spend" for x in lines) == 3
    assert POPULATION in lines[-1]


def test_the_cohort_is_dp_fedavgs():
    """Distributed and central DP-FedAvg sample the same clients (the same coins)."""
    plan = _plan(client_rate=0.3)
    central = ClientDpPlan(20, 0.3, 1.0, 1.0)
    tree = SeedTree(4)
    for r in range(1, 6):
        assert np.array_equal(plan.select(tree, r), central.select(tree, r))


def test_the_secure_sum_is_the_unwrapped_sum_modulo_2_bits():
    """What the server decodes (the secure sum, centred) is the clients' noisy integer sum
    when it does not wrap: the wrap diagnostic compares the right numbers."""
    plan = _plan(min_survivors=3)
    rng = np.random.default_rng(2)
    seed = rotation_seed(SeedTree(1), 1)
    ys, xs = zip(*(plan.client_input(c, rng.normal(size=300) * 0.1,
                                     rng=np.random.default_rng(c), rotation_seed=seed)
                   for c in range(3)))
    total = plan.mechanism().secure_sum(list(ys))
    assert np.array_equal(center_modular(total, 16), np.sum(xs, axis=0))


# --------------------------------------------------------------------------- shares scaled
# to the cohort (``dropout_tolerance`` f): a released round of n clients adds shares for
# s(n) = max(n_min, ceil((1 - f) n)) survivors; nothing priced changes.
@pytest.mark.parametrize("f, n, n_min, want", [
    (0.0, 100, 78, 100), (0.1, 100, 78, 90), (0.1, 10, 5, 9), (0.5, 100, 78, 78),
    (1.0, 100, 78, 78), (0.0, 78, 78, 78), (0.2, 100, 78, 80), (1.0, 163, 78, 78)])
def test_share_survivors_is_max_n_min_ceil_1_minus_f_n(f, n, n_min, want):
    assert share_survivors(n, n_min, f) == want
    if n_min == 78:  # the plan's (2000 clients at q 0.05: the default n_min is 78)
        plan = _plan(num_clients=2000, client_rate=0.05, dropout_tolerance=f)
        assert plan.min_survivors == 78 and plan.share_survivors(n) == want


@pytest.mark.parametrize("f", [0.0, 0.05, 0.37, 0.9, 1.0])
@pytest.mark.parametrize("k", [0, 1, 7])
def test_any_share_survivors_hold_the_priced_variance(f, k):
    plan = _plan(num_clients=200, client_rate=0.5, colluders=k, dropout_tolerance=f)
    mu, h = plan.noise_per_client, plan.honest_shares
    for n in range(plan.min_survivors, 200 + 1):
        s, share = plan.share_survivors(n), plan.noise_share(n)
        assert plan.min_survivors <= s <= n and 0 < share <= mu
        assert (s - k) * share >= h * mu  # exactly, in floating point
        assert share == pytest.approx(mu * h / (s - k), rel=1e-15)
        if f == 1.0:
            assert share == mu


def _release_sum(plan, n, *, data_round=2, seed=11):
    """The modular sum the server decodes in one released round of clients 0..n-1, and the
    new model."""
    from privkit.mechanisms.distributed import DistributedSkellam

    seen = []
    real = DistributedSkellam.decode

    def decode(self, s, **kw):
        seen.append(np.asarray(s).copy())
        return real(self, s, **kw)

    g = torch.Generator().manual_seed(0)
    w = {"a": torch.zeros(plan.dim - 7), "b": torch.zeros(7)}
    local = {k: 0.2 * torch.randn(n, *v.shape, generator=g) for k, v in w.items()}
    state: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DistributedSkellam, "decode", decode)
        new = plan.release(w, local, state, sel=np.arange(n), data_round=data_round,
                           tree=SeedTree(seed))
    return seen[0], new, state, local, w


def test_f_1_reproduces_the_fixed_share_encodings_bit_for_bit():
    """f = 1: every client adds mu, as before the shares were scaled: the secure sum of a
    round of 6 > n_min = 3 clients is the one the fixed-share plan produced (digests recorded
    before the change), and is each client's ``mechanism().encode`` from its own stream."""
    import hashlib

    plan = DistributedDpPlan(num_clients=6, client_rate=1.0, l2_clip_norm=1.0,
                             noise_per_client=50.0, granularity=0.01, bits=16, dim=40,
                             min_survivors=3, dropout_tolerance=1.0)
    total, new, _, local, w = _release_sum(plan, 6)
    assert hashlib.sha256(total.astype("<u8").tobytes()).hexdigest() == (
        "8d2ec809ccb0d2abcd1d9c251a69117331559fb30de4eb31e9d30ca35bc33720")
    assert hashlib.sha256(b"".join(new[k].numpy().astype("<f4").tobytes()
                                   for k in new)).hexdigest() == (
        "c86eb192188fc1e701e87d08a336b8d66bcfcde1605ca694bdc1a903a88671b6")
    tree, seed = SeedTree(11), rotation_seed(SeedTree(11), 2)
    rows = [plan.mechanism().encode(np.concatenate([(local[k][c] - w[k]).double().numpy()
                                                    for k in w]),
                                    rng=tree.numpy(2, f"{NOISE_STREAM}/{c}"),
                                    rotation_seed=seed) for c in range(6)]
    assert np.array_equal(total, plan.mechanism().secure_sum(rows))
    # f = 0 scales the same clients' shares (mu / 2 each: shares for 6 survivors)
    scaled, _, state, _, _ = _release_sum(dataclasses.replace(plan, dropout_tolerance=0.0), 6)
    assert not np.array_equal(scaled, total)
    assert state["distributed_shares"] == {
        "shares": 6, "variance": pytest.approx(6 * 25.0),
        "released_z": pytest.approx(0.01 * np.sqrt(150.0))}


def test_the_share_changes_only_the_skellam_parameter_of_the_clients_own_stream():
    """A client's residues in a round of n clients are the share mechanism's encoding from its
    own stream: the rounding coins (drawn first) are the fixed-share encoding's, and adding
    or zeroing another client never moves them (n is the same under zero-out)."""
    plan = _plan(num_clients=20, client_rate=0.5, min_survivors=5)
    tree, seed = SeedTree(5), rotation_seed(SeedTree(5), 2)
    u = np.random.default_rng(3).normal(size=300) * 0.05
    ours = plan.client_input(7, u, rng=tree.numpy(2, f"{NOISE_STREAM}/7"), rotation_seed=seed,
                             cohort=12)
    again = plan.share_mechanism(12, 62).encode(u, rng=tree.numpy(2, f"{NOISE_STREAM}/7"),
                                                rotation_seed=seed)
    assert np.array_equal(ours[0], again & np.uint64((1 << 16) - 1))
    assert plan.share_mechanism(12).noise_per_client == plan.noise_share(12)
    quiet = [dataclasses.replace(m, _noise=False).encode(u, rng=tree.numpy(
        2, f"{NOISE_STREAM}/7"), rotation_seed=seed)
        for m in (plan.mechanism(), plan.share_mechanism(12))]
    assert np.array_equal(*quiet)


def test_a_round_below_its_share_survivors_is_refused():
    plan = _plan(num_clients=40, client_rate=0.5, min_survivors=10, dropout_tolerance=0.25)
    assert plan.share_survivors(20) == 15
    assert plan.check_survivors(20, 15) == 15 and plan.check_survivors(20, 20) == 20
    with pytest.raises(InvalidParameterError) as err:
        plan.check_survivors(20, 14)
    assert err.value.name == "survivors"


def test_f_0_and_f_1_charge_the_same_ledger_and_epsilon(data, tmp_path):
    """The ledger's charges, the skipped rounds and the epsilon are the same at f = 0 and
    f = 1 (same seed): only the released sums' noise differs, lower at f = 0."""
    res, spends = {}, {}
    for f in (0.0, 1.0):
        cfg = UpcycledConfig(**BASE, client_rate=0.3, min_survivors=12, noise_multiplier=1.5,
                             bits=16, iterations=8, dropout_tolerance=f)
        out = tmp_path / str(f)
        res[f] = run_algorithm("fedavg", cfg, data, iterations=8, out=out)
        lines = [json.loads(x) for x in (out / "ledger-fedavg.jsonl").read_text().splitlines()]
        spends[f] = [{k: v for k, v in x.items() if k in ("event", "round", "clients",
                                                          "count", "kind")}
                     for x in lines if x.get("kind") == "spend"]
    a, b = res[0.0]["privacy"], res[1.0]["privacy"]
    assert spends[0.0] == spends[1.0] and len(spends[0.0]) == a["charged_rounds"] > 0
    for key in ("epsilon_max", "epsilon_replace_one", "charged_rounds", "skipped_rounds",
                "noise_per_client", "noise_multiplier", "min_survivors", "released_rate",
                "granularity", "wrap_bound_per_round"):
        assert a[key] == b[key], key
    assert a["epsilon_unamplified"] == b["epsilon_unamplified"]
    assert a["dropout_tolerance"] == 0.0 and b["dropout_tolerance"] == 1.0
    assert b["mean_noise_per_client"] == pytest.approx(b["noise_per_client"])
    assert a["mean_noise_per_client"] < b["mean_noise_per_client"]
    assert a["mean_released_noise_multiplier"] == pytest.approx(a["noise_multiplier"])
    assert b["mean_released_noise_multiplier"] > 1.05 * b["noise_multiplier"]
    assert "shares scaled to the cohort" in final_table(
        {"algorithms": {"fedavg": {**res[0.0], "iterations": 8, "data_rounds": 8}}})


@pytest.mark.parametrize("f", [-0.1, 1.5, float("nan"), float("inf"), "0.5", True])
def test_dropout_tolerance_outside_0_1_is_named(f):
    with pytest.raises(InvalidParameterError) as err:
        UpcycledConfig(**(BASE | {"iterations": 4, "dropout_tolerance": f}))
    assert err.value.name == "dropout_tolerance"
    with pytest.raises(InvalidParameterError) as err:
        DPRecConfig(aggregation="distributed", dropout_tolerance=f)
    assert err.value.name == "dropout_tolerance"
    with pytest.raises(InvalidParameterError) as err:
        _plan(dropout_tolerance=f)
    assert err.value.name == "dropout_tolerance"


@pytest.mark.parametrize("over", [dict(aggregation="central"), dict(privacy="record",
                                                                     aggregation=None),
                                  dict(privacy="output", aggregation=None)])
def test_dropout_tolerance_without_distributed_aggregation_is_named(over):
    with pytest.raises(InvalidParameterError) as err:
        UpcycledConfig(**(BASE | {"iterations": 4, "dropout_tolerance": 0.5} | over))
    assert err.value.name == "dropout_tolerance"
    with pytest.raises(InvalidParameterError) as err:
        DPRecConfig(dropout_tolerance=0.5)
    assert err.value.name == "dropout_tolerance"


def test_dropout_tolerance_defaults_to_0_in_the_trainers():
    assert UpcycledConfig(**(BASE | {"iterations": 4})).dropout_tolerance == 0.0
    cfg = DPRecConfig(aggregation="distributed").resolved(("dpfedavg",))
    assert cfg.dropout_tolerance == 0.0


@pytest.mark.parametrize("trainer, extra", [
    ("upcycled", ["--privacy", "client", "--dataset", "synthetic:iid@40/40"]),
    ("dprec", ["--algorithms", "dpfedavg"])])
@pytest.mark.parametrize("value, aggregation", [("nan", "distributed"), ("2", "distributed"),
                                                ("0.5", "central")])
def test_cli_refuses_dropout_tolerance_in_one_line(trainer, extra, value, aggregation,
                                                   tmp_path, capsys):
    code = main(["train", trainer, *extra, "--aggregation", aggregation,
                 "--dropout-tolerance", value, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--dropout-tolerance" in err[0], err
    assert not (tmp_path / "o").exists()


def test_the_wrap_bound_for_fixed_shares_covers_the_scaled_ones():
    """The plan's wrap-around bound assumes every client of the cohort bound adds mu; a
    cohort's scaled shares (mu_n <= mu) have a smaller bound at every cohort size up to it."""
    from privkit.accountants.distributed import wraparound_probability

    plan = _plan(num_clients=2000, client_rate=0.05, bits=14, noise_multiplier=0.5)
    m = plan.mechanism()
    fixed = plan.wrap_bound
    for n in range(plan.min_survivors, plan.cohort_bound + 1, 5):
        scaled = wraparound_probability(clients=n, noise_per_client=plan.noise_share(n),
                                        scaled_clip=m.scaled_clip, padded_dim=m.padded_dim,
                                        bits=14)
        assert scaled <= wraparound_probability(
            clients=n, noise_per_client=plan.noise_per_client, scaled_clip=m.scaled_clip,
            padded_dim=m.padded_dim, bits=14) <= fixed
