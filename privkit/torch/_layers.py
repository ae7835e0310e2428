"""Per-layer rules: per-example gradient norms and clipped sums from a layer's inputs and the
gradients of its outputs, without running autograd per example.

A rule gets every call of one module in a forward pass, ``(a, g)``: the input ``a`` and the
gradient ``g`` of the summed per-example losses with respect to the output, both with two
leading axes ``(K, B)``: K clients (each with its own parameters; K = 1 for one model) of B
examples. Since the examples are independent, ``g[k, i]`` is example i's own output
gradient, and the layer's per-example gradients follow in closed form:

- ``nn.Linear``: the weight gradient of example i is ``sum_t g_it a_it^T`` over its positions
  t. Its squared norm is ``||a_i||^2 ||g_i||^2`` for one position, and otherwise either the
  norm of the materialised ``(out, in)`` gradient or the *ghost norm*
  ``sum_{t,s} (a_it . a_is)(g_it . g_is)`` (Goodfellow 2015; Li et al., ICLR 2022) when
  materialising would take much memory and the ghost norm less (``T^2 < out * in``: Bu et
  al., "mixed ghost clipping", 2022).
- ``nn.Conv1d/2d``: the same with the unfolded input (``groups == 1``); other convolutions
  (``Conv3d``, grouped) materialise every example's weight gradient with one grouped
  weight-gradient convolution (``groups * K * B`` groups).
- ``nn.Embedding``: the gradient rows of example i are its output gradients summed per token
  id; their squared norm is a segment sum over (example, id) pairs (no ``(B, V, D)`` tensor).
- ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``: the affine parameters' per-example
  gradients (``g`` times the normalised input, summed over positions) are small, and kept.

The clipped sum ``sum_i f_i grad_i`` (per client) is then one weight-gradient product with
``f_i g_i`` (book-keeping, Bu et al., 2023): no second backward pass. Squared norms are
reduced in the layer's dtype and summed over layers in float64; ghost norms (``T^2`` Gram
matrices) are computed in float64, where cancellation would otherwise cost precision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.grad import conv1d_weight, conv2d_weight, conv3d_weight

__all__ = ["Parts", "RULES", "materialized"]

Calls = list[tuple[Tensor, Tensor]]

#: Per-example gradients of a layer are materialised (exact clipped sums, fast small matrix
#: products) up to this many elements for the whole batch, and beyond it whenever the ghost
#: norm would need as much (``T^2 >= out * in`` per example).
MATERIALISE_ELEMENTS = 1 << 22


#: ``weighted(f, drop)``: the clipped sums for factors f ``(K, B)``; ``drop`` (bool
#: ``(K, B)``, or None when no row needs it) marks rows that must contribute exactly 0 although
#: their per-example values may be NaN or inf (``0 * nan`` is nan): their factor is 0 too.
Weighted = Callable[[Tensor, "Tensor | None"], dict[str, Tensor]]


class Parts:
    """One module's per-example squared norms ``sq`` ``(K, B)`` float64, and
    ``weighted(f, drop)``: the clipped sums ``{local parameter name: (K, *shape)}`` of
    ``sum_i f_ki grad_ki`` for factors f ``(K, B)``, rows marked in ``drop`` left out
    (:data:`Weighted`)."""

    def __init__(self, sq: Tensor, weighted: Weighted) -> None:
        self.sq = sq
        self.weighted = weighted


def _sumsq(x: Tensor, dims: int) -> Tensor:
    """Squared norms over all but the first ``dims`` axes (none left: a 0-dim parameter's
    per-example gradients), summed in ``x``'s dtype (cascade summation, relative error
    ``O(log n eps)``: the clip factor's margin covers it, see
    :func:`privkit.torch.grads.clip_factors`); layers' norms are added up in float64. A
    NaN or inf entry makes its row's sum NaN or inf."""
    return (x * x).reshape(*x.shape[:dims], -1).sum(-1)


def _rows_zeroed(x: Tensor, drop: Tensor | None) -> Tensor:
    """``x`` ``(n, ...)`` with the rows marked in ``drop`` (any shape of n elements) set to
    0 (their NaN and inf too); ``x`` itself when ``drop`` is None."""
    if drop is None:
        return x
    return x.masked_fill(drop.reshape(-1, *([1] * (x.dim() - 1))), 0)


def materialized(grads: Mapping[str, Tensor]) -> Parts:
    """Parts of per-example gradients held in full, ``{name: (K, B, *shape)}`` (a 0-dim
    parameter's are ``(K, B)``)."""
    grads = dict(grads)
    first = next(iter(grads.values()))
    sq = torch.zeros(first.shape[:2], dtype=torch.float64, device=first.device)
    for v in grads.values():
        sq = sq + _sumsq(v, 2)

    def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        out = {}
        for n, v in grads.items():
            k, b = v.shape[:2]
            flat = _rows_zeroed(v.reshape(k * b, -1), drop).reshape(k, b, -1)
            out[n] = torch.bmm(f.to(v.dtype).unsqueeze(1), flat).reshape(k, *v.shape[2:])
        return out

    return Parts(sq, weighted)


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _gram_norms(a: Tensor, g: Tensor) -> Tensor:
    """``sum_{t,s} (a_t . a_s)(g_t . g_s)`` per example for ``a (n, T, I)``, ``g (n, T, O)``."""
    a64, g64 = a.to(torch.float64), g.to(torch.float64)
    return (torch.bmm(a64, a64.transpose(1, 2)) * torch.bmm(g64, g64.transpose(1, 2))).sum((1, 2))


def _outer(a: Tensor, g: Tensor, want: set[str], k: int) -> tuple[Tensor, Callable[..., Any]]:
    """Squared norms ``(K, B)`` and the weighted sums of the weight ``sum_t g_t a_t^T``
    (``(K, O, I)``) and bias ``sum_t g_t`` for ``a (K B, T, I)``, ``g (K B, T, O)``."""
    n, t, i = a.shape
    o = g.shape[2]
    gb = g.reshape(n, o) if t == 1 else g.sum(1)  # the bias's per-example gradients
    per = None
    if "weight" not in want:
        sq = _sumsq(gb, 1)
    elif t == 1:  # ||a g^T||^2 = ||a||^2 ||g||^2, and ||g||^2 for the bias
        sq = _sumsq(a, 1) + ("bias" in want)
        sq = sq * _sumsq(gb, 1)
    else:
        if n * o * i <= MATERIALISE_ELEMENTS or t * t >= o * i:
            per = torch.bmm(g.transpose(1, 2), a)
            sq = _sumsq(per, 1)
        else:
            sq = _gram_norms(a, g)
        if "bias" in want:
            sq = sq + _sumsq(gb, 1)

    def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        fk = f.to(g.dtype).reshape(k, 1, -1)
        out = {}
        if "weight" in want:
            if per is not None:
                p = _rows_zeroed(per, drop)
                out["weight"] = torch.bmm(fk, p.reshape(k, -1, o * i)).reshape(k, o, i)
            else:
                fg = (_rows_zeroed(g, drop) * fk.reshape(-1, 1, 1)).reshape(k, -1, o)
                out["weight"] = torch.bmm(fg.transpose(1, 2),
                                          _rows_zeroed(a, drop).reshape(k, -1, i))
        if "bias" in want:
            out["bias"] = torch.bmm(fk, _rows_zeroed(gb, drop).reshape(k, -1, o)).reshape(k, o)
        return out

    return sq.reshape(k, -1), weighted


def _linear(module: nn.Linear, calls: Calls, want: set[str]) -> Parts:
    k, b = calls[0][1].shape[:2]
    o, i = module.out_features, module.in_features
    a = _cat([x.reshape(k * b, -1, i) for x, _ in calls], dim=1)
    g = _cat([y.reshape(k * b, -1, o) for _, y in calls], dim=1)
    sq, weighted = _outer(a, g, want, k)
    return Parts(sq, weighted)


# ------------------------------------------------------------------------------ convolution
_WEIGHT_GRAD = {1: conv1d_weight, 2: conv2d_weight, 3: conv3d_weight}


def _conv_input(module: Any, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """The input as the convolution sees it, and the padding still to apply: string padding
    and non-zero padding modes are applied here (as ``nn.Conv*`` does), leaving 0."""
    nd = a.dim() - 2
    if isinstance(module.padding, str):
        pads: list[int] = []
        for d, kk in zip(reversed(module.dilation), reversed(module.kernel_size)):
            total = d * (kk - 1) if module.padding == "same" else 0
            pads += [total // 2, total - total // 2]
    elif module.padding_mode != "zeros":
        pads = [p for p in reversed(module.padding) for _ in range(2)]
    else:
        return a, tuple(module.padding)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(a, pads, mode=mode), (0,) * nd


def _unfold(a: Tensor, module: Any, padding: tuple[int, ...]) -> Tensor:
    """``(n, C k, T)`` patches of a 1d or 2d input (1d as height 1), ``F.unfold``'s layout
    (the weight's ``(C, kh, kw)`` order), from strided views and one copy whose innermost
    axis runs along the input rows (``F.unfold`` itself loops over the batch)."""
    k, d, p, s = module.kernel_size, module.dilation, padding, module.stride
    if a.dim() == 3:
        a, k, d, p, s = a.unsqueeze(2), (1, *k), (1, *d), (0, *p), (1, *s)
    if any(p):
        a = F.pad(a, (p[1], p[1], p[0], p[0]))
    u = a.unfold(2, d[0] * (k[0] - 1) + 1, s[0]).unfold(3, d[1] * (k[1] - 1) + 1, s[1])
    if d[0] != 1 or d[1] != 1:
        u = u[..., ::d[0], ::d[1]]
    n, c, h, w = u.shape[:4]
    return u.permute(0, 1, 4, 5, 2, 3).reshape(n, c * k[0] * k[1], h * w)


def _conv(module: Any, calls: Calls, want: set[str]) -> Parts:
    k, b = calls[0][1].shape[:2]
    ins = [_conv_input(module, x.flatten(0, 1)) for x, _ in calls]
    gs = [y.flatten(0, 1) for _, y in calls]
    nd = gs[0].dim() - 2
    w_shape = module.weight.shape
    if "weight" in want and module.groups == 1 and nd <= 2:
        u = _cat([_unfold(x, module, p) for x, p in ins], dim=2).transpose(1, 2)
        g = _cat([y.flatten(2).transpose(1, 2) for y in gs], dim=1)
        sq, outer = _outer(u, g, want, k)

        def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
            out = outer(f, drop)
            if "weight" in out:
                out["weight"] = out["weight"].reshape(k, *w_shape)
            return out

        return Parts(sq, weighted)
    grads: dict[str, Tensor] = {}
    if "weight" in want:
        per = sum(_per_example_conv(module, x, p, y) for (x, p), y in zip(ins, gs))
        assert isinstance(per, Tensor)
        grads["weight"] = per.reshape(k, b, *w_shape)
    if "bias" in want:
        bias = sum(y.flatten(2).sum(2) for y in gs)
        assert isinstance(bias, Tensor)
        grads["bias"] = bias.reshape(k, b, -1)
    return materialized(grads)


def _per_example_conv(module: Any, a: Tensor, padding: tuple[int, ...], g: Tensor) -> Tensor:
    """``(n, *weight.shape)``: every example's weight gradient from one grouped convolution
    (examples as ``n * groups`` groups)."""
    n, nd = a.shape[0], a.dim() - 2
    w = module.weight.shape
    gw = _WEIGHT_GRAD[nd](a.reshape(1, -1, *a.shape[2:]), (n * w[0], *w[1:]),
                          g.reshape(1, -1, *g.shape[2:]), module.stride, padding,
                          module.dilation, module.groups * n)
    return gw.view(n, *w)


# ------------------------------------------------------------------------------ embedding
def _embedding(module: nn.Embedding, calls: Calls, want: set[str]) -> Parts:
    k, b = calls[0][1].shape[:2]
    v, dim = module.num_embeddings, module.embedding_dim
    ids = _cat([x.reshape(k * b, -1) for x, _ in calls], dim=1)
    g = _cat([y.reshape(k * b, -1, dim) for _, y in calls], dim=1)
    if module.padding_idx is not None:  # nn.Embedding never updates the padding row
        g = g.masked_fill((ids == module.padding_idx).unsqueeze(-1), 0)
    owner = torch.arange(k * b, device=ids.device).unsqueeze(1).expand_as(ids)
    keys, inverse = torch.unique(owner * v + ids, return_inverse=True)
    rows = torch.zeros(keys.shape[0], dim, dtype=g.dtype, device=g.device)
    rows.index_add_(0, inverse.reshape(-1), g.reshape(-1, dim))
    sq = torch.zeros(k * b, dtype=torch.float64, device=g.device)
    sq.index_add_(0, torch.div(keys, v, rounding_mode="floor"),
                  _sumsq(rows, 1).to(torch.float64))
    client = torch.div(owner, b, rounding_mode="floor")

    def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        fg = (_rows_zeroed(g, drop) * f.to(g.dtype).reshape(-1, 1, 1)).reshape(-1, dim)
        out = torch.zeros(k * v, dim, dtype=g.dtype, device=g.device)
        out.index_add_(0, (client * v + ids).reshape(-1), fg)
        return {"weight": out.reshape(k, v, dim)}

    return Parts(sq.reshape(k, b), weighted)


# ------------------------------------------------------------------------------ normalisation
def _affine(calls: Calls, want: set[str], normalise: Callable[[Tensor], Tensor],
            reduce: Callable[[Tensor], Tensor]) -> Parts:
    k, b = calls[0][1].shape[:2]
    grads: dict[str, Tensor] = {}
    for x, g in calls:
        x, g = x.flatten(0, 1), g.flatten(0, 1)
        parts = {}
        if "weight" in want:
            parts["weight"] = reduce(g * normalise(x))
        if "bias" in want:
            parts["bias"] = reduce(g)
        for n, v in parts.items():
            v = v.reshape(k, b, *v.shape[1:])
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

    def reduce(t: Tensor) -> Tensor:  # (N, C, *) with * possibly empty: (N, C)
        return t.reshape(t.shape[0], t.shape[1], -1).sum(2)

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
