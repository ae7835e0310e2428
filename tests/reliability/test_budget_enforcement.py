"""Budget enforcement: a budget for exactly k charged rounds stops before round k+1 draws noise.

For every :func:`_trainers.budget_cases` entry the budget is set so that exactly k rounds fit
(per client: the largest client's epsilon after k rounds, so every client can afford k rounds
and the largest cannot afford k + 1; DP-REC: the central epsilon after k rounds). Spies wrap
every noise sampler the mechanisms can call, and the ledger's ``spend``, recording the order
of charges and draws. The run must stop after exactly k charged rounds, draw noise only after
the charge it depends on, draw nothing for round k + 1, stay within the budget, and say why
it stopped. A "round" is what the trainer's budget counts (MAPA: an edge's upload).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from _trainers import BudgetCase, budget_cases

CASES = budget_cases()


def _install_spies(case: BudgetCase, monkeypatch, log: list) -> None:
    for module_name, attr in case.spies:
        module = importlib.import_module(module_name)
        real = getattr(module, attr)

        def spy(*args, _real=real, _name=f"{module_name}.{attr}", **kw):
            log.append(("draw", _name))
            return _real(*args, **kw)

        monkeypatch.setattr(module, attr, spy)
    import privkit.ledger as ledger_mod

    real_spend = ledger_mod.Ledger.spend_many  # Ledger.spend is one charge of it

    def spend_many(self, charges, **kw):
        charges = list(charges)
        receipt = real_spend(self, charges, **kw)
        for charge in charges:  # logged only once the whole batch is on disk
            ids = charge[0] if isinstance(charge[0], (list, tuple)) else [charge[0]]
            log.append(("charge", kw.get("round"), tuple(str(c) for c in ids),
                        int(charge[2]) if len(charge) == 3 else 1))
        return receipt

    monkeypatch.setattr(ledger_mod.Ledger, "spend_many", spend_many)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_budget_for_k_rounds_stops_before_round_k_plus_1_draws_noise(case, tmp_path,
                                                                      monkeypatch):
    budget = case.budget(case.k)
    log: list = []
    _install_spies(case, monkeypatch, log)
    res = case.run(budget, tmp_path)
    assert case.rounds_done(res) == case.k
    charges = [e[1:] for e in log if e[0] == "charge"]
    assert case.rounds_charged(charges) == case.k  # nothing charged for round k + 1
    draws = [e for e in log if e[0] == "draw"]
    expected = case.draws_expected(charges, res)
    assert expected > 0 and len(draws) == expected, (len(draws), expected)
    # write-ahead: at every draw, at least as many client uses as draws are charged on disk
    charged = drawn = 0
    for e in log:
        if e[0] == "charge":
            charged += len(e[2]) * e[3]
        else:
            drawn += 1
            assert drawn <= charged, log
    assert log[-1][0] == "draw"  # nothing was charged or drawn after round k's releases
    msg = case.stopped(res)
    for phrase in case.reason(budget, case.k):
        assert phrase in msg, (phrase, msg)
    assert case.spent(res) <= budget


def test_spy_catches_noise_drawn_before_the_budget_check(tmp_path, monkeypatch):
    """A planted bug (a draw before the charge decision) makes the harness fail."""
    case = CASES[0]
    budget = case.budget(case.k)
    log: list = []
    _install_spies(case, monkeypatch, log)
    from fl_examples.core import privacy

    real_charge = privacy.PrivacyPlan.charge
    sampling = importlib.import_module("privkit.mechanisms.sampling")

    def leaky(self, ledger, clients, **kw):
        sampling.gaussian_noise(np.zeros(2), 1.0, rng=np.random.default_rng(0))
        return real_charge(self, ledger, clients, **kw)

    monkeypatch.setattr(privacy.PrivacyPlan, "charge", leaky)
    res = case.run(budget, tmp_path)
    charges = [e[1:] for e in log if e[0] == "charge"]
    draws = sum(1 for e in log if e[0] == "draw")
    assert draws > case.draws_expected(charges, res)  # the check above would fail
    assert case.rounds_done(res) == case.k
    assert log[0][0] == "draw"  # and so would the write-ahead check


@pytest.mark.parametrize(("name", "sampler"), [
    ("mapa-uploads", "fl_examples.mapa.uploads.l2_laplace_noise"),
    ("dprec-central", "privkit.mechanisms.rec.encode"),
    ("dpfedavg-central", "privkit.mechanisms.aggregate.gaussian_noise")])
def test_spies_see_the_trainers_own_draws(name, sampler, tmp_path, monkeypatch):
    """The draws the harness counts are the trainer's releases, through the names it calls
    (MAPA's batched path calls the samplers it imported; DP-REC encodes through ``rec``;
    DP-FedAvg draws through ClientLevelGaussian's module):
    without these spies the draw count would be 0 and the main check would fail."""
    case = next(c for c in CASES if c.name == name)
    log: list = []
    _install_spies(case, monkeypatch, log)
    case.run(case.budget(case.k), tmp_path)
    assert {e[1] for e in log if e[0] == "draw"} == {sampler}
