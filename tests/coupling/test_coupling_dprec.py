"""Coupling entries of ``privkit train dprec``: DP-REC's messages under replace-one one
client, and that trainer's DP-FedAvg under add/remove (its default) or replace-one (its
``--relation replace-one``). 3-5 clients of 5-9 records, 2-3 rounds, logistic regression."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

from fl_examples.core.dp_modes import ClientDpPlan
from fl_examples.dprec import DPRecConfig, run_algorithm
from fl_examples.dprec.config import relation_of
from fl_examples.dprec.run import _Run
from privkit.mechanisms import rec
from privkit.mechanisms.aggregate import ClientLevelGaussian

from .harness import (
    ADD_REMOVE,
    D2,
    REPLACE_ONE,
    Entry,
    Tap,
    coupling_tests,
    federated,
    opposite,
    pin,
    spy_client_sum,
    toy_clients,
)

SETTINGS = st.fixed_dictionaries({
    "clients": st.integers(3, 5), "per_round": st.integers(1, 3),
    "q": st.sampled_from([0.5, 1.0]), "clip": st.sampled_from([0.05, 0.5, 5.0]),
    "relation": st.sampled_from(["add-remove", "replace-one"]), "target": st.integers(0, 4),
    "rounds": st.integers(2, 3), "seed": st.integers(0, 10_000),
    "data": st.integers(0, 10_000)})


def _config(s: dict[str, Any], algorithm: str) -> DPRecConfig:
    # sigma = C: one noise multiplier (each new one costs seconds of RDP in the report)
    kw: dict[str, Any] = dict(bits=4, stddev=s["clip"]) if algorithm == "dprec" else dict(
        client_rate=s["q"], relation=s["relation"])
    return DPRecConfig(dataset="coupling", clients_per_round=s["per_round"],
                       rounds=s["rounds"], l2_clip=s["clip"], local_epochs=2, batch_size=4,
                       lr=0.5, seed=s["seed"], device="cpu", eval_every=s["rounds"], **kw)


def _relation(s: dict[str, Any]) -> Any:
    if s["algorithm"] == "dprec" or s["relation"] == "replace-one":
        return REPLACE_ONE
    return ADD_REMOVE


def run_dprec(s: dict[str, Any], tap: Tap) -> None:
    """DP-REC (``algorithm`` dprec, replace-one): D' turns client t's data away; release
    point ``rec.encode``: the clipped update each drawn client encodes (the pre-noise value
    of REC: its selection is the noise), bound 2C; one release per message, the messages
    coupled. DP-FedAvg (``algorithm`` dpfedavg): release point
    ``ClientLevelGaussian.__call__`` (the sum of clipped updates before the noise and the
    division by q N); add/remove: D' adds client N, bound C, the divisor q N pinned;
    replace-one: D' turns client t's data away, bound 2C."""
    sizes = [int(n) for n in np.random.default_rng(s["data"]).integers(5, 10, s["clients"])]
    base = toy_clients(s["data"], sizes)
    relation = _relation(s)
    clients = list(base)
    if relation == ADD_REMOVE:
        tap.target = len(base)
        if tap.side == D2:
            clients.append(opposite(toy_clients(s["data"] + 1, [7])[0]))
    else:
        tap.target = s["target"] % len(base)
        if tap.side == D2:
            clients[tap.target] = opposite(base[tap.target])
    algorithm = s["algorithm"]
    cfg = _config(s, algorithm)
    with pytest.MonkeyPatch.context() as mp:
        real_draws, real_encode = _Run.draws, rec.encode

        def draws(self: Any, t: int) -> Any:
            sel = real_draws(self, t)
            tap.ctx.update(ids=[int(c) for c in sel], round=t, message=0)
            return sel

        def encode(update: Any, **kw: Any) -> Any:
            leaves, _, _ = rec._update_leaves(update)
            flat_u = rec.clip_l2(rec._flat_update(leaves, "cpu"), kw["l2_clip_norm"])
            i = tap.ctx["message"]
            tap.ctx["message"] += 1
            who = tap.ctx["ids"][i]
            tap.record("rec.encode", flat_u, 2 * kw["l2_clip_norm"],
                       key=(tap.ctx["round"], i), target=who == tap.target)
            return tap.couple("rec.encode", lambda: real_encode(update, **kw))

        mp.setattr(_Run, "draws", draws)
        mp.setattr(rec, "encode", encode)
        pin(mp, tap, ClientDpPlan, "expected_clients")
        spy_client_sum(mp, tap, ClientLevelGaussian, ids=lambda: tap.ctx["ids"],
                       target=tap.target,
                       bound=lambda m: s["clip"] * (2 if relation == REPLACE_ONE else 1))
        kw = {"z": 1.0} if algorithm == "dpfedavg" else {}
        run_algorithm(algorithm, cfg, federated(clients), **kw)


def stated(s: dict[str, Any]) -> Any:
    return relation_of(_config(s, s["algorithm"]), s["algorithm"])


WITNESS = {"clients": 3, "per_round": 3, "q": 1.0, "clip": 0.05, "relation": "add-remove",
           "target": 0, "rounds": 2, "seed": 0, "data": 0}

ENTRIES = [
    Entry("dprec-rec", _relation, SETTINGS.map(lambda s: s | {"algorithm": "dprec"}),
          run_dprec, stated, WITNESS | {"algorithm": "dprec"}),
    Entry("dprec-dpfedavg", _relation, SETTINGS.map(lambda s: s | {"algorithm": "dpfedavg"}),
          run_dprec, stated, WITNESS | {"algorithm": "dpfedavg"}),
]


test_coupling, test_witness_sees_the_target = coupling_tests(ENTRIES)
