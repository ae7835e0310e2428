"""Per-layer rules: per-example gradient norms and clipped sums from a layer's inputs and the
gradients of its outputs, without running autograd per example.

A rule gets every call of one module in a forward pass, ``(a, g)``: the input ``a`` and the
gradient ``g`` of the summed per-example losses with respect to the output, both with two
leading axes ``(K, B)``: K clients (each with its own parameters; K = 1 for one model) of B
examples. Since the examples are independent, ``g[k, i]`` is example i's own output
gradient, and the layer's per-example gradients follow in closed form:

- ``nn.Linear``: the weight gradient of example i is ``G_i = sum_t g_it a_it^T`` over its
  positions t (all calls' positions together). Its squared norm is ``||a_i||^2 ||g_i||^2``
  for one position; otherwise, per layer, the cheaper of two exact routes (as in Bu et al.,
  "mixed ghost clipping", 2022): the *ghost norm* ``sum_{t,s} (a_it . a_is)(g_it . g_is)``
  (Goodfellow 2015; Li et al., ICLR 2022), from two ``T x T`` Gram matrices, or the norm of
  the materialised ``(out, in)`` gradient (:func:`ghost_route`).
- ``nn.Conv1d/2d`` (``groups == 1``): the same with the input's patches (``in`` = channels
  times kernel size, T = output positions), the per-example gradients materialised by one
  batched product of the patches, or, for inputs of many channels, by one grouped
  weight-gradient convolution (no patches); other convolutions (``Conv3d``, grouped) by the
  grouped convolution (``groups * K * B`` groups).
- ``nn.Embedding``: the gradient rows of example i are its output gradients summed per token
  id; their squared norm is a segment sum over (example, id) pairs (no ``(B, V, D)`` tensor).
- ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``: the affine parameters' per-example
  gradients (``g`` times the normalised input, summed over positions) are small, and kept.

The clipped sum ``sum_i f_i G_i`` (per client) is then one weight-gradient product with
``f_i g_i`` (book-keeping, Bu et al., 2023), or ``f`` times the materialised per-example
gradients where those are smaller than the layer's input and output gradient: no second
backward pass. A rule keeps only what its clipped sum needs (the smaller of the two), and
computes norms in chunks of examples of bounded temporary memory (:data:`CHUNK_ELEMENTS`).
Squared norms are reduced in the layer's dtype and summed over layers in float64; ghost norms
(``T^2`` Gram matrices) are computed in float64, where cancellation would otherwise cost
precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.grad import conv1d_weight, conv2d_weight, conv3d_weight
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

__all__ = ["Parts", "RULES", "MULTI", "materialized", "ghost_route"]

Calls = list[tuple[Tensor, Tensor]]

#: Per-example norms are computed in chunks of examples whose temporary tensors (patches,
#: materialised gradients, Gram matrices, normalised inputs) hold about this many elements.
CHUNK_ELEMENTS = 1 << 18

#: The route of every layer with positions, for tests: None (the cheaper, :func:`ghost_route`),
#: ``"ghost"`` or ``"materialise"``.
ROUTE: str | None = None

#: A convolution materialises its per-example gradients from its patches (one batched matrix
#: product) when a patch has at most :data:`PATCH_ENTRIES` entries (input channels per group
#: times kernel size) or an example's patches at most :data:`PATCH_ELEMENTS`; else by one
#: grouped weight-gradient convolution, which never builds the patches (faster for wide
#: patches at many positions).
PATCH_ENTRIES = 32
PATCH_ELEMENTS = 1 << 14


def ghost_route(t: int, o: int, i: int) -> bool:
    """Whether a layer's per-example weight-gradient norms over ``t`` positions come cheaper
    from the ghost norm than from the materialised ``(o, i)`` gradients.

    Bu et al. (2022) choose by memory: two ``t x t`` Gram matrices against ``o i`` entries
    per example (ghost when ``2 t^2 < o i``). Here both routes run in chunks of examples of
    bounded memory (:data:`CHUNK_ELEMENTS`), so what is left to choose by is arithmetic: the
    Gram matrices take ``t^2 (i + o)`` multiply-adds in float64 (counted twice: half the
    float32 rate, and the inputs converted), the materialised gradients ``t o i`` in the
    layer's dtype. Ghost when ``2 t (i + o) < o i``.

    Examples:
        >>> ghost_route(16, 768, 768), ghost_route(32, 192, 64), ghost_route(49, 64, 288)
        (True, False, False)
    """
    if ROUTE is not None:
        return ROUTE == "ghost"
    return 2 * t * (i + o) < o * i


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


def _chunks(n: int, per_example: int) -> list[slice]:
    """Slices of ``n`` examples, each of about :data:`CHUNK_ELEMENTS` temporary elements at
    ``per_example`` elements an example."""
    c = max(1, CHUNK_ELEMENTS // max(1, per_example))
    return [slice(s, min(n, s + c)) for s in range(0, n, c)]


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
    """``sum_{t,s} (a_t . a_s)(g_t . g_s)`` per example (float64) for ``a (n, T, I)``,
    ``g (n, T, O)``, in chunks of examples."""
    n, t, i = a.shape
    out = torch.empty(n, dtype=torch.float64, device=a.device)
    for sl in _chunks(n, 2 * t * t + t * (i + g.shape[2])):
        a64, g64 = a[sl].to(torch.float64), g[sl].to(torch.float64)
        out[sl] = (torch.bmm(a64, a64.transpose(1, 2))
                   * torch.bmm(g64, g64.transpose(1, 2))).sum((1, 2))
    return out


def _materialised_norms(a: Tensor, g: Tensor, keep: bool) -> tuple[Tensor, Tensor | None]:
    """Squared norms ``(n,)`` of the per-example ``g_i^T a_i`` ``(O, I)`` for ``a (n, T, I)``,
    ``g (n, T, O)``, in chunks of examples; the ``(n, O, I)`` gradients too if ``keep``."""
    n, _, i = a.shape
    o = g.shape[2]
    per = torch.empty(n, o, i, dtype=g.dtype, device=g.device) if keep else None
    sq = torch.empty(n, dtype=g.dtype, device=g.device)
    for sl in [slice(0, n)] if keep else _chunks(n, o * i):
        p = torch.bmm(g[sl].transpose(1, 2), a[sl], out=None if per is None else per[sl])
        sq[sl] = _sumsq(p, 1)
    return sq, per


def _outer(a: Tensor, g: Tensor, want: set[str], k: int) -> tuple[Tensor, Callable[..., Any]]:
    """Squared norms ``(K, B)`` and the weighted sums of the weight ``sum_t g_t a_t^T``
    (``(K, O, I)``) and bias ``sum_t g_t`` for ``a (K B, T, I)``, ``g (K B, T, O)``, keeping
    only what the weighted sums need: ``a`` and ``g``, or the materialised gradients where
    those are smaller."""
    n, t, i = a.shape
    o = g.shape[2]
    gb = g.reshape(n, o) if t == 1 else g.sum(1)  # the bias's per-example gradients
    per = None
    if "weight" not in want:
        sq = _sumsq(gb, 1).to(torch.float64)
        a = g = a[:0]  # nothing of them is needed
    elif t == 1:  # ||a g^T||^2 = ||a||^2 ||g||^2, and ||g||^2 for the bias
        sq = _sumsq(a, 1) + ("bias" in want)
        sq = (sq * _sumsq(gb, 1)).to(torch.float64)
    else:
        if ghost_route(t, o, i):
            sq = _gram_norms(a, g)
        else:
            w_sq, per = _materialised_norms(a, g, keep=o * i <= t * (i + o))
            sq = w_sq.to(torch.float64)
            if per is not None:
                a = g = a[:0]
        if "bias" in want:
            sq = sq + _sumsq(gb, 1)
    if "bias" not in want:
        gb = gb[:0]

    def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        fk = f.to(gb.dtype).reshape(k, 1, -1)
        out = {}
        if "weight" in want:
            if per is not None:
                p = _rows_zeroed(per, drop)
                out["weight"] = torch.bmm(fk, p.reshape(k, -1, o * i)).reshape(k, o, i)
            else:
                fg = (_rows_zeroed(g, drop) * fk.reshape(-1, 1, 1)).reshape(k, -1, o)
                out["weight"] = torch.bmm(fg.transpose(1, 2),
                                          _rows_zeroed(a, drop).reshape(k, -1, i))
        if "bias" in want:  # (the same arithmetic for every K: a client alone or batched)
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


def _pad(a: Tensor, padding: tuple[int, ...]) -> Tensor:
    """``a`` (n, C, *spatial) zero-padded by ``padding`` on both sides of each spatial axis."""
    if not any(padding):
        return a
    return F.pad(a, [q for p in reversed(padding) for q in (p, p)])


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


def _per_example_conv(module: Any, a: Tensor, padding: tuple[int, ...], g: Tensor) -> Tensor:
    """``(n, *weight.shape)``: every example's weight gradient from one grouped convolution
    (examples as ``n * groups`` groups)."""
    n = a.shape[0]
    w = module.weight.shape
    gw = _WEIGHT_GRAD[a.dim() - 2](a.reshape(1, -1, *a.shape[2:]), (n * w[0], *w[1:]),
                                   g.reshape(1, -1, *g.shape[2:]), module.stride, padding,
                                   module.dilation, module.groups * n)
    return gw.view(n, *w)


def _conv_weight_sum(module: Any, ins: list[tuple[Tensor, tuple[int, ...]]], gs: list[Tensor],
                     f: Tensor, k: int) -> Tensor:
    """``(K, *weight.shape)``: per client, ``sum_i f_i`` (example i's weight gradient), as a
    weight-gradient convolution of the inputs with the scaled output gradients (the K clients
    as K groups)."""
    w = module.weight.shape
    out = None
    for (a, p), g in zip(ins, gs):
        fg = g * f.to(g.dtype).reshape(-1, *([1] * (g.dim() - 1)))
        if k > 1:  # (K B, C, ...) -> (B, K C, ...): client k's channels form group k
            b = a.shape[0] // k
            a = a.reshape(k, b, *a.shape[1:]).transpose(0, 1).reshape(b, -1, *a.shape[2:])
            fg = fg.reshape(k, b, *fg.shape[1:]).transpose(0, 1).reshape(b, -1, *fg.shape[2:])
        s = _WEIGHT_GRAD[a.dim() - 2](a, (k * w[0], *w[1:]), fg, module.stride, p,
                                      module.dilation, module.groups * k)
        out = s if out is None else out + s
    assert out is not None
    return out.reshape(k, *w)


def _conv(module: Any, calls: Calls, want: set[str]) -> Parts:
    k, b = calls[0][1].shape[:2]
    n = k * b
    ins = [_conv_input(module, x.flatten(0, 1)) for x, _ in calls]
    gs = [y.flatten(0, 1) for _, y in calls]
    nd = gs[0].dim() - 2
    w_shape = module.weight.shape
    o, i = w_shape[0], math.prod(w_shape[1:])
    grads: dict[str, Tensor] = {}
    if "bias" in want:
        bias = sum(y.flatten(2).sum(2) for y in gs)
        assert isinstance(bias, Tensor)
        grads["bias"] = bias.reshape(k, b, -1)
    if "weight" not in want:
        return materialized(grads)
    t = sum(math.prod(y.shape[2:]) for y in gs)
    if module.groups != 1 or nd > 2:  # grouped or 3d: the grouped convolution, kept
        whole = sum(_per_example_conv(module, x, p, y) for (x, p), y in zip(ins, gs))
        assert isinstance(whole, Tensor)
        grads["weight"] = whole.reshape(k, b, *w_shape)
        return materialized(grads)
    size = sum(x.numel() for x, _ in ins) + sum(y.numel() for y in gs)
    keep_per = False
    per: Tensor | None
    if ghost_route(t, o, i):
        sq_w = torch.empty(n, dtype=torch.float64, device=gs[0].device)
        for sl in _chunks(n, 2 * t * t + t * (i + o)):
            u = _cat([_unfold(x[sl], module, p) for x, p in ins], dim=2).transpose(1, 2)
            g = _cat([y[sl].flatten(2).transpose(1, 2) for y in gs], dim=1)
            sq_w[sl] = _gram_norms(u, g)
        per = None
    else:
        keep_per = n * o * i <= size
        per = torch.empty(n, o, i, dtype=gs[0].dtype, device=gs[0].device) if keep_per else None
        sq_w = torch.empty(n, dtype=gs[0].dtype, device=gs[0].device)
        patches = i <= PATCH_ENTRIES or t * i <= PATCH_ELEMENTS
        chunks = [slice(0, n)] if keep_per else _chunks(n, o * i + (t * i if patches else 0))
        padded = ins
        if patches and len(chunks) > 1:  # pad once, not once per chunk
            padded = [(_pad(x, p), (0,) * len(p)) for x, p in ins]
        for sl in chunks:
            if patches:
                u = _cat([_unfold(x[sl], module, p) for x, p in padded], dim=2)
                g = _cat([y[sl].flatten(2) for y in gs], dim=2)
                p_sl = torch.bmm(g, u.transpose(1, 2), out=None if per is None else per[sl])
                if per is None:  # a temporary: squared in place
                    sq_w[sl] = p_sl.mul_(p_sl).reshape(p_sl.shape[0], -1).sum(-1)
                    continue
            else:
                summed = sum(_per_example_conv(module, x[sl], p, y[sl]).reshape(-1, o, i)
                             for (x, p), y in zip(ins, gs))
                assert isinstance(summed, Tensor)
                p_sl = summed
                if per is not None:
                    per[sl] = p_sl
            sq_w[sl] = _sumsq(p_sl, 1)
        sq_w = sq_w.to(torch.float64)
    if keep_per:
        assert per is not None
        grads["weight"] = per.reshape(k, b, *w_shape)
        return materialized(grads)
    rest = materialized(grads) if grads else None
    sq = sq_w.reshape(k, b) + (rest.sq if rest is not None else 0)

    def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        out = rest.weighted(f, drop) if rest is not None else {}
        fz = f.reshape(-1)
        out["weight"] = _conv_weight_sum(
            module, [(_rows_zeroed(x, drop), p) for x, p in ins],
            [_rows_zeroed(y, drop) for y in gs], fz, k)
        return out

    return Parts(sq, weighted)


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
    del g, owner, inverse
    example = torch.div(keys, v, rounding_mode="floor")  # the (client, example) of each row
    sq = torch.zeros(k * b, dtype=torch.float64, device=rows.device)
    sq.index_add_(0, example, _sumsq(rows, 1).to(torch.float64))
    # row r of the result: client * V + id, with id = key - example * V
    target = torch.div(example, b, rounding_mode="floor") * v + (keys - example * v)

    def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        fr = f.reshape(-1)[example].to(rows.dtype).unsqueeze(1)
        r = rows if drop is None else rows.masked_fill(drop.reshape(-1)[example].unsqueeze(1), 0)
        out = torch.zeros(k * v, dim, dtype=rows.dtype, device=rows.device)
        out.index_add_(0, target, r * fr)
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
            size = x[0].numel() * 2
            parts["weight"] = _cat([reduce(g[sl] * normalise(x[sl]))
                                    for sl in _chunks(x.shape[0], size)], dim=0)
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


Rule = Callable[[Any, Any, set[str]], Parts]

#: Module type -> rule (exact types: a subclass may change the forward). ``out_proj`` of
#: ``nn.MultiheadAttention`` is a ``NonDynamicallyQuantizableLinear``, ``nn.Linear`` in all
#: but name.
RULES: dict[type, Rule] = {
    nn.Linear: _linear,
    NonDynamicallyQuantizableLinear: _linear,
    nn.Conv1d: _conv,
    nn.Conv2d: _conv,
    nn.Conv3d: _conv,
    nn.Embedding: _embedding,
    nn.LayerNorm: _layer_norm,
    nn.GroupNorm: _group_norm,
}
if hasattr(nn, "RMSNorm"):
    RULES[nn.RMSNorm] = _layer_norm

#: Module types whose rule takes every tensor input and output of a call: ``calls`` are
#: ``(inputs, output gradients)`` lists (one tensor per output; zeros where an output did not
#: reach the loss), not ``(a, g)`` pairs of the first input and output.
MULTI: set[type] = set()
