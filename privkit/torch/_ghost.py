"""Ghost clipping for any module: record each parameterised module's calls, get the gradients
of the summed per-example losses with respect to their outputs, and hand ``(input, output
gradient)`` to the layer rules of :mod:`privkit.torch._layers` (or, for a module without a
rule, to ``torch.func``: ``vmap`` of ``vjp`` over the examples, for that module alone).

Two drivers share the recording and the rules:

- :func:`ghost` (one model): forward hooks record the calls and the *gradient edges* of the
  outputs; one ``torch.autograd.grad`` then runs the backward pass to those outputs (never to
  the parameters). A layer with a rule and a large output gets a zero scalar added to it (a
  *tap*): the backward is asked for the taps' gradients, and a hook on each tapped output's
  node hands its gradient to the layer's rule as soon as the backward produces it, so the
  rule keeps only what its clipped sum needs (:mod:`privkit.torch._layers`) and the output
  gradient is freed, as a plain backward frees it: at most one large output gradient is
  alive at a time. Other outputs' gradients are returned by the backward and ruled after it.
  In-place operations after a layer do not change the edge recorded at its output.
- :func:`ghost_clients` (K models stacked on a client axis): the forward runs under
  ``vmap`` over the clients (``functional_call`` with each client's parameters); the hooks add
  a zero tensor to each output (a *perturbation*, one per client, example and call) and
  return the layers' inputs, so that one ``torch.autograd.grad`` to the perturbations gives
  every client's output gradients. A first forward on one example checks the model (as
  :func:`ghost` does) and gives the perturbations' shapes.

Hooks live only while a forward runs (:func:`recording`); so does the decomposed forward of
``nn.MultiheadAttention`` (:mod:`privkit.torch._attention`), whose in-projection,
``bias_k``/``bias_v`` and ``out_proj`` become calls of modules with rules.

Both rely on each trainable parameter being used only inside the forward calls of the module
that holds it (the rules see those calls only). :func:`plan` refuses a parameter registered
under two modules; :func:`check_uses` walks the autograd graph of the loss and refuses a
parameter that any operation outside its module's calls consumes (a tied output layer's
``F.linear(h, emb.weight)``): a call's operations are the graph nodes reachable from its
outputs' gradient edges without passing its inputs' edges. The rules split a call's output
per example along dimension 0: an output whose first dimension is not the batch is refused,
and where another of its dimensions has the batch's size (a sequence-first layer whose
sequence is as long as the batch), a forward on one example decides which dimension is the
batch. :func:`func_only` names the layers that need ``torch.func`` for the whole model
(recurrent layers return their state batch second).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from privkit.errors import InvalidParameterError
from privkit.torch._attention import InProjection, patched, proxies
from privkit.torch._layers import MULTI, RULES, Parts, materialized

__all__ = ["ghost", "ghost_clients", "trace", "func_only", "check_uses"]

LossFn = Callable[[Any, Any], Tensor]
#: ``weighted(f, drop)``: the clipped sums ``{name: sum_i f_i g_i}``; rows marked in the bool
#: ``drop`` (None: none) contribute exactly 0, even where their values are NaN or inf.
Weighted = Callable[[Tensor, "Tensor | None"], dict[str, Tensor]]

#: A call of a layer with a rule whose outputs hold at least this many elements is tapped
#: (module docstring): its rule runs during the backward pass.
TAP_ELEMENTS = 1 << 16

_IN_PROJ = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias")


@dataclass
class _Call:
    """One call of a planned module: its inputs, the positions ``pos`` among the output's
    pytree leaves of the outputs that require grad, their shapes, dtypes and gradient edges,
    the graph nodes of its tensor inputs' gradient edges (``ins``), whether its outputs are
    tapped, their gradients once known, and the dimension of its input and outputs that holds
    the batch (:func:`_check_batch`)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    pos: list[int]
    shapes: list[tuple[torch.Size, torch.dtype, torch.device]]
    edges: list[Any]
    ins: list[Any] = field(default_factory=list)
    tapped: bool = False
    grads: list[Tensor | None] = field(default_factory=list)
    bdim: int = 0


@dataclass
class _Entry:
    qual: str
    module: nn.Module
    own: dict[str, nn.Parameter]
    calls: list[_Call] = field(default_factory=list)
    parts: Parts | None = None
    waiting: int = 0

    @property
    def kind(self) -> str:
        """The type of the user's module (an attention module's, for its proxies)."""
        return type(getattr(self.module, "owner", self.module)).__name__

    @property
    def label(self) -> str:
        return f"module {self.qual or self.kind!r}"

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
    """The modules holding trainable parameters (each parameter held by one module); an
    ``nn.MultiheadAttention``'s own parameters go to its proxies (its in-projection always
    has an entry, which is what runs the decomposed forward)."""
    seen: dict[int, str] = {}
    out = []
    skip: set[int] = set()  # the out_proj of an attention module: its proxy holds them

    def claim(qual: str, own: dict[str, nn.Parameter]) -> None:
        for n, p in own.items():
            full = f"{qual}.{n}" if qual else n
            if id(p) in seen:
                raise InvalidParameterError(
                    f"parameter {full!r}", f"shared with {seen[id(p)]!r}",
                    f"used by one module only for method=GradMethod.GHOST {_USE_FUNC}")
            seen[id(p)] = full

    for qual, m in module.named_modules():
        own = {n: p for n, p in m._parameters.items() if p is not None and p.requires_grad}
        if id(m) in skip:
            own = {n: p for n, p in own.items() if n not in ("weight", "bias")}
        if type(m) is nn.MultiheadAttention:
            proj, out_proj, bkv = proxies(m)
            proj.__dict__["others"] = out_proj, bkv
            claim(qual, own)
            out.append(_Entry(qual, proj, {n: p for n, p in own.items() if n in _IN_PROJ}))
            outs = {f"out_proj.{n}": p for n, p in m.out_proj._parameters.items()
                    if n in ("weight", "bias") and p is not None and p.requires_grad}
            claim(qual, outs)
            skip.add(id(m.out_proj))
            if outs:
                out.append(_Entry(qual, out_proj, outs))
            kv = {n: p for n, p in own.items() if n not in _IN_PROJ}
            if kv:
                out.append(_Entry(qual, bkv, kv))
            continue
        claim(qual, own)
        if own:
            out.append(_Entry(qual, m, own))
    return out


@contextmanager
def recording(entries: list[_Entry], hook_for: Callable[[_Entry, int], Any]) -> Iterator[None]:
    """Forward hooks ``hook_for(entry, index)`` on the planned modules, and the decomposed
    forward of their attention modules, while open."""
    with ExitStack() as stack:
        attention = [(e.module, *e.module.others) for e in entries
                     if isinstance(e.module, InProjection)]
        if attention:
            stack.enter_context(patched(attention))
        handles = [e.module.register_forward_hook(hook_for(e, i), with_kwargs=True)
                   for i, e in enumerate(entries)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _ruled(entry: _Entry) -> bool:
    return type(entry.module) in RULES


def _inputs(entry: _Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The tensor inputs whose gradient edges bound a call (all of them)."""
    ins = args if not kwargs and all(isinstance(a, Tensor) for a in args) else tuple(
        tree_flatten((args, kwargs))[0])
    return [t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node
            for t in ins if isinstance(t, Tensor) and t.requires_grad]


class _Recorder:
    """The hooks of :func:`ghost` and :func:`trace`: record each call; with ``taps``, add a
    zero scalar to the large outputs of layers with a rule (module docstring)."""

    def __init__(self, taps: bool) -> None:
        self.taps: dict[tuple[torch.dtype, torch.device], Tensor] | None = {} if taps else None

    def _tap(self, t: Tensor) -> Tensor:
        assert self.taps is not None
        key = (t.dtype, t.device)
        if key not in self.taps:
            self.taps[key] = torch.zeros((), dtype=t.dtype, device=t.device, requires_grad=True)
        return t + self.taps[key]

    def hook_for(self, entry: _Entry, _: int) -> Callable[..., Any]:
        tap = self.taps is not None and _ruled(entry) and bool(entry.own)

        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
            one = isinstance(out, Tensor)
            leaves, spec = ([out], None) if one else tree_flatten(out)
            assert one or spec is not None
            pos = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
            tapped = tap and sum(leaves[i].numel() for i in pos) >= TAP_ELEMENTS
            if tapped:
                for i in pos:
                    leaves[i] = self._tap(leaves[i])
            outs = [leaves[i] for i in pos]
            entry.calls.append(_Call(args, kwargs, pos,
                                     [(o.shape, o.dtype, o.device) for o in outs],
                                     [get_gradient_edge(o) for o in outs],
                                     _inputs(entry, args, kwargs), tapped))
            if not tapped:
                return None
            return leaves[0] if spec is None else tree_unflatten(leaves, spec)

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
                f"used outside the forward of {entry.label} ({entry.kind}), {where}",
                f"used by its own module only for method=GradMethod.GHOST {_USE_FUNC}")


def _check_losses(losses: Any, shape: tuple[int, ...]) -> None:
    if not (isinstance(losses, Tensor) and tuple(losses.shape) == shape):
        raise InvalidParameterError("loss_fn", getattr(losses, "shape", losses),
                                    f"per-example losses of shape {shape} (reduction='none')")


def _batch_second(entry: _Entry, shape: tuple[int, ...], b: int) -> InvalidParameterError:
    return InvalidParameterError(
        entry.label, f"{entry.kind} with an output of shape {shape}",
        f"a module whose outputs hold the batch ({b} examples) on dimension 0 for "
        f"method=GradMethod.GHOST, which splits them per example {_USE_FUNC}")


def _other_batch(x: Any, b: int) -> Any:
    """The inputs' first example (two copies of it when ``b`` is 1): a batch of another size,
    whose outputs' shapes tell which dimension is the batch."""
    leaves, spec = tree_flatten(x)
    out = []
    for t in leaves:
        if isinstance(t, Tensor) and t.dim() and t.shape[0] == b:
            t = t[:1] if b > 1 else torch.cat([t, t])
        out.append(t)
    return tree_unflatten(out, spec)


#: Layers whose rule treats every dimension of the output but the last ones (positions) alike,
#: so that the batch may be on any of them (``nn.TransformerEncoderLayer(batch_first=False)``'s
#: linear and normalisation layers see (T, B, E)).
POSITIONWISE: tuple[type, ...] = (nn.Linear, nn.LayerNorm, nn.Embedding) + (
    (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

#: per model: for the output shapes of its calls (with the batch size) already checked against
#: a forward at another batch size, the batch dimension of each call (:func:`_check_batch`)
_VERIFIED: weakref.WeakKeyDictionary[nn.Module, dict[Any, list[int]]] = \
    weakref.WeakKeyDictionary()


def _check_batch(entries: list[_Entry], module: nn.Module, inputs: tuple[Any, ...], b: int
                 ) -> None:
    """Set each call's batch dimension (``bdim``). It is 0 when every output has the batch's
    size there and nowhere else; otherwise a forward on the first example (two copies of it
    when the batch is one example) says, for every output, which dimension changes with the
    batch size (once per model and shapes of its calls). A call whose batch is not on
    dimension 0 is accepted for the position-wise layers (:data:`POSITIONWISE`) only."""
    calls = [(entry, call) for entry in entries for call in entry.calls]
    if not any(len(shape) == 0 or shape[0] != b or (b > 1 and b in tuple(shape[1:]))
               for _, call in calls for shape, _, _ in call.shapes):
        return
    signature = (b, tuple(tuple(tuple(shape) for call in entry.calls for shape, _, _ in
                                call.shapes) for entry in entries))
    known = _VERIFIED.setdefault(module, {})
    if signature not in known:
        other = plan(module)
        try:
            with recording(other, _Recorder(taps=False).hook_for), torch.enable_grad():
                module(*_other_batch(inputs, b))
        except Exception as err:  # a model that runs at this batch size only: name the layer
            entry, call = next((e, c) for e, c in calls if any(
                len(sh) == 0 or sh[0] != b or b in tuple(sh[1:]) for sh, _, _ in c.shapes))
            raise InvalidParameterError(
                entry.label, f"{entry.kind} with an output of shape "
                f"{tuple(call.shapes[0][0])}, and a model that fails on another batch size "
                f"({type(err).__name__}: {err})", f"a module whose outputs hold the batch "
                f"({b} examples) on dimension 0 for method=GradMethod.GHOST {_USE_FUNC}"
            ) from err
        b2 = 1 if b > 1 else 2
        dims = []
        for entry, single in zip(entries, other):
            if len(single.calls) != len(entry.calls):
                raise InvalidParameterError(
                    entry.label, f"{len(single.calls)} calls on {b2} example(s), "
                    f"{len(entry.calls)} on {b}", f"called as often for every batch for "
                    f"method=GradMethod.GHOST {_USE_FUNC}")
            for c2, cb in zip(single.calls, entry.calls):
                found: set[int] = set()
                for (s2, _, _), (sb, _, _) in zip(c2.shapes, cb.shapes):
                    moved = [d for d in range(len(sb)) if len(s2) == len(sb) and
                             s2[d] == b2 and sb[d] == b and all(
                                 s2[e] == sb[e] for e in range(len(sb)) if e != d)]
                    if len(moved) != 1:
                        raise _batch_second(entry, tuple(sb), b)
                    found.add(moved[0])
                if len(found) > 1 or (found and found != {0} and not (
                        isinstance(entry.module, POSITIONWISE) and _ruled(entry))):
                    raise _batch_second(entry, tuple(cb.shapes[0][0]), b)
                dims.append(found.pop() if found else 0)
        known[signature] = dims
    for (_, call), d in zip(calls, known[signature]):
        call.bdim = d


def _forward(module: nn.Module, inputs: tuple[Any, ...], targets: Any, loss_fn: LossFn, b: int,
             taps: bool) -> tuple[list[_Entry], Tensor, Tensor, _Recorder]:
    """Forward with the calls recorded (tapped if ``taps``); the checks."""
    entries = plan(module)
    rec = _Recorder(taps)
    with recording(entries, rec.hook_for), torch.enable_grad():
        losses = loss_fn(module(*inputs), targets)
        total = losses.sum()
    _check_losses(losses, (b,))
    check_uses(entries, total.grad_fn)
    _check_batch(entries, module, inputs, b)
    return entries, losses, total, rec


def _present(g: Tensor | None) -> Tensor:
    """A layer rule's output gradient (its one output reached the loss)."""
    assert g is not None
    return g


def _zeros(meta: tuple[torch.Size, torch.dtype, torch.device]) -> Tensor:
    return torch.zeros(meta[0], dtype=meta[1], device=meta[2])


def _rule(entry: _Entry, lead: int) -> None:
    """``entry.parts`` from its rule and its calls' gradients (``lead`` leading axes to add:
    1 for one model); the calls' tensors are dropped."""
    rule = RULES[type(entry.module)]
    calls = [c for c in entry.calls if any(g is not None for g in c.grads)]
    pairs: list[Any]

    def up(t: Tensor) -> Tensor:
        return t.detach().unsqueeze(0) if lead else t.detach()

    if type(entry.module) in MULTI:
        pairs = [([up(a) for a in c.args if isinstance(a, Tensor)],
                  [up(g if g is not None else _zeros(m)) for g, m in zip(c.grads, c.shapes)])
                 for c in calls]
    else:  # batch first (a position-wise layer may have it elsewhere: c.bdim)
        pairs = [(up(c.args[0].movedim(c.bdim, 0)), up(_present(c.grads[0]).movedim(c.bdim, 0)))
                 for c in calls]
    if calls:
        with torch.no_grad():
            entry.parts = rule(entry.module, pairs, set(entry.own))
    for c in entry.calls:
        c.args, c.kwargs, c.grads = (), {}, []


def _arrival(entry: _Entry, call: _Call, j: int) -> Callable[..., None]:
    """The backward hook of a tapped output: store its gradient; the entry's last one runs
    the rule."""
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
        call.grads[j] = grad_outputs[0]
        entry.waiting -= 1
        if entry.waiting == 0:
            _rule(entry, 1)
    return hook


def ghost(module: nn.Module, inputs: tuple[Any, ...], targets: Any, loss_fn: LossFn,
          b: int) -> tuple[Tensor, Weighted]:
    """One model: per-example squared norms ``(B,)`` float64 and ``weighted(f (B,), drop)
    -> {name: sum_i f_i g_i}`` over the trainable parameters of the modules that were called
    (:data:`Weighted`)."""
    entries, losses, total, rec = _forward(module, inputs, targets, loss_fn, b, taps=True)
    request: list[Any] = list(rec.taps.values()) if rec.taps else []
    untapped: list[tuple[_Call, int]] = []
    for entry in entries:
        all_tapped = bool(entry.calls) and all(c.tapped for c in entry.calls)
        for call in entry.calls:
            call.grads = [None] * len(call.edges)
            for j, edge in enumerate(call.edges):
                if call.tapped:
                    edge.node.register_prehook(_arrival(entry, call, j))
                    entry.waiting += all_tapped
                else:
                    request.append(edge)
                    untapped.append((call, j))
        if not all_tapped:
            entry.waiting = -1  # ruled after the backward
    found = torch.autograd.grad(total, request, allow_unused=True) if request else ()
    for (call, j), g in zip(untapped, found[len(request) - len(untapped):]):
        call.grads[j] = g
    del found, request
    parts: list[tuple[_Entry, Parts]] = []
    for entry in entries:
        if entry.parts is None and _ruled(entry) and entry.own:
            _rule(entry, 1)
        elif entry.parts is None and entry.own:
            _fallback_entry(entry, b)
        if entry.parts is not None:
            parts.append((entry, entry.parts))
    sq, weighted = _collect(parts, 1, b, losses.device)

    def weighted1(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        d = None if drop is None else drop.unsqueeze(0)
        return {n: v[0] for n, v in weighted(f.unsqueeze(0), d).items()}

    return sq[0], weighted1


def _fallback_entry(entry: _Entry, b: int) -> None:
    """``entry.parts`` by ``torch.func`` (a module without a rule)."""
    own = {n: p.detach() for n, p in entry.own.items()}
    total: dict[str, Tensor] = {}
    for c in entry.calls:
        if all(g is None for g in c.grads):
            continue
        leaves, spec = tree_flatten((c.args, c.kwargs))
        leaves = [x.detach() if isinstance(x, Tensor) else x for x in leaves]
        cot = [g if g is not None else _zeros(m) for g, m in zip(c.grads, c.shapes)]
        per = _fallback_guard(entry, _fallback_one, entry.module, own, leaves,
                              _batch_dims(leaves, b, 0), spec, c.pos, cot)
        for n, v in per.items():
            total[n] = total[n] + v if n in total else v
    if total:
        entry.parts = materialized({n: v.unsqueeze(0) for n, v in total.items()})


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
            entry.label, entry.kind,
            f"a module torch.func can take per-example gradients of ({err}); "
            f"use another layer {_USE_FUNC}") from err


def _batch_dims(leaves: list[Any], b: int, lead: int) -> list[int | None]:
    return [0 if isinstance(x, Tensor) and x.dim() > lead and x.shape[lead] == b else None
            for x in leaves]


def _collect(parts: list[tuple[_Entry, Parts]], k: int, b: int, device: Any
             ) -> tuple[Tensor, Weighted]:
    """The summed squared norms, and ``weighted``, which may be called once: it releases each
    layer's retained tensors as soon as that layer's sums are computed."""
    sq = torch.zeros(k, b, dtype=torch.float64, device=device)
    for entry, p in parts:
        sq = sq + p.sq
        entry.parts = None
    pending = [(entry.full, p.weighted) for entry, p in parts]
    parts.clear()

    def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        while pending:
            full, fn = pending.pop()
            out.update((full(n), v) for n, v in fn(f, drop).items())
        return out

    return sq, weighted


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
        ruled = _ruled(entry)
        multi = type(entry.module) in MULTI

        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
            c = self.count[e]
            self.count[e] += 1
            if c >= len(entry.calls):
                raise InvalidParameterError(
                    entry.label, f"call {c + 1}", f"called as often for every batch as for one "
                    f"example ({len(entry.calls)}) for method=GradMethod.GHOST {_USE_FUNC}")
            pos = entry.calls[c].pos
            one = isinstance(out, Tensor)
            leaves, spec = ([out], None) if one else tree_flatten(out)
            for j, p in enumerate(pos):
                eps = self.eps[self.offset[e, c] + j]
                if not isinstance(leaves[p], Tensor) or leaves[p].shape != eps.shape:
                    # one client's output is (B, *the traced shape[1:]) when the batch leads
                    raise _batch_second(entry, tuple(getattr(leaves[p], "shape", ())),
                                        int(eps.shape[0]) if eps.dim() else 0)
                leaves[p] = leaves[p] + eps
            b = int(leaves[pos[0]].shape[0]) if pos else -1
            if ruled and not multi and args and isinstance(args[0], Tensor):  # the common case
                self.meta.append((e, c, _ONE_SPEC, [None], [0 if args[0].dim() and
                                                             args[0].shape[0] == b else None]))
                self.saved.append(args[0])
            else:
                ins, in_spec = tree_flatten((args[:1], {}) if ruled and not multi
                                            else (args, kwargs))
                self.meta.append((e, c, in_spec,
                                  [None if isinstance(x, Tensor) else x for x in ins],
                                  _batch_dims(ins, b, 0)))
                self.saved.extend(x for x in ins if isinstance(x, Tensor))
            return leaves[0] if spec is None else tree_unflatten(leaves, spec)

        return hook


#: the pytree spec of ``((a,), {})``: a ruled module's call, as :class:`_Inject` records it
_ONE_SPEC = tree_flatten(((0,), {}))[1]


def trace(module: nn.Module, x1: Tensor, y1: Tensor, loss_fn: LossFn) -> list[_Entry]:
    """The modules' calls on one example ``x1 (1, ...)``, checked as :func:`ghost` checks
    them: what :func:`ghost_clients` perturbs (the same for every batch of such inputs)."""
    entries = _forward(module, (x1,), y1, loss_fn, 1, taps=False)[0]
    for entry in entries:
        for call in entry.calls:
            if call.bdim:  # K clients: the batch must lead
                raise _batch_second(entry, tuple(call.shapes[0][0]), 1)
            call.args, call.kwargs = (), {}
    return entries


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
    eps = [torch.zeros(k, b, *shape[1:], dtype=dtype, device=device, requires_grad=True)
           for entry in entries for call in entry.calls for shape, dtype, device in call.shapes]
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
    del grads, eps
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
        if e not in calls or not entry.own:
            continue
        rule = RULES.get(type(entry.module))
        if rule is not None:
            pairs: list[Any]
            if type(entry.module) in MULTI:
                pairs = [([x.detach() for x in leaves if isinstance(x, Tensor)], cot)
                         for leaves, _, _, cot, _ in calls[e]]
            else:
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
    return _collect(parts, k, b, device)


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

