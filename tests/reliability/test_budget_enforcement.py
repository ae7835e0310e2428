"""Budget enforcement: a budget for exactly k charged rounds stops before round k+1 draws noise.

For every :data:`_trainers.budget_cases` entry the per-client budget is set to the largest
client's epsilon after k rounds (so every client can afford k rounds and the largest cannot
afford k + 1). Spies wrap every noise sampler the mechanisms can call, and the ledger's
``spend``, recording the order of charges and draws. The run must stop after exactly k
charged rounds, draw noise only after the charge it depends on, draw nothing for round k + 1,
keep every client within budget, and say why it stopped.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from _trainers import BudgetCase, budget_cases

import privkit
from privkit.events import SelfComposedDpEvent

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

    real_spend = ledger_mod.Ledger.spend

    def spend(self, client_ids, event, **kw):
        receipt = real_spend(self, client_ids, event, **kw)
        log.append(("charge", kw.get("round"), len(receipt.client_ids)))
        return receipt

    monkeypatch.setattr(ledger_mod.Ledger, "spend", spend)


def _budget(case: BudgetCase, delta: float = 1e-3) -> tuple[float, list]:
    events = case.client_events()
    eps_k = [privkit.epsilon(SelfComposedDpEvent(ev, case.k), delta).epsilon for ev in events]
    budget = max(eps_k) * (1 + 1e-12)
    worst = events[int(np.argmax(eps_k))]
    assert privkit.epsilon(SelfComposedDpEvent(worst, case.k + 1), delta).epsilon > budget
    return budget, events


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_budget_for_k_rounds_stops_before_round_k_plus_1_draws_noise(case, tmp_path,
                                                                      monkeypatch):
    budget, events = _budget(case)
    log: list = []
    _install_spies(case, monkeypatch, log)
    res = case.run(budget, tmp_path)
    n = len(events)
    assert case.rounds_done(res) == case.k
    charges = [e for e in log if e[0] == "charge"]
    assert sorted({c[1] for c in charges}) == list(range(1, case.k + 1))  # no round k + 1
    draws = [e for e in log if e[0] == "draw"]
    assert len(draws) == case.k * n, (len(draws), case.k, n)  # one draw per client and round
    # write-ahead: at every draw, at least as many client charges as draws are on disk
    charged = drawn = 0
    for e in log:
        if e[0] == "charge":
            charged += e[2]
        else:
            drawn += 1
            assert drawn <= charged, log
    assert log[-1][0] == "draw"  # nothing was charged or drawn after round k's releases
    msg = case.stopped(res)
    assert "would exceed the budget" in msg and f"budget {budget}" in msg, msg
    assert max(res["privacy"]["per_client"]) <= budget


def test_spy_catches_noise_drawn_before_the_budget_check(tmp_path, monkeypatch):
    """A planted bug (a draw before the charge decision) makes the harness fail."""
    case = CASES[0]
    budget, _ = _budget(case)
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
    draws = sum(1 for e in log if e[0] == "draw")
    assert draws > case.k * len(case.client_events())  # the check above would fail
    assert case.rounds_done(res) == case.k
