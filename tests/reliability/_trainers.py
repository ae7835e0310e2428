"""The trainers the crash and budget harnesses exercise: one table entry per trainer setting.

Adding a trainer means adding a :class:`TrainerCase` to :data:`CASES` (crash safety, run as
``privkit train ...`` subprocesses) and a :class:`BudgetCase` to :data:`BUDGET_CASES`
(budget enforcement, run in-process with spies on the noise samplers). Nothing else in the
harnesses knows about a particular trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import privkit

ROOT = Path(privkit.__file__).resolve().parents[1]

#: Report and checkpoint-state fields that hold wall-clock times (excluded from the bitwise
#: comparison; everything else in report.json and state.json must match exactly).
WALL_CLOCK_KEYS = frozenset({"wall_time_s", "client_compute_s"})


@dataclass(frozen=True)
class TrainerCase:
    """A deterministic private ``privkit train`` run with a checkpoint every iteration.

    Attributes:
        name: test id.
        argv: arguments after ``privkit``, without ``--out`` and ``--resume``.
        ledgers: ledger files the run writes, relative to its output directory.
        checkpoints: checkpoint directories (each with ``LATEST``), relative to it.
        wall_clock_keys: report / state fields that are wall-clock times.
        ci: run in the CI subset (the others run under ``PRIVKIT_SOAK=1`` only).
    """

    name: str
    argv: tuple[str, ...]
    ledgers: tuple[str, ...]
    checkpoints: tuple[str, ...]
    wall_clock_keys: frozenset[str] = WALL_CLOCK_KEYS
    ci: bool = False


_UPCYCLED = ("train", "upcycled", "--dataset", "digits:3", "--epochs", "1", "--fraction", "0.5",
             "--stragglers", "0.3", "--mu", "0.1", "--lam", "0.04", "--seed", "2",
             "--device", "cpu", "--checkpoint-every", "1", "--eval-every", "1")

CASES: list[TrainerCase] = [
    TrainerCase("upcycled-output", _UPCYCLED + ("--iterations", "24", "--privacy", "output",
                                                "--sigma", "5"),
                ("ledger-upcycled.jsonl",), ("checkpoints/upcycled",), ci=True),
    TrainerCase("upcycled-objective", _UPCYCLED + ("--iterations", "24", "--privacy",
                                                   "objective", "--alpha", "50",
                                                   "--allow-unproven"),
                ("ledger-upcycled.jsonl",), ("checkpoints/upcycled",)),
    TrainerCase("fedprox-output-budget", _UPCYCLED + (
        "--algorithm", "fedprox", "--iterations", "24", "--privacy", "output", "--sigma", "50",
        "--epsilon-budget", "4"), ("ledger-fedprox.jsonl",), ("checkpoints/fedprox",)),
]


def env() -> dict[str, str]:
    """Subprocess environment: this checkout importable, one thread, fixed ledger time."""
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", SOURCE_DATE_EPOCH="1700000000",
                TQDM_DISABLE="1", MPLBACKEND="Agg")


def command(case: TrainerCase, out: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "privkit.cli", *case.argv, "--out", str(out),
            *(["--resume"] if resume else [])]


def run(case: TrainerCase, out: Path, resume: bool = False,
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(case, out, resume), env=env(), capture_output=True, text=True,
                          timeout=timeout)


def _drop(obj: Any, keys: frozenset[str]) -> Any:
    if isinstance(obj, dict):
        return {k: _drop(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [_drop(v, keys) for v in obj]
    return obj


def outcome(case: TrainerCase, out: Path) -> dict[str, Any]:
    """Everything a finished run leaves that must be reproduced bitwise (wall clock dropped)."""
    res: dict[str, Any] = {
        "report": _drop(json.loads((out / "report.json").read_text()), case.wall_clock_keys)}
    for name in case.ledgers:
        res[name] = (out / name).read_bytes()
    for c in case.checkpoints:
        latest = (out / c / "LATEST").read_text().strip()
        res[f"{c}/LATEST"] = latest
        res[f"{c}/tensors"] = (out / c / latest / "tensors.safetensors").read_bytes()
        res[f"{c}/state"] = _drop(json.loads((out / c / latest / "state.json").read_text()),
                                  case.wall_clock_keys)
    return res


# ------------------------------------------------------------------ budget enforcement
@dataclass(frozen=True)
class BudgetCase:
    """An in-process private run whose budget allows exactly ``k`` charged rounds.

    Attributes:
        name: test id.
        run: ``run(budget, out) -> result`` runs the trainer with that per-client budget
            (every client takes part in every charged round) and returns its result dict.
        client_events: ``client_events()``: each client's event of one charged round.
        spies: (module path, attribute) of every noise sampler the trainer may call; each is
            wrapped to count calls.
        stopped: ``stopped(result) -> str`` the trainer's stop message ("" if none).
        rounds_done: ``rounds_done(result) -> int`` charged rounds completed.
    """

    name: str
    run: Callable[[float, Path], dict[str, Any]]
    client_events: Callable[[], list[Any]]
    spies: tuple[tuple[str, str], ...]
    stopped: Callable[[dict[str, Any]], str]
    rounds_done: Callable[[dict[str, Any]], int]
    k: int = 3
    extra: dict[str, Any] = field(default_factory=dict)


_SAMPLERS = (("privkit.mechanisms.sampling", "gaussian_noise"),
             ("privkit.mechanisms.sampling", "laplace_noise"),
             ("privkit.mechanisms.sampling", "l2_laplace_noise"),
             ("privkit.mechanisms.gaussian", "gaussian_noise"),
             ("privkit.mechanisms.objective", "l2_laplace_noise"),
             ("privkit.mechanisms.laplace", "l2_laplace_noise"),
             ("privkit.mechanisms.laplace", "laplace_noise"))


def _upcycled_budget_case(privacy: str, algorithm: str) -> BudgetCase:
    from fl_examples.core.privacy import PrivacyPlan

    base = dict(dataset="digits:3", local_epochs=1, batch_size=32, lr=0.05, device="cpu",
                fraction=1.0, stragglers=0.0, seed=2, mu=0.1, lam=0.04, checkpoint_every=1,
                iterations=20)
    extra = (dict(privacy="output", stddev=8.0) if privacy == "output" else
             dict(privacy="objective", alpha=50.0, allow_unproven=True))

    def client_events() -> list[Any]:
        # Output perturbation (replace-one) charges every client the same event; objective
        # perturbation's epsilon depends on |D_i|.
        from fl_examples.core.data import parse_dataset_spec

        ds = parse_dataset_spec("digits:3", seed=2)
        sizes = tuple(int(n) for n in ds.train_sizes)
        if privacy == "output":
            p = PrivacyPlan(kind="output", sizes=sizes, stddev=8.0)
        else:
            p = PrivacyPlan(kind="objective", sizes=sizes, alpha=50.0, proximal_mu=0.1,
                            allow_unproven=True)
        return [p.mechanism(i).event() for i in range(len(sizes))]

    def run_it(budget: float, out: Path) -> dict[str, Any]:
        from fl_examples.core.data import parse_dataset_spec
        from fl_examples.upcycled import UpcycledConfig, run_algorithm

        cfg = UpcycledConfig(**base, **extra, epsilon_budget=budget)
        ds = parse_dataset_spec("digits:3", seed=2)
        return run_algorithm(algorithm, cfg, ds, iterations=cfg.iterations, out=out)

    def rounds_done(res: dict[str, Any]) -> int:
        return max(res["privacy"]["charged_rounds"])

    return BudgetCase(f"{algorithm}-{privacy}", run_it, client_events, _SAMPLERS,
                      lambda res: res["privacy"].get("stopped", ""), rounds_done)


def budget_cases() -> list[BudgetCase]:
    return [_upcycled_budget_case("output", "upcycled"),
            _upcycled_budget_case("objective", "upcycled"),
            _upcycled_budget_case("output", "fedprox")]
