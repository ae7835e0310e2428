"""Per-example gradients, their norms and clipped sums for any ``nn.Module``.

The privacy unit is one example (one record): the module's forward must treat the examples
of a batch independently (row i of the output depends only on row i of the input), and the
loss must be given per example (``loss_fn(output, targets)`` returns shape ``(B,)``; the
default is cross-entropy). Layers that mix the examples of a batch are refused by name
(:func:`check_module`). Two ways to get what DP-SGD needs (:class:`GradMethod`):

- ``GHOST`` (default): one forward and one backward pass to the layers' outputs only. The
  layers with a rule in :mod:`privkit.torch._layers` (``Linear``, ``Conv1d/2d/3d``,
  ``Embedding``, ``LayerNorm``, ``GroupNorm``, ``RMSNorm``) get their per-example gradient
  norms and the clipped sum from their inputs and output gradients without materialising
  per-example gradients where that is cheaper (ghost clipping); any other module that holds
  parameters gets its per-example gradients from ``torch.func`` (``vmap`` of ``vjp`` over
  the examples, for that module alone). Hooks live only for the duration of one call.
- ``FUNC``: ``vmap(grad(loss))`` of the whole model over the examples (``functional_call``),
  materialising every per-example gradient: the simplest path, for any module ``torch.func``
  can transform, and the reference the ghost path is tested against.

``GHOST`` assumes that each parameter is used only inside the forward of the module that
holds it (a parameter shared by two modules, or used by another module's forward, as
``nn.MultiheadAttention`` does with ``out_proj``, is refused by name: use ``FUNC`` there).
"""

from __future__ import annotations

import enum
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
from privkit.torch._ghost import ghost
from privkit.torch._layers import materialized

__all__ = ["GradMethod", "ClippedGradSum", "check_module", "per_example_grads",
           "per_example_norms", "clipped_grad_sum", "clip_factors", "cross_entropy_per_example"]

LossFn = Callable[[Any, Any], Tensor]


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
    if not isinstance(module, nn.Module):
        raise InvalidParameterError("module", module, "a torch.nn.Module")
    for qual, m in module.named_modules():
        why = _mixing(m)
        if why is not None:
            raise InvalidParameterError(
                f"module {qual or type(module).__name__!r}",
                type(m).__name__,
                f"a layer whose output for one example depends on that example only ({why})")


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
    return func_per_example_grads(module, params, xs, targets,
                                  loss_fn or cross_entropy_per_example, _rest(module))


# ------------------------------------------------------------------------------ public
def _setup(module: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None,
           method: Any) -> tuple[tuple[Any, ...], int, LossFn, GradMethod]:
    check_module(module)
    if not isinstance(method, GradMethod):
        raise InvalidParameterError("method", method, "a privkit.torch.GradMethod")
    xs = _as_tuple(inputs)
    return xs, _batch_size(xs, targets), loss_fn or cross_entropy_per_example, method


def _sq_and_weighted(module: nn.Module, xs: tuple[Any, ...], targets: Any, loss_fn: LossFn,
                     b: int, method: GradMethod
                     ) -> tuple[Tensor, Callable[[Tensor], dict[str, Tensor]]]:
    if method is GradMethod.GHOST:
        return ghost(module, xs, targets, loss_fn, b)
    params = {n: p.detach() for n, p in _trainable(module).items()}
    per = func_per_example_grads(module, params, xs, targets, loss_fn, _rest(module))
    parts = materialized({n: v.unsqueeze(0) for n, v in per.items()})

    def weighted(f: Tensor) -> dict[str, Tensor]:
        return {n: v[0] for n, v in parts.weighted(f.unsqueeze(0)).items()}

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
                     method: GradMethod = GradMethod.GHOST) -> ClippedGradSum:
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

    Returns:
        :class:`ClippedGradSum`; an empty batch gives zeros. Each example's contribution
        has L2 norm at most C (its factor is shrunk by :data:`CLIP_MARGIN_ULPS` ulps).

    Examples:
        >>> net = nn.Linear(3, 2)
        >>> s = clipped_grad_sum(net, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...                      l2_clip_norm=0.1)
        >>> sorted(s.grads), bool(torch.linalg.vector_norm(
        ...     torch.cat([g.flatten() for g in s.grads.values()])) <= 0.4)
        (['bias', 'weight'], True)
    """
    clip = _validate.positive("l2_clip_norm", l2_clip_norm)
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
    summed = weighted(clip_factors(norms, clip, dtype, weights))
    grads = {n: summed[n].reshape(p.shape).to(p.dtype) if n in summed else torch.zeros_like(p)
             for n, p in params.items()}
    return ClippedGradSum(grads, norms)
