"""Ghost clipping for ``nn.MultiheadAttention`` (and so for ``nn.TransformerEncoderLayer``,
``nn.TransformerDecoderLayer`` and their stacks).

``nn.MultiheadAttention`` computes its in-projection and out-projection inside
``F.multi_head_attention_forward``, from its parameters ``in_proj_weight`` (or
``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``), ``in_proj_bias``, ``bias_k``,
``bias_v`` and ``out_proj.weight``/``out_proj.bias``, without calling ``out_proj``: no rule
sees those layers' inputs and output gradients. While the ghost path records a forward
(:func:`patched`), each attention module of exact type ``nn.MultiheadAttention`` therefore runs
:func:`mha_forward` instead: the same computation (masks, ``bias_k``/``bias_v``,
``add_zero_attn``, dropout, ``need_weights``, ``is_causal``, ``batch_first``), decomposed so
that every parameter is used inside one call of a module with a rule:

- the in-projection is a call of :class:`InProjection` (one per attention module), a linear
  layer over the sequence: its inputs are the query (and, when they are other tensors, the key
  and value; the arity says which are the same tensor, as ``nn.MultiheadAttention`` itself
  tells self-attention from encoder-decoder attention), its outputs their projections. Its
  rule is the linear rule on the weight's row blocks (:func:`_in_projection`): example i's
  gradient of the q rows is ``sum_t gq_it x_it^T`` (all calls' positions together), so the
  squared norm is the sum over blocks of each block's ghost norm or materialised norm
  (:func:`privkit.torch._layers.ghost_route`); blocks that see the same input in every call
  form one block;
- the out-projection (``out_proj.weight``, ``out_proj.bias``) is a call of
  :class:`OutProjection`, the linear rule;
- ``bias_k`` and ``bias_v`` are the outputs of a call of :class:`BiasKV`, broadcast over the
  examples: example i's gradient is its own row of their output gradient.

The graph check still applies: a parameter of an attention module used anywhere else (tied)
is refused by name. The forward runs only during the ghost path's recording; the module and
its parameters are never changed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from privkit.errors import InvalidParameterError
from privkit.torch._layers import MULTI, RULES, Parts, _linear, _outer, materialized

__all__ = ["InProjection", "OutProjection", "BiasKV", "mha_forward", "patched", "proxies"]

_FUNC = "(use GradMethod.FUNC)"


class _Proxy(nn.Module):
    """A stand-in module for part of an attention module's forward (holds no parameters:
    it reads its owner's, so that ``functional_call`` on the model swaps them)."""

    owner: Any  # an nn.MultiheadAttention
    others: Any  # the in-projection's OutProjection and BiasKV (set by the plan)

    def __init__(self, owner: nn.MultiheadAttention) -> None:
        super().__init__()
        self.__dict__["owner"] = owner  # not a submodule: no second path to its parameters


class InProjection(_Proxy):
    """The in-projection of one ``nn.MultiheadAttention``, batch first: ``(x,)`` -> the packed
    ``(B, T, 3E)`` projection (self-attention); ``(q, kv)`` -> ``(B, T, E)``, ``(B, S, 2E)``
    (key is value); ``(q, k, v)`` -> three projections (or always, with separate weights)."""

    def forward(self, *xs: Tensor) -> tuple[Tensor, ...]:
        m = self.owner
        e = m.embed_dim
        b = m.in_proj_bias
        if m._qkv_same_embed_dim:
            w = m.in_proj_weight
            rows = _blocks(len(xs), e)
            return tuple(F.linear(x, w[r0:r1], None if b is None else b[r0:r1])
                         for x, (r0, r1) in zip(xs, rows))
        ws = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
        return tuple(F.linear(x, w, None if b is None else b[j * e:(j + 1) * e])
                     for j, (x, w) in enumerate(zip(xs, ws)))


class OutProjection(_Proxy):
    """The out-projection of one ``nn.MultiheadAttention`` (``out_proj.weight``,
    ``out_proj.bias``, as ``F.multi_head_attention_forward`` uses them): ``(B, T, E)`` views
    of sequence-first contiguous tensors in and out, so that the output is laid out in
    memory as the module's own (a later dropout draws the same mask)."""

    def forward(self, ctx: Tensor) -> Tensor:
        p = self.owner.out_proj
        return F.linear(ctx.transpose(0, 1), p.weight, p.bias).transpose(0, 1)


class BiasKV(_Proxy):
    """``bias_k`` and ``bias_v`` of one ``nn.MultiheadAttention``, one row per example of
    ``like`` ``(B, S, E)``: ``(B, 1, E)`` each."""

    def forward(self, like: Tensor) -> tuple[Tensor, Tensor]:
        m = self.owner
        b, e = like.shape[0], m.embed_dim
        return m.bias_k.reshape(1, 1, e).expand(b, 1, e), m.bias_v.reshape(1, 1, e).expand(b, 1, e)


def _blocks(arity: int, e: int) -> list[tuple[int, int]]:
    """The rows of the packed ``(3E, E)`` weight that each of ``arity`` inputs projects."""
    cuts = {1: [0, 3], 2: [0, 1, 3], 3: [0, 1, 2, 3]}[arity]
    return [(e * c0, e * c1) for c0, c1 in zip(cuts, cuts[1:])]


def proxies(m: nn.MultiheadAttention) -> tuple[InProjection, OutProjection, BiasKV]:
    """Fresh proxies for ``m`` (one plan, i.e. one batch or one run, uses one set)."""
    return InProjection(m), OutProjection(m), BiasKV(m)


def _shape_error(what: str, shape: Any, need: str) -> InvalidParameterError:
    return InvalidParameterError(what, shape, f"{need} for GradMethod.GHOST's attention rule "
                                 f"{_FUNC}")


def mha_forward(m: nn.MultiheadAttention, proj: InProjection, out_proj: OutProjection,
                bkv: BiasKV, query: Tensor,
                key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False
                ) -> tuple[Tensor, Tensor | None]:
    """``m.forward``, decomposed (module docstring): the same outputs, computed batch first,
    with the in-projection a call of ``proj``, ``bias_k``/``bias_v`` a call of ``bkv`` and
    the out-projection a call of ``out_proj``."""
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise _shape_error("query", tuple(query.shape), "batched (3-D) query, key and value")
    if query.is_nested or key.is_nested or value.is_nested:
        raise _shape_error("query", "a nested tensor", "dense tensors")
    # as nn.MultiheadAttention.forward, then F.multi_head_attention_forward
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask), other_name="attn_mask", target_type=query.dtype)
    attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                  other_name="", target_type=query.dtype, check_other=False)
    same_kv, same_qk = key is value, query is key
    if not m.batch_first:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    b, t, e = query.shape
    s = key.shape[1]
    h = m.num_heads
    hd = e // h
    if e != m.embed_dim:
        raise _shape_error("query", tuple(query.shape), f"embedding dimension {m.embed_dim}")
    if key.shape[0] != b or value.shape[:2] != key.shape[:2]:
        raise _shape_error("key", tuple(key.shape), "key and value of the query's batch and "
                           "of one sequence length")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (b, s):
        raise _shape_error("key_padding_mask", tuple(key_padding_mask.shape),
                           f"a ({b}, {s}) mask")
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the "
                           "Transformer module method `generate_square_subsequent_mask` to "
                           "create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # SDPA's is_causal instead
    elif key_padding_mask is not None:
        is_causal = False
    if attn_mask is not None:
        if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (t, s):
            attn_mask = attn_mask.reshape(1, 1, t, s)
        elif attn_mask.dim() == 3 and tuple(attn_mask.shape) == (b * h, t, s):
            attn_mask = attn_mask.reshape(b, h, t, s)
        else:
            raise _shape_error("attn_mask", tuple(attn_mask.shape),
                               f"a ({t}, {s}) or ({b * h}, {t}, {s}) mask")
    # the in-projection
    if not m._qkv_same_embed_dim:
        q, k, v = proj(query, key, value)
    elif same_kv and same_qk:
        q, k, v = proj(query)[0].split(e, dim=-1)
    elif same_kv:
        q, kv = proj(query, key)
        k, v = kv.split(e, dim=-1)
    else:
        q, k, v = proj(query, key, value)
    if m.bias_k is not None and m.bias_v is not None:
        bk, bv = bkv(k)
        k, v = torch.cat([k, bk], 1), torch.cat([v, bv], 1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    elif m.bias_k is not None or m.bias_v is not None:
        raise _shape_error("bias_k", "one of bias_k and bias_v", "both or neither")
    q = q.reshape(b, t, h, hd).transpose(1, 2)
    k = k.reshape(b, -1, h, hd).transpose(1, 2)
    v = v.reshape(b, -1, h, hd).transpose(1, 2)
    if m.add_zero_attn:
        zeros = torch.zeros(b, h, 1, hd, dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], 2), torch.cat([v, zeros], 2)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    s = k.shape[2]
    if key_padding_mask is not None:
        kpm = key_padding_mask.reshape(b, 1, 1, s)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    dropout_p = m.dropout if m.training else 0.0
    weights = None
    if need_weights or torch._C._functorch.is_batchedtensor(q):  # explicit (also under vmap)
        if is_causal and attn_mask is None:
            attn_mask = torch.zeros(t, s, dtype=q.dtype, device=q.device).masked_fill_(
                torch.ones(t, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        scores = torch.matmul(q * math.sqrt(1.0 / float(hd)), k.transpose(-2, -1))
        if attn_mask is not None:
            scores = scores + attn_mask
        w = F.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            w = F.dropout(w, p=dropout_p)
        ctx = torch.matmul(w, v)
        if need_weights:
            weights = w.mean(dim=1) if average_attn_weights else w
    else:
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
    # (T, B, E) contiguous, as the module's own: its out-projection and output
    out = out_proj(ctx.permute(2, 0, 1, 3).reshape(t, b, e).transpose(0, 1))
    return (out if m.batch_first else out.transpose(0, 1)), weights


@contextmanager
def patched(sets: list[tuple[InProjection, OutProjection, BiasKV]]) -> Iterator[None]:
    """Each proxies' owner runs :func:`mha_forward` with them while open."""
    saved = []
    for proj, out_proj, bkv in sets:
        m = proj.owner
        saved.append((m, m.__dict__.get("forward")))

        def forward(*args: Any, _m: Any = m, _p: Any = proj, _o: Any = out_proj, _b: Any = bkv,
                    **kwargs: Any) -> tuple[Tensor, Tensor | None]:
            return mha_forward(_m, _p, _o, _b, *args, **kwargs)

        m.__dict__["forward"] = forward
    try:
        yield
    finally:
        for m, old in saved:
            if old is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = old


# ------------------------------------------------------------------------------ rules
def _in_projection(module: InProjection, calls: list[tuple[list[Tensor], list[Tensor]]],
                   want: set[str]) -> Parts:
    """The linear rule on the in-projection's row blocks (module docstring)."""
    m = module.owner
    e = m.embed_dim
    k, b = calls[0][1][0].shape[:2]
    arities = {len(xs) for xs, _ in calls}
    packed = m._qkv_same_embed_dim
    # blocks: (rows of the packed weight / index of the separate weight, [(a, g)]) where every
    # call's input for those rows is one tensor
    if not packed or len(arities) == 1:
        rows = _blocks(arities.pop() if packed else 3, e)
        pairs: list[list[tuple[Tensor, Tensor]]] = [[] for _ in rows]
        for xs, gs in calls:
            for j, (x, g) in enumerate(zip(xs, gs)):
                pairs[j].append((x, g))
    else:  # one block per q, k, v (a call of arity 1 or 2 split into them)
        rows = _blocks(3, e)
        pairs = [[], [], []]
        for xs, gs in calls:
            at = 0  # the q, k, v blocks an output covers follow those of the outputs before
            for x, g in zip(xs, gs):
                for c in range(g.shape[-1] // e):
                    pairs[at].append((x, g[..., c * e:(c + 1) * e]))
                    at += 1
    weight_names = (["in_proj_weight"] * len(rows) if packed
                    else ["q_proj_weight", "k_proj_weight", "v_proj_weight"])
    sq = torch.zeros(k, b, dtype=torch.float64, device=calls[0][1][0].device)
    sums: list[Any] = []
    for (r0, r1), name, blk in zip(rows, weight_names, pairs):
        sub = {"weight"} if name in want else set()
        if "in_proj_bias" in want:
            sub.add("bias")
        if not sub or not blk:
            sums.append(None)
            continue
        i = blk[0][0].shape[-1]
        a = torch.cat([x.reshape(k * b, -1, i) for x, _ in blk], dim=1)
        g = torch.cat([y.reshape(k * b, -1, r1 - r0) for _, y in blk], dim=1)
        part_sq, part_w = _outer(a, g, sub, k)
        sq = sq + part_sq
        sums.append(part_w)

    def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        got = [None if w is None else w(f, drop) for w in sums]
        out: dict[str, Tensor] = {}
        dtype = calls[0][1][0].dtype
        device = f.device
        if packed and "in_proj_weight" in want:
            out["in_proj_weight"] = torch.cat([
                d["weight"] if d is not None and "weight" in d
                else torch.zeros(k, r1 - r0, e, dtype=dtype, device=device)
                for d, (r0, r1) in zip(got, rows)], dim=1)
        if not packed:
            for name, d in zip(weight_names, got):
                if name in want:
                    assert d is not None
                    out[name] = d["weight"]
        if "in_proj_bias" in want:
            out["in_proj_bias"] = torch.cat([
                d["bias"] if d is not None
                else torch.zeros(k, r1 - r0, dtype=dtype, device=device)
                for d, (r0, r1) in zip(got, rows)], dim=1)
        return out

    return Parts(sq, weighted)


def _out_projection(module: OutProjection, calls: list[tuple[Tensor, Tensor]],
                    want: set[str]) -> Parts:
    """The linear rule, under the names ``out_proj.weight`` and ``out_proj.bias``."""
    inner = _linear(module.owner.out_proj, calls, {n[len("out_proj."):] for n in want})

    def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        return {f"out_proj.{n}": v for n, v in inner.weighted(f, drop).items()}

    return Parts(inner.sq, weighted)


def _bias_kv(module: BiasKV, calls: list[tuple[list[Tensor], list[Tensor]]],
             want: set[str]) -> Parts:
    """Example i's gradient of ``bias_k`` (``bias_v``) is row i of the output gradient."""
    k, b = calls[0][1][0].shape[:2]
    grads: dict[str, Tensor] = {}
    for _, gs in calls:
        for name, g in zip(("bias_k", "bias_v"), gs):
            if name in want:
                v = g.reshape(k, b, 1, 1, -1)
                grads[name] = grads[name] + v if name in grads else v
    return materialized(grads)


RULES[InProjection] = _in_projection
RULES[OutProjection] = _out_projection
RULES[BiasKV] = _bias_kv
MULTI.update({InProjection, BiasKV})
