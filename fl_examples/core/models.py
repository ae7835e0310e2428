"""Models whose parameters are stacked on a leading client axis, so K clients train at once.

A model here is a small, frozen, functional spec rather than an ``nn.Module``: parameters are a
``dict[str, Tensor]`` whose every tensor has shape ``(K, *shape)``, and the model only says how
to initialise them, how to compute logits, losses and gradients for all K clients at once
(``torch.bmm`` over the client axis), and how the same network runs for one client (the
reference path the batched trainer is tested against).

Both models output **logits**; the loss is cross-entropy applied to the logits once. The
authors' code ends its networks with a softmax and then applies ``CrossEntropyLoss`` (a double
softmax, spec ``upcycled_fl.md`` section 7, item 6); privkit does not.

Flat layout. :func:`flatten` concatenates the parameters in the order of
:meth:`parameter_shapes`, each reshaped to ``(K, -1)``. Every layer stores its weight as
``(fan_in, fan_out)`` followed by its bias ``(fan_out,)``, so the flat block of one layer is the
row-major ``(fan_in + 1, fan_out)`` matrix ``[W; b]`` that multiplies features augmented with a
constant-one column. The batched solver (:mod:`fl_examples.core.local`) works on this layout.

Per-example gradients (:class:`PerExampleModel`). An asynchronous edge (MAPA) computes the
uploads of many models at once, each a flat ``(d,)`` vector pulled at another time: a model
that also has ``flat_logits``, ``per_example_grads`` and ``mean_grads`` serves it.
:class:`MultinomialLogReg` computes them in closed form, the ``torch.func`` models of
:mod:`fl_examples.core.deep_models` with ``vmap(grad)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from privkit.errors import InvalidParameterError

__all__ = [
    "BatchedModel",
    "PerExampleModel",
    "GradientAccumulator",
    "MultinomialLogReg",
    "MLP",
    "flatten",
    "unflatten",
    "split_flat",
    "num_parameters",
    "masked_mean_cross_entropy",
]

Params = dict[str, Tensor]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidParameterError(name, value, "an integer >= 1")
    return value


def _check_num_clients(num_clients: object) -> int:
    return _positive_int("num_clients", num_clients)


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidParameterError("dtype", dtype, "a floating-point torch.dtype")
    return dtype


GradientAccumulator = Callable[[tuple[Tensor, ...], float], None]
"""``accumulate(minibatch, beta)``: ``out <- beta * out + grad`` in place (see BatchedModel)."""


@runtime_checkable
class BatchedModel(Protocol):
    """What the batched local solver needs from a model.

    The solver's inner loop uses two methods, both on the flat layout of the module docstring:

    - ``prepare_minibatches(x, y, weights)`` lays out a chunk of T steps' minibatches once
      (leading axes ``(T, K)``, model-specific layout). ``x (T, K, B, F)`` holds real samples
      only; ``weights (T, K, B)`` are 1/|minibatch| on the rows that count and 0 on filler rows
      (a short last minibatch is filled up with some real row of the same client, so every
      value is finite); ``y (T, K, B)`` are valid labels everywhere.
    - ``gradient_accumulator(theta, out)`` returns ``accumulate(minibatch, beta)``, which sets
      ``out <- beta * out + sum_rows weight * grad CE`` in place for the parameters ``theta``
      (both ``(K, d)``; the closure may keep views of them, and is rebuilt when they change).
      ``minibatch`` is one step's slice ``[t, :K]`` of every prepared tensor.
    """

    @property
    def num_features(self) -> int: ...

    @property
    def num_classes(self) -> int: ...

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def init(
        self,
        num_clients: int,
        *,
        generator: torch.Generator,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Params: ...

    def forward(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor: ...

    def forward_single(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor: ...

    def loss(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, mask: Tensor) -> Tensor: ...

    def grad(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, mask: Tensor) -> Params: ...

    def prepare_minibatches(self, x: Tensor, y: Tensor, weights: Tensor) -> tuple[Tensor, ...]: ...

    def gradient_accumulator(self, theta: Tensor, out: Tensor) -> GradientAccumulator: ...


@runtime_checkable
class PerExampleModel(BatchedModel, Protocol):
    """A :class:`BatchedModel` that also gives per-example gradients of m single models.

    Parameters are flat (the layout of the module docstring): ``theta`` is ``(m, d)``, one
    model per row (e.g. the models m uploads were computed from), with inputs ``x (m, b, F)``
    and labels ``y (m, b)``: row j's examples are scored by model j.
    """

    def flat_logits(self, flat: Tensor, x: Tensor) -> Tensor:
        """Logits ``(B, C)`` of one model, flat ``(d,)``, on ``x (B, F)``."""
        ...

    def per_example_grads(self, theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """``(m, b, d)`` gradients of each example's cross-entropy under its row's model."""
        ...

    def mean_grads(self, theta: Tensor, x: Tensor, y: Tensor, mask: Tensor | None = None,
                   denom: int | None = None) -> Tensor:
        """``(m, d)``: per row, the sum of the gradients over the examples (those with
        ``mask`` 1) divided by ``denom`` (default: the number of examples ``b``)."""
        ...


# --------------------------------------------------------------------------- flat helpers


def num_parameters(model: BatchedModel) -> int:
    """Number of trainable parameters of one client (d).

    Example:
        >>> num_parameters(MultinomialLogReg(20, 10))
        210
        >>> num_parameters(MLP(784, 196, 10))
        155830
    """
    return sum(math.prod(shape) for shape in model.parameter_shapes().values())


def flatten(params: Mapping[str, Tensor]) -> Tensor:
    """Concatenate stacked parameters into one ``(K, d)`` matrix (dict order, row-major).

    Example:
        >>> p = {"weight": torch.zeros(3, 20, 10), "bias": torch.ones(3, 10)}
        >>> flatten(p).shape
        torch.Size([3, 210])
    """
    if not params:
        raise InvalidParameterError("params", params, "a non-empty mapping of tensors")
    tensors = list(params.values())
    k = tensors[0].shape[0] if tensors[0].dim() > 0 else -1
    for name, t in params.items():
        if t.dim() < 1 or t.shape[0] != k:
            raise InvalidParameterError(
                f"params[{name!r}]", tuple(t.shape), "a tensor with the common leading client axis"
            )
    return torch.cat([t.reshape(k, -1) for t in tensors], dim=1)


def unflatten(flat: Tensor, shapes: Mapping[str, tuple[int, ...]]) -> Params:
    """Inverse of :func:`flatten`: split ``(K, d)`` into ``{name: (K, *shape)}`` views.

    Args:
        flat: Matrix of shape ``(K, d)``.
        shapes: Per-client shapes in flat order, e.g. ``model.parameter_shapes()``.

    Returns:
        Views into ``flat`` (no copy); ``.clone()`` them if ``flat`` will be modified.

    Example:
        >>> m = MultinomialLogReg(4, 3)
        >>> p = unflatten(torch.arange(30.0).reshape(2, 15), m.parameter_shapes())
        >>> p["weight"].shape, p["bias"][0].tolist()
        (torch.Size([2, 4, 3]), [12.0, 13.0, 14.0])
    """
    total = sum(math.prod(s) for s in shapes.values())
    if flat.dim() != 2 or flat.shape[1] != total:
        raise InvalidParameterError("flat", tuple(flat.shape), f"a (K, {total}) tensor")
    out: Params = {}
    start = 0
    for name, shape in shapes.items():
        size = math.prod(shape)
        out[name] = flat[:, start : start + size].view(flat.shape[0], *shape)
        start += size
    return out


def split_flat(flat: Tensor, shapes: Mapping[str, tuple[int, ...]]) -> Params:
    """One model's flat ``(d,)`` parameters as ``{name: view}`` (no client axis, no copy).

    Example:
        >>> p = split_flat(torch.arange(15.0), MultinomialLogReg(4, 3).parameter_shapes())
        >>> p["weight"].shape, p["bias"].tolist()
        (torch.Size([4, 3]), [12.0, 13.0, 14.0])
    """
    out: Params = {}
    start = 0
    for name, shape in shapes.items():
        size = math.prod(shape)
        out[name] = flat[start : start + size].view(shape)
        start += size
    return out


def masked_mean_cross_entropy(logits: Tensor, y: Tensor, mask: Tensor) -> Tensor:
    """Per-client mean cross-entropy over the rows where ``mask`` is true.

    Args:
        logits: ``(K, B, C)`` logits (not probabilities).
        y: ``(K, B)`` integer labels; values on padding rows are ignored.
        mask: ``(K, B)``, true (or 1) on real rows and false (0) on padding.

    Returns:
        ``(K,)`` losses. A client with no real row gets 0 (an empty sum), not NaN.
    """
    m = mask.to(logits.dtype)
    labels = torch.where(mask.bool(), y, torch.zeros_like(y)).long()
    nll = -logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def _check_batched_x(x: Tensor, num_features: int) -> None:
    if x.dim() != 3 or x.shape[-1] != num_features:
        raise InvalidParameterError("x", tuple(x.shape), f"a (K, B, {num_features}) tensor")


def _weighted_one_hot(y: Tensor, weights: Tensor, num_classes: int, dim: int) -> Tensor:
    """``weights * one_hot(y)`` with the class axis at ``dim`` (-1 or -2), in one scatter."""
    shape = list(y.shape)
    shape.insert(len(shape) + 1 + dim, num_classes)
    out = torch.zeros(shape, dtype=weights.dtype, device=weights.device)
    return out.scatter_(dim, y.long().unsqueeze(dim), weights.unsqueeze(dim))


def _row_weights(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """1/n_real on real rows and 0 on padding, per client: the weights of a masked mean."""
    m = mask.to(dtype)
    return m / m.sum(-1, keepdim=True).clamp(min=1.0)


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class MultinomialLogReg:
    """Multinomial logistic regression ``logits = x @ W + b``, stacked over clients.

    Parameters: ``weight`` ``(K, num_features, num_classes)`` and ``bias`` ``(K, num_classes)``.
    Initialisation follows the authors' code (spec ``upcycled_fl.md`` section 5): weights
    N(0, ``init_std``^2) with ``init_std = 0.01``, bias 0.

    Example:
        >>> m = MultinomialLogReg(20, 10)
        >>> g = torch.Generator().manual_seed(0)
        >>> p = m.init(4, generator=g)
        >>> m.forward(p, torch.zeros(4, 7, 20)).shape
        torch.Size([4, 7, 10])
    """

    num_features: int
    num_classes: int
    init_std: float = 0.01

    def __post_init__(self) -> None:
        _positive_int("num_features", self.num_features)
        _positive_int("num_classes", self.num_classes)
        if (
            isinstance(self.init_std, bool)
            or not (isinstance(self.init_std, (int, float)) and math.isfinite(self.init_std))
            or self.init_std < 0
        ):
            raise InvalidParameterError("init_std", self.init_std, "finite and >= 0")

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-client parameter shapes in flat order."""
        return {"weight": (self.num_features, self.num_classes), "bias": (self.num_classes,)}

    @property
    def num_parameters(self) -> int:
        """Parameters per client: ``(num_features + 1) * num_classes``."""
        return num_parameters(self)

    def init(
        self,
        num_clients: int,
        *,
        generator: torch.Generator,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Params:
        """Draw K independent initial models (draws on the generator's device, then moved)."""
        k = _check_num_clients(num_clients)
        dtype = _float_dtype(dtype)
        gdev = generator.device
        w = torch.randn(
            k, self.num_features, self.num_classes, generator=generator, device=gdev, dtype=dtype
        )
        w.mul_(self.init_std)
        return {
            "weight": w.to(device or gdev),
            "bias": torch.zeros(k, self.num_classes, device=device or gdev, dtype=dtype),
        }

    def forward(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Logits ``(K, B, C)`` for inputs ``x`` of shape ``(K, B, F)``."""
        _check_batched_x(x, self.num_features)
        return torch.baddbmm(params["bias"].unsqueeze(1), x, params["weight"])

    def forward_single(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Logits ``(B, C)`` of one client (parameters without the client axis)."""
        return x @ params["weight"] + params["bias"]

    def loss(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        """Per-client mean cross-entropy ``(K,)`` over the real rows of ``x``."""
        return masked_mean_cross_entropy(self.forward(params, x), y, mask)

    def grad(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, mask: Tensor) -> Params:
        """Closed-form gradient of :meth:`loss` per client (no autograd)."""
        w = _row_weights(mask, x.dtype).unsqueeze(-1)
        d = self.forward(params, x).softmax(-1).mul_(w)
        d.sub_(F.one_hot(torch.where(mask.bool(), y, 0).long(), self.num_classes) * w)
        return {"weight": torch.bmm(x.transpose(1, 2), d), "bias": d.sum(1)}

    # -- per-example gradients on flat parameters (see PerExampleModel), closed form

    def flat_logits(self, flat: Tensor, x: Tensor) -> Tensor:
        """Logits ``(B, C)`` of one model, flat ``[W; b]`` ``(d,)``, on ``x (B, F)``."""
        fc = self.num_features * self.num_classes
        return x @ flat[:fc].view(self.num_features, self.num_classes) + flat[fc:]

    def _residuals(self, theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """``softmax(logits) - one_hot(y)``, ``(m, b, C)``, of row j's examples under model j."""
        m, f, c = x.shape[0], self.num_features, self.num_classes
        fc = f * c
        logits = torch.baddbmm(theta[:, None, fc:], x, theta[:, :fc].view(m, f, c))
        r = logits.softmax(-1)
        return r.sub_(F.one_hot(y, c).to(r.dtype))

    def per_example_grads(self, theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """``(m, b, d)`` per-example gradients of the cross-entropy (flat layout)."""
        m, b, _ = x.shape
        r = self._residuals(theta, x, y)
        gw = x[:, :, :, None] * r[:, :, None, :]
        return torch.cat([gw.reshape(m, b, self.num_features * self.num_classes), r], dim=2)

    def clipped_grad_sum(self, theta: Tensor, x: Tensor, y: Tensor,
                         factor: Callable[[Tensor], Tensor]) -> Tensor:
        """``(m, d)``: sum over the rows of ``f_i g_i``, ``f = factor(norms)`` from the
        per-example gradient norms ``(m, b)`` (float64), never materialising ``g_i``:
        ``||g_i||^2 = (||x_i||^2 + 1) ||r_i||^2`` (DP-SGD's clipped sum, ghost norms)."""
        m = x.shape[0]
        r = self._residuals(theta, x, y)
        x64, r64 = x.to(torch.float64), r.to(torch.float64)
        sq = (x64.pow(2).sum(2) + 1.0) * r64.pow(2).sum(2)
        f = factor(sq.sqrt()).to(r.dtype)
        fr = r * f[:, :, None]
        gw = torch.bmm(x.transpose(1, 2), fr).reshape(m, self.num_features * self.num_classes)
        return torch.cat([gw, fr.sum(1)], dim=1)

    def mean_grads(self, theta: Tensor, x: Tensor, y: Tensor, mask: Tensor | None = None,
                   denom: int | None = None) -> Tensor:
        """``(m, d)``: the gradients summed over the rows (those with ``mask`` 1) and divided
        by ``denom`` (default: the number of rows)."""
        m, b, _ = x.shape
        r = self._residuals(theta, x, y)
        if mask is not None:
            r.mul_(mask[:, :, None].to(r.dtype))
        r.div_(b if denom is None else denom)
        gw = torch.bmm(x.transpose(1, 2), r).reshape(m, self.num_features * self.num_classes)
        return torch.cat([gw, r.sum(1)], dim=1)

    # -- solver kernel. Softmax runs over dim 1 of a (K, C, B) tensor: on CPU, PyTorch's
    # last-dim softmax over a handful of classes is several times slower than this layout.

    def prepare_minibatches(self, x: Tensor, y: Tensor, weights: Tensor) -> tuple[Tensor, ...]:
        """Lay out T steps of minibatches (see :class:`BatchedModel`).

        Returns ``(xa_t, w_t, yw_t)``: features with a constant-one column, transposed,
        ``(T, K, F+1, B)``; weights ``(T, K, 1, B)``; weighted one-hot labels ``(T, K, C, B)``.
        """
        f = self.num_features
        xa_t = torch.empty(*x.shape[:2], f + 1, x.shape[2], dtype=x.dtype, device=x.device)
        xa_t[:, :, :f].copy_(x.transpose(-1, -2))
        xa_t[:, :, f].fill_(1.0)
        yw_t = _weighted_one_hot(y, weights, self.num_classes, dim=-2)
        return xa_t, weights.unsqueeze(-2), yw_t

    def gradient_accumulator(self, theta: Tensor, out: Tensor) -> GradientAccumulator:
        """``accumulate(minibatch, beta)`` for flat ``theta`` and ``out`` ``(K, d)``."""
        k, f1, c = theta.shape[0], self.num_features + 1, self.num_classes
        a_t = theta.view(k, f1, c).transpose(1, 2)  # (K, C, F+1)
        o = out.view(k, f1, c)

        def accumulate(minibatch: tuple[Tensor, ...], beta: float) -> None:
            xa_t, w_t, yw_t = minibatch
            p_t = torch.bmm(a_t, xa_t).softmax(1)  # (K, C, B)
            p_t.mul_(w_t).sub_(yw_t)
            o.baddbmm_(xa_t, p_t.transpose(1, 2), beta=beta)

        return accumulate


@dataclass(frozen=True)
class MLP:
    """Two-layer perceptron ``Linear(F, H) - ReLU - Linear(H, C)``, stacked over clients.

    The paper's FEMNIST model is 784-196-10 ("two layer, hidden 14*14"). The authors' code adds
    Dropout(0.5) and a final softmax; this model has neither (dropout would add a second source
    of training randomness; the softmax would be a double softmax). Initialisation is PyTorch's
    ``nn.Linear`` default: weight and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

    Parameters: ``w1 (K, F, H)``, ``b1 (K, H)``, ``w2 (K, H, C)``, ``b2 (K, C)``.

    Example:
        >>> m = MLP(784, 196, 10)
        >>> p = m.init(2, generator=torch.Generator().manual_seed(0))
        >>> m.forward(p, torch.zeros(2, 5, 784)).shape
        torch.Size([2, 5, 10])
    """

    num_features: int = 784
    hidden: int = 196
    num_classes: int = 10

    def __post_init__(self) -> None:
        _positive_int("num_features", self.num_features)
        _positive_int("hidden", self.hidden)
        _positive_int("num_classes", self.num_classes)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-client parameter shapes in flat order."""
        f, h, c = self.num_features, self.hidden, self.num_classes
        return {"w1": (f, h), "b1": (h,), "w2": (h, c), "b2": (c,)}

    @property
    def num_parameters(self) -> int:
        """Parameters per client: ``(F + 1) H + (H + 1) C``."""
        return num_parameters(self)

    def init(
        self,
        num_clients: int,
        *,
        generator: torch.Generator,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Params:
        """Draw K independent initial models (draws on the generator's device, then moved)."""
        k = _check_num_clients(num_clients)
        dtype = _float_dtype(dtype)
        gdev = generator.device
        out: Params = {}
        fan_in = {"w1": self.num_features, "b1": self.num_features}
        fan_in |= {"w2": self.hidden, "b2": self.hidden}
        for name, shape in self.parameter_shapes().items():
            bound = 1.0 / math.sqrt(fan_in[name])
            u = torch.rand(k, *shape, generator=generator, device=gdev, dtype=dtype)
            out[name] = u.mul_(2 * bound).sub_(bound).to(device or gdev)
        return out

    def forward(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Logits ``(K, B, C)`` for inputs ``x`` of shape ``(K, B, F)``."""
        _check_batched_x(x, self.num_features)
        h = torch.baddbmm(params["b1"].unsqueeze(1), x, params["w1"]).relu_()
        return torch.baddbmm(params["b2"].unsqueeze(1), h, params["w2"])

    def forward_single(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Logits ``(B, C)`` of one client (parameters without the client axis)."""
        h = torch.relu(x @ params["w1"] + params["b1"])
        return h @ params["w2"] + params["b2"]

    # -- per-example gradients on flat parameters (see PerExampleModel), by torch.func

    def flat_logits(self, flat: Tensor, x: Tensor) -> Tensor:
        """Logits ``(B, C)`` of one model, flat ``(d,)``, on ``x (B, F)``."""
        return self.forward_single(split_flat(flat, self.parameter_shapes()), x)

    def per_example_grads(self, theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """``(m, b, d)`` per-example gradients of the cross-entropy (``vmap`` of ``grad``)."""
        from torch.func import grad, vmap

        def loss_one(flat: Tensor, xi: Tensor, yi: Tensor) -> Tensor:
            return F.cross_entropy(self.flat_logits(flat, xi[None]), yi[None])

        return vmap(vmap(grad(loss_one), in_dims=(None, 0, 0)), in_dims=(0, 0, 0))(theta, x, y)

    def clipped_grad_sum(self, theta: Tensor, x: Tensor, y: Tensor,
                         factor: Callable[[Tensor], Tensor]) -> Tensor:
        """``(m, d)``: sum over the rows of ``f_i g_i``, ``f = factor(norms)`` from the
        per-example gradient norms ``(m, b)`` (float64), by backpropagation by hand and
        ghost norms (each layer's per-example gradient is an outer product ``a_i delta_i``,
        of squared norm ``(||a_i||^2 + 1) ||delta_i||^2`` with its bias): no ``(m, b, d)``
        tensor is formed."""
        p = unflatten(theta, self.parameter_shapes())
        h = torch.baddbmm(p["b1"].unsqueeze(1), x, p["w1"]).relu_()
        d2 = torch.baddbmm(p["b2"].unsqueeze(1), h, p["w2"]).softmax(-1)
        d2.sub_(F.one_hot(y, self.num_classes).to(d2.dtype))
        d1 = torch.bmm(d2, p["w2"].transpose(1, 2)).mul_(h > 0)

        def sq(a: Tensor, d: Tensor) -> Tensor:
            return (a.to(torch.float64).pow(2).sum(2) + 1.0) * d.to(torch.float64).pow(2).sum(2)

        f = factor((sq(x, d1) + sq(h, d2)).sqrt()).to(d1.dtype)[:, :, None]
        d1, d2 = d1 * f, d2 * f
        m = x.shape[0]
        return torch.cat([torch.bmm(x.transpose(1, 2), d1).reshape(m, -1), d1.sum(1),
                          torch.bmm(h.transpose(1, 2), d2).reshape(m, -1), d2.sum(1)], dim=1)

    def mean_grads(self, theta: Tensor, x: Tensor, y: Tensor, mask: Tensor | None = None,
                   denom: int | None = None) -> Tensor:
        """``(m, d)``: the per-example gradients summed over the rows (those with ``mask`` 1)
        and divided by ``denom`` (default: the number of rows)."""
        per = self.per_example_grads(theta, x, y)
        if mask is not None:
            per = per * mask[:, :, None].to(per.dtype)
        return per.sum(1) / (per.shape[1] if denom is None else denom)

    def loss(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        """Per-client mean cross-entropy ``(K,)`` over the real rows of ``x``."""
        return masked_mean_cross_entropy(self.forward(params, x), y, mask)

    def grad(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, mask: Tensor) -> Params:
        """Closed-form gradient of :meth:`loss` per client (backpropagation by hand)."""
        _check_batched_x(x, self.num_features)
        w = _row_weights(mask, x.dtype).unsqueeze(-1)
        h = torch.baddbmm(params["b1"].unsqueeze(1), x, params["w1"]).relu_()
        d = torch.baddbmm(params["b2"].unsqueeze(1), h, params["w2"]).softmax(-1).mul_(w)
        d.sub_(F.one_hot(torch.where(mask.bool(), y, 0).long(), self.num_classes) * w)
        dh = torch.bmm(d, params["w2"].transpose(1, 2)).mul_(h > 0)
        return {
            "w1": torch.bmm(x.transpose(1, 2), dh),
            "b1": dh.sum(1),
            "w2": torch.bmm(h.transpose(1, 2), d),
            "b2": d.sum(1),
        }

    def prepare_minibatches(self, x: Tensor, y: Tensor, weights: Tensor) -> tuple[Tensor, ...]:
        """Lay out T steps of minibatches (see :class:`BatchedModel`).

        Returns ``(xa, w, yw)``: features with a constant-one column ``(T, K, B, F+1)``,
        weights ``(T, K, B, 1)`` and weighted one-hot labels ``(T, K, B, C)``.
        """
        f = self.num_features
        xa = torch.empty(*x.shape[:3], f + 1, dtype=x.dtype, device=x.device)
        xa[..., :f].copy_(x)
        xa[..., f].fill_(1.0)
        yw = _weighted_one_hot(y, weights, self.num_classes, dim=-1)
        return xa, weights.unsqueeze(-1), yw

    def gradient_accumulator(self, theta: Tensor, out: Tensor) -> GradientAccumulator:
        """``accumulate(minibatch, beta)`` for flat ``theta`` and ``out`` ``(K, d)``."""
        k = theta.shape[0]
        f1, h, c = self.num_features + 1, self.hidden, self.num_classes
        split = f1 * h
        a1 = theta[:, :split].view(k, f1, h)
        w2 = theta[:, split:].view(k, h + 1, c)[:, :h]
        b2 = theta[:, split:].view(k, h + 1, c)[:, h:]
        g1 = out[:, :split].view(k, f1, h)
        g2w = out[:, split:].view(k, h + 1, c)[:, :h]
        g2b = out[:, split:].view(k, h + 1, c)[:, h]

        def accumulate(minibatch: tuple[Tensor, ...], beta: float) -> None:
            xa, w, yw = minibatch
            hid = torch.bmm(xa, a1).relu_()
            d = torch.baddbmm(b2, hid, w2).softmax(-1)
            d.mul_(w).sub_(yw)
            dh = torch.bmm(d, w2.transpose(1, 2)).mul_(hid > 0)
            g2w.baddbmm_(hid.transpose(1, 2), d, beta=beta)
            g2b.mul_(beta).add_(d.sum(1))
            g1.baddbmm_(xa.transpose(1, 2), dh, beta=beta)

        return accumulate
