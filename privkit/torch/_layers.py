"""Per-layer rules: per-example gradient norms and clipped sums from a layer's inputs and the
gradients of its outputs, without running autograd per example.

A rule gets every call of one module in a forward pass, ``(a, g)``: the input ``a`` (batch
first) and the gradient ``g`` of the summed per-example losses with respect to the output.
Since the examples are independent, row i of ``g`` is example i's own output gradient, and
the layer's per-example gradients follow in closed form:

- ``nn.Linear``: the weight gradient of example i is ``sum_t g_it a_it^T`` over its positions
  t. Its squared norm is ``||a_i||^2 ||g_i||^2`` for one position, and otherwise either the
  *ghost norm* ``sum_{t,s} (a_it . a_is)(g_it . g_is)`` (Goodfellow 2015; Li et al., ICLR 2022)
  or the norm of the materialised ``(out, in)`` gradient, whichever needs less memory
  (``T^2`` against ``out * in`` per example: Bu et al., "mixed ghost clipping", 2022).
- ``nn.Conv1d/2d/3d``: the same with the unfolded input (1d and 2d, ``groups == 1``) for the
  ghost norm; otherwise the per-example weight gradients of all examples come from one
  grouped weight-gradient convolution (``groups * B`` groups).
- ``nn.Embedding``: the gradient rows of example i are its output gradients summed per token
  id; their squared norm is computed by a segment sum over (example, id) pairs (no
  ``(B, V, D)`` tensor).
- ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``: the affine parameters' per-example
  gradients (``g`` times the normalised input, summed over positions) are small, and kept.

The clipped sum ``sum_i f_i grad_i`` is then one weight-gradient product with ``f_i g_i``
(book-keeping, Bu et al., 2023): no second backward pass. Squared norms are reduced in the
layer's dtype and summed over layers in float64; ghost norms (``T^2`` Gram matrices) are
computed in float64, where cancellation would otherwise cost precision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Parts", "RULES"]

Calls = list[tuple[Tensor, Tensor]]


class Parts:
    """One module's per-example squared norms ``sq`` (B,) float64, and ``weighted(f)``: the
    clipped sum ``{local parameter name: sum_i f_i grad_i}`` for factors f (B,)."""

    def __init__(self, sq: Tensor, weighted: Callable[[Tensor], dict[str, Tensor]]) -> None:
        self.sq = sq
        self.weighted = weighted


def materialized(grads: Mapping[str, Tensor]) -> Parts:
    """Parts of per-example gradients held in full, ``{name: (B, *shape)}``."""
    grads = dict(grads)
    first = next(iter(grads.values()))
    sq = torch.zeros(first.shape[0], dtype=torch.float64, device=first.device)
    for v in grads.values():
        sq += _sumsq(v, 1)

    def weighted(f: Tensor) -> dict[str, Tensor]:
        return {n: torch.tensordot(f.to(v.dtype), v, dims=1) for n, v in grads.items()}

    return Parts(sq, weighted)


def _sumsq(x: Tensor, dims: int) -> Tensor:
    """Squared norms over all but the first ``dims`` axes: squares summed in ``x``'s dtype
    (cascade summation, relative error ``O(log n eps)``: the clip factor's margin covers it,
    see :func:`privkit.torch.grads.clip_factors`), returned in float64."""
    return (x * x).flatten(dims).sum(-1).to(torch.float64)


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _gram_norms(a: Tensor, g: Tensor) -> Tensor:
    """``sum_{t,s} (a_t . a_s)(g_t . g_s)`` per example for ``a (B, T, I)``, ``g (B, T, O)``."""
    a64, g64 = a.to(torch.float64), g.to(torch.float64)
    return (torch.bmm(a64, a64.transpose(1, 2)) * torch.bmm(g64, g64.transpose(1, 2))).sum((1, 2))


#: Per-example gradients of a layer are materialised (exact clipped sums, fast small matrix
#: products) up to this many elements for the whole batch, and beyond it whenever the ghost
#: norm would need more (``T^2 >= out * in`` per example).
MATERIALISE_ELEMENTS = 1 << 22


def _weight_sq(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor | None]:
    """Squared per-example norms of ``sum_t g_t a_t^T`` for ``a (B, T, I)``, ``g (B, T, O)``,
    and the materialised ``(B, O, I)`` gradients when they are the chosen way (else None)."""
    b, t, i = a.shape
    o = g.shape[2]
    if t == 1:
        return _sumsq(a, 1) * _sumsq(g, 1), None
    if b * o * i <= MATERIALISE_ELEMENTS or t * t >= o * i:
        per = torch.bmm(g.transpose(1, 2), a)
        return _sumsq(per, 1), per
    return _gram_norms(a, g), None


def _linear(module: nn.Linear, calls: Calls, want: set[str]) -> Parts:
    b, o, i = calls[0][1].shape[0], module.out_features, module.in_features
    a = _cat([x.reshape(b, -1, i) for x, _ in calls], dim=1)
    g = _cat([y.reshape(b, -1, o) for _, y in calls], dim=1)
    sq = torch.zeros(b, dtype=torch.float64, device=g.device)
    per = None
    if "weight" in want:
        w_sq, per = _weight_sq(a, g)
        sq += w_sq
    if "bias" in want:
        sq += _sumsq(g.sum(1), 1)

    def weighted(f: Tensor) -> dict[str, Tensor]:
        fg = g * f.to(g.dtype)[:, None, None]
        out = {}
        if "weight" in want:
            out["weight"] = (torch.tensordot(f.to(per.dtype), per, dims=1) if per is not None
                             else fg.reshape(-1, o).T @ a.reshape(-1, i))
        if "bias" in want:
            out["bias"] = fg.sum((0, 1))
        return out

    return Parts(sq, weighted)


# ------------------------------------------------------------------------------ convolution
_WEIGHT_GRAD = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight,
                3: torch.nn.grad.conv3d_weight}


def _conv_input(module: Any, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """The input as the convolution sees it, and the padding still to apply: string padding
    and non-zero padding modes are applied here (as ``nn.Conv*`` does), leaving 0."""
    nd = a.dim() - 2
    if isinstance(module.padding, str):
        pads: list[int] = []
        for d, k in zip(reversed(module.dilation), reversed(module.kernel_size)):
            total = d * (k - 1) if module.padding == "same" else 0
            pads += [total // 2, total - total // 2]
    elif module.padding_mode != "zeros":
        pads = [p for p in reversed(module.padding) for _ in range(2)]
    else:
        return a, tuple(module.padding)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(a, pads, mode=mode), (0,) * nd


def _unfold(a: Tensor, module: Any, padding: tuple[int, ...]) -> Tensor:
    """``(B, T, C k)`` patches of a 1d or 2d input (``F.unfold``, 1d as height 1)."""
    if a.dim() == 3:
        a = a.unsqueeze(2)
        k, d, p, s = ((1, *module.kernel_size), (1, *module.dilation), (0, *padding),
                      (1, *module.stride))
    else:
        k, d, p, s = module.kernel_size, module.dilation, padding, module.stride
    return F.unfold(a, k, d, p, s).transpose(1, 2)


def _conv(module: Any, calls: Calls, want: set[str]) -> Parts:
    b = calls[0][1].shape[0]
    nd = calls[0][0].dim() - 2
    ins = [_conv_input(module, x) for x, _ in calls]
    gs = [y for _, y in calls]
    sq = torch.zeros(b, dtype=torch.float64, device=gs[0].device)
    per: Tensor | None = None
    if "weight" in want:
        if module.groups == 1 and nd <= 2:
            u = _cat([_unfold(x, module, p) for x, p in ins], dim=1)
            g = _cat([y.flatten(2).transpose(1, 2) for y in gs], dim=1)
            w_sq, per = _weight_sq(u, g)
            sq += w_sq
        else:
            per = sum(_per_example_conv(module, x, p, y) for (x, p), y in zip(ins, gs))
            sq += _sumsq(per, 1)
    if "bias" in want:
        sq += _sumsq(sum(y.flatten(2).sum(2) for y in gs), 1)

    def weighted(f: Tensor) -> dict[str, Tensor]:
        fs = [y * f.to(y.dtype).view(-1, *([1] * (y.dim() - 1))) for y in gs]
        out = {}
        if "weight" in want:
            if per is not None:
                w = torch.tensordot(f.to(per.dtype), per, dims=1)
                out["weight"] = w.reshape(module.weight.shape)
            else:
                out["weight"] = sum(_WEIGHT_GRAD[nd](
                    x, module.weight.shape, fy, module.stride, p, module.dilation, module.groups)
                    for (x, p), fy in zip(ins, fs))
        if "bias" in want:
            out["bias"] = sum(fy.transpose(0, 1).flatten(1).sum(1) for fy in fs)
        return out

    return Parts(sq, weighted)


def _per_example_conv(module: Any, a: Tensor, padding: tuple[int, ...], g: Tensor) -> Tensor:
    """``(B, *weight.shape)``: every example's weight gradient from one grouped convolution
    (examples as ``B * groups`` groups)."""
    b, nd = a.shape[0], a.dim() - 2
    w = module.weight.shape
    gw = _WEIGHT_GRAD[nd](a.reshape(1, -1, *a.shape[2:]), (b * w[0], *w[1:]),
                          g.reshape(1, -1, *g.shape[2:]), module.stride, padding,
                          module.dilation, module.groups * b)
    return gw.view(b, *w)


# ------------------------------------------------------------------------------ embedding
def _embedding(module: nn.Embedding, calls: Calls, want: set[str]) -> Parts:
    b, v, dim = calls[0][1].shape[0], module.num_embeddings, module.embedding_dim
    ids = _cat([x.reshape(b, -1) for x, _ in calls], dim=1)
    g = _cat([y.reshape(b, -1, dim) for _, y in calls], dim=1)
    if module.padding_idx is not None:  # nn.Embedding never updates the padding row
        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
    owner = torch.arange(b, device=ids.device).unsqueeze(1).expand_as(ids)
    keys, inverse = torch.unique(owner * v + ids, return_inverse=True)
    rows = torch.zeros(keys.shape[0], dim, dtype=torch.float64, device=g.device)
    rows.index_add_(0, inverse.reshape(-1), g.reshape(-1, dim).to(torch.float64))
    sq = torch.zeros(b, dtype=torch.float64, device=g.device)
    sq.index_add_(0, torch.div(keys, v, rounding_mode="floor"), rows.pow(2).sum(1))

    def weighted(f: Tensor) -> dict[str, Tensor]:
        fg = (g * f.to(g.dtype)[:, None, None]).reshape(-1, dim)
        out = torch.zeros(v, dim, dtype=g.dtype, device=g.device)
        return {"weight": out.index_add_(0, ids.reshape(-1), fg)}

    return Parts(sq, weighted)


# ------------------------------------------------------------------------------ normalisation
def _affine(calls: Calls, want: set[str], normalise: Callable[[Tensor], Tensor],
            reduce: Callable[[Tensor], Tensor]) -> Parts:
    grads: dict[str, Tensor] = {}
    for x, g in calls:
        parts = {}
        if "weight" in want:
            parts["weight"] = reduce(g * normalise(x))
        if "bias" in want:
            parts["bias"] = reduce(g)
        for n, v in parts.items():
            grads[n] = grads[n] + v if n in grads else v
    return materialized(grads)


def _layer_norm(module: Any, calls: Calls, want: set[str]) -> Parts:
    shape = tuple(module.normalized_shape)

    def reduce(t: Tensor) -> Tensor:
        return t.reshape(t.shape[0], -1, *shape).sum(1)

    if isinstance(module, nn.LayerNorm):
        def normalise(x: Tensor) -> Tensor:
            return F.layer_norm(x, shape, None, None, module.eps)
    else:
        def normalise(x: Tensor) -> Tensor:
            return F.rms_norm(x, shape, None, module.eps)
    return _affine(calls, want, normalise, reduce)


def _group_norm(module: nn.GroupNorm, calls: Calls, want: set[str]) -> Parts:
    def normalise(x: Tensor) -> Tensor:
        return F.group_norm(x, module.num_groups, None, None, module.eps)

    def reduce(t: Tensor) -> Tensor:
        return t.flatten(2).sum(2)

    return _affine(calls, want, normalise, reduce)


Rule = Callable[[Any, Calls, set[str]], Parts]

#: Module type -> rule (exact types: a subclass may change the forward).
RULES: dict[type, Rule] = {
    nn.Linear: _linear,
    nn.Conv1d: _conv,
    nn.Conv2d: _conv,
    nn.Conv3d: _conv,
    nn.Embedding: _embedding,
    nn.LayerNorm: _layer_norm,
    nn.GroupNorm: _group_norm,
}
if hasattr(nn, "RMSNorm"):
    RULES[nn.RMSNorm] = _layer_norm
