"""Coupling entries of distributed DP (``--privacy client --aggregation distributed`` in
``privkit train upcycled``, ``--aggregation distributed`` for DP-FedAvg in ``privkit train
dprec``), and the test that the decoded sum carries the priced noise.

**The release point** is what secure aggregation reveals before the noise: the sum of the
clients' clipped, rotated, scaled and rounded updates, in integer units (before the server
unscales it), recorded at :meth:`privkit.mechanisms.DistributedSkellam.decode`. Each client's
row is computed at :meth:`fl_examples.core.distributed.DistributedDpPlan.client_input` by
encoding the same update without the noise share from a copy of the client's generator (the
rounding coins are drawn before the noise, so the copy draws the same coins). **Relation:**
zero-out, the plan's: D' turns the target's data away and its update becomes the null update
at the client (the target keeps its place, its coins and its noise share); **bound** the
rounded norm bound ``Delta_2 = sqrt(T)`` the ledger prices. No public constant moves under
zero-out (N, q, the divisor q N, the noise and the grid are the same on D and D'), so nothing
is pinned. The decoded release is coupled (D' continues from D's model).

The noise test runs the plan's round on fixed updates, reads the modular sum the server
decodes, subtracts the clients' noiseless rounded rows (recomputed from their own seed-tree
streams) and checks the remainder against ``Skellam(n mu_n)`` (n the clients in the sum, each
adding the share for its cohort, ``mu_n = mu (n_min - k) / (s(n) - k)``; the priced variance
is ``(n_min - k) mu``) with a chi-square test on the exact pmf; three wrong noise draws fail
the same test.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from scipy import stats

import fl_examples.upcycled.privacy as up_privacy
from fl_examples.core.distributed import (
    NOISE_STREAM,
    DistributedDpPlan,
    rotation_seed,
)
from fl_examples.core.dp_modes import ClientDpPlan
from fl_examples.core.rounds import independent_straggler_epochs
from fl_examples.core.seeds import SeedTree
from fl_examples.dprec import DPRecConfig
from fl_examples.dprec import run_algorithm as dprec_run
from fl_examples.dprec.config import relation_of
from fl_examples.upcycled import UpcycledConfig, run_algorithm
from privkit.mechanisms import distributed as dist_module
from privkit.mechanisms.distributed import MAX_BITS, DistributedSkellam, center_modular

from .harness import (
    D2,
    ZERO_OUT,
    Entry,
    Tap,
    assert_coupled,
    check,
    coupling_tests,
    federated,
    opposite,
    toy_clients,
)

POINT = "DistributedSkellam.decode"


def spy_distributed(mp: pytest.MonkeyPatch, tap: Tap, target: int) -> None:
    """The release point of the module docstring: each client's noiseless rounded row at
    ``client_input`` (D': the target's update zeroed), the round's sum recorded at
    ``decode`` with bound Delta_2, the decoded mean coupled."""
    real_release = DistributedDpPlan.release
    real_input = DistributedDpPlan.client_input
    real_decode = DistributedSkellam.decode

    def release(self: Any, w: Any, local: Any, state: Any, generator: Any = None, *,
                sel: Any, data_round: int, tree: Any, secure: Any = None,
                canaries: Any = None) -> Any:
        assert canaries is None  # an audit run's canary rows are no client's: not coupled
        tap.ctx.update(ids=[int(c) for c in sel], round=data_round, rows={})
        return real_release(self, w, local, state, generator, sel=sel, data_round=data_round,
                            tree=tree, secure=secure)

    def client_input(self: Any, client: int, update: Any, *, rng: Any,
                     rotation_seed: int, cohort: Any = None) -> Any:
        if tap.replaying and client == target:  # zero-out: the null update, the same share
            update = np.zeros_like(update)
        # the round's share (scaled to the cohort, the same on D and D') never moves the
        # rounding coins, drawn before it: the noiseless row is the plan's encoder's
        quiet = dataclasses.replace(self.share_mechanism(cohort, MAX_BITS), _noise=False)
        row = quiet.encode(update, rng=copy.deepcopy(rng), rotation_seed=rotation_seed)
        tap.ctx["rows"][client] = center_modular(row, MAX_BITS)
        return real_input(self, client, update, rng=rng, rotation_seed=rotation_seed,
                          cohort=cohort)

    def decode(self: Any, modular_sum: Any, *, survivors: int, divisor: float,
               rotation_seed: int, like: Any = None) -> Any:
        ids, rows = tap.ctx["ids"], tap.ctx["rows"]
        assert list(rows) == ids and survivors == len(ids)
        pre = np.sum([rows[c] for c in ids], axis=0)
        tap.record(POINT, pre, self.sensitivities[0], key=(tap.ctx["round"],),
                   target=target in ids, rows=dict(rows))
        return tap.couple(POINT, lambda: real_decode(
            self, modular_sum, survivors=survivors, divisor=divisor,
            rotation_seed=rotation_seed, like=like))

    mp.setattr(DistributedDpPlan, "release", release)
    mp.setattr(DistributedDpPlan, "client_input", client_input)
    mp.setattr(DistributedSkellam, "decode", decode)


def _clients(s: dict[str, Any], tap: Tap) -> list[tuple[np.ndarray, np.ndarray]]:
    sizes = [int(n) for n in np.random.default_rng(s["data"]).integers(5, 10, s["clients"])]
    base = toy_clients(s["data"], sizes)
    tap.target = s["target"] % len(base)
    clients = list(base)
    if tap.side == D2:
        clients[tap.target] = opposite(base[tap.target])
    return clients


# ------------------------------------------------------------------------- upcycled
UPCYCLED = st.fixed_dictionaries({
    "algorithm": st.sampled_from(["fedavg", "fedprox", "upcycled"]),
    "clients": st.integers(2, 4), "q": st.sampled_from([0.5, 0.8, 1.0]),
    "clip": st.sampled_from([0.05, 0.5, 5.0]), "bits": st.sampled_from([12, 16, 20]),
    "min_survivors": st.sampled_from([1, 2]), "stragglers": st.sampled_from([0.0, 0.5]),
    "target": st.integers(0, 3), "seed": st.integers(0, 10_000),
    "data": st.integers(0, 10_000), "iterations": st.integers(3, 4)}).filter(
    lambda s: _released(s) > 0)


def _released(s: dict[str, Any]) -> int:
    """Data rounds of setting ``s`` whose sum would be released (the sample alone decides;
    a setting in which every round is skipped releases nothing to compare)."""
    tree = SeedTree(s["seed"])
    rounds = (s["iterations"] + 1) // 2 if s["algorithm"] == "upcycled" else s["iterations"]
    n_min = min(s["min_survivors"], s["clients"])
    out = 0
    for r in range(1, rounds + 1):
        sel = ClientDpPlan(s["clients"], s["q"], 1.0, 1.0).select(tree, r)
        if s["algorithm"] == "fedavg":
            _, strag = independent_straggler_epochs(tree, r, sel, s["stragglers"], 2)
            sel = sel[~strag]
        out += int(len(sel) >= n_min)
    return out


def upcycled_config(s: dict[str, Any]) -> UpcycledConfig:
    return UpcycledConfig(
        dataset="coupling", local_epochs=2, batch_size=4, lr=0.5, seed=s["seed"],
        iterations=s["iterations"], device="cpu", eval_every=s["iterations"],
        privacy="client", aggregation="distributed", client_rate=s["q"],
        l2_clip_norm=s["clip"], noise_multiplier=1.0, bits=s["bits"],
        min_survivors=min(s["min_survivors"], s["clients"]), stragglers=s["stragglers"])


def run_upcycled(s: dict[str, Any], tap: Tap) -> None:
    """Upcycled-FL, FedProx or FedAvg with distributed DP (module docstring); FedAvg drops
    its stragglers before the sum; a round below ``min_survivors`` is skipped alike on D and
    D' (the coins are the same)."""
    clients = _clients(s, tap)
    with pytest.MonkeyPatch.context() as mp:
        spy_distributed(mp, tap, tap.target)
        run_algorithm(s["algorithm"], upcycled_config(s), federated(clients),
                      iterations=s["iterations"])


def upcycled_stated(s: dict[str, Any]) -> Any:
    ds = federated(toy_clients(s["data"], [6] * s["clients"]))
    plan, _ = up_privacy._privacy_plan(s["algorithm"], upcycled_config(s), ds, s["iterations"])
    assert isinstance(plan, DistributedDpPlan)
    return plan.neighboring_relation


UPCYCLED_WITNESS = {"algorithm": "fedavg", "clients": 3, "q": 1.0, "clip": 0.5, "bits": 16,
                    "min_survivors": 2, "stragglers": 0.0, "target": 0, "seed": 0, "data": 0,
                    "iterations": 3}


# ------------------------------------------------------------------------- dprec
DPREC = st.fixed_dictionaries({
    "clients": st.integers(3, 5), "q": st.sampled_from([0.5, 1.0]),
    "clip": st.sampled_from([0.05, 0.5, 5.0]), "bits": st.sampled_from([14, 20]),
    "target": st.integers(0, 4), "rounds": st.integers(2, 3),
    "seed": st.integers(0, 10_000), "data": st.integers(0, 10_000)})


def dprec_config(s: dict[str, Any]) -> DPRecConfig:
    return DPRecConfig(dataset="coupling", clients_per_round=1, rounds=s["rounds"],
                       l2_clip=s["clip"], local_epochs=2, batch_size=4, lr=0.5,
                       seed=s["seed"], device="cpu", eval_every=s["rounds"],
                       client_rate=s["q"], aggregation="distributed",
                       secagg_bits=s["bits"], min_survivors=1)


def run_dprec(s: dict[str, Any], tap: Tap) -> None:
    """DP-FedAvg in ``privkit train dprec`` with ``--aggregation distributed``: the same
    release point, relation and bound."""
    clients = _clients(s, tap)
    with pytest.MonkeyPatch.context() as mp:
        spy_distributed(mp, tap, tap.target)
        dprec_run("dpfedavg", dprec_config(s), federated(clients), z=1.0)


ENTRIES = [
    Entry("upcycled-client-distributed", ZERO_OUT, UPCYCLED, run_upcycled, upcycled_stated,
          UPCYCLED_WITNESS),
    Entry("dprec-dpfedavg-distributed", ZERO_OUT, DPREC, run_dprec,
          lambda s: relation_of(dprec_config(s), "dpfedavg"),
          {"clients": 3, "q": 1.0, "clip": 0.5, "bits": 20, "target": 1, "rounds": 2,
           "seed": 0, "data": 0}),
]

test_coupling, test_witness_sees_the_target = coupling_tests(ENTRIES)


def test_a_target_update_beyond_the_clip_still_moves_the_sum_by_at_most_delta_2() -> None:
    """The bound the ledger prices is the rounded norm bound, not C: with C = 5 and the
    target's data turned away its clipped update has norm near C / gamma, and the rounded row
    can exceed it; what is checked is Delta_2 = sqrt(T), which the conditional rounding
    enforces (and which is above C / gamma)."""
    s = UPCYCLED_WITNESS | {"clip": 5.0, "q": 1.0, "iterations": 3}
    rep = assert_coupled(ENTRIES[0], s)
    moved = max(rep.moved())
    bound = rep.d[0].bound
    plan, _ = up_privacy._privacy_plan("fedavg", upcycled_config(s),
                                       federated(toy_clients(0, [6, 6, 6])), 3)
    scaled = plan.l2_clip_norm / plan.granularity
    assert bound > scaled and 0 < moved <= bound * (1 + 1e-12)


# ------------------------------------------------------------------------- the noise
def _noise_samples(plan: DistributedDpPlan, rounds: int, clients: int, *, seed: int = 0
                   ) -> np.ndarray:
    """The noise of the decoded sum in integer units, over ``rounds`` rounds of the plan's
    release on fixed updates: the modular sum the server decodes, minus the clients'
    noiseless rounded rows recomputed from their own streams, centred."""
    tree = SeedTree(seed)
    rng = np.random.default_rng(seed + 1)
    w = {"a": torch.zeros(plan.dim - 7, dtype=torch.float32),
         "b": torch.zeros(7, dtype=torch.float32)}
    local = {k: torch.as_tensor(0.3 * rng.normal(size=(clients, *v.shape)), dtype=v.dtype)
             for k, v in w.items()}
    sel = np.arange(clients)
    seen: list[np.ndarray] = []
    real_decode = DistributedSkellam.decode

    def decode(self: Any, modular_sum: Any, **kw: Any) -> Any:
        seen.append(np.asarray(modular_sum).copy())
        return real_decode(self, modular_sum, **kw)

    out = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DistributedSkellam, "decode", decode)
        for r in range(1, rounds + 1):
            plan.release(w, local, {}, sel=sel, data_round=r, tree=tree)
            quiet = dataclasses.replace(plan.mechanism(), _noise=False)
            seed_r = rotation_seed(tree, r)
            rows = [quiet.encode(np.concatenate([local[k][j].double().numpy().reshape(-1)
                                                 for k in w]),
                                 rng=tree.numpy(r, f"{NOISE_STREAM}/{j}"),
                                 rotation_seed=seed_r).astype(np.int64) for j in sel]
            m = 1 << int(plan.bits)
            z = (seen[-1].astype(np.int64) - np.sum(rows, axis=0)) % m
            out.append(center_modular(z.astype(np.uint64), int(plan.bits)))
    return np.concatenate(out)


def _chi_square_p(z: np.ndarray, variance: float) -> float:
    """p-value of a chi-square test of ``z`` against Skellam(variance): the exact pmf on the
    integers, tails pooled where the expected count falls below 20."""
    lam = variance / 2.0
    dist = stats.skellam(lam, lam)
    lo, hi = int(dist.ppf(1e-4)), int(dist.ppf(1 - 1e-4))
    edges = np.arange(lo, hi + 1)
    probs = dist.pmf(edges)
    probs[0] += dist.cdf(lo - 1)
    probs[-1] += dist.sf(hi)
    counts = np.array([np.sum(np.clip(z, lo, hi) == v) for v in edges], dtype=np.float64)
    expected = probs * len(z)
    keep = expected >= 20
    obs = np.concatenate([counts[keep], [counts[~keep].sum()]])
    exp = np.concatenate([expected[keep], [expected[~keep].sum()]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


#: Three clients, a small noise share (Skellam(1) each: far from a Gaussian), 2048 rotated
#: coordinates, 8 rounds: 16384 draws of the sum's noise.
NOISE_PLAN = DistributedDpPlan(num_clients=3, client_rate=1.0, l2_clip_norm=1.0,
                               noise_per_client=1.0, granularity=0.05, bits=16, dim=2000,
                               min_survivors=3)


def test_the_decoded_sum_carries_skellam_n_mu_and_the_priced_noise() -> None:
    plan = NOISE_PLAN
    z = _noise_samples(plan, rounds=8, clients=3)
    n_mu = 3 * plan.noise_per_client
    assert z.size == 8 * plan.padded_dim
    assert abs(z.mean()) < 4 * np.sqrt(n_mu / z.size)
    assert np.var(z) == pytest.approx(n_mu, rel=0.05)
    assert _chi_square_p(z, n_mu) > 1e-3
    # what the ledger prices: (n_min - k) shares of mu, all present in the sum
    ev = plan.round_event()
    assert ev.central_variance == pytest.approx(n_mu) and ev.survivors == 3


@pytest.mark.parametrize("f, n_min, k, clients, per_share", [
    (0.0, 2, 0, 4, 0.5),     # s(4) = 4: 4 shares of mu / 2, n_min mu in all
    (0.0, 3, 1, 5, 0.5),     # s(5) = 5: (n_min - k) mu / (s - k) = mu / 2 each
    (0.5, 2, 0, 5, 2 / 3),   # s(5) = max(2, ceil(2.5)) = 3: 2 mu / 3 each
    (1.0, 2, 0, 4, 1.0),     # s(n) = n_min: every client adds mu (the fixed-share protocol)
])
def test_shares_scaled_to_the_cohort_carry_the_priced_noise(f: float, n_min: int, k: int,
                                                            clients: int,
                                                            per_share: float) -> None:
    """A released round of n > n_min clients: each adds Skellam(mu_n), mu_n = mu (n_min - k) /
    (s(n) - k); the decoded sum's noise is Skellam(n mu_n) (the chi-square test above), and
    its honest part (s(n) - k) mu_n is the priced (n_min - k) mu: at f = 0 with no colluders
    the sum carries exactly n_min mu, not n mu."""
    plan = dataclasses.replace(NOISE_PLAN, num_clients=clients, min_survivors=n_min,
                               colluders=k, dropout_tolerance=f)
    mu = plan.noise_per_client
    s = plan.share_survivors(clients)
    assert plan.noise_share(clients) == pytest.approx(per_share * mu, rel=1e-12)
    assert (s - k) * plan.noise_share(clients) >= (n_min - k) * mu
    z = _noise_samples(plan, rounds=8, clients=clients)
    total = clients * plan.noise_share(clients)
    assert np.var(z) == pytest.approx(total, rel=0.05)
    assert _chi_square_p(z, total) > 1e-3
    if f == 0.0 and k == 0:  # exactly the priced variance, not n mu
        assert total == pytest.approx(n_min * mu, rel=1e-12)
        assert _chi_square_p(z, clients * mu) < 1e-6
    # the ledger's event: (n_min - k) shares of mu, whatever f
    ev = plan.round_event()
    assert ev.noise_per_client == mu and ev.survivors == n_min - k
    assert ev == dataclasses.replace(plan, dropout_tolerance=1.0).round_event()


@pytest.mark.parametrize("wrong", ["one share", "half noise", "rounded gaussian"])
def test_a_wrong_noise_share_fails_the_same_test(wrong: str) -> None:
    """The test above has power: a sum with only one client's share, shares of half the
    variance, or rounded Gaussian shares of the right variance (not Skellam) are rejected."""
    real = dist_module.skellam_noise
    calls = {"n": 0}

    def noise(size: int, mu: float, *, rng: Any) -> np.ndarray:
        calls["n"] += 1
        if wrong == "one share":
            return real(size, mu, rng=rng) if calls["n"] % 3 == 1 else np.zeros(size, np.int64)
        if wrong == "half noise":
            return real(size, mu / 2, rng=rng)
        gen = np.random.default_rng(rng.integers(2**63))
        return np.rint(gen.normal(scale=np.sqrt(mu), size=size)).astype(np.int64)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist_module, "skellam_noise", noise)
        z = _noise_samples(NOISE_PLAN, rounds=8, clients=3)
    assert _chi_square_p(z, 3 * NOISE_PLAN.noise_per_client) < 1e-6


def test_clients_clipping_to_more_than_the_priced_norm_are_detected() -> None:
    """A planted bug: the clients encode with ten times the clip norm the ledger prices (the
    plan's client path builds its own mechanism). The target's row then exceeds Delta_2 and
    the coupling fails; the plan as shipped passes on the same setting."""
    real = DistributedDpPlan.mechanism

    def mechanism(self: Any, bits: Any = None) -> Any:
        m = real(self, bits)
        return dataclasses.replace(m, l2_clip_norm=10 * m.l2_clip_norm) if bits else m

    def bugged(s: dict[str, Any], tap: Tap) -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(DistributedDpPlan, "mechanism", mechanism)
            run_upcycled(s, tap)

    setting = UPCYCLED_WITNESS | {"clip": 0.05}
    report = check(Entry("wide-clip", ZERO_OUT, None, bugged), setting)
    worst = max(report.sensitivity_violations(), key=lambda v: v.measured / v.bound)
    assert worst.measured > 2 * worst.bound
    assert_coupled(ENTRIES[0], setting)
