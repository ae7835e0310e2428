"""Crash safety: SIGKILL trainer runs at random points, resume, and compare bitwise.

For each :data:`_trainers.CASES` entry (a deterministic private ``privkit train`` run with
frequent checkpoints), an uninterrupted reference run is made first. Then a fresh run
is started and SIGKILLed at a random moment of its training, resumed with ``--resume``,
killed again, ... and finally resumed to the end. After every kill the ledger must open (its
hash chains verify) and no client's epsilon may have decreased. At the end the ledger bytes,
the final checkpoints (tensors bytes and state), and report.json must equal the reference's,
except the wall-clock fields ``wall_time_s`` and ``client_compute_s`` (the PNG plots are not
compared: one of them has wall time on its axis). Ledgers are byte-identical because the
subprocesses set ``SOURCE_DATE_EPOCH`` (the ledger header's time).

A run may train several algorithms one after the other (MAPA then AUDP, SCFL then FL-PMA,
DP-REC then DP-FedAvg), each with its own ledger and checkpoints; every ledger, checkpoint and
listed file is compared. SCFL has no epsilon ledger (its privacy is the MI-DP of a one-time
coded upload, written to ``midp-scfl.json``): its checkpoints hold the server's coded set, so
a resumed run continues with the very coded rows (and noise) of the first start.

CI: 3 kill points: 2 on the Upcycled-FL output-perturbation case and 1 on a case drawn with a
fixed seed among MAPA, SCFL and DP-REC. ``PRIVKIT_SOAK=1``: 8 kill points on every case (48
in all, over the four trainers).

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

#: The CI subset's drawn case (fixed seed: the same one every run, so failures reproduce).
DRAWN = [c for c in CASES if c.ci_draw][
    int(np.random.default_rng(11).integers(sum(c.ci_draw for c in CASES)))]
ACTIVE = [c for c in CASES if c.ci or c is DRAWN or SOAK]


def kills(case: TrainerCase) -> int:
    """Kill points of a case: 8 each in the soak; CI: 2 on the fixed case, 1 on the drawn."""
    return scaled(2 if case.ci else 1, 8)


def _ledger_epsilons(case: TrainerCase, out: Path) -> dict[str, dict[str, float]]:
    found = {}
    for name in case.ledgers:
        if (out / name).exists():
            found[name] = Ledger.open(out / name).epsilons()  # verifies every chain
    return found


def _classify(case: TrainerCase, out: Path) -> str:
    """Where the kill landed, from what it left on disk (in the algorithm that was running:
    the last one with a ledger or a checkpoint)."""
    n = max(len(case.ledgers), len(case.checkpoints))
    for i in reversed(range(n)):
        ckpt = out / case.checkpoints[i] if i < len(case.checkpoints) else None
        ledger_path = out / case.ledgers[i] if i < len(case.ledgers) else None
        has_ckpt = ckpt is not None and (ckpt / "LATEST").exists()
        if not has_ckpt and not (ledger_path is not None and ledger_path.exists()):
            continue
        where = f" ({Path(case.checkpoints[i]).name})" if n > 1 else ""
        if ledger_path is None:
            return "at or between checkpoints (no ledger)" + where
        led = Ledger.open(ledger_path)
        if led.discarded_bytes:
            return "inside a ledger write" + where
        if not has_ckpt:
            return "before the first checkpoint" + where
        assert ckpt is not None
        latest = ckpt / (ckpt / "LATEST").read_text().strip()
        pointer = json.loads((latest / "state.json").read_text())["ledger_pointer"]
        if pointer["seq"] < led.head().seq:
            return "between a charge and its checkpoint" + where
        return "at a checkpoint boundary (even step, evaluation or report)" + where
    return "before training"


def _wait_for_progress(case: TrainerCase, out: Path, proc: subprocess.Popen,
                       timeout: float) -> bool:
    end = time.monotonic() + timeout
    empty = ((None,) * len(case.ledgers), (None,) * len(case.checkpoints))
    while time.monotonic() < end:
        if _progress(case, out) != empty:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    return False


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted reference runs: outcome, time per checkpoint, training time (first
    durable step to the last checkpoint) and when each checkpoint was written."""
    refs = {}
    for case in ACTIVE:
        out = tmp_path_factory.mktemp(f"ref-{case.name}")
        t0 = time.monotonic()
        proc = subprocess.Popen(command(case, out, False), env=env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        started = _wait_for_progress(case, out, proc, 300)
        t_start = time.monotonic() - t0
        seen = []  # (time, checkpoint pointers) changes
        while proc.poll() is None:
            now = _progress(case, out)[1]
            if any(now) and (not seen or seen[-1][1] != now):
                seen.append((time.monotonic(), now))
            time.sleep(0.001)
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0 and started and len(seen) >= 3, err
        per_iteration = (seen[-1][0] - seen[0][0]) / (len(seen) - 1)
        t_train = seen[-1][0] - t0 - t_start  # first durable step to the last checkpoint
        # per checkpoint directory: (checkpoint name, training time it was first seen)
        when: list[list[tuple[str, float]]] = [[] for _ in case.checkpoints]
        for t, ptrs in seen:
            for j, name in enumerate(ptrs):
                if name and (not when[j] or when[j][-1][0] != name):
                    when[j].append((name, t - t0 - t_start))
        refs[case.name] = (outcome(case, out), per_iteration, t_train, when)
    return refs


@pytest.mark.parametrize("case", ACTIVE, ids=lambda c: c.name)
def test_sigkill_at_random_points_then_resume_is_bitwise_equal(case, references, tmp_path):
    ref, per_iteration, t_train, when = references[case.name]
    n_kills = kills(case)
    out = tmp_path / "run"
    rng = np.random.default_rng([7, len(case.name)])
    prev: dict[str, dict[str, float]] = {}
    landed: list[str] = []
    for i in range(n_kills):
        state_before = _progress(case, out)
        proc = subprocess.Popen(command(case, out, resume=i > 0), env=env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # wait until the run has durably done something (a charge or a checkpoint), so
            # the kill lands in training, not in start-up; then kill it at a random point of
            # the i-th of n equal shares of 90% of the reference run's training up to its last
            # checkpoint (the run's position located by its checkpoints), so the kills spread
            # over every algorithm of the run
            end = time.monotonic() + 300
            while (_progress(case, out) == state_before and proc.poll() is None
                   and time.monotonic() < end):
                time.sleep(0.002)
            at = _position(when, _progress(case, out)[1])
            target = 0.9 * t_train * (i + float(rng.uniform())) / n_kills
            time.sleep(max(target - at, float(rng.uniform(0.0, per_iteration))))
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
    assert len(killed) >= (n_kills + 1) // 2, landed


def _position(when: list[list[tuple[str, float]]], pointers: tuple) -> float:
    """Where a run with these checkpoint pointers stands in the reference run's training
    time (the latest reference checkpoint at or before them; names sort by round)."""
    for j in reversed(range(len(pointers))):
        if pointers[j]:
            times = [t for name, t in when[j] if name <= pointers[j]]
            if times:
                return max(times)
            return max((t for name, t in when[j - 1]), default=0.0) if j else 0.0
    return 0.0


def _progress(case: TrainerCase, out: Path) -> tuple:
    """What a run has durably done: ledger bytes and checkpoint pointers."""
    return (tuple((out / x).read_bytes() if (out / x).exists() else None for x in case.ledgers),
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
    from fl_examples.core import checkpoint  # every trainer saves through it

    real = checkpoint.save

    def crash_point(m):
        def save(directory, round_, tensors, state):
            if round_ == 5:
                raise _Crash
            return real(directory, round_, tensors, state)

        m.setattr(checkpoint, "save", save)

    _assert_same(*_straight_and_crashed(tmp_path, monkeypatch, "output", crash_point))


def test_crash_after_a_rounds_charges_before_its_release(tmp_path, monkeypatch):
    """Objective perturbation charges one group per distinct |D_i|, all of a round in one
    all-or-nothing write; die right after round 3's write, before anything is released: the
    resumed run adopts the charges (never charges twice) and ends as an uninterrupted one."""
    import privkit.ledger as ledger_mod

    real = ledger_mod.Ledger.spend_many
    seen: list[int] = []

    def crash_point(m):
        def spend_many(self, charges, **kw):
            receipt = real(self, charges, **kw)
            seen.append(kw.get("round"))
            if kw.get("round") == 3 and seen.count(3) == 1:
                raise _Crash
            return receipt

        m.setattr(ledger_mod.Ledger, "spend_many", spend_many)

    ref, res, tmp = _straight_and_crashed(tmp_path, monkeypatch, "objective", crash_point)
    lines = (tmp / "ref" / "ledger-upcycled.jsonl").read_text().splitlines()[1:]
    events = {json.dumps(json.loads(x)["event"], sort_keys=True) for x in lines
              if json.loads(x)["round"] == 3}
    assert len(events) >= 2  # round 3 really charges several groups (one write)
    _assert_same(ref, res, tmp)


def test_scfl_resume_keeps_the_coded_upload_of_the_first_start(tmp_path, monkeypatch):
    """SCFL's privacy is one coded upload per client: with OS-entropy coding noise (nothing
    to replay) a crash and resume must go on with the coded rows the server already holds,
    never with a fresh coding, and report the same MI-DP."""
    import fl_examples.scfl as scfl
    from fl_examples.core import checkpoint  # every trainer saves through it

    cfg = scfl.ScflConfig(dataset="digits", clients=6, num_coded_rows=60, rounds=6,
                          checkpoint_every=1, secure_coding=True, seed=1)
    real = checkpoint.save

    def save(directory, round_, tensors, state):
        if round_ == 4:
            raise _Crash
        return real(directory, round_, tensors, state)

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "save", save)
        with pytest.raises(_Crash):
            scfl.train(cfg, algorithms="scfl", out=out)
    from safetensors.numpy import load_file

    ckpt = out / "checkpoints" / "scfl"
    first = load_file(ckpt / "ckpt-000003" / "tensors.safetensors")
    from fl_examples.scfl.run import _code

    fresh = _code(cfg, scfl.load_data(cfg), None)  # what a recoding gives
    assert not np.array_equal(fresh[0], first["coded_x"])
    res = scfl.train(cfg, algorithms="scfl", out=out, resume=True)
    last = load_file(ckpt / (ckpt / "LATEST").read_text().strip() / "tensors.safetensors")
    assert (ckpt / "LATEST").read_text().strip() == "ckpt-000006"
    assert np.array_equal(last["coded_x"], first["coded_x"])
    assert np.array_equal(last["coded_y"], first["coded_y"])
    midp = json.loads((out / "midp-scfl.json").read_text())
    assert midp["mi_dp_nats"] == res["algorithms"]["scfl"]["privacy"]["per_client"]
    assert all(x > 0 for x in midp["mi_dp_nats"])


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


@pytest.mark.parametrize("with_head", [False, True], ids=["journal", "journal-and-head"])
def test_older_ledger_is_refused(finished, tmp_path, with_head):
    """An older copy of the journal is refused by its head record; an older copy of both (a
    restore of the whole directory's ledger from a backup) by the checkpoint's pointer."""
    from privkit import _head

    case, done = finished
    out = _copy(done, tmp_path / "out")
    path = out / case.ledgers[0]
    lines = path.read_bytes().splitlines(keepends=True)
    keep = [i for i, x in enumerate(lines[1:], 1) if json.loads(x)["round"] <= 3]
    older = b"".join(lines[: keep[-1] + 1])
    path.write_bytes(older)  # an older copy of the same journal
    if with_head:  # and the head record of that time
        last = json.loads(lines[keep[-1]])
        _head.write_head(str(path) + ".head", _head.Head(
            last["seq"], last["hash"], len(older), json.loads(lines[0])["hash"]), None)
        Ledger.open(path)  # still a valid ledger on its own
    before = _snapshot(out)
    r = run(case, out, resume=True)
    assert r.returncode == 2, r.stderr
    msg = r.stderr.strip().splitlines()
    want = "is not in this ledger" if with_head else "entries are missing"
    assert len(msg) == 1 and want in msg[0], r.stderr
    if not with_head:
        assert "privkit ledger recover" in msg[0] and f"{path}.head" in msg[0]
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
import privkit  # warm up: the accountant imports its numerics on first use, not in the window
privkit.epsilon(GaussianDpEvent(1000.0), 1e-5)
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
