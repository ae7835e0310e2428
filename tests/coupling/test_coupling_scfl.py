"""Coupling entry of ``privkit train scfl`` with gradient noise (record-level DP-SGD on the
per-epoch client gradients, ``fl_examples/scfl/gradients.py``): add/remove one record of one
client, what the gradient ledger prices. 3-4 clients of 6-9 rows, linear regression, 2-3
epochs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

import fl_examples.scfl.run as scfl_run
from fl_examples.scfl import ScflConfig, ScflMethod
from fl_examples.scfl.data import RegressionData, _features
from fl_examples.scfl.run import _Run, _setup, run_method
from privkit.mechanisms.clipping import clip_per_example

from .harness import ADD_REMOVE, D2, Entry, Tap, Violation, coupling_tests

SETTINGS = st.fixed_dictionaries({
    "method": st.sampled_from([ScflMethod.SCFL, ScflMethod.SCFL_NO_MAKEUP,
                               ScflMethod.CODEDFEDL_STYLE]),
    "clients": st.integers(3, 4), "batch": st.sampled_from([2, 3]),
    "clip": st.sampled_from([0.01, 0.1, 1.0]), "target": st.integers(0, 3),
    "rounds": st.integers(2, 3), "seed": st.integers(0, 10_000),
    "data": st.integers(0, 10_000)})


def regression(seed: int, sizes: list[int], extra: int | None = None, d: int = 3,
               o: int = 2) -> RegressionData:
    """Rows in the unit ball with a bias (``_features``), targets clipped to norm 1; with
    ``extra`` one more record appended to that client (the target record, last row)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(d + 1, o))

    def rows(n: int) -> tuple[np.ndarray, np.ndarray]:
        x = _features(rng.normal(size=(n, d)), None)
        return x, clip_per_example(x @ w + 0.1 * rng.normal(size=(n, o)), 1.0)

    xs, ys = zip(*[rows(n) for n in sizes])
    xs, ys = list(xs), list(ys)
    tx, ty = rows(8)
    if extra is not None:
        ex, ey = rows(1)
        xs[extra], ys[extra] = np.vstack([xs[extra], ex]), np.vstack([ys[extra], -ey])
    return RegressionData(tuple(f"c_{i:05d}" for i in range(len(sizes))), tuple(xs),
                          tuple(ys), None, tx, ty, None, False, {"recipe": "coupling"})


def run_scfl(s: dict[str, Any], tap: Tap) -> None:
    """SCFL with ``gradient_noise_multiplier`` (Bernoulli batches): D' appends one record
    to client t. Release point ``dp_client_gradient``: each arrived client's clipped
    per-example gradient sum before its noise and its public scale 1 / q_i = l_i / b_i, bound
    C (``gradient_clip``); one release per client and epoch.

    What D' takes from D: the coded upload (a release of its own, priced in MI-DP: the
    coupling conditions on it, as on every earlier release), the step size eta = lr / m and
    the scales l_i / b_i (public constants of l_i), and the coins of D's records (each client
    draws its Bernoulli rows from its own stream ``batches/<i>``, so another client's rows are
    the same in D and D' by construction; within the target's client the merge keeps D's
    coins and adds the target record's own). The client gradients are coupled."""
    sizes = [int(n) for n in np.random.default_rng(s["data"]).integers(6, 10, s["clients"])]
    t = s["target"] % len(sizes)
    tap.target = t
    data = regression(s["data"], sizes, t if tap.side == D2 else None)
    cfg = ScflConfig(dataset="coupling", clients=len(sizes), num_coded_rows=12,
                     rounds=s["rounds"], eval_every=s["rounds"], seed=s["seed"],
                     client_batch_size=s["batch"], server_batch_size=4,
                     batch_sampling="bernoulli", gradient_noise_multiplier=1.0,
                     gradient_clip=s["clip"], label_l2_bound=1.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scfl_run, "load_data", lambda cfg: data)
        sh = _setup(cfg, [s["method"]])
        sh.coded = tap.couple("coded upload", lambda: sh.coded)
        sh.eta = tap.public("eta", lambda: sh.eta)
        which = {id(x): i for i, x in enumerate(sh.data.x)}
        real_step, real_rows, real_grad = _Run.step, _Run._client_rows, \
            scfl_run.dp_client_gradient
        real_open = scfl_run.open_ledger

        def open_ledger(*a: Any, **kw: Any) -> Any:
            tap.ctx["ledger"] = real_open(*a, **kw)
            return tap.ctx["ledger"]

        def step(self: Any) -> bool:
            tap.ctx["round"] = self.round + 1
            return real_step(self)

        def client_rows(self: Any, rng: Any, i: int) -> Any:
            def how(own: Any, ref: Any) -> Any:
                if i != t:  # another client's rows come from its own stream: never moved
                    assert np.array_equal(own[0], ref[0]) and own[1] == ref[1], (i, own, ref)
                rows = ref[0]
                if i == t and sizes[t] in set(np.asarray(own[0]).tolist()):
                    rows = np.append(rows, sizes[t])
                return rows, ref[1]

            return tap.merge("client rows", real_rows(self, rng, i), how)

        def gradient(x: Any, y: Any, w: Any, rows: Any, scale: float, clip: float,
                     noise: Any) -> Any:
            i = which[id(x)]
            pre = real_grad(x, y, w, rows, 1.0, clip, np.zeros_like(noise))
            hit = i == t and sizes[t] in set(np.asarray(rows).tolist())
            tap.record("dp_client_gradient", pre, s["clip"], key=(tap.ctx["round"], i),
                       target=hit)
            return tap.couple("dp_client_gradient",
                              lambda: real_grad(x, y, w, rows, scale, clip, noise))

        mp.setattr(scfl_run, "open_ledger", open_ledger)
        mp.setattr(_Run, "step", step)
        mp.setattr(_Run, "_client_rows", client_rows)
        mp.setattr(scfl_run, "dp_client_gradient", gradient)
        run_method(s["method"], sh)


def ledger_relation(s: dict[str, Any], d: Tap, d2: Tap) -> list[Violation]:
    """The gradient ledger prices add/remove one record (the relation checked here)."""
    rel = d.ctx["ledger"].neighboring_relation
    return [] if rel == ADD_REMOVE else [Violation("stated", -1, "ledger", (), 0, 0,
                                                   f"(the ledger prices {rel})")]


ENTRIES = [Entry("scfl-gradient-dp", ADD_REMOVE, SETTINGS, run_scfl, None,
                 {"method": ScflMethod.SCFL, "clients": 3, "batch": 3, "clip": 0.01,
                  "target": 0, "rounds": 3, "seed": 0, "data": 0}, ledger_relation)]


test_coupling, test_witness_sees_the_target = coupling_tests(ENTRIES, witness_moves=1e-4)
