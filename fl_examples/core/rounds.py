"""Round machinery shared by the synchronous trainers: who trains, for how long, and how
their models are combined and evaluated.

All draws come from a :class:`~fl_examples.core.seeds.SeedTree` keyed by the *data round*
(the k-th round that touches client data), so every algorithm in a comparison sees the same
client subsets and stragglers in its k-th data round.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from fl_examples.core.local import ClientData
from fl_examples.core.seeds import SeedTree
from privkit.errors import InvalidParameterError

__all__ = [
    "resolve_device",
    "to_client_data",
    "select",
    "sample_clients",
    "straggler_epochs",
    "independent_straggler_epochs",
    "client_uniforms",
    "client_orders",
    "aggregate",
    "evaluate",
    "evaluation_row",
    "broadcast",
]


def resolve_device(spec: str) -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda[:N]``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu" or spec.startswith("cuda"):
        if spec.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidParameterError("device", spec, "auto or cpu (no CUDA device is available)")
        return torch.device(spec)
    raise InvalidParameterError("device", spec, "one of auto, cpu, cuda[:N]")


def to_client_data(padded: Any, device: torch.device, dtype: torch.dtype) -> ClientData:
    """numpy :class:`~fl_examples.core.data.PaddedClients` -> torch ClientData on ``device``."""
    return ClientData(
        torch.as_tensor(padded.x, dtype=dtype, device=device),
        torch.as_tensor(padded.y, dtype=torch.long, device=device),
        torch.as_tensor(padded.mask, dtype=torch.bool, device=device),
        torch.as_tensor(padded.sizes, dtype=torch.long, device=device),
    )


def select(data: ClientData, idx: Tensor) -> ClientData:
    """The selected clients' rows, trimmed to their largest size (no host round trip of data)."""
    sizes = data.sizes[idx]
    n = int(sizes.max()) if sizes.numel() else 0
    return ClientData(data.x[idx, :n], data.y[idx, :n], data.mask[idx, :n], sizes)


def sample_clients(
    tree: SeedTree, data_round: int, num_clients: int, fraction: float
) -> np.ndarray:
    """max(int(fraction * N), 1) distinct clients, sorted (the authors' fixed-size sampler)."""
    k = max(int(fraction * num_clients), 1)
    rng = tree.numpy(data_round, "clients")
    return np.sort(rng.choice(num_clients, size=k, replace=False))


def straggler_epochs(tree: SeedTree, data_round: int, num_selected: int, straggler_fraction: float,
                     local_epochs: int) -> tuple[np.ndarray, np.ndarray]:
    """(epochs per selected client, straggler mask).

    round(straggler_fraction * k) of the k selected clients are stragglers; each runs
    int(U * E) epochs with U ~ Uniform(0, 1), redrawn until > 0 (the authors' rule), the others
    run E epochs.
    """
    rng = tree.numpy(data_round, "stragglers")
    n_strag = int(round(straggler_fraction * num_selected))
    strag = np.zeros(num_selected, dtype=bool)
    strag[rng.choice(num_selected, size=n_strag, replace=False)] = True
    epochs = np.full(num_selected, local_epochs, dtype=np.int64)
    for i in np.flatnonzero(strag):
        e = 0
        while e == 0:
            e = int(rng.uniform() * local_epochs) if local_epochs > 1 else 1
        epochs[i] = e
    return epochs, strag


def client_uniforms(tree: SeedTree, data_round: int, stream: str, clients: Any,
                    count: int) -> np.ndarray:
    """``(len(clients), count)`` uniforms in [0, 1), row i keyed by client ``clients[i]``'s id
    alone (:meth:`privkit.seeds.SeedTree.uniforms`): a client's draws never depend on who
    else is drawn for, or on the population size.

    Example:
        >>> t = SeedTree(0)
        >>> a = client_uniforms(t, 1, "x", [3], 2)
        >>> b = client_uniforms(t, 1, "x", [1, 3, 7], 2)
        >>> bool((a[0] == b[1]).all())
        True
    """
    return tree.uniforms(data_round, stream, clients, count)


def independent_straggler_epochs(tree: SeedTree, data_round: int, clients: np.ndarray,
                                 straggler_fraction: float, local_epochs: int
                                 ) -> tuple[np.ndarray, np.ndarray]:
    """(epochs per client in ``clients``, straggler mask), each client's drawn on its own.

    In every data round each client gets a straggler flag (probability ``straggler_fraction``)
    and a straggler's epoch count (uniform on 1 .. E-1, the law of :func:`straggler_epochs`'
    redraw rule; 1 when E = 1) from :func:`client_uniforms`: whether client j straggles, and
    how much it works, never depends on who else was sampled or on the population's size
    (under client-level DP, adding client i must not change client j's update). The expected
    share of stragglers is ``straggler_fraction`` (:func:`straggler_epochs` fixes their
    number at round(s K) of the K sampled instead).

    Example:
        >>> t = SeedTree(0)
        >>> a, _ = independent_straggler_epochs(t, 1, np.array([3]), 0.5, 20)
        >>> b, _ = independent_straggler_epochs(t, 1, np.array([1, 3, 7]), 0.5, 20)
        >>> int(a[0]) == int(b[1])
        True
    """
    sel = np.asarray(clients, dtype=np.int64)
    u = client_uniforms(tree, data_round, "stragglers-per-client", sel, 2)
    strag = u[:, 0] < straggler_fraction
    spare = 1 + np.floor(u[:, 1] * (local_epochs - 1)).astype(np.int64) \
        if local_epochs > 1 else np.ones(len(sel), dtype=np.int64)
    epochs = np.where(strag, spare, local_epochs).astype(np.int64)
    return epochs, strag


def client_orders(tree: SeedTree, data_round: int, clients: Any, sizes: Tensor,
                  epochs: Tensor, device: torch.device) -> Any:
    """Batch orders of ``clients`` in ``data_round``, each from its own stream
    ``batches/<client id>`` (the Flower clients' ``per-client`` order): a client's local
    training never depends on who else was sampled."""
    from fl_examples.core.local import client_batch_orders

    gens = [tree.torch(data_round, f"batches/{int(c)}", device) for c in clients]
    return client_batch_orders(sizes, epochs, gens)


def aggregate(stacked: dict[str, Tensor], weights: Tensor) -> dict[str, Tensor]:
    """sum_i w_i theta_i / sum_i w_i over the client axis (weights re-normalised here)."""
    w = weights.to(dtype=torch.float64)
    total = w.sum()
    if not bool(total > 0):
        raise InvalidParameterError("weights", weights.tolist(), "with a positive sum")
    w = (w / total)
    return {k: torch.tensordot(w.to(v.dtype), v, dims=([0], [0])) for k, v in stacked.items()}


def broadcast(params: dict[str, Tensor], k: int) -> dict[str, Tensor]:
    """Global parameters (no client axis) repeated for ``k`` clients (a copy)."""
    return {n: v.unsqueeze(0).expand(k, *v.shape).contiguous() for n, v in params.items()}


@torch.no_grad()
def evaluate(model: Any, params: dict[str, Tensor], data: ClientData, chunk: int = 64
             ) -> tuple[float, float]:
    """(mean loss, accuracy) of one global model over every real row of ``data``."""
    k = data.x.shape[0]
    loss_sum = torch.zeros((), dtype=torch.float64, device=data.x.device)
    correct = torch.zeros((), dtype=torch.float64, device=data.x.device)
    for s in range(0, k, chunk):
        x, y, m = data.x[s:s + chunk], data.y[s:s + chunk], data.mask[s:s + chunk]
        p = broadcast(params, x.shape[0])
        logits = model.forward(p, x)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        loss_sum += (ce * m).sum(dtype=torch.float64)
        correct += ((logits.argmax(-1) == y) & m).sum(dtype=torch.float64)
    n = float(data.sizes.sum())
    if n == 0:
        return float("nan"), float("nan")
    return float(loss_sum) / n, float(correct) / n


def evaluation_row(model: Any, params: dict[str, Tensor], *, heldout: ClientData | None,
                   train: ClientData, test: ClientData, evaluate_clients: bool
                   ) -> dict[str, float]:
    """A history row's metrics: on the public held-out set when there is one, and on the
    clients' training and test data only when ``evaluate_clients`` (a non-private run, or
    ``--eval-client-data``: those numbers are then listed as not covered by epsilon)."""
    row: dict[str, float] = {}
    if heldout is not None:
        row["heldout_loss"], row["heldout_accuracy"] = evaluate(model, params, heldout)
    if evaluate_clients:
        row["train_loss"], row["train_accuracy"] = evaluate(model, params, train)
        _, row["test_accuracy"] = evaluate(model, params, test)
    return row

