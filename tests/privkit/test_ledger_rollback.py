"""A keyed head record cannot be rolled back by someone who can write the ledger's directory.

The three attacks of the audit, each followed by cutting the journal's last batch (which
lowers epsilon a from 3.709 to 2.943): (a) spoil a byte of the current slot, so that the
older slot, naming the batch before, is read; (b) raise the older slot's generation and
recompute its plain checksum; (c) write the older record as a one-line head file (the earlier
layout). Each is refused in every key mode (``key=``, ``PRIVKIT_LEDGER_KEY``,
``PRIVKIT_LEDGER_KEY_FILE``), and ``privkit ledger verify`` fails; the state a crash leaves
(a slot cut short, the journal one batch ahead of the other slot) still opens. The same holds
for head files written by the previous privkit (slot format 1), which stay readable.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import privkit
from privkit import _head
from privkit.cli import main
from privkit.errors import LedgerHeadError
from privkit.events import GaussianDpEvent
from privkit.ledger import Ledger

DELTA = 1e-5
KEY = b"rollback-test-key-0123456789abcd"
Z = GaussianDpEvent(2.0)
SLOT = _head.SLOT


def head_file(path) -> Path:
    return Path(str(path) + ".head")


@pytest.fixture(params=["argument", "env", "file"])
def key_mode(request, tmp_path, monkeypatch):
    """How the ledger key is given: ``key=`` (the keyword arguments returned), the key in
    ``PRIVKIT_LEDGER_KEY`` or a file named by ``PRIVKIT_LEDGER_KEY_FILE``."""
    monkeypatch.delenv(_head.KEY_ENV, raising=False)
    monkeypatch.delenv(_head.KEY_FILE_ENV, raising=False)
    if request.param == "env":
        monkeypatch.setenv(_head.KEY_ENV, KEY.decode())
    elif request.param == "file":
        key_file = tmp_path / "ledger.key"
        key_file.write_bytes(KEY + b"\n")
        monkeypatch.setenv(_head.KEY_FILE_ENV, str(key_file))
    return request.param, ({"key": KEY} if request.param == "argument" else {})


def three_batches(path, **kw):
    """A ledger with batches of 1, 2 and 3 entries; it, the journal after each batch and
    the head file after each batch (index 0: after creation)."""
    led = Ledger.create(path, population_id="pop", delta=DELTA,
                        created="2024-01-01T00:00:00+00:00", **kw)
    journals, heads = [path.read_bytes()], [head_file(path).read_bytes()]
    for ids in (["a"], ["a", "b"], ["a", "b", "c"]):
        led.spend(ids, Z, label="upd")
        journals.append(path.read_bytes())
        heads.append(head_file(path).read_bytes())
    return led, journals, heads


def slot_fields(data: bytes, i: int) -> list[bytes]:
    """The tab-separated fields of slot ``i`` of a head file."""
    return data[i * SLOT:(i + 1) * SLOT].split(b"\n", 1)[0].split(b"\t")


def gen_of(data: bytes, i: int) -> int:
    return int(slot_fields(data, i)[1])


def current_index(data: bytes) -> int:
    return max((0, 1), key=lambda i: gen_of(data, i))


def with_slot(data: bytes, i: int, fields: list[bytes], *, checksum: bool = True) -> bytes:
    """``data`` with slot ``i`` made of ``fields`` (the last, the plain checksum, recomputed
    over the others when ``checksum``), padded as privkit pads."""
    if checksum:
        fields = fields[:-1] + [hashlib.sha256(b"\t".join(fields[:-1])).hexdigest()[:32]
                                .encode()]
    line = b"\t".join(fields) + b"\n"
    slot = line + b" " * (SLOT - len(line))
    return data[:i * SLOT] + slot + data[(i + 1) * SLOT:]


def v1_head_file(current: _head.Head, current_gen: int, older: _head.Head,
                 key: bytes | None) -> bytes:
    """A two-slot head file as the previous privkit wrote it (slot format 1: the record with
    its MAC, over the record only, then the generation and a plain checksum)."""
    out = [b"", b""]
    for head, gen in ((current, current_gen), (older, current_gen - 1)):
        body = head.to_bytes(key).rstrip(b"\n") + b"\t%d" % gen
        line = body + b"\t" + hashlib.sha256(body).hexdigest()[:32].encode() + b"\n"
        out[gen % 2] = line + b" " * (SLOT - len(line))
    return out[0] + out[1]


def record_of(journal: bytes) -> _head.Head:
    """The head record of a journal as it is (its last entry, its size, its header)."""
    header, *entries = [json.loads(x) for x in journal.splitlines()]
    last = entries[-1] if entries else header
    return _head.Head(len(entries) - 1, last["hash"], len(journal), header["hash"])


def attack(kind: str, data: bytes, older: _head.Head) -> bytes:
    """The head file after one of the audit's attacks on the head file ``data`` (``older``:
    the record of the batch before, for the one-line layout)."""
    cur = current_index(data)
    if kind == "spoil-current":
        spoilt = bytearray(data)
        spoilt[cur * SLOT + 40] ^= 1  # inside the record: the checksum fails
        return bytes(spoilt)
    if kind == "raise-older-generation":
        fields = slot_fields(data, 1 - cur)
        fields[1] = b"%d" % (gen_of(data, cur) + 1)  # same parity: the slot stays in place
        return with_slot(data, 1 - cur, fields)
    if kind == "one-line":  # authentic, as an earlier privkit wrote it with the key
        return older.to_bytes(KEY)
    if kind == "copy-older-over-current":
        return data[(1 - cur) * SLOT:(2 - cur) * SLOT] * 2
    raise AssertionError(kind)


def verify_exit(path, mode, monkeypatch) -> int:
    """``privkit ledger verify`` with the key where the command finds it (the environment;
    for the ``key=`` mode, the key put there for the command)."""
    if mode != "argument":
        return main(["ledger", "verify", str(path)])
    with monkeypatch.context() as m:
        m.setenv(_head.KEY_ENV, KEY.decode())
        return main(["ledger", "verify", str(path)])


ATTACKS = {  # attack -> the kinds of refusal it may meet
    "spoil-current": {"spoilt"},
    "raise-older-generation": {"bad-mac"},
    "one-line": {"one-line"},
}


# ----------------------------------------------------------------- the audit's attacks
@pytest.mark.parametrize("kind", list(ATTACKS))
def test_rollback_attacks_on_a_keyed_head_record_are_refused(tmp_path, key_mode, kind,
                                                             capsys, monkeypatch):
    mode, kw = key_mode
    path = tmp_path / "l.jsonl"
    led, journals, heads = three_batches(path, **kw)
    assert led.epsilons()["a"] == pytest.approx(3.708634930511884)
    assert verify_exit(path, mode, monkeypatch) == 0  # the command itself works
    capsys.readouterr()
    head_file(path).write_bytes(attack(kind, heads[3], record_of(journals[2])))
    path.write_bytes(journals[2])  # and the journal's last batch cut
    with pytest.raises(LedgerHeadError) as info:
        Ledger.open(path, **kw)
    assert info.value.kind in ATTACKS[kind]
    msg = str(info.value)
    assert str(path) in msg and str(head_file(path)) in msg and "\n" not in msg
    assert verify_exit(path, mode, monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(head_file(path)) in err[0]
    assert path.read_bytes() == journals[2]  # nothing was written
    # an accepted loss is continued explicitly, and recorded
    rec = Ledger.recover(path, reason="accepted", **kw)
    assert json.loads(path.read_bytes().splitlines()[-1])["problem"] in ATTACKS[kind]
    assert Ledger.open(path, **kw).head() == rec.head()
    path.write_bytes(journals[2])
    # what the refusal prevents: the cut journal reports less spend
    head_file(path).unlink()
    monkeypatch.delenv(_head.KEY_ENV, raising=False)
    monkeypatch.delenv(_head.KEY_FILE_ENV, raising=False)
    assert Ledger.open(path).epsilons()["a"] == pytest.approx(2.943225239801373)


@pytest.mark.parametrize("kind", ["copy-older-over-current", "older-slot-saved-earlier",
                                  "slots-swapped", "older-slot-of-another-ledger",
                                  "newer-slot-of-another-ledger"])
def test_slots_that_privkit_never_writes_are_refused(tmp_path, key_mode, kind):
    """Non-consecutive generations, slots out of place, identical slots or slots of two
    journals: whole and authentic, but no write or crash of privkit leaves them."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    _, journals, heads = three_batches(path, **kw)
    data, cur = heads[3], current_index(heads[3])
    if kind == "copy-older-over-current":
        bad = attack(kind, data, record_of(journals[2]))
        path.write_bytes(journals[2])  # the journal cut to the older record
    elif kind == "older-slot-saved-earlier":  # from the head file after creation
        bad = data[:(1 - cur) * SLOT] + heads[0][(1 - cur) * SLOT:(2 - cur) * SLOT]
        bad += data[(2 - cur) * SLOT:]
        assert abs(gen_of(bad, 0) - gen_of(bad, 1)) > 1
    elif kind == "slots-swapped":
        bad = data[SLOT:] + data[:SLOT]
    else:  # a slot of another ledger under the same key, in place of the older one: of the
        # same generation (charged as often), or of the next one (charged once more)
        other = tmp_path / "o.jsonl"
        o = Ledger.create(other, population_id="other", delta=DELTA, **kw)
        batches = [["x"], ["x", "y"], ["x", "y", "z"]]
        for ids in batches + ([["w"]] if kind.startswith("newer") else []):
            o.spend(ids, Z, label="upd")
        odata = head_file(other).read_bytes()
        older = slice((1 - cur) * SLOT, (2 - cur) * SLOT)
        bad = data[:older.start] + odata[older] + data[older.stop:]
        assert gen_of(bad, 1 - cur) - gen_of(bad, cur) == (1 if kind.startswith("newer") else -1)
    head_file(path).write_bytes(bad)
    with pytest.raises(LedgerHeadError) as info:
        Ledger.open(path, **kw)
    assert info.value.kind in {"slots", "bad-mac"}, info.value
    assert str(head_file(path)) in str(info.value)
    # recovery (the journal is whole here) writes a head file that opens from then on
    rec = Ledger.recover(path, reason="the head file was tampered with", **kw)
    assert Ledger.open(path, **kw).head() == rec.head()


def test_without_the_cut_a_spoilt_slot_is_the_crash_case(tmp_path, key_mode):
    """Attack (a) alone (the journal whole): the state a crash leaves, accepted; the head
    record is rewritten and nothing is lost."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    led, journals, heads = three_batches(path, **kw)
    head_file(path).write_bytes(attack("spoil-current", heads[3], record_of(journals[2])))
    again = Ledger.open(path, **kw)
    assert again.epsilons() == led.epsilons() and again.head() == led.head()
    assert "3 entries ahead of its head record" in again.head_note
    assert Ledger.open(path, **kw).head_note is None  # repaired


# -------------------------------------------------------------------- the crash case
def test_a_slot_cut_short_with_the_journal_one_batch_ahead_opens(tmp_path, key_mode):
    """What a crash during a batch's slot write leaves: the journal holds the batch, the slot
    it was going to is partly written (a prefix of the new slot over the old one), and the
    other slot names the batch before."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    led, journals, heads = three_batches(path, **kw)
    before, after = heads[2], heads[3]
    target = current_index(after)  # the slot the last batch wrote
    assert target != current_index(before)
    torn = bytearray(before)
    torn[target * SLOT:target * SLOT + 100] = after[target * SLOT:target * SLOT + 100]
    head_file(path).write_bytes(bytes(torn))
    assert _head.read_head(str(head_file(path))).seq == 2  # the batch before
    again = Ledger.open(path, **kw)
    assert again.head() == led.head() and again.epsilons() == led.epsilons()
    assert "ahead of its head record" in again.head_note
    assert f"slot {target} (its checksum fails" in again.head_note
    assert _head.read_head(str(head_file(path))).seq == 5
    again.spend("d", Z, label="upd")
    assert Ledger.open(path, **kw).head().seq == 6


KILLER = """
import os, signal, sys
from privkit import _head
from privkit.events import GaussianDpEvent
from privkit.ledger import Ledger
where, real_pwrite = sys.argv[2], os.pwrite


def pwrite(fd, data, offset):  # a torn slot: a part of it written, then killed
    if os.readlink(f"/proc/self/fd/{fd}").endswith(".head"):
        real_pwrite(fd, data[:100], offset)
        os.kill(os.getpid(), signal.SIGKILL)
    return real_pwrite(fd, data, offset)


led = Ledger.open(sys.argv[1])
if where == "before-head":  # right after the batch's fsync, before the head record
    _head.write_head = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
os.pwrite = pwrite
led.spend(["a", "b"], GaussianDpEvent(2.0), label="upd")
"""


@pytest.mark.parametrize("where", ["in-slot", "before-head"])
def test_sigkill_of_a_keyed_writer_is_accepted(tmp_path, monkeypatch, where):
    monkeypatch.setenv(_head.KEY_ENV, KEY.decode())
    path = tmp_path / "l.jsonl"
    Ledger.create(path, population_id="pop", delta=DELTA).spend("a", Z, label="upd")
    root = str(Path(privkit.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", KILLER, str(path), where], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _head.read_head(str(head_file(path))).seq == 0
    led = Ledger.open(path)
    assert led.head().seq == 2 and set(led.epsilons()) == {"a", "b"}
    assert _head.read_head(str(head_file(path))).seq == 2  # the head record moved
    assert Ledger.open(path).head_note is None


# ------------------------------------------------- head files of the previous privkit
#: Slot 1 of a head file that the previous privkit wrote (``_slot_bytes`` of its
#: ``Head(5, "ab" * 32, 3153, "cd" * 32).to_bytes(KEY)`` at generation 3), padding left off.
PREVIOUS_SLOT = (
    b'{"hash":"' + b"ab" * 32 + b'","header_hash":"' + b"cd" * 32 + b'","key_id":'
    b'"7e7279bfccd1c162","mac":"4387b4f02943d2d1ea6c488fda8b9cd5cdeaa7e9da530bb0665df7dae7'
    b'0155e1","schema":"privkit.ledger-head/1","seq":5,"size":3153}\t3\t94b9f617a290305ea04'
    b'608e2207c4988\n')


def test_previous_format_is_what_the_previous_privkit_wrote(tmp_path):
    """The helper that writes slot format 1 writes the previous privkit's bytes, and this
    privkit reads them as format 1 and authenticates them with the key."""
    current, older = _head.Head(5, "ab" * 32, 3153, "cd" * 32), _head.Head(2, "ef" * 32, 1713,
                                                                           "cd" * 32)
    data = v1_head_file(current, 3, older, KEY)
    assert data[SLOT:] == PREVIOUS_SLOT + b" " * (SLOT - len(PREVIOUS_SLOT))
    path = tmp_path / "l.jsonl.head"
    path.write_bytes(data)
    found = _head.read_file(str(path))
    assert [(s.version, s.gen, s.head.seq) for s in found.whole()] == [(1, 2, 2), (1, 3, 5)]
    assert all(s.verifies(KEY) for s in found.whole())
    assert not found.whole()[1].verifies(b"another-key-0123456789abcdefghij")
    assert found.current().seq == 5 and found.current().key_id == _head.key_id(KEY)


def test_a_previous_keyed_head_file_opens_and_is_rewritten(tmp_path, key_mode):
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    led, journals, _ = three_batches(path, **kw)
    head_file(path).write_bytes(v1_head_file(record_of(journals[3]), 3,
                                             record_of(journals[2]), KEY))
    again = Ledger.open(path, **kw)
    assert again.epsilons() == led.epsilons() and again.head_note is None
    again.spend("d", Z, label="upd")  # the next write replaces it in the current format
    found = _head.read_file(str(head_file(path)))
    assert [s.version for s in found.whole()] == [2, 2] and found.current().seq == 6
    assert Ledger.open(path, **kw).head().seq == 6


@pytest.mark.parametrize("kind, refusal", [
    ("spoil-current", "spoilt"), ("raise-older-generation", "ambiguous"),
    ("one-line", "one-line"), ("copy-older-over-current", "ambiguous")])
def test_rollback_attacks_on_a_previous_keyed_head_file_are_refused(tmp_path, key_mode, kind,
                                                                    refusal, monkeypatch,
                                                                    capsys):
    """In slot format 1 the generation is not under the MAC, so (b) passes the MAC: it is
    refused because the current record would name an earlier entry than the other."""
    mode, kw = key_mode
    path = tmp_path / "l.jsonl"
    _, journals, _ = three_batches(path, **kw)
    older = record_of(journals[2])
    data = v1_head_file(record_of(journals[3]), 7, older, KEY)
    head_file(path).write_bytes(attack(kind, data, older))
    path.write_bytes(journals[2])
    with pytest.raises(LedgerHeadError) as info:
        Ledger.open(path, **kw)
    assert info.value.kind == refusal, info.value
    assert str(head_file(path)) in str(info.value)
    capsys.readouterr()
    assert verify_exit(path, mode, monkeypatch) == 2
    assert str(head_file(path)) in capsys.readouterr().err


def test_an_empty_previous_keyed_ledger_is_refused_with_the_way_on(tmp_path, key_mode):
    """Identical slots at seq -1 are what the previous privkit left in a new ledger, and what
    copying the older slot over the current one leaves after its first charge: refused, and
    the message says how to go on (recovery loses nothing when the journal is whole)."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    Ledger.create(path, population_id="pop", delta=DELTA, **kw)
    record = record_of(path.read_bytes())
    head_file(path).write_bytes(v1_head_file(record, 1, record, KEY)[:SLOT] * 2)
    with pytest.raises(LedgerHeadError, match="earlier privkit .*privkit ledger recover") as info:
        Ledger.open(path, **kw)
    assert info.value.kind == "ambiguous"
    rec = Ledger.recover(path, reason="the previous privkit's empty ledger", **kw)
    assert rec.head().seq == 0 and rec.epsilons() == {}
    assert Ledger.open(path, **kw).head_note is None


def test_keyless_ledgers_keep_the_previous_behaviour(tmp_path, monkeypatch):
    """Without a key nothing is authenticated: the one-line layout and a spoilt current slot
    read as before (the limitation is documented); such a cut journal opens."""
    monkeypatch.delenv(_head.KEY_ENV, raising=False)
    monkeypatch.delenv(_head.KEY_FILE_ENV, raising=False)
    path = tmp_path / "l.jsonl"
    _, journals, heads = three_batches(path)
    for data in (attack("spoil-current", heads[3], record_of(journals[2])),
                 record_of(journals[2]).to_bytes(None)):
        head_file(path).write_bytes(data)
        path.write_bytes(journals[2])
        assert Ledger.open(path).head().seq == 2


def test_a_new_ledger_replaces_an_earlier_creations_head_record(tmp_path, key_mode):
    """A crash while creating leaves a head record at seq -1 and no journal; creating the
    ledger again (another header: another time) writes a head file of its own, not a slot
    beside the other journal's record."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    Ledger.create(path, population_id="pop", delta=DELTA, created="2024-01-01T00:00:00+00:00",
                  **kw)
    path.unlink()  # as if the crash came before the journal was linked into place
    led = Ledger.create(path, population_id="pop", delta=DELTA,
                        created="2024-01-02T00:00:00+00:00", **kw)
    found = _head.read_file(str(head_file(path)))
    assert {s.head.header_hash for s in found.whole()} == {led.origin().hash}
    led.spend("a", Z, label="upd")
    assert Ledger.open(path, **kw).head().seq == 0
