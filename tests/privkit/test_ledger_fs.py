"""File-system errors (a full disk, a file too large, a read-only file system, no permission,
a head path that is a directory) are LedgerErrors naming the file and the error, raised with
the state left whole: a failed charge is not recorded, and a retry once the disk works does.

Each write point is made to fail by replacing the system call (``os.write``, ``os.fsync``,
``os.open``, ...) with one that raises for the file in question only.
"""

import builtins
import errno
import os
from pathlib import Path

import pytest

from privkit import _head
from privkit.errors import LedgerError
from privkit.events import GaussianDpEvent
from privkit.ledger import Ledger

DELTA = 1e-5
Z = GaussianDpEvent(2.0)


def name_of(target) -> str:
    """The path of a descriptor (or the path itself)."""
    return os.readlink(f"/proc/self/fd/{target}") if isinstance(target, int) else str(target)


def journal(p: str) -> bool:
    return p.endswith("l.jsonl")


def head(p: str) -> bool:
    return p.endswith("l.jsonl.head")


def journal_temp(p: str) -> bool:
    return os.path.basename(p).startswith(".l.jsonl.") and p.endswith(".tmp")


def head_temp(p: str) -> bool:
    return p.endswith("l.jsonl.head.tmp")


def directory(p: str) -> bool:
    return os.path.isdir(p)


def directory_once_linked(p: str) -> bool:
    """The directory, once the new journal is in it (its fsync makes the name durable)."""
    return os.path.isdir(p) and os.path.exists(os.path.join(p, "l.jsonl"))


def fail(monkeypatch, owner, name: str, code: int, which) -> list[str]:
    """Make ``owner.name`` raise OSError ``code`` when its first argument (a descriptor or a
    path) is a file ``which`` accepts; the names it failed for are listed in the result."""
    real, failed = getattr(owner, name), []

    def fake(target, *args, **kwargs):
        if which(name_of(target)):
            failed.append(name_of(target))
            raise OSError(code, os.strerror(code))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(owner, name, fake)
    return failed


def files(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path))


def charged(path) -> Ledger:
    led = Ledger.create(path, population_id="pop", delta=DELTA,
                        created="2024-01-01T00:00:00+00:00")
    led.spend("a", Z, label="upd")
    return led


# ------------------------------------------------------------------------ spend
@pytest.mark.parametrize("owner, name, code, which, where", [
    (os, "write", errno.ENOSPC, journal, "journal"),
    (os, "write", errno.EFBIG, journal, "journal"),
    (os, "fsync", errno.ENOSPC, journal, "journal"),
    (os, "fsync", errno.EIO, journal, "journal"),
    (os, "open", errno.EROFS, journal, "journal"),
    (os, "open", errno.EACCES, journal, "journal"),
    (os, "open", errno.EROFS, head, "head"),
    (os, "open", errno.EACCES, head, "head"),
])
@pytest.mark.parametrize("many", [False, True], ids=["spend", "spend_many"])
def test_a_failed_charge_records_nothing_and_a_retry_works(tmp_path, monkeypatch, owner, name,
                                                          code, which, where, many):
    path = tmp_path / "l.jsonl"
    led = charged(path)
    before = (path.read_bytes(), Path(str(path) + ".head").read_bytes(), files(tmp_path))
    eps, pointer = led.epsilons(), led.head()

    def charge():
        if many:
            return led.spend_many([(["a"], Z), (["b"], Z, 2)], label="upd")
        return led.spend(["a", "b"], Z, label="upd")

    with monkeypatch.context() as m:
        failed = fail(m, owner, name, code, which)
        with pytest.raises(LedgerError) as info:
            charge()
    assert failed
    shown = str(path) + (".head" if where == "head" else "")
    msg = str(info.value)
    assert msg.startswith(f"{shown}: cannot ") and f"({errno.errorcode[code]}: " in msg
    assert "nothing was recorded" in msg and "\n" not in msg
    # the state is whole: nothing on disk, nothing in memory
    assert (path.read_bytes(), Path(str(path) + ".head").read_bytes(),
            files(tmp_path)) == before
    assert led.epsilons() == eps and led.head() == pointer
    receipt = charge()  # the same ledger, once the disk works
    assert receipt.seq == pointer.seq + 2
    again = Ledger.open(path)
    assert again.head() == led.head() and again.epsilons() == led.epsilons()
    assert again.composition("a").atoms == ((Z, 2),)  # charged once by the retry, not twice


def test_a_head_path_that_is_a_directory_refuses_the_charge_first(tmp_path):
    path = tmp_path / "l.jsonl"
    led = charged(path)
    hf = Path(str(path) + ".head")
    record, data, eps = hf.read_bytes(), path.read_bytes(), led.epsilons()
    hf.unlink()
    hf.mkdir()
    with pytest.raises(LedgerError, match=rf"^{hf}: cannot write \(EISDIR: Is a directory\); "
                       "nothing was recorded$"):
        led.spend("b", Z, label="upd")
    assert path.read_bytes() == data and led.epsilons() == eps
    with pytest.raises(LedgerError, match=rf"^{hf}: cannot read the head record \(EISDIR"):
        Ledger.open(path)
    hf.rmdir()
    hf.write_bytes(record)
    led.spend("b", Z, label="upd")
    assert Ledger.open(path).epsilons() == pytest.approx({"a": eps["a"], "b": eps["a"]})


@pytest.mark.parametrize("owner, name", [(os, "pwrite"), (_head, "_datasync")])
def test_a_head_record_that_fails_after_the_journal_keeps_the_charge(tmp_path, monkeypatch,
                                                                    owner, name):
    """The batch is durable when the head record's slot fails: the charge is counted (over,
    never under) and the ledger is refused until reopened, which settles the head record."""
    path = tmp_path / "l.jsonl"
    led = charged(path)
    with monkeypatch.context() as m:
        fail(m, owner, name, errno.ENOSPC, head)
        with pytest.raises(LedgerError, match=r"durable in the journal .*\(ENOSPC: No space "
                           "left on device\\); reopen"):
            led.spend("b", Z, label="upd")
    with pytest.raises(LedgerError, match="reopen"):
        led.spend("c", Z, label="upd")
    again = Ledger.open(path)
    assert again.head().seq == 1 and set(again.epsilons()) == {"a", "b"}
    assert Ledger.open(path).head_note is None


# ----------------------------------------------------------------------- create
@pytest.mark.parametrize("owner, name, code, which, shown", [
    (os, "write", errno.ENOSPC, journal_temp, "l.jsonl"),
    (os, "fsync", errno.EIO, journal_temp, "l.jsonl"),
    (os, "open", errno.EROFS, journal_temp, "l.jsonl"),
    (os, "open", errno.EACCES, journal_temp, "l.jsonl"),
    (os, "write", errno.ENOSPC, head_temp, "l.jsonl.head"),
    (os, "fsync", errno.ENOSPC, head_temp, "l.jsonl.head"),
    (os, "open", errno.EROFS, head_temp, "l.jsonl.head"),
    (os, "link", errno.EROFS, journal_temp, "l.jsonl"),
    (os, "fsync", errno.EIO, directory, "l.jsonl.head"),
    (os, "fsync", errno.EIO, directory_once_linked, "l.jsonl"),
])
def test_a_failed_create_creates_nothing_and_a_retry_works(tmp_path, monkeypatch, owner, name,
                                                          code, which, shown):
    path = tmp_path / "l.jsonl"
    with monkeypatch.context() as m:
        failed = fail(m, owner, name, code, which)
        with pytest.raises(LedgerError) as info:
            Ledger.create(path, population_id="pop", delta=DELTA)
    assert failed
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / shown}: cannot ") and "nothing was created" in msg
    assert f"({errno.errorcode[code]}: " in msg and ".tmp" not in msg
    assert not path.exists() and not any(f.endswith(".tmp") for f in files(tmp_path))
    led = Ledger.create(path, population_id="pop", delta=DELTA)  # the retry
    led.spend("a", Z, label="upd")
    assert Ledger.open(path).head().seq == 0


def test_create_with_a_head_path_that_is_a_directory(tmp_path):
    path = tmp_path / "l.jsonl"
    hf = Path(str(path) + ".head")
    hf.mkdir()
    with pytest.raises(LedgerError, match=rf"^{hf}: cannot read \(EISDIR: Is a directory\)"):
        Ledger.create(path, population_id="pop", delta=DELTA)
    assert files(tmp_path) == ["l.jsonl.head"]
    hf.rmdir()
    Ledger.create(path, population_id="pop", delta=DELTA).spend("a", Z, label="upd")
    assert Ledger.open(path).head().seq == 0


# ------------------------------------------------------------------------- open
@pytest.mark.parametrize("code, which, shown, what", [
    (errno.EACCES, journal, "l.jsonl", "read the journal"),
    (errno.EIO, journal, "l.jsonl", "read the journal"),
    (errno.EACCES, head, "l.jsonl.head", "read the head record"),
    (errno.EIO, head, "l.jsonl.head", "read the head record"),
])
def test_a_file_that_cannot_be_read_is_a_ledger_error(tmp_path, monkeypatch, code, which,
                                                      shown, what):
    path = tmp_path / "l.jsonl"
    led = charged(path)
    with monkeypatch.context() as m:
        fail(m, builtins, "open", code, which)
        with pytest.raises(LedgerError, match=rf"^{tmp_path / shown}: cannot {what} "
                           rf"\({errno.errorcode[code]}: "):
            Ledger.open(path)
        with pytest.raises(LedgerError, match=errno.errorcode[code]):
            Ledger.recover(path, reason="x")
    assert Ledger.open(path).epsilons() == led.epsilons()
