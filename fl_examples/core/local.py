"""Local solver of FedProx / Upcycled-FL odd rounds, batched over clients.

Each client i approximately solves (spec ``upcycled_fl.md`` sections 1-2)

    min_w  F_i(w; D_i) + (mu / 2) ||w - w_bar||^2

with minibatch SGD and heavy-ball momentum in PyTorch's convention (``torch.optim.SGD``,
dampening 0): ``buf <- momentum * buf + (grad F_i(w; batch) + mu (w - w_bar))``,
``w <- w - lr * buf``, the buffer starting at zero for every local solve. Each of the client's
``epochs[i]`` epochs visits its own ``n_i`` samples in a fresh random order, in minibatches of
``batch_size`` (the last one smaller when ``batch_size`` does not divide ``n_i``); the gradient
is the mean over the minibatch's rows. Stragglers simply have fewer epochs (0 means no work).

:func:`local_sgd` runs all K clients together: parameters live in one ``(K, d)`` matrix, one
Python iteration is one SGD step of every client still working, and a client's minibatch is
gathered from a precomputed batch order. Clients are sorted by their number of steps so that the
still-working ones are always a prefix and finished ones cost nothing. There is no Python loop
over clients and no autograd; gradients are the model's closed forms
(:mod:`fl_examples.core.models`). :func:`local_sgd_reference` is the per-client loop with
``torch.optim.SGD`` and autograd that the batched path is tested against; both draw the batch
order with :func:`batch_orders`, so one seed gives both the same minibatches.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fl_examples.core.models import BatchedModel, unflatten
from privkit.errors import InvalidParameterError

__all__ = [
    "ClientData",
    "BatchOrder",
    "pad_clients",
    "batch_orders",
    "client_batch_orders",
    "keyed_batch_orders",
    "local_sgd",
    "local_sgd_reference",
]

Params = dict[str, Tensor]

# Elements of the largest chunk tensor (minibatch features of T steps x K clients).
_CHUNK_ELEMENTS = 1 << 22


class ClientData(NamedTuple):
    """K clients' data stacked with padding. Client i's samples are rows ``0..n_i-1``.

    Attributes:
        x: ``(K, N, F)`` floating features, N = max_i n_i (or more).
        y: ``(K, N)`` integer labels in ``[0, num_classes)`` on real rows.
        mask: ``(K, N)`` bool, true exactly on the first ``sizes[i]`` rows of client i.
        sizes: ``(K,)`` integer n_i.
    """

    x: Tensor
    y: Tensor
    mask: Tensor
    sizes: Tensor


class BatchOrder(NamedTuple):
    """Every client's sample order for every epoch of one local solve.

    Attributes:
        order: Flat int64 tensor of length ``sum_i epochs[i] * sizes[i]``. Client i's block
            starts at ``offsets[i]``; epoch e of client i is the permutation of ``0..n_i-1`` at
            ``order[offsets[i] + e * n_i : offsets[i] + (e + 1) * n_i]``.
        offsets: ``(K,)`` int64 start of each client's block.
    """

    order: Tensor
    offsets: Tensor

    def permutation(self, client: int, epoch: int, size: int) -> Tensor:
        """The order in which ``client`` visits its ``size`` samples in ``epoch``."""
        start = int(self.offsets[client]) + epoch * size
        return self.order[start : start + size]


def pad_clients(
    xs: Sequence[Any],
    ys: Sequence[Any],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> ClientData:
    """Stack per-client arrays ``(n_i, F)`` and ``(n_i,)`` into a padded :class:`ClientData`.

    Example:
        >>> d = pad_clients([np.zeros((3, 2)), np.ones((1, 2))], [np.zeros(3), np.ones(1)])
        >>> d.x.shape, d.sizes.tolist(), d.mask[1].tolist()
        (torch.Size([2, 3, 2]), [3, 1], [True, False, False])
    """
    if len(xs) != len(ys) or len(xs) == 0:
        raise InvalidParameterError("ys", len(ys), f"one label array per client ({len(xs)})")
    xt = [torch.as_tensor(np.asarray(x), dtype=dtype) for x in xs]
    yt = [torch.as_tensor(np.asarray(y)).long() for y in ys]
    for i, (x, y) in enumerate(zip(xt, yt)):
        if x.dim() != 2 or y.shape != (x.shape[0],):
            raise InvalidParameterError(f"xs[{i}]", tuple(x.shape), "(n_i, F) with (n_i,) labels")
    n = max(x.shape[0] for x in xt)
    k, f = len(xt), xt[0].shape[1]
    x = torch.zeros(k, n, f, dtype=dtype)
    y = torch.zeros(k, n, dtype=torch.long)
    sizes = torch.tensor([t.shape[0] for t in xt], dtype=torch.long)
    for i in range(k):
        x[i, : sizes[i]] = xt[i]
        y[i, : sizes[i]] = yt[i]
    mask = torch.arange(n) < sizes[:, None]
    return ClientData(x.to(device), y.to(device), mask.to(device), sizes.to(device))


def batch_orders(sizes: Tensor, epochs: Tensor, *, generator: torch.Generator) -> BatchOrder:
    """Draw a uniform random permutation per (client, epoch), all in one sort.

    Key ``segment + U`` (U uniform in [0, 1), float64) sorted once puts every (client, epoch)
    segment in its own range, ordered by U within the segment. Runs on the tensors' device
    (``generator`` must live there); the K sizes and epochs are read to the host once.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> o = batch_orders(torch.tensor([3, 2]), torch.tensor([2, 1]), generator=g)
        >>> sorted(o.permutation(0, 1, 3).tolist()), o.offsets.tolist()
        ([0, 1, 2], [0, 6])
    """
    for name, t in (("sizes", sizes), ("epochs", epochs)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype.is_floating_point:
            got = (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else t
            raise InvalidParameterError(name, got, "a 1-D integer tensor")
    if epochs.shape != sizes.shape:
        raise InvalidParameterError("epochs", tuple(epochs.shape), f"of shape {tuple(sizes.shape)}")
    sizes, epochs = sizes.long(), epochs.to(sizes.device).long()
    host = torch.cat([sizes, epochs]).tolist()
    k = sizes.numel()
    for name, vals in (("sizes", host[:k]), ("epochs", host[k:])):
        if any(v < 0 for v in vals):
            raise InvalidParameterError(name, min(vals), "integers >= 0 in every entry")
    return _draw_orders(sizes, epochs, host[:k], host[k:], generator)


def client_batch_orders(
    sizes: Tensor, epochs: Tensor, generators: Sequence[torch.Generator]
) -> BatchOrder:
    """Like :func:`batch_orders`, but client i's orders come from ``generators[i]`` alone.

    Client i's block is exactly ``batch_orders([n_i], [e_i], generator=generators[i])``: it
    does not depend on which other clients are in the call, their sizes or their epochs
    (client-level DP needs that: adding one client must not change another's update). One
    small draw per client, then one sort for all.

    Example:
        >>> gs = [torch.Generator().manual_seed(s) for s in (1, 2)]
        >>> both = client_batch_orders(torch.tensor([3, 2]), torch.tensor([1, 2]), gs)
        >>> alone = batch_orders(torch.tensor([2]), torch.tensor([2]),
        ...                      generator=torch.Generator().manual_seed(2))
        >>> both.order[3:].tolist() == alone.order.tolist()
        True
    """
    sizes, epochs = sizes.long(), epochs.to(sizes.device).long()
    host = torch.cat([sizes, epochs]).tolist()
    k = sizes.numel()
    if len(generators) != k:
        raise InvalidParameterError("generators", len(generators), f"one per client ({k})")
    sizes_h, epochs_h = host[:k], host[k:]
    for name, vals in (("sizes", sizes_h), ("epochs", epochs_h)):
        if any(v < 0 for v in vals):
            raise InvalidParameterError(name, min(vals), "integers >= 0 in every entry")
    dev = sizes.device
    parts = [torch.rand(n * e, generator=g, device=dev, dtype=torch.float64)
             for n, e, g in zip(sizes_h, epochs_h, generators)]
    u = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=dev)
    return _orders_from(sizes, epochs, sizes_h, epochs_h, u)


#: Bits of a sort key that hold the sample's index within its segment (the rest: the key).
_COL_BITS = 20
#: Bits of a segment's random key in a sort key; a padding key, ``1 << _KEY_BITS``, sorts last.
_KEY_BITS = 42
_MAX_ATTEMPTS = 64


def keyed_batch_orders(
    sizes: Tensor,
    epochs: Tensor,
    words: Callable[[np.ndarray, np.ndarray, int], np.ndarray],
) -> BatchOrder:
    """Batch orders from counter-based keys: client i's epoch-e permutation sorts its keys
    ``words(client, positions, attempt)`` at positions ``e n_i .. e n_i + n_i - 1`` of its
    block (uint64 words, of which the top :data:`_KEY_BITS` are compared; all 62 top bits for
    an epoch of more than 2^20 samples).

    ``words(rows, positions, attempt)`` gets client indices ``rows`` and positions (uint64)
    of one shape and returns the words of those clients at those positions; a word must
    depend only on the client (its identity, not its index among the others), the position
    and ``attempt``. Then client i's block is a function of its own words alone: it never
    depends on which other clients are in the call.

    Exact: the argsort of distinct i.i.d. uniform keys is a uniform random permutation, and a
    client any of whose epochs holds two equal keys (probability about n^2 / 2^43) is drawn
    again with ``attempt + 1`` (all of its epochs), so its orders are uniform permutations,
    independent across epochs, conditioned on nothing. The words are computed once per real
    position; the sort is one in-place ``sort`` per bucket of segments of similar length, on
    the host (:func:`_sort_segments`).

    Example:
        >>> def words(rows, pos, attempt):  # client i's keys: its positions, reversed
        ...     return (np.uint64(1 << 40) - pos) << np.uint64(22)
        >>> o = keyed_batch_orders(torch.tensor([3, 2]), torch.tensor([1, 2]), words)
        >>> o.order.tolist(), o.offsets.tolist()
        ([2, 1, 0, 1, 0, 1, 0], [0, 3])
    """
    sizes, epochs = sizes.long(), epochs.to(sizes.device).long()
    host = torch.cat([sizes, epochs]).tolist()
    k = sizes.numel()
    n_h = np.asarray(host[:k], dtype=np.int64)
    e_h = np.asarray(host[k:], dtype=np.int64)
    for name, vals in (("sizes", n_h), ("epochs", e_h)):
        if vals.size and vals.min() < 0:
            raise InvalidParameterError(name, int(vals.min()), "integers >= 0 in every entry")
    counts = n_h * e_h
    offsets = np.cumsum(counts) - counts
    seg_client = np.repeat(np.arange(k), e_h)  # segments: (client, epoch), client-major
    seg_n = n_h[seg_client]
    words64 = np.empty(int(counts.sum()), dtype=np.uint64)  # every real position's word
    out = np.empty(words64.size, dtype=np.int64)
    segs, clients = np.arange(seg_client.size), np.arange(k)
    for attempt in range(_MAX_ATTEMPTS):
        if attempt == 0:  # every client: the flat positions in order
            rows = np.repeat(clients, counts)
            pos = np.arange(words64.size) - np.repeat(offsets, counts)
            words64[:] = words(rows, pos.view(np.uint64), attempt)
        else:
            at = _ranges(offsets[clients], counts[clients])
            rows = np.repeat(clients, counts[clients])
            words64[at] = words(rows, (at - offsets[rows]).view(np.uint64), attempt)
        tied = _sort_segments(out, segs, seg_n, words64, ties=True)
        if not tied.size:
            dev = sizes.device
            return BatchOrder(torch.from_numpy(out).to(dev), torch.as_tensor(offsets, device=dev))
        clients = np.unique(seg_client[tied])  # a tie anywhere: the client's whole draw again
        segs = np.flatnonzero(np.isin(seg_client, clients))
    raise AssertionError("keys kept tying: the words are not random")  # pragma: no cover


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, s + n)`` over (starts, lengths)."""
    total = int(lengths.sum())
    return np.arange(total) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)


def _sort_segments(out: np.ndarray, segs: np.ndarray, seg_n: np.ndarray, words: np.ndarray,
                   ties: bool = False) -> np.ndarray:
    """Write into ``out`` the permutation that sorts each segment's words (segments lie one
    after the other: segment s holds ``words[start_s : start_s + seg_n[s]]`` and gets
    ``out[start_s : start_s + seg_n[s]]``), for the segments ``segs`` (ascending).

    A sort key is a word's top :data:`_KEY_BITS` bits above its index in the segment, so one
    in-place ``sort`` per bucket of segments (padded to widths by powers of two, at most
    twice the work; one bucket when padding costs little) gives each permutation; equal keys
    come out in index order. A segment of more than ``2**_COL_BITS`` samples is argsorted
    alone on its top 62 bits. With ``ties``, returns the segments in which two compared keys
    are equal (else an empty array)."""
    tied: list[np.ndarray] = []
    seg_start = np.cumsum(seg_n) - seg_n
    n = seg_n[segs]
    big = n > 1 << _COL_BITS
    for s in segs[big].tolist():
        a, b = int(seg_start[s]), int(seg_start[s] + seg_n[s])
        key = (words[a:b] >> np.uint64(2)).astype(np.int64)
        perm = np.argsort(key, kind="stable")
        out[a:b] = perm
        if ties and bool((key[perm][1:] == key[perm][:-1]).any()):
            tied.append(np.array([s]))
    segs, n = segs[~big], n[~big]
    if segs.size:
        width = np.left_shift(1, np.ceil(np.log2(np.maximum(n, 1))).astype(np.int64))
        top = int(width.max())
        if top * segs.size <= 2 * int(n.sum()) + 4096:  # little padding: one sort does
            width[:] = top
        whole = segs.size == seg_n.size  # every segment, in order: flat positions in order
        shift = np.uint64(64 - _KEY_BITS)
        for w in np.unique(width).tolist():
            pick = width == w
            sel = segs[pick]
            col = np.arange(w)
            real = col < n[pick][:, None]
            src: Any = slice(None) if whole and bool(pick.all()) else _ranges(
                seg_start[sel], seg_n[sel])
            # padding keys above every real one, and distinct: only real keys can tie
            key = np.repeat(((1 << _KEY_BITS) + col)[None, :], sel.size, axis=0)
            key[real] = (words[src] >> shift).view(np.int64)
            key <<= _COL_BITS
            key |= col
            key.sort(axis=1)
            if ties and w > 1:
                high = key >> _COL_BITS
                tied.append(sel[(high[:, 1:] == high[:, :-1]).any(axis=1)])
            key &= (1 << _COL_BITS) - 1
            out[src] = key[real]
    return np.concatenate(tied) if tied else np.zeros(0, dtype=np.int64)


def _draw_orders(
    sizes: Tensor,
    epochs: Tensor,
    sizes_h: list[int],
    epochs_h: list[int],
    generator: torch.Generator,
) -> BatchOrder:
    """:func:`batch_orders` with the host copies already known (no device synchronisation)."""
    dev = sizes.device
    if generator.device.type != dev.type:
        raise InvalidParameterError("generator", generator.device, f"a generator on {dev}")
    total = sum(n * e for n, e in zip(sizes_h, epochs_h))
    u = torch.rand(total, generator=generator, device=dev, dtype=torch.float64) if total \
        else torch.zeros(0, dtype=torch.float64, device=dev)
    return _orders_from(sizes, epochs, sizes_h, epochs_h, u)


def _orders_from(
    sizes: Tensor, epochs: Tensor, sizes_h: list[int], epochs_h: list[int], u: Tensor
) -> BatchOrder:
    """The permutations that sort ``u`` within every (client, epoch) segment."""
    dev = sizes.device
    counts = sizes * epochs
    offsets = torch.cumsum(counts, 0) - counts
    total = sum(n * e for n, e in zip(sizes_h, epochs_h))
    if total == 0:
        return BatchOrder(torch.zeros(0, dtype=torch.long, device=dev), offsets)
    if dev.type == "cpu":  # one sort per bucket of segment lengths (keyed_batch_orders')
        seg_n = np.repeat(np.asarray(sizes_h, dtype=np.int64), np.asarray(epochs_h))
        # u < 1 in float64: u 2^64 is exact and below 2^64, its top bits u's leading ones
        words = (u.numpy() * 2.0**64).astype(np.uint64)
        out = np.empty(total, dtype=np.int64)
        _sort_segments(out, np.arange(seg_n.size), seg_n, words)
        return BatchOrder(torch.from_numpy(out), offsets)
    seg_len = sizes.repeat_interleave(epochs, output_size=sum(epochs_h))  # per (client, epoch)
    seg_id = torch.repeat_interleave(
        torch.arange(seg_len.numel(), device=dev), seg_len, output_size=total
    )
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    pos = torch.argsort(seg_id.to(torch.float64) + u)  # keys distinct with probability ~1
    return BatchOrder(pos - seg_start[seg_id], offsets)


# --------------------------------------------------------------------------- validation


def _finite(name: str, value: Any, low: float, high: float = math.inf, *, open_low: bool) -> float:
    req = f"finite and {'>' if open_low else '>='} {low:g}" + (
        f" and < {high:g}" if high < math.inf else ""
    )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(name, value, req)
    x = float(value)
    ok = math.isfinite(x) and (x > low if open_low else x >= low) and x < high
    if not ok:
        raise InvalidParameterError(name, value, req)
    return x


def _check_shape(name: str, t: Any, shape: tuple[int, ...]) -> None:
    if not isinstance(t, Tensor) or tuple(t.shape) != shape:
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise InvalidParameterError(name, got, f"a tensor of shape {shape}")


class _Plan(NamedTuple):
    theta: Tensor
    wbar: Tensor
    data: ClientData
    epochs: Tensor
    sizes_h: list[int]
    epochs_h: list[int]


def _validate(
    model: BatchedModel,
    params: Mapping[str, Tensor],
    w_bar: Mapping[str, Tensor],
    data: Sequence[Tensor],
    epochs: Any,
    batch_size: Any,
    lr: Any,
    momentum: Any,
    proximal_mu: Any,
) -> _Plan:
    """Check every argument; read the K sizes and epochs to the host (one transfer)."""
    got: Any  # what an error message shows
    _finite("lr", lr, 0.0, open_low=True)
    _finite("momentum", momentum, 0.0, 1.0, open_low=False)
    _finite("proximal_mu", proximal_mu, 0.0, open_low=False)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidParameterError("batch_size", batch_size, "an integer >= 1")
    if not isinstance(data, Sequence) or len(data) != 4:
        raise InvalidParameterError("data", type(data).__name__, "(x, y, mask, sizes)")
    x, y, mask, sizes = data
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[2] != model.num_features:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise InvalidParameterError("x", got, f"a (K, N, {model.num_features}) tensor")
    if not x.dtype.is_floating_point:
        raise InvalidParameterError("x", x.dtype, "a floating-point tensor")
    k, n = x.shape[0], x.shape[1]
    dev = x.device
    _check_shape("y", y, (k, n))
    _check_shape("mask", mask, (k, n))
    _check_shape("sizes", sizes, (k,))
    if y.dtype.is_floating_point or y.dtype == torch.bool:
        raise InvalidParameterError("y", y.dtype, "an integer tensor")
    if sizes.dtype.is_floating_point or sizes.dtype == torch.bool:
        raise InvalidParameterError("sizes", sizes.dtype, "an integer tensor")
    if isinstance(epochs, int) and not isinstance(epochs, bool):
        epochs = torch.full((k,), epochs, dtype=torch.long, device=dev)
    _check_shape("epochs", epochs, (k,))
    if epochs.dtype.is_floating_point or epochs.dtype == torch.bool:
        raise InvalidParameterError("epochs", epochs.dtype, "an integer tensor")
    shapes = model.parameter_shapes()
    flat: dict[str, list[Tensor]] = {"params": [], "w_bar": []}
    for label, p in (("params", params), ("w_bar", w_bar)):
        if not isinstance(p, Mapping) or list(p) != list(shapes):
            got = list(p) if isinstance(p, Mapping) else type(p).__name__
            raise InvalidParameterError(label, got, f"a dict with keys {list(shapes)}")
        for name, shape in shapes.items():
            t = p[name]
            ok = isinstance(t, Tensor) and t.dtype == x.dtype and t.device == dev
            if label == "params":
                ok = ok and tuple(t.shape) == (k, *shape)
            else:
                ok = ok and tuple(t.shape) in ((k, *shape), (1, *shape), shape)
            if not ok:
                got = (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, Tensor) else t
                raise InvalidParameterError(
                    f"{label}[{name!r}]", got, f"a {x.dtype} tensor on {dev} of shape (K, *{shape})"
                )
            rows = k if tuple(t.shape) == (k, *shape) else 1
            flat[label].append(t.detach().reshape(rows, math.prod(shape)))
    theta = torch.cat(flat["params"], 1)
    wbar = torch.cat([t.expand(k, -1) for t in flat["w_bar"]], 1)
    sizes_d, epochs_d = sizes.to(dev).long(), epochs.to(dev).long()
    real = torch.arange(n, device=dev) < sizes_d[:, None]
    bad_label = mask.bool() & ((y < 0) | (y >= model.num_classes))
    flags = torch.stack([(mask.bool() != real).any(), bad_label.any()]).long()
    host = torch.cat([sizes_d, epochs_d, flags]).tolist()  # the one host transfer
    sizes_h, epochs_h = host[:k], host[k : 2 * k]
    for name, vals, hi in (("sizes", sizes_h, n), ("epochs", epochs_h, math.inf)):
        bad = [v for v in vals if not 0 <= v <= hi]
        if bad:
            raise InvalidParameterError(name, bad[0], f"integers in [0, {hi}] in every entry")
    if host[2 * k]:
        raise InvalidParameterError("mask", "mismatch", "true exactly on rows < sizes[i]")
    if host[2 * k + 1]:
        raise InvalidParameterError(
            "y", "out of range", f"in [0, {model.num_classes}) on real rows"
        )
    return _Plan(theta, wbar, ClientData(x, y, mask, sizes_d), epochs_d, sizes_h, epochs_h)


def _linear_flat(model: BatchedModel, linear_term: Any, plan: _Plan) -> Tensor | None:
    """The linear term as a flat ``(K, d)`` tensor in the model's parameter order."""
    if linear_term is None:
        return None
    shapes = model.parameter_shapes()
    k = plan.theta.shape[0]
    got: Any
    if not isinstance(linear_term, Mapping) or list(linear_term) != list(shapes):
        got = list(linear_term) if isinstance(linear_term, Mapping) else type(linear_term)
        raise InvalidParameterError("linear_term", got, f"a dict with keys {list(shapes)}")
    parts = []
    for name, shape in shapes.items():
        t = linear_term[name]
        if not (isinstance(t, Tensor) and tuple(t.shape) == (k, *shape)
                and t.dtype == plan.theta.dtype and t.device == plan.theta.device):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise InvalidParameterError(f"linear_term[{name!r}]", got, f"(K, *{shape}) like params")
        if not bool(torch.isfinite(t).all()):
            raise InvalidParameterError(f"linear_term[{name!r}]", "non-finite", "finite")
        parts.append(t.reshape(k, -1))
    return torch.cat(parts, 1)


def _resolve_order(
    plan: _Plan, generator: torch.Generator | None, order: BatchOrder | None
) -> BatchOrder:
    if generator is not None and order is None:
        return _draw_orders(plan.data.sizes, plan.epochs, plan.sizes_h, plan.epochs_h, generator)
    if order is None or generator is not None:
        raise InvalidParameterError("generator", generator, "given exactly when order is not")
    counts = [n * e for n, e in zip(plan.sizes_h, plan.epochs_h)]
    offsets = list(itertools.accumulate(counts, initial=0))[:-1]
    dev = plan.data.x.device
    if (
        not isinstance(order, BatchOrder)
        or order.order.numel() != sum(counts)
        or order.order.device != dev
        or order.offsets.tolist() != offsets
    ):
        raise InvalidParameterError(
            "order", type(order).__name__, f"batch_orders(sizes, epochs) on {dev}"
        )
    return order


# --------------------------------------------------------------------------- batched path


def local_sgd(
    model: BatchedModel,
    params: Mapping[str, Tensor],
    w_bar: Mapping[str, Tensor],
    data: Sequence[Tensor],
    *,
    epochs: Tensor | int,
    batch_size: int,
    lr: float,
    momentum: float = 0.5,
    proximal_mu: float = 0.0,
    generator: torch.Generator | None = None,
    order: BatchOrder | None = None,
    linear_term: Mapping[str, Tensor] | None = None,
) -> Params:
    """Run every client's local solve at once; return the new stacked parameters.

    Args:
        model: A :class:`fl_examples.core.models.BatchedModel`.
        params: Starting parameters ``{name: (K, *shape)}`` (usually w_bar broadcast).
        w_bar: Centre of the proximal term, ``(K, *shape)``, ``(1, *shape)`` or ``shape``.
        data: :class:`ClientData` or a tuple ``(x, y, mask, sizes)``.
        epochs: ``(K,)`` integer tensor (or one int for all): local epochs per client; a
            straggler has fewer, 0 leaves the client's parameters unchanged.
        batch_size: Minibatch size (the last minibatch of an epoch may be smaller).
        lr: Learning rate, > 0.
        momentum: Heavy-ball momentum in [0, 1), PyTorch convention; the paper uses 0.5.
        proximal_mu: FedProx mu >= 0 (0 gives FedAvg's local solver).
        generator: Draws the batch order (on the data's device). Exactly one of ``generator``
            and ``order`` is given.
        order: A precomputed :func:`batch_orders` result.
        linear_term: Optional ``{name: (K, *shape)}`` vectors n_i: client i then minimises
            F_i(w) + mu/2 ||w - w_bar||^2 + <n_i, w>, i.e. n_i is added to every step's
            gradient (Upcycled-FL objective perturbation).

    Returns:
        New parameters, same keys, shapes, dtype and device as ``params`` (fresh tensors).

    Raises:
        InvalidParameterError: A bad argument; the message names it.

    Note:
        The K sizes and epochs are read to the host once per call (the number of steps is a
        Python loop bound); everything else stays on the tensors' device.

    Example:
        >>> from fl_examples.core.models import MultinomialLogReg
        >>> m = MultinomialLogReg(2, 2)
        >>> g = torch.Generator().manual_seed(0)
        >>> d = pad_clients([torch.randn(5, 2), torch.randn(3, 2)], [torch.ones(5), torch.zeros(3)])
        >>> p = m.init(2, generator=g)
        >>> out = local_sgd(m, p, p, d, epochs=torch.tensor([2, 0]), batch_size=2, lr=0.1,
        ...                 generator=g)
        >>> bool(torch.equal(out["weight"][1], p["weight"][1]))
        True
    """
    plan = _validate(model, params, w_bar, data, epochs, batch_size, lr, momentum, proximal_mu)
    bo = _resolve_order(plan, generator, order)
    lin = _linear_flat(model, linear_term, plan)
    theta = _run_batched(
        model, plan, bo, batch_size, float(lr), float(momentum), float(proximal_mu), lin
    )
    return {k: v.clone() for k, v in unflatten(theta, model.parameter_shapes()).items()}


@torch.no_grad()
def _run_batched(
    model: BatchedModel,
    plan: _Plan,
    bo: BatchOrder,
    b: int,
    lr: float,
    momentum: float,
    mu: float,
    lin: Tensor | None = None,
) -> Tensor:
    x, y, _, sizes = plan.data
    k_all, n_max, nf = x.shape
    dev = x.device
    n_h = np.asarray(plan.sizes_h, dtype=np.int64)
    nb_h = -(-n_h // b)  # minibatches per epoch
    total_h = nb_h * np.asarray(plan.epochs_h, dtype=np.int64)
    steps = int(total_h.max(initial=0))
    if steps == 0:
        return plan.theta.clone()
    # Sort clients by steps (descending) so the working ones are a prefix at every step.
    srt_h = np.argsort(-total_h, kind="stable")
    active_h = k_all - np.cumsum(np.bincount(total_h[srt_h], minlength=steps + 1))[:steps]
    srt = torch.as_tensor(srt_h, device=dev)
    theta = plan.theta[srt].contiguous()
    buf = torch.zeros_like(theta)
    # The step adds mu * theta - mu_wbar to the buffer: the proximal gradient and, with a
    # linear term n, + n (folded in as mu_wbar = mu * w_bar - n).
    mu_wbar = plan.wbar[srt].mul_(mu) if mu > 0 else None
    if lin is not None:
        mu_wbar = (mu_wbar if mu_wbar is not None else torch.zeros_like(theta)).sub_(lin[srt])
    n_s = sizes[srt]
    nb_s = torch.as_tensor(nb_h[srt_h], device=dev)
    total_s = torch.as_tensor(total_h[srt_h], device=dev)
    row0_s = (srt * n_max).unsqueeze(1)  # first row of each client in x.reshape(K * N, F)
    off_s = bo.offsets.to(dev)[srt]
    x_rows, y_rows = x.reshape(k_all * n_max, nf), y.reshape(-1)
    r = torch.arange(b, device=dev)

    s0 = 0
    while s0 < steps:
        k0 = int(active_h[s0])
        span = min(steps - s0, max(1, _CHUNK_ELEMENTS // (k0 * b * (nf + 1))))
        # Minibatch rows of steps s0 .. s0 + span - 1 for the k0 working clients. A row that
        # does not count (short last minibatch, finished client) gets weight 0 and points at
        # the client's first sample, so it only ever reads real, finite data.
        s = torch.arange(s0, s0 + span, device=dev).unsqueeze(1)
        ep = torch.div(s, nb_s[:k0], rounding_mode="floor")
        within = ((s - ep * nb_s[:k0]) * b).unsqueeze(-1) + r  # (T, k0, b)
        valid = (within < n_s[:k0, None]) & (s < total_s[:k0]).unsqueeze(-1)
        pos = (off_s[:k0] + ep * n_s[:k0]).unsqueeze(-1) + within
        pos = torch.where(valid, pos, off_s[:k0, None])
        rows = torch.where(valid, bo.order[pos], 0).add_(row0_s[:k0])
        weights = valid.to(x.dtype)
        weights.div_(weights.sum(-1, keepdim=True).clamp_(min=1.0))
        flat_rows = rows.view(-1)
        xb = x_rows.index_select(0, flat_rows).view(*rows.shape, nf)
        yb = y_rows.index_select(0, flat_rows).view(rows.shape)
        chunk = model.prepare_minibatches(xb, yb, weights)
        per_step = list(zip(*(c.unbind(0) for c in chunk)))  # per_step[t]: step t's tensors
        k_cur = -1
        for t in range(span):
            k = int(active_h[s0 + t])
            if k != k_cur:
                k_cur = k
                th_k, buf_k = theta[:k], buf[:k]
                mw_k = mu_wbar[:k] if mu_wbar is not None else None
                accumulate = model.gradient_accumulator(th_k, buf_k)
            if k == k0:
                accumulate(per_step[t], momentum)
            else:
                accumulate(tuple(c[:k] for c in per_step[t]), momentum)
            if mw_k is not None:
                buf_k.add_(th_k, alpha=mu).sub_(mw_k)
            th_k.add_(buf_k, alpha=-lr)
        s0 += span
    out = torch.empty_like(theta)
    out[srt] = theta
    return out


# --------------------------------------------------------------------------- reference path


def local_sgd_reference(
    model: BatchedModel,
    params: Mapping[str, Tensor],
    w_bar: Mapping[str, Tensor],
    data: Sequence[Tensor],
    *,
    epochs: Tensor | int,
    batch_size: int,
    lr: float,
    momentum: float = 0.5,
    proximal_mu: float = 0.0,
    generator: torch.Generator | None = None,
    order: BatchOrder | None = None,
    linear_term: Mapping[str, Tensor] | None = None,
) -> Params:
    """The same local solves, one client at a time with autograd and ``torch.optim.SGD``.

    Same arguments and result as :func:`local_sgd`; for testing and benchmarking only. Client
    i's minibatches are ``x[i, perm[j * batch_size : (j + 1) * batch_size]]`` for each epoch's
    permutation ``perm`` of its own ``n_i`` rows; padding rows are never read.
    """
    plan = _validate(model, params, w_bar, data, epochs, batch_size, lr, momentum, proximal_mu)
    bo = _resolve_order(plan, generator, order)
    lin = _linear_flat(model, linear_term, plan)
    x, y, _, _ = plan.data
    shapes = model.parameter_shapes()
    theta = plan.theta.clone()
    wbar = unflatten(plan.wbar, shapes)
    for i, (n, e) in enumerate(zip(plan.sizes_h, plan.epochs_h)):
        if n * e == 0:
            continue
        start = unflatten(plan.theta[i : i + 1], shapes)
        p = {k: v[0].clone().requires_grad_(True) for k, v in start.items()}
        centre = {k: v[i] for k, v in wbar.items()}
        opt = torch.optim.SGD(list(p.values()), lr=float(lr), momentum=float(momentum))
        with torch.enable_grad():
            for epoch in range(e):
                perm = bo.permutation(i, epoch, n)
                for first in range(0, n, batch_size):
                    idx = perm[first : first + batch_size]
                    loss = F.cross_entropy(model.forward_single(p, x[i, idx]), y[i, idx])
                    if proximal_mu > 0:
                        sq = sum(((p[k] - centre[k]) ** 2).sum() for k in p)
                        loss = loss + 0.5 * proximal_mu * sq
                    if lin is not None:
                        flat_p = torch.cat([v.reshape(-1) for v in p.values()])
                        loss = loss + (lin[i] * flat_p).sum()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        theta[i] = torch.cat([v.detach().reshape(-1) for v in p.values()])
    return {k: v.clone() for k, v in unflatten(theta, shapes).items()}
