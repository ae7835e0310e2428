"""The ledger header records what a noise multiplier means (``noise_reading``), and what
``Ledger.create`` and ``Ledger.open`` accept as a path and a creation time."""

import hashlib
import json
from pathlib import Path

import pytest

from privkit import _head
from privkit.cli import main
from privkit.errors import InvalidParameterError, LedgerCorruptError, LedgerError
from privkit.events import GaussianDpEvent
from privkit.ledger import NOISE_READING, Ledger

DELTA = 1e-5
Z = GaussianDpEvent(2.0)
CREATED = "2024-01-01T00:00:00+00:00"


def canonical(d):
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def rehash(d):
    body = {k: v for k, v in d.items() if k != "hash"}
    return dict(body, hash=hashlib.sha256(canonical(body).encode()).hexdigest())


def rewrite_header(path, change):
    """Rewrite the journal with ``change(header)`` as its header, every chain re-linked to
    the new header hash and the head record written for it: a ledger as another privkit
    version would have written it (keyless)."""
    header, *entries = [json.loads(x) for x in Path(path).read_bytes().splitlines()]
    header = rehash(change({k: v for k, v in header.items() if k != "hash"}))
    prev, client_prev, out = header["hash"], {}, [header]
    for e in entries:
        e = rehash(dict(e, prev_hash=prev,
                        client_prev_hash=client_prev.get(e["client_id"], header["hash"])))
        prev = client_prev[e["client_id"]] = e["hash"]
        out.append(e)
    data = "".join(canonical(e) + "\n" for e in out).encode()
    Path(path).write_bytes(data)
    last = out[-1]
    Path(str(path) + ".head").unlink()
    _head.write_head(str(path) + ".head", _head.Head(len(out) - 2, last["hash"], len(data),
                                                     header["hash"]), None)


def charged(path, relation):
    led = Ledger.create(path, population_id="pop", delta=DELTA, created=CREATED,
                        neighboring_relation=relation)
    led.spend(["a", "b"], Z, label="upd")
    led.spend("a", Z, label="upd")
    return led


def without_reading(header):
    del header["noise_reading"]
    return header


# --------------------------------------------------------------------- noise reading
@pytest.mark.parametrize("relation", ["add-remove", "replace-one", "zero-out"])
def test_new_ledgers_record_the_noise_reading(tmp_path, relation):
    path = tmp_path / "l.jsonl"
    led = charged(path, relation)
    header = json.loads(path.read_bytes().splitlines()[0])
    assert header["noise_reading"] == NOISE_READING == "per-contribution"
    assert led.noise_reading == NOISE_READING
    assert Ledger.open(path).noise_reading == NOISE_READING
    assert Ledger.create(None, population_id="p", delta=DELTA).noise_reading == NOISE_READING
    # the field is under the header hash: editing it is corruption
    lines = path.read_bytes().splitlines(keepends=True)
    lines[0] = lines[0].replace(b'"per-contribution"', b'"per-contributioN"')
    path.write_bytes(b"".join(lines))
    with pytest.raises(LedgerCorruptError, match="header hash mismatch"):
        Ledger.open(path)


def test_zero_out_is_a_ledger_relation(tmp_path):
    path = tmp_path / "l.jsonl"
    led = charged(path, "zero-out")
    assert json.loads(path.read_bytes().splitlines()[0])["neighboring_relation"] == (
        "REPLACE_SPECIAL")
    assert led.neighboring_relation.name == "REPLACE_SPECIAL"
    assert Ledger.open(path).epsilons() == led.epsilons()


def test_an_earlier_replace_one_ledger_is_refused(tmp_path, capsys):
    """Its noise multipliers meant stddev / (2C): never re-read as stddev / C."""
    path = tmp_path / "l.jsonl"
    charged(path, "replace-one")
    rewrite_header(path, without_reading)
    before = (path.read_bytes(), Path(str(path) + ".head").read_bytes())
    want = (r"l.jsonl: the ledger was written when a REPLACE_ONE noise multiplier meant stddev "
            r"/ \(2C\); its epsilons would be re-read under the new reading \(stddev / C, the "
            r"accountant doubling the sensitivity\); it cannot be continued by this version; "
            r"report it with the version that wrote it, or start a new ledger")
    with pytest.raises(LedgerError, match=want) as info:
        Ledger.open(path)
    assert type(info.value) is LedgerError
    with pytest.raises(LedgerError, match=want):
        Ledger.recover(path, reason="continue it anyway")
    assert main(["ledger", "verify", str(path)]) == 2
    assert "REPLACE_ONE noise multiplier meant stddev / (2C)" in capsys.readouterr().err
    assert (path.read_bytes(), Path(str(path) + ".head").read_bytes()) == before


def test_an_earlier_zero_out_ledger_is_refused(tmp_path):
    path = tmp_path / "l.jsonl"
    charged(path, "zero-out")
    rewrite_header(path, without_reading)
    with pytest.raises(LedgerError, match="under REPLACE_SPECIAL before privkit recorded"):
        Ledger.open(path)


def test_an_earlier_add_remove_ledger_opens_and_continues(tmp_path):
    """Under ADD_OR_REMOVE_ONE both readings are one: it opens, and stays without the
    field."""
    path = tmp_path / "l.jsonl"
    led = charged(path, "add-remove")
    rewrite_header(path, without_reading)
    old = Ledger.open(path)
    assert old.noise_reading is None and old.epsilons() == led.epsilons()
    old.spend("b", Z, label="upd")
    assert "noise_reading" not in json.loads(path.read_bytes().splitlines()[0])
    assert Ledger.open(path).epsilons() == pytest.approx(
        {"a": led.epsilons()["a"], "b": led.epsilons()["a"]})
    assert main(["ledger", "verify", str(path)]) == 0


@pytest.mark.parametrize("value", ["per-sensitivity", None, 1])
def test_an_unknown_noise_reading_is_refused(tmp_path, value):
    path = tmp_path / "l.jsonl"
    charged(path, "add-remove")
    rewrite_header(path, lambda h: dict(h, noise_reading=value))
    with pytest.raises(LedgerError, match=f"unknown noise_reading {value!r}"):
        Ledger.open(path)


# ------------------------------------------------------------------ path and created
@pytest.mark.parametrize("created", [
    "yesterday", "2024-01-01", "2024-01-01T00:00:00", "2024-01-01T00:00:00+02:00",
    "2024-13-01T00:00:00+00:00", "", 1704067200, [CREATED]])
def test_created_must_be_an_iso_utc_timestamp(tmp_path, created):
    path = tmp_path / "l.jsonl"
    with pytest.raises(InvalidParameterError, match="created must be an ISO-8601 UTC"):
        Ledger.create(path, population_id="p", delta=DELTA, created=created)
    with pytest.raises(InvalidParameterError, match="created"):
        Ledger.create(None, population_id="p", delta=DELTA, created=created)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("created", [CREATED, "2024-01-01T00:00:00Z",
                                     "2024-01-01T12:30:05.250000+00:00"])
def test_iso_utc_timestamps_are_kept_as_given(tmp_path, created):
    path = tmp_path / "l.jsonl"
    assert Ledger.create(path, population_id="p", delta=DELTA, created=created).created == (
        created)
    assert Ledger.open(path).created == created


@pytest.mark.parametrize("path", [None, 3, b"l.jsonl", ""])
def test_a_path_that_is_not_one_is_refused_naming_path(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidParameterError, match="path must be a file path"):
        Ledger.open(path)
    with pytest.raises(InvalidParameterError, match="path must be a file path"):
        Ledger.recover(path, reason="x")
    if path is not None:  # None: an in-memory ledger
        with pytest.raises(InvalidParameterError, match="path must be a file path"):
            Ledger.create(path, population_id="p", delta=DELTA)
    assert list(tmp_path.iterdir()) == []


def test_create_in_a_missing_directory_names_the_path(tmp_path):
    path = tmp_path / "missing" / "l.jsonl"
    with pytest.raises(LedgerError, match="does not exist") as info:
        Ledger.create(path, population_id="p", delta=DELTA)
    msg = str(info.value)
    assert msg.startswith(f"{path}: cannot create the ledger") and ".tmp" not in msg
    assert str(tmp_path / "missing") in msg
    (tmp_path / "file").write_text("x")
    with pytest.raises(LedgerError, match="is not a directory"):
        Ledger.create(tmp_path / "file" / "l.jsonl", population_id="p", delta=DELTA)
