"""The run skeleton every bundled trainer implements: one algorithm's run, step by step.

A trainer module (``upcycled``, ``mapa``, ``scfl``, ``dprec``) holds its algorithm and its
configuration; the state of one algorithm's run is a subclass of :class:`TrainerRun`, which
answers a small protocol:

``step() -> bool``
    one step of the algorithm (a round, an iteration, a cloud event); False when the run must
    stop before it (a budget stop, with :attr:`TrainerRun.stopped` saying why), having charged
    and released nothing.
``position``, ``finished()``, ``remaining()``
    steps done (what ``eval_every`` and ``checkpoint_every`` count), whether the run is over,
    and how many counted steps are left (for the progress bar).
``evaluate() -> dict``
    one history row (``iteration``, losses, accuracies, timings, ...), appended to ``history``.
``state()`` / ``load_state(tensors, state)``
    the algorithm's own part of a checkpoint; :meth:`TrainerRun.save` and
    :meth:`TrainerRun.restore` add and check what every checkpoint holds (algorithm,
    configuration, history, ledger pointer).
``adopt(pointer)``
    after a restore, check the ledger's entries after the checkpoint's pointer: charges of
    steps the run is about to replay are adopted (not made twice), anything else is refused.
``report() -> dict``
    the algorithm's entry of ``report.json``.

:func:`drive` is the loop they share: restore or adopt on resume, evaluate every
``eval_every`` steps and at the end, checkpoint every ``checkpoint_every`` steps, stop early
for tests, make the ledger's charges durable at every publication point (below), and stop a
diverging run (:class:`TrainingDivergedError`: the watched loss, the
training loss or a private run's held-out loss (:attr:`TrainerRun.loss_key`), is not
finite, or more than :func:`max_loss_factor` times its first evaluated value; the CLI's
``--max-loss-factor``, default :data:`DEFAULT_MAX_LOSS_FACTOR`). :func:`open_ledger` opens
the run's ledger in the output directory (never reset) and :func:`adopt_round_charges` is the
adoption rule of trainers that charge round by round; :mod:`fl_examples.core.outdir` checks
the output directory before a run starts.
The checkpoint files themselves are :mod:`fl_examples.core.checkpoint`'s.

**Durability.** A step charges its release on the ledger before the release exists (write
ahead), but :func:`drive` runs the steps inside :meth:`privkit.ledger.Ledger.deferred`: the
charges are checked against the budget at once and written together at the next *publication
point*, where something derived from a release would leave the process: a checkpoint (its
model, history and ledger pointer), a progress-bar line showing an evaluation (only when the
bar is shown), the end of the loop (the report, the console table, plots and an error message
come after it: the block's end syncs, also when an exception ends it). A crash between two
publication points loses only charges of releases that never left the process; resuming
replays those steps and charges them again (a seeded step replays the same release, and a
charge that did reach the ledger is adopted, never made twice: :func:`adopt_round_charges`).
A step must therefore publish nothing itself; one that does calls :meth:`TrainerRun.publish`
first.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
import enum
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from fl_examples.core import checkpoint
from fl_examples.core.report import progress
from privkit import _validate
from privkit._journal import canonical_json
from privkit.errors import InvalidParameterError, LedgerRollbackError
from privkit.ledger import Ledger, LedgerPointer

__all__ = ["TrainerRun", "drive", "open_ledger", "ledger_path", "checkpoint_dir",
           "adopt_round_charges", "check_shared_settings", "TrainingDivergedError",
           "DEFAULT_MAX_LOSS_FACTOR", "max_loss_factor", "below_one", "target_within_budget"]

DEFAULT_MAX_LOSS_FACTOR = 100.0
"""A run stops when its training loss exceeds this many times its first evaluated value."""
_MAX_LOSS_FACTOR: contextvars.ContextVar[float] = contextvars.ContextVar(
    "max_loss_factor", default=DEFAULT_MAX_LOSS_FACTOR)


class TrainingDivergedError(FloatingPointError):
    """The training loss became non-finite (or the model did), or it grew past the allowed
    factor of its first evaluated value: the run stops (the CLI exits with status 1)."""


@contextlib.contextmanager
def max_loss_factor(factor: float) -> Iterator[float]:
    """Within the block, :func:`drive` stops a run whose training loss exceeds ``factor``
    times its first evaluated value (``>= 1``; ``inf``: only a non-finite loss stops it).

    Example:
        >>> with max_loss_factor(float("inf")) as f:
        ...     f
        inf
    """
    x = _validate.real("max_loss_factor", factor)
    if not x >= 1:
        raise InvalidParameterError("max_loss_factor", factor, ">= 1 (inf: no limit)")
    token = _MAX_LOSS_FACTOR.set(x)
    try:
        yield x
    finally:
        _MAX_LOSS_FACTOR.reset(token)


def _check_loss(run: TrainerRun, row: dict[str, Any]) -> dict[str, Any]:
    """Raise :class:`TrainingDivergedError` if ``row``'s training loss shows divergence."""
    key = run.loss_key
    loss = row.get(key)
    if not isinstance(loss, (int, float)):
        return row
    what = key.replace("_", " ")
    where = f"{run.algorithm}: training diverged at iteration {row.get('iteration', '?')}"
    if not math.isfinite(loss):
        raise TrainingDivergedError(f"{where}: {what} {loss}; lower --lr (the step size)")
    first = run.history[0].get(key) if run.history else None
    factor = _MAX_LOSS_FACTOR.get()
    if isinstance(first, (int, float)) and math.isfinite(first) and first > 0 \
            and loss > factor * first:
        raise TrainingDivergedError(
            f"{where}: {what} {loss:.4g} is more than {factor:g} x its first value "
            f"{first:.4g} (--max-loss-factor); lower --lr (the step size)")
    return row


def _unhealthy(run: TrainerRun) -> TrainingDivergedError:
    return TrainingDivergedError(f"{run.algorithm}: training diverged after step {run.position}: "
                                 "the model is not finite; lower --lr (the step size)")


class TrainerRun(abc.ABC):
    """One algorithm's run: the protocol of the module docstring plus the checkpoint plumbing.

    Subclasses set :attr:`algorithm`, :attr:`cfg` (a frozen dataclass), :attr:`history`,
    :attr:`ledger` (None for a run without privacy charges) and, for tensors on a device,
    :attr:`device`. The class attributes are the run's policies in :func:`drive`.
    """

    #: Evaluate the initial model before the first step (a history row at position 0).
    evaluate_first: ClassVar[bool] = True
    #: Also checkpoint the last step (or a budget stop) when it is off the checkpoint grid.
    save_at_end: ClassVar[bool] = False
    #: Checkpoints record a ``ledger_pointer`` (None when this run has no ledger).
    records_ledger: ClassVar[bool] = True
    #: On resume without a checkpoint, ledger entries that are not this run's first window
    #: are an earlier run's spend: kept, and this run charges on top (True), or refused (False).
    keeps_earlier_spend: ClassVar[bool] = True

    algorithm: str
    cfg: Any
    history: list[dict[str, Any]]
    ledger: Ledger | None = None
    stopped: str | None = None
    device: Any = "cpu"
    #: The history loss that the divergence stop and the progress bar watch (a private run
    #: watches its held-out loss: :attr:`fl_examples.core.release.Publication.loss_key`).
    loss_key: str = "train_loss"

    # -- the protocol ----------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def position(self) -> int:
        """Steps done: what ``eval_every``, ``checkpoint_every`` and ``stop_after`` count."""

    @abc.abstractmethod
    def finished(self) -> bool:
        """Whether the run has reached its end (no step is left)."""

    @abc.abstractmethod
    def remaining(self) -> int:
        """Counted steps left (the progress bar's total)."""

    @abc.abstractmethod
    def step(self) -> bool:
        """One step; False (nothing charged or released) when the run stops before it."""

    @abc.abstractmethod
    def evaluate(self) -> dict[str, Any]:
        """Evaluate the current model, append the row to :attr:`history` and return it."""

    @abc.abstractmethod
    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensors, JSON state) of this algorithm's part of a checkpoint."""

    @abc.abstractmethod
    def load_state(self, tensors: dict[str, Any], state: dict[str, Any]) -> None:
        """Inverse of :meth:`state` (the history is loaded by :meth:`restore`); raises
        ``CheckpointError`` for a state it cannot use."""

    @abc.abstractmethod
    def report(self) -> dict[str, Any]:
        """This algorithm's entry of the report (keys starting with ``_`` stay out of it)."""

    def adopt(self, pointer: LedgerPointer) -> None:
        """Check the ledger's entries after ``pointer`` against the steps about to replay.

        The default knows no write-ahead charges, so it is strict: the ledger must end at
        ``pointer`` (nothing to check without a ledger). A run that charges before it
        checkpoints overrides it with :func:`adopt_round_charges` over its charges.

        Raises:
            LedgerMismatchError: the ledger lacks the pointer's entry (an older ledger).
            LedgerRollbackError: spend after the pointer that this state cannot account for.
        """
        if self.ledger is not None:
            adopt_round_charges(self.ledger, pointer, run_id=self.algorithm,
                                start=self.position, window=self.position,
                                charges=lambda t: ())

    # -- hooks with defaults ---------------------------------------------------------------
    def publish(self) -> None:
        """A publication point: make every charge made so far durable (a no-op without a
        ledger or a deferred charge). Call it before anything derived from a release leaves
        the process (:func:`drive` does at its own publication points)."""
        if self.ledger is not None:
            self.ledger.sync()

    def healthy(self) -> bool:
        """False (a model that is no longer finite) stops the run before an evaluation with
        :class:`TrainingDivergedError`."""
        return True

    def begin(self) -> None:
        """Work before the first step of this process (after any restore)."""
        return None

    def finish(self) -> None:
        """Checks after the last step, before the final checkpoint."""
        return None

    def postfix(self, row: dict[str, Any]) -> dict[str, str]:
        """What the progress bar shows after an evaluation."""
        out = {"loss": f"{row[self.loss_key]:.4g}"} if self.loss_key in row else {}
        acc = "heldout_accuracy" if self.loss_key == "heldout_loss" else "test_accuracy"
        if acc in row:
            out["acc"] = f"{row[acc]:.3f}"
        if "epsilon" in row:
            out["eps"] = f"{row['epsilon']:.3g}"
        return out

    def checkpoint_round(self) -> int:
        """The number a checkpoint of the current state is named by (it only grows)."""
        return self.position

    def config_state(self) -> Any:
        """The configuration as a checkpoint stores it (and compares it on restore)."""
        return dataclasses.asdict(self.cfg)

    def same_config(self, state: dict[str, Any]) -> bool:
        """Whether a checkpoint's state was made with this run's settings."""
        return state.get("config") == self.config_state()

    def history_state(self) -> list[dict[str, Any]]:
        return self.history

    def load_history(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return list(rows)

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """Checkpoint the current state: the algorithm's :meth:`state` plus the algorithm,
        configuration, history and (with :attr:`records_ledger`) the ledger pointer."""
        self.publish()  # the checkpoint leaves the process: its charges first
        tensors, state = self.state()
        common: dict[str, Any] = {"algorithm": self.algorithm, "config": self.config_state(),
                                  "history": self.history_state()}
        if self.records_ledger:
            common["ledger_pointer"] = (self.ledger.head().to_dict()
                                        if self.ledger is not None else None)
        checkpoint.save(directory, self.checkpoint_round(), tensors, common | state)

    def restore(self, directory: Path) -> None:
        """Continue from the latest checkpoint in ``directory``, checked against the ledger
        (:meth:`adopt`).

        Raises:
            CheckpointError: a checkpoint of another algorithm or configuration, or a private
                run's checkpoint without a ledger pointer.
            LedgerMismatchError: the ledger lacks the checkpoint's entry (an older ledger).
            LedgerRollbackError: the checkpoint is older than the ledger's spend.
        """
        tensors, state = checkpoint.load_latest(directory, self.device)
        if state.get("algorithm") != self.algorithm:
            raise checkpoint.CheckpointError(
                f"{directory}: checkpoint is for {state.get('algorithm')!r}, "
                f"not {self.algorithm!r}")
        if not self.same_config(state):
            raise checkpoint.CheckpointError(
                f"{directory}: checkpoint was made with another configuration; resume with "
                "the same settings or start a new --out")
        try:
            self.load_state(tensors, state)
        except checkpoint.CheckpointError as exc:  # e.g. a tensor of another shape
            raise checkpoint.CheckpointError(f"{directory}: {exc}") from None
        self.history = self.load_history(state["history"])
        if self.ledger is not None:
            pointer = state.get("ledger_pointer")
            if pointer is None:
                raise checkpoint.CheckpointError(
                    f"{directory}: a private run's checkpoint without a ledger pointer")
            self.adopt(LedgerPointer.from_dict(pointer))


def drive(run: TrainerRun, *, checkpoints: Path | None, checkpoint_every: int,
          eval_every: int, resume: bool = False, stop_after: int | None = None) -> None:
    """Run ``run`` to its end: the loop every trainer shares.

    With ``resume``, the run continues from the latest checkpoint in ``checkpoints`` or, when
    there is none, adopts the charges a crash before the first checkpoint left in its ledger.
    Then: evaluate first (``run.evaluate_first``); step until :meth:`TrainerRun.finished`;
    evaluate every ``eval_every`` counted steps and after the last one; checkpoint every
    ``checkpoint_every`` (0: never); stop after ``stop_after`` counted steps (to test
    resuming: no final evaluation or checkpoint then). A step that counts nothing (MAPA's
    dropped upload) is neither evaluated nor checkpointed. A budget stop (``step()`` returns
    False) ends the loop with a final evaluation. The ledger's charges are deferred and made
    durable at each publication point: before a checkpoint, before the progress bar shows an
    evaluation, and when the loop ends, however it ends (module docstring).

    Raises:
        TrainingDivergedError: after an evaluation whose watched loss is not finite or
            exceeds :func:`max_loss_factor` times the first one, or when
            :meth:`TrainerRun.healthy` says the model is not finite.
    """
    every = checkpoint_every if checkpoints is not None else 0
    saved: int | None = None
    if resume and checkpoints is not None and checkpoint.latest_round(checkpoints) is not None:
        run.restore(checkpoints)
        saved = run.checkpoint_round()
    elif resume and run.ledger is not None and run.ledger.head().seq >= 0:
        # No checkpoint yet: a crash during the first steps may have left their charges.
        try:
            run.adopt(run.ledger.origin())
        except LedgerRollbackError:
            if not run.keeps_earlier_spend:
                raise
    if run.evaluate_first and not run.history:
        _check_loss(run, run.evaluate())
    interrupted = False
    bar = progress(run.remaining(), desc=run.algorithm)
    # charges are made durable at the publication points, and when the block ends
    deferred = run.ledger.deferred() if run.ledger is not None else contextlib.nullcontext()
    try:
        with deferred:
            run.begin()
            while not run.finished():
                before = run.position
                if not run.step():
                    break
                if run.position == before:
                    continue
                bar.update(run.position - before)
                if run.position % eval_every == 0 or run.finished():
                    if not run.healthy():
                        raise _unhealthy(run)
                    row = _check_loss(run, run.evaluate())
                    if not bar.disable:  # the bar prints the evaluation: a publication
                        run.publish()
                    bar.set_postfix(**run.postfix(row))
                if every and run.position % every == 0:
                    assert checkpoints is not None
                    run.save(checkpoints)  # publishes first
                    saved = run.checkpoint_round()
                if stop_after is not None and run.position >= stop_after:
                    interrupted = True
                    break
            if not interrupted:
                if not run.healthy():
                    raise _unhealthy(run)
                if not run.history or run.history[-1]["iteration"] != run.position:
                    _check_loss(run, run.evaluate())
                run.finish()
                if every and run.save_at_end and saved != run.checkpoint_round():
                    assert checkpoints is not None
                    run.save(checkpoints)
    finally:
        bar.close()


# ----------------------------------------------------------------------------- ledgers
def ledger_path(out: Path, algorithm: str) -> Path:
    """``OUT/ledger-<algorithm>.jsonl``: one ledger per output directory and algorithm."""
    return out / f"ledger-{algorithm}.jsonl"


def checkpoint_dir(out: Path | None, algorithm: str) -> Path | None:
    """``OUT/checkpoints/<algorithm>/`` (None without an output directory)."""
    return out / "checkpoints" / algorithm if out is not None else None


def open_ledger(out: Path | None, algorithm: str, *, population_id: str, delta: float,
                resume: bool, reopen: bool = False, check_settings: bool = True,
                **settings: Any) -> Ledger:
    """The run's ledger: in memory without ``out``, else ``OUT/ledger-<algorithm>.jsonl``,
    created, or reopened (spend is never reset) on ``resume`` (or always, with ``reopen``).

    ``settings`` are :meth:`Ledger.create`'s other arguments (``epsilon_budget``, ``method``,
    ``neighboring_relation``); a reopened ledger must hold the same population and delta and,
    with ``check_settings`` (the default), the same settings: a budget stop then names the
    budget the ledger enforces. A ledger whose journal was deleted but whose head record
    remains is not recreated (:meth:`Ledger.create` refuses).

    Raises:
        InvalidParameterError: naming ``out``: the ledger exists and this is not a resume, or
            it belongs to other settings.
        CheckpointError: on resume, a checkpoint exists but its ledger does not (spend is
            never reset: a missing ledger is not a fresh start).
    """
    if out is None:
        return Ledger.create(None, population_id=population_id, delta=delta, **settings)
    path = ledger_path(out, algorithm)
    ckpt = checkpoint_dir(out, algorithm)
    if resume and not path.exists() and ckpt is not None \
            and checkpoint.latest_round(ckpt) is not None:
        raise checkpoint.CheckpointError(
            f"{ckpt}: a checkpoint exists but its ledger {path} is missing; spend is never "
            "reset (use a new --out)")
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        return Ledger.create(path, population_id=population_id, delta=delta, **settings)
    if not (resume or reopen):
        raise InvalidParameterError("out", str(out), f"a directory without {path.name} (a "
                                    "ledger never resets: use a new --out, or --resume)")
    led = Ledger.open(path)
    held = {"epsilon_budget": led.epsilon_budget, "method": led.method.value,
            "neighboring_relation": led.neighboring_relation.name}
    want = {k: (v.value if k == "method" else v.name) if isinstance(v, enum.Enum) else v
            for k, v in settings.items()}
    same = led.population_id == population_id and led.delta == delta and (
        not check_settings or all(held[k] == v for k, v in want.items()))
    if not same:
        extra = (f", budget {led.epsilon_budget}, relation {led.neighboring_relation.name}"
                 if check_settings else "")
        raise InvalidParameterError(
            "out", str(out), f"a directory whose {path.name} belongs to these settings (it "
            f"holds population {led.population_id!r}, delta {led.delta:g}{extra}); resume "
            "with the same settings or use a new --out")
    return led


Charge = tuple[int, str, int, str]
"""One expected ledger entry: (round, client id, count, canonical event JSON)."""


def adopt_round_charges(ledger: Ledger, pointer: LedgerPointer, *, run_id: str, start: int,
                        window: int, charges: Callable[[int], Sequence[Charge]],
                        step_name: str = "round", replays_identically: bool = True
                        ) -> dict[int, set[str]]:
    """Match the ledger's entries after ``pointer`` with the write-ahead charges of the steps
    ``start + 1 .. window``, in order; returns ``{round: client ids already charged}``.

    With ``replays_identically=False`` (noise from the OS CSPRNG: a replayed step draws fresh
    noise, so its release is new) the entries must each be a charge of one of those steps
    (several crashes may have left several attempts), they stay spent, and nothing is
    adopted: the replay charges again.

    ``charges(t)`` lists the entries step ``t`` writes (none for a step that touches no data);
    a crash may cut a step's charges anywhere. Charges are written before a step releases
    anything and checkpoints come every few steps, so the entries after a checkpoint's pointer
    can only be charges of the steps up to the next checkpoint (``window``): those steps
    replay with the same draws (every stream comes from the seed tree by step), so their
    charges are adopted rather than made twice.

    Raises:
        LedgerRollbackError: an entry that is not the next expected charge (a newer
            checkpoint existed, or another run's spend): the state is older than the ledger.
    """
    pending = ledger.entries_since(pointer)
    if not replays_identically:
        _check_attempts(ledger, pointer, pending, run_id=run_id, start=start, window=window,
                        charges=charges, step_name=step_name)
        return {}

    def rollback(entry: dict[str, Any]) -> LedgerRollbackError:
        return LedgerRollbackError(
            f"{run_id}: the checkpoint at {step_name} {start} (ledger seq {pointer.seq}) is "
            f"older than the ledger (head seq {ledger.head().seq}): entry {entry.get('seq')} "
            f"is spend that a later state depends on, not an interrupted {step_name} of this "
            "run; resume from the latest checkpoint (spend is never rolled back)")

    adopted: dict[int, set[str]] = {}
    t, i = start, 0
    while i < len(pending):
        t += 1
        if t > window:
            raise rollback(pending[i])
        for round_, cid, count, event in charges(t)[: len(pending) - i]:
            e = pending[i]
            if not (e.get("kind") == "spend" and e.get("client_id") == cid
                    and e.get("count") == count and e.get("round") == round_
                    and e.get("run_id") == run_id and canonical_json(e.get("event")) == event):
                raise rollback(e)
            adopted.setdefault(round_, set()).add(cid)
            i += 1
    return adopted


def _check_attempts(ledger: Ledger, pointer: LedgerPointer, pending: Sequence[dict[str, Any]],
                    *, run_id: str, start: int, window: int,
                    charges: Callable[[int], Sequence[Charge]], step_name: str) -> None:
    """Each entry after ``pointer`` is a charge of one of the steps ``start + 1 .. window``
    (a charge whose client id is None stands for any client: a run whose sample comes from
    the OS CSPRNG cannot replay who was charged, only the round and the event)."""
    expected = [c for t in range(start + 1, window + 1) for c in charges(t)]
    allowed = {c for c in expected if c[1] is not None}
    anyone = {(c[0], c[3]) for c in expected if c[1] is None}
    for e in pending:
        event = canonical_json(e.get("event"))
        key = (e.get("round"), e.get("client_id"), e.get("count"), event)
        ok = key in allowed or (e.get("round"), event) in anyone
        if not (e.get("kind") == "spend" and e.get("run_id") == run_id and ok):
            raise LedgerRollbackError(
                f"{run_id}: the checkpoint at {step_name} {start} (ledger seq {pointer.seq}) "
                f"is older than the ledger (head seq {ledger.head().seq}): entry "
                f"{e.get('seq')} is not a charge of the {step_name}s up to the next "
                "checkpoint; resume from the latest checkpoint (spend is never rolled back)")


# ------------------------------------------------------------------------- settings
#: The largest float32: the models train in float32, so a step size above it overflows.
FLOAT32_MAX = 3.4028234663852886e38


def float32_scale(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """A finite number > 0 (>= 0 with ``allow_zero``) that float32 arithmetic can hold (a
    learning rate, a proximal coefficient: the models train in float32)."""
    v = (_validate.nonnegative if allow_zero else _validate.positive)(name, value)
    if v > FLOAT32_MAX:
        raise InvalidParameterError(name, value, f"at most {FLOAT32_MAX:.4g} (the models train "
                                    "in float32)")
    return v


_SHARED: dict[str, Callable[[str, Any], Any]] = {
    "local_epochs": _validate.positive_int,
    "batch_size": _validate.positive_int,
    "lr": float32_scale,
    "delta": lambda name, v: None if v is None else _validate.delta(name, v),
    "epsilon_budget": lambda name, v: None if v is None else _validate.positive(name, v),
    "seed": _validate.nonnegative_int,
    "eval_every": _validate.positive_int,
    "checkpoint_every": _validate.nonnegative_int,
}


def below_one(name: str, value: Any) -> float:
    """A real number in [0, 1) (a momentum, a share of clients), else an error naming
    ``name``."""
    x = _validate.real(name, value)
    if not 0 <= x < 1:
        raise InvalidParameterError(name, value, "in [0, 1)")
    return x


def target_within_budget(name: str, target: Any, budget: float | None) -> float | None:
    """An epsilon the noise is calibrated to (``--noise-for-epsilon``; None: not given):
    finite, > 0 and at most ``budget`` (``--epsilon-budget``, None: no budget), else an
    error naming ``name``: calibrated above the budget, the run would stop before training."""
    if target is None:
        return None
    t = _validate.positive(name, target)
    if budget is not None and t > budget:
        raise InvalidParameterError(
            name, target, f"<= --epsilon-budget {budget:g} (calibrated above the budget, the "
            "run would stop before training)")
    return t


def check_shared_settings(cfg: Any) -> None:
    """Validate the settings every trainer's configuration shares, those ``cfg`` has: the
    local solver (``local_epochs``, ``batch_size``, ``lr``), ``delta``, ``epsilon_budget``
    (None or > 0), ``seed``, ``eval_every`` and ``checkpoint_every``."""
    for name, check in _SHARED.items():
        if hasattr(cfg, name):
            check(name, getattr(cfg, name))
