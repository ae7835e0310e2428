"""Deferred durability: ``Ledger.spend(..., durable=False)``, ``Ledger.deferred()`` and
``Ledger.sync()``.

A deferred charge is checked against the budget and counted at once, and written at the next
sync together with every charge deferred before it: one write, one fsync and one head-record
move. Everything the ledger tells (pointers, epsilons, entries, a receipt's hash) is durable.
Without a key the journal is byte for byte what durable charges write; with one, every batch
of a write but its last is MACed as "the write goes on", so a write cut short is ignored like
a torn tail and the head record's "at most one write ahead" rule still holds. SIGKILLed
writers never leave a published seq beyond the journal.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import privkit
from privkit import _head, _journal
from privkit.errors import BudgetExceededError, LedgerError, LedgerHeadError
from privkit.events import GaussianDpEvent
from privkit.ledger import Ledger, LedgerPointer

DELTA = 1e-5
Z = GaussianDpEvent(2.0)
KEY = b"deferred-durability-key-0123456789"
CREATED = "2024-01-01T00:00:00+00:00"
CHARGES = [(["a"], 1), (["a", "b"], 2), (["b", "c"], 3), (["a", "b", "c"], 4)]


@pytest.fixture(autouse=True)
def _no_key_from_the_environment(monkeypatch):
    monkeypatch.delenv(_head.KEY_ENV, raising=False)
    monkeypatch.delenv(_head.KEY_FILE_ENV, raising=False)


def new(path, **kw) -> Ledger:
    return Ledger.create(path, population_id="pop", delta=DELTA, created=CREATED, **kw)


def charge_all(led: Ledger, charges=CHARGES, **kw) -> list:
    return [led.spend(ids, Z, label="round", round=r, **kw) for ids, r in charges]


def head_file(path: Path) -> Path:
    return Path(str(path) + ".head")


# ------------------------------------------------------------------------- the API
def test_deferred_charges_count_at_once_and_reach_disk_at_the_sync(tmp_path):
    ref = tmp_path / "durable.jsonl"
    charge_all(new(ref))
    path = tmp_path / "deferred.jsonl"
    led = new(path)
    empty = path.read_bytes()
    receipts = charge_all(led, durable=False)
    assert led.pending == 1 + 2 + 2 + 3 and not any(r.durable for r in receipts)
    assert path.read_bytes() == empty  # nothing written yet
    assert [r.seq for r in receipts] == [0, 2, 4, 7]  # seqs are known at once
    assert "pending=8" in repr(led)
    assert led.sync() == LedgerPointer(7, Ledger.open(ref).head().hash)
    assert led.pending == 0 and all(r.durable for r in receipts)
    # one charge is one batch whatever the writes: the same bytes as durable charges
    assert path.read_bytes() == ref.read_bytes()
    assert head_file(path).read_bytes() != b""
    assert Ledger.open(path).epsilons() == Ledger.open(ref).epsilons() == led.epsilons()
    assert led.sync().seq == 7  # nothing deferred: a no-op


def test_the_budget_counts_deferred_charges(tmp_path):
    one = privkit.epsilon(Z, DELTA).epsilon
    three = privkit.epsilon(privkit.SelfComposedDpEvent(Z, 3), DELTA).epsilon
    led = new(tmp_path / "l.jsonl", epsilon_budget=three * (1 + 1e-9))
    with led.deferred():
        for r in range(3):
            led.spend(["a"], Z, label="round", round=r)
        assert bool(led.would_exceed(["a"], Z)[0])
        with pytest.raises(BudgetExceededError, match="nothing was recorded"):
            led.spend(["a"], Z, label="round", round=3)
        assert led.pending == 3
    assert led.epsilons()["a"] == pytest.approx(three) and three > one
    assert Ledger.open(tmp_path / "l.jsonl").head().seq == 2


def test_one_write_and_one_head_move_per_sync(tmp_path, monkeypatch):
    syncs: list[str] = []
    real_fsync, real_datasync = os.fsync, _head._datasync
    monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(_head, "_datasync",
                        lambda fd: (syncs.append("datasync"), real_datasync(fd))[1])
    led = new(tmp_path / "l.jsonl")
    syncs.clear()
    with led.deferred():
        for r in range(10):
            led.spend(["a", "b"], Z, label="round", round=r)
        assert syncs == []
    assert syncs == ["fsync", "datasync"]  # the journal's write, the head record's slot
    syncs.clear()
    charge_all(led)  # durable: a write per charge
    assert syncs == ["fsync", "datasync"] * len(CHARGES)


@pytest.mark.parametrize("read", [
    "head", "epsilons", "report", "composition", "entries_since", "fork", "receipt.hash",
    "receipt.pointer", "receipt.epsilons"])
def test_whatever_the_ledger_tells_is_durable(tmp_path, read):
    path = tmp_path / "l.jsonl"
    led = new(path)
    receipt = charge_all(led, durable=False)[-1]
    assert led.pending and Ledger.open(path).head().seq == -1
    {"head": led.head, "epsilons": led.epsilons, "report": led.report,
     "composition": lambda: led.composition("a"),
     "entries_since": lambda: led.entries_since(led.origin()),
     "fork": lambda: led.verify_pointer(led.origin(), fork=True),
     "receipt.hash": lambda: receipt.hash, "receipt.pointer": lambda: receipt.pointer,
     "receipt.epsilons": lambda: receipt.epsilons}[read]()
    assert led.pending == 0 and receipt.durable
    assert Ledger.open(path).head().seq >= receipt.seq


def test_deferred_blocks_nest_and_the_outermost_syncs_even_on_an_error(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    with led.deferred():
        led.spend(["a"], Z, label="round", round=1)
        with led.deferred():
            led.spend(["b"], Z, label="round", round=2)
        assert led.pending == 2  # the inner block does not sync
    assert led.pending == 0 and Ledger.open(path).head().seq == 1
    with pytest.raises(ZeroDivisionError):
        with led.deferred():
            led.spend(["c"], Z, label="round", round=3)
            raise ZeroDivisionError  # an error may carry a release-derived number: sync first
    assert led.pending == 0 and Ledger.open(path).head().seq == 2


def test_a_durable_charge_writes_what_was_deferred_before_it(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    with led.deferred():
        first = led.spend(["a"], Z, label="round", round=1)
        second = led.spend(["b"], Z, label="round", round=2, durable=True)
        assert first.durable and second.durable and led.pending == 0
        assert Ledger.open(path).head().seq == 1
        led.spend(["c"], Z, label="round", round=3)
        assert led.pending == 1
    assert led.spend(["d"], Z, label="round", round=4, durable=False).durable is False
    assert led.pending == 1  # outside a block: deferred until the next sync
    led.sync()


def test_a_failed_sync_records_nothing_and_is_retried(tmp_path, monkeypatch):
    ref = tmp_path / "ref.jsonl"
    charge_all(new(ref))
    path = tmp_path / "l.jsonl"
    led = new(path)
    empty = (path.read_bytes(), head_file(path).read_bytes())
    receipts = charge_all(led, durable=False)
    real = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(LedgerError, match="ENOSPC"):
        led.sync()
    assert (path.read_bytes(), head_file(path).read_bytes()) == empty  # the write was cut off
    assert led.pending == 8 and not receipts[-1].durable
    # a durable charge that fails is dropped; the deferred ones before it stay deferred
    with pytest.raises(LedgerError, match="ENOSPC"):
        led.spend(["z"], Z, label="round", round=9)
    assert "z" not in led.client_ids and led.pending == 8
    monkeypatch.setattr(os, "fsync", real)
    assert led.sync().seq == 7 and receipts[-1].durable
    assert path.read_bytes() == ref.read_bytes()


def test_a_receipt_of_a_charge_never_written_says_so(tmp_path, monkeypatch):
    led = new(tmp_path / "l.jsonl")
    receipt = led.spend(["a"], Z, label="round", durable=False)
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    with pytest.raises(LedgerError, match="EIO"):
        receipt.hash  # noqa: B018 - the property syncs
    assert not receipt.durable


def test_an_in_memory_ledger_defers_and_syncs_alike():
    led = new(None)
    with led.deferred():
        receipts = charge_all(led)
        assert led.pending == 8
    assert led.pending == 0 and receipts[-1].pointer == led.head()


# -------------------------------------------------------------------- with a key
def batches(path: Path) -> list[list[dict]]:
    import json

    lines = [json.loads(x) for x in path.read_bytes().splitlines()[1:]]
    out: list[list[dict]] = []
    for e in lines:
        if not out or out[-1][-1]["seq"] == out[-1][-1]["batch_end"]:
            out.append([])
        out[-1].append(e)
    return out


def body(e: dict) -> str:
    return _journal.canonical_json({k: v for k, v in e.items() if k not in ("hash", "mac")})


def test_a_keyed_write_macs_every_batch_but_its_last_as_going_on(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path, key=KEY)
    led.spend(["x"], Z, label="alone")  # a durable charge: a write of one batch
    with led.deferred():
        charge_all(led)
    got = batches(path)
    assert [len(b) for b in got] == [1, 1, 2, 2, 3]  # still one batch per charge
    ends = [b[-1] for b in got]
    more = [e["mac"] == _journal.batch_mac(KEY, body(e), True) for e in ends]
    last = [e["mac"] == _journal.batch_mac(KEY, body(e)) for e in ends]
    assert more == [False, True, True, True, False] and last == [True, False, False, False, True]
    again = Ledger.open(path, key=KEY)
    assert again.epsilons() == led.epsilons() and again.head() == led.head()


@pytest.mark.parametrize("keyed", [True, False])
def test_a_write_cut_short_is_ignored_with_a_key_and_counted_without(tmp_path, keyed):
    """A crash in the middle of a write of three deferred batches (the head record names the
    write before): with a key, the whole write is ignored like a torn tail and cut off before
    the next append; without, the whole batches it left count (over, never under)."""
    kw = {"key": KEY} if keyed else {}
    path = tmp_path / "l.jsonl"
    led = new(path, **kw)
    led.spend(["a"], Z, label="before", round=0)
    before = (path.read_bytes(), head_file(path).read_bytes())
    with led.deferred():
        charge_all(led, CHARGES[1:])
    whole = path.read_bytes()
    cut = before[0] + b"".join(whole[len(before[0]):].splitlines(keepends=True)[:4])  # 2 batches
    path.write_bytes(cut)
    head_file(path).write_bytes(before[1])
    again = Ledger.open(path, **kw)
    if keyed:
        assert again.head().seq == 0 and again.discarded_bytes == len(cut) - len(before[0])
        assert again.epsilons() == {"a": privkit.epsilon(Z, DELTA).epsilon}
    else:
        assert again.head().seq == 4 and again.discarded_bytes == 0  # rounds 2 and 3 count
    again.spend(["d"], Z, label="after", round=5)  # cuts the ignored write off first
    final = Ledger.open(path, **kw)
    assert final.composition("d").atoms and final.head() == again.head()


def test_a_crash_between_a_keyed_write_and_its_head_record_opens(tmp_path):
    """The write of several batches is durable but the head record still names the write
    before: one write ahead, what a crash leaves, opens and moves the head record; an older
    head record, two writes behind, is refused (``ahead``), as a batch ahead always was."""
    path = tmp_path / "l.jsonl"
    led = new(path, key=KEY)
    led.spend(["a"], Z, label="before", round=0)
    two_behind = head_file(path).read_bytes()
    led.spend(["b"], Z, label="before", round=0)
    one_behind = head_file(path).read_bytes()
    with led.deferred():
        charge_all(led)
    head_file(path).write_bytes(one_behind)
    again = Ledger.open(path, key=KEY)
    assert again.head() == led.head() and "head record moved" in again.head_note
    head_file(path).write_bytes(two_behind)
    with pytest.raises(LedgerHeadError) as exc:
        Ledger.open(path, key=KEY)
    assert exc.value.kind == "ahead"


def test_a_continuing_mac_cannot_end_a_write(tmp_path):
    """Cutting a keyed write after a batch MACed as "the write goes on" and presenting the
    rest as whole is not possible: the cut write is ignored, and with the head record naming
    the whole write the journal is behind it (refused)."""
    path = tmp_path / "l.jsonl"
    led = new(path, key=KEY)
    with led.deferred():
        charge_all(led)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:4]))  # header, 1 + 2 entries: two batches of the write
    with pytest.raises(LedgerHeadError) as exc:
        Ledger.open(path, key=KEY)
    assert exc.value.kind == "behind"


# ---------------------------------------------------------------------- SIGKILL
@pytest.mark.parametrize("keyed", [False, True])
def test_sigkill_never_leaves_a_published_charge_behind(tmp_path, keyed, monkeypatch):
    """A writer defers its charges, syncs at random points and only then prints the seq it
    publishes; it is SIGKILLed at random moments, five times. After each kill the ledger opens
    (chains and, with a key, MACs verify), holds every published seq, and no client's epsilon
    decreased; the next writer goes on."""
    path = tmp_path / "crash.jsonl"
    if keyed:
        monkeypatch.setenv(_head.KEY_ENV, KEY.decode())
    new(path)
    child = Path(__file__).with_name("_ledger_deferred_child.py")
    root = str(Path(privkit.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rng = np.random.default_rng(99 + keyed)
    prev_eps: dict[str, float] = {}
    prev_seq, published_any = -1, False
    for trial in range(5):
        proc = subprocess.Popen([sys.executable, str(child), str(path), str(trial), "400"],
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
        published = [int(x.split()[1]) for x in out.splitlines() if x.startswith("published")]
        published_any |= bool(published)
        led = Ledger.open(path)  # verifies every chain (and MAC)
        eps, head = led.epsilons(), led.head().seq
        assert head >= max(published, default=-1)  # nothing published beyond the journal
        assert [e["seq"] for e in led.entries_since(led.origin())] == list(range(head + 1))
        assert head >= prev_seq and all(eps[c] >= prev_eps[c] for c in prev_eps)
        prev_eps, prev_seq = eps, head
    assert published_any and prev_seq > 0
