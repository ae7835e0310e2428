"""With a ledger key every batch of the journal carries a MAC, so no batch can be forged.

The gap the head record alone left: someone who can write the directory makes the record of
the batch before current again (spoils the current slot, or puts back an older copy of it),
cuts the journal's last batch and appends a cheaper one of their own, hash-chained as privkit
chains (anyone can compute the hashes). The journal is then one batch ahead of the surviving
record, which is what a crash leaves, so the head record cannot tell. The batch's MAC can:
each such forgery is refused in every key mode (``key=``, ``PRIVKIT_LEDGER_KEY``,
``PRIVKIT_LEDGER_KEY_FILE``), as is a forged batch appended after an intact head record and a
journal more than one batch ahead of its record; the crash case still opens. Without a key
nothing changes: a keyless journal is byte for byte what the previous privkit wrote.
"""

import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import privkit
from privkit import _head, _journal
from privkit.cli import main
from privkit.errors import LedgerCorruptError, LedgerError, LedgerHeadError
from privkit.events import GaussianDpEvent
from privkit.ledger import SCHEMA, SCHEMA_KEYED, Ledger

DELTA = 1e-5
KEY = b"batch-mac-test-key-0123456789abc"
OTHER_KEY = b"another-key-0123456789abcdefghij"
Z = GaussianDpEvent(2.0)
SLOT = _head.SLOT
EPS_A = 3.708634930511884  # epsilon of client a after the three batches (three uses)


def head_file(path) -> Path:
    return Path(str(path) + ".head")


def canonical(d) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


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


@pytest.fixture
def no_key(monkeypatch):
    monkeypatch.delenv(_head.KEY_ENV, raising=False)
    monkeypatch.delenv(_head.KEY_FILE_ENV, raising=False)


def three_batches(path, **kw):
    """A ledger with batches of 1, 2 and 3 entries (lines 2, 3-4 and 5-7); it, the journal
    after each batch and the head file after each batch (index 0: after creation)."""
    led = Ledger.create(path, population_id="pop", delta=DELTA,
                        created="2024-01-01T00:00:00+00:00", **kw)
    journals, heads = [path.read_bytes()], [head_file(path).read_bytes()]
    for ids in (["a"], ["a", "b"], ["a", "b", "c"]):
        led.spend(ids, Z, label="upd")
        journals.append(path.read_bytes())
        heads.append(head_file(path).read_bytes())
    return led, journals, heads


def entries(journal: bytes) -> list[dict]:
    return [json.loads(x) for x in journal.splitlines()]


def forge_batch(journal: bytes, ids, mac: str) -> bytes:
    """``journal`` and a batch charging ``ids`` one use of a Gaussian of noise multiplier 1e6
    (epsilon about 0), chained as privkit chains (global and per-client links, seq,
    batch_end, hashes: what anyone can compute), its last entry carrying a MAC: ``"none"``,
    ``"copied"`` (the journal's last MAC), ``"other-key"`` (made with another key, over this
    entry) or ``"real-key"`` (made with the ledger key: what only a key holder can do)."""
    header, *old = entries(journal)
    links = {e["client_id"]: (e["client_seq"] + 1, e["hash"]) for e in old
             if e["kind"] == "spend"}
    prev, first, out = (old[-1]["hash"] if old else header["hash"]), len(old), []
    for k, cid in enumerate(ids):
        cseq, cprev = links.get(cid, (0, header["hash"]))
        e = {"batch_end": first + len(ids) - 1, "client_id": cid, "client_prev_hash": cprev,
             "client_seq": cseq, "count": 1, "eps_after": None,
             "event": {"noise_multiplier": 1e6, "type": "dp_accounting.dp_event:GaussianDpEvent"},
             "kind": "spend", "label": "upd", "meta": None, "prev_hash": prev, "round": None,
             "run_id": None, "seq": first + k, "step": None}
        if k == len(ids) - 1 and mac != "none":
            if mac == "copied":
                e["mac"] = next(x["mac"] for x in reversed(old) if "mac" in x)
            else:
                e["mac"] = _journal.batch_mac(KEY if mac == "real-key" else OTHER_KEY,
                                              canonical(e))
        e["hash"] = hashlib.sha256(canonical(e).encode()).hexdigest()
        prev = e["hash"]
        out.append(e)
    return journal + b"".join((canonical(e) + "\n").encode() for e in out)


def current_index(data: bytes) -> int:
    gens = [int(data[i * SLOT:(i + 1) * SLOT].split(b"\t")[1]) for i in (0, 1)]
    return 0 if gens[0] > gens[1] else 1


def spoil_current(data: bytes) -> bytes:
    spoilt = bytearray(data)
    spoilt[current_index(data) * SLOT + 40] ^= 1  # inside the record: the checksum fails
    return bytes(spoilt)


def verify_exit(path, mode, monkeypatch) -> int:
    """``privkit ledger verify`` with the key where the command finds it (the environment;
    for the ``key=`` mode, the key put there for the command)."""
    if mode != "argument":
        return main(["ledger", "verify", str(path)])
    with monkeypatch.context() as m:
        m.setenv(_head.KEY_ENV, KEY.decode())
        return main(["ledger", "verify", str(path)])


def epsilon_a_without_key(path, monkeypatch) -> float:
    """What the journal as it is would report if nothing were checked (no key, no head)."""
    head_file(path).unlink()
    with monkeypatch.context() as m:
        m.delenv(_head.KEY_ENV, raising=False)
        m.delenv(_head.KEY_FILE_ENV, raising=False)
        return Ledger.open(path).epsilons()["a"]


def assert_batch_mac_refusal(path, kw, lineno: int) -> LedgerHeadError:
    with pytest.raises(LedgerHeadError) as info:
        Ledger.open(path, **kw)
    msg = str(info.value)
    assert info.value.kind == "batch-mac", msg
    assert msg.startswith(f"{path}: line {lineno}: the batch ending at seq ") and "\n" not in msg
    return info.value


# --------------------------------------------------------------------------- the attack
@pytest.mark.parametrize("mac", ["none", "copied", "other-key"])
@pytest.mark.parametrize("how", ["spoil-current-slot", "older-copy-of-current-slot"])
def test_a_forged_batch_after_a_rolled_back_head_record_is_refused(tmp_path, key_mode, how, mac,
                                                                   monkeypatch, capsys):
    """The attack: make the record of batch 2 current again, cut batch 3, append a cheaper
    batch 3 of one's own. The journal is one batch ahead of the surviving record, as after a
    crash; the forged batch's MAC is what refuses it."""
    mode, kw = key_mode
    path = tmp_path / "l.jsonl"
    led, journals, heads = three_batches(path, **kw)
    assert led.epsilons()["a"] == pytest.approx(EPS_A)
    rolled_back = spoil_current(heads[3]) if how == "spoil-current-slot" else heads[2]
    assert _head.read_head(str(head_file(path))).seq == 5
    forged = forge_batch(journals[2], ["a", "b", "c"], mac)
    head_file(path).write_bytes(rolled_back)
    path.write_bytes(forged)
    assert _head.read_head(str(head_file(path))).seq == 2  # the record before the cut batch
    err = assert_batch_mac_refusal(path, kw, 7)
    assert ("carries no MAC" if mac == "none" else "MAC that this ledger key does not give") \
        in str(err)
    assert path.read_bytes() == forged and head_file(path).read_bytes() == rolled_back
    capsys.readouterr()
    assert verify_exit(path, mode, monkeypatch) == 2
    out = capsys.readouterr().err.strip().splitlines()
    assert len(out) == 1 and f"{path}: line 7" in out[0]
    # the forgery is otherwise sound: a key holder's MAC on the same batch opens
    path.write_bytes(forge_batch(journals[2], ["a", "b", "c"], "real-key"))
    assert Ledger.open(path, **kw).head().seq == 5
    # and what the refusal prevents: the forged journal reports less spend
    path.write_bytes(forged)
    assert epsilon_a_without_key(path, monkeypatch) < 0.8 * EPS_A


@pytest.mark.parametrize("mac", ["none", "copied", "other-key"])
def test_a_forged_batch_after_an_intact_head_record_is_refused(tmp_path, key_mode, mac,
                                                               monkeypatch, capsys):
    """A batch appended after the current record (the journal one batch ahead of an intact
    head file): accepted before only because a crash leaves the same."""
    mode, kw = key_mode
    path = tmp_path / "l.jsonl"
    _, journals, heads = three_batches(path, **kw)
    forged = forge_batch(journals[3], ["d"], mac)
    path.write_bytes(forged)
    err = assert_batch_mac_refusal(path, kw, 8)
    assert "seq 6 (from byte " + str(len(journals[3])) + ")" in str(err)
    assert head_file(path).read_bytes() == heads[3]  # the head record did not move
    capsys.readouterr()
    assert verify_exit(path, mode, monkeypatch) == 2
    assert f"{path}: line 8" in capsys.readouterr().err
    path.write_bytes(forge_batch(journals[3], ["d"], "real-key"))  # a key holder's opens
    assert Ledger.open(path, **kw).head().seq == 6


def test_a_batch_mac_is_no_slot_mac_and_names_its_batch(tmp_path, key_mode):
    """A MAC of the ledger key over the same bytes without the batch prefix (what another
    use of the key could give) is refused: the prefix separates the domains."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    _, journals, _ = three_batches(path, **kw)
    forged = forge_batch(journals[3], ["d"], "none")
    last = json.loads(forged.splitlines()[-1])
    del last["hash"]
    last["mac"] = hmac.new(KEY, canonical(last).encode(), hashlib.sha256).hexdigest()
    last["hash"] = hashlib.sha256(canonical(last).encode()).hexdigest()
    path.write_bytes(journals[3] + (canonical(last) + "\n").encode())
    assert_batch_mac_refusal(path, kw, 8)


# ------------------------------------------------------------------------ the crash case
def test_the_crash_case_still_opens_and_moves_the_head_forward(tmp_path, key_mode):
    """The last batch written and synced, the slot it was going to cut short (a prefix of the
    new slot over the old one): the batch's MAC verifies, so it opens, the head record moves,
    and the writer goes on."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    led, _, heads = three_batches(path, **kw)
    before, after = heads[2], heads[3]
    target = current_index(after)
    torn = bytearray(before)
    torn[target * SLOT:target * SLOT + 100] = after[target * SLOT:target * SLOT + 100]
    head_file(path).write_bytes(bytes(torn))
    assert _head.read_head(str(head_file(path))).seq == 2
    again = Ledger.open(path, **kw)
    assert again.head() == led.head() and again.epsilons() == led.epsilons()
    assert "ahead of its head record" in again.head_note
    assert _head.read_head(str(head_file(path))).seq == 5
    again.spend("d", Z, label="upd")
    assert Ledger.open(path, **kw).head().seq == 6


KILLER = """
import os, signal, sys
from privkit import _head
from privkit.events import GaussianDpEvent
from privkit.ledger import Ledger
real_pwrite = os.pwrite


def pwrite(fd, data, offset):  # a torn slot: a part of it written, then killed
    if os.readlink(f"/proc/self/fd/{fd}").endswith(".head"):
        real_pwrite(fd, data[:100], offset)
        os.kill(os.getpid(), signal.SIGKILL)
    return real_pwrite(fd, data, offset)


kw = {"key": sys.argv[2].encode()} if sys.argv[2] else {}
led = Ledger.open(sys.argv[1], **kw)
os.pwrite = pwrite
led.spend(["a", "b"], GaussianDpEvent(2.0), label="upd")
"""


def test_sigkill_during_the_slot_write_of_a_keyed_writer_is_accepted(tmp_path, key_mode):
    """A writer killed inside the head record's slot write, after the batch's fsync."""
    mode, kw = key_mode
    path = tmp_path / "l.jsonl"
    Ledger.create(path, population_id="pop", delta=DELTA, **kw).spend("a", Z, label="upd")
    root = str(Path(privkit.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", KILLER, str(path),
                           KEY.decode() if mode == "argument" else ""],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _head.read_head(str(head_file(path))).seq == 0
    assert "mac" in entries(path.read_bytes())[-1]  # the batch is in the journal, MACed
    led = Ledger.open(path, **kw)
    assert led.head().seq == 2 and set(led.epsilons()) == {"a", "b"}
    assert _head.read_head(str(head_file(path))).seq == 2


# ---------------------------------------------------------------- what the journal holds
def test_every_batch_of_a_keyed_ledger_carries_a_mac_that_verifies(tmp_path, key_mode):
    """spend, spend_many, fork and recover entries: the last entry of each batch has ``mac``
    (HMAC-SHA256 of the prefix and the entry without hash and mac), under its hash; no other
    entry has one; the header is of the keyed format."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    led, _, heads = three_batches(path, **kw)
    led.spend_many([(["a"], Z), (["e", 7], GaussianDpEvent(3.0), 2)], label="many", step=1)
    led.verify_pointer(led.origin(), fork=True, run_id="r")
    head_file(path).write_bytes(heads[0])  # refused (behind), then recovered: a recover entry
    rec = Ledger.recover(path, reason="test", **kw)
    header, *es = entries(path.read_bytes())
    assert header["schema"] == SCHEMA_KEYED
    assert [e["kind"] for e in es[-2:]] == ["fork", "recover"]
    for e in es:
        assert ("mac" in e) == (e["seq"] == e["batch_end"])
        body = {k: v for k, v in e.items() if k != "hash"}
        assert hashlib.sha256(canonical(body).encode()).hexdigest() == e["hash"]
        if "mac" in e:
            del body["mac"]
            assert e["mac"] == _journal.batch_mac(KEY, canonical(body))
            assert e["mac"] != _journal.batch_mac(OTHER_KEY, canonical(body))
    assert Ledger.open(path, **kw).head() == rec.head()


def test_a_keyless_journal_is_what_the_previous_privkit_wrote(tmp_path, no_key):
    """Without a key nothing changes: the same charges give the same journal and head file,
    byte for byte, as the privkit before batch MACs (their SHA-256 pinned), of format /2."""
    path = tmp_path / "l.jsonl"
    led = Ledger.create(path, population_id="pop", delta=DELTA, epsilon_budget=50.0,
                        created="2024-01-01T00:00:00+00:00")
    charge_the_pinned_ledger(led)
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == PREVIOUS_JOURNAL
    assert hashlib.sha256(head_file(path).read_bytes()).hexdigest() == PREVIOUS_KEYLESS_HEAD
    assert entries(data)[0]["schema"] == SCHEMA and b'"mac"' not in data


#: SHA-256 of what the privkit before batch MACs wrote for :func:`charge_the_pinned_ledger`:
#: the journal (the same with or without a key: the key went into the head file only), the
#: keyless head file and the head file with :data:`KEY`.
PREVIOUS_JOURNAL = "8d886e1a9b25896b88c91f05ac5951d89f186420153b81863566281407611055"
PREVIOUS_KEYLESS_HEAD = "bc2a5e011fc905e451651720e332451d832e3eeaf8e18db9783f47ce7851ef4b"
PREVIOUS_KEYED_HEAD = "e459b1ebeb194433752dcba4166ccc34f165e4f9ce91e436f308ded3c7cee130"


def charge_the_pinned_ledger(led: Ledger) -> None:
    led.spend(["a", "b"], Z, label="upd", round=0, meta={"x": [1, 2]})
    led.spend_many([(["a"], Z), (["c", 7], GaussianDpEvent(3.0), 2)], label="many", step=3,
                   run_id="r")
    led.verify_pointer(led.origin(), fork=True, run_id="r2")
    led.spend("é", GaussianDpEvent(1.0), label="u")


def previous_keyed_ledger(path) -> list[int]:
    """The keyed ledger the privkit before batch MACs wrote for the pinned charges (its
    journal is the keyless one; its head file is rebuilt here, one slot write per batch as
    that privkit wrote it, and checked against the pinned bytes); the seq each batch ends
    at."""
    with pytest.MonkeyPatch.context() as m:
        m.delenv(_head.KEY_ENV, raising=False)
        m.delenv(_head.KEY_FILE_ENV, raising=False)
        charge_the_pinned_ledger(Ledger.create(path, population_id="pop", delta=DELTA,
                                               epsilon_budget=50.0,
                                               created="2024-01-01T00:00:00+00:00"))
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == PREVIOUS_JOURNAL
    header, *es = entries(data)
    sizes = [len(x) for x in data.splitlines(keepends=True)]
    ends = [-1] + [e["seq"] for e in es if e["seq"] == e["batch_end"]]
    for n, end in enumerate(ends):
        _head.write_head(str(head_file(path)), _head.Head(
            end, es[end]["hash"] if end >= 0 else header["hash"], sum(sizes[:end + 2]),
            header["hash"]), KEY, fresh=n == 0)
    assert hashlib.sha256(head_file(path).read_bytes()).hexdigest() == PREVIOUS_KEYED_HEAD
    return ends


# -------------------------------------------------------- journals of the previous privkit
def test_a_previous_keyed_journal_opens_and_its_new_batches_carry_macs(tmp_path, key_mode):
    """A keyed ledger of the privkit before batch MACs (format /2, no MAC in any batch):
    its batches up to the head record are authenticated by the record's MAC and open; every
    batch appended from then on carries a MAC, and a batch without one after them is
    refused."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    previous_keyed_ledger(path)
    led = Ledger.open(path, **kw)
    assert led.head().seq == 6 and led.head_note is None
    led.spend("z", Z, label="upd")
    header, *es = entries(path.read_bytes())
    assert header["schema"] == SCHEMA  # the header stays (it is hashed into the chain)
    assert ["mac" in e for e in es] == [False] * 7 + [True]
    again = Ledger.open(path, **kw)
    assert again.head().seq == 7 and again.epsilons() == led.epsilons()
    # a MAC-less batch after the MACed one (the head record intact) is refused
    path.write_bytes(forge_batch(path.read_bytes(), ["y"], "none"))
    err = assert_batch_mac_refusal(path, kw, 10)
    assert "carries no MAC although batches before it do" in str(err)


@pytest.mark.parametrize("how", ["spoil-current-slot", "older-copy-of-current-slot"])
def test_the_attack_on_a_previous_keyed_journal_is_refused(tmp_path, key_mode, how,
                                                           monkeypatch, capsys):
    """The same attack on a journal written before batch MACs: the forged batch, after the
    surviving record, has no MAC and is refused (and nothing in it can make one)."""
    mode, kw = key_mode
    path = tmp_path / "l.jsonl"
    ends = previous_keyed_ledger(path)
    data, heads = path.read_bytes(), head_file(path).read_bytes()
    # the journal through the batch before the last, and the head file when it was current
    cut = data[:sum(len(x) for x in data.splitlines(keepends=True)[:ends[-2] + 2])]
    _head.write_head(str(head_file(path)), _head.Head(
        ends[-2], entries(cut)[-1]["hash"], len(cut), entries(cut)[0]["hash"]), KEY)
    older = head_file(path).read_bytes()
    head_file(path).write_bytes(heads)  # the head file as it was, current at the last batch
    assert _head.read_head(str(head_file(path))).seq == ends[-1]
    head_file(path).write_bytes(spoil_current(heads) if how == "spoil-current-slot"
                                else older)
    assert _head.read_head(str(head_file(path))).seq == ends[-2]
    path.write_bytes(forge_batch(cut, ["é"], "none"))
    err = assert_batch_mac_refusal(path, kw, 8)
    assert "comes after the entry its head record names (seq 5" in str(err)
    capsys.readouterr()
    assert verify_exit(path, mode, monkeypatch) == 2


def test_a_batch_an_earlier_privkit_left_after_a_crash_is_refused_then_recovered(tmp_path,
                                                                                key_mode):
    """The privkit before batch MACs crashed after its journal write, before its head
    record's: the batch beyond the record has no MAC, so it cannot be told from a forgery:
    refused, naming the line and the way on; the recovery continues from the journal as it
    is (losing nothing), and its authenticated recover entry vouches for the batch."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    ends = previous_keyed_ledger(path)
    data = path.read_bytes()
    cut = data[:sum(len(x) for x in data.splitlines(keepends=True)[:ends[-2] + 2])]
    _head.write_head(str(head_file(path)), _head.Head(
        ends[-2], entries(cut)[-1]["hash"], len(cut), entries(cut)[0]["hash"]), KEY)
    err = assert_batch_mac_refusal(path, kw, 8)
    assert "privkit ledger recover" in str(err) and f"from byte {len(cut)}" in str(err)
    with pytest.raises(LedgerHeadError):  # a refusal writes nothing
        Ledger.open(path, **kw)
    assert path.read_bytes() == data
    rec = Ledger.recover(path, reason="the previous privkit crashed", **kw)
    assert rec.head().seq == 7 and "é" in rec.epsilons()
    last = entries(path.read_bytes())[-1]
    assert last["kind"] == "recover" and last["problem"] == "batch-mac" and "mac" in last
    assert Ledger.open(path, **kw).head() == rec.head()


# ------------------------------------------------------ a journal more than a batch ahead
def test_a_journal_more_than_one_batch_ahead_of_its_head_record_is_refused(tmp_path, key_mode,
                                                                           monkeypatch):
    """An older copy of the head file put back beside a journal two batches further on:
    no crash leaves that, and with the file of any earlier time the journal could be cut
    at any later batch. Refused with a key; without one it opens, as before."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    _, journals, heads = three_batches(path, **kw)
    head_file(path).write_bytes(heads[1])
    for journal in (journals[3], journals[2] + journals[3][len(journals[2]):]):
        path.write_bytes(journal)
        with pytest.raises(LedgerHeadError, match="holds 2 writes after the entry") as info:
            Ledger.open(path, **kw)
        assert info.value.kind == "ahead" and str(head_file(path)) in str(info.value)
    path.write_bytes(journals[2])  # one batch ahead: the crash case
    assert Ledger.open(path, **kw).head().seq == 2
    rec_path = tmp_path / "r.jsonl"  # recovery continues from such a journal, losing nothing
    _, journals, heads = three_batches(rec_path, **kw)
    head_file(rec_path).write_bytes(heads[1])
    assert Ledger.recover(rec_path, reason="an old head file", **kw).head().seq == 6


def test_a_keyless_journal_ahead_or_forged_opens_as_before(tmp_path, no_key):
    """Without a key nothing is authenticated (the documented limitation): a journal two
    batches ahead of an older head file, and a forged batch after it, open."""
    path = tmp_path / "l.jsonl"
    _, journals, heads = three_batches(path)
    head_file(path).write_bytes(heads[1])
    path.write_bytes(forge_batch(journals[2], ["a", "b", "c"], "none"))
    assert Ledger.open(path).epsilons()["a"] < 0.8 * EPS_A


# ------------------------------------------------------------------ recovery and damage
def test_recovery_vouches_for_the_journal_as_it_was_and_no_more(tmp_path, key_mode):
    """An accepted forged batch (the operator chose to go on): the recover entry, MACed,
    covers it; a forged batch after the recovery is refused again."""
    _, kw = key_mode
    path = tmp_path / "l.jsonl"
    _, journals, heads = three_batches(path, **kw)
    path.write_bytes(forge_batch(journals[3], ["d"], "other-key"))
    assert_batch_mac_refusal(path, kw, 8)
    rec = Ledger.recover(path, reason="accepted", **kw)
    assert rec.head().seq == 7
    assert Ledger.open(path, **kw).head() == rec.head()
    path.write_bytes(forge_batch(path.read_bytes(), ["e"], "none"))
    assert_batch_mac_refusal(path, kw, 10)


@pytest.mark.parametrize("damage", ["mac-on-a-middle-entry", "malformed-mac"])
def test_a_misplaced_or_malformed_mac_is_corrupt_with_or_without_a_key(tmp_path, damage,
                                                                         no_key):
    """A MAC only ever ends a batch, as 64 hex digits: anything else is a damaged journal
    (the line named), whatever the key."""
    path = tmp_path / "l.jsonl"
    _, journals, _ = three_batches(path, key=KEY)
    lines = journals[3].splitlines(keepends=True)
    lineno = 3 if damage == "mac-on-a-middle-entry" else 4  # batch 2: lines 3 and 4
    e = json.loads(lines[lineno - 1])
    assert ("mac" in e) == (damage == "malformed-mac")
    del e["hash"]
    e["mac"] = "ab" * 32 if damage == "mac-on-a-middle-entry" else "AB" * 32
    e["hash"] = hashlib.sha256(canonical(e).encode()).hexdigest()
    lines[lineno - 1] = (canonical(e) + "\n").encode()
    path.write_bytes(b"".join(lines))
    for kw in ({"key": KEY}, {}):
        with pytest.raises(LedgerCorruptError, match=f"{path}: line {lineno}: a malformed MAC"):
            Ledger.open(path, **kw)


def test_a_keyed_journal_without_its_key_is_still_refused(tmp_path, no_key):
    """The head record says a key is needed (the journal's MACs are not checked without it,
    and nothing is written)."""
    path = tmp_path / "l.jsonl"
    _, journals, _ = three_batches(path, key=KEY)
    with pytest.raises(LedgerHeadError) as info:
        Ledger.open(path)
    assert info.value.kind == "needs-key"
    with pytest.raises(LedgerError):
        Ledger.open(path, key=OTHER_KEY)
    assert path.read_bytes() == journals[3]


def test_recover_without_the_key_of_a_keyed_ledger_is_refused(tmp_path, monkeypatch):
    """Recovering a keyed ledger without its key would write a keyless head record over the
    authenticated one: refused, nothing written."""
    monkeypatch.delenv("PRIVKIT_LEDGER_KEY", raising=False)
    monkeypatch.delenv("PRIVKIT_LEDGER_KEY_FILE", raising=False)
    path = tmp_path / "l.jsonl"
    led = Ledger.create(path, population_id="p", delta=1e-5, key="k" * 32)
    led.spend(["a"], privkit.GaussianDpEvent(2.0), label="x")
    before = (path.read_bytes(), (tmp_path / "l.jsonl.head").read_bytes())
    with pytest.raises(LedgerHeadError, match="authenticated"):
        Ledger.recover(path, reason="test")
    assert (path.read_bytes(), (tmp_path / "l.jsonl.head").read_bytes()) == before
