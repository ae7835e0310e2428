"""ServerApp of the example: the run config becomes an UpcycledFedProx / PrivkitFedProx run.

With ``privacy`` set, every client sent work is charged on a privkit ledger
(``OUT/ledger.jsonl`` with ``out-dir``, else in memory) and the round metrics carry each
client's epsilon. With ``out-dir``, ``OUT/flower-result.json`` holds the per-round metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context

from fl_examples.flower import (
    PrivacySettings,
    PrivkitFedProx,
    UpcycledFedProx,
    initial_arrays,
    load_federated,
    make_server_app,
)
from fl_examples.flower.client import make_model
from privkit.errors import InvalidParameterError
from privkit.ledger import Ledger


def _ledger(rc: Any) -> Ledger:
    population = f"{rc['dataset']}|clients={rc['num-clients']}|seed={rc['seed']}|flower"
    budget = float(rc["epsilon-budget"]) or None
    out = str(rc["out-dir"])
    if not out:
        return Ledger.create(None, population_id=population, delta=float(rc["delta"]),
                             epsilon_budget=budget)
    path = Path(out) / "ledger.jsonl"
    if path.exists():  # a ledger never resets: a rerun keeps charging the same clients
        ledger = Ledger.open(path)
        if ledger.population_id != population:
            raise InvalidParameterError("out-dir", out, f"a directory whose ledger belongs to "
                                        f"this population (it holds {ledger.population_id!r})")
        return ledger
    path.parent.mkdir(parents=True, exist_ok=True)
    return Ledger.create(path, population_id=population, delta=float(rc["delta"]),
                         epsilon_budget=budget)


def strategy_from_config(context: Context) -> PrivkitFedProx:
    """The strategy the run config describes."""
    rc = context.run_config
    kind = str(rc["privacy"])
    if kind not in ("none", "output", "objective", "rec"):
        raise InvalidParameterError("privacy", kind, "none, output, objective or rec")
    private: dict[str, Any] = {}
    if kind != "none":
        settings = PrivacySettings(
            kind, l2_clip_norm=float(rc["l2-clip-norm"]), stddev=float(rc["stddev"]),
            sensitivity=str(rc["sensitivity"]), clip=str(rc["clip"]), alpha=float(rc["alpha"]),
            allow_unproven=bool(rc["allow-unproven"]), glm=rc["model"] == "logreg",
            bits=int(rc["rec-bits"]), groups=str(rc["rec-groups"]))
        private = {"privacy": settings, "ledger": _ledger(rc), "train_action": kind}
    common: dict[str, Any] = dict(
        proximal_mu=float(rc["mu"]), fraction_train=float(rc["fraction"]),
        stragglers=float(rc["stragglers"]), local_epochs=int(rc["local-epochs"]),
        batch_size=int(rc["batch-size"]), lr=float(rc["lr"]), momentum=float(rc["momentum"]),
        seed=int(rc["seed"]), fraction_evaluate=float(rc["fraction-evaluate"]),
        batch_order=str(rc["batch-order"]), **private)
    n = int(rc["num-clients"])
    if rc["algorithm"] == "upcycled":
        return UpcycledFedProx(n, lam=float(rc["lam"]), **common)
    if rc["algorithm"] == "fedprox":
        return PrivkitFedProx(n, **common)
    raise InvalidParameterError("algorithm", rc["algorithm"], "upcycled or fedprox")


def initial_from_config(context: Context) -> ArrayRecord:
    """The initial model (the server reads the data set only for its shape)."""
    rc = context.run_config
    ds = load_federated(str(rc["dataset"]), int(rc["seed"]), int(rc["num-clients"]))
    return initial_arrays(make_model(str(rc["model"]), ds), int(rc["seed"]))


app = make_server_app(strategy_from_config, initial_from_config)
