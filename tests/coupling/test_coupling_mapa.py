"""Coupling entries of ``privkit train mapa`` (MAPA and AUDP): the pure-DP uploads under
replace-one (batched path and the reference path through ``LaplaceGradientNoise.__call__``),
the amplified Poisson uploads and the Gaussian (DP-SGD) uploads under add/remove one record.
Tiny logistic regression over 2-3 edges of 5-8 records, 4-8 cloud updates."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

import fl_examples.mapa.run as mapa_run
import fl_examples.mapa.uploads as uploads
from fl_examples.mapa import MapaConfig, run_algorithm
from fl_examples.mapa.privacy import _relation
from fl_examples.mapa.uploads import UploadsMixin
from privkit.events.mechanisms import NeighboringRelation
from privkit.mechanisms import laplace
from privkit.mechanisms.laplace import LaplaceGradientNoise

from .harness import (
    ADD_REMOVE,
    D2,
    REPLACE_ONE,
    Entry,
    Tap,
    _zero_noise,
    coupling_tests,
    federated,
    pin,
    replaced_record,
    toy_clients,
    with_record,
)

SETTINGS = st.fixed_dictionaries({
    "algorithm": st.sampled_from(["mapa", "audp"]), "edges": st.integers(2, 3),
    "batch": st.sampled_from([2, 3]), "noise": st.sampled_from(["l2", "l1"]),
    "batched": st.booleans(), "updates": st.integers(4, 8), "target": st.integers(0, 2),
    "record": st.integers(0, 4), "seed": st.integers(0, 10_000),
    "data": st.integers(0, 10_000)})


def _config(s: dict[str, Any]) -> MapaConfig:
    mode = s["mode"]
    kw: dict[str, Any] = dict(noise=s["noise"], batched=s["batched"])
    if mode == "amplified":
        kw |= dict(batch_sampler="poisson", amplification=True, batched=True)
    elif mode == "gaussian":
        kw = dict(noise="gaussian", noise_multiplier=1.0, clip=s["clip"], batched=True)
    return MapaConfig(edges=s["edges"], batch=s["batch"], updates=s["updates"],
                      eval_every=s["updates"], seed=s["seed"], device="cpu", **kw)


def run_mapa(s: dict[str, Any], tap: Tap) -> None:
    """One MAPA/AUDP run. ``mode`` ``pure`` (replace-one): D' replaces record ``record`` of
    edge t; each upload's pre-noise value is its clipped mean, bound DeltaS = 2 C / b (the
    noise's calibration). ``amplified`` (Poisson batches, add/remove): D' appends a record to
    edge t; bound DeltaS (priced: the noise is calibrated to it; the add/remove sensitivity
    C / b is half of it). ``gaussian`` (add/remove): D' appends a record; the pre-noise value
    is the clipped sum / b, bound C / b. Pinned: the sampling rates q_k = b / n_k (D's).

    Release points: ``UploadsMixin._noisy_batched`` (every batched upload: its pre-noise
    value is the same function with the noise samplers returning zeros) and, on the
    reference path, ``LaplaceGradientNoise.__call__`` (the clipped rows' mean, by the
    mechanism's own helpers). Each upload (edge, upload number) is one release; the target
    contributed when its row is in the upload's batch. The uploads are coupled."""
    sizes = [int(n) for n in np.random.default_rng(s["data"]).integers(5, 9, s["edges"])]
    base = toy_clients(s["data"], sizes)
    t, j = s["target"] % len(base), s["record"] % min(sizes)
    clients = list(base)
    add = s["mode"] != "pure"
    if tap.side == D2:
        clients[t] = with_record(base[t], s["data"]) if add else replaced_record(base[t], j)
    index = sizes[t] if add else j  # the target record's row within edge t
    tap.target = t
    cfg = _config(s)
    with pytest.MonkeyPatch.context() as mp:
        pin(mp, tap, mapa_run, "_sampling_probabilities")
        real_rows, real_noisy = UploadsMixin._batch_rows, UploadsMixin._noisy_batched
        real_call = LaplaceGradientNoise.__call__

        def batch_rows(self: Any, k: int, u: int) -> Any:
            rows = real_rows(self, k, u)
            hit = k == t and int(self.data.offsets[t]) + index in set(rows.tolist())
            tap.ctx.setdefault("hit", {})[(k, u)] = hit
            tap.ctx["last"] = (k, u)
            return rows

        def bound(delta_s: float) -> float:
            return delta_s / 2 if s["mode"] == "gaussian" else delta_s

        def noisy(self: Any, per_ex: Any, ks: Any, ups: Any, mask: Any = None) -> Any:
            delta_s = np.array(self.delta_s[ks], dtype=np.float64)
            with pytest.MonkeyPatch.context() as quiet:
                for name in ("gaussian_noise", "l2_laplace_noise", "laplace_noise"):
                    quiet.setattr(uploads, name, _zero_noise)
                pre = real_noisy(self, per_ex, ks, ups, mask)
            for i, (k, u) in enumerate(zip(ks, ups)):
                tap.record("mapa upload", pre[i], bound(float(delta_s[i])), key=(k, u),
                           target=tap.ctx["hit"][(k, u)])
            return tap.couple("mapa upload", lambda: real_noisy(self, per_ex, ks, ups, mask))

        def call(self: Any, per_example_grads: Any, *, rng: Any) -> Any:
            k, u = tap.ctx["last"]
            clipped = laplace._clip_per_example(per_example_grads, self.l2_clip_norm, "g")
            tap.record("mapa upload", laplace._mean_rows64(clipped, self.batch_size),
                       self.sensitivity, key=(k, u), target=tap.ctx["hit"][(k, u)])
            return tap.couple("mapa upload", lambda: real_call(self, per_example_grads,
                                                                 rng=rng))

        mp.setattr(UploadsMixin, "_batch_rows", batch_rows)
        mp.setattr(UploadsMixin, "_noisy_batched", noisy)
        mp.setattr(LaplaceGradientNoise, "__call__", call)
        run_algorithm(s["algorithm"], cfg, dataset=federated(clients))


def stated(s: dict[str, Any]) -> Any:
    return NeighboringRelation[_relation(_config(s))]


WITNESS = {"algorithm": "audp", "edges": 2, "batch": 3, "noise": "l2", "batched": True,
           "updates": 8, "target": 0, "record": 0, "seed": 0, "data": 0}

ENTRIES = [
    Entry("mapa-pure", REPLACE_ONE, SETTINGS.map(lambda s: s | {"mode": "pure"}), run_mapa,
          stated, WITNESS | {"mode": "pure"}),
    Entry("mapa-pure-reference-path", REPLACE_ONE,
          SETTINGS.map(lambda s: s | {"mode": "pure", "batched": False}), run_mapa, stated,
          WITNESS | {"mode": "pure", "batched": False}),
    Entry("mapa-amplified", ADD_REMOVE, SETTINGS.map(lambda s: s | {"mode": "amplified"}),
          run_mapa, stated, WITNESS | {"mode": "amplified"}),
    Entry("mapa-gaussian", ADD_REMOVE,
          st.tuples(SETTINGS, st.sampled_from([0.05, 1.0])).map(
              lambda p: p[0] | {"mode": "gaussian", "clip": p[1]}),
          run_mapa, stated, WITNESS | {"mode": "gaussian", "clip": 0.05}),
]


test_coupling, test_witness_sees_the_target = coupling_tests(ENTRIES, witness_moves=1e-4)
