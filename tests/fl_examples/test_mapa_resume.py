"""MAPA checkpoint / resume: bitwise-equal resumes, adopted write-ahead charges, refusals.

A crash can land between an upload's ledger charge (made before its noise is drawn) and the
next checkpoint; on resume those charges are adopted (same edges, upload numbers, events),
never made twice, and the run ends bitwise equal to an uninterrupted one. Older checkpoints
and older ledgers are refused.
"""

import json
import logging
import time

import pytest
import torch
from _sigkill import kill_when

import fl_examples.mapa as mapa_mod
import privkit
from fl_examples.core import checkpoint  # every trainer saves through it
from fl_examples.core.checkpoint import CheckpointError
from fl_examples.core.models import MultinomialLogReg
from fl_examples.mapa import MapaConfig, load_edges, run_algorithm
from fl_examples.mapa.run import _Run
from fl_examples.mapa.uploads import _pool
from privkit.cli import main
from privkit.errors import LedgerHeadError, LedgerMismatchError, LedgerRollbackError
from privkit.ledger import Ledger

WALL = frozenset({"wall_time_s", "client_compute_s"})  # the only wall-clock fields
BASE = dict(dataset="digits", edges=8, batch=16, updates=120, eval_every=20, seed=3,
            checkpoint_every=15, epsilon=(1.0, 2.0) * 4, delta=1e-3)


@pytest.fixture(autouse=True)
def fixed_time(monkeypatch):
    # the ledger header's time is its only wall-clock field: fix it for byte-equal ledgers
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def digits8():
    return load_edges("digits", edges=8, seed=3)


class _Crash(BaseException):
    """Stands for SIGKILL: nothing after the raise point runs."""


def _drop(obj, keys=WALL):
    if isinstance(obj, dict):
        return {k: _drop(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [_drop(v, keys) for v in obj]
    return obj


def _crash_at_save(monkeypatch, applied):
    real = checkpoint.save

    def save(directory, round_, tensors, state):
        if state["applied"] == applied:
            raise _Crash
        return real(directory, round_, tensors, state)

    monkeypatch.setattr(checkpoint, "save", save)


def _public(res):
    return _drop({k: v for k, v in res.items() if not k.startswith("_")})


def _pointer(out, alg):
    ck = out / "checkpoints" / alg
    return json.loads((ck / (ck / "LATEST").read_text() / "state.json").read_text())[
        "ledger_pointer"]


@pytest.mark.parametrize("extra", [
    {}, {"batched": False, "tau_max": 3},
    {"batch_sampler": "poisson", "amplification": True},
], ids=["batched", "naive-drops", "poisson-amplified"])
def test_charged_but_not_checkpointed_uploads_are_adopted(extra, digits8, tmp_path, monkeypatch):
    """The save after update 60 dies: the uploads charged since the save at 45 are in the
    ledger but no checkpoint covers them. Resuming replays them from update 45 with the same
    batches and noise streams, adopting their charges instead of charging them again."""
    cfg = MapaConfig(**(BASE | extra))
    ref = run_algorithm("mapa", cfg, dataset=digits8, out=tmp_path / "ref")
    with monkeypatch.context() as m:
        _crash_at_save(m, 60)
        with pytest.raises(_Crash):
            run_algorithm("mapa", cfg, dataset=digits8, out=tmp_path / "run")
    led = Ledger.open(tmp_path / "run" / "ledger-mapa.jsonl")
    ptr = _pointer(tmp_path / "run", "mapa")
    assert ptr["seq"] < led.head().seq  # charged, not checkpointed
    spent = led.epsilons()
    res = run_algorithm("mapa", cfg, dataset=digits8, out=tmp_path / "run", resume=True)
    assert torch.equal(ref["_model"], res["_model"])
    assert (tmp_path / "ref" / "ledger-mapa.jsonl").read_bytes() == \
        (tmp_path / "run" / "ledger-mapa.jsonl").read_bytes()  # no second charge, no fork
    assert _public(ref) == _public(res)
    after = Ledger.open(tmp_path / "run" / "ledger-mapa.jsonl").epsilons()
    assert all(after[c] >= e for c, e in spent.items())  # spend never decreases


def test_crash_between_two_spend_calls_of_one_computation(digits8, tmp_path, monkeypatch):
    """Edges with eps 1 and eps 2 are charged in two spend calls per batched computation; a
    crash after the first leaves half a computation's charges: adopted, the rest made."""
    cfg = MapaConfig(**BASE)
    ref = run_algorithm("mapa", cfg, dataset=digits8, out=tmp_path / "ref")
    real, calls = Ledger.spend, []

    def spend(self, ids, event, **kw):
        calls.append(kw["step"])
        if len(calls) > 20 and calls[-1] == calls[-2]:  # the second call of one computation
            raise _Crash
        return real(self, ids, event, **kw)

    with monkeypatch.context() as m:
        m.setattr(Ledger, "spend", spend)
        with pytest.raises(_Crash):
            run_algorithm("mapa", cfg, dataset=digits8, out=tmp_path / "run")
    led = Ledger.open(tmp_path / "run" / "ledger-mapa.jsonl")
    assert led.entries_since(led.origin())[-1]["step"] == calls[-1]  # half of it charged
    res = run_algorithm("mapa", cfg, dataset=digits8, out=tmp_path / "run", resume=True)
    assert torch.equal(ref["_model"], res["_model"]) and _public(ref) == _public(res)
    assert (tmp_path / "ref" / "ledger-mapa.jsonl").read_bytes() == \
        (tmp_path / "run" / "ledger-mapa.jsonl").read_bytes()


def test_crash_before_the_first_checkpoint_adopts_the_first_window(digits8, tmp_path,
                                                                   monkeypatch):
    cfg = MapaConfig(**BASE)
    ref = run_algorithm("audp", cfg, dataset=digits8, out=tmp_path / "ref")
    with monkeypatch.context() as m:
        _crash_at_save(m, 15)
        with pytest.raises(_Crash):
            run_algorithm("audp", cfg, dataset=digits8, out=tmp_path / "run")
    assert Ledger.open(tmp_path / "run" / "ledger-audp.jsonl").head().seq >= 0
    res = run_algorithm("audp", cfg, dataset=digits8, out=tmp_path / "run", resume=True)
    assert torch.equal(ref["_model"], res["_model"]) and _public(ref) == _public(res)
    assert (tmp_path / "ref" / "ledger-audp.jsonl").read_bytes() == \
        (tmp_path / "run" / "ledger-audp.jsonl").read_bytes()


@pytest.mark.parametrize("batched", [True, False])
def test_the_charge_plan_is_what_the_ledger_records(batched, digits8, tmp_path):
    """The planner that recognises adopted charges predicts every spend call of a whole run
    (drops, a budget stop, batched flushes or one upload at a time)."""
    one = privkit.epsilon(privkit.SelfComposedDpEvent(privkit.L2LaplaceDpEvent(1.0, 650), 12),
                          1e-3, "optimal").epsilon
    cfg = MapaConfig(**(BASE | {"tau_max": 2, "batched": batched, "epsilon": 1.0,
                                "epsilon_budget": one * (1 + 1e-9)}))
    res = run_algorithm("mapa", cfg, dataset=digits8, out=tmp_path)
    assert "stopped" in res["privacy"] and res["dropped_uploads"] > 0
    led = Ledger.open(tmp_path / "ledger-mapa.jsonl")
    calls: dict[int, list] = {}
    for e in led.entries_since(led.origin()):
        calls.setdefault(e["batch_end"], []).append(e)
    recorded = [(tuple(e["client_id"] for e in es), json.dumps(es[0]["event"], sort_keys=True,
                                                                separators=(",", ":")),
                 es[0]["round"], es[0]["step"]) for es in calls.values()]
    ds = digits8
    fresh = _Run("mapa", cfg, MultinomialLogReg(ds.num_features, ds.num_classes),
                 _pool(ds, torch.device("cpu")), mapa_mod.simulate(
                     8, 120, cfg.timing(), seed=3, tau_max=2), None, torch.device("cpu"))
    assert fresh._plan(fresh.end) == recorded
    # client_seq is the edge's upload number
    for e in led.entries_since(led.origin()):
        assert e["client_seq"] < res["privacy"]["uploads_per_edge"][int(e["client_id"])]


def test_older_checkpoint_and_older_ledger_are_refused(digits8, tmp_path, monkeypatch):
    cfg = MapaConfig(**BASE)
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        _crash_at_save(m, 75)
        with pytest.raises(_Crash):
            run_algorithm("mapa", cfg, dataset=digits8, out=out)
    ledger = out / "ledger-mapa.jsonl"
    head = out / "ledger-mapa.jsonl.head"
    old_ledger = ledger.read_bytes()  # an older ledger (head before later charges)
    old_head = head.read_bytes()
    run_algorithm("mapa", cfg, dataset=digits8, out=out, resume=True)
    done = ledger.read_bytes()
    ck = out / "checkpoints" / "mapa"
    latest = (ck / "LATEST").read_text()
    # 1. an older checkpoint (LATEST moved back to update 30): later spend would be forgotten
    older = next(p.name for p in sorted(ck.iterdir())
                 if p.name.startswith("ckpt-") and json.loads(
                     (p / "state.json").read_text())["applied"] == 30)
    (ck / "LATEST").write_text(older)
    with pytest.raises(LedgerRollbackError, match="older than the ledger"):
        run_algorithm("mapa", cfg, dataset=digits8, out=out, resume=True)
    assert ledger.read_bytes() == done  # nothing charged, no fork
    (ck / "LATEST").write_text(latest)
    # 2. an older journal than its head record says was committed
    new_head = head.read_bytes()
    ledger.write_bytes(old_ledger)
    with pytest.raises(LedgerHeadError, match="entries are missing"):
        run_algorithm("mapa", cfg, dataset=digits8, out=out, resume=True)
    # ... and an older ledger (head record too) than the checkpoint expects
    head.write_bytes(old_head)
    with pytest.raises(LedgerMismatchError, match="not in this ledger"):
        run_algorithm("mapa", cfg, dataset=digits8, out=out, resume=True)
    assert ledger.read_bytes() == old_ledger
    # 3. a missing ledger is not a fresh start
    ledger.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        run_algorithm("mapa", cfg, dataset=digits8, out=out, resume=True)
    assert not ledger.exists()
    ledger.write_bytes(done)
    head.write_bytes(new_head)
    # 4. other settings
    with pytest.raises(CheckpointError, match="another configuration"):
        run_algorithm("mapa", MapaConfig(**(BASE | {"eval_every": 30})), dataset=digits8,
                      out=out, resume=True)


# --------------------------------------------------------------------- SIGKILL, subprocess
ARGV = ["train", "mapa", "--algorithms", "mapa,audp", "--dataset", "digits", "--clients", "8",
        "--batch", "16", "--rounds", "150", "--eval-every", "25", "--upload-epsilon", "2",
        "--tau-max", "6", "--checkpoint-every", "15", "--seed", "3"]


def _outcome(out):
    res = {"report": _drop(json.loads((out / "report.json").read_text()))}
    for alg in ("mapa", "audp"):
        res[alg] = (out / f"ledger-{alg}.jsonl").read_bytes()
        ck = out / "checkpoints" / alg
        latest = (ck / "LATEST").read_text().strip()
        res[f"{alg}/ckpt"] = (latest, (ck / latest / "tensors.safetensors").read_bytes(),
                              _drop(json.loads((ck / latest / "state.json").read_text())))
    return res


def test_sigkill_then_resume_is_bitwise_equal(tmp_path, capsys):
    """Kill the CLI during MAPA and again during AUDP (resumed), then resume to the end."""
    ref_out, out = tmp_path / "ref", tmp_path / "run"
    assert main(ARGV + ["--out", str(ref_out)]) == 0  # in-process: the same code and threads
    capsys.readouterr()
    t0 = time.monotonic()
    where1, led1 = kill_when(ARGV, out, False, "ledger-mapa.jsonl", 70)
    eps1 = led1.epsilons()
    where2, _ = kill_when(ARGV, out, True, "ledger-audp.jsonl", 45)
    eps2 = Ledger.open(out / "ledger-mapa.jsonl").epsilons()
    assert all(eps2[c] >= e for c, e in eps1.items())  # spend never decreases
    assert main(ARGV + ["--out", str(out), "--resume"]) == 0
    capsys.readouterr()
    # where the kills landed: in the log (pytest -o log_cli=true shows it), not on stdout
    logging.getLogger(__name__).info("kills landed: mapa %s, audp %s; killed runs and resume "
                                     "%.1f s", where1, where2, time.monotonic() - t0)
    got, want = _outcome(out), _outcome(ref_out)
    for key in want:
        assert got[key] == want[key], key
