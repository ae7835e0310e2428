"""Round machinery shared by the synchronous trainers: who trains, for how long, and how
their models are combined and evaluated.

All draws come from a :class:`~fl_examples.core.seeds.SeedTree` keyed by the *data round*
(the k-th round that touches client data), so every algorithm in a comparison sees the same
client subsets and stragglers in its k-th data round.
"""

from __future__ import annotations

import math
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
    "order_words",
    "poisson_sample",
    "POISSON_BLOCK",
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
    if straggler_fraction <= 0:  # nobody straggles: no draw needed (the same epochs)
        return np.full(len(sel), local_epochs, dtype=np.int64), np.zeros(len(sel), dtype=bool)
    u = client_uniforms(tree, data_round, "stragglers-per-client", sel, 2)
    strag = u[:, 0] < straggler_fraction
    spare = 1 + np.floor(u[:, 1] * (local_epochs - 1)).astype(np.int64) \
        if local_epochs > 1 else np.ones(len(sel), dtype=np.int64)
    epochs = np.where(strag, spare, local_epochs).astype(np.int64)
    return epochs, strag


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, in place on uint64 words (wrapping arithmetic: unsigned
    integer overflow is not reported by numpy's array operations)."""
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def _counter_words(tree: SeedTree, data_round: int, stream: str, ids: Any, rows: np.ndarray,
                   positions: np.ndarray) -> np.ndarray:
    """``m(m(ids[rows] ^ k0) ^ m(k1 + positions G))``, ``k0, k1`` from the seed tree's
    ``stream`` of ``data_round`` and ``m`` SplitMix64 (:func:`order_words`)."""
    k0, k1 = tree.sequence(data_round, stream).generate_state(2, np.uint64)
    ids = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    positions = np.asarray(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):  # scalar uint64 arithmetic warns on wrapping
        per_id = _mix((ids ^ k0) + _GOLDEN)
        top = int(positions.max()) + 1 if positions.size else 0
        per_position = _mix(np.arange(top, dtype=np.uint64) * _GOLDEN + (k1 + _GOLDEN))
        z = per_position[positions]
        z ^= per_id[rows]
        z += _GOLDEN
        return _mix(z)


#: Clients per block of :func:`poisson_sample` (a constant: the sample of a block never
#: depends on the population's size).
POISSON_BLOCK = 1 << 16


def poisson_sample(tree: SeedTree, data_round: int, num_clients: int, rate: float,
                   stream: str = "poisson-blocks") -> np.ndarray:
    """Poisson sampling: each of the clients ``0 .. num_clients - 1`` independently with
    probability ``rate``, sorted; in time proportional to the sample (plus one small draw per
    :data:`POISSON_BLOCK` clients), not to the population.

    The ids are cut into blocks of :data:`POISSON_BLOCK`; in block b the sampled offsets are
    ``p_1 = G_1``, ``p_{k+1} = p_k + 1 + G_{k+1}``, with i.i.d. geometric gaps ``G_k =
    floor(log U_k / log(1 - rate))`` (failures before a success; ``U_k`` in (0, 1] from the
    counter-based words of (seed, round, b, k), :func:`order_words`' construction): a
    Bernoulli process, so every client is in independently with probability ``rate``,
    exactly as a coin per client. Whether client c is in depends on the seed, the round and
    c's block's gaps alone: never on the population's size or on who else exists (adding a
    client never moves another, the coupling add/remove DP needs).

    Example:
        >>> t = SeedTree(0)
        >>> a = poisson_sample(t, 1, 1000, 0.1)
        >>> b = poisson_sample(t, 1, 1001, 0.1)  # one more client: nobody else moves
        >>> bool(np.array_equal(a, b[b < 1000])), 60 < a.size < 140
        (True, True)
    """
    n = int(num_clients)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    if rate >= 1:
        return np.arange(n, dtype=np.int64)
    if rate <= 0:
        return np.zeros(0, dtype=np.int64)
    log_keep = math.log1p(-rate)
    blocks = np.arange(-(-n // POISSON_BLOCK), dtype=np.int64)
    span = np.minimum(POISSON_BLOCK, n - blocks * POISSON_BLOCK)  # ids of each block, < n
    out: list[np.ndarray] = []
    start = np.zeros(blocks.size, dtype=np.int64)  # the next gap's position in each block
    drawn = 0  # gaps drawn per block so far
    todo = np.arange(blocks.size)
    while todo.size:
        expect = rate * float(span[todo].max())
        m = int(expect + 8 * math.sqrt(expect) + 16)
        rows = np.repeat(np.arange(todo.size), m)
        k = np.tile(np.arange(drawn, drawn + m, dtype=np.uint64), todo.size)
        w = _counter_words(tree, data_round, stream, blocks[todo], rows, k)
        u = ((w >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53  # in (0, 1]
        gaps = np.floor(np.log(u) / log_keep).reshape(todo.size, m)
        pos = start[todo][:, None] + np.cumsum(gaps + 1.0, axis=1) - 1.0  # offsets sampled
        inside = pos < span[todo][:, None]
        out.append((blocks[todo][:, None] * POISSON_BLOCK + pos.astype(np.int64))[inside])
        start[todo] = pos[:, -1].astype(np.int64) + 1
        drawn += m
        todo = todo[inside[:, -1]]  # blocks whose last gap stayed inside: draw further
    return np.sort(np.concatenate(out))


def order_words(tree: SeedTree, data_round: int, clients: Any, rows: np.ndarray,
                positions: np.ndarray, attempt: int = 0) -> np.ndarray:
    """The 64-bit words behind the batch orders of :func:`client_orders`: for each element,
    client ``clients[rows[j]]``'s word at position ``positions[j]`` (uint64, the shape of
    ``rows``) in ``data_round``.

    Counter-based, as :meth:`privkit.seeds.SeedTree.uniforms`: with ``k0, k1`` from the seed
    tree's stream ``batch-orders/<attempt>`` of the round, a client with id ``c`` has the
    word ``m(m(c ^ k0) ^ m(k1 + p G))`` at position ``p``, ``m`` SplitMix64 (``G`` its
    increment). A word depends on the seed, the round, the client's id, ``p`` and
    ``attempt`` alone: never on who else is drawn for or how many.

    Example:
        >>> t = SeedTree(0)
        >>> pos = np.arange(4, dtype=np.uint64)
        >>> a = order_words(t, 1, [3], np.zeros(4, dtype=np.int64), pos)
        >>> b = order_words(t, 1, [1, 3, 7], np.ones(4, dtype=np.int64), pos)
        >>> bool((a == b).all())
        True
    """
    return _counter_words(tree, data_round, f"batch-orders/{int(attempt)}", clients, rows,
                          positions)


def client_orders(tree: SeedTree, data_round: int, clients: Any, sizes: Tensor,
                  epochs: Tensor, device: torch.device) -> Any:
    """Batch orders of ``clients`` in ``data_round``: client c's epoch-e permutation sorts
    its own counter-based words (:func:`order_words`, keyed by the seed, the round and c's
    id), so a client's local training never depends on who else was sampled.

    One vectorised hash over every sampled client's positions and one argsort per bucket of
    similar sizes (:func:`~fl_examples.core.local.keyed_batch_orders`, exact: uniform
    permutations, a client whose keys tie is drawn again), without a generator per client.

    Example:
        >>> t = SeedTree(0)
        >>> one = client_orders(t, 1, [7], torch.tensor([4]), torch.tensor([2]), "cpu")
        >>> three = client_orders(t, 1, [2, 7, 9], torch.tensor([3, 4, 5]),
        ...                       torch.tensor([1, 2, 1]), "cpu")
        >>> three.order[3:11].tolist() == one.order.tolist()
        True
    """
    from fl_examples.core.local import keyed_batch_orders

    ids = np.asarray(clients, dtype=np.int64).reshape(-1)
    if ids.size != sizes.numel():
        raise InvalidParameterError("clients", ids.size, f"one per size ({sizes.numel()})")
    order = keyed_batch_orders(
        sizes.cpu(), epochs.cpu(),
        lambda rows, pos, attempt: order_words(tree, data_round, ids, rows, pos, attempt))
    dev = torch.device(device)
    if dev.type == "cpu":
        return order
    return type(order)(order.order.to(dev), order.offsets.to(dev))


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

