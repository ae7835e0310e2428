"""Deep models (FEMNIST CNN, MAPA's pooled CNN, Sent140 stacked LSTM) on a leading client axis.

They satisfy the same :class:`fl_examples.core.models.BatchedModel` protocol as the closed-form
models, so :func:`fl_examples.core.local.local_sgd` and
:func:`fl_examples.core.local.local_sgd_reference` train them unchanged. Each model writes the
network once, for one client (:meth:`forward_single`); the batched methods are derived from it
with ``torch.func``: logits are ``vmap(forward_single)`` over the client axis and gradients are
``vmap(grad(weighted cross-entropy))``, so there is no Python loop over clients and no
hand-written backward pass. The solver kernel (``prepare_minibatches`` /
``gradient_accumulator``) uses the same per-client gradients, on views of the solver's flat
``(K, d)`` matrices (flat layout: parameters in :meth:`parameter_shapes` order, each row-major).
Per-example gradients of many single models (:class:`fl_examples.core.models.PerExampleModel`,
what MAPA's edges need) are ``vmap(vmap(grad(cross-entropy)))`` over models and examples.

Both models output **logits**; the loss is cross-entropy applied once. Neither has dropout
(it would add a second source of training randomness), matching :class:`models.MLP`.
Initialisation mirrors PyTorch's defaults for the corresponding ``nn`` layers, drawn from an
explicit ``torch.Generator``.

Spec ``upcycled_fl.md`` section 5: the FEMNIST CNN is "a 3x3 conv with 3 channels, then linear
layers of width 1000 and 100"; the Sent140 model is a stacked LSTM with 2 layers, 128 hidden
units, 300-d embeddings, sequence length 25 and 2 classes (the paper's description; the
authors' code uses one bidirectional layer instead). Embeddings here are trained from random
initialisation (no pretrained vectors).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import grad, vmap

from fl_examples.core.models import (
    GradientAccumulator,
    masked_mean_cross_entropy,
    num_parameters,
    split_flat,
    unflatten,
)
from privkit.errors import InvalidParameterError

__all__ = ["CNN", "PooledCNN", "StackedLSTM"]

Params = dict[str, Tensor]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidParameterError(name, value, "an integer >= 1")
    return value


def _positive_ints(name: str, value: object) -> tuple[int, ...]:
    ok = isinstance(value, (tuple, list)) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
    )
    if not ok:
        raise InvalidParameterError(name, value, "a tuple of integers >= 1")
    return tuple(value)  # type: ignore[arg-type]


class _FunctionalModel(abc.ABC):
    """Batched protocol methods derived from ``forward_single`` with ``torch.func``.

    Subclasses define ``num_features``, ``num_classes``, :meth:`parameter_shapes`,
    :meth:`_init_spec` and :meth:`forward_single`.
    """

    num_features: int
    num_classes: int

    @abc.abstractmethod
    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-client parameter shapes in flat order."""

    @abc.abstractmethod
    def _init_spec(self) -> dict[str, tuple[str, float]]:
        """``{name: ("uniform", bound) | ("normal", std) | ("zeros", 0)}`` for every parameter
        (zeros draw nothing from the generator)."""

    @abc.abstractmethod
    def forward_single(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Logits of one client (parameters without the client axis)."""

    @property
    def num_parameters(self) -> int:
        """Trainable parameters per client (d)."""
        return num_parameters(self)  # type: ignore[arg-type]

    def init(
        self,
        num_clients: int,
        *,
        generator: torch.Generator,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Params:
        """Draw K independent initial models (draws on the generator's device, then moved)."""
        k = _positive_int("num_clients", num_clients)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise InvalidParameterError("dtype", dtype, "a floating-point torch.dtype")
        if not isinstance(generator, torch.Generator):
            raise InvalidParameterError("generator", generator, "a torch.Generator")
        gdev = generator.device
        spec = self._init_spec()
        out: Params = {}
        for name, shape in self.parameter_shapes().items():
            kind, scale = spec[name]
            if kind == "zeros":
                t = torch.zeros(k, *shape, device=gdev, dtype=dtype)
            elif kind == "normal":
                t = torch.randn(k, *shape, generator=generator, device=gdev, dtype=dtype)
                t.mul_(scale)
            else:
                t = torch.rand(k, *shape, generator=generator, device=gdev, dtype=dtype)
                t.mul_(2 * scale).sub_(scale)
            out[name] = t.to(device or gdev)
        return out

    # -- batched forward / loss / gradient

    def _check_x(self, x: Tensor) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.num_features:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise InvalidParameterError("x", got, f"a (K, B, {self.num_features}) tensor")

    def forward(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Logits ``(K, B, C)`` for inputs ``x`` of shape ``(K, B, F)``."""
        self._check_x(x)
        return vmap(self.forward_single)(dict(params), x)

    def loss(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        """Per-client mean cross-entropy ``(K,)`` over the real rows of ``x``."""
        return masked_mean_cross_entropy(self.forward(params, x), y, mask)

    def _weighted_ce(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        """One client's ``sum_rows w * CE(logits, y)`` (a scalar)."""
        logits = self.forward_single(params, x)
        return (F.cross_entropy(logits, y, reduction="none") * w).sum()

    def grad(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, mask: Tensor) -> Params:
        """Gradient of :meth:`loss` per client, ``{name: (K, *shape)}`` (``torch.func``).

        Padding rows are replaced by zeros (features) and class 0 (labels) and weighted 0, so
        their content never matters.
        """
        self._check_x(x)
        keep = mask.bool()
        m = keep.to(x.dtype)
        w = m / m.sum(-1, keepdim=True).clamp(min=1.0)
        xs = torch.where(keep.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
        ys = torch.where(keep, y, torch.zeros_like(y)).long()
        params = {k: v.detach() for k, v in params.items()}
        return vmap(grad(self._weighted_ce))(params, xs, ys, w)

    # -- per-example gradients on flat parameters (see PerExampleModel)

    def flat_logits(self, flat: Tensor, x: Tensor) -> Tensor:
        """Logits ``(B, C)`` of one model, flat ``(d,)``, on ``x (B, F)``."""
        return self.forward_single(split_flat(flat, self.parameter_shapes()), x)

    def per_example_grads(self, theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """``(m, b, d)``: ``vmap`` over the m models and their examples of ``grad`` of one
        example's cross-entropy."""
        def loss_one(flat: Tensor, xi: Tensor, yi: Tensor) -> Tensor:
            return F.cross_entropy(self.flat_logits(flat, xi[None]), yi[None])

        return vmap(vmap(grad(loss_one), in_dims=(None, 0, 0)), in_dims=(0, 0, 0))(theta, x, y)

    def mean_grads(self, theta: Tensor, x: Tensor, y: Tensor, mask: Tensor | None = None,
                   denom: int | None = None) -> Tensor:
        """``(m, d)``: the per-example gradients summed over the rows (those with ``mask`` 1)
        and divided by ``denom`` (default: their mean)."""
        per = self.per_example_grads(theta, x, y)
        if mask is None and denom is None:
            return per.mean(1)
        if mask is not None:
            per = per * mask[:, :, None].to(per.dtype)
        return per.sum(1) / (per.shape[1] if denom is None else denom)

    # -- solver kernel (see BatchedModel)

    def prepare_minibatches(self, x: Tensor, y: Tensor, weights: Tensor) -> tuple[Tensor, ...]:
        """Lay out T steps of minibatches: ``(x (T, K, B, F), y long (T, K, B), w (T, K, B))``."""
        return x, y.long(), weights

    def gradient_accumulator(self, theta: Tensor, out: Tensor) -> GradientAccumulator:
        """``accumulate(minibatch, beta)``: ``out <- beta * out + grad`` for flat ``(K, d)``."""
        shapes = self.parameter_shapes()
        p = unflatten(theta, shapes)  # views: in-place updates of theta are seen
        o = unflatten(out, shapes)
        batched_grad = vmap(grad(self._weighted_ce))

        def accumulate(minibatch: tuple[Tensor, ...], beta: float) -> None:
            x, y, w = minibatch
            g = batched_grad(p, x, y, w)
            for name, t in o.items():
                t.mul_(beta).add_(g[name])

        return accumulate


@dataclass(frozen=True)
class CNN(_FunctionalModel):
    """FEMNIST CNN: Conv3x3(1 -> channels, padding 1) - ReLU - [Linear - ReLU]* - Linear.

    Inputs are flattened square grey images, ``num_features = image_size ** 2`` (784 for
    FEMNIST), read row-major as ``(1, image_size, image_size)``. The linear widths are
    ``hidden`` (paper: 1000 and 100). Parameters (per client): ``conv_w (channels, 1, 3, 3)``,
    ``conv_b (channels,)``, then per linear layer j = 1, 2, ...: ``w{j} (fan_in, fan_out)``
    and ``b{j} (fan_out,)``; the flattened conv output is in PyTorch's (C, H, W) order.
    Initialisation is PyTorch's ``nn.Conv2d`` / ``nn.Linear`` default,
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases (conv fan_in = 9).

    Example:
        >>> m = CNN(image_size=6, channels=2, hidden=(8, 4), num_classes=3)
        >>> p = m.init(2, generator=torch.Generator().manual_seed(0))
        >>> m.forward(p, torch.zeros(2, 5, 36)).shape
        torch.Size([2, 5, 3])
        >>> CNN().num_parameters
        2454140
    """

    image_size: int = 28
    channels: int = 3
    hidden: tuple[int, ...] = (1000, 100)
    num_classes: int = 10

    def __post_init__(self) -> None:
        _positive_int("image_size", self.image_size)
        _positive_int("channels", self.channels)
        object.__setattr__(self, "hidden", _positive_ints("hidden", self.hidden))
        _positive_int("num_classes", self.num_classes)

    @property
    def num_features(self) -> int:  # type: ignore[override]
        """Flattened image size ``image_size ** 2``."""
        return self.image_size**2

    def _widths(self) -> list[int]:
        return [self.channels * self.image_size**2, *self.hidden, self.num_classes]

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-client parameter shapes in flat order."""
        shapes: dict[str, tuple[int, ...]] = {
            "conv_w": (self.channels, 1, 3, 3),
            "conv_b": (self.channels,),
        }
        widths = self._widths()
        for j, (fi, fo) in enumerate(zip(widths[:-1], widths[1:]), start=1):
            shapes[f"w{j}"] = (fi, fo)
            shapes[f"b{j}"] = (fo,)
        return shapes

    def _init_spec(self) -> dict[str, tuple[str, float]]:
        spec = {"conv_w": ("uniform", 1 / 3.0), "conv_b": ("uniform", 1 / 3.0)}
        widths = self._widths()
        for j, fi in enumerate(widths[:-1], start=1):
            bound = 1.0 / math.sqrt(fi)
            spec[f"w{j}"] = spec[f"b{j}"] = ("uniform", bound)
        return spec

    def forward_single(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Logits ``(B, C)`` of one client (parameters without the client axis)."""
        s = self.image_size
        h = F.conv2d(x.reshape(-1, 1, s, s), params["conv_w"], params["conv_b"], padding=1)
        h = h.relu().flatten(1)
        n_linear = len(self.hidden) + 1
        for j in range(1, n_linear + 1):
            h = torch.addmm(params[f"b{j}"], h, params[f"w{j}"])
            if j < n_linear:
                h = h.relu()
        return h


@dataclass(frozen=True)
class PooledCNN(_FunctionalModel):
    """MAPA's testbed CNN (spec ``mapa.md`` section 9), for flattened square grey images.

    Conv5x5(1 -> channels) - ReLU - MaxPool2 - Conv5x5(channels -> channels) - ReLU - MaxPool2
    - Linear(-> num_classes), no padding. For 28x28 images and 10 channels the linear layer
    reads 160 features and d = 250 + 10 + 2500 + 10 + 1600 + 10 = 4380. Parameters (per
    client): ``conv1_w (channels, 1, 5, 5)``, ``conv1_b``, ``conv2_w (channels, channels, 5,
    5)``, ``conv2_b``, ``fc_w (features, num_classes)``, ``fc_b``. Initialisation: conv filters
    N(0, 1/fan_in) (fan_in = in_channels * 25, a reading of the testbed's "1/(number of
    elements)"), the linear weight N(0, 0.01^2), biases 0.

    Example:
        >>> PooledCNN().num_parameters
        4380
        >>> m = PooledCNN(image_size=16, channels=2, num_classes=3)
        >>> p = m.init(2, generator=torch.Generator().manual_seed(0))
        >>> m.forward(p, torch.zeros(2, 5, 256)).shape
        torch.Size([2, 5, 3])
    """

    image_size: int = 28
    channels: int = 10
    num_classes: int = 10

    def __post_init__(self) -> None:
        if _positive_int("image_size", self.image_size) < 16:
            raise InvalidParameterError("image_size", self.image_size, ">= 16 (two 5x5 "
                                        "convolutions, each followed by a 2x2 pooling)")
        _positive_int("channels", self.channels)
        _positive_int("num_classes", self.num_classes)

    @property
    def num_features(self) -> int:  # type: ignore[override]
        """Flattened image size ``image_size ** 2``."""
        return self.image_size**2

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-client parameter shapes in flat order."""
        ch, side = self.channels, ((self.image_size - 4) // 2 - 4) // 2
        return {"conv1_w": (ch, 1, 5, 5), "conv1_b": (ch,), "conv2_w": (ch, ch, 5, 5),
                "conv2_b": (ch,), "fc_w": (ch * side * side, self.num_classes),
                "fc_b": (self.num_classes,)}

    def _init_spec(self) -> dict[str, tuple[str, float]]:
        spec: dict[str, tuple[str, float]] = {}
        for name, shape in self.parameter_shapes().items():
            if name.endswith("_b"):
                spec[name] = ("zeros", 0.0)
            else:
                spec[name] = ("normal", 0.01 if name == "fc_w"
                              else 1.0 / math.sqrt(math.prod(shape[1:])))
        return spec

    def forward_single(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Logits ``(B, C)`` of one client (parameters without the client axis)."""
        s = self.image_size
        h = F.conv2d(x.reshape(-1, 1, s, s), params["conv1_w"], params["conv1_b"])
        h = F.max_pool2d(h.relu(), 2)
        h = F.conv2d(h, params["conv2_w"], params["conv2_b"])
        h = F.max_pool2d(h.relu(), 2).flatten(1)
        return h @ params["fc_w"] + params["fc_b"]


@dataclass(frozen=True)
class StackedLSTM(_FunctionalModel):
    """Sent140 model: Embedding - LSTM x ``layers`` - last hidden state - Linear.

    Inputs are token ids stored as floats, ``(..., seq_len)`` (``num_features = seq_len``),
    converted with ``.long()``; ids must lie in ``[0, vocab_size)``. The LSTM cell is written
    out with matmuls in ``nn.LSTM``'s convention (gates i, f, g, o; two biases per layer), so
    ``vmap`` over stacked client parameters needs no cuDNN kernel. Parameters (per client):
    ``embedding (vocab_size, embedding_dim)``; per layer l = 0, 1, ...: ``w_ih{l} (in, 4H)``,
    ``w_hh{l} (H, 4H)``, ``b_ih{l} (4H,)``, ``b_hh{l} (4H,)`` (transposes of ``nn.LSTM``'s
    weights); ``out_w (H, num_classes)``, ``out_b (num_classes,)``. Initialisation is PyTorch's
    default: embedding N(0, 1), LSTM U(-1/sqrt(H), 1/sqrt(H)), output layer
    U(-1/sqrt(H), 1/sqrt(H)).

    Example:
        >>> m = StackedLSTM(vocab_size=20, embedding_dim=5, hidden=6, seq_len=4)
        >>> p = m.init(3, generator=torch.Generator().manual_seed(0))
        >>> m.forward(p, torch.ones(3, 2, 4)).shape
        torch.Size([3, 2, 2])
    """

    vocab_size: int
    embedding_dim: int = 300
    hidden: int = 128
    layers: int = 2
    num_classes: int = 2
    seq_len: int = 25

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embedding_dim", "hidden", "layers", "num_classes", "seq_len"):
            _positive_int(name, getattr(self, name))

    @property
    def num_features(self) -> int:  # type: ignore[override]
        """Sequence length (one token id per feature)."""
        return self.seq_len

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-client parameter shapes in flat order."""
        h4 = 4 * self.hidden
        shapes: dict[str, tuple[int, ...]] = {"embedding": (self.vocab_size, self.embedding_dim)}
        for layer in range(self.layers):
            fan_in = self.embedding_dim if layer == 0 else self.hidden
            shapes[f"w_ih{layer}"] = (fan_in, h4)
            shapes[f"w_hh{layer}"] = (self.hidden, h4)
            shapes[f"b_ih{layer}"] = (h4,)
            shapes[f"b_hh{layer}"] = (h4,)
        shapes["out_w"] = (self.hidden, self.num_classes)
        shapes["out_b"] = (self.num_classes,)
        return shapes

    def _init_spec(self) -> dict[str, tuple[str, float]]:
        bound = 1.0 / math.sqrt(self.hidden)
        spec = {name: ("uniform", bound) for name in self.parameter_shapes()}
        spec["embedding"] = ("normal", 1.0)
        return spec

    def forward_single(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """Logits ``(B, C)`` of one client (parameters without the client axis)."""
        ids = x.long() if x.is_floating_point() else x
        seq = F.embedding(ids, params["embedding"])  # (B, L, E)
        for layer in range(self.layers):
            w_hh = params[f"w_hh{layer}"]
            # Input projections of all time steps at once; the recurrence is over time only.
            proj = seq @ params[f"w_ih{layer}"] + (params[f"b_ih{layer}"] + params[f"b_hh{layer}"])
            h = proj.new_zeros(proj.shape[0], self.hidden)
            c = h
            outputs = []
            for t in range(self.seq_len):
                gates = proj[:, t] + h @ w_hh
                i, f, g, o = gates.chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outputs.append(h)
            seq = torch.stack(outputs, dim=1)
        return torch.addmm(params["out_b"], h, params["out_w"])
