"""The ledger: budget refusal, replayed epsilons, verified persistence, no rollback."""

import hashlib
import json
import math
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import privkit
from privkit.accountants import epsilon
from privkit.errors import (
    BudgetExceededError,
    InvalidParameterError,
    LedgerCorruptError,
    LedgerError,
    LedgerHeadError,
    LedgerMismatchError,
    LedgerRollbackError,
)
from privkit.events import (
    ComposedDpEvent,
    GaussianDpEvent,
    PoissonSampledDpEvent,
    SelfComposedDpEvent,
)
from privkit.ledger import SCHEMA, Ledger, LedgerPointer, atomic_write_bytes

DELTA = 1e-5
Z = 2.0


def eps_k(k, z=Z, delta=DELTA):
    """The accountant's epsilon of k uses of a Gaussian with noise multiplier z."""
    return 0.0 if k == 0 else epsilon(SelfComposedDpEvent(GaussianDpEvent(z), k), delta).epsilon


def new(path, budget=None, **kw):
    return Ledger.create(path, population_id="pop", delta=DELTA, epsilon_budget=budget,
                         created="2024-01-01T00:00:00+00:00", **kw)


def lines(path):
    return Path(path).read_bytes().splitlines(keepends=True)


def canonical(d):
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def rehash(d):
    body = {k: v for k, v in d.items() if k != "hash"}
    return dict(body, hash=hashlib.sha256(canonical(body).encode()).hexdigest())


def forge_head(path, key=None):
    """Rewrite the head record to match the journal as it is now (what anyone with write
    access can do; with ``key``, only a key holder)."""
    from privkit import _head

    data = Path(path).read_bytes()
    header, *entries = [json.loads(x) for x in data.splitlines()]
    last = entries[-1] if entries else header
    _head.write_head(str(path) + ".head", _head.Head(
        len(entries) - 1, last["hash"], len(data), header["hash"]), key)


# ------------------------------------------------------------------ budget
def test_refused_spend_changes_nothing(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path, budget=eps_k(3) * 1.001)
    for r in range(3):
        led.spend(["a", "b"], GaussianDpEvent(Z), label="upd", round=r)
    led.spend("c", GaussianDpEvent(Z), label="upd")
    before_bytes, before_eps, before_head = path.read_bytes(), led.epsilons(), led.head()
    with pytest.raises(BudgetExceededError, match=r"'a'.*'b'") as info:
        led.spend(["c", "a", "b"], GaussianDpEvent(Z), label="upd")
    assert "epsilon_budget" in str(info.value) and "'c'" not in str(info.value)
    assert path.read_bytes() == before_bytes
    assert led.epsilons() == before_eps and led.head() == before_head
    assert led.would_exceed(["c", "a"], GaussianDpEvent(Z)).tolist() == [False, True]
    assert path.read_bytes() == before_bytes
    assert Ledger.open(path).epsilons() == before_eps


@pytest.mark.parametrize("k", [1, 5])
def test_budget_for_exactly_k_spends(k):
    led = new(None, budget=(eps_k(k) + eps_k(k + 1)) / 2)
    for r in range(k):
        assert not led.would_exceed("x", GaussianDpEvent(Z)).any()
        led.spend("x", GaussianDpEvent(Z), label="upd", round=r)
    assert led.epsilons()["x"] == pytest.approx(eps_k(k), rel=1e-12)
    assert led.would_exceed("x", GaussianDpEvent(Z)).all()
    with pytest.raises(BudgetExceededError):
        led.spend("x", GaussianDpEvent(Z), label="upd", round=k)
    assert led.head().seq == k - 1


def test_budget_exactly_at_the_boundary_is_allowed():
    led = new(None, budget=eps_k(2))
    led.spend("x", GaussianDpEvent(Z), label="upd", count=2)
    with pytest.raises(BudgetExceededError):
        led.spend("x", GaussianDpEvent(Z), label="upd")


def test_non_private_event_is_over_any_budget():
    led = new(None, budget=1e6)
    with pytest.raises(BudgetExceededError):
        led.spend("x", GaussianDpEvent(0.0), label="leak")
    assert led.head().seq == -1


# ------------------------------------------------------------------ replay
def test_epsilons_match_accountant_and_report():
    led = new(None)
    for r in range(3):
        led.spend(["a"] + (["b"] if r == 0 else []), GaussianDpEvent(Z), label="upd", round=r)
    led.spend(7, GaussianDpEvent(Z), label="upd", count=4)  # int ids are stored as str
    eps = led.epsilons()
    assert eps == pytest.approx({"a": eps_k(3), "b": eps_k(1), "7": eps_k(4)}, rel=1e-12)
    assert eps["a"] != eps["b"]
    rep = led.report(["a", "b", "never", 7])
    assert rep.client_ids == ("a", "b", "never", "7")
    np.testing.assert_allclose(rep.epsilons, [eps_k(3), eps_k(1), 0.0, eps_k(4)], rtol=1e-12)
    assert rep.mean == pytest.approx(np.mean(rep.epsilons)) and rep.max == eps["7"]
    assert rep.delta == DELTA and rep.method is privkit.accountants.Method.AUTO
    assert rep.head == led.head()
    assert led.report().client_ids == ("a", "b", "7")
    assert led.epsilons(["never"]) == {"never": 0.0}


def test_composed_and_subsampled_events_replay():
    sampled = PoissonSampledDpEvent(0.1, GaussianDpEvent(1.0))
    mixed = ComposedDpEvent([GaussianDpEvent(3.0), sampled])
    led = new(None)
    led.spend(["a", "b"], mixed, label="mix")
    led.spend("a", sampled, label="s", count=3)
    want = epsilon(ComposedDpEvent([mixed, SelfComposedDpEvent(sampled, 3)]), DELTA).epsilon
    assert led.epsilons()["a"] == pytest.approx(want, rel=1e-9)
    assert led.epsilons()["b"] == pytest.approx(epsilon(mixed, DELTA).epsilon, rel=1e-9)


def test_many_clients_many_rounds(tmp_path):
    """Benchmark-like sanity check: 1000 clients x 100 rounds stays cheap."""
    rng = np.random.default_rng(0)
    clients = np.arange(1000)
    led = new(tmp_path / "big.jsonl")
    counts = np.zeros(1000, dtype=int)
    for r in range(100):
        chosen = clients[rng.random(1000) < 0.5]
        receipt = led.spend(chosen, GaussianDpEvent(Z), label="upd", round=r)
        counts[chosen] += 1
        assert receipt.seq == led.head().seq
    rep = led.report(clients)
    want = {k: eps_k(k) for k in set(counts.tolist())}
    np.testing.assert_allclose(rep.epsilons, [want[k] for k in counts], rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sets(st.sampled_from("abcd"), min_size=1),
                          st.sampled_from([0.7, 1.5, 4.0]), st.integers(1, 3)), max_size=8))
def test_epsilon_never_decreases_and_stays_within_budget(ops):
    budget = 8.0
    led = new(None, budget=budget)
    shadow = {c: [] for c in "abcd"}
    for ids, z, n in ops:
        before = led.epsilons(list("abcd"))
        try:
            led.spend(sorted(ids), GaussianDpEvent(z), label="op", count=n)
            for c in ids:
                shadow[c].append(SelfComposedDpEvent(GaussianDpEvent(z), n))
        except BudgetExceededError:
            assert led.epsilons(list("abcd")) == before
        after = led.epsilons(list("abcd"))
        for c in "abcd":
            assert after[c] >= before[c] and after[c] <= budget
            want = epsilon(ComposedDpEvent(shadow[c]), DELTA).epsilon if shadow[c] else 0.0
            assert after[c] == pytest.approx(want, rel=1e-9)


# ------------------------------------------------------------- persistence
def test_reopen_gives_identical_state_and_keeps_appending(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path, budget=100.0)
    led.spend(["a", "b"], GaussianDpEvent(Z), label="upd", round=0, run_id="r1",
              meta={"backend": "numpy", "secure": False, "rng": [0, 3]})
    led.spend("a", GaussianDpEvent(Z), label="upd", count=2, round=1, step=4)
    again = Ledger.open(path)
    assert again.epsilons() == led.epsilons() and again.head() == led.head()
    assert (again.population_id, again.delta, again.epsilon_budget) == ("pop", DELTA, 100.0)
    assert again.discarded_bytes == 0 and again.stale_eps_after() == {}
    again.spend(["b", "c"], GaussianDpEvent(Z), label="upd", round=2)
    third = Ledger.open(path)
    assert third.epsilons() == pytest.approx({"a": eps_k(3), "b": eps_k(2), "c": eps_k(1)})
    header, *entries = [json.loads(x) for x in lines(path)]
    assert header["schema"] == SCHEMA and header["hash"] == entries[0]["prev_hash"]
    assert [e["seq"] for e in entries] == list(range(5))
    assert [e["client_seq"] for e in entries if e["client_id"] == "b"] == [0, 1]
    for e in entries:  # every hash is the canonical hash of the entry without it
        assert rehash(e)["hash"] == e["hash"]


def test_awkward_strings_and_unbounded_epsilon_round_trip(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    led.spend(["é\n%s", 12, "\"q\""], GaussianDpEvent(Z), label="50% %d\n", run_id="ü%",
              meta={"k": "%(x)s", "n": [1, 2.5, None]})
    led.spend("leaky", GaussianDpEvent(0.0), label="no noise")  # no budget: allowed, eps inf
    again = Ledger.open(path)
    assert again.epsilons() == led.epsilons() and again.epsilons()["leaky"] == math.inf
    assert again.client_ids == ("é\n%s", "12", '"q"', "leaky")
    assert json.loads(lines(path)[-1])["eps_after"] == "inf"


def test_replay_not_cache_is_the_authority(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    led.spend(["a", "b"], GaussianDpEvent(Z), label="upd")
    led.spend("a", GaussianDpEvent(Z), label="upd")
    header, *entries = [json.loads(x) for x in lines(path)]
    prev, client_prev, out = header["hash"], {}, [header]
    for e in entries:  # forge the caches and rebuild every chain
        e = rehash(dict(e, eps_after=0.0, prev_hash=prev,
                        client_prev_hash=client_prev.get(e["client_id"], header["hash"])))
        prev = client_prev[e["client_id"]] = e["hash"]
        out.append(e)
    path.write_text("".join(canonical(e) + "\n" for e in out), encoding="utf-8")
    with pytest.raises(LedgerHeadError, match="entry 2 has hash .* the journal was rewritten"):
        Ledger.open(path)  # the head record still names the real entry 2
    forge_head(path)  # without a ledger key, a forger can rewrite the head record too
    forged = Ledger.open(path)
    assert forged.epsilons() == pytest.approx({"a": eps_k(2), "b": eps_k(1)}, rel=1e-12)
    assert set(forged.stale_eps_after()) == {"a", "b"} and led.stale_eps_after() == {}


def test_create_refuses_an_existing_file(tmp_path):
    path = tmp_path / "l.jsonl"
    new(path).spend("a", GaussianDpEvent(Z), label="upd")
    data = path.read_bytes()
    with pytest.raises(LedgerError, match="already exists"):
        new(path)
    assert path.read_bytes() == data


def test_second_writer_is_refused(tmp_path):
    path = tmp_path / "l.jsonl"
    new(path)
    one, two = Ledger.open(path), Ledger.open(path)
    one.spend("a", GaussianDpEvent(Z), label="upd")
    data = path.read_bytes()
    with pytest.raises(LedgerError, match="changed"):
        two.spend("a", GaussianDpEvent(Z), label="upd")
    assert path.read_bytes() == data


@pytest.mark.parametrize("failures", [1, 100])
def test_failed_fsync_records_nothing(tmp_path, monkeypatch, failures):
    path = tmp_path / "l.jsonl"
    led = new(path)
    led.spend("a", GaussianDpEvent(Z), label="upd")
    data, eps, head = path.read_bytes(), led.epsilons(), led.head()
    real_fsync, calls = os.fsync, []

    def flaky_fsync(fd):
        calls.append(fd)
        if len(calls) <= failures:
            raise OSError(5, "simulated I/O error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", flaky_fsync)
    with pytest.raises(LedgerError, match=r"l.jsonl: cannot write the journal \(EIO: "
                       r"simulated I/O error\); nothing was recorded") as info:
        led.spend(["a", "b"], GaussianDpEvent(Z), label="upd")
    assert isinstance(info.value.__cause__, OSError)
    assert led.epsilons() == eps and led.head() == head
    assert path.read_bytes() == data  # the unacknowledged write was cut off
    if failures > 1:  # the disk still fails: every charge is refused, and records nothing
        with pytest.raises(LedgerError, match="EIO"):
            led.spend("b", GaussianDpEvent(Z), label="upd")
        assert path.read_bytes() == data and led.epsilons() == eps
        monkeypatch.setattr(os, "fsync", real_fsync)
    led.spend("b", GaussianDpEvent(Z), label="upd")  # the same ledger, once the disk works
    assert Ledger.open(path).epsilons() == pytest.approx({"a": eps_k(1), "b": eps_k(1)})


def test_torn_last_line_is_discarded_then_cut_off(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    led.spend(["a", "b"], GaussianDpEvent(Z), label="upd")
    good = path.read_bytes()
    before = led.epsilons()
    torn = b'{"batch_end":2,"client_id":"a","client_prev'
    with open(path, "ab") as f:
        f.write(torn)
    again = Ledger.open(path)
    assert again.epsilons() == before and again.head() == led.head()
    assert again.discarded_bytes == len(torn)
    again.spend("a", GaussianDpEvent(Z), label="upd")
    assert path.read_bytes().startswith(good)
    assert len(lines(path)) == 4 and all(json.loads(x) for x in lines(path))
    assert Ledger.open(path).epsilons() == pytest.approx({"a": eps_k(2), "b": eps_k(1)})


def test_incomplete_final_batch_is_discarded(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    led.spend("a", GaussianDpEvent(Z), label="upd")
    good, before = path.read_bytes(), led.epsilons()
    head = Path(str(path) + ".head").read_bytes()
    led.spend(["a", "b", "c"], GaussianDpEvent(Z), label="upd")
    first_of_batch = lines(path)[2]
    path.write_bytes(good + first_of_batch)  # whole lines, but the batch never completed
    with pytest.raises(LedgerHeadError, match="3 entries are missing"):
        Ledger.open(path)  # the batch had been committed: cutting it is tail loss
    Path(str(path) + ".head").write_bytes(head)  # a crash: the head record never moved
    again = Ledger.open(path)
    assert again.epsilons() == before and again.discarded_bytes == len(first_of_batch)
    again.spend("b", GaussianDpEvent(Z), label="upd")
    assert Ledger.open(path).epsilons() == pytest.approx({"a": eps_k(1), "b": eps_k(1)})


def _three_entry_ledger(path):
    led = new(path)
    for r in range(3):
        led.spend("a", GaussianDpEvent(Z), label="upd", round=r)
    return lines(path)


def test_edited_middle_line_is_corrupt(tmp_path):
    path = tmp_path / "l.jsonl"
    ls = _three_entry_ledger(path)
    assert b'"count":1,' in ls[2]
    ls[2] = ls[2].replace(b'"count":1,', b'"count":2,')
    path.write_bytes(b"".join(ls))
    with pytest.raises(LedgerCorruptError, match="line 3.*hash"):
        Ledger.open(path)


def test_edited_last_line_is_corrupt_not_torn(tmp_path):
    path = tmp_path / "l.jsonl"
    ls = _three_entry_ledger(path)
    ls[3] = ls[3].replace(b'"round":2', b'"round":9')
    path.write_bytes(b"".join(ls))
    with pytest.raises(LedgerCorruptError, match="line 4"):
        Ledger.open(path)


def test_deleted_middle_line_is_corrupt(tmp_path):
    path = tmp_path / "l.jsonl"
    ls = _three_entry_ledger(path)
    del ls[2]
    path.write_bytes(b"".join(ls))
    with pytest.raises(LedgerCorruptError, match="line 3.*seq"):
        Ledger.open(path)


def test_rehashed_edit_breaks_the_chain(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    for c in "abc":  # one entry per client: only the global chain links line 3 to line 4
        led.spend(c, GaussianDpEvent(Z), label="upd")
    ls = lines(path)
    e = json.loads(ls[2])
    e["count"] = 5
    ls[2] = (canonical(rehash(e)) + "\n").encode()
    path.write_bytes(b"".join(ls))
    with pytest.raises(LedgerCorruptError, match="line 4.*prev_hash"):
        Ledger.open(path)


def test_malformed_middle_line_is_corrupt(tmp_path):
    path = tmp_path / "l.jsonl"
    ls = _three_entry_ledger(path)
    ls[2] = b'{"seq": NaN}\n'
    path.write_bytes(b"".join(ls))
    with pytest.raises(LedgerCorruptError, match="line 3"):
        Ledger.open(path)


@pytest.mark.parametrize("schema, match", [("privkit.ledger/4", "newer"),
                                           ("other.thing/1", "unknown schema")])
def test_schema_mismatch_is_refused(tmp_path, schema, match):
    path = tmp_path / "l.jsonl"
    ls = _three_entry_ledger(path)
    header = rehash(dict(json.loads(ls[0]), schema=schema))
    ls[0] = (canonical(header) + "\n").encode()
    path.write_bytes(b"".join(ls))
    with pytest.raises(LedgerCorruptError, match=match):
        Ledger.open(path)


def test_pickle_payload_is_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "evil.jsonl"
    path.write_bytes(pickle.dumps(Evil(), protocol=0))
    with pytest.raises(LedgerCorruptError):
        Ledger.open(path)
    path.write_bytes(pickle.dumps(Evil()) + b"\n")
    with pytest.raises(LedgerCorruptError):
        Ledger.open(path)
    assert not marker.exists()


def test_atomic_write_bytes(tmp_path):
    path = tmp_path / "LATEST"
    atomic_write_bytes(path, b"one")
    atomic_write_bytes(path, b"two")
    assert path.read_bytes() == b"two" and os.listdir(tmp_path) == ["LATEST"]


# ---------------------------------------------------------------- rollback
def test_rollback_refused_unless_fork(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    empty = led.head()
    assert empty.seq == -1
    led.spend(["a", "b"], GaussianDpEvent(Z), label="upd")
    ckpt = led.head()
    assert led.verify_pointer(ckpt) == ckpt
    led.spend("a", GaussianDpEvent(Z), label="upd")
    with pytest.raises(LedgerRollbackError):
        led.verify_pointer(ckpt)
    with pytest.raises(LedgerRollbackError):
        led.verify_pointer(empty)
    with pytest.raises(LedgerMismatchError):
        led.verify_pointer(LedgerPointer(ckpt.seq, "0" * 64))
    with pytest.raises(LedgerMismatchError):
        led.verify_pointer(LedgerPointer(ckpt.seq + 5, ckpt.hash))
    eps_before, seq_before = led.epsilons(), led.head().seq
    forked = led.verify_pointer(LedgerPointer.from_dict(ckpt.to_dict()), fork=True, run_id="r2")
    assert forked.seq == seq_before + 1 and forked == led.head()
    after = led.epsilons()
    assert all(after[c] >= eps_before[c] for c in eps_before)
    again = Ledger.open(path)
    assert again.head() == forked and again.epsilons() == after
    with pytest.raises(LedgerRollbackError):
        again.verify_pointer(ckpt)
    with pytest.raises(LedgerMismatchError):
        new(None).verify_pointer(ckpt)


# ------------------------------------------------------------------- crash
def test_sigkill_at_random_times_never_loses_spend(tmp_path):
    path = tmp_path / "crash.jsonl"
    new(path)
    child = Path(__file__).with_name("_ledger_crash_child.py")
    root = str(Path(privkit.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rng = np.random.default_rng(1234)
    prev_eps, prev_seq = {}, -1
    for trial in range(5):
        proc = subprocess.Popen([sys.executable, str(child), str(path), str(trial), "300"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        try:
            if proc.stdout.readline().strip() != "ready":
                proc.kill()
                pytest.fail(f"child did not start: {proc.communicate(timeout=30)[1]}")
            try:
                proc.wait(timeout=float(rng.uniform(0.0, 0.3)))
            except subprocess.TimeoutExpired:
                pass
            proc.send_signal(signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
            assert "Traceback" not in err, err
        finally:
            if proc.poll() is None:
                proc.kill()
        released = [int(x) for x in out.split() if x.isdigit()]
        led = Ledger.open(path)  # verifies every chain
        eps, head = led.epsilons(), led.head().seq
        assert head >= max(released, default=-1) >= prev_seq  # write-ahead
        assert head >= prev_seq and set(eps) >= set(prev_eps)
        assert all(eps[c] >= prev_eps[c] for c in prev_eps)
        prev_eps, prev_seq = eps, head
    assert prev_seq > 0


# -------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, name", [
    ({"epsilon_budget": math.nan}, "epsilon_budget"),
    ({"epsilon_budget": math.inf}, "epsilon_budget"),
    ({"epsilon_budget": 0.0}, "epsilon_budget"),
    ({"delta": 0.0}, "delta"),
    ({"delta": 1.0}, "delta"),
    ({"delta": math.nan}, "delta"),
    ({"population_id": ""}, "population_id"),
    ({"method": "bogus"}, "method"),
    ({"neighboring_relation": "sideways"}, "neighboring_relation"),
])
def test_bad_create_arguments(tmp_path, kwargs, name):
    with pytest.raises(InvalidParameterError, match=name):
        Ledger.create(tmp_path / "l.jsonl", **{"population_id": "pop", "delta": DELTA, **kwargs})
    assert not (tmp_path / "l.jsonl").exists()


@pytest.mark.parametrize("args, kwargs, name", [
    (([], GaussianDpEvent(Z)), {}, "client_ids"),
    ((["a", "a"], GaussianDpEvent(Z)), {}, "client_ids"),
    (([True], GaussianDpEvent(Z)), {}, "client_ids"),
    (([1.5], GaussianDpEvent(Z)), {}, "client_ids"),
    ((["a"], "gaussian"), {}, "event"),
    ((["a"], GaussianDpEvent(math.nan)), {}, "noise_multiplier"),
    ((["a"], GaussianDpEvent(Z)), {"count": 0}, "count"),
    ((["a"], GaussianDpEvent(Z)), {"count": math.nan}, "count"),
    ((["a"], GaussianDpEvent(Z)), {"label": ""}, "label"),
    ((["a"], GaussianDpEvent(Z)), {"round": -1}, "round"),
    ((["a"], GaussianDpEvent(Z)), {"run_id": 3}, "run_id"),
    ((["a"], GaussianDpEvent(Z)), {"meta": {"x": math.nan}}, "meta"),
    ((["a"], GaussianDpEvent(Z)), {"meta": {2: "a", 10: "b"}}, "meta"),
])
def test_bad_spend_arguments_change_nothing(tmp_path, args, kwargs, name):
    path = tmp_path / "l.jsonl"
    led = new(path, budget=10.0)
    led.spend("b", GaussianDpEvent(Z), label="upd")
    data, eps = path.read_bytes(), led.epsilons()
    with pytest.raises(InvalidParameterError, match=name):
        led.spend(*args, **{"label": "upd", **kwargs})
    assert path.read_bytes() == data and led.epsilons() == eps


def test_composition_of_a_client_is_replayed():
    from privkit.events import GaussianDpEvent as G

    led = Ledger.create(None, population_id="c", delta=1e-5)
    led.spend(["a", "b"], G(2.0), label="r1")
    led.spend(["a"], G(2.0), label="r2", count=2)
    assert dict(led.composition("a").atoms) == {G(2.0): 3}
    assert dict(led.composition("b").atoms) == {G(2.0): 1}
    assert led.composition("never").atoms == ()
