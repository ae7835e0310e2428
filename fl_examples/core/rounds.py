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
    "aggregate",
    "evaluate",
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

