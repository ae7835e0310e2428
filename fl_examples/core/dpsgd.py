"""Record-level DP-SGD inside local training, batched over clients.

Each client runs DP-SGD (Abadi et al., CCS 2016) on its own records: at every local step each
of its ``n_i`` records joins the minibatch independently with probability ``q_i = min(1,
b / n_i)`` (Poisson sampling, so the minibatch size varies), every per-example gradient is
clipped to L2 norm ``C``, the clipped gradients are summed, ``N(0, (z C)^2 I)`` is added, and
the sum is divided by the *expected* batch size ``q_i n_i`` (a fixed number). The proximal term
``mu (w - w_bar)`` (FedProx) and momentum are post-processing: they never see a record. One
step is ``PoissonSampledDpEvent(q_i, GaussianDpEvent(z))`` under add/remove of one record; a
client that runs ``s_i`` steps in a round is charged that event ``s_i`` times
(:func:`round_event`), before training, on its own ledger entry.

Clients advance in lockstep, one step of every still-working client per iteration: a client
works for ``epochs_i * ceil(n_i / b)`` steps (``epochs_i`` expected passes over its data).
Per-example gradients come from the model (:class:`~fl_examples.core.models.PerExampleModel`:
closed form for logistic regression, ``torch.func`` for the MLP, CNN and LSTM).
:func:`local_dpsgd_reference` is the one-client-at-a-time loop the batched path is tested
against (same Poisson draws, same noise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import privkit
from fl_examples.core.local import ClientData
from fl_examples.core.models import PerExampleModel, flatten, unflatten
from privkit.errors import InvalidParameterError

__all__ = ["DpSgdSettings", "local_dpsgd", "local_dpsgd_reference", "steps_per_client",
           "sampling_rates", "round_event", "benchmark"]


@dataclass(frozen=True)
class DpSgdSettings:
    """Record-level DP-SGD's privacy knobs.

    Attributes:
        l2_clip_norm: C, the bound on each example's gradient, finite and > 0.
        noise_multiplier: z, noise stddev / C on the summed clipped gradients, > 0.
        batch_size: b, the expected minibatch size (Poisson rate b / n_i per record), >= 1.
    """

    l2_clip_norm: float
    noise_multiplier: float
    batch_size: int

    def __post_init__(self) -> None:
        from privkit import _validate

        _validate.positive("clip", self.l2_clip_norm)
        _validate.positive("noise_multiplier", self.noise_multiplier)
        _validate.positive_int("batch_size", self.batch_size)


def sampling_rates(sizes: Any, batch_size: int) -> Tensor:
    """q_i = min(1, b / n_i) per client."""
    n = torch.as_tensor(sizes, dtype=torch.float64)
    return torch.clamp(batch_size / n, max=1.0)


def steps_per_client(sizes: Any, epochs: Any, batch_size: int) -> Tensor:
    """Local steps of each client: ``epochs_i * ceil(n_i / b)`` (int64)."""
    n = torch.as_tensor(sizes, dtype=torch.int64)
    e = torch.as_tensor(epochs, dtype=torch.int64)
    return e * torch.div(n + batch_size - 1, batch_size, rounding_mode="floor")


def round_event(size: int, steps: int, settings: DpSgdSettings) -> Any:
    """The event one client is charged for a round of ``steps`` DP-SGD steps."""
    q = min(1.0, settings.batch_size / size)
    inner: Any = privkit.GaussianDpEvent(float(settings.noise_multiplier))
    if q < 1:
        inner = privkit.PoissonSampledDpEvent(q, inner)
    return privkit.SelfComposedDpEvent(inner, int(steps))


def _check(model: Any, data: ClientData) -> None:
    if not isinstance(model, PerExampleModel):
        raise InvalidParameterError(
            "model", type(model).__name__,
            "a model with per-example gradients (logreg, mlp, cnn or lstm) for --privacy record")
    if bool((data.sizes <= 0).any()):
        raise InvalidParameterError("client data", "an empty client", ">= 1 record per client")


def _clip_factor(norms: Tensor, weights: Tensor, clip: float, dtype: torch.dtype) -> Tensor:
    """Per-example scale ``min(1, C / ||g||)`` (0 on padding rows), shrunk by a few ulps of
    the working dtype so that rounding cannot let a clipped gradient exceed C."""
    factor = torch.clamp(clip / torch.clamp(norms, min=1e-300), max=1.0)
    return factor * (1.0 - 8 * torch.finfo(dtype).eps) * weights


def _noisy_step_grads(model: Any, theta: Tensor, data: ClientData, rows: Tensor, weights: Tensor,
                      settings: DpSgdSettings, expected: Tensor, noise: Tensor) -> Tensor:
    """(K, d): (sum of clipped per-example gradients of the sampled rows + noise) / E[batch].

    A model with ``clipped_grad_sum`` (logistic regression, the MLP) forms the clipped sum
    from per-example norms without materialising the (K, B, d) gradients; any other
    per-example model's gradients are materialised and clipped here."""
    k = theta.shape[0]
    ar = torch.arange(k, device=theta.device)[:, None]
    x, y = data.x[ar, rows], data.y[ar, rows]
    if x.is_floating_point():  # token ids (LSTM) stay integers
        x = x.to(theta.dtype)
    clip = settings.l2_clip_norm
    if hasattr(model, "clipped_grad_sum"):
        summed = model.clipped_grad_sum(
            theta, x, y, lambda norms: _clip_factor(norms, weights, clip, theta.dtype))
    else:
        g = model.per_example_grads(theta, x, y)  # (K, B, d)
        norms = torch.linalg.vector_norm(g.to(torch.float64), dim=2)
        factor = _clip_factor(norms, weights, clip, g.dtype)
        summed = torch.einsum("kb,kbd->kd", factor.to(g.dtype), g)
    return (summed.to(torch.float64) + noise) / expected[:, None]


def _poisson_rows(u: Tensor, q: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Rows sampled with probability q_i each (from uniforms u), as (K, B_max) indices and
    weights (1 on sampled rows, 0 on padding)."""
    take = (u < q[:, None]) & mask
    b = int(take.sum(1).max()) if take.numel() else 0
    b = max(b, 1)
    order = torch.argsort(take.to(torch.int8), dim=1, descending=True, stable=True)[:, :b]
    w = torch.gather(take, 1, order).to(torch.float64)
    return order, w


def _draws(generator: Any, u_shape: Any, noise_shape: Any, dev: Any) -> tuple[Tensor, Tensor]:
    """One step's Poisson uniforms then standard normals, float64 on ``dev``, from a
    ``torch.Generator`` or a :class:`privkit.SecureRandom` (the OS CSPRNG)."""
    if isinstance(generator, torch.Generator):
        u = torch.rand(u_shape, generator=generator, device=dev, dtype=torch.float64)
        return u, torch.randn(noise_shape, generator=generator, device=dev, dtype=torch.float64)
    u_np = generator.uniform(tuple(u_shape))
    z_np = generator.gaussian(1.0, tuple(noise_shape))  # the hardened sampler
    return (torch.as_tensor(u_np, dtype=torch.float64, device=dev),
            torch.as_tensor(z_np, dtype=torch.float64, device=dev))


@torch.no_grad()
def local_dpsgd(model: Any, params: dict[str, Tensor], w_bar: dict[str, Tensor],
                data: ClientData, *, epochs: Tensor, settings: DpSgdSettings, lr: float,
                momentum: float, proximal_mu: float, generator: torch.Generator
                ) -> dict[str, Tensor]:
    """K clients' DP-SGD in lockstep (module docstring); returns their final parameters.

    Args:
        params: (K, ...) starting parameters per client; w_bar: the global model (no axis).
        epochs: (K,) expected passes per client (0: the client does nothing).
        generator: draws the Poisson minibatches and the noise, in that order per step: a
            ``torch.Generator`` on the data's device or a :class:`privkit.SecureRandom`.
    """
    _check(model, data)
    shapes = model.parameter_shapes()
    theta = flatten(params).to(torch.float64).clone()
    bar = flatten({n: v.unsqueeze(0) for n, v in w_bar.items()}).to(torch.float64)
    k, d = theta.shape
    dev = theta.device
    dtype = next(iter(params.values())).dtype  # the model's working precision
    steps = steps_per_client(data.sizes, epochs, settings.batch_size).to(dev)
    q = sampling_rates(data.sizes, settings.batch_size).to(dev)
    expected = (q * data.sizes.to(torch.float64)).to(dev)
    stddev = settings.noise_multiplier * settings.l2_clip_norm
    buf = torch.zeros_like(theta)
    total = int(steps.max()) if k else 0
    for s in range(total):
        active = steps > s
        u, noise = _draws(generator, data.mask.shape, (k, d), dev)
        noise.mul_(stddev)
        rows, w = _poisson_rows(u, q, data.mask)
        g = _noisy_step_grads(model, theta.to(dtype), data, rows, w, settings,
                              expected, noise)
        if proximal_mu:
            g += proximal_mu * (theta - bar)
        buf = torch.where(active[:, None], momentum * buf + g, buf)
        theta = torch.where(active[:, None], theta - lr * buf, theta)
    out = unflatten(theta.to(next(iter(params.values())).dtype), shapes)
    return {n: v.clone() for n, v in out.items()}


@torch.no_grad()
def local_dpsgd_reference(model: Any, params: dict[str, Tensor], w_bar: dict[str, Tensor],
                          data: ClientData, *, epochs: Tensor, settings: DpSgdSettings,
                          lr: float, momentum: float, proximal_mu: float,
                          generator: torch.Generator) -> dict[str, Tensor]:
    """:func:`local_dpsgd` one client and one example at a time (the reference it is tested
    against: it consumes the generator in the same order)."""
    _check(model, data)
    shapes = model.parameter_shapes()
    theta = flatten(params).to(torch.float64).clone()
    bar = flatten({n: v.unsqueeze(0) for n, v in w_bar.items()}).to(torch.float64)[0]
    k, d = theta.shape
    dev = theta.device
    dtype = next(iter(params.values())).dtype
    steps = steps_per_client(data.sizes, epochs, settings.batch_size)
    q = sampling_rates(data.sizes, settings.batch_size)
    buf = torch.zeros_like(theta)
    stddev = settings.noise_multiplier * settings.l2_clip_norm
    for s in range(int(steps.max()) if k else 0):
        u, noise = _draws(generator, data.mask.shape, (k, d), dev)
        noise = noise * stddev
        for i in range(k):
            if s >= int(steps[i]):
                continue
            n = int(data.sizes[i])
            total = torch.zeros(d, dtype=torch.float64, device=dev)
            for j in range(n):
                if not float(u[i, j]) < float(q[i]):
                    continue
                xj = data.x[i:i + 1, j:j + 1]
                gj = model.per_example_grads(theta[i:i + 1].to(dtype),
                                             xj.to(dtype) if xj.is_floating_point() else xj,
                                             data.y[i:i + 1, j:j + 1])[0, 0].to(torch.float64)
                norm = float(torch.linalg.vector_norm(gj))
                f = min(1.0, settings.l2_clip_norm / max(norm, 1e-300))
                total += gj * (f * (1.0 - 8 * torch.finfo(dtype).eps))
            g = (total + noise[i]) / (float(q[i]) * n)
            if proximal_mu:
                g = g + proximal_mu * (theta[i] - bar)
            buf[i] = momentum * buf[i] + g
            theta[i] = theta[i] - lr * buf[i]
    out = unflatten(theta.to(next(iter(params.values())).dtype), shapes)
    return {n: v.clone() for n, v in out.items()}


def benchmark(device: str) -> tuple[float, str]:
    """Seconds for one batched DP-SGD round of 1000 logistic-regression clients (5 epochs,
    expected batch 32), for bench/gpu_check.py."""
    import time

    import numpy as np

    from fl_examples.core.local import pad_clients
    from fl_examples.core.models import MultinomialLogReg

    rng = np.random.default_rng(0)
    sizes = np.minimum(rng.lognormal(4, 2, 1000).astype(np.int64) + 50, 500)
    w = rng.normal(size=(20, 10))
    xs = [rng.normal(size=(n, 20)) for n in sizes]
    data = pad_clients(xs, [np.argmax(x @ w, axis=1) for x in xs], device=device)
    model = MultinomialLogReg(20, 10)
    p = model.init(1000, generator=torch.Generator(device=device).manual_seed(0), device=device)
    bar = {n: v[0] for n, v in p.items()}
    s = DpSgdSettings(1.0, 1.0, 32)
    t0 = time.perf_counter()
    local_dpsgd(model, p, bar, data, epochs=torch.full((1000,), 5, device=device), settings=s,
                lr=0.1, momentum=0.5, proximal_mu=0.1,
                generator=torch.Generator(device=device).manual_seed(1))
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, "1000 logreg clients, 5 epochs, expected batch 32"
