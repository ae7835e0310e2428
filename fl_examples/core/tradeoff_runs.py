"""Reading the runs of ``privkit report tradeoff``: one :class:`RunPoint` per (run, algorithm).

Which metrics and which privacy section a point takes from a ``report.json`` is described in
:mod:`fl_examples.core.tradeoff`; malformed reports raise
:class:`~privkit.errors.InvalidParameterError` naming the file and the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privkit.errors import InvalidParameterError

__all__ = ["MEASURES", "GUARANTEES", "EPSILON_STATISTICS", "RunPoint", "load_runs"]

#: Which per-run number a point takes (over the run's clients): ``max``, the worst-off
#: client's (what the run can claim for every client; the default), or ``mean``.
EPSILON_STATISTICS = ("max", "mean")
_EPSILON_CHOICES = EPSILON_STATISTICS
#: Privacy measures a report can carry: (epsilon, delta)-DP or MI-DP in nats.
MEASURES = ("epsilon", "mi_dp_nats")
#: A report's ``guarantee``, strongest first (docs/epsilon-covers.md).
GUARANTEES = ("proven", "simulation", "not proven")


@dataclass(frozen=True)
class RunPoint:
    """The final result of one algorithm in one run.

    ``accuracy`` and ``loss`` are the report's held-out metrics where it has them (public
    data: all a private run publishes), else the clients' test accuracy and training loss
    (older or non-private reports); ``accuracy_metric`` and ``loss_metric`` name which.
    """

    algorithm: str
    seed: int | None
    dataset: str
    privacy: str  # "output" | "objective" | ... ; "none" for an algorithm without privacy
    epsilon_mean: float  # +inf when not private
    epsilon_max: float
    proven: bool
    accuracy: float
    loss: float
    source: Path  # the report.json read
    delta: float | None = None
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    measure: str = "epsilon"  # "mi_dp_nats": epsilon_* are NaN, the value is in mi_dp_nats_*
    mi_dp_nats_mean: float = math.nan
    mi_dp_nats_max: float = math.nan
    accuracy_metric: str = "test_accuracy"
    loss_metric: str = "train_loss"
    guarantee: str = "-"  # "proven" | "simulation" | "not proven"; "-" when not private
    note: str = ""  # what the epsilon leaves out that the metrics depend on

    @property
    def private(self) -> bool:
        return self.privacy != "none"

    def epsilon(self, which: str = "max") -> float:
        """The run's epsilon over its clients: ``max`` (the worst-off client's) or ``mean``."""
        _check_epsilon(which)
        return self.epsilon_mean if which == "mean" else self.epsilon_max

    def value(self, which: str = "max") -> float:
        """The privacy number in this point's ``measure`` (epsilon or MI-DP nats), ``max``
        (the worst-off client's) or ``mean`` over the run's clients."""
        _check_epsilon(which)
        if self.measure == "mi_dp_nats":
            return self.mi_dp_nats_mean if which == "mean" else self.mi_dp_nats_max
        return self.epsilon(which)


# ---------------------------------------------------------------------------------- loading


def _check_epsilon(which: Any, name: str = "epsilon") -> str:
    """``which`` if it is a statistic of :data:`EPSILON_STATISTICS`, else an error naming
    ``name`` (the library's ``epsilon=`` argument, the CLI's ``epsilon_statistic``)."""
    if which not in _EPSILON_CHOICES:
        raise InvalidParameterError(name, which, "'max' (the worst-off client's) or 'mean'")
    return which


def _number(value: Any, where: str) -> float:
    """A report number: finite JSON number, null (NaN) or the strings 'inf'/'-inf'/'nan'."""
    if value is None:
        return math.nan
    if isinstance(value, bool):
        raise InvalidParameterError(where, value, "a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "-inf", "nan"):
        return float(value)
    raise InvalidParameterError(where, value, "a number (or null, 'inf', '-inf')")


def _report_files(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            if (p / "report.json").is_file():
                files.append(p / "report.json")
                continue
            found = sorted(f for f in p.rglob("report.json")  # a sweep of run directories
                           if not any(part.startswith(".privkit-overwrite-")  # a replaced run
                                      for part in f.relative_to(p).parts))
            if not found:
                raise InvalidParameterError(
                    "run directory", str(p), "a run directory containing report.json "
                    "(or a directory with run directories below it)")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise InvalidParameterError("run directory", str(p),
                                        "an existing run directory or report.json file")
    unique: dict[Path, Path] = {}
    for f in files:
        unique.setdefault(f.resolve(), f)
    return list(unique.values())


def _load_file(path: Path) -> list[RunPoint]:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(str(path), type(exc).__name__, "a readable file") from exc
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(str(path), f"{exc.msg} at line {exc.lineno}",
                                    "valid JSON (a report.json)") from exc

    def key(name: str) -> str:
        return f"{path}: {name}"

    if not isinstance(body, dict):
        raise InvalidParameterError(key("<top level>"), type(body).__name__, "a JSON object")
    config = body.get("config")
    if not isinstance(config, dict):
        raise InvalidParameterError(key("config"), config, "a JSON object")
    algorithms = body.get("algorithms")
    if not isinstance(algorithms, dict) or not algorithms:
        raise InvalidParameterError(key("algorithms"), algorithms,
                                    "a non-empty JSON object of algorithm entries")
    seed = config.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidParameterError(key("config.seed"), seed, "an integer")
    dataset = config.get("dataset", "")
    if not isinstance(dataset, str):
        raise InvalidParameterError(key("config.dataset"), dataset, "a string")
    kind = config.get("privacy", "none")
    if kind is None:
        kind = "none"
    if not isinstance(kind, str):
        raise InvalidParameterError(key("config.privacy"), kind, "a string")

    points = []
    for name, entry in algorithms.items():
        where = f"algorithms.{name}"
        if not isinstance(entry, dict):
            raise InvalidParameterError(key(where), entry, "a JSON object")
        final = entry.get("final")
        if not isinstance(final, dict):
            raise InvalidParameterError(key(f"{where}.final"), final,
                                        "an evaluation object (was the run empty?)")
        # the held-out metrics (public data: what a private run publishes), else the
        # clients' test accuracy and training loss (older reports, non-private runs)
        acc_key = next((k for k in ("heldout_accuracy", "test_accuracy") if k in final),
                       "none")
        loss_key = "heldout_loss" if "heldout_loss" in final else "train_loss"
        if loss_key not in final:
            raise InvalidParameterError(key(f"{where}.final.{loss_key}"), None,
                                        "present (or heldout_loss)")
        # a regression task (SCFL on linreg) has no accuracy
        acc = _number(final[acc_key], key(f"{where}.final.{acc_key}")) \
            if acc_key in final else math.nan
        loss = _number(final[loss_key], key(f"{where}.final.{loss_key}"))
        priv, section, run_kind = _privacy_of(entry, where, kind, config, key)
        measure, mi_mean, mi_max, note = "epsilon", math.nan, math.nan, ""
        guarantee = "-"
        if priv is None:
            eps_mean, eps_max, proven, delta = math.inf, math.inf, True, None
        else:
            measure = priv.get("measure", "epsilon")
            if measure not in MEASURES:
                raise InvalidParameterError(key(f"{where}.{section}.measure"), measure,
                                            "'epsilon' or 'mi_dp_nats'")
            names = (("epsilon_mean", "epsilon_max") if measure == "epsilon"
                     else ("mi_dp_nats_mean", "mi_dp_nats_max"))
            for k in names:
                if k not in priv:
                    raise InvalidParameterError(key(f"{where}.{section}.{k}"), None, "present")
            lo_hi = [_number(priv[k], key(f"{where}.{section}.{k}")) for k in names]
            if measure == "epsilon":
                eps_mean, eps_max = lo_hi
            else:
                eps_mean = eps_max = math.nan  # an MI-DP run has no epsilon
                mi_mean, mi_max = lo_hi
            proven = priv.get("proven", False)
            if not isinstance(proven, bool):
                raise InvalidParameterError(key(f"{where}.{section}.proven"), proven,
                                            "true or false")
            guarantee = priv.get("guarantee", "proven" if proven else "not proven")
            if guarantee not in GUARANTEES:
                raise InvalidParameterError(key(f"{where}.{section}.guarantee"), guarantee,
                                            "'proven', 'simulation' or 'not proven'")
            delta = priv.get("delta")
            if delta is not None:
                delta = _number(delta, key(f"{where}.{section}.delta"))
            coded = entry.get("privacy") if section == "gradient_privacy" else None
            if isinstance(coded, dict) and coded.get("measure") == "mi_dp_nats":
                mi_mean = _number(coded.get("mi_dp_nats_mean"), key(f"{where}.privacy"))
                mi_max = _number(coded.get("mi_dp_nats_max"), key(f"{where}.privacy"))
                note = (f"{name}: epsilon of the client gradients only; the model also rests "
                        f"on the coded upload (MI-DP {mi_max:.3g} nats max, not an epsilon)")
        points.append(RunPoint(
            algorithm=str(name), seed=seed, dataset=dataset, privacy=run_kind,
            epsilon_mean=eps_mean, epsilon_max=eps_max, proven=proven,
            accuracy=acc, loss=loss, source=path, delta=delta,
            config=dict(config), measure=measure, mi_dp_nats_mean=mi_mean,
            mi_dp_nats_max=mi_max, accuracy_metric=acc_key, loss_metric=loss_key,
            guarantee=guarantee, note=note))
    return points


def _privacy_of(entry: dict[str, Any], where: str, kind: str, config: dict[str, Any],
                key: Any) -> tuple[dict[str, Any] | None, str, str]:
    """(the privacy section to read, its key, the point's privacy kind); (None, "", "none")
    for a non-private algorithm: no section, or one marked ``non_private`` (DP-REC's FedAvg
    reference). SCFL keeps the epsilon of its DP-SGD gradients in ``gradient_privacy`` (its
    ``privacy`` is the coded upload's MI-DP): that epsilon is the point's."""
    for section in ("gradient_privacy", "privacy"):
        priv = entry.get(section)
        if priv is None:
            continue
        if not isinstance(priv, dict):
            raise InvalidParameterError(key(f"{where}.{section}"), priv, "a JSON object")
        if priv.get("non_private") is True:
            return None, "", "none"
        if section == "gradient_privacy":
            return priv, section, "gradient-dp"
        if kind not in ("none", "private"):
            name = kind.split("+")[0]  # scfl's "coded-mi-dp+gradient-dp": the coded part
        elif isinstance(config.get("noise"), str):  # mapa: l2, l1 or gaussian
            name = f"{config['noise']} noise"
        elif isinstance(priv.get("mechanism"), str):  # dprec: rec, client_level_gaussian
            name = priv["mechanism"].split()[0]
        else:
            name = "private"
        return priv, section, name
    return None, "", "none"


def load_runs(paths: Iterable[str | Path]) -> list[RunPoint]:
    """One :class:`RunPoint` per (run, algorithm).

    Each path is a run directory holding ``report.json``, a ``report.json`` file, or a
    directory with run directories somewhere below it (all their reports are read). A file
    given twice is read once. A missing or malformed file raises
    :class:`~privkit.errors.InvalidParameterError` naming the path and the offending key.
    """
    files = _report_files(paths)
    if not files:
        raise InvalidParameterError("RUN_DIRS", [], "at least one run directory")
    points: list[RunPoint] = []
    for f in files:
        points.extend(_load_file(f))
    return points
