"""Secure mode end to end: through the mechanisms, not only the generator.

tests/privkit/mechanisms/test_sampling.py checks ``SecureRandom`` itself (seeds and keys
refused, instances differ, a failing ``os.urandom`` propagates from every sampler, four
draws per element). Here the same promises are checked on the mechanism objects a trainer
uses, and beside a ledger: a failing entropy source raises out of every mechanism call, after
which the ledger holds exactly the charge that preceded the draw (write-ahead: over-counted,
never under-counted) and no noisy output exists.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import privkit
from privkit.errors import InvalidParameterError
from privkit.ledger import Ledger
from privkit.mechanisms.sampling import SecureRandom

MECHANISMS = {
    "gaussian-output": (lambda: privkit.GaussianOutputPerturbation.from_stddev(1.0, 0.5),
                        lambda m, rng: m({"w": torch.zeros(64)}, rng=rng)["w"]),
    "laplace-gradient": (lambda: privkit.LaplaceGradientNoise(l2_clip_norm=1.0, batch_size=2,
                                                              epsilon=1.0),
                         lambda m, rng: m({"g": np.zeros((2, 64))}, rng=rng)["g"]),
    "objective-linear-term": (lambda: privkit.ObjectivePerturbation(
        alpha=5.0, dataset_size=100, proximal_mu=1.0),
        lambda m, rng: m.linear_term({"w": np.zeros(64)}, rng=rng)["w"]),
}


@pytest.mark.parametrize("seed", [0, 1, 2**63, "0" * 16])
def test_seeds_are_refused(seed):
    with pytest.raises(InvalidParameterError, match="seeds are refused"):
        SecureRandom(seed)


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_outputs_differ_across_instances_and_calls(name):
    make, call = MECHANISMS[name]
    mech = make()
    outs = [np.asarray(call(mech, SecureRandom())) for _ in range(3)]
    rng = SecureRandom()
    outs += [np.asarray(call(mech, rng)) for _ in range(2)]
    flat = [o.tobytes() for o in outs]
    assert len(set(flat)) == len(flat)
    assert all(np.isfinite(o).all() and np.any(o != 0) for o in outs)


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_failing_entropy_source_raises_after_the_charge(name, tmp_path, monkeypatch):
    make, call = MECHANISMS[name]
    mech = make()
    rng = SecureRandom()
    rel = getattr(mech, "neighboring_relation", "ADD_OR_REMOVE_ONE")
    led = Ledger.create(tmp_path / "l.jsonl", population_id="p", delta=1e-5,
                        neighboring_relation=rel)
    event = mech.event(64) if name == "laplace-gradient" else mech.event()
    led.spend(["c"], event, label="release")  # write-ahead, then draw

    def broken(n):
        raise OSError("entropy source unavailable")

    monkeypatch.setattr(os, "urandom", broken)
    result = None
    with pytest.raises(OSError, match="entropy source unavailable"):
        result = call(mech, rng)
    assert result is None  # nothing released
    monkeypatch.undo()
    again = Ledger.open(tmp_path / "l.jsonl")
    assert again.head().seq == 0 and again.epsilons()["c"] > 0  # the charge stays
