"""The ledger's head record: rollback, tail loss, older copies and forgeries are refused on
open; a crash between the journal and its head record is not; recovery is explicit."""

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import privkit
from privkit import _head
from privkit.cli import main
from privkit.errors import (
    InvalidParameterError,
    LedgerCorruptError,
    LedgerError,
    LedgerHeadError,
    LedgerRollbackError,
)
from privkit.events import GaussianDpEvent
from privkit.ledger import Ledger

DELTA = 1e-5
KEY = b"k" * 32
Z = GaussianDpEvent(2.0)


def new(path, **kw):
    return Ledger.create(path, population_id="pop", delta=DELTA,
                         created="2024-01-01T00:00:00+00:00", **kw)


def head_file(path) -> Path:
    return Path(str(path) + ".head")


def head_of(path) -> dict:
    """The current record of a head file as written (the slot of the higher generation, with
    its ``gen`` and ``mac``; a file in the one-line layout is the record)."""
    data = head_file(path).read_bytes()
    if len(data) != 2 * _head.SLOT:
        return json.loads(data)
    slots = []
    for i in (0, 1):
        record, gen, mac, _check = data[i * _head.SLOT:(i + 1) * _head.SLOT].split(
            b"\n", 1)[0].split(b"\t")
        slots.append(json.loads(record) | {"gen": int(gen),
                                           "mac": None if mac == b"-" else mac.decode()})
    return max(slots, key=lambda s: s["gen"])


def canonical(d):
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def rehash(d):
    body = {k: v for k, v in d.items() if k != "hash"}
    return dict(body, hash=hashlib.sha256(canonical(body).encode()).hexdigest())


def forge_head(path, key=None):
    """A head record for the journal as it is now (anyone with write access; with ``key``,
    only a key holder)."""
    data = Path(path).read_bytes()
    header, *entries = [json.loads(x) for x in data.splitlines()]
    last = entries[-1] if entries else header
    _head.write_head(str(head_file(path)), _head.Head(
        len(entries) - 1, last["hash"], len(data), header["hash"]), key)


def three_batches(path, **kw):
    """A ledger with batches of 1, 2 and 3 entries; returns it and the journal after each."""
    led = new(path, **kw)
    copies = [Path(path).read_bytes()]
    for ids in (["a"], ["a", "b"], ["a", "b", "c"]):
        led.spend(ids, Z, label="upd")
        copies.append(Path(path).read_bytes())
    return led, copies


# ------------------------------------------------------------------------- the record
def test_head_record_follows_every_committed_batch(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    h = head_of(path)
    assert (h["seq"], h["hash"], h["size"]) == (-1, led.origin().hash, path.stat().st_size)
    assert h["mac"] is None and h["key_id"] is None and h["schema"] == _head.SCHEMA
    for ids in (["a"], ["a", "b", "c"]):
        receipt = led.spend(ids, Z, label="upd")
        h = head_of(path)
        assert (h["seq"], h["hash"]) == (receipt.seq, receipt.hash)
        assert h["size"] == path.stat().st_size and h["header_hash"] == led.origin().hash
    # the journal itself carries nothing of it (its format is unchanged)
    assert all("size" not in json.loads(x) for x in path.read_bytes().splitlines())
    assert sorted(os.listdir(tmp_path)) == ["l.jsonl", "l.jsonl.head"]  # no temporary left


def test_in_memory_ledger_has_no_head_record(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    new(None).spend("a", Z, label="upd")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------- rollback and tail loss
@pytest.mark.parametrize("cut, missing", [
    ("last-batch", 3),  # the last whole batch deleted
    ("to-header", 6),  # cut to the header
    ("older-copy", 5),  # replaced by the copy after the first batch
])
def test_journal_behind_its_head_record_is_refused(tmp_path, cut, missing):
    path = tmp_path / "l.jsonl"
    led, copies = three_batches(path)
    eps = led.epsilons()
    older = {"last-batch": copies[2], "to-header": copies[0], "older-copy": copies[1]}[cut]
    path.write_bytes(older)
    before = (path.read_bytes(), head_file(path).read_bytes())
    with pytest.raises(LedgerHeadError, match=f"{missing} entries are missing") as info:
        Ledger.open(path)
    msg = str(info.value)
    assert info.value.kind == "behind" and isinstance(info.value, LedgerRollbackError)
    assert str(path) in msg and str(head_file(path)) in msg and "\n" not in msg
    assert "seq 5" in msg and "privkit ledger recover" in msg
    assert (path.read_bytes(), head_file(path).read_bytes()) == before  # nothing changed
    # what the refusal prevents: the older journal alone reports less spend
    forge_head(path)
    assert Ledger.open(path).epsilons().get("a", 0.0) < eps["a"]


def test_rewritten_journal_is_refused_and_a_forger_needs_the_key(tmp_path, monkeypatch):
    """A chain re-hashed from start to end (here: every event's noise multiplied by 1e6,
    epsilon about 0) opens only with a head record written for it; with a ledger key only a
    key holder can write one."""
    monkeypatch.setenv(_head.KEY_ENV, KEY.decode())
    path = tmp_path / "l.jsonl"
    led, _ = three_batches(path)
    assert head_of(path)["mac"] is not None
    header, *entries = [json.loads(x) for x in path.read_bytes().splitlines()]
    prev, client_prev, out = header["hash"], {}, [header]
    for e in entries:
        event = dict(e["event"], noise_multiplier=e["event"]["noise_multiplier"] * 1e6)
        e = rehash(dict(e, event=event, eps_after=0.0, prev_hash=prev,
                        client_prev_hash=client_prev.get(e["client_id"], header["hash"])))
        prev = client_prev[e["client_id"]] = e["hash"]
        out.append(e)
    path.write_text("".join(canonical(e) + "\n" for e in out), encoding="utf-8")
    with pytest.raises(LedgerHeadError, match="the journal was rewritten") as info:
        Ledger.open(path)
    assert info.value.kind == "diverged"
    forge_head(path)  # a head record for the forgery, without the key
    with pytest.raises(LedgerHeadError, match="carries no MAC") as info:
        Ledger.open(path)
    assert info.value.kind == "unauthenticated"
    forge_head(path, key=b"x" * 32)  # with a key of the forger's own
    with pytest.raises(LedgerHeadError, match="does not verify with this ledger key"):
        Ledger.open(path)
    head_file(path).unlink()  # no head record at all
    with pytest.raises(LedgerHeadError, match="no head record .* a ledger key is set"):
        Ledger.open(path)
    # without a key, a forger who rewrites the head record too is not detected (the threat
    # model says so): the forged chain opens, with epsilon about 0
    monkeypatch.delenv(_head.KEY_ENV)
    forge_head(path)
    assert max(Ledger.open(path).epsilons().values()) < 1e-3 < min(led.epsilons().values())


def test_keys_from_the_environment_or_a_file_and_key_mismatch(tmp_path, monkeypatch):
    path = tmp_path / "l.jsonl"
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    monkeypatch.setenv(_head.KEY_FILE_ENV, str(key_file))
    new(path).spend("a", Z, label="upd")
    assert head_of(path)["key_id"] == _head.key_id(KEY)
    assert Ledger.open(path, key=KEY).head().seq == 0  # the file's key, newline ignored
    with pytest.raises(LedgerHeadError, match="does not verify") as info:
        Ledger.open(path, key=b"y" * 16)
    assert info.value.kind == "bad-mac"
    monkeypatch.delenv(_head.KEY_FILE_ENV)
    with pytest.raises(LedgerHeadError, match=f"is authenticated .*set {_head.KEY_ENV}"):
        Ledger.open(path)
    monkeypatch.setenv(_head.KEY_ENV, "short")
    with pytest.raises(InvalidParameterError, match=f"{_head.KEY_ENV} must be at least 16"):
        Ledger.open(path)
    monkeypatch.setenv(_head.KEY_FILE_ENV, str(key_file))
    with pytest.raises(InvalidParameterError, match="one source of the ledger key"):
        Ledger.open(path)
    monkeypatch.delenv(_head.KEY_ENV)
    monkeypatch.setenv(_head.KEY_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(LedgerError, match="cannot read the ledger key file"):
        Ledger.open(path)
    assert b"k" * 16 not in head_file(path).read_bytes()  # the key is never written


@pytest.mark.parametrize("damage, kind", [("garbage", "unreadable"), ("other", "other")])
def test_unreadable_or_foreign_head_record_is_refused(tmp_path, damage, kind):
    path = tmp_path / "l.jsonl"
    three_batches(path)
    if damage == "garbage":
        head_file(path).write_bytes(b"not json")
    else:  # the head record of another ledger
        other = tmp_path / "o.jsonl"
        Ledger.create(other, population_id="other", delta=DELTA)
        head_file(path).write_bytes(head_file(other).read_bytes())
    with pytest.raises(LedgerHeadError) as info:
        Ledger.open(path)
    assert info.value.kind == kind


def test_missing_journal_is_a_ledger_error_naming_it(tmp_path):
    path = tmp_path / "l.jsonl"
    with pytest.raises(LedgerError, match="no ledger at .*l.jsonl") as info:
        Ledger.open(path)
    assert not isinstance(info.value, FileNotFoundError)
    new(path).spend("a", Z, label="upd")
    path.unlink()
    with pytest.raises(LedgerError, match="its head record .* exists: the journal was deleted"):
        Ledger.open(path)


def test_a_deleted_journal_is_not_recreated(tmp_path):
    path = tmp_path / "l.jsonl"
    new(path).spend("a", Z, label="upd")
    head = head_file(path).read_bytes()
    path.unlink()
    with pytest.raises(LedgerError, match="says entries up to seq 0 were committed"):
        new(path)
    assert not path.exists() and head_file(path).read_bytes() == head
    # a head record at seq -1 (a crash while creating, or an empty ledger) is replaced
    empty = tmp_path / "e.jsonl"
    new(empty)
    empty.unlink()
    new(empty).spend("a", Z, label="upd")
    assert Ledger.open(empty).head().seq == 0


# ------------------------------------------------------------------ crashes and legacy
def test_journal_one_batch_ahead_is_accepted_and_repaired(tmp_path, caplog):
    """A crash after the batch's fsync and before the head record's replace."""
    path = tmp_path / "l.jsonl"
    led = new(path)
    led.spend("a", Z, label="upd")
    stale = head_file(path).read_bytes()
    led.spend(["a", "b"], Z, label="upd")
    head_file(path).write_bytes(stale)
    with caplog.at_level(logging.INFO, logger="privkit.ledger"):
        again = Ledger.open(path)
    assert again.head() == led.head() and again.epsilons() == led.epsilons()
    assert "2 entries ahead of its head record" in again.head_note
    assert head_of(path)["seq"] == led.head().seq  # repaired
    assert Ledger.open(path).head_note is None


def test_ledger_without_head_record_opens_says_so_and_gets_one(tmp_path, caplog):
    path = tmp_path / "l.jsonl"
    led, copies = three_batches(path)
    head_file(path).unlink()  # as written by a privkit before head records
    with caplog.at_level(logging.WARNING, logger="privkit.ledger"):
        old = Ledger.open(path)
    assert old.epsilons() == led.epsilons()
    assert "no head record" in old.head_note and "no head record" in caplog.text
    assert head_of(path)["seq"] == 5
    path.write_bytes(copies[2])  # from now on, a rollback is refused
    with pytest.raises(LedgerHeadError, match="3 entries are missing"):
        Ledger.open(path)


def test_failed_head_write_keeps_the_charge_and_refuses_until_reopened(tmp_path, monkeypatch):
    path = tmp_path / "l.jsonl"
    led = new(path)
    led.spend("a", Z, label="upd")
    real = _head.write_head

    def full_disk(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_head, "write_head", full_disk)
    with pytest.raises(LedgerError, match=r"durable in the journal .*\(ENOSPC: No space left"):
        led.spend(["a", "b"], Z, label="upd")
    with pytest.raises(LedgerError, match="reopen"):
        led.spend("c", Z, label="upd")
    monkeypatch.setattr(_head, "write_head", real)
    again = Ledger.open(path)  # the charge that raised is counted (over-count, never under)
    assert again.head().seq == 2 and set(again.epsilons()) == {"a", "b"}
    assert head_of(path)["seq"] == 2


KILLER = """
import os, signal, sys
from privkit import _head
from privkit.events import GaussianDpEvent
from privkit.ledger import Ledger
where = sys.argv[2]
real_write, real_replace, real_pwrite = os.write, os.replace, os.pwrite


def write(fd, data):  # kill once the head record's temporary file is being written
    if where == "in-temp" and os.readlink(f"/proc/self/fd/{fd}").endswith(".head.tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_write(fd, data)


def replace(src, dst):
    if where == "before-replace" and str(dst).endswith(".head"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)


def pwrite(fd, data, offset):  # a torn slot: a part of it written, then killed
    if where == "in-slot" and os.readlink(f"/proc/self/fd/{fd}").endswith(".head"):
        real_pwrite(fd, data[:100], offset)
        os.kill(os.getpid(), signal.SIGKILL)
    return real_pwrite(fd, data, offset)


led = Ledger.open(sys.argv[1])
if where == "before-head":  # right after the batch's fsync, before the head record
    _head.write_head = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
os.write, os.replace, os.pwrite = write, replace, pwrite
led.spend(["a", "b"], GaussianDpEvent(2.0), label="upd")
"""


@pytest.mark.parametrize("where, one_line", [("before-head", False), ("in-slot", False),
                                             ("before-head", True), ("in-temp", True),
                                             ("before-replace", True)])
def test_sigkill_between_journal_and_head_record(tmp_path, where, one_line):
    """A batch's head record goes into the slot not holding the current record (in place);
    a head file in the earlier one-line layout is replaced atomically. A kill at any point
    leaves a head record naming the batch before, which the next open accepts and moves."""
    path = tmp_path / "l.jsonl"
    new(path).spend("a", Z, label="upd")
    if one_line:  # as an earlier privkit wrote it
        head_file(path).write_bytes(_head.read_head(str(head_file(path))).to_bytes(None))
        assert head_of(path)["seq"] == 0
    root = str(Path(privkit.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", KILLER, str(path), where], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert head_of(path)["seq"] == 0  # the head record still names the batch before
    led = Ledger.open(path)  # the batch is durable: accepted, and the head record moved
    assert led.head().seq == 2 and set(led.epsilons()) == {"a", "b"}
    assert head_of(path)["seq"] == 2
    led.spend("c", Z, label="upd")  # and the next writer goes on (a stale temp file is reused)
    assert Ledger.open(path).head().seq == 3
    assert sorted(os.listdir(tmp_path)) == ["l.jsonl", "l.jsonl.head"]
    assert head_file(path).stat().st_size == 2 * _head.SLOT  # the two-slot layout from now on


def test_head_file_alternates_slots_and_reads_the_newest_whole_one(tmp_path):
    path = tmp_path / "l.jsonl"
    led = new(path)
    hf = str(head_file(path))
    slots = []
    for i in range(3):
        led.spend(f"c{i}", Z, label="upd")
        data = head_file(path).read_bytes()
        assert len(data) == 2 * _head.SLOT
        slots.append((data[:_head.SLOT], data[_head.SLOT:]))
    # each batch rewrote one slot only, the other one each time
    changed = [[a != b for a, b in zip(slots[i], slots[i + 1], strict=True)] for i in (0, 1)]
    assert changed in ([[True, False], [False, True]], [[False, True], [True, False]])
    assert _head.read_head(hf).seq == 2
    data = bytearray(head_file(path).read_bytes())
    newest = changed[1].index(True)
    data[newest * _head.SLOT + 40] ^= 1  # the newest slot spoilt: the one before is current
    head_file(path).write_bytes(bytes(data))
    assert _head.read_head(hf).seq == 1
    assert Ledger.open(path).head().seq == 2  # the journal one batch ahead: accepted, repaired
    assert _head.read_head(hf).seq == 2
    data = bytearray(head_file(path).read_bytes())
    data[40] ^= 1
    data[_head.SLOT + 40] ^= 1
    head_file(path).write_bytes(bytes(data))  # both spoilt: unreadable, said so
    with pytest.raises(_head.HeadUnreadable, match="neither slot"):
        _head.read_head(hf)


def test_readers_never_see_a_false_rollback_while_a_writer_appends(tmp_path):
    path = tmp_path / "l.jsonl"
    new(path)
    child = Path(__file__).with_name("_ledger_crash_child.py")
    root = str(Path(privkit.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(child), str(path), "3", "400"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        seqs = []
        for _ in range(40):
            seqs.append(Ledger.open(path).head().seq)  # never refused, never behind
        assert seqs == sorted(seqs)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert Ledger.open(path).head().seq >= seqs[-1]


# ------------------------------------------------------------------------- recovery
def test_recovery_is_explicit_recorded_and_logged(tmp_path, caplog):
    path = tmp_path / "l.jsonl"
    led, copies = three_batches(path)
    lost = led.head()
    path.write_bytes(copies[1])  # restored from an older backup
    with pytest.raises(InvalidParameterError, match="reason"):
        Ledger.recover(path, reason=" ")
    with caplog.at_level(logging.WARNING, logger="privkit.ledger"):
        rec = Ledger.recover(path, reason="restored from the backup of Monday")
    assert "recovered (behind)" in caplog.text and "Monday" in rec.head_note
    entry = json.loads(path.read_bytes().splitlines()[-1])
    assert entry["kind"] == "recover" and entry["problem"] == "behind"
    assert entry["head_record"] == {"seq": lost.seq, "hash": lost.hash,
                                    "size": len(copies[3])}
    assert entry["reason"] == "restored from the backup of Monday" and entry["seq"] == 1
    again = Ledger.open(path)  # continues from the journal as it was, plus the record
    assert again.head() == rec.head() and again.epsilons() == rec.epsilons()
    assert again.epsilons()["a"] < led.epsilons()["a"]  # the lost spend is not restored
    again.spend("a", Z, label="upd")
    assert Ledger.open(path).head().seq == 2
    with pytest.raises(LedgerError, match="nothing to recover"):
        Ledger.recover(path, reason="again")


def test_recovery_does_not_mend_a_corrupt_journal(tmp_path):
    path = tmp_path / "l.jsonl"
    three_batches(path)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b'"count":1', b'"count":3')
    path.write_bytes(b"".join(lines))
    with pytest.raises(LedgerCorruptError):
        Ledger.recover(path, reason="x")


def test_cli_verify_and_recover(tmp_path, capsys):
    path = tmp_path / "l.jsonl"
    led, copies = three_batches(path)
    assert main(["ledger", "verify", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["head_seq"] == 5 and out["clients"] == 3 and out["head_note"] is None
    path.write_bytes(copies[2])
    assert main(["ledger", "verify", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and "3 entries are missing" in err[0]
    assert main(["ledger", "recover", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--accept-rollback must be given" in err[0]
    assert path.read_bytes() == copies[2]
    assert main(["ledger", "recover", str(path), "--accept-rollback", "--reason", "disk"]) == 0
    out = capsys.readouterr().out
    assert "recovered" in out and "recover entry seq 3" in out
    assert Ledger.open(path).head().seq == 3
