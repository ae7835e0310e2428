"""The trainer skeleton (fl_examples.core.run) on a toy run: the loop, checkpoints, resume,
ledgers and charge adoption; and the shared report helpers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from fl_examples.core import checkpoint
from fl_examples.core.report import Column, text_table, write_report
from fl_examples.core.run import (
    TrainerRun,
    adopt_round_charges,
    check_shared_settings,
    checkpoint_dir,
    drive,
    ledger_path,
    open_ledger,
)
from privkit._journal import canonical_json
from privkit.errors import InvalidParameterError, LedgerRollbackError
from privkit.events import GaussianDpEvent, event_to_dict
from privkit.ledger import Ledger


@dataclass(frozen=True)
class ToyConfig:
    steps: int = 7
    stop_before: int | None = None  # a budget stop before this step


class Toy(TrainerRun):
    """x <- x + t at step t; evaluation rows record x."""

    def __init__(self, cfg: ToyConfig, *, first: bool = True, at_end: bool = False,
                 skip_odd_calls: bool = False) -> None:
        self.algorithm, self.cfg, self.history = "toy", cfg, []
        self.t, self.calls, self.x = 0, 0, torch.zeros(1, dtype=torch.float64)
        self.evaluate_first, self.save_at_end = first, at_end  # instance policies for tests
        self.skip_odd_calls = skip_odd_calls

    @property
    def position(self) -> int:
        return self.t

    def finished(self) -> bool:
        return self.t >= self.cfg.steps

    def remaining(self) -> int:
        return self.cfg.steps - self.t

    def step(self) -> bool:
        self.calls += 1
        if self.skip_odd_calls and self.calls % 2:
            return True  # a step that counts nothing
        if self.cfg.stop_before is not None and self.t + 1 >= self.cfg.stop_before:
            self.stopped = f"stopped before step {self.t + 1}"
            return False
        self.t += 1
        self.x += self.t
        return True

    def evaluate(self) -> dict[str, Any]:
        row = {"iteration": self.t, "train_loss": float(self.x[0])}
        self.history.append(row)
        return row

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"x": self.x}, {"t": self.t}

    def load_state(self, tensors: dict[str, Any], state: dict[str, Any]) -> None:
        if tuple(tensors["x"].shape) != (1,):
            raise checkpoint.CheckpointError("tensor 'x' of another shape")
        self.x, self.t = tensors["x"], int(state["t"])

    def report(self) -> dict[str, Any]:
        return {"history": self.history, "_model": self.x}


def _rows(run: Toy) -> list[int]:
    return [r["iteration"] for r in run.history]


def _saved(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith("ckpt-"))


@pytest.mark.parametrize("first, want", [(True, [0, 3, 6, 7]), (False, [3, 6, 7])])
def test_evaluations_fall_on_the_grid_and_after_the_last_step(first, want):
    run = Toy(ToyConfig(), first=first)
    drive(run, checkpoints=None, checkpoint_every=2, eval_every=3)
    assert _rows(run) == want and float(run.x[0]) == 28.0


@pytest.mark.parametrize("at_end, want", [(False, [2, 4, 6]), (True, [2, 4, 6, 7])])
def test_checkpoints_fall_on_the_grid_and_optionally_at_the_end(at_end, want, tmp_path):
    drive(Toy(ToyConfig(), at_end=at_end), checkpoints=tmp_path, checkpoint_every=2,
          eval_every=3)
    assert _saved(tmp_path) == [f"ckpt-{r:06d}" for r in want]
    state = json.loads((tmp_path / "ckpt-000004" / "state.json").read_text())
    assert state["algorithm"] == "toy" and state["config"] == {"steps": 7, "stop_before": None}
    assert state["ledger_pointer"] is None and state["t"] == 4 and state["round"] == 4
    assert [r["iteration"] for r in state["history"]] == [0, 3]


def test_stop_after_then_resume_equals_an_uninterrupted_run(tmp_path):
    whole = Toy(ToyConfig())
    drive(whole, checkpoints=tmp_path / "a", checkpoint_every=2, eval_every=3, resume=False)
    cut = Toy(ToyConfig())
    drive(cut, checkpoints=tmp_path / "b", checkpoint_every=2, eval_every=3, stop_after=5)
    assert _rows(cut) == [0, 3] and cut.t == 5  # no final evaluation when interrupted
    resumed = Toy(ToyConfig())
    drive(resumed, checkpoints=tmp_path / "b", checkpoint_every=2, eval_every=3, resume=True)
    assert resumed.history == whole.history and torch.equal(resumed.x, whole.x)
    assert _saved(tmp_path / "a") == _saved(tmp_path / "b")


def test_a_budget_stop_ends_with_an_evaluation_and_the_end_checkpoint(tmp_path):
    run = Toy(ToyConfig(stop_before=6), at_end=True)
    drive(run, checkpoints=tmp_path, checkpoint_every=3, eval_every=3)
    assert _rows(run) == [0, 3, 5] and run.stopped == "stopped before step 6"
    assert _saved(tmp_path) == ["ckpt-000003", "ckpt-000005"]


def test_steps_that_count_nothing_are_not_evaluated_or_checkpointed(tmp_path):
    run = Toy(ToyConfig(steps=4), skip_odd_calls=True)
    drive(run, checkpoints=tmp_path, checkpoint_every=2, eval_every=2)
    assert run.calls == 8 and _rows(run) == [0, 2, 4]
    assert _saved(tmp_path) == ["ckpt-000002", "ckpt-000004"]


def test_restore_refuses_another_algorithm_configuration_or_state(tmp_path):
    drive(Toy(ToyConfig()), checkpoints=tmp_path, checkpoint_every=2, eval_every=3)
    with pytest.raises(checkpoint.CheckpointError, match="another configuration"):
        Toy(ToyConfig(steps=8)).restore(tmp_path)
    other = Toy(ToyConfig())
    other.algorithm = "other"
    with pytest.raises(checkpoint.CheckpointError, match="is for 'toy', not 'other'"):
        other.restore(tmp_path)
    bad = Toy(ToyConfig())
    bad.state = lambda: ({"x": torch.zeros(2)}, {"t": 8})  # type: ignore[method-assign]
    bad.save(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match=f"{tmp_path}: tensor 'x'"):
        Toy(ToyConfig()).restore(tmp_path)


# ------------------------------------------------------------------------------ ledgers
EVENT = GaussianDpEvent(2.0)
EV_JSON = canonical_json(event_to_dict(EVENT))


def _charges(t: int) -> list[tuple[int, str, int, str]]:
    return [(t, cid, 1, EV_JSON) for cid in (str(t), str(t + 10))]


def _ledger_with(path: Path, rounds: list[int], run_id: str = "toy") -> tuple[Ledger, list]:
    """A ledger with the charges of ``rounds`` and the pointer after each round."""
    led = Ledger.create(path, population_id="p", delta=1e-5)
    after = []
    for r in rounds:
        for _, cid, _, _ in _charges(r):
            receipt = led.spend([cid], EVENT, label="x", round=r, run_id=run_id)
        after.append(receipt.pointer)
    return led, after


def test_charges_after_the_pointer_are_adopted_within_the_window(tmp_path):
    led, after = _ledger_with(tmp_path / "a.jsonl", [1, 2, 3])
    pointer = after[0]  # the state after round 1
    got = adopt_round_charges(led, pointer, run_id="toy", start=1, window=3, charges=_charges)
    assert got == {2: {"2", "12"}, 3: {"3", "13"}}
    with pytest.raises(LedgerRollbackError, match="older than the ledger"):
        adopt_round_charges(led, pointer, run_id="toy", start=1, window=2, charges=_charges)
    with pytest.raises(LedgerRollbackError, match="not an interrupted round"):
        adopt_round_charges(led, led.origin(), run_id="toy", start=1, window=9,
                            charges=_charges)  # round 1's entries are not round 2's
    half, _ = _ledger_with(tmp_path / "b.jsonl", [1])
    half.spend(["2"], EVENT, label="x", round=2, run_id="toy")  # a round cut in the middle
    assert adopt_round_charges(half, half.origin(), run_id="toy", start=0, window=2,
                               charges=_charges) == {1: {"1", "11"}, 2: {"2"}}
    other, _ = _ledger_with(tmp_path / "c.jsonl", [1], run_id="someone-else")
    with pytest.raises(LedgerRollbackError):
        adopt_round_charges(other, other.origin(), run_id="toy", start=0, window=5,
                            charges=_charges)


def test_default_adopt_refuses_any_spend_after_the_pointer(tmp_path):
    """A run without its own write-ahead charges adopts nothing: spend after the checkpoint's
    pointer is refused, never silently taken as already charged."""
    led, after = _ledger_with(tmp_path / "a.jsonl", [1, 2])
    run = Toy(ToyConfig())
    run.adopt(after[1])  # no ledger: nothing to check
    run.ledger = led
    run.adopt(after[1])  # the ledger ends at the pointer
    with pytest.raises(LedgerRollbackError, match="older than the ledger"):
        run.adopt(after[0])


def test_open_ledger_never_resets_spend(tmp_path):
    kw = dict(population_id="p", delta=1e-5)
    assert open_ledger(None, "toy", resume=False, **kw).path is None
    led = open_ledger(tmp_path, "toy", resume=False, **kw)
    assert Path(led.path) == ledger_path(tmp_path, "toy")
    led.spend(["a"], EVENT, label="x")
    with pytest.raises(InvalidParameterError, match="--resume"):
        open_ledger(tmp_path, "toy", resume=False, **kw)
    assert open_ledger(tmp_path, "toy", resume=False, reopen=True, **kw).head() == led.head()
    with pytest.raises(InvalidParameterError, match="belongs to these settings"):
        open_ledger(tmp_path, "toy", resume=True, population_id="q", delta=1e-5)
    with pytest.raises(InvalidParameterError, match="budget"):
        open_ledger(tmp_path, "toy", resume=True, check_settings=True, epsilon_budget=3.0, **kw)
    assert open_ledger(tmp_path, "toy", resume=True, check_settings=True, epsilon_budget=None,
                       **kw).head() == led.head()
    # a checkpoint without its ledger is not a fresh start
    run = Toy(ToyConfig())
    run.save(checkpoint_dir(tmp_path, "gone"))
    with pytest.raises(checkpoint.CheckpointError, match="missing"):
        open_ledger(tmp_path, "gone", resume=True, **kw)
    assert not ledger_path(tmp_path, "gone").exists()


@dataclass(frozen=True)
class Shared:
    lr: float = 0.1
    seed: int = 0
    eval_every: int = 1
    checkpoint_every: int = 0
    epsilon_budget: float | None = None


@pytest.mark.parametrize("field, value", [("lr", float("nan")), ("seed", -1),
                                          ("eval_every", 0), ("checkpoint_every", 1.5),
                                          ("epsilon_budget", 0.0)])
def test_shared_settings_are_validated_by_name(field, value):
    check_shared_settings(Shared())
    with pytest.raises(InvalidParameterError, match=field):
        check_shared_settings(Shared(**{field: value}))


# ------------------------------------------------------------------------------ reports
def test_text_table_aligns_and_formats_columns():
    lines = text_table([Column("algorithm", 9), Column("loss", 6, ".3f"), Column("n", 3)],
                       [("mapa", 0.5, 7), ("asgd", 12.25, 10)])
    assert lines == ["algorithm   loss   n", "mapa       0.500   7", "asgd      12.250  10"]


def test_report_leaves_out_private_keys_and_adds_sections(tmp_path):
    path = write_report(tmp_path, {"seed": 1}, {"a": {"history": [{"iteration": 1}],
                                                      "_model": object(), "x": float("nan")}},
                        plots=False, sections={"comparison": {"best": float("inf")}})
    body = json.loads(path.read_text())
    assert list(body) == ["config", "algorithms", "comparison"]
    assert body["algorithms"]["a"] == {"x": None, "history": [{"iteration": 1}],
                                       "final": {"iteration": 1}}
    assert body["comparison"] == {"best": "inf"}
