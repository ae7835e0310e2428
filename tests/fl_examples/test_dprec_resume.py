"""DP-REC trainer: checkpoint and resume, bitwise, after crashes at the windows that matter.

Every random stream of a round (draws, local batches, REC seeds and selection, DP-FedAvg
noise) comes from the seed tree by round, so a resumed run replays exactly. The ledger is
charged before a round releases anything and a checkpoint records the ledger pointer, so a
round charged but not checkpointed is recognised on resume: its charges are adopted, not made
twice. Compared bitwise with an uninterrupted run: the ledgers (bytes; the header's time is
fixed with ``SOURCE_DATE_EPOCH``), the final checkpoints (model tensors and state) and
report.json, except the wall-clock fields ``wall_time_s`` and ``client_compute_s``.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _sigkill import kill_when

import fl_examples.core.report as report_mod
import fl_examples.dprec as dprec_mod
from fl_examples.core.checkpoint import CheckpointError
from fl_examples.core.seeds import SeedTree
from fl_examples.dprec import DPRecConfig, load_dataset, run_algorithm, train
from fl_examples.dprec.run import _Run
from privkit.cli import main
from privkit.errors import (
    InvalidParameterError,
    LedgerHeadError,
    LedgerMismatchError,
    LedgerRollbackError,
)
from privkit.ledger import Ledger
from privkit.mechanisms import aggregate, rec

WALL = frozenset({"wall_time_s", "client_compute_s"})  # the only wall-clock fields
# 10 clients, 6 draws with replacement a round: most DP-REC rounds draw a client twice, so
# they charge the ledger in two batches (count 1, count 2)
TINY = dict(clients=10, clients_per_round=6, rounds=6, bits=4, eval_every=1, lr=0.2,
            device="cpu", dpfedavg_noise=2.0, checkpoint_every=2)
ARGV = ["train", "dprec", "--dataset", "digits", "--clients", "10", "--clients-per-round", "6",
        "--rounds", "6", "--bits", "4", "--eval-every", "1", "--lr", "0.2",
        "--noise-multiplier", "2.0", "--device", "cpu", "--checkpoint-every", "2",
        "--threads", "1", "--algorithms", "dprec,dpfedavg"]
ALGS = ("dprec", "dpfedavg")


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    # the ledger header's time is its only wall-clock field: fix it for byte-equal ledgers
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    monkeypatch.setattr(report_mod, "plot_histories", lambda *a, **k: [])  # speed only
    monkeypatch.setattr(dprec_mod, "_plot_vs_epsilon", lambda *a, **k: None)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Crash(BaseException):
    """Stands for SIGKILL: nothing in the trainer catches it, nothing after it runs."""


def _drop(obj, keys=WALL):
    if isinstance(obj, dict):
        return {k: _drop(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [_drop(v, keys) for v in obj]
    return obj


def outcome(out: Path, algs=ALGS) -> dict:
    """What a finished run leaves that must be reproduced bitwise (wall clock dropped)."""
    report = _drop(json.loads((out / "report.json").read_text()))
    res = {f"{a}/report": report["algorithms"][a] for a in algs}
    res["config"] = report["config"]
    for alg in algs:
        res[alg] = (out / f"ledger-{alg}.jsonl").read_bytes()
        ck = out / "checkpoints" / alg
        latest = (ck / "LATEST").read_text().strip()
        res[f"{alg}/ckpt"] = (latest, (ck / latest / "tensors.safetensors").read_bytes(),
                              _drop(json.loads((ck / latest / "state.json").read_text())))
    return res


def _same(got: dict, want: dict) -> None:
    for key in want:
        assert got[key] == want[key], key


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run (both algorithms, checkpoints every 2 rounds)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SOURCE_DATE_EPOCH", "1700000000")
        m.setattr(report_mod, "plot_histories", lambda *a, **k: [])
        m.setattr(dprec_mod, "_plot_vs_epsilon", lambda *a, **k: None)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            train(DPRecConfig(**TINY), compare=("dpfedavg",), out=out)
        finally:
            torch.set_num_threads(before)
    return out


def _crash_on(m, module, name, when):
    """Make ``module.name`` raise Crash on the call numbers ``when`` accepts."""
    real, calls = getattr(module, name), []

    def spy(*args, **kwargs):
        calls.append(1)
        if when(len(calls)):
            raise Crash(name)
        return real(*args, **kwargs)

    m.setattr(module, name, spy)


def _rounds_charged(path: Path) -> list[int]:
    return [json.loads(x)["round"] for x in path.read_text().splitlines()[1:]]


def _latest(out: Path, alg: str) -> str:
    return (out / "checkpoints" / alg / "LATEST").read_text()


def test_charged_but_not_checkpointed_rounds_are_adopted(tmp_path, monkeypatch, reference):
    """DP-REC dies in round 3 after its charge (checkpoint at 2); the resume then dies in
    DP-FedAvg's round 5 after its charge (checkpoint at 4); the last resume finishes.
    Nothing is charged twice and the end is bitwise the uninterrupted run's."""
    cfg, out = DPRecConfig(**TINY), tmp_path / "run"
    with monkeypatch.context() as m:
        _crash_on(m, rec, "encode", lambda n: n == 2 * 6 + 1)  # the first encode of round 3
        with pytest.raises(Crash):
            train(cfg, out=out)
    assert max(_rounds_charged(out / "ledger-dprec.jsonl")) == 3
    assert _latest(out, "dprec") == "ckpt-000002"
    eps1 = Ledger.open(out / "ledger-dprec.jsonl").epsilons()
    with monkeypatch.context() as m:
        _crash_on(m, aggregate, "gaussian_noise", lambda n: n == 5)  # DP-FedAvg round 5
        with pytest.raises(Crash):
            train(cfg, out=out, resume=True)
    assert max(_rounds_charged(out / "ledger-dpfedavg.jsonl")) == 5
    assert _latest(out, "dpfedavg") == "ckpt-000004"
    eps2 = Ledger.open(out / "ledger-dprec.jsonl").epsilons()
    assert all(eps2[c] >= e for c, e in eps1.items())  # spend never decreases
    train(cfg, out=out, resume=True)
    _same(outcome(out), outcome(reference))


def test_crash_between_two_charge_batches_of_a_round(tmp_path, monkeypatch, reference):
    """A round whose clients are charged in two batches dies after the first: the resume
    adopts it and charges only the second."""
    cfg, out = DPRecConfig(**TINY), tmp_path / "run"
    probe = _Run("dprec", cfg, load_dataset(cfg), Ledger.create(
        None, population_id="probe", delta=cfg.delta), None)
    t = next(r for r in range(3, cfg.rounds + 1) if len(probe.charges(r)) > 1)
    real = Ledger.spend

    def spend(self, ids, event, **kw):
        receipt = real(self, ids, event, **kw)
        if kw.get("round") == t and kw.get("run_id") == "dprec":
            raise Crash("after the first batch")
        return receipt

    with monkeypatch.context() as m:
        m.setattr(Ledger, "spend", spend)
        with pytest.raises(Crash):
            train(cfg, out=out)
    ids = [json.loads(x)["client_id"] for x in
           (out / "ledger-dprec.jsonl").read_text().splitlines()[1:]
           if json.loads(x)["round"] == t]
    assert ids == probe.charges(t)[0][1]  # only the first batch of round t
    train(cfg, out=out, resume=True)
    _same(outcome(out), outcome(reference))


def test_crash_before_the_first_checkpoint(tmp_path, monkeypatch, reference):
    """Round 1 is charged, its release dies, there is no checkpoint yet: the resume adopts
    round 1's charges from the start of the ledger."""
    cfg, out = DPRecConfig(**TINY), tmp_path / "run"
    with monkeypatch.context() as m:
        _crash_on(m, rec, "encode", lambda n: n == 3)
        with pytest.raises(Crash):
            train(cfg, out=out)
    assert _rounds_charged(out / "ledger-dprec.jsonl") and not (
        out / "checkpoints" / "dprec" / "LATEST").exists()
    train(cfg, out=out, resume=True)
    _same(outcome(out), outcome(reference))


def test_older_checkpoint_and_older_ledger_are_refused(tmp_path):
    cfg = DPRecConfig(**TINY)
    ds = load_dataset(cfg)
    out = tmp_path / "run"
    run_algorithm("dprec", cfg, ds, out=out, stop_after=2)
    ledger = out / "ledger-dprec.jsonl"
    head = out / "ledger-dprec.jsonl.head"
    old_ledger, old_head = ledger.read_bytes(), head.read_bytes()
    run_algorithm("dprec", cfg, ds, out=out, resume=True)
    ck = out / "checkpoints" / "dprec"
    assert (ck / "LATEST").read_text() == "ckpt-000006"
    # an older checkpoint: the ledger holds rounds 3-6, beyond one checkpoint interval
    (ck / "LATEST").write_text("ckpt-000002")
    with pytest.raises(LedgerRollbackError, match="older than the ledger"):
        run_algorithm("dprec", cfg, ds, out=out, resume=True)
    (ck / "LATEST").write_text("ckpt-000006")
    # an older journal: its head record says more was committed
    new_ledger, new_head = ledger.read_bytes(), head.read_bytes()
    ledger.write_bytes(old_ledger)
    with pytest.raises(LedgerHeadError, match="entries are missing"):
        run_algorithm("dprec", cfg, ds, out=out, resume=True)
    # an older ledger, head record too: it lacks the entry the checkpoint depends on
    head.write_bytes(old_head)
    with pytest.raises(LedgerMismatchError, match="not in this ledger"):
        run_algorithm("dprec", cfg, ds, out=out, resume=True)
    ledger.write_bytes(new_ledger)
    head.write_bytes(new_head)
    # another configuration, or a new run into the same directory
    with pytest.raises(CheckpointError, match="another configuration"):
        run_algorithm("dprec", DPRecConfig(**(TINY | {"lr": 0.3})), ds, out=out, resume=True)
    with pytest.raises(InvalidParameterError, match="--resume"):
        run_algorithm("dprec", cfg, ds, out=out)
    assert ledger.read_bytes() == new_ledger  # nothing was charged by the refusals


def test_seen_seeds_survive_resume(tmp_path):
    """The server's seen-seed set is checkpointed: after a resume a message reusing a seed
    of an earlier round is still refused."""
    cfg = DPRecConfig(**TINY)
    ds = load_dataset(cfg)
    out = tmp_path / "run"
    run_algorithm("dprec", cfg, ds, out=out, stop_after=2)
    run = _Run("dprec", cfg, ds, Ledger.open(out / "ledger-dprec.jsonl"), None)
    run.restore(out / "checkpoints" / "dprec")
    tree = SeedTree(cfg.seed)
    streams = [tree.numpy(t, "rec-seeds") for t in (1, 2)]
    sent = [g.bytes(16) for g in streams for _ in range(6)]
    assert run.seen_seeds == set(sent)
    u = {k: torch.zeros(s, dtype=torch.float64) for k, s in run.shapes.items()}
    msg = rec.encode(u, l2_clip_norm=0.5, stddev=1.0, bits=4, groups="per-layer",
                     seed=sent[7], rng=np.random.default_rng(0))
    with pytest.raises(InvalidParameterError, match="message.seed"):
        run.receive(msg)
    fresh = rec.encode(u, l2_clip_norm=0.5, stddev=1.0, bits=4, groups="per-layer",
                       seed=b"\x01" * 16, rng=np.random.default_rng(0))
    assert run.receive(fresh).keys() == run.shapes.keys()


# --------------------------------------------------------------------- SIGKILL, subprocess
def test_sigkill_then_resume_is_bitwise_equal(tmp_path, capsys, reference):
    """Kill the CLI in DP-REC, then in DP-FedAvg (resumed), then resume to the end."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    # DP-REC charges about 5 ledger lines a round: stop in round 4 (after the checkpoint
    # at 2); DP-FedAvg charges one line (the population's release) a round: stop in round 3
    where1, led1 = kill_when(ARGV, out, False, "ledger-dprec.jsonl", 1 + 17)
    eps1 = led1.epsilons()
    where2, _ = kill_when(ARGV, out, True, "ledger-dpfedavg.jsonl", 1 + 3)
    eps2 = Ledger.open(out / "ledger-dprec.jsonl").epsilons()
    assert all(eps2[c] >= e for c, e in eps1.items())  # spend never decreases
    assert main(ARGV + ["--out", str(out), "--resume"]) == 0
    capsys.readouterr()
    # where the kills landed: in the log (pytest -o log_cli=true shows it), not on stdout
    logging.getLogger(__name__).info("kills landed: dprec %s, dpfedavg %s; killed runs and resume "
                                     "%.1f s", where1, where2, time.monotonic() - t0)
    _same(outcome(out), outcome(reference))
    shutil.rmtree(out)
