"""Per-example gradients, their norms and clipped sums for any ``nn.Module``.

The privacy unit is one example (one record): the module's forward must treat the examples
of a batch independently (row i of the output depends only on row i of the input), and the
loss must be given per example (``loss_fn(output, targets)`` returns shape ``(B,)``; the
default is cross-entropy). Layers that mix the examples of a batch are refused by name
(:func:`check_module`). Two ways to get what DP-SGD needs (:class:`GradMethod`):

- ``GHOST`` (default): one forward and one backward pass to the layers' outputs only. The
  layers with a rule in :mod:`privkit.torch._layers` (``Linear``, ``Conv1d/2d/3d``,
  ``Embedding``, ``LayerNorm``, ``GroupNorm``, ``RMSNorm``) and ``nn.MultiheadAttention``
  (:mod:`privkit.torch._attention`; so the Transformer layers) get their per-example
  gradient norms and the clipped sum from their inputs and output gradients, by the ghost
  norm or by materialised per-example gradients, whichever is cheaper per layer (ghost
  clipping); any other module that holds parameters gets its per-example gradients from
  ``torch.func`` (``vmap`` of ``vjp`` over the examples, for that module alone). Hooks live
  only for the duration of one call. A layer's output must hold the batch on dimension 0;
  the position-wise layers (``Linear``, ``LayerNorm``, ``RMSNorm``, ``Embedding``) may hold
  it on another (``nn.TransformerEncoderLayer(batch_first=False)`` applies them to
  ``(T, B, E)``), found by a forward at another batch size.
- ``FUNC``: ``vmap(grad(loss))`` of the whole model over the examples (``functional_call``),
  materialising every per-example gradient: the simplest path, for any module ``torch.func``
  can transform, and the reference the ghost path is tested against.

``GHOST`` assumes that each parameter is used only inside the forward of the module that
holds it (an attention module's, including its ``out_proj``, inside the attention module's).
A parameter registered under two modules, or consumed by any operation outside its module's
calls (a tied output layer's ``F.linear(h, emb.weight)``), is refused by name: use ``FUNC``
there. The check walks the
autograd graph of every batch (:func:`privkit.torch._ghost.check_uses`), so it cannot miss a
use the gradient sees. A model with a recurrent layer (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``,
which return their state batch second) gets ``FUNC`` for the whole model under ``GHOST``, said
once per model at INFO on the ``privkit.torch`` logger.

Non-finite gradients (:class:`~privkit.mechanisms.NonFiniteUpdates`, argument ``nonfinite``):
an example whose per-example gradient holds a NaN or an infinity (a NaN in its input, a model
with an infinite output on it; also a norm that overflows) contributes exactly zeros by
default (``ZERO``), silently: its contribution has norm 0 <= C and the others' are unchanged,
so the sensitivity bound holds. ``RAISE`` raises instead, naming the example's row (for
debugging: the error itself is outside any privacy claim). Rows with weight 0 (padding) are
left out either way.
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.mechanisms.aggregate import NonFiniteUpdates
from privkit.torch._ghost import Weighted, func_only, ghost, recurrent
from privkit.torch._layers import materialized

__all__ = ["GradMethod", "ClippedGradSum", "check_module", "per_example_grads",
           "per_example_norms", "clipped_grad_sum", "clip_factors", "cross_entropy_per_example"]

LossFn = Callable[[Any, Any], Tensor]

logger = logging.getLogger("privkit.torch")
#: models already told (at INFO) that they get GradMethod.FUNC under GHOST
_TOLD: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class GradMethod(enum.Enum):
    """How per-example gradient norms and clipped sums are computed (module docstring)."""

    GHOST = "ghost"
    FUNC = "func"


@dataclass(frozen=True, eq=False)
class ClippedGradSum:
    """``sum_i f_i grad_i`` over a batch, with ``f_i = min(1, C / ||grad_i||)``.

    Attributes:
        grads: ``{parameter name: tensor}`` for every trainable parameter of the module
            (``named_parameters()`` order and names), in the parameters' dtype.
        norms: ``(B,)`` float64 norms of the unclipped per-example gradients.
    """

    grads: dict[str, Tensor]
    norms: Tensor


def cross_entropy_per_example(output: Tensor, targets: Tensor) -> Tensor:
    """The default loss: ``F.cross_entropy(output, targets, reduction="none")``, shape (B,)."""
    return F.cross_entropy(output, targets, reduction="none")


# ------------------------------------------------------------------------------ checks
def _mixing(module: nn.Module) -> str | None:
    """Why ``module`` mixes the examples of a batch (None if it does not)."""
    name = type(module).__name__
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        if module.training or module.running_mean is None:
            return (f"{name} normalises with the statistics of the whole batch; use "
                    f"nn.GroupNorm(num_groups, {module.num_features}) instead")
    elif isinstance(module, nn.modules.instancenorm._InstanceNorm):
        if module.training and module.track_running_stats:
            return (f"{name} with track_running_stats=True updates its running statistics "
                    "from the whole batch; use track_running_stats=False or nn.GroupNorm")
    elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        if module.scale_grad_by_freq:
            return (f"{name} with scale_grad_by_freq=True scales gradients by token counts "
                    "over the whole batch; use scale_grad_by_freq=False")
        if module.max_norm is not None:
            return (f"{name} with max_norm renormalises its weight in place from the batch's "
                    "tokens, outside the noise; use max_norm=None")
    return None


def check_module(module: nn.Module) -> None:
    """Refuse a module with a layer that mixes the examples of a batch.

    Raises:
        InvalidParameterError: naming the layer (qualified name and type) and what to use
            instead, e.g. BatchNorm in training mode (use ``nn.GroupNorm``).

    Examples:
        >>> try:
        ...     check_module(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)))
        ... except InvalidParameterError as err:
        ...     print(err.name, "|", err.value, "|", err.requirement[-40:])
        module '1' | BatchNorm1d | use nn.GroupNorm(num_groups, 8) instead)
    """
    _scan(module)


def _scan(module: nn.Module) -> tuple[str, nn.Module] | None:
    """:func:`check_module`, and the first recurrent layer (as
    :func:`privkit.torch._ghost.func_only`), in one walk over the modules."""
    if not isinstance(module, nn.Module):
        raise InvalidParameterError("module", module, "a torch.nn.Module")
    layer = None
    for qual, m in module.named_modules():
        why = _mixing(m)
        if why is not None:
            raise InvalidParameterError(
                f"module {qual or type(module).__name__!r}",
                type(m).__name__,
                f"a layer whose output for one example depends on that example only ({why})")
        if layer is None and recurrent(m):
            layer = qual or type(module).__name__, m
    return layer


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def _as_tuple(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _batch_size(inputs: tuple[Any, ...], targets: Any) -> int:
    if len(inputs) == 1 and isinstance(inputs[0], Tensor) and isinstance(targets, Tensor):
        leaves = [inputs[0], targets]  # the common case, without a pytree walk
    else:
        leaves = [x for x in tree_flatten((inputs, targets))[0] if isinstance(x, Tensor)]
    if not leaves or leaves[0].dim() == 0:
        raise InvalidParameterError("inputs", type(inputs).__name__,
                                    "tensors with a leading batch dimension")
    b = leaves[0].shape[0]
    for x in leaves:
        if x.dim() == 0 or x.shape[0] != b:
            raise InvalidParameterError("inputs", tuple(x.shape),
                                        f"tensors whose leading (batch) dimension is {b}")
    return b


#: The clip factor is shrunk by this many ulps of the parameters' dtype: it covers the
#: rounding of the squared norms (summed in that dtype, cascade summation) and of the
#: clipped sum, so that no example's contribution exceeds C.
CLIP_MARGIN_ULPS = 64


def clip_factors(norms: Tensor, l2_clip_norm: float, dtype: torch.dtype,
                 weights: Tensor | None = None) -> Tensor:
    """``min(1, C / norm)`` per example (float64), shrunk by :data:`CLIP_MARGIN_ULPS` ulps
    of ``dtype``; times ``weights`` (e.g. 0 on padding rows) when given.

    Examples:
        >>> clip_factors(torch.tensor([0.5, 4.0], dtype=torch.float64), 1.0, torch.float64)
        tensor([1.0000, 0.2500], dtype=torch.float64)
    """
    f = torch.clamp(l2_clip_norm / torch.clamp(norms, min=1e-300), max=1.0)
    f = f * (1.0 - CLIP_MARGIN_ULPS * torch.finfo(dtype).eps)
    return f if weights is None else f * weights.to(torch.float64)


# ------------------------------------------------------------------------------ torch.func path
def func_per_example_grads(module: nn.Module, params: Mapping[str, Tensor],
                           inputs: tuple[Any, ...], targets: Any, loss_fn: LossFn,
                           rest: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``vmap(grad)`` over the examples: ``{name: (B, *shape)}`` for ``params``; ``rest``
    (frozen parameters, buffers) is held fixed. Composable with an outer ``vmap``."""

    def one(p: Mapping[str, Tensor], xs: tuple[Any, ...], y: Any) -> Tensor:
        xs1 = tuple(x.unsqueeze(0) if isinstance(x, Tensor) else x for x in xs)
        leaves, spec = tree_flatten(y)
        y1 = tree_unflatten([t.unsqueeze(0) for t in leaves], spec)
        return loss_fn(functional_call(module, (dict(p), dict(rest)), xs1), y1).sum()

    in_x = tuple(0 if isinstance(x, Tensor) else None for x in inputs)
    return vmap(grad(one), in_dims=(None, in_x, 0))(dict(params), inputs, targets)


def check_nonfinite(nonfinite: Any) -> NonFiniteUpdates:
    """``nonfinite``, checked: a :class:`~privkit.mechanisms.NonFiniteUpdates` member."""
    if not isinstance(nonfinite, NonFiniteUpdates):
        raise InvalidParameterError("nonfinite", nonfinite,
                                    "a privkit.mechanisms.NonFiniteUpdates member (ZERO or RAISE)")
    return nonfinite


def nonfinite_rows(norms: Tensor, weights: Tensor | None, nonfinite: NonFiniteUpdates,
                   where: Callable[[Tensor], str]) -> Tensor | None:
    """The rows to leave out of a clipped sum: ``(..., B)`` bool where the per-example
    gradient norm is NaN or inf, or None when every row is finite (one device sync). Under
    ``RAISE``, the first such row with a non-zero weight raises, named by ``where(index)``
    (a padding row, of weight 0, is never an error)."""
    if bool(torch.isfinite(norms).all()):
        return None
    bad = ~torch.isfinite(norms)
    if nonfinite is NonFiniteUpdates.RAISE:
        live = bad if weights is None else bad & (weights != 0)
        if bool(live.any()):
            at = torch.nonzero(live)[0]
            raise InvalidParameterError(
                where(at), f"an example whose gradient norm is {float(norms[tuple(at)])}",
                "an example with a finite per-example gradient "
                "(nonfinite=NonFiniteUpdates.RAISE; ZERO would leave it out)")
    return bad


def _rest(module: nn.Module) -> dict[str, Tensor]:
    out = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
    out.update(dict(module.named_buffers()))
    return out


def per_example_grads(module: nn.Module, inputs: Any, targets: Any, *,
                      loss_fn: LossFn | None = None) -> dict[str, Tensor]:
    """Every example's gradient, ``{parameter name: (B, *shape)}``, by ``torch.func``.

    Args:
        module: the model; its forward must treat examples independently.
        inputs: the forward's input (a tensor, or a tuple of positional inputs), batch first.
        targets: what ``loss_fn`` compares the output with, batch first.
        loss_fn: ``loss_fn(output, targets) -> (B,)`` per-example losses (default
            cross-entropy).

    Examples:
        >>> net = nn.Linear(3, 2)
        >>> g = per_example_grads(net, torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 1]))
        >>> tuple(g["weight"].shape), tuple(g["bias"].shape)
        ((5, 2, 3), (5, 2))
    """
    check_module(module)
    xs = _as_tuple(inputs)
    _batch_size(xs, targets)
    params = {n: p.detach() for n, p in _trainable(module).items()}
    return _whole_model(module, params, xs, targets, loss_fn or cross_entropy_per_example)


def _whole_model(module: nn.Module, params: Mapping[str, Tensor], xs: tuple[Any, ...],
                 targets: Any, loss_fn: LossFn) -> dict[str, Tensor]:
    """:func:`func_per_example_grads` of the model; a failure of ``torch.func`` (an
    operation without a batching rule, an in-place write it cannot follow) names the model."""
    try:
        return func_per_example_grads(module, params, xs, targets, loss_fn, _rest(module))
    except RuntimeError as err:
        raise InvalidParameterError(
            "module", type(module).__name__,
            f"a model torch.func can take per-example gradients of for "
            f"method=GradMethod.FUNC ({err})") from err


# ------------------------------------------------------------------------------ public
def resolve_method(module: nn.Module, method: Any, layer: Any = ...) -> GradMethod:
    """``method``, checked; ``FUNC`` for a model that ``GHOST`` cannot split per example
    (``layer``, :func:`privkit.torch._ghost.func_only` when not given: a recurrent layer),
    said once per model at INFO."""
    if not isinstance(method, GradMethod):
        raise InvalidParameterError("method", method, "a privkit.torch.GradMethod")
    if method is GradMethod.GHOST:
        if layer is ...:
            layer = func_only(module)
        if layer is not None:
            if module not in _TOLD:
                _TOLD.add(module)
                logger.info("GradMethod.GHOST: module %r (%s) returns its state with the batch "
                            "on dimension 1, so the whole model's per-example gradients come "
                            "from GradMethod.FUNC (torch.func)", layer[0],
                            type(layer[1]).__name__)
            return GradMethod.FUNC
    return method


def _setup(module: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None,
           method: Any) -> tuple[tuple[Any, ...], int, LossFn, GradMethod]:
    method = resolve_method(module, method, _scan(module))
    xs = _as_tuple(inputs)
    return xs, _batch_size(xs, targets), loss_fn or cross_entropy_per_example, method


def _sq_and_weighted(module: nn.Module, xs: tuple[Any, ...], targets: Any, loss_fn: LossFn,
                     b: int, method: GradMethod) -> tuple[Tensor, Weighted]:
    if method is GradMethod.GHOST:
        return ghost(module, xs, targets, loss_fn, b)
    params = {n: p.detach() for n, p in _trainable(module).items()}
    per = _whole_model(module, params, xs, targets, loss_fn)
    parts = materialized({n: v.unsqueeze(0) for n, v in per.items()})

    def weighted(f: Tensor, drop: Tensor | None = None) -> dict[str, Tensor]:
        d = None if drop is None else drop.unsqueeze(0)
        return {n: v[0] for n, v in parts.weighted(f.unsqueeze(0), d).items()}

    return parts.sq[0], weighted


def per_example_norms(module: nn.Module, inputs: Any, targets: Any, *,
                      loss_fn: LossFn | None = None,
                      method: GradMethod = GradMethod.GHOST) -> Tensor:
    """``(B,)`` float64 L2 norms of the per-example gradients (all trainable parameters).

    Examples:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> x, y = torch.randn(6, 3), torch.tensor([0, 1, 1, 0, 1, 0])
        >>> a = per_example_norms(net, x, y)
        >>> b = per_example_norms(net, x, y, method=GradMethod.FUNC)
        >>> bool(torch.allclose(a, b)), a.dtype
        (True, torch.float64)
    """
    xs, b, loss_fn, method = _setup(module, inputs, targets, loss_fn, method)
    if b == 0:
        return torch.zeros(0, dtype=torch.float64)
    return _sq_and_weighted(module, xs, targets, loss_fn, b, method)[0].sqrt()


def clipped_grad_sum(module: nn.Module, inputs: Any, targets: Any, *, l2_clip_norm: float,
                     loss_fn: LossFn | None = None, weights: Tensor | None = None,
                     method: GradMethod = GradMethod.GHOST,
                     nonfinite: NonFiniteUpdates = NonFiniteUpdates.ZERO) -> ClippedGradSum:
    """DP-SGD's clipped sum ``sum_i w_i min(1, C / ||g_i||) g_i`` over a batch.

    Args:
        module: the model (its trainable parameters are differentiated; frozen ones, with
            ``requires_grad=False``, are not).
        inputs: the forward's input (a tensor, or a tuple of positional inputs), batch first.
        targets: what ``loss_fn`` compares the output with, batch first.
        loss_fn: ``loss_fn(output, targets) -> (B,)`` per-example losses (default
            cross-entropy).
        l2_clip_norm: C, finite and > 0.
        weights: optional ``(B,)`` example weights (e.g. 0 for padding rows).
        method: :class:`GradMethod`.
        nonfinite: :class:`~privkit.mechanisms.NonFiniteUpdates`: an example whose gradient
            holds NaN or inf contributes zeros (``ZERO``, the default) or raises, naming its
            row (``RAISE``).

    Returns:
        :class:`ClippedGradSum`; an empty batch gives zeros. Each example's contribution
        has L2 norm at most C (its factor is shrunk by :data:`CLIP_MARGIN_ULPS` ulps); an
        example left out as non-finite contributes exactly 0 (its entry of ``norms`` is NaN
        or inf).

    Raises:
        InvalidParameterError: a bad argument, named; a refused layer or parameter; under
            ``RAISE``, ``inputs[i]`` with a non-finite gradient.

    Examples:
        >>> net = nn.Linear(3, 2)
        >>> s = clipped_grad_sum(net, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...                      l2_clip_norm=0.1)
        >>> sorted(s.grads), bool(torch.linalg.vector_norm(
        ...     torch.cat([g.flatten() for g in s.grads.values()])) <= 0.4)
        (['bias', 'weight'], True)
    """
    clip = _validate.positive("l2_clip_norm", l2_clip_norm)
    policy = check_nonfinite(nonfinite)
    xs, b, loss_fn, method = _setup(module, inputs, targets, loss_fn, method)
    params = _trainable(module)
    if weights is not None and tuple(weights.shape) != (b,):
        raise InvalidParameterError("weights", tuple(weights.shape), f"a ({b},) tensor")
    if b == 0:
        return ClippedGradSum({n: torch.zeros_like(p) for n, p in params.items()},
                              torch.zeros(0, dtype=torch.float64))
    sq, weighted = _sq_and_weighted(module, xs, targets, loss_fn, b, method)
    norms = sq.sqrt()
    dtype = next(iter(params.values())).dtype if params else torch.float32
    drop = nonfinite_rows(norms, weights, policy, lambda at: f"inputs[{int(at[0])}]")
    f = clip_factors(norms, clip, dtype, weights)
    if drop is not None:
        f = f.masked_fill(drop, 0.0)
    summed = weighted(f, drop)
    grads = {n: summed[n].reshape(p.shape).to(p.dtype) if n in summed else torch.zeros_like(p)
             for n, p in params.items()}
    return ClippedGradSum(grads, norms)
