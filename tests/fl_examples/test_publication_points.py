"""Nothing derived from a release leaves the process before the release's charge is durable.

The trainers defer their ledger charges (:func:`fl_examples.core.run.drive` runs the steps
inside ``Ledger.deferred()``) and sync at every publication point. These tests intercept every
way a run publishes (a checkpoint, a progress-bar line showing an evaluation, the report, a
figure, a printed line, an error) and, at that moment, read the ledger from disk as a fresh
process would after a crash: it must hold every charge the run has made so far. That is every
crash point at once, exactly; a planted missing sync is caught, so the check can fail. A
SIGKILL test does the same through the command line: the run is killed at random moments under
a terminal (the bar shown), and every number it printed or wrote is matched to the reference
run's iteration and found charged in the reopened ledger; the resumed run ends as the
reference, each round charged once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _sigkill import ROOT

import fl_examples.core.checkpoint as checkpoint_mod
import fl_examples.core.run as run_mod
from fl_examples.core.data import parse_dataset_spec
from fl_examples.core.run import TrainerRun, TrainingDivergedError, max_loss_factor
from privkit.ledger import Ledger


# ------------------------------------------------------------------- the harness
class _Bar:
    """A progress bar that is shown (``disable`` False): every postfix is a console line."""

    disable = False

    def __init__(self, on_line: Any) -> None:
        self.n, self.on_line = 0, on_line

    def update(self, n: int) -> None:
        self.n += n

    def set_postfix(self, **kw: Any) -> None:
        self.on_line(f"{self.n} {kw}")

    def close(self) -> None:
        pass


class Publications:
    """Tracks every file-backed ledger the run opens and checks, at each publication, that
    a fresh reader of its journal sees every charge the run has made (staged ones included)."""

    def __init__(self) -> None:
        self.ledgers: list[Ledger] = []
        self.seen: list[tuple[str, str]] = []
        self.violations: list[str] = []

    def check(self, what: str, detail: str = "") -> None:
        self.seen.append((what, detail))
        for led in self.ledgers:
            made = led._journal.next_seq - 1  # every charge made, durable or deferred
            on_disk = Ledger.open(led.path).head().seq if Path(led.path).exists() else -1
            if on_disk != made:
                self.violations.append(f"{what} {detail}: {Path(led.path).name} holds seq "
                                       f"{on_disk} on disk, the run has charged up to {made}")


@contextlib.contextmanager
def publications(mp: pytest.MonkeyPatch) -> Iterator[Publications]:
    pubs = Publications()
    real_create, real_open = Ledger.create.__func__, Ledger.open.__func__  # type: ignore[attr-defined]

    def create(cls: Any, path: Any, **kw: Any) -> Ledger:
        led = real_create(cls, path, **kw)
        if led.path is not None:
            pubs.ledgers.append(led)
        return led

    def open_(cls: Any, path: Any, **kw: Any) -> Ledger:
        led = real_open(cls, path, **kw)
        if not getattr(pubs, "_reading", False):
            pubs.ledgers.append(led)
        return led

    def check(what: str, detail: str = "") -> None:
        pubs._reading = True  # type: ignore[attr-defined]
        try:
            pubs.check(what, detail)
        finally:
            pubs._reading = False  # type: ignore[attr-defined]

    real_save = checkpoint_mod.save

    def save(directory: Any, round_: int, tensors: Any, state: Any) -> Any:
        check("checkpoint", f"{Path(directory).name} {round_}")
        return real_save(directory, round_, tensors, state)

    import fl_examples.core.report as report_mod
    real_write = report_mod.atomic_write_bytes

    def write(path: Any, data: bytes) -> None:
        check("file", Path(path).name)
        real_write(path, data)

    import matplotlib.figure

    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(self: Any, *a: Any, **kw: Any) -> Any:
        check("figure")
        return real_savefig(self, *a, **kw)

    mp.setattr(Ledger, "create", classmethod(create))
    mp.setattr(Ledger, "open", classmethod(open_))
    mp.setattr(checkpoint_mod, "save", save)
    mp.setattr(report_mod, "atomic_write_bytes", write)
    mp.setattr(matplotlib.figure.Figure, "savefig", savefig)
    mp.setattr(run_mod, "progress", lambda total, desc: _Bar(lambda s: check("console", s)))
    yield pubs


def _upcycled(privacy: str, **kw: Any) -> Any:
    from fl_examples.upcycled import UpcycledConfig

    base = dict(dataset="synthetic:iid@40/20", iterations=14, local_epochs=1, stragglers=0.0,
                device="cpu", eval_every=2, checkpoint_every=5, fraction=0.3, seed=1)
    extra = {"client": dict(privacy="client", client_rate=0.3, l2_clip_norm=1.0,
                            noise_multiplier=1.0),
             "record": dict(privacy="record", l2_clip_norm=1.0, noise_multiplier=1.0),
             "output": dict(privacy="output", stddev=5.0),
             "objective": dict(privacy="objective", alpha=20.0, allow_unproven=True)}[privacy]
    return UpcycledConfig(**(base | extra | kw))


# ----------------------------------------------------------------- the trainers
@pytest.mark.parametrize("privacy, secure", [("client", False), ("client", True),
                                             ("record", False), ("output", False),
                                             ("objective", False)])
def test_upcycled_publishes_nothing_before_its_charges_are_durable(tmp_path, monkeypatch,
                                                                   privacy, secure):
    from fl_examples.upcycled import train

    cfg = _upcycled(privacy, secure_noise=secure)
    other = "fedprox" if privacy == "objective" else "fedavg"  # objective needs mu > 0
    with publications(monkeypatch) as pubs:
        train(cfg, compare=(other,), out=tmp_path, algorithm="upcycled")
    kinds = {w for w, _ in pubs.seen}
    assert {"checkpoint", "console", "file", "figure"} <= kinds, kinds
    assert pubs.violations == []
    assert len(pubs.ledgers) >= 2  # both algorithms', checked at every publication


def test_the_deferred_charges_are_made_in_groups_not_one_write_each(tmp_path, monkeypatch):
    """The point of deferring: between publication points the ledger is not written (seven
    data rounds of FedAvg, checkpoints every 5, no evaluation shown: three writes)."""
    from fl_examples.upcycled import run_algorithm

    writes: list[int] = []
    real = Ledger._flush_locked

    def flush(self: Ledger) -> None:
        if self._journal.staged_entries:
            writes.append(self._journal.staged_entries)
        real(self)

    monkeypatch.setattr(Ledger, "_flush_locked", flush)
    cfg = _upcycled("client", iterations=7, eval_every=7)
    ds = parse_dataset_spec(cfg.dataset, seed=cfg.seed)
    run_algorithm("fedavg", cfg, ds, iterations=7, out=tmp_path)
    assert writes == [5, 2]  # the checkpoint at 5, the end of the loop at 7
    led = Ledger.open(tmp_path / "ledger-fedavg.jsonl")
    assert [e["round"] for e in led.entries_since(led.origin())] == list(range(1, 8))


def test_a_planted_missing_sync_is_caught(tmp_path, monkeypatch):
    """With the publication before a shown evaluation taken out, the check sees the line go
    out while its charges are still in memory."""
    from fl_examples.upcycled import run_algorithm

    monkeypatch.setattr(TrainerRun, "publish", lambda self: None)
    cfg = _upcycled("client")
    ds = parse_dataset_spec(cfg.dataset, seed=cfg.seed)
    with publications(monkeypatch) as pubs:
        run_algorithm("fedavg", cfg, ds, iterations=cfg.iterations, out=tmp_path)
    assert any(v.startswith("console") for v in pubs.violations), pubs.violations


def test_an_error_message_is_a_publication_too(tmp_path, monkeypatch):
    """A diverging run's error names its loss: the charges of every round it trained are
    durable when the exception leaves the loop."""
    from fl_examples.upcycled import run_algorithm

    cfg = _upcycled("client", noise_multiplier=50.0, eval_every=3, checkpoint_every=0)
    ds = parse_dataset_spec(cfg.dataset, seed=cfg.seed)
    with pytest.raises(TrainingDivergedError) as exc, max_loss_factor(1.0):
        run_algorithm("fedavg", cfg, ds, iterations=cfg.iterations, out=tmp_path)
    at = int(re.search(r"iteration (\d+)", str(exc.value)).group(1))
    led = Ledger.open(tmp_path / "ledger-fedavg.jsonl")
    assert {e["round"] for e in led.entries_since(led.origin())} == set(range(1, at + 1))


def test_dprec_mapa_and_scfl_publish_nothing_before_their_charges(tmp_path, monkeypatch):
    from fl_examples.dprec import DPRecConfig
    from fl_examples.dprec import train as dprec_train
    from fl_examples.mapa import MapaConfig
    from fl_examples.mapa import train as mapa_train
    from fl_examples.scfl import ScflConfig
    from fl_examples.scfl import train as scfl_train

    runs = [
        (dprec_train, DPRecConfig(clients=10, clients_per_round=6, rounds=6, bits=4,
                                  eval_every=2, lr=0.2, device="cpu", dpfedavg_noise=2.0,
                                  checkpoint_every=4), {"compare": ("dpfedavg",)}),
        (mapa_train, MapaConfig(dataset="digits", edges=8, batch=16, updates=60, eval_every=20,
                                seed=3, checkpoint_every=15, epsilon=(1.0, 2.0) * 4,
                                delta=1e-3), {}),
        (scfl_train, ScflConfig(dataset="digits:3", clients=8, num_coded_rows=60, rounds=12,
                                eval_every=4, batch_sampling="bernoulli", gradient_clip=0.5,
                                gradient_noise_multiplier=1.2, checkpoint_every=5), {}),
    ]
    for i, (train, cfg, kw) in enumerate(runs):
        with monkeypatch.context() as m, publications(m) as pubs:
            train(cfg, out=tmp_path / str(i), **kw)
        assert pubs.ledgers and {"checkpoint", "console", "file"} <= {w for w, _ in pubs.seen}
        assert pubs.violations == [], (type(cfg).__name__, pubs.violations)


# ----------------------------------------------------------------------- SIGKILL
ROUNDS = 240
ARGV = ["train", "upcycled", "--dataset", "synthetic:iid@100/50", "--algorithms", "fedavg",
        "--privacy", "client", "--client-rate", "0.3", "--clip", "1", "--noise-multiplier", "1",
        "--rounds", str(ROUNDS), "--epochs", "1", "--stragglers", "0", "--eval-every", "2",
        "--checkpoint-every", "7", "--seed", "4", "--threads", "1", "--device", "cpu"]
_ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    return env | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                  "OMP_NUM_THREADS": "1", "SOURCE_DATE_EPOCH": "1700000000",
                  "MPLBACKEND": "Agg", "COLUMNS": "200"}


def _run_in_terminal(argv: list[str], out: Path, kill_after: float | None
                     ) -> tuple[str, bool, float]:
    """``privkit <argv> --out OUT`` with its stderr on a terminal (the bar shown); SIGKILLed
    ``kill_after`` seconds after its ledger appears (None: run to the end). Returns what it
    printed, whether it ended by itself and the seconds from its ledger to its end."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # a width
    proc = subprocess.Popen([sys.executable, "-m", "privkit.cli", *argv, "--out", str(out)],
                            env=_env(), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []
    started = None
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.005)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:
                    data = b""
                if data:
                    chunks.append(data)
                elif proc.poll() is not None:
                    break
            elif proc.poll() is not None:
                break
            if started is None and (out / "ledger-fedavg.jsonl").exists():
                started = time.monotonic()
            if kill_after is not None and started is not None \
                    and time.monotonic() - started >= kill_after:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                break
        ended = proc.poll() == 0 and kill_after is None
        took = time.monotonic() - (started or time.monotonic())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    text = _ANSI.sub(b"", b"".join(chunks)).decode("utf-8", "replace")
    assert "Traceback" not in text, text[-3000:]
    return text, ended, took


def _charged_rounds(out: Path) -> list[int]:
    led = Ledger.open(out / "ledger-fedavg.jsonl")  # verifies the chains (recovery)
    return [e["round"] for e in led.entries_since(led.origin()) if e["kind"] == "spend"]


def _covered(rounds: list[int], upto: int) -> bool:
    return set(range(1, upto + 1)) <= set(rounds)


def test_sigkill_never_leaves_a_published_number_without_its_charge(tmp_path):
    """Kill ``privkit train`` four times at random moments (the bar on a terminal: an
    evaluation line every 2 rounds, a checkpoint every 7, charges deferred in between), resume
    after each, and finish. After every kill: every loss the terminal showed is the reference
    run's at some iteration, and every round up to it is charged in the reopened ledger;
    every checkpoint on disk is covered the same way. At the end the report, the history and
    the ledger's bytes are the reference's (each round charged once)."""
    ref = tmp_path / "ref"
    ref_text, _, took = _run_in_terminal(ARGV, ref, None)
    assert "loss=" in ref_text  # the terminal shows the evaluations
    report = json.loads((ref / "report.json").read_text())
    history = report["algorithms"]["fedavg"]["history"]
    losses: dict[str, list[int]] = {}
    for row in history:
        losses.setdefault(f"{row['heldout_loss']:.4g}", []).append(row["iteration"])
    out = tmp_path / "run"
    rng = np.random.default_rng(7)
    shown_total = 0
    for attempt in range(4):
        text, ended, _ = _run_in_terminal(ARGV + (["--resume"] if attempt else []), out,
                                          float(rng.uniform(0.05, 0.6) * took))
        if ended:
            break
        rounds = _charged_rounds(out)
        for value in re.findall(r"loss=([-+0-9.eE]+)", text):
            at = losses.get(value)
            assert at, f"printed loss {value} is none of the reference's"
            shown_total += 1
            assert _covered(rounds, min(at)), (value, at, sorted(set(rounds)))
        ck = out / "checkpoints" / "fedavg"
        for d in sorted(ck.glob("ckpt-*")) if ck.exists() else []:
            if (d / "state.json").exists():
                state = json.loads((d / "state.json").read_text())
                assert _covered(rounds, state["round"]), (d.name, sorted(set(rounds)))
    _run_in_terminal(ARGV + ["--resume"], out, None)
    assert shown_total > 0  # the terminal did show evaluations before the kills
    got = json.loads((out / "report.json").read_text())
    strip = ("wall_time_s", "client_compute_s")
    rows = [{k: v for k, v in r.items() if k not in strip}
            for r in got["algorithms"]["fedavg"]["history"]]
    assert rows == [{k: v for k, v in r.items() if k not in strip} for r in history]
    assert sorted(_charged_rounds(out)) == list(range(1, ROUNDS + 1))  # once each
    assert (out / "ledger-fedavg.jsonl").read_bytes() == (ref / "ledger-fedavg.jsonl").read_bytes()
