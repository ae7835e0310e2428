"""The trainers the crash and budget harnesses exercise: one table entry per trainer setting.

Adding a trainer means adding a :class:`TrainerCase` to :data:`CASES` (crash safety, run as
``privkit train ...`` subprocesses) and a :class:`BudgetCase` to :func:`budget_cases`
(budget enforcement, run in-process with spies on the noise samplers). Nothing else in the
harnesses knows about a particular trainer.

Trainers covered: Upcycled-FL / FedProx (``upcycled``), MAPA / AUDP (``mapa``), SCFL /
FL-PMA (``scfl``: no epsilon ledger, its privacy is the MI-DP of a one-time coded upload,
so it has a crash case and no budget case) and DP-REC / DP-FedAvg (``dprec``).
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
    """A deterministic private ``privkit train`` run with frequent checkpoints.

    Attributes:
        name: test id.
        argv: arguments after ``privkit``, without ``--out`` and ``--resume``.
        ledgers: ledger files the run writes, relative to its output directory, in the order
            the run's algorithms write them (may be empty: a run without an epsilon ledger).
        checkpoints: checkpoint directories (each with ``LATEST``), relative to it, in the
            same order (``checkpoints[i]`` belongs to ``ledgers[i]`` where both exist).
        files: further files the run writes that must be reproduced bitwise.
        wall_clock_keys: report / state fields that are wall-clock times.
        ci: always in the CI subset.
        ci_draw: a candidate for the CI subset's one drawn case (a fixed-seed draw picks one
            of these; all run under ``PRIVKIT_SOAK=1``).
    """

    name: str
    argv: tuple[str, ...]
    ledgers: tuple[str, ...]
    checkpoints: tuple[str, ...]
    files: tuple[str, ...] = ()
    wall_clock_keys: frozenset[str] = WALL_CLOCK_KEYS
    ci: bool = False
    ci_draw: bool = False


_UPCYCLED = ("train", "upcycled", "--dataset", "digits:3", "--epochs", "1", "--fraction", "0.5",
             "--stragglers", "0.3", "--mu", "0.1", "--lam", "0.04", "--seed", "2",
             "--device", "cpu", "--checkpoint-every", "1", "--eval-every", "1")

CASES: list[TrainerCase] = [
    TrainerCase("upcycled-output", _UPCYCLED + ("--rounds", "24", "--privacy", "output",
                                                "--sigma", "5"),
                ("ledger-upcycled.jsonl",), ("checkpoints/upcycled",), ci=True),
    TrainerCase("upcycled-objective", _UPCYCLED + ("--rounds", "24", "--privacy",
                                                   "objective", "--alpha", "50",
                                                   "--allow-unproven"),
                ("ledger-upcycled.jsonl",), ("checkpoints/upcycled",)),
    TrainerCase("fedprox-output-budget", _UPCYCLED + (
        "--algorithms", "fedprox", "--rounds", "24", "--privacy", "output", "--sigma", "50",
        "--epsilon-budget", "4"), ("ledger-fedprox.jsonl",), ("checkpoints/fedprox",)),
    TrainerCase("mapa-audp", (
        "train", "mapa", "--algorithms", "mapa,audp", "--dataset", "digits", "--clients", "8",
        "--batch", "16", "--rounds", "150", "--eval-every", "25", "--upload-epsilon", "2",
        "--tau-max", "6", "--checkpoint-every", "15", "--seed", "3"),
        ("ledger-mapa.jsonl", "ledger-audp.jsonl"), ("checkpoints/mapa", "checkpoints/audp"),
        ci_draw=True),
    TrainerCase("scfl-flpma", (
        "train", "scfl", "--algorithms", "scfl,fl-pma", "--dataset", "digits", "--clients",
        "10", "--coded-rows", "200", "--rounds", "60", "--eval-every", "1", "--seed", "4",
        "--checkpoint-every", "1"), (), ("checkpoints/scfl", "checkpoints/fl-pma"),
        files=("midp-scfl.json",), ci_draw=True),
    TrainerCase("dprec-dpfedavg", (
        "train", "dprec", "--dataset", "digits", "--clients", "10", "--clients-per-round", "6",
        "--rounds", "12", "--bits", "4", "--eval-every", "1", "--lr", "0.2",
        "--noise-multiplier", "2.0", "--device", "cpu", "--checkpoint-every", "1"),
        ("ledger-dprec.jsonl", "ledger-dpfedavg.jsonl"),
        ("checkpoints/dprec", "checkpoints/dpfedavg"), ci_draw=True),
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
    for name in case.ledgers + case.files:
        res[name] = (out / name).read_bytes()
    for c in case.checkpoints:
        latest = (out / c / "LATEST").read_text().strip()
        res[f"{c}/LATEST"] = latest
        res[f"{c}/tensors"] = (out / c / latest / "tensors.safetensors").read_bytes()
        res[f"{c}/state"] = _drop(json.loads((out / c / latest / "state.json").read_text()),
                                  case.wall_clock_keys)
    return res


# ------------------------------------------------------------------ budget enforcement
#: One charge as the spy on ``Ledger.spend_many`` records it: (ledger ``round``, client ids, count).
Charge = tuple[Any, tuple[str, ...], int]


@dataclass(frozen=True)
class BudgetCase:
    """An in-process private run whose budget allows exactly ``k`` charged rounds.

    A "round" is what the trainer's budget counts: a data round (Upcycled-FL, DP-REC), or an
    edge's upload (MAPA, whose edges upload asynchronously and are each charged per upload).

    Attributes:
        name: test id.
        budget: ``budget(k)``: the budget that allows exactly k rounds and not k + 1 (the
            function checks the "not k + 1" part itself).
        run: ``run(budget, out) -> result`` runs the trainer with that budget.
        spies: (module path, attribute) of every noise sampler the trainer may call; each is
            wrapped to count calls.
        stopped: ``stopped(result) -> str`` the trainer's stop message ("" if none).
        rounds_done: ``rounds_done(result) -> int`` charged rounds the result reports.
        rounds_charged: ``rounds_charged(charges)``: the rounds the spend log shows (must be k).
        draws_expected: ``draws_expected(charges, result)``: noise draws those charges pay for.
        spent: ``spent(result)``: the quantity the budget bounds (largest client epsilon, or
            the central epsilon).
        reason: ``reason(budget, k)``: phrases the stop message must contain.
    """

    name: str
    budget: Callable[[int], float]
    run: Callable[[float, Path], dict[str, Any]]
    spies: tuple[tuple[str, str], ...]
    stopped: Callable[[dict[str, Any]], str]
    rounds_done: Callable[[dict[str, Any]], int]
    rounds_charged: Callable[[list[Charge]], int]
    draws_expected: Callable[[list[Charge], dict[str, Any]], int]
    spent: Callable[[dict[str, Any]], float]
    reason: Callable[[float, int], tuple[str, ...]]
    k: int = 3
    extra: dict[str, Any] = field(default_factory=dict)


_SAMPLERS = (("privkit.mechanisms.sampling", "gaussian_noise"),
             ("privkit.mechanisms.sampling", "laplace_noise"),
             ("privkit.mechanisms.sampling", "l2_laplace_noise"),
             ("privkit.mechanisms.gaussian", "gaussian_noise"),
             ("privkit.mechanisms.objective", "l2_laplace_noise"),
             ("privkit.mechanisms.laplace", "l2_laplace_noise"),
             ("privkit.mechanisms.laplace", "laplace_noise"))


def _uses(charges: list[Charge]) -> int:
    """Client uses the charges pay for (a batch of c clients charged n uses each: c n)."""
    return sum(len(ids) * n for _, ids, n in charges)


def _max_round(charges: list[Charge]) -> int:
    return max((r for r, _, _ in charges), default=0)


def _per_client_budget(events: list[Any], k: int, delta: float = 1e-3,
                       method: str = "auto", relation: Any = "ADD_OR_REMOVE_ONE") -> float:
    """The largest client's epsilon after k uses of its event (so every client affords k),
    priced under ``relation`` (the one the run's ledger prices under)."""
    import privkit
    from privkit.events import SelfComposedDpEvent

    def eps(ev: Any, n: int) -> float:
        return privkit.epsilon(SelfComposedDpEvent(ev, n), delta, method,
                               neighboring_relation=relation).epsilon

    eps_k = [eps(ev, k) for ev in events]
    budget = max(eps_k) * (1 + 1e-12)
    worst = events[eps_k.index(max(eps_k))]
    assert eps(worst, k + 1) > budget  # the worst client cannot afford k + 1
    return budget


def _upcycled_budget_case(privacy: str, algorithm: str) -> BudgetCase:
    from fl_examples.core.privacy import PrivacyPlan

    base = dict(dataset="digits:3", local_epochs=1, batch_size=32, lr=0.05, device="cpu",
                fraction=1.0, stragglers=0.0, seed=2, mu=0.1, lam=0.04, checkpoint_every=1,
                iterations=20)
    extra = (dict(privacy="output", stddev=8.0) if privacy == "output" else
             dict(privacy="objective", alpha=50.0, allow_unproven=True))

    def budget(k: int) -> float:
        # Output perturbation (replace-one) charges every client the same event; objective
        # perturbation's epsilon depends on |D_i|. Every client takes part in every round.
        from fl_examples.core.data import parse_dataset_spec

        ds = parse_dataset_spec("digits:3", seed=2)
        sizes = tuple(int(n) for n in ds.train_sizes)
        if privacy == "output":
            p = PrivacyPlan(kind="output", sizes=sizes, stddev=8.0)
        else:
            p = PrivacyPlan(kind="objective", sizes=sizes, alpha=50.0, proximal_mu=0.1,
                            allow_unproven=True)
        return _per_client_budget([p.mechanism(i).event() for i in range(len(sizes))], k,
                                  relation=p.neighboring_relation)

    def run_it(budget: float, out: Path) -> dict[str, Any]:
        from fl_examples.core.data import parse_dataset_spec
        from fl_examples.upcycled import UpcycledConfig, run_algorithm

        cfg = UpcycledConfig(**base, **extra, epsilon_budget=budget)
        ds = parse_dataset_spec("digits:3", seed=2)
        return run_algorithm(algorithm, cfg, ds, iterations=cfg.iterations, out=out)

    return BudgetCase(
        f"{algorithm}-{privacy}", budget, run_it, _SAMPLERS,
        stopped=lambda res: res["privacy"].get("stopped", ""),
        rounds_done=lambda res: max(res["privacy"]["charged_rounds"]),
        rounds_charged=_max_round,
        draws_expected=lambda charges, res: _uses(charges),  # one draw per client and round
        spent=lambda res: max(res["privacy"]["per_client"]),
        reason=lambda b, k: ("would exceed the budget", f"budget {b}",
                             f"in data round {k + 1}"))


def _mapa_budget_case(algorithm: str) -> BudgetCase:
    """MAPA / AUDP: every edge is charged its pure-DP event per upload (one epsilon for all
    edges here), composed optimally; the budget allows k uploads per edge, and the run stops
    before the first edge's upload k + 1. Dropped (too stale) uploads are charged but draw no
    noise (they are never computed)."""
    base = dict(dataset="digits", edges=4, batch=16, updates=60, eval_every=10, epsilon=2.0,
                delta=1e-3, tau_max=6, seed=3, checkpoint_every=5)

    def budget(k: int) -> float:
        from fl_examples import mapa
        from fl_examples.core.models import num_parameters
        from fl_examples.mapa.privacy import _upload_event

        cfg = mapa.MapaConfig(**base)
        ds = mapa.load_edges(cfg.dataset, edges=cfg.edges, seed=cfg.seed)
        ev = _upload_event(cfg, 2.0, num_parameters(mapa.make_model(cfg.model, ds)))
        return _per_client_budget([ev], k, cfg.delta, "optimal")

    def run_it(budget: float, out: Path) -> dict[str, Any]:
        from fl_examples import mapa

        cfg = mapa.MapaConfig(**base, epsilon_budget=budget)
        return mapa.run_algorithm(algorithm, cfg, out=out)

    def per_edge_max(charges: list[Charge]) -> int:
        counts: dict[str, int] = {}
        for _, ids, n in charges:
            for c in ids:
                counts[c] = counts.get(c, 0) + n
        return max(counts.values(), default=0)

    return BudgetCase(
        f"{algorithm}-uploads", budget, run_it,
        _SAMPLERS + (("fl_examples.mapa.uploads", "l2_laplace_noise"),
                     ("fl_examples.mapa.uploads", "laplace_noise")),
        stopped=lambda res: res["privacy"].get("stopped", ""),
        rounds_done=lambda res: res["privacy"]["uploads_max"],
        rounds_charged=per_edge_max,
        draws_expected=lambda charges, res: _uses(charges) - res["dropped_uploads"],
        spent=lambda res: res["privacy"]["epsilon_max"],
        reason=lambda b, k: ("would exceed the budget", f"budget {b:g}",
                             f"stopped before upload {k + 1} of edge"))


def _dprec_budget_case(algorithm: str) -> BudgetCase:
    """DP-REC / DP-FedAvg: the budget bounds the central epsilon after each round (DP-REC:
    T |S'| REC messages amplified by sampling with replacement; DP-FedAvg: Gaussian sums on
    samples without replacement). A budget between the central epsilons after k and k + 1
    rounds stops it before round k + 1. DP-REC draws through ``rec.encode`` (one message per
    draw of a client), DP-FedAvg adds one Gaussian noise to each round's sum."""
    base = dict(dataset="digits", clients=10, clients_per_round=6, rounds=8, bits=4,
                groups="whole", eval_every=1, lr=0.2, device="cpu", checkpoint_every=1)
    z = 2.0

    def budget(k: int) -> float:
        from fl_examples import dprec

        cfg = dprec.DPRecConfig(**base)
        n = dprec.load_dataset(cfg).num_clients
        if algorithm == "dprec":  # groups="whole": one REC group
            lo, hi = (dprec.dprec_central_epsilon(cfg, n, r) for r in (k, k + 1))
        else:
            lo, hi = (dprec.dpfedavg_central_epsilon(z, cfg, n, r) for r in (k, k + 1))
        assert lo < hi
        return lo * (1 + 1e-12)

    def run_it(budget: float, out: Path) -> dict[str, Any]:
        from fl_examples import dprec

        cfg = dprec.DPRecConfig(**base, epsilon_budget=budget)
        return dprec.run_algorithm(algorithm, cfg, dprec.load_dataset(cfg),
                                   z=z if algorithm == "dpfedavg" else None, out=out)

    def draws(charges: list[Charge], res: dict[str, Any]) -> int:
        # DP-REC: one encoded message per draw of a client (a client drawn c times is
        # charged c uses at once); DP-FedAvg: one noise vector per round's sum
        return _uses(charges) if algorithm == "dprec" else len({r for r, _, _ in charges})

    return BudgetCase(
        f"{algorithm}-central", budget, run_it,
        # DP-FedAvg's noise: ClientLevelGaussian's draw, through the name aggregate imported
        _SAMPLERS + (("privkit.mechanisms.rec", "encode"),
                     ("privkit.mechanisms.aggregate", "gaussian_noise")),
        stopped=lambda res: res["privacy"].get("stopped", ""),
        rounds_done=lambda res: res["privacy"]["rounds_run"],
        rounds_charged=_max_round, draws_expected=draws,
        spent=lambda res: res["privacy"]["epsilon_central"],
        reason=lambda b, k: (f"stopped before round {k + 1}", f"> budget {b:g}"))


def budget_cases() -> list[BudgetCase]:
    return [_upcycled_budget_case("output", "upcycled"),
            _upcycled_budget_case("objective", "upcycled"),
            _upcycled_budget_case("output", "fedprox"),
            _mapa_budget_case("mapa"), _mapa_budget_case("audp"),
            _dprec_budget_case("dprec"), _dprec_budget_case("dpfedavg")]
