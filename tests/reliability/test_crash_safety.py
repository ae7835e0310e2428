"""Crash safety: SIGKILL trainer runs at random points, resume, and compare bitwise.

For each :data:`_trainers.CASES` entry (a deterministic private ``privkit train`` run with a
checkpoint every iteration), an uninterrupted reference run is made first. Then a fresh run
is started and SIGKILLed at a random moment of its training, resumed with ``--resume``,
killed again, ... and finally resumed to the end. After every kill the ledger must open (its
hash chains verify) and no client's epsilon may have decreased. At the end the ledger bytes,
the final checkpoint (tensors bytes and state), and report.json must equal the reference's,
except the wall-clock fields ``wall_time_s`` and ``client_compute_s`` (the PNG plots are not
compared: one of them has wall time on its axis). Ledgers are byte-identical because the
subprocesses set ``SOURCE_DATE_EPOCH`` (the ledger header's time).

CI: 3 kill points on the Upcycled-FL output-perturbation case. ``PRIVKIT_SOAK=1``: 8 kill
points on every case (24 in all).

Also here: crashes injected in-process at the exact windows that matter (between a round's
charge and its checkpoint, and between two charge batches of one round), an older checkpoint
and an older ledger being refused, and SIGKILL during ledger writes.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _soak import SOAK, scaled
from _trainers import CASES, ROOT, TrainerCase, command, env, outcome, run

from privkit.ledger import Ledger, LedgerPointer

KILLS_PER_CASE = scaled(3, 8)
ACTIVE = [c for c in CASES if c.ci or SOAK]


def _ledger_epsilons(case: TrainerCase, out: Path) -> dict[str, dict[str, float]]:
    found = {}
    for name in case.ledgers:
        if (out / name).exists():
            found[name] = Ledger.open(out / name).epsilons()  # verifies every chain
    return found


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    return False


def _classify(case: TrainerCase, out: Path) -> str:
    """Where the kill landed, from what it left on disk."""
    ckpt = out / case.checkpoints[0]
    ledger_path = out / case.ledgers[0]
    if not ledger_path.exists():
        return "before training"
    led = Ledger.open(ledger_path)
    if led.discarded_bytes:
        return "inside a ledger write"
    if not (ckpt / "LATEST").exists():
        return "before the first checkpoint"
    latest = ckpt / (ckpt / "LATEST").read_text().strip()
    pointer = json.loads((latest / "state.json").read_text())["ledger_pointer"]
    if pointer["seq"] < led.head().seq:
        return "between a charge and its checkpoint"
    return "at a checkpoint boundary (even step, evaluation or report)"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted reference runs: outcome and timing (startup vs training)."""
    refs = {}
    for case in ACTIVE:
        out = tmp_path_factory.mktemp(f"ref-{case.name}")
        t0 = time.monotonic()
        proc = subprocess.Popen(command(case, out, False), env=env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        started = _wait_for(out / case.ledgers[0], proc, 300)
        t_start = time.monotonic() - t0
        latest, seen = out / case.checkpoints[0] / "LATEST", []  # (time, checkpoint) changes
        while proc.poll() is None:
            name = latest.read_text() if latest.exists() else None
            if name and (not seen or seen[-1][1] != name):
                seen.append((time.monotonic(), name))
            time.sleep(0.001)
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0 and started and len(seen) >= 3, err
        per_iteration = (seen[-1][0] - seen[0][0]) / (len(seen) - 1)
        refs[case.name] = (outcome(case, out), t_start, per_iteration)
    return refs


@pytest.mark.parametrize("case", ACTIVE, ids=lambda c: c.name)
def test_sigkill_at_random_points_then_resume_is_bitwise_equal(case, references, tmp_path):
    ref, _, per_iteration = references[case.name]
    out = tmp_path / "run"
    rng = np.random.default_rng([7, len(case.name)])
    prev: dict[str, dict[str, float]] = {}
    landed: list[str] = []
    for i in range(KILLS_PER_CASE):
        state_before = _progress(case, out)
        proc = subprocess.Popen(command(case, out, resume=i > 0), env=env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # wait until the run has durably done something (a charge or a checkpoint), so
            # the kill lands in training, not in start-up; then a random share of the run
            end = time.monotonic() + 300
            while (_progress(case, out) == state_before and proc.poll() is None
                   and time.monotonic() < end):
                time.sleep(0.002)
            time.sleep(float(rng.uniform(0.0, 2.5 * per_iteration)))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                landed.append(_classify(case, out) if _progress(case, out) != state_before
                              else "during start-up or restore (no progress)")
            else:
                landed.append("finished before the kill")
            _, err = proc.communicate(timeout=60)
            assert "Traceback" not in err, err
        finally:
            if proc.poll() is None:
                proc.kill()
        now = _ledger_epsilons(case, out)
        for name, eps in prev.items():  # spend never decreases, no client forgotten
            assert set(now[name]) >= set(eps), (name, landed)
            assert all(now[name][c] >= e for c, e in eps.items()), (name, landed)
        prev = now
    final = run(case, out, resume=True)
    assert final.returncode == 0, final.stderr
    got = outcome(case, out)
    for key in ref:
        assert got[key] == ref[key], f"{key} differs after kills at: {landed}"
    killed = [w for w in landed if w != "finished before the kill"]
    counts = {w: landed.count(w) for w in sorted(set(landed))}
    print(f"\n{case.name}: {len(killed)} kill points survived: {counts}")
    assert len(killed) >= (KILLS_PER_CASE + 1) // 2, landed


def _progress(case: TrainerCase, out: Path) -> tuple:
    """What a run has durably done: ledger bytes and checkpoint pointers."""
    led = out / case.ledgers[0]
    return (led.read_bytes() if led.exists() else None,
            tuple((out / c / "LATEST").read_text() if (out / c / "LATEST").exists() else None
                  for c in case.checkpoints))


# ----------------------------------------------------------- injected crashes (in-process)
class _Crash(BaseException):
    """Stands for SIGKILL: nothing after the raise point runs (not even except Exception)."""


PRIV = dict(dataset="digits:3", local_epochs=1, batch_size=32, lr=0.05, device="cpu",
            fraction=0.5, stragglers=0.3, seed=2, mu=0.1, lam=0.04, checkpoint_every=1,
            iterations=8)


def _straight_and_crashed(tmp_path, monkeypatch, privacy, crash_point):
    from fl_examples.core.data import parse_dataset_spec
    from fl_examples.upcycled import UpcycledConfig, run_algorithm

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    kw = (dict(privacy="output", stddev=5.0) if privacy == "output"
          else dict(privacy="objective", alpha=50.0, allow_unproven=True))
    cfg = UpcycledConfig(**PRIV, **kw)
    ds = parse_dataset_spec("digits:3", seed=2)
    ref = run_algorithm("upcycled", cfg, ds, iterations=8, out=tmp_path / "ref")
    with monkeypatch.context() as m:
        crash_point(m)
        with pytest.raises(_Crash):
            run_algorithm("upcycled", cfg, ds, iterations=8, out=tmp_path / "run")
    led = Ledger.open(tmp_path / "run" / "ledger-upcycled.jsonl")
    ptr = json.loads((tmp_path / "run/checkpoints/upcycled" / (
        tmp_path / "run/checkpoints/upcycled/LATEST").read_text() / "state.json").read_text())
    assert ptr["ledger_pointer"]["seq"] < led.head().seq  # the crash left a charge behind
    res = run_algorithm("upcycled", cfg, ds, iterations=8, out=tmp_path / "run", resume=True)
    return ref, res, tmp_path


def _assert_same(ref, res, tmp_path):
    import torch

    for k, v in ref["model"].items():
        assert torch.equal(v, res["model"][k])
    a = (tmp_path / "ref" / "ledger-upcycled.jsonl").read_bytes()
    b = (tmp_path / "run" / "ledger-upcycled.jsonl").read_bytes()
    assert a == b  # no fork entry, no second charge of the interrupted round
    assert ref["privacy"] == res["privacy"]


def test_crash_between_charge_and_checkpoint_adopts_the_charge(tmp_path, monkeypatch):
    """Iteration 5 charges data round 3, then dies before its checkpoint is written."""
    import fl_examples.upcycled as up

    real = up.checkpoint.save

    def crash_point(m):
        def save(directory, round_, tensors, state):
            if round_ == 5:
                raise _Crash
            return real(directory, round_, tensors, state)

        m.setattr(up.checkpoint, "save", save)

    _assert_same(*_straight_and_crashed(tmp_path, monkeypatch, "output", crash_point))


def test_crash_between_two_charge_batches_of_one_round(tmp_path, monkeypatch):
    """Objective perturbation charges one batch per distinct |D_i|; die after the first."""
    import privkit.ledger as ledger_mod

    real = ledger_mod.Ledger.spend
    seen: list[int] = []

    def crash_point(m):
        def spend(self, client_ids, event, **kw):
            receipt = real(self, client_ids, event, **kw)
            seen.append(kw.get("round"))
            if kw.get("round") == 3 and seen.count(3) == 1:
                raise _Crash
            return receipt

        m.setattr(ledger_mod.Ledger, "spend", spend)

    ref, res, tmp = _straight_and_crashed(tmp_path, monkeypatch, "objective", crash_point)
    lines = (tmp / "ref" / "ledger-upcycled.jsonl").read_text().splitlines()[1:]
    batches = {json.loads(x)["batch_end"] for x in lines if json.loads(x)["round"] == 3}
    assert len(batches) >= 2  # round 3 really is several batches
    _assert_same(ref, res, tmp)


# --------------------------------------------------------- older checkpoint / older ledger
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    case = CASES[0]
    out = tmp_path_factory.mktemp("finished")
    r = run(case, out)
    assert r.returncode == 0, r.stderr
    return case, out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file()}


def test_older_checkpoint_is_refused(finished, tmp_path):
    case, done = finished
    out = _copy(done, tmp_path / "out")
    ckpt = out / case.checkpoints[0]
    (ckpt / "LATEST").write_text("ckpt-000002")  # an older, complete checkpoint
    before = _snapshot(out)
    r = run(case, out, resume=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "older than the ledger" in lines[0], r.stderr
    assert "resume from the latest checkpoint" in lines[0]
    assert _snapshot(out) == before  # nothing charged, nothing written


def test_older_ledger_is_refused(finished, tmp_path):
    case, done = finished
    out = _copy(done, tmp_path / "out")
    path = out / case.ledgers[0]
    lines = path.read_bytes().splitlines(keepends=True)
    keep = [i for i, x in enumerate(lines[1:], 1) if json.loads(x)["round"] <= 3]
    path.write_bytes(b"".join(lines[: keep[-1] + 1]))  # an older copy of the same ledger
    Ledger.open(path)  # still a valid ledger on its own
    before = _snapshot(out)
    r = run(case, out, resume=True)
    assert r.returncode == 2, r.stderr
    msg = r.stderr.strip().splitlines()
    assert len(msg) == 1 and "is not in this ledger" in msg[0], r.stderr
    assert _snapshot(out) == before


def test_pointer_of_a_rewritten_ledger_is_refused(tmp_path):
    led = Ledger.create(tmp_path / "l.jsonl", population_id="p", delta=1e-5)
    from privkit.events import GaussianDpEvent

    led.spend(["a"], GaussianDpEvent(3.0), label="x")
    with pytest.raises(Exception, match="another hash"):
        led.entries_since(LedgerPointer(0, "0" * 64))
    assert led.entries_since(led.head()) == []
    assert [e["seq"] for e in led.entries_since(led.origin())] == [0]


# ------------------------------------------------------------------ kill during a ledger write
WRITER = """
import os, sys, time
from privkit.events import GaussianDpEvent
from privkit.ledger import Ledger
real_write = os.write


def slow_write(fd, data):  # a slow disk: 4 KiB per write call, so kills land inside writes
    n = real_write(fd, bytes(data[:4096]))
    time.sleep(0.0005)
    return n


os.write = slow_write
led = Ledger.open(sys.argv[1])
clients = [f"c{i}" for i in range(int(sys.argv[2]))]
print("ready", led.head().seq, flush=True)
for r in range(10_000):
    print("begin", led.head().seq, flush=True)
    led.spend(clients, GaussianDpEvent(1000.0 + r % 7), label="w", round=r)
    print("done", led.head().seq, flush=True)
"""


def test_sigkill_during_ledger_writes_leaves_old_or_new(tmp_path):
    """Batches of 300 entries (~200 KB, written 4 KiB at a time as by a slow disk): after a
    kill the ledger is the state before or after the batch in flight, never a mix, and the
    next writer continues it."""
    path = tmp_path / "w.jsonl"
    Ledger.create(path, population_id="w", delta=1e-5)
    n_clients = 300
    rng = np.random.default_rng(5)
    kinds: dict[str, int] = {}
    for _ in range(scaled(4, 30)):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(n_clients)],
                                env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT)
        try:
            ready = proc.stdout.readline().split()
            assert ready[0] == "ready", ready
            time.sleep(float(rng.uniform(0.02, 0.4)))
            proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        # only complete lines (the kill may cut the last one short)
        events = [line.split() for line in out.splitlines(keepends=True)
                  if line.endswith("\n") and len(line.split()) == 2]
        done = [int(s) for k, s in events if k == "done"]
        before = done[-1] if done else int(ready[1])
        led = Ledger.open(path)
        head = led.head().seq
        assert head in (before, before + n_clients), (head, before)
        kind = ("torn write discarded" if led.discarded_bytes else
                "after the batch" if head == before + n_clients and events[-1][0] == "begin"
                else "between batches")
        kinds[kind] = kinds.get(kind, 0) + 1
        eps = led.epsilons()
        assert len(set(eps.values())) <= 2 and all(e > 0 for e in eps.values())
    print(f"\nledger-write kills: {kinds}")
    # the next writer cuts any torn tail and appends whole batches
    led = Ledger.open(path)
    from privkit.events import GaussianDpEvent

    led.spend(["c0"], GaussianDpEvent(1000.0), label="after")
    again = Ledger.open(path)
    assert again.discarded_bytes == 0 and again.head() == led.head()


def test_source_date_epoch_makes_ledgers_byte_identical(tmp_path, monkeypatch):
    from privkit.errors import InvalidParameterError
    from privkit.events import GaussianDpEvent

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for i, p in enumerate(paths):
        if i:
            time.sleep(1.1)  # a different second of wall-clock time
        led = Ledger.create(p, population_id="p", delta=1e-5)
        led.spend(["a", "b"], GaussianDpEvent(2.0), label="r")
        assert led.created == "2023-11-14T22:13:20+00:00"
    assert paths[0].read_bytes() == paths[1].read_bytes()
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(InvalidParameterError, match="SOURCE_DATE_EPOCH"):
        Ledger.create(tmp_path / "c.jsonl", population_id="p", delta=1e-5)
    assert not (tmp_path / "c.jsonl").exists()
