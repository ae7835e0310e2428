"""The ledger's budget check without re-pricing the history (privkit.accountants.budget): the
same refusals as tight pricing, at the boundary too; no pricing without a budget; O(log T)
tight prices on the way to a budget; the reported epsilon is always the tight one."""

import json
import math

import numpy as np
import pytest

from privkit._journal import canonical_json
from privkit.accountants import epsilon
from privkit.accountants.budget import MARGIN
from privkit.errors import BudgetExceededError, InvalidParameterError, UnsupportedEventError
from privkit.events import (
    ComposedDpEvent,
    GaussianDpEvent,
    PoissonSampledDpEvent,
    SelfComposedDpEvent,
)
from privkit.ledger import Ledger

DELTA = 1e-5
SAMPLED = PoissonSampledDpEvent(0.1, GaussianDpEvent(1.0))


def tight(event, n, **kw):
    """The accountant's epsilon of n uses of ``event`` (what the ledger must report)."""
    return 0.0 if n == 0 else epsilon(SelfComposedDpEvent(event, n), DELTA, **kw).epsilon


def new(path=None, budget=None, **kw):
    return Ledger.create(path, population_id="pop", delta=DELTA, epsilon_budget=budget,
                         created="2024-01-01T00:00:00+00:00", **kw)


def charge_until_refused(led, event, limit, client="x"):
    """Charge ``event`` until the ledger refuses (or ``limit`` charges); return the count
    accepted, checking that would_exceed agreed with spend every time."""
    for n in range(limit):
        over = bool(led.would_exceed(client, event)[0])
        try:
            led.spend(client, event, label="upd", round=n)
        except BudgetExceededError:
            assert over
            return n
        assert not over
    return limit


@pytest.mark.parametrize("k", [1, 3, 12, 40])
def test_subsampled_budget_between_k_and_k_plus_one(k):
    led = new(budget=(tight(SAMPLED, k) + tight(SAMPLED, k + 1)) / 2)
    assert charge_until_refused(led, SAMPLED, k + 5) == k
    assert led.epsilons()["x"] == tight(SAMPLED, k)


@pytest.mark.parametrize("k", [2, 25])
def test_subsampled_budget_exactly_at_the_boundary_is_allowed(k):
    led = new(budget=tight(SAMPLED, k))
    assert charge_until_refused(led, SAMPLED, k + 5) == k
    assert led.epsilons()["x"] == tight(SAMPLED, k)


def test_refusals_equal_tight_pricing_every_round_on_the_way_to_the_budget():
    """Each of 60 rounds, for a budget reached at round 45: accepted exactly while the tight
    price of the would-be composition is within the budget."""
    budget = tight(SAMPLED, 45) * (1 + 1e-9)
    led = new(budget=budget)
    accepted = charge_until_refused(led, SAMPLED, 60)
    want = next(n for n in range(61) if tight(SAMPLED, n + 1) > budget)
    assert accepted == want == 45
    assert led._states.priced < 45  # not every round priced


def test_heterogeneous_clients_and_events_match_tight_pricing():
    """Mixed events per client (two sampling rates, an unsampled step) and several clients in
    one spend: every decision is the tight one."""
    rng = np.random.default_rng(0)
    events = [SAMPLED, PoissonSampledDpEvent(0.05, GaussianDpEvent(0.9)), GaussianDpEvent(6.0)]
    budget = 3.0
    led = new(budget=budget)
    history: dict[str, list] = {c: [] for c in "abcd"}
    for r in range(40):
        ev = events[int(rng.integers(len(events)))]
        ids = [c for c in "abcd" if rng.random() < 0.7] or ["a"]
        price = {c: epsilon(ComposedDpEvent(history[c] + [ev]), DELTA).epsilon for c in ids}
        over = led.would_exceed(ids, ev)
        assert over.tolist() == [price[c] > budget for c in ids]
        if over.any():
            with pytest.raises(BudgetExceededError):
                led.spend(ids, ev, label="upd", round=r)
            continue
        led.spend(ids, ev, label="upd", round=r)
        for c in ids:
            history[c].append(ev)
    for c, evs in history.items():
        if evs:
            assert led.epsilons([c])[c] == epsilon(ComposedDpEvent(evs), DELTA).epsilon


def test_no_budget_prices_nothing_until_asked(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    for r in range(200):
        receipt = led.spend(["a", "b"], SAMPLED, label="upd", round=r)
        assert not led.would_exceed(["a", "c"], SAMPLED).any()
    assert led._states.priced == 0
    entries = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    assert all(e["eps_after"] is None for e in entries)
    want = tight(SAMPLED, 200)
    assert receipt.epsilons.tolist() == [want, want]  # priced when read
    assert not receipt.epsilons.flags.writeable
    assert led.epsilons() == {"a": want, "b": want}
    again = Ledger.open(path)
    assert again.epsilons() == led.epsilons() and again.stale_eps_after() == {}


def test_far_budget_uses_bounds_and_a_few_look_aheads():
    led = new(budget=1e4)  # never near: the RDP bound settles every round
    for r in range(1000):
        led.spend("a", SAMPLED, label="upd", round=r)
    assert led._states.priced == 0
    assert led.epsilons()["a"] == tight(SAMPLED, 1000)


def test_look_ahead_prices_logarithmically_many_states():
    """A budget reached at exactly round 400: the RDP bound is above it for the last ~30% of
    the rounds, where look-aheads decide; the refusal is still exact, and only a few dozen of
    the 401 would-be compositions are priced."""
    ev = PoissonSampledDpEvent(0.02, GaussianDpEvent(0.8))
    budget = tight(ev, 400)
    led = new(budget=budget)
    assert charge_until_refused(led, ev, 450) == 400
    assert led._states.priced <= 40
    assert led.epsilons()["x"] == budget


def test_refused_spend_shows_tight_epsilons_and_records_nothing(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path, budget=tight(SAMPLED, 3) * (1 + 1e-12))
    led.spend(["a", "b"], SAMPLED, label="upd", count=3)
    before = path.read_bytes()
    with pytest.raises(BudgetExceededError, match=f"epsilon {tight(SAMPLED, 4):.6g}"):
        led.spend(["a", "b"], SAMPLED, label="upd")
    assert path.read_bytes() == before


def test_unpriceable_event_is_refused_without_a_budget():
    led = new(method="exact")  # exact prices unsampled Gaussians only
    with pytest.raises(UnsupportedEventError):
        led.spend("a", SAMPLED, label="upd")
    assert led.head().seq == -1


def test_a_format_1_journal_keeps_a_number_in_every_entry(tmp_path):
    """A journal written before null eps_after (privkit.ledger/1) opens and is appended to in
    its own format."""
    path = tmp_path / "l.jsonl"
    led = new(path)
    led.spend(["a", "b"], SAMPLED, label="upd", round=0)
    header, *entries = [json.loads(x) for x in path.read_text().splitlines()]
    out = [_rehash(dict(header, schema="privkit.ledger/1"))]
    prev, client_prev = out[0]["hash"], {}
    for e in entries:
        e = _rehash(dict(e, eps_after=tight(SAMPLED, 1), prev_hash=prev,
                         client_prev_hash=client_prev.get(e["client_id"], out[0]["hash"])))
        prev = client_prev[e["client_id"]] = e["hash"]
        out.append(e)
    path.write_text("".join(canonical_json(e) + "\n" for e in out), encoding="utf-8")
    (tmp_path / "l.jsonl.head").unlink()  # a ledger from before head records
    old = Ledger.open(path)
    old.spend("a", SAMPLED, label="upd", round=1)
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["eps_after"] == tight(SAMPLED, 2) and old.stale_eps_after() == {}
    assert Ledger.open(path).epsilons() == {"a": tight(SAMPLED, 2), "b": tight(SAMPLED, 1)}


def test_margin_is_small():
    assert 0 < MARGIN <= 1e-2 and math.isfinite(MARGIN)


def _rehash(d):
    import hashlib

    body = {k: v for k, v in d.items() if k != "hash"}
    return dict(body, hash=hashlib.sha256(canonical_json(body).encode()).hexdigest())


# ------------------------------------------------------------------ spend_many
def test_spend_many_is_one_batch_and_replays(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    other = PoissonSampledDpEvent(0.05, GaussianDpEvent(0.9))
    receipt = led.spend_many([(["a", "b"], SAMPLED), ("c", other, 3)], label="round", round=0)
    entries = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    assert [e["client_id"] for e in entries] == ["a", "b", "c"]
    assert {e["batch_end"] for e in entries} == {2} and receipt.seq == 2
    assert [e["count"] for e in entries] == [1, 1, 3]
    want = {"a": tight(SAMPLED, 1), "b": tight(SAMPLED, 1), "c": tight(other, 3)}
    assert led.epsilons() == want and Ledger.open(path).epsilons() == want
    assert receipt.epsilons.tolist() == [want["a"], want["b"], want["c"]]


def test_spend_many_is_all_or_nothing(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path, budget=tight(SAMPLED, 2) * (1 + 1e-12))
    led.spend("a", SAMPLED, label="upd", count=2)
    before = path.read_bytes()
    with pytest.raises(BudgetExceededError, match="'a'"):
        led.spend_many([("b", SAMPLED), ("a", SAMPLED)], label="round")
    assert path.read_bytes() == before and led.epsilons() == {"a": tight(SAMPLED, 2)}
    led.spend_many([("b", SAMPLED), ("c", SAMPLED, 2)], label="round")
    assert led.epsilons(["b", "c"]) == {"b": tight(SAMPLED, 1), "c": tight(SAMPLED, 2)}


@pytest.mark.parametrize("charges, name", [
    ([], "charges"),
    ([("a",)], "charges"),
    ([("a", SAMPLED), (["b", "a"], SAMPLED)], "client_ids"),
    ([("a", SAMPLED, 0)], "count"),
    ([("a", "not an event")], "event"),
])
def test_spend_many_bad_input_changes_nothing(charges, name):
    led = new()
    with pytest.raises(InvalidParameterError, match=name):
        led.spend_many(charges, label="round")
    assert led.head().seq == -1
