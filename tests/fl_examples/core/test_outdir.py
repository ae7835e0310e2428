"""``--out`` for every trainer (fl_examples.core.outdir, through ``privkit train``): reruns
never add to another run's ledgers, ``--overwrite --discard-ledger`` starts new ledgers, keeps
the old ones aside and says so (tests/fl_examples/test_out_dir_safety.py: the rest), nothing is
created before a refusal, ``--resume`` needs a run; and every trainer stops a diverging run
with exit status 1 and one line (fl_examples.core.run)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fl_examples.core import outdir
from fl_examples.core.run import (
    DEFAULT_MAX_LOSS_FACTOR,
    TrainerRun,
    TrainingDivergedError,
    drive,
    max_loss_factor,
)
from privkit.cli import main
from privkit.errors import InvalidParameterError
from privkit.ledger import Ledger

#: A short private run of each trainer (without --out) and the ledgers it writes.
TRAINERS = {
    "upcycled": (("train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--epochs",
                  "1", "--device", "cpu", "--privacy", "output", "--sigma", "5"),
                 ("ledger-upcycled.jsonl",)),
    "mapa": (("train", "mapa", "--algorithms", "audp", "--clients", "4", "--rounds", "10",
              "--eval-every", "5"), ("ledger-audp.jsonl",)),
    "scfl": (("train", "scfl", "--clients", "4", "--coded-rows", "20", "--rounds", "2",
              "--algorithms", "scfl"), ()),
    "dprec": (("train", "dprec", "--clients", "10", "--clients-per-round", "4", "--rounds", "2",
               "--bits", "4", "--algorithms", "dprec", "--device", "cpu"), ("ledger-dprec.jsonl",)),
}


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def _cli(argv, capsys) -> tuple[int, str, list[str]]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished run of each trainer, made once (copied by the tests that change it)."""
    runs = {}
    for name, (argv, _) in TRAINERS.items():
        out = tmp_path_factory.mktemp(name) / "run"
        assert main([*argv, "--out", str(out)]) == 0
        runs[name] = out
    return runs


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("trainer", TRAINERS)
def test_rerun_without_resume_is_refused_and_changes_nothing(trainer, finished, capsys):
    argv, _ = TRAINERS[trainer]
    out = finished[trainer]
    before = _snapshot(out)
    code, stdout, err = _cli([*argv, "--out", out], capsys)
    assert code == 2 and stdout == "" and len(err) == 1, err
    assert "--out must be a new or empty directory" in err[0] and "--resume" in err[0]
    assert _snapshot(out) == before  # nothing charged, nothing written


@pytest.mark.parametrize("trainer", TRAINERS)
def test_overwrite_starts_new_ledgers_and_says_so(trainer, finished, tmp_path, capsys,
                                                  monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    argv, ledgers = TRAINERS[trainer]
    out = _copy(finished[trainer], tmp_path / "run")
    (out / "notes.txt").write_text("mine")  # not a trainer's file: kept
    old = {name: (out / name).read_bytes() for name in ledgers}
    code, _, err = _cli([*argv, "--out", out, "--overwrite", "--discard-ledger"], capsys)
    assert code == 0, err
    for name in ledgers:  # said on stderr, and the old ledger is kept aside, not removed
        assert any(f"--overwrite --discard-ledger: {out / name}" in line and "new ledger" in line
                   for line in err), err
        kept = list(out.glob(f"{name}.discarded-*[0-9Z]"))
        assert len(kept) == 1 and kept[0].read_bytes() == old[name]
    fresh = tmp_path / "fresh"
    assert main([*argv, "--out", str(fresh)]) == 0
    capsys.readouterr()
    for name in ledgers:  # exactly one run's charges: the old ones are not reused
        assert (out / name).read_bytes() == (fresh / name).read_bytes()
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("trainer", ["upcycled", "dprec", "mapa"])
def test_a_deleted_ledger_is_not_recreated_on_resume(trainer, finished, tmp_path, capsys):
    argv, ledgers = TRAINERS[trainer]
    out = _copy(finished[trainer], tmp_path / "run")
    (out / ledgers[0]).unlink()
    before = _snapshot(out)
    code, _, err = _cli([*argv, "--out", out, "--resume"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "was deleted or moved" in err[0] and str(out / ledgers[0]) in err[0]
    assert _snapshot(out) == before and not (out / ledgers[0]).exists()


def test_resume_needs_a_run_and_out_a_path(tmp_path, capsys):
    argv, _ = TRAINERS["upcycled"]
    (tmp_path / "empty").mkdir()
    for out, want in ((tmp_path / "empty", "(it is empty)"),
                      (tmp_path / "missing", "(it is missing)")):
        code, _, err = _cli([*argv, "--out", out, "--resume"], capsys)
        assert code == 2 and len(err) == 1 and "holding a run to resume" in err[0]
        assert want in err[0]
    code, _, err = _cli([*argv, "--out", ""], capsys)
    assert code == 2 and len(err) == 1 and "--out must be a directory path" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    assert list((tmp_path / "empty").iterdir()) == []


def test_a_failed_run_leaves_a_new_or_empty_out_as_it_was(tmp_path, capsys):
    # a run that diverges before anything is charged (no privacy): exit status 1
    bad = ["train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--epochs", "1",
           "--device", "cpu", "--lr", "1e30"]
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        code, _, err = _cli([*bad, "--out", out], capsys)
        assert code == 1 and "diverged" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # nor its parent "new"
    assert list((tmp_path / "empty").iterdir()) == []


def test_prepare_out_and_the_writable_checks(tmp_path):
    assert outdir.prepare_out(None) is None
    with pytest.raises(InvalidParameterError, match="resume"):
        outdir.prepare_out(None, resume=True)
    with pytest.raises(InvalidParameterError, match="overwrite"):
        outdir.prepare_out(tmp_path, resume=True, overwrite=True)
    prepared = outdir.prepare_out(tmp_path / "a" / "b")
    assert prepared.fresh and not prepared.existed and prepared.created == [tmp_path / "a"]
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing
    (tmp_path / "f").write_text("x")
    for bad, why in ((tmp_path / "f", "it is a file"), (tmp_path / "f" / "x", "Not a directory"),
                     ("/proc/x", "No such file")):
        with pytest.raises(InvalidParameterError, match=why):
            outdir.prepare_out(bad)
        with pytest.raises(InvalidParameterError, match=why if why != "it is a file"
                           else "a file in a directory"):
            outdir.check_out_file(Path(bad) / "plot.png")
    with pytest.raises(InvalidParameterError, match="it is a directory"):
        outdir.check_out_file(tmp_path)


# ---------------------------------------------------------------------------- divergence
DIVERGING = {
    "upcycled": ("train", "upcycled", "--dataset", "digits:3", "--rounds", "4", "--epochs",
                 "1", "--device", "cpu", "--model", "mlp", "--lr", "1e3"),
    "mapa": ("train", "mapa", "--algorithms", "mapa", "--variance", "paper", "--clients", "6",
             "--rounds", "100", "--eval-every", "20"),
    "scfl": ("train", "scfl", "--dataset", "digits", "--clients", "5", "--coded-rows", "50",
             "--lr", "1e9", "--rounds", "30", "--algorithms", "fl-pma"),
    "dprec": ("train", "dprec", "--clients", "10", "--clients-per-round", "4", "--rounds", "4",
              "--bits", "4", "--algorithms", "dprec", "--device", "cpu", "--server-lr", "1e4"),
}


@pytest.mark.parametrize("trainer", DIVERGING)
def test_every_trainer_stops_a_diverging_run_with_exit_1(trainer, tmp_path, capsys):
    code, _, err = _cli([*DIVERGING[trainer], "--out", tmp_path / "run"], capsys)
    assert code == 1 and len(err) == 1, err
    assert "training diverged" in err[0] and f"more than {DEFAULT_MAX_LOSS_FACTOR:g} x" in err[0]
    assert "--max-loss-factor" in err[0]


class Toy(TrainerRun):
    """Losses from a list, one per step (a step's row holds the loss after it)."""

    algorithm, history = "toy", []

    def __init__(self, losses, *, finite=True):
        self.losses, self.t, self.history, self.finite = losses, 0, [], finite

    position = property(lambda self: self.t)

    def finished(self):
        return self.t >= len(self.losses) - 1

    def remaining(self):
        return len(self.losses) - 1 - self.t

    def step(self):
        self.t += 1
        return True

    def healthy(self):
        return self.finite or self.t < 2

    def evaluate(self):
        row = {"iteration": self.t, "train_loss": self.losses[self.t]}
        self.history.append(row)
        return row

    def state(self):
        return {"x": torch.zeros(1)}, {}

    def load_state(self, tensors, state):
        return None

    def report(self):
        return {}


def _drive(run):
    drive(run, checkpoints=None, checkpoint_every=0, eval_every=1)


def test_drive_stops_on_a_non_finite_or_growing_loss():
    _drive(Toy([2.0, 150.0, 199.0]))  # within 100 x the first value
    with pytest.raises(TrainingDivergedError, match=r"iteration 2: train loss 201 is more than "
                       r"100 x its first value 2 \(--max-loss-factor\)"):
        _drive(Toy([2.0, 150.0, 201.0, 1.0]))
    with pytest.raises(TrainingDivergedError, match="iteration 1: train loss nan"):
        _drive(Toy([2.0, math.nan, 1.0]))
    with pytest.raises(TrainingDivergedError, match="after step 2: the model is not finite"):
        _drive(Toy([2.0, 1.0, 1.0, 1.0], finite=False))
    with max_loss_factor(3) as f:
        assert f == 3.0
        with pytest.raises(TrainingDivergedError, match="more than 3 x"):
            _drive(Toy([2.0, 7.0]))
    with max_loss_factor(math.inf):
        _drive(Toy([2.0, 1e300]))  # only a non-finite loss stops it
        with pytest.raises(TrainingDivergedError):
            _drive(Toy([2.0, math.inf]))
    _drive(Toy([0.0, 5.0]))  # a first value of 0 sets no growth limit
    for bad in (0.5, math.nan, "x"):
        with pytest.raises(InvalidParameterError, match="max_loss_factor"):
            with max_loss_factor(bad):
                pass


def test_ledgers_of_a_refused_run_open_untouched(finished):
    for name, (_, ledgers) in TRAINERS.items():
        for ledger in ledgers:
            assert Ledger.open(finished[name] / ledger).head_note is None
