"""Kill a ``privkit train ...`` subprocess mid-run (shared by the trainers' resume tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from privkit.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    """A deterministic child environment: one thread, fixed ledger header time, no bars."""
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", SOURCE_DATE_EPOCH="1700000000",
                TQDM_DISABLE="1", MPLBACKEND="Agg")


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def kill_when(argv: list[str], out: Path, resume: bool, ledger: str, lines: int,
              timeout: float = 120) -> tuple[str, Ledger]:
    """Start ``privkit <argv> --out OUT``, SIGKILL it once ``ledger`` has ``lines`` lines.

    Returns where the kill landed (before the first checkpoint, between a charge and its
    checkpoint, or at a checkpoint) and the reopened ledger (every hash chain verifies).
    """
    cmd = [sys.executable, "-m", "privkit.cli", *argv, "--out", str(out)]
    proc = subprocess.Popen(cmd + (["--resume"] if resume else []), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    end = time.monotonic() + timeout
    try:
        while _lines(out / ledger) < lines and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.001)
        assert proc.poll() is None, "the run ended before the kill"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert b"Traceback" not in proc.stderr.read()
    led = Ledger.open(out / ledger)
    alg = ledger.split("-")[1].split(".")[0]
    ck = out / "checkpoints" / alg
    if not (ck / "LATEST").exists():
        return "before the first checkpoint", led
    state = json.loads((ck / (ck / "LATEST").read_text() / "state.json").read_text())
    return ("between a charge and its checkpoint" if state["ledger_pointer"]["seq"]
            < led.head().seq else "at a checkpoint"), led
