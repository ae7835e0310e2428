"""Server side helpers: the initial model, central evaluation, a ServerApp around a strategy.

The initial model is drawn exactly as privkit's batched trainers draw it (stream ``init`` of
round 0 of the seed tree, on the CPU), so a Flower run and a simulator run with the same seed
start from the same parameters.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from fl_examples.core.data import FederatedDataset
from fl_examples.core.rounds import evaluate, to_client_data
from fl_examples.core.seeds import SeedTree
from fl_examples.flower.strategy import PrivkitFedProx
from privkit.errors import InvalidParameterError
from privkit.flower import records as keys

__all__ = ["central_evaluate_fn", "initial_arrays", "make_server_app", "result_summary"]


def initial_arrays(model: Any, seed: int) -> ArrayRecord:
    """The global model before round 1 (same draw as ``fl_examples.upcycled``)."""
    init = model.init(1, generator=SeedTree(seed).torch(0, "init", "cpu"), device="cpu")
    return keys.to_record({k: v[0] for k, v in init.items()})


def central_evaluate_fn(model: Any, ds: FederatedDataset
                        ) -> Callable[[int, ArrayRecord], MetricRecord]:
    """``evaluate_fn`` for ``Strategy.start``: the global model on the held-out set the server
    holds.

    The held-out set (:attr:`~fl_examples.core.dataset.FederatedDataset.x_heldout`) is public
    data that no client holds (for digits, the rows held back from every client's share), so
    evaluation needs no message to any client and releases nothing computed on client data.
    The metrics are ``loss``, ``accuracy`` and ``num-examples``.
    """
    if not ds.has_heldout:
        raise InvalidParameterError("ds", ds.description.get("recipe"), "a data set with a "
                                    "public held-out set for the server to evaluate on")
    data = to_client_data(ds.heldout_padded(), torch.device("cpu"), torch.float32)
    n = int(data.sizes.sum())

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loss, acc = evaluate(model, keys.to_torch(arrays), data)
        return MetricRecord({"loss": loss, "accuracy": acc, keys.NUM_EXAMPLES: n})

    return evaluate_fn


def result_summary(result: Result, strategy: PrivkitFedProx) -> dict[str, Any]:
    """JSON-able summary of a run: per-round metrics and, if private, the privacy report."""
    def plain(records: dict[int, Any]) -> dict[str, Any]:
        return {str(r): dict(m) for r, m in sorted(records.items())}

    out: dict[str, Any] = {
        "train_metrics": plain(result.train_metrics_clientapp),
        "evaluate_metrics": plain(result.evaluate_metrics_clientapp),
        "evaluate_metrics_server": plain(result.evaluate_metrics_serverapp),
        "sizes": list(strategy.sizes),
    }
    if strategy.accountant is not None and strategy.accountant.bound:
        out["privacy"] = strategy.accountant.report()
    if strategy.stopped is not None:
        out["stopped"] = strategy.stopped
    return out


def make_server_app(make_strategy: Callable[[Context], PrivkitFedProx],
                    make_initial: Callable[[Context], ArrayRecord], num_rounds: int | None = None,
                    *, on_result: Callable[[Result, PrivkitFedProx], None] | None = None,
                    out_dir: str | Path | None = None, timeout: float = 3600.0) -> ServerApp:
    """A ServerApp that runs ``make_strategy(context)`` for ``num_rounds`` rounds.

    ``num_rounds`` defaults to the run config's ``num-rounds``. ``on_result(result, strategy)``
    receives the Flower :class:`~flwr.serverapp.strategy.Result` (final arrays, per-round
    metrics); with ``out_dir`` (or the run config's ``out-dir``) the summary goes to
    ``OUT/flower-result.json``.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = make_strategy(context)
        rounds = int(num_rounds if num_rounds is not None else context.run_config["num-rounds"])
        result = strategy.start(grid=grid, initial_arrays=make_initial(context),
                                num_rounds=rounds, timeout=timeout, train_config=ConfigRecord(),
                                evaluate_config=ConfigRecord())
        if on_result is not None:
            on_result(result, strategy)
        out = out_dir if out_dir is not None else context.run_config.get("out-dir", "")
        if out:
            path = Path(str(out))
            path.mkdir(parents=True, exist_ok=True)
            (path / "flower-result.json").write_text(
                json.dumps(result_summary(result, strategy), indent=2, sort_keys=True))

    return app
