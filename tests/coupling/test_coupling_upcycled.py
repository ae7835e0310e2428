"""Coupling entries of ``privkit train upcycled`` (Upcycled-FL, FedProx, FedAvg): client-level
DP-FedAvg (Poisson, adaptive clipping, stragglers), banded MF under each participation,
record-level DP-SGD and output perturbation. Every run is a tiny logistic regression (4
features, 2 classes, 2-5 clients of 5-9 records, 2-4 iterations) built by hand."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

import fl_examples.upcycled.privacy as up_privacy
from fl_examples.core.banded import BandedDpPlan
from fl_examples.core.dp_modes import ClientDpPlan, RecordDpPlan
from fl_examples.core.privacy import PrivacyPlan, clip_features
from fl_examples.upcycled import UpcycledConfig, run_algorithm
from fl_examples.upcycled.run import _Run
from privkit.mechanisms import gaussian as gaussian_module
from privkit.mechanisms.aggregate import ClientLevelGaussian
from privkit.mechanisms.bandmf import BandMF
from privkit.mechanisms.gaussian import GaussianOutputPerturbation

from .harness import (
    ADD_REMOVE,
    D2,
    REPLACE_ONE,
    ZERO_OUT,
    Entry,
    Tap,
    Violation,
    coupling_tests,
    federated,
    opposite,
    pin,
    replaced_record,
    spy_adaptive_count,
    spy_client_sum,
    spy_clients_dpsgd,
    toy_clients,
    with_record,
)

ALGORITHMS = ("fedavg", "fedprox", "upcycled")


def _sizes(s: dict[str, Any]) -> list[int]:
    rng = np.random.default_rng(s["data"])
    return [int(n) for n in rng.integers(5, 10, s["clients"])]


def track_selection(mp: pytest.MonkeyPatch, tap: Tap) -> None:
    """The round's contributors: ``_Run._selection``'s clients (after FedAvg drops its
    stragglers), in row order (sorted ids), and the data round."""
    real = _Run._selection

    def selection(self: Any, r: int) -> Any:
        out = real(self, r)
        tap.ctx["ids"], tap.ctx["round"] = [int(c) for c in out[0]], r
        return out

    mp.setattr(_Run, "_selection", selection)


def _config(s: dict[str, Any], **kw: Any) -> UpcycledConfig:
    base = dict(dataset="coupling", local_epochs=2, batch_size=4, lr=0.5, seed=s["seed"],
                iterations=s["iterations"], device="cpu", eval_every=s["iterations"])
    return UpcycledConfig(**(base | kw))


# ------------------------------------------------------------------------- client level
CLIENT = st.fixed_dictionaries({
    "algorithm": st.sampled_from(ALGORITHMS), "clients": st.integers(2, 4),
    "q": st.sampled_from([0.5, 0.8, 1.0]), "clip": st.sampled_from([0.05, 0.5, 5.0]),
    "seed": st.integers(0, 10_000), "data": st.integers(0, 10_000),
    "iterations": st.integers(3, 4)})


def run_client(s: dict[str, Any], tap: Tap) -> None:
    """DP-FedAvg in the trainer (``--privacy client``), add/remove one client.

    D: ``clients`` clients; D': the same plus a target client (id N, data turned away from
    the others'). Release point ``ClientLevelGaussian.__call__``: the sum of the clipped
    updates before the noise and before the division by q N; bound C (``--clip``); with
    adaptive clipping the round's C_t and also the count (``AdaptiveClipping.update``, bound
    1/2) and the pair jointly against 1 / z_eff. Pinned public constants: the divisor
    q N (``ClientDpPlan.expected_clients``) and, with adaptive clipping, the count's
    stddev max(q N / 20, 2.5 z) (D's ``AdaptiveClipping``)."""
    base = toy_clients(s["data"], _sizes(s))
    tap.target = len(base)
    target = opposite(toy_clients(s["data"] + 1, [7])[0])
    ds = federated(base + [target] if tap.side == D2 else base)
    adaptive = s.get("adaptive")
    cfg = _config(s, privacy="client", client_rate=s["q"], l2_clip_norm=s["clip"],
                  noise_multiplier=1.0, stragglers=s.get("stragglers", 0.0),
                  local_epochs=s.get("epochs", 2),
                  adaptive_clip=0.0 if adaptive is None else adaptive)  # 0: a fixed clip
    with pytest.MonkeyPatch.context() as mp:
        track_selection(mp, tap)
        pin(mp, tap, ClientDpPlan, "expected_clients")
        group = joint = None
        if adaptive is not None:
            real_plan = up_privacy.client_plan

            def client_plan(cfg: Any, ds: Any, z: Any = None) -> Any:
                plan = real_plan(cfg, ds, z)
                adaptive = tap.public("AdaptiveClipping", lambda: plan.adaptive)
                tap.ctx["plan"] = dataclasses.replace(plan, adaptive=adaptive)
                return tap.ctx["plan"]

            mp.setattr(up_privacy, "client_plan", client_plan)

            def group() -> Any:
                return tap.ctx["round"]

            def joint() -> float:  # 1 / the z_eff the round is charged at
                return 1.0 / tap.ctx["plan"].effective_noise_multiplier

            spy_adaptive_count(mp, tap, ids=lambda: tap.ctx["ids"], target=tap.target,
                               group=group, joint=joint)
        spy_client_sum(mp, tap, ClientLevelGaussian, ids=lambda: tap.ctx["ids"],
                       target=tap.target,
                       bound=(lambda m: m.l2_clip_norm) if adaptive else (lambda m: s["clip"]),
                       group=group, joint=joint)
        run_algorithm(s["algorithm"], cfg, ds, iterations=s["iterations"])


WITNESS = {"algorithm": "fedavg", "clients": 2, "q": 1.0, "clip": 0.05, "seed": 0, "data": 0,
           "iterations": 3}


def stated_client(s: dict[str, Any]) -> Any:
    return ClientDpPlan.neighboring_relation


ENTRIES = [
    Entry("upcycled-client", ADD_REMOVE, CLIENT, run_client, stated_client, WITNESS),
    Entry("upcycled-client-adaptive", ADD_REMOVE,
          CLIENT.map(lambda s: s | {"adaptive": 0.5}), run_client, stated_client,
          WITNESS | {"adaptive": 0.5}),
    Entry("upcycled-client-stragglers", ADD_REMOVE,
          st.tuples(CLIENT, st.sampled_from([0.3, 0.6, 0.9])).map(
              lambda p: p[0] | {"stragglers": p[1], "epochs": 3}),
          run_client, stated_client, WITNESS | {"stragglers": 0.5, "epochs": 3}),
]


# ------------------------------------------------------------------------- banded MF
def banded_settings(participation: str) -> Any:
    return st.fixed_dictionaries({
        "algorithm": st.sampled_from(ALGORITHMS), "clients": st.integers(3, 5),
        "bands": st.sampled_from([1, 2]), "groups": st.sampled_from([1, 2, 3]),
        "q": st.sampled_from([0.4, 0.7]), "clip": st.sampled_from([0.05, 0.5]),
        "seed": st.integers(0, 10_000), "data": st.integers(0, 10_000),
        "target": st.integers(0, 4), "iterations": st.integers(3, 4),
        "participation": st.just(participation)})


def banded_config(s: dict[str, Any]) -> UpcycledConfig:
    p = s["participation"]
    groups = None if p == "minsep" else max(s["groups"], s["bands"] if p == "poisson" else 1)
    return _config(s, privacy="client", mechanism="bandmf", bands=s["bands"],
                   participation=p, groups=groups, l2_clip_norm=s["clip"],
                   noise_multiplier=1.0, client_rate=None if p == "cyclic" else s["q"],
                   stragglers=0.0)


def run_banded(s: dict[str, Any], tap: Tap) -> None:
    """Banded MF in the trainer (``--mechanism bandmf``), release point ``BandMF.__call__``:
    the round's sum of clipped updates before the correlated noise and the division by the
    public divisor; bound C per round (the strategy's sensitivity prices C per
    participation; the schema check (``extra``) asks that the target's participations fit
    the priced schema).

    ``relation`` ZERO_OUT (minsep's stated relation): the target is client ``target mod N``,
    its data turned away in D' and its row zeroed at the release point. ADD_REMOVE (cyclic,
    poisson; and the minsep regression): D' adds client N; pinned: the divisor (per round)
    and the cohort m = round(q N)."""
    base = toy_clients(s["data"], _sizes(s))
    if s["relation"] == ZERO_OUT:
        tap.target = s["target"] % len(base)
        clients = list(base)
        if tap.side == D2:
            clients[tap.target] = opposite(clients[tap.target])
    else:
        tap.target = len(base)
        clients = base + [opposite(toy_clients(s["data"] + 1, [7])[0])] \
            if tap.side == D2 else base
    cfg = banded_config(s)
    with pytest.MonkeyPatch.context() as mp:
        track_selection(mp, tap)
        pin(mp, tap, BandedDpPlan, "divisor")
        pin(mp, tap, BandedDpPlan, "cohort")
        real_banded = up_privacy._banded

        def banded(*a: Any) -> Any:
            tap.ctx["plan"], cal = real_banded(*a)
            return tap.ctx["plan"], cal

        mp.setattr(up_privacy, "_banded", banded)
        spy_client_sum(mp, tap, BandMF, ids=lambda: tap.ctx["ids"], target=tap.target,
                       bound=lambda m: s["clip"], zero_target=s["relation"] == ZERO_OUT)
        run_algorithm(s["algorithm"], cfg, federated(clients), iterations=s["iterations"])


def schema_fits(s: dict[str, Any], d: Tap, d2: Tap) -> list[Violation]:
    """The target's participations in D' (0-based data rounds) fit the priced schema."""
    plan = d2.ctx["plan"]
    rounds = [r.key[0] - 1 for r in d2.releases if r.target]
    if plan.participation == "minsep":
        ok = plan.schema.allows(rounds)
    else:
        ok = plan.schema.allows(rounds, d2.target % plan.groups)
    return [] if ok else [Violation("schema", -1, "participation", tuple(rounds), 0, 0,
                                    f"(the target's rounds do not fit {plan.schema})")]


def banded_stated(s: dict[str, Any]) -> Any:
    cfg = banded_config(s)
    return BandedDpPlan(s["clients"], up_privacy.data_rounds(s["algorithm"], s["iterations"]),
                        cfg.bands, cfg.participation, cfg.effective_client_rate,
                        cfg.groups or cfg.bands, cfg.l2_clip_norm, 1.0).neighboring_relation


def banded_entry(participation: str, relation: Any) -> Entry:
    witness = {"algorithm": "fedavg", "clients": 3, "bands": 2, "groups": 1, "q": 0.7,
               "clip": 0.05, "seed": 1, "data": 1, "target": 0, "iterations": 4,
               "participation": participation, "relation": relation}
    return Entry(f"upcycled-bandmf-{participation}", relation,
                 banded_settings(participation).map(lambda s: s | {"relation": relation}),
                 run_banded, banded_stated, witness, schema_fits)


ENTRIES += [
    banded_entry("minsep", ZERO_OUT),
    banded_entry("cyclic", ADD_REMOVE),
    banded_entry("poisson", ADD_REMOVE),
]


# ------------------------------------------------------------------------- record level
RECORD = st.fixed_dictionaries({
    "algorithm": st.sampled_from(ALGORITHMS), "clients": st.integers(2, 3),
    "fraction": st.sampled_from([0.5, 1.0]), "batch": st.sampled_from([2, 3]),
    "clip": st.sampled_from([0.05, 0.5, 5.0]), "target": st.integers(0, 2),
    "stragglers": st.sampled_from([0.0, 0.5]), "seed": st.integers(0, 10_000),
    "data": st.integers(0, 10_000), "iterations": st.integers(2, 3)})


def record_sizes(s: dict[str, Any]) -> tuple[list[int], int]:
    """Client sizes, with the target client's n_t > b and n_t mod b != 0: adding a record
    then keeps its steps e ceil(n/b) and its divisor q n = b (public constants)."""
    sizes = _sizes(s)
    t = s["target"] % len(sizes)
    b = s["batch"]
    sizes[t] = 2 * b + 1
    return sizes, t


def run_record(s: dict[str, Any], tap: Tap) -> None:
    """Record-level DP-SGD in the trainer (``--privacy record``, ``privkit.torch.
    ClientsDpSgd``), add/remove one record: D' appends one record to client t. Release point:
    each sampled client's clipped per-example gradient sum at each step (before the noise
    and the division by q_i n_i = b), bound C. Pinned: the aggregation weights n_i / n
    (D's); the coins of D's records (see ``spy_clients_dpsgd``)."""
    sizes, t = record_sizes(s)
    base = toy_clients(s["data"], sizes)
    clients = list(base)
    if tap.side == D2:
        clients[t] = with_record(base[t], s["data"])
    weights = np.asarray(sizes, dtype=np.float64) / sum(sizes)
    cfg = _config(s, privacy="record", l2_clip_norm=s["clip"], noise_multiplier=1.0,
                  fraction=s["fraction"], batch_size=s["batch"], stragglers=s["stragglers"])
    tap.target = t
    with pytest.MonkeyPatch.context() as mp:
        spy_clients_dpsgd(mp, tap, target_key=t, target_row=sizes[t], bound=s["clip"])
        run_algorithm(s["algorithm"], cfg, federated(clients, weights=weights),
                      iterations=s["iterations"])


ENTRIES.append(Entry(
    "upcycled-record", ADD_REMOVE, RECORD, run_record,
    lambda s: RecordDpPlan.neighboring_relation,
    {"algorithm": "fedavg", "clients": 2, "fraction": 1.0, "batch": 2, "clip": 0.05,
     "target": 0, "stragglers": 0.0, "seed": 0, "data": 0, "iterations": 2}))


# ------------------------------------------------------------------------- output
OUTPUT = st.fixed_dictionaries({
    "algorithm": st.sampled_from(ALGORITHMS), "clients": st.integers(2, 3),
    "fraction": st.sampled_from([0.5, 1.0]), "tau": st.sampled_from([0.1, 1.0, 10.0]),
    "sensitivity": st.sampled_from(["replace-one", "strongly-convex"]),
    "target": st.integers(0, 2), "record": st.integers(0, 4),
    "stragglers": st.sampled_from([0.0, 0.5]),
    "seed": st.integers(0, 10_000), "data": st.integers(0, 10_000),
    "iterations": st.integers(2, 3)})


def output_config(s: dict[str, Any]) -> UpcycledConfig:
    extra = dict(feature_norm=1.0, momentum=0.0, mu=1.0) \
        if s["sensitivity"] == "strongly-convex" else {}
    return _config(s, privacy="output", l2_clip_norm=s["tau"], stddev=1.0,
                   sensitivity=s["sensitivity"], fraction=s["fraction"],
                   stragglers=s["stragglers"], **extra)


def output_algorithm(s: dict[str, Any]) -> str:
    """FedProx in place of FedAvg for ``strongly-convex`` (it needs mu > 0)."""
    strong = s["sensitivity"] == "strongly-convex"
    return "fedprox" if strong and s["algorithm"] == "fedavg" else s["algorithm"]


def run_output(s: dict[str, Any], tap: Tap) -> None:
    """Output perturbation (``--privacy output``), replace-one one record of client t.
    Release point ``GaussianOutputPerturbation.__call__``: the clipped local model (the
    pre-noise value), one release per sampled client; bound the mechanism's sensitivity
    (2 tau for ``replace-one``; min(2 tau, 2 u1 / (b_min mu)) for ``strongly-convex``, whose
    conditions the configuration meets: features clipped to R = 1, momentum 0, mu = 1,
    lr <= 2 / (beta + 2 mu), FedProx in place of FedAvg)."""
    cfg = output_config(s)
    base = toy_clients(s["data"], _sizes(s))
    t = s["target"] % len(base)
    clients = list(base)
    if tap.side == D2:
        clients[t] = replaced_record(base[t], s["record"] % len(base[t][0]))
    ds = federated(clients)
    if cfg.feature_norm is not None:
        ds = clip_features(ds, cfg.feature_norm)
    tap.target = t
    with pytest.MonkeyPatch.context() as mp:
        real_mech, real_call = PrivacyPlan.mechanism, GaussianOutputPerturbation.__call__

        def mechanism(self: Any, client: int) -> Any:
            tap.ctx["client"] = int(client)
            return real_mech(self, client)

        def call(self: Any, tree: Any, *, rng: Any) -> Any:
            c = tap.ctx["client"]
            tap.record("GaussianOutputPerturbation.__call__",
                       gaussian_module.clip_l2(tree, self.l2_clip_norm), self.sensitivity,
                       key=(tap.ctx["round"], c), target=c == t)
            return tap.couple("output", lambda: real_call(self, tree, rng=rng))

        track_selection(mp, tap)
        mp.setattr(PrivacyPlan, "mechanism", mechanism)
        mp.setattr(GaussianOutputPerturbation, "__call__", call)
        run_algorithm(output_algorithm(s), cfg, ds, iterations=s["iterations"])


def output_stated(s: dict[str, Any]) -> Any:
    cfg = output_config(s)
    ds = federated(toy_clients(s["data"], _sizes(s)))
    return up_privacy._plan_for(cfg, ds, output_algorithm(s)).neighboring_relation


ENTRIES.append(Entry(
    "upcycled-output", REPLACE_ONE, OUTPUT, run_output, output_stated,
    {"algorithm": "fedprox", "clients": 2, "fraction": 1.0, "tau": 10.0,
     "sensitivity": "strongly-convex", "target": 0, "record": 0, "stragglers": 0.0,
     "seed": 0, "data": 0, "iterations": 2}))


# ------------------------------------------------------------------------- the tests
test_coupling, test_witness_sees_the_target = coupling_tests(ENTRIES)


def test_adaptive_clipping_survives_a_round_without_clients() -> None:
    """2 clients, q = 0.5, seed 1: data round 1 samples nobody (the release must still be
    made: noise only, and the count's noise)."""
    cfg = _config({"seed": 1, "iterations": 3}, privacy="client", client_rate=0.5,
                  l2_clip_norm=0.5, noise_multiplier=1.0, adaptive_clip=0.5, stragglers=0.0)
    res = run_algorithm("fedavg", cfg, federated(toy_clients(0, [6, 7])), iterations=3)
    assert res["privacy"]["charged_rounds"] == 3  # every round released (and was charged)
    assert [h["iteration"] for h in res["history"]][-1] == 3
