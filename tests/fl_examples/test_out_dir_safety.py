"""OUT is never damaged by a mistake (fl_examples.core.outdir, through ``privkit train``).

- A bad flag, config or data-set spec given with ``--overwrite`` exits 2 with one line and
  leaves OUT byte-identical, in all four trainers: flags and specs are checked before OUT is
  touched, and a failure found later (a data directory that does not hold the data) puts
  the previous run's files back.
- ``--overwrite`` never removes a ledger that holds charges: without ``--discard-ledger`` it
  refuses (one line naming the ledger and the flag) and changes nothing; with it, the ledger
  and its head record are renamed ``....discarded-<UTC time>``, kept, and still verify.
- A full disk while a checkpoint is written (ENOSPC) is one line and exit status 2, leaves no
  partial checkpoint, and the run resumes to the very same end.
- Absurd numbers are refused naming their flag: ``--noise-for-epsilon 1e308``, MAPA's
  ``--noise-multiplier 1e308`` (its step sizes overflowed), data-set specs with more clients
  than records; an epsilon near the largest double no longer breaks the epsilon plot.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fl_examples.core import checkpoint, outdir
from fl_examples.core.data import (
    DIGITS_RECORDS,
    check_dataset_spec,
    check_digits_clients,
    digits,
)
from fl_examples.core.epsilon_plot import plot_vs_epsilon
from fl_examples.mapa.schedule import MapaSchedule
from privkit.cli import main
from privkit.errors import InvalidParameterError
from privkit.events import GaussianDpEvent
from privkit.ledger import Ledger

#: A short private run of each trainer (without --out) and the ledger it charges.
TRAINERS = {
    "upcycled": (("train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--epochs",
                  "1", "--device", "cpu", "--privacy", "output", "--sigma", "5"),
                 "ledger-upcycled.jsonl"),
    "mapa": (("train", "mapa", "--algorithms", "audp", "--clients", "4", "--rounds", "10",
              "--eval-every", "5"), "ledger-audp.jsonl"),
    "scfl": (("train", "scfl", "--clients", "4", "--coded-rows", "20", "--rounds", "2",
              "--algorithms", "scfl", "--noise-multiplier", "1"), "ledger-scfl.jsonl"),
    "dprec": (("train", "dprec", "--clients", "10", "--clients-per-round", "4", "--rounds",
               "2", "--bits", "4", "--algorithms", "dprec", "--device", "cpu"),
              "ledger-dprec.jsonl"),
}

#: Per trainer, bad inputs (each exits 2 naming the flag), the first a flag, the second the
#: data-set spec or the client count, the third found only when the data are read.
BAD = {
    "upcycled": ((("--clip", "nan"), "--clip"),
                 (("--dataset", "digits:3@100000"), "--dataset"),
                 (("--dataset", "mnist:{empty}"), "directory")),
    "mapa": ((("--theta", "nan"), "--theta"),
             (("--clients", "100000"), "--clients"),
             (("--dataset", "mnist:{empty}"), "directory")),
    "scfl": ((("--noise-stddev", "nan"), "--noise-stddev"),
             (("--clients", "100000"), "--clients"),
             (("--dataset", "mnist:{empty}"), "directory")),
    "dprec": ((("--server-momentum", "inf"), "--server-momentum"),
              (("--clients", "100000"), "--clients"),
              (("--dataset", "mnist:{empty}"), "directory")),
}


def _snapshot(root: Path) -> dict[str, str | None]:
    """Every path under ``root`` (hidden ones too) -> the SHA-256 of its bytes (None: a
    directory)."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest()
                                       if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def _cli(argv, capsys) -> tuple[int, list[str]]:
    code = main([str(a) for a in argv])
    _, err = capsys.readouterr()
    return code, err.strip().splitlines()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished private run of each trainer (copied by the tests that change it)."""
    runs = {}
    for name, (argv, ledger) in TRAINERS.items():
        out = tmp_path_factory.mktemp(name) / "run"
        assert main([*argv, "--out", str(out)]) == 0
        assert outdir.ledger_entries(out / ledger), name  # it holds charges
        runs[name] = out
    return runs


def _copy(finished, trainer: str, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished[trainer], out)
    (out / "notes.txt").write_text("mine")  # not a trainer's file
    return out


@pytest.mark.parametrize("which", [0, 1, 2], ids=["flag", "clients", "data"])
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_bad_input_with_overwrite_leaves_out_byte_identical(trainer, which, finished,
                                                              tmp_path, capsys):
    argv, _ = TRAINERS[trainer]
    out = _copy(finished, trainer, tmp_path)
    (tmp_path / "empty").mkdir()
    before = _snapshot(out)
    bad, names = BAD[trainer][which]
    bad = [a.replace("{empty}", str(tmp_path / "empty")) for a in bad]
    if trainer == "dprec" and which == 2:  # --clients is for digits only
        argv = tuple(a for a in argv if a not in ("--clients", "10"))
    # the data are read (and found missing) only once OUT was prepared: past the ledger check
    for extra in ((), ("--discard-ledger",))[1 if which == 2 else 0:]:
        code, err = _cli([*argv, *bad, "--out", out, "--overwrite", *extra], capsys)
        assert code == 2 and len(err) == 1, err
        assert names in err[0], err
        assert _snapshot(out) == before  # nothing removed, renamed, added or changed


@pytest.mark.parametrize("trainer", TRAINERS)
def test_overwrite_refuses_a_ledger_with_charges_without_discard_ledger(trainer, finished,
                                                                        tmp_path, capsys):
    argv, ledger = TRAINERS[trainer]
    out = _copy(finished, trainer, tmp_path)
    before = _snapshot(out)
    code, err = _cli([*argv, "--out", out, "--overwrite"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "--discard-ledger must be given for --overwrite" in err[0]
    assert f"{out / ledger} holds" in err[0] and "entries" in err[0]
    assert _snapshot(out) == before


@pytest.mark.parametrize("trainer", TRAINERS)
def test_overwrite_with_discard_ledger_keeps_the_old_ledger_aside(trainer, finished, tmp_path,
                                                                  capsys, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # the ledgers' creation time
    argv, ledger = TRAINERS[trainer]
    out = _copy(finished, trainer, tmp_path)
    journal = (out / ledger).read_bytes()
    head = (out / f"{ledger}.head").read_bytes()
    spent = Ledger.open(out / ledger).report().max
    code, err = _cli([*argv, "--out", out, "--overwrite", "--discard-ledger"], capsys)
    assert code == 0, err
    kept = sorted(out.glob(f"{ledger}{outdir.DISCARDED}*[0-9Z]"))
    assert len(kept) == 1, sorted(p.name for p in out.iterdir())
    assert kept[0].read_bytes() == journal  # renamed, byte for byte, never deleted
    assert Path(f"{kept[0]}.head").read_bytes() == head
    assert Ledger.open(kept[0]).report().max == spent  # it still verifies and prices
    assert any(f"{out / ledger}" in line and kept[0].name in line
               and "no longer counted" in line for line in err), err
    assert not list(out.glob(f"{outdir.STAGE_PREFIX}*"))  # the staged outputs are gone
    assert (out / "notes.txt").read_text() == "mine"
    fresh = tmp_path / "fresh"  # the new ledger holds this run's charges only
    assert main([*argv, "--out", str(fresh)]) == 0
    capsys.readouterr()
    assert (out / ledger).read_bytes() == (fresh / ledger).read_bytes()
    # a second --overwrite keeps the first discarded ledger and sets the new one aside too
    code, err = _cli([*argv, "--out", out, "--overwrite", "--discard-ledger"], capsys)
    assert code == 0, err
    assert len(list(out.glob(f"{ledger}{outdir.DISCARDED}*[0-9Z]"))) == 2
    assert kept[0].read_bytes() == journal


def test_discard_ledger_needs_overwrite_and_an_unreadable_ledger_counts_as_charged(
        finished, tmp_path, capsys):
    argv, ledger = TRAINERS["upcycled"]
    out = _copy(finished, "upcycled", tmp_path)
    before = _snapshot(out)
    code, err = _cli([*argv, "--out", out, "--discard-ledger"], capsys)
    assert code == 2 and len(err) == 1 and "--discard-ledger must be given with --overwrite" \
        in err[0], err
    code, err = _cli([*argv, "--out", out, "--resume", "--discard-ledger"], capsys)
    assert code == 2 and len(err) == 1 and "--discard-ledger" in err[0], err
    assert _snapshot(out) == before
    # a head record whose journal is missing: the journal's spend may be lost, never guessed
    (out / ledger).unlink()
    before = _snapshot(out)
    code, err = _cli([*argv, "--out", out, "--overwrite"], capsys)
    assert code == 2 and "was deleted but its head record remains" in err[0], err
    assert _snapshot(out) == before


def test_a_run_that_fails_before_writing_anything_puts_the_overwritten_out_back(
        finished, tmp_path, capsys, monkeypatch):
    """A failure inside the trainer, after ``--overwrite`` set the old run aside and after the
    trainer created its (empty) ledger: the new files go, the old ones come back."""
    import fl_examples.upcycled as upcycled

    argv, ledger = TRAINERS["upcycled"]
    out = _copy(finished, "upcycled", tmp_path)
    before = _snapshot(out)

    def fails(cfg, *, out, **kw):
        assert not (Path(out) / ledger).exists()  # set aside by now
        Ledger.create(Path(out) / ledger, population_id="p", delta=1e-5)  # empty, with head
        (Path(out) / "checkpoints" / "upcycled").mkdir(parents=True)
        raise InvalidParameterError("clip", "x", "a number")

    monkeypatch.setattr(upcycled, "train", fails)
    code, err = _cli([*argv, "--out", out, "--overwrite", "--discard-ledger"], capsys)
    assert code == 2 and len(err) == 1 and "--clip must be a number" in err[0], err
    assert _snapshot(out) == before


def test_a_run_that_fails_after_charging_completes_the_overwrite(finished, tmp_path, capsys):
    """The new run charged, then diverged (exit 1): its ledger is the record now; the old
    ledger stays aside and the old report and plots are gone (they described another run)."""
    argv, ledger = TRAINERS["upcycled"]
    out = _copy(finished, "upcycled", tmp_path)
    journal = (out / ledger).read_bytes()
    code, err = _cli([*argv, "--lr", "1e30", "--max-loss-factor", "1.0001", "--out", out,
                      "--overwrite", "--discard-ledger"], capsys)
    assert code == 1 and "diverged" in err[-1], err
    (kept,) = out.glob(f"{ledger}{outdir.DISCARDED}*[0-9Z]")
    assert kept.read_bytes() == journal
    assert outdir.ledger_entries(out / ledger)  # the new run's charges
    assert not (out / "report.json").exists() and not list(out.glob("*.png"))
    assert not list(out.glob(f"{outdir.STAGE_PREFIX}*"))


def test_prepare_out_sets_aside_and_restore_puts_every_file_back(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    led = Ledger.create(out / "ledger-a.jsonl", population_id="p", delta=1e-5)
    led.spend(["c1"], GaussianDpEvent(1.0), label="test")
    Ledger.create(out / "ledger-b.jsonl", population_id="p", delta=1e-5)  # empty: no charge
    (out / "report.json").write_text("{}")
    (out / "checkpoints" / "a").mkdir(parents=True)
    (out / "checkpoints" / "a" / "LATEST").write_text("ckpt-000001")
    (out / ".privkit-overwrite-20000101T000000Z").mkdir()  # a killed run's leftovers
    before = _snapshot(out)
    assert outdir.ledger_entries(out / "ledger-a.jsonl") == 1
    assert outdir.ledger_entries(out / "ledger-b.jsonl") == 0
    assert outdir.ledger_entries(tmp_path / "missing.jsonl") is None
    with pytest.raises(InvalidParameterError, match="discard_ledger"):
        outdir.prepare_out(out, overwrite=True)
    assert _snapshot(out) == before
    prepared = outdir.prepare_out(out, overwrite=True, discard_ledger=True)
    assert prepared is not None and prepared.stage is not None
    kept = f"ledger-a.jsonl{outdir.DISCARDED}"
    assert sorted(p.name[:len(kept)] if p.name.startswith(kept) else p.name
                  for p in out.iterdir()) == sorted([prepared.stage.name, kept, kept])
    assert len(prepared.notes) == 1 and "ledger-a.jsonl (1 entries" in prepared.notes[0]
    prepared.restore()
    assert _snapshot(out) == before


# ---------------------------------------------------------------------------- full disk
RUN = ("train", "upcycled", "--dataset", "digits:3", "--rounds", "4", "--epochs", "1",
       "--device", "cpu", "--privacy", "output", "--sigma", "5", "--checkpoint-every", "1")


def _history(out: Path) -> list[dict]:
    report = json.loads((out / "report.json").read_text())
    return [{k: v for k, v in row.items() if k not in ("wall_time_s", "client_compute_s")}
            for row in report["algorithms"]["upcycled"]["history"]]


@pytest.mark.parametrize("raised", ["oserror", "safetensors"])
def test_a_full_disk_while_checkpointing_is_one_line_and_resumes_exactly(raised, tmp_path,
                                                                         capsys, monkeypatch):
    import safetensors.torch

    real = safetensors.torch.save_file
    calls = []

    def full(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) < 3:
            return real(tensors, filename, metadata)
        Path(filename).write_bytes(b"half a tensor")  # what a full disk leaves behind
        if raised == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        from safetensors import SafetensorError

        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # the ledgers' creation time
    out = tmp_path / "run"
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    code, err = _cli([*RUN, "--out", out], capsys)
    assert code == 2 and len(err) == 1, err
    assert "ckpt-000003.partial/tensors.safetensors" in err[0] and "(ENOSPC)" in err[0], err
    assert "No space left on device" in err[0] and "--resume" in err[0]
    assert not list(out.rglob("*.partial")) and not list(out.rglob("ckpt-000003*"))
    assert checkpoint.latest_round(out / "checkpoints" / "upcycled") == 2
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    code, err = _cli([*RUN, "--out", out, "--resume"], capsys)
    assert code == 0, err
    whole = tmp_path / "whole"
    code, err = _cli([*RUN, "--out", whole], capsys)
    assert code == 0, err
    assert _history(out) == _history(whole)
    ledger = "ledger-upcycled.jsonl"  # every charge made once, as in one uninterrupted run
    assert (out / ledger).read_bytes() == (whole / ledger).read_bytes()


def test_checkpoint_save_removes_its_partial_directory_on_any_refused_write(tmp_path,
                                                                            monkeypatch):
    import torch

    root = tmp_path / "ckpts"
    checkpoint.save(root, 1, {"w": torch.zeros(2)}, {"x": 1})

    def refuse(self, data):
        raise OSError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "write_bytes", refuse)  # state.json
    with pytest.raises(checkpoint.CheckpointError, match=r"state.json: checkpoint 2 not "
                       r"written: Permission denied \(EACCES\)"):
        checkpoint.save(root, 2, {"w": torch.ones(2)}, {"x": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "ckpt-000001"]
    assert checkpoint.latest_round(root) == 1


# ---------------------------------------------------------------------- absurd numbers
#: Per trainer, a private run whose noise --noise-for-epsilon calibrates.
CALIBRATED = {
    "upcycled": ("train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--epochs", "1",
                 "--device", "cpu", "--privacy", "client"),
    "mapa": ("train", "mapa", "--algorithms", "audp", "--clients", "4", "--rounds", "10",
             "--noise", "gaussian"),
    "scfl": ("train", "scfl", "--clients", "4", "--coded-rows", "20", "--rounds", "2",
             "--algorithms", "scfl"),
    "dprec": TRAINERS["dprec"][0],
}


@pytest.mark.parametrize("trainer", CALIBRATED)
def test_noise_for_an_absurd_epsilon_is_refused_before_anything(trainer, tmp_path, capsys):
    for target in ("1e308", "710", "inf"):
        code, err = _cli([*CALIBRATED[trainer], "--noise-for-epsilon", target, "--out",
                          tmp_path / "run"], capsys)
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith("privkit: error: --noise-for-epsilon must be"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, flag", [
    (("--noise", "gaussian", "--noise-multiplier", "1e308"), "--noise-multiplier"),
    (("--noise", "gaussian", "--noise-multiplier", "1e200"), "--noise-multiplier"),
    (("--noise", "gaussian", "--noise-multiplier", "1e100"), "--noise-multiplier"),
    (("--upload-epsilon", "1e-300"), "--upload-epsilon"),
    (("--noise", "l1", "--upload-epsilon", "1e-200", "--variance", "paper"),
     "--upload-epsilon"),
    (("--upload-epsilon", "1e308"), "--upload-epsilon"),
    (("--upload-epsilon", "1,2,3,800"), "--upload-epsilon"),
    (("--sigma", "1e308"), "--sigma"),
    (("--sigma", "1e-308"), "--sigma"),
    (("--noise", "gaussian", "--clip", "1e308"), "--clip"),
    (("--noise", "gaussian", "--clip", "1e-308"), "--clip"),
    (("--audp-clip", "1e200"), "--audp-clip"),
    (("--audp-clip", "1e-308"), "--audp-clip"),
    (("--lipschitz", "1e308"), "--lipschitz"),
    (("--lipschitz", "1e-308"), "--lipschitz"),
    (("--theta", "1e-300"), "--theta"),
    (("--lr", "1e308", "--step-schedule", "constant"), "--lr"),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_mapa_refuses_numbers_whose_noise_or_step_sizes_overflow(extra, flag, tmp_path,
                                                                 capsys):
    """Before: OverflowError or ZeroDivisionError tracebacks, a torch RuntimeError, or an
    error naming an internal (alpha, l2_clip_norm, delta_s, batch[0]) instead of the flag."""
    code, err = _cli(["train", "mapa", "--algorithms", "mapa,audp,asgd", "--clients", "4",
                      "--rounds", "10", "--eval-every", "5", *extra, "--out",
                      tmp_path / "run"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"privkit: error: {flag} must be"), err
    assert not (tmp_path / "run").exists()


def test_a_huge_but_finite_noise_keeps_a_finite_mapa_schedule():
    s = MapaSchedule(sigma=30, batch=24, delta=1e-5, epsilon0=1, lipschitz=10, r0=50, tau=3,
                     theta=0.5, dim=10, noise="gaussian", noise_multiplier=1e100)
    assert s.stage(0).gamma > 0 and s.stage(0).length == 2**62  # capped, no overflow
    with pytest.raises(InvalidParameterError, match="noise_multiplier"):
        MapaSchedule(sigma=30, batch=24, delta=1e-5, epsilon0=1, lipschitz=10, r0=50, tau=3,
                     theta=0.5, dim=10, noise="gaussian", noise_multiplier=1e300).stage(0)
    t = MapaSchedule(sigma=30, batch=24, delta=1e-3, epsilon0=1, lipschitz=10, r0=50, tau=3,
                     theta=0.5, dim=4380, variance="paper")
    assert [t.stage(i).length for i in range(5)] == [2, 6, 21, 75, 237]  # unchanged


@pytest.mark.parametrize("spec, why", [
    ("digits:3@100000", "at most 898 clients"),
    ("digits@1798", "at most 898 clients"),
    ("digits:iid@899", "at most 898 clients"),
    ("digits:3@600", "none to train on"),
    ("digits@0", "@CLIENTS needs at least 1 client"),
    ("digits@-3", "must be finite and >= 0"),
    ("synthetic:iid@10/1", "/MAXSIZE needs at least 2 records"),
    ("synthetic:0.5,0.5@99999999999999999999", "at most 1000000 synthetic clients"),
    ("synthetic:0.5,0.5@1000001/60", "at most 1000000 synthetic clients"),
    ("breast_cancer:57", "1 <= CLIENTS <= 56"),
])
def test_dataset_specs_with_too_many_or_too_few_clients_are_refused(spec, why):
    with pytest.raises(InvalidParameterError, match="dataset") as caught:
        check_dataset_spec(spec)
    assert why in str(caught.value)


def test_the_digits_client_check_is_exact():
    """check_digits_clients passes exactly the splits in which digits() gives every client a
    training record (the same partition, without the data)."""
    for k, per, seed in ((898, None, 0), (500, 1, 0), (300, 3, 1), (600, 3, 0), (450, 2, 4),
                         (180, 10, 2)):
        ds = digits(rng=seed, num_clients=k, classes_per_client=per)
        ok = int(ds.train_sizes.min()) >= 1
        try:
            check_digits_clients("dataset", "x", num_clients=k, classes_per_client=per,
                                 seed=seed)
            passed = True
        except InvalidParameterError:
            passed = False
        assert passed == ok, (k, per, seed)
    assert DIGITS_RECORDS == 1797


@pytest.mark.parametrize("argv, flag", [
    (("train", "upcycled", "--dataset", "digits:3@100000"), "--dataset"),
    (("train", "upcycled", "--dataset", "digits", "--clients", "5000"), "--dataset"),
    (("train", "mapa", "--clients", "1000"), "--clients"),
    (("train", "scfl", "--clients", "2000"), "--clients"),
    (("train", "dprec", "--clients", "5000"), "--clients"),
    (("train", "dprec", "--digits-classes", "3", "--clients", "600"), "--clients"),
])
def test_more_clients_than_records_is_refused_naming_the_flag(argv, flag, tmp_path, capsys):
    code, err = _cli([*argv, "--out", tmp_path / "run"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"privkit: error: {flag} must be"), err
    assert not (tmp_path / "run").exists()


def test_an_epsilon_near_the_largest_double_does_not_break_the_plot(tmp_path):
    rows = [{"heldout_accuracy": 0.5}, {"heldout_accuracy": 0.6}]
    assert plot_vs_epsilon(tmp_path, {"a": [(1e308, rows[0]), (1.7e308, rows[1])]},
                           x_label="eps", text=None) is None  # nothing drawable: no figure
    path = plot_vs_epsilon(tmp_path, {"a": [(1.0, rows[0]), (1e308, rows[1])],
                                      "b": [(np.inf, rows[0]), (2.0, rows[1])]},
                           x_label="eps", text=None)
    assert path is not None and path.stat().st_size > 0


def test_a_run_with_an_epsilon_near_the_largest_double_ends_cleanly(tmp_path, capsys):
    """z = 7.1e-155 prices at epsilon ~1e308 (the calibration of --noise-for-epsilon 1e308
    gave it before that was refused): the run still ends with its report, no traceback."""
    code, err = _cli(["train", "upcycled", "--dataset", "digits:3", "--rounds", "2",
                      "--epochs", "1", "--device", "cpu", "--privacy", "client",
                      "--noise-multiplier", "7.1e-155", "--out", tmp_path / "run"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["algorithms"]["upcycled"]["privacy"]["epsilon_max"] > 1e300


def test_a_sweep_report_skips_the_files_a_killed_overwrite_left_aside(finished, tmp_path):
    """A run killed during ``--overwrite`` leaves the previous run's report in the hidden
    stage directory; ``report tradeoff`` over a sweep reads the run's own report only."""
    from fl_examples.core.tradeoff_runs import _report_files

    out = _copy(finished, "upcycled", tmp_path / "sweep")
    stage = out / f"{outdir.STAGE_PREFIX}20000101T000000Z"
    stage.mkdir()
    shutil.copy(out / "report.json", stage / "report.json")
    assert _report_files([tmp_path / "sweep"]) == [out / "report.json"]
