"""ServerApp of the example: the run config becomes an UpcycledFedProx / PrivkitFedProx run.

``privacy``:

- ``client`` (default): client-level DP. The app's strategy (every client addressed,
  ``fraction_train=1.0``) runs inside :class:`~fl_examples.flower.ClientLevelDP`: each client
  joins a data round with probability ``fraction`` (Poisson), its update is clipped to
  ``client-clip-norm`` and the sum gets Gaussian noise once. ``noise-multiplier = 0``
  calibrates z so that the population's epsilon at ``delta`` after the run's data rounds is
  at most ``target-epsilon``. The ledger (id ``population``) is ``OUT/ledger-client.jsonl``
  with ``out-dir``, else in memory; the run stops before a round would exceed
  ``epsilon-budget`` (0: ``target-epsilon`` when calibrated, else no limit).
- ``output``, ``objective``, ``rec``: privkit's local mechanisms behind the client mods, every
  client sent work charged on ``OUT/ledger.jsonl`` (record-level guarantees per client).
- ``none``: no privacy.

``evaluation``:

- ``server`` (default): the server evaluates each round's global model on the data set's
  public held-out set (for digits, the rows held back from every client's share; in a real
  deployment the server's own held-out data). No client is asked anything, so evaluation
  releases nothing computed on client data and costs no messages.
- ``clients``: federated evaluation, each client on its test split (``fraction-evaluate`` of
  them), weighted by test size. The replies are computed on client data and are not covered
  by the guarantee.

With ``reference = true`` and a private ``privacy``, the same settings then run again without
privacy on the same nodes, and the last log line puts both final accuracies side by side. With
``out-dir``,
``OUT/flower-result.json`` holds each run's per-round metrics, keyed ``private`` and
``non-private``.
"""

from __future__ import annotations

import json
import time
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

import privkit
from fl_examples.flower import (
    PrivkitFedProx,
    UpcycledFedProx,
    central_evaluate_fn,
    initial_arrays,
    load_federated,
)
from fl_examples.flower.client import make_model
from fl_examples.flower.privacy import relation_of
from fl_examples.flower.server import result_summary
from privkit.errors import InvalidParameterError
from privkit.events.mechanisms import NeighboringRelation
from privkit.flower import ClientLevelDP, PrivacySettings
from privkit.ledger import Ledger
from privkit.mechanisms.aggregate import ClientLevelGaussian

PRIVACY = ("none", "client", "output", "objective", "rec")
EVALUATION = ("server", "clients")


def _population(rc: Any, kind: str) -> str:
    tail = "flower-client-level" if kind == "client" else "flower"
    return f"{rc['dataset']}|clients={rc['num-clients']}|seed={rc['seed']}|{tail}"


def _ledger(rc: Any, kind: str, budget: float | None,
            relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE) -> Ledger:
    population = _population(rc, kind)
    out = str(rc["out-dir"])
    if not out:
        return Ledger.create(None, population_id=population, delta=float(rc["delta"]),
                             epsilon_budget=budget, neighboring_relation=relation)
    path = Path(out) / ("ledger-client.jsonl" if kind == "client" else "ledger.jsonl")
    if path.exists():  # a ledger never resets: a rerun keeps charging the same clients
        ledger = Ledger.open(path)
        if ledger.population_id != population:
            raise InvalidParameterError("out-dir", out, f"a directory whose ledger belongs to "
                                        f"this population (it holds {ledger.population_id!r})")
        return ledger
    path.parent.mkdir(parents=True, exist_ok=True)
    return Ledger.create(path, population_id=population, delta=float(rc["delta"]),
                         epsilon_budget=budget, neighboring_relation=relation)


def data_rounds(algorithm: str, num_rounds: int) -> int:
    """Server rounds that touch client data: all (FedProx) or the odd ones (Upcycled-FL)."""
    return (num_rounds + 1) // 2 if algorithm == "upcycled" else num_rounds


def client_level_noise(*, l2_clip_norm: float, client_rate: float, rounds: int,
                       target_epsilon: float, delta: float) -> tuple[float, float]:
    """(z, planned epsilon): the smallest z whose ``rounds`` Poisson-sampled releases of
    :class:`privkit.ClientLevelGaussian` stay within ``target_epsilon`` at ``delta``.

    >>> z, eps = client_level_noise(l2_clip_norm=1.0, client_rate=0.3, rounds=10,
    ...                             target_epsilon=8.0, delta=1e-5)
    >>> round(z, 2), eps <= 8.0
    (0.92, True)
    """
    z, eps, _ = privkit.calibrate_noise(
        lambda x: privkit.SelfComposedDpEvent(
            ClientLevelGaussian(l2_clip_norm, x, client_rate).event(), rounds),
        target_epsilon=target_epsilon, delta=delta, tol=1e-4)
    return float(z), float(eps)


def strategy_from_config(context: Context, kind: str | None = None) -> Strategy:
    """The strategy the run config describes (``kind`` overrides its ``privacy``)."""
    rc = context.run_config
    kind = str(rc["privacy"]) if kind is None else kind
    if kind not in PRIVACY:
        raise InvalidParameterError("privacy", kind, "none, client, output, objective or rec")
    budget = float(rc["epsilon-budget"]) or None
    private: dict[str, Any] = {}
    if kind in ("output", "objective", "rec"):
        settings = PrivacySettings(
            kind, l2_clip_norm=float(rc["l2-clip-norm"]), stddev=float(rc["stddev"]),
            sensitivity=str(rc["sensitivity"]), clip=str(rc["clip"]), alpha=float(rc["alpha"]),
            allow_unproven=bool(rc["allow-unproven"]), glm=rc["model"] == "logreg",
            bits=int(rc["rec-bits"]), groups=str(rc["rec-groups"]))
        rel = relation_of(settings) or NeighboringRelation.ADD_OR_REMOVE_ONE
        private = {"privacy": settings, "ledger": _ledger(rc, kind, budget, rel),
                   "train_action": kind}
    fraction = float(rc["fraction"])
    fraction_evaluate = 0.0 if _evaluation(rc) == "server" else float(rc["fraction-evaluate"])
    common: dict[str, Any] = dict(
        proximal_mu=float(rc["mu"]), fraction_train=1.0 if kind == "client" else fraction,
        stragglers=float(rc["stragglers"]), local_epochs=int(rc["local-epochs"]),
        batch_size=int(rc["batch-size"]), lr=float(rc["lr"]), momentum=float(rc["momentum"]),
        seed=int(rc["seed"]), fraction_evaluate=fraction_evaluate,
        batch_order=str(rc["batch-order"]), **private)
    n = int(rc["num-clients"])
    algorithm = str(rc["algorithm"])
    if algorithm == "upcycled":
        inner: PrivkitFedProx = UpcycledFedProx(n, lam=float(rc["lam"]), **common)
    elif algorithm == "fedprox":
        inner = PrivkitFedProx(n, **common)
    else:
        raise InvalidParameterError("algorithm", algorithm, "upcycled or fedprox")
    if kind != "client":
        return inner
    clip, z = float(rc["client-clip-norm"]), float(rc["noise-multiplier"])
    if z == 0.0:
        target = float(rc["target-epsilon"])
        z, _ = client_level_noise(l2_clip_norm=clip, client_rate=fraction,
                                  rounds=data_rounds(algorithm, int(rc["num-rounds"])),
                                  target_epsilon=target, delta=float(rc["delta"]))
        budget = budget or target
    return ClientLevelDP(inner, num_clients=n, client_rate=fraction, l2_clip_norm=clip,
                         noise_multiplier=z, ledger=_ledger(rc, kind, None),
                         max_epsilon=budget, run_id=_population(rc, kind))


def _evaluation(rc: Any) -> str:
    kind = str(rc.get("evaluation", "server"))
    if kind not in EVALUATION:
        raise InvalidParameterError("evaluation", kind, "server or clients")
    return kind


def _dataset(rc: Any) -> Any:
    return load_federated(str(rc["dataset"]), int(rc["seed"]), int(rc["num-clients"]))


def initial_from_config(context: Context) -> ArrayRecord:
    """The initial model (drawn from the seed; the data set gives only its shape)."""
    rc = context.run_config
    return initial_arrays(make_model(str(rc["model"]), _dataset(rc)), int(rc["seed"]))


def evaluate_fn_from_config(context: Context) -> Any:
    """``evaluate_fn`` for ``Strategy.start`` with ``evaluation = "server"``, else None."""
    rc = context.run_config
    if _evaluation(rc) != "server":
        return None
    ds = _dataset(rc)
    return central_evaluate_fn(make_model(str(rc["model"]), ds), ds)


def run_summary(result: Result, strategy: Strategy, seconds: float) -> dict[str, Any]:
    """Per-round metrics, the final accuracy and, for client-level DP, its privacy."""
    inner = strategy.strategy if isinstance(strategy, ClientLevelDP) else strategy
    out = result_summary(result, inner)  # type: ignore[arg-type]
    evals = result.evaluate_metrics_serverapp or result.evaluate_metrics_clientapp
    out["evaluation"] = "server" if result.evaluate_metrics_serverapp else "clients"
    out["accuracy"] = float(evals[max(evals)]["accuracy"]) if evals else None
    out["seconds"] = seconds
    if isinstance(strategy, ClientLevelDP):
        out["privacy"] = strategy.report() | {
            "evaluation": out["evaluation"] + (": the held-out set, no client's data" if
                                               out["evaluation"] == "server" else ""),
            "not_covered": [{"field": "seconds", "reason": "wall-clock time"}] + (
                [{"field": "evaluate_metrics", "reason": "federated evaluation on the "
                  "clients' own test data"}] if out["evaluation"] == "clients" else [])}
        if strategy.stopped is not None:
            out["stopped"] = strategy.stopped
    return out


def _line(label: str, run: dict[str, Any]) -> str:
    acc = "n/a" if run["accuracy"] is None else f"{run['accuracy']:.4f}"
    text = f"{label} accuracy {acc}"
    p = run.get("privacy")
    if p and "epsilon" in p:
        text += f" (client-level epsilon {p['epsilon']:.4f} at delta {p['delta']:g})"
    elif p and "epsilon_max" in p:
        text += f" (per-client epsilon max {p['epsilon_max']:.4g} at delta {p['delta']:g})"
    return text


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the configured strategy, then (``reference``) the same settings without privacy."""
    rc = context.run_config
    kind = str(rc["privacy"])
    runs = [("private" if kind != "none" else "non-private", kind)]
    if kind != "none" and bool(rc.get("reference", False)):
        runs.append(("non-private", "none"))
    rounds = int(rc["num-rounds"])
    summary: dict[str, Any] = {}
    for label, k in runs:
        strategy = strategy_from_config(context, k)
        t0 = time.perf_counter()
        result = strategy.start(grid=grid, initial_arrays=initial_from_config(context),
                                num_rounds=rounds, timeout=3600.0, train_config=ConfigRecord(),
                                evaluate_config=ConfigRecord(),
                                evaluate_fn=evaluate_fn_from_config(context))
        summary[label] = run_summary(result, strategy, time.perf_counter() - t0)
        log(INFO, "privkit: %s", _line(label, summary[label]))
    log(INFO, "privkit: final %s", " | ".join(_line(label, summary[label])
                                              for label, _ in runs))
    out = str(rc.get("out-dir", ""))
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "flower-result.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
