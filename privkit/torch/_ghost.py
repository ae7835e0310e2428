"""Ghost clipping for any module: record each parameterised module's calls, get the gradients
of the summed per-example losses with respect to their outputs, and hand ``(input, output
gradient)`` to the layer rules of :mod:`privkit.torch._layers` (or, for a module without a
rule, to ``torch.func``: ``vmap`` of ``vjp`` over the examples, for that module alone).

Two drivers share the recording and the rules:

- :func:`ghost` (one model): forward hooks record the calls and the *gradient edges* of the
  outputs, then one ``torch.autograd.grad`` to those edges (in-place operations after a
  layer do not change the edge recorded at its output).
- :func:`ghost_clients` (K models stacked on a client axis): the forward runs under
  ``vmap`` over the clients (``functional_call`` with each client's parameters); the hooks add
  a zero tensor to each output (a *perturbation*, one per client, example and call) and
  return the layers' inputs, so that one ``torch.autograd.grad`` to the perturbations gives
  every client's output gradients. A first forward on one example checks the model (as
  :func:`ghost` does) and gives the perturbations' shapes.

Hooks live only while a forward runs (:func:`recording`).

Both rely on each trainable parameter being used only inside the forward calls of the module
that holds it (the rules see those calls only). :func:`plan` refuses a parameter registered
under two modules; :func:`check_uses` walks the autograd graph of the loss and refuses a
parameter that any operation outside its module's calls consumes (a tied output layer's
``F.linear(h, emb.weight)``, ``nn.MultiheadAttention``'s use of ``out_proj.weight``): a
call's operations are the graph nodes reachable from its outputs' gradient edges without
passing its inputs' edges. :func:`func_only` names the layers that need ``torch.func`` for
the whole model (recurrent layers return their state batch second).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from privkit.errors import InvalidParameterError
from privkit.torch._layers import RULES, Parts, materialized

__all__ = ["ghost", "ghost_clients", "trace", "func_only", "check_uses"]

LossFn = Callable[[Any, Any], Tensor]
#: ``weighted(f, drop)``: the clipped sums ``{name: sum_i f_i g_i}``; rows marked in the bool
#: ``drop`` (None: none) contribute exactly 0, even where their values are NaN or inf.
Weighted = Callable[[Tensor, "Tensor | None"], dict[str, Tensor]]


@dataclass
class _Call:
    """One call of a planned module: its inputs, the output leaves that require grad
    (positions ``pos`` among the output's pytree leaves) with their gradient edges, and the
    graph nodes of its tensor inputs' gradient edges (``ins``)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    pos: list[int]
    outs: list[Tensor]
    edges: list[Any]
    ins: list[Any] = field(default_factory=list)


@dataclass
class _Entry:
    qual: str
    module: nn.Module
    own: dict[str, nn.Parameter]
    calls: list[_Call] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"module {self.qual or type(self.module).__name__!r}"

    def full(self, name: str) -> str:
        return f"{self.qual}.{name}" if self.qual else name


_USE_FUNC = "(use GradMethod.FUNC)"


def recurrent(m: nn.Module) -> bool:
    """Whether ``m`` is a recurrent layer with trainable parameters (``nn.RNN``,
    ``nn.LSTM``, ``nn.GRU``): it returns its final state with the batch on dimension 1,
    which the per-module path cannot split per example."""
    return isinstance(m, nn.RNNBase) and any(p.requires_grad for p in m.parameters())


def func_only(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The first layer (qualified name, layer) that needs ``torch.func`` for the whole model
    (:func:`recurrent`), or None."""
    for qual, m in module.named_modules():
        if recurrent(m):
            return qual or type(module).__name__, m
    return None


def plan(module: nn.Module) -> list[_Entry]:
    """The modules holding trainable parameters (each parameter held by one module)."""
    seen: dict[int, str] = {}
    out = []
    for qual, m in module.named_modules():
        own = {n: p for n, p in m._parameters.items() if p is not None and p.requires_grad}
        for n, p in own.items():
            full = f"{qual}.{n}" if qual else n
            if id(p) in seen:
                raise InvalidParameterError(
                    f"parameter {full!r}", f"shared with {seen[id(p)]!r}",
                    f"used by one module only for method=GradMethod.GHOST {_USE_FUNC}")
            seen[id(p)] = full
        if own:
            out.append(_Entry(qual, m, own))
    return out


@contextmanager
def recording(entries: list[_Entry], hook_for: Callable[[_Entry, int], Any]) -> Iterator[None]:
    """Forward hooks ``hook_for(entry, index)`` on the planned modules while open."""
    handles = [e.module.register_forward_hook(hook_for(e, i), with_kwargs=True)
               for i, e in enumerate(entries)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _record_edges(entry: _Entry, _: int) -> Callable[..., None]:
    def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        leaves = [out] if isinstance(out, Tensor) else tree_flatten(out)[0]
        pos = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
        outs = [leaves[i] for i in pos]
        ins = args if not kwargs and all(isinstance(a, Tensor) for a in args) else tuple(
            tree_flatten((args, kwargs))[0])
        entry.calls.append(_Call(args, kwargs, pos, outs, [get_gradient_edge(t) for t in outs],
                                 [t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node
                                  for t in ins if isinstance(t, Tensor) and t.requires_grad]))
    return hook


def _inside(entry: _Entry) -> set[Any]:
    """The autograd nodes of ``entry``'s calls: reachable from their outputs' gradient edges
    without passing their inputs' edges (a module that writes to its input in place moves
    that edge into its own call, and its parameters' uses then count as outside it: such a
    module is for ``FUNC`` anyway, as ``torch.func`` cannot follow the write per module)."""
    inside: set[Any] = set()
    for call in entry.calls:
        stop = set(call.ins)
        stack = [e.node for e in call.edges if e.node not in stop and e.node not in inside]
        inside.update(stack)
        while stack:
            for nxt, _ in stack.pop().next_functions:
                if nxt is not None and nxt not in stop and nxt not in inside:
                    inside.add(nxt)
                    stack.append(nxt)
    return inside


_ACCUMULATE_GRAD: list[Any] = []


def _accumulate_grad() -> Any:
    """The type of the autograd node that accumulates a leaf's gradient."""
    if not _ACCUMULATE_GRAD:
        _ACCUMULATE_GRAD.append(type(get_gradient_edge(torch.zeros(1, requires_grad=True)).node))
    return _ACCUMULATE_GRAD[0]


def check_uses(entries: list[_Entry], root: Any) -> None:
    """Refuse a planned parameter that an operation outside its module's calls consumes.

    One walk of the autograd graph from ``root`` (the loss's ``grad_fn``) finds every node
    that consumes a parameter (has an edge to its ``AccumulateGrad`` node); each must be one
    of its module's own nodes (:func:`_inside`). Exact for what the gradient sees: a use
    through ``F.linear(h, emb.weight)``, a view, a copy or a module that never calls the
    holder; a use under ``no_grad`` or of ``.detach()`` contributes no gradient and is
    not one.

    Raises:
        InvalidParameterError: naming the parameter and :attr:`GradMethod.FUNC`.
    """
    owned = {id(p) for entry in entries for p in entry.own.values()}
    if root is None or not owned:
        return
    acc = _accumulate_grad()
    users: dict[int, list[Any]] = {}
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if type(nxt) is acc:  # a leaf: a parameter's (or an input's) AccumulateGrad
                key = id(nxt.variable)
                if key in owned:
                    users.setdefault(key, []).append(node)
            elif nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    inside: set[Any] | None
    for entry in entries:  # the first in the model's order is named
        inside = None
        for n, p in entry.own.items():
            nodes = users.get(id(p), [])
            if nodes and inside is None:
                inside = _inside(entry)
            if inside is None or all(node in inside for node in nodes):
                continue
            where = ("which is never called" if not entry.calls else
                     "e.g. by a tied layer's F.linear(h, weight), or by an in-place write "
                     "to the module's input")
            raise InvalidParameterError(
                f"parameter {entry.full(n)!r}",
                f"used outside the forward of {entry.label} ({type(entry.module).__name__}), "
                f"{where}",
                f"used by its own module only for method=GradMethod.GHOST {_USE_FUNC}")


def _check_losses(losses: Any, shape: tuple[int, ...]) -> None:
    if not (isinstance(losses, Tensor) and tuple(losses.shape) == shape):
        raise InvalidParameterError("loss_fn", getattr(losses, "shape", losses),
                                    f"per-example losses of shape {shape} (reduction='none')")


def _traced(module: nn.Module, inputs: tuple[Any, ...], targets: Any, loss_fn: LossFn,
            b: int) -> tuple[list[_Entry], Tensor, list[list[Tensor | None]]]:
    """Forward with the calls recorded; checks; the output gradients of every call."""
    entries = plan(module)
    with recording(entries, _record_edges), torch.enable_grad():
        losses = loss_fn(module(*inputs), targets)
        total = losses.sum()
    _check_losses(losses, (b,))
    check_uses(entries, total.grad_fn)
    for entry in entries:
        for call in entry.calls:
            for o in call.outs:
                if o.dim() == 0 or o.shape[0] != b:
                    raise _batch_second(entry, tuple(o.shape), b)
    edges = [e for entry in entries for call in entry.calls for e in call.edges]
    found = torch.autograd.grad(total, edges, allow_unused=True) if edges else ()
    it = iter(found)
    return entries, losses, [[next(it) for _ in call.edges] for e in entries for call in e.calls]


def _batch_second(entry: _Entry, shape: tuple[int, ...], b: int) -> InvalidParameterError:
    return InvalidParameterError(
        entry.label, f"{type(entry.module).__name__} with an output of shape {shape}",
        f"a module whose outputs hold the batch ({b} examples) on dimension 0 for "
        f"method=GradMethod.GHOST, which splits them per example {_USE_FUNC}")


def _present(g: Tensor | None) -> Tensor:
    """A layer rule's output gradient (its one output reached the loss)."""
    assert g is not None
    return g


def _fallback_one(module: nn.Module, own: dict[str, Tensor], leaves: list[Any],
                  dims: list[int | None], spec: Any, pos: list[int], gs: list[Tensor],
                  inner: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """``{name: (B, *shape)}``: per-example gradients of ``module``'s own parameters, for one
    set of parameters, by ``vmap`` over the examples of ``vjp``; ``inner``: its submodules'
    parameters where they are not the module's own (one client's, in the batched form)."""

    def one(xs: list[Any], g1: list[Tensor]) -> dict[str, Tensor]:
        xs = [x.unsqueeze(0) if d == 0 else x for x, d in zip(xs, dims)]
        a, kw = tree_unflatten(xs, spec)

        def f(q: dict[str, Tensor]) -> tuple[Tensor, ...]:
            out = tree_flatten(functional_call(module, (q, inner or {}), tuple(a), kw))[0]
            return tuple(out[i] for i in pos)

        return vjp(f, own)[1](tuple(g.unsqueeze(0) for g in g1))[0]

    return vmap(one, in_dims=(dims, 0))(leaves, gs)


def _fallback_guard(entry: _Entry, fn: Callable[..., dict[str, Tensor]], *args: Any
                    ) -> dict[str, Tensor]:
    """``fn(*args)``, a ``torch.func`` computation of ``entry``'s per-example gradients; a
    failure names the module."""
    try:
        with torch.no_grad():  # torch.func differentiates; nothing else records a graph
            return fn(*args)
    except RuntimeError as err:
        raise InvalidParameterError(
            entry.label, type(entry.module).__name__,
            f"a module torch.func can take per-example gradients of ({err}); "
            f"use another layer {_USE_FUNC}") from err


def _batch_dims(leaves: list[Any], b: int, lead: int) -> list[int | None]:
    return [0 if isinstance(x, Tensor) and x.dim() > lead and x.shape[lead] == b else None
            for x in leaves]


def _collect(entries: list[_Entry], parts: list[tuple[_Entry, Parts]], k: int, b: int,
             device: Any) -> tuple[Tensor, Weighted]:
    sq = torch.zeros(k, b, dtype=torch.float64, device=device)
    for _, p in parts:
        sq = sq + p.sq

    def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        return {entry.full(n): v for entry, p in parts for n, v in p.weighted(f, drop).items()}

    return sq, weighted


def ghost(module: nn.Module, inputs: tuple[Any, ...], targets: Any, loss_fn: LossFn,
          b: int) -> tuple[Tensor, Weighted]:
    """One model: per-example squared norms ``(B,)`` float64 and ``weighted(f (B,), drop)
    -> {name: sum_i f_i g_i}`` over the trainable parameters of the modules that were called
    (:data:`Weighted`)."""
    entries, losses, grads = _traced(module, inputs, targets, loss_fn, b)
    parts: list[tuple[_Entry, Parts]] = []
    it = iter(grads)
    for entry in entries:
        calls = [(c, next(it)) for c in entry.calls]
        calls = [(c, gs) for c, gs in calls if any(g is not None for g in gs)]
        if not calls:
            continue
        rule = RULES.get(type(entry.module))
        if rule is not None:
            pairs = [(c.args[0].detach().unsqueeze(0), _present(gs[0]).unsqueeze(0))
                     for c, gs in calls]
            parts.append((entry, rule(entry.module, pairs, set(entry.own))))
            continue
        own = {n: p.detach() for n, p in entry.own.items()}
        total: dict[str, Tensor] = {}
        for c, gs in calls:
            leaves, spec = tree_flatten((c.args, c.kwargs))
            leaves = [x.detach() if isinstance(x, Tensor) else x for x in leaves]
            cot = [g if g is not None else torch.zeros_like(o) for o, g in zip(c.outs, gs)]
            per = _fallback_guard(entry, _fallback_one, entry.module, own, leaves,
                                  _batch_dims(leaves, b, 0), spec, c.pos, cot)
            for n, v in per.items():
                total[n] = total[n] + v if n in total else v
        parts.append((entry, materialized({n: v.unsqueeze(0) for n, v in total.items()})))
    sq, weighted = _collect(entries, parts, 1, b, losses.device)

    def weighted1(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        d = None if drop is None else drop.unsqueeze(0)
        return {n: v[0] for n, v in weighted(f.unsqueeze(0), d).items()}

    return sq[0], weighted1


# ------------------------------------------------------------------------------ K clients
class _Inject:
    """What the hooks of one vmapped forward share: the perturbations of the current call of
    each module (per client: vmap's slices), and the inputs they hand back."""

    def __init__(self, entries: list[_Entry]) -> None:
        self.entries = entries
        self.eps: list[Tensor] = []
        self.count = [0] * len(entries)
        self.saved: list[Tensor] = []
        self.meta: list[tuple[int, int, Any, list[Any], list[int | None]]] = []
        #: (entry, call) -> index of its first perturbation (entries' order, as created)
        self.offset: dict[tuple[int, int], int] = {}
        at = 0
        for e, entry in enumerate(entries):
            for c, call in enumerate(entry.calls):
                self.offset[e, c] = at
                at += len(call.pos)

    def hook_for(self, entry: _Entry, e: int) -> Callable[..., Any]:
        ruled = type(entry.module) in RULES

        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
            c = self.count[e]
            self.count[e] += 1
            if c >= len(entry.calls):
                raise InvalidParameterError(
                    entry.label, f"call {c + 1}", f"called as often for every batch as for one "
                    f"example ({len(entry.calls)}) for method=GradMethod.GHOST {_USE_FUNC}")
            leaves, spec = tree_flatten(out)
            for j, p in enumerate(entry.calls[c].pos):
                eps = self.eps[self.offset[e, c] + j]
                if not isinstance(leaves[p], Tensor) or leaves[p].shape != eps.shape:
                    # one client's output is (B, *the traced shape[1:]) when the batch leads
                    raise _batch_second(entry, tuple(getattr(leaves[p], "shape", ())),
                                        int(eps.shape[0]) if eps.dim() else 0)
                leaves[p] = leaves[p] + eps
            ins, in_spec = tree_flatten((args[:1], {}) if ruled else (args, kwargs))
            tensors = [x for x in ins if isinstance(x, Tensor)]
            b = int(leaves[entry.calls[c].pos[0]].shape[0]) if entry.calls[c].pos else -1
            self.meta.append((e, c, in_spec, [None if isinstance(x, Tensor) else x for x in ins],
                              _batch_dims(ins, b, 0)))
            self.saved.extend(tensors)
            return tree_unflatten(leaves, spec)

        return hook


def trace(module: nn.Module, x1: Tensor, y1: Tensor, loss_fn: LossFn) -> list[_Entry]:
    """The modules' calls on one example ``x1 (1, ...)``, checked as :func:`ghost` checks
    them: what :func:`ghost_clients` perturbs (the same for every batch of such inputs)."""
    return _traced(module, (x1,), y1, loss_fn, 1)[0]


def ghost_clients(module: nn.Module, params: Mapping[str, Tensor], rest: Mapping[str, Tensor],
                  x: Tensor, y: Tensor, loss_fn: LossFn, entries: list[_Entry] | None = None
                  ) -> tuple[Tensor, Weighted]:
    """K models: per-example squared norms ``(K, B)`` float64 and ``weighted(f (K, B), drop)
    -> {name: (K, *shape)}`` clipped sums (:data:`Weighted`), for stacked ``params``
    ``{name: (K, *shape)}`` on inputs ``x (K, B, ...)`` and targets ``y (K, B, ...)``;
    ``entries`` from :func:`trace` (traced here if None)."""
    k, b = x.shape[:2]
    if entries is None:
        entries = trace(module, x[0, :1], y[0, :1], loss_fn)
    eps = [torch.zeros(k, b, *o.shape[1:], dtype=o.dtype, device=o.device, requires_grad=True)
           for entry in entries for call in entry.calls for o in call.outs]
    ctx = _Inject(entries)

    def forward(p: dict[str, Tensor], xk: Tensor, *eps_k: Tensor) -> tuple[Any, ...]:
        ctx.eps, ctx.count, ctx.saved, ctx.meta = list(eps_k), [0] * len(entries), [], []
        return functional_call(module, (p, dict(rest)), (xk,)), tuple(ctx.saved)

    with recording(entries, ctx.hook_for), torch.enable_grad():
        # random layers (dropout) draw from torch's global generator, differently per client
        out, saved = vmap(forward, randomness="different")(dict(params), x, *eps)
        # per-example losses of all K B examples at once, outside vmap (much faster there)
        flat = tree_flatten(y)
        losses = loss_fn(tree_unflatten([t.flatten(0, 1) for t in tree_flatten(out)[0]],
                                        tree_flatten(out)[1]),
                         tree_unflatten([t.flatten(0, 1) for t in flat[0]], flat[1]))
        _check_losses(losses, (k * b,))
        total = losses.sum()
    for e, entry in enumerate(entries):
        if ctx.count[e] != len(entry.calls):
            raise InvalidParameterError(entry.label, f"{ctx.count[e]} calls", f"called as often "
                                        f"for every batch as for one example ({len(entry.calls)})"
                                        f" for method=GradMethod.GHOST {_USE_FUNC}")
    grads = torch.autograd.grad(total, eps, allow_unused=True)
    gs = [g if g is not None else torch.zeros_like(z) for g, z in zip(grads, eps)]
    return _clients_parts(entries, ctx, saved, gs, params, k, b, x.device)


def _clients_parts(entries: list[_Entry], ctx: _Inject, saved: tuple[Tensor, ...],
                   gs: list[Tensor], params: Mapping[str, Tensor], k: int, b: int,
                   device: Any) -> tuple[Tensor, Weighted]:
    saved_it = iter(saved)
    calls: dict[int, list[tuple[list[Any], Any, list[int | None], list[Tensor], list[int]]]] = {}
    for e, c, in_spec, leaves, dims in ctx.meta:
        full = [next(saved_it) if x is None else x for x in leaves]
        pos = entries[e].calls[c].pos
        if pos:
            cot = gs[ctx.offset[e, c]:ctx.offset[e, c] + len(pos)]
            calls.setdefault(e, []).append((full, in_spec, dims, cot, pos))
    parts: list[tuple[_Entry, Parts]] = []
    for e, entry in enumerate(entries):
        if e not in calls:
            continue
        rule = RULES.get(type(entry.module))
        if rule is not None:
            pairs = [(leaves[0].detach(), cot[0]) for leaves, _, _, cot, _ in calls[e]]
            parts.append((entry, rule(entry.module, pairs, set(entry.own))))
            continue
        own = {n: params[entry.full(n)] for n in entry.own}
        inner = {n: params[entry.full(n)] for n, _ in entry.module.named_parameters()
                 if n not in own and entry.full(n) in params}
        total: dict[str, Tensor] = {}
        for leaves, spec, dims, cot, pos in calls[e]:
            per = _fallback_guard(entry, _fallback_clients, entry.module, own, inner, leaves,
                                  spec, dims, cot, pos)
            for n, v in per.items():
                total[n] = total[n] + v if n in total else v
        parts.append((entry, materialized(total)))
    return _collect(entries, parts, k, b, device)


def _fallback_clients(module: nn.Module, own: dict[str, Tensor], inner: dict[str, Tensor],
                      leaves: list[Any], spec: Any, dims: list[int | None], cot: list[Tensor],
                      pos: list[int]) -> dict[str, Tensor]:
    """:func:`_fallback_one` for every client: ``vmap`` over the client axis of the
    parameters, of the tensor leaves (stacked by the vmapped forward) and of the output
    gradients."""
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]

    def per_client(q: dict[str, Tensor], sub: dict[str, Tensor], ts: list[Tensor],
                   g1: list[Tensor]) -> dict[str, Tensor]:
        full = list(leaves)
        for i, t in zip(tensors, ts):
            full[i] = t
        return _fallback_one(module, q, full, dims, spec, pos, g1, sub)

    return vmap(per_client)(own, inner, [leaves[i].detach() for i in tensors], cot)
