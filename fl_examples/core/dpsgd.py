"""Record-level DP-SGD inside the trainers' local training: privkit's engine on their models.

Each client runs DP-SGD (Abadi et al., CCS 2016) on its own records with
:class:`privkit.torch.ClientsDpSgd`, all K sampled clients batched: at every local step each
of client i's ``n_i`` records joins the minibatch independently with probability ``q_i =
min(1, b / n_i)``, every per-example gradient is clipped to L2 norm ``C``, the clipped
gradients are summed, ``N(0, (z C)^2 I)`` is added, and the sum is divided by the *expected*
batch size ``q_i n_i``. The proximal term ``mu (w - w_bar)`` (FedProx) and momentum are
post-processing. One step is ``PoissonSampledDpEvent(q_i, GaussianDpEvent(z))`` under
add/remove of one record; a client that runs ``s_i`` steps in a round is charged
:func:`round_event` (that event ``s_i`` times), before training, on its own ledger entry.

A client works for ``epochs_i * ceil(n_i / b)`` steps. Its Poisson draws and noise come from
its own stream (:class:`privkit.torch.ClientStreams`, keyed by the client's id), or the OS
CSPRNG, so a client's training never depends on who else was sampled. The models bring their
own clipped gradient sums where they have closed forms (logistic regression, the MLP:
``clipped_grad_sum``); the CNN and the LSTM materialise their per-example gradients
(:func:`clipped_sum_fn`). This module holds no second DP-SGD: it adapts the trainers' models
and data to privkit's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

import privkit
import privkit.torch as pt
from fl_examples.core.local import ClientData
from fl_examples.core.models import PerExampleModel
from privkit._rng import SecureRandom
from privkit.errors import InvalidParameterError

__all__ = ["DpSgdSettings", "local_dpsgd", "steps_per_client", "sampling_rates",
           "round_event", "clipped_sum_fn", "client_streams", "benchmark"]

#: Local steps of each client, ``epochs_i * ceil(n_i / b)``
#: (:func:`privkit.torch.steps_for_epochs`).
steps_per_client = pt.steps_for_epochs
#: q_i = min(1, b / n_i) per client (:func:`privkit.torch.sampling_rates`).
sampling_rates = pt.sampling_rates


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


def round_event(size: int, steps: int, settings: DpSgdSettings) -> Any:
    """The event one client is charged for a round of ``steps`` DP-SGD steps."""
    q = min(1.0, settings.batch_size / size)
    inner: Any = privkit.GaussianDpEvent(float(settings.noise_multiplier))
    if q < 1:
        inner = privkit.PoissonSampledDpEvent(q, inner)
    return privkit.SelfComposedDpEvent(inner, int(steps))


def clipped_sum_fn(model: Any) -> pt.ClippedSumFn:
    """The model's clipped per-example gradient sum on flat parameters: its own
    ``clipped_grad_sum`` (closed-form norms), else from its materialised per-example
    gradients."""
    if hasattr(model, "clipped_grad_sum"):
        return model.clipped_grad_sum  # type: ignore[no-any-return]

    def materialised(theta: Tensor, x: Tensor, y: Tensor, factor: Any) -> Tensor:
        g = model.per_example_grads(theta, x, y)  # (K, B, d)
        f = factor(torch.linalg.vector_norm(g.to(torch.float64), dim=2))
        return torch.einsum("kb,kbd->kd", f.to(g.dtype), g)

    return materialised


def client_streams(seed: int, data_round: int) -> pt.ClientStreams:
    """Round ``data_round``'s per-client streams under the run's ``seed`` (each client's
    draws keyed by its id: :class:`privkit.torch.ClientStreams`)."""
    key = np.random.SeedSequence(int(seed), spawn_key=(0xD95, int(data_round)))
    return pt.ClientStreams(seed=int(key.generate_state(1, np.uint64)[0]),
                            round=int(data_round) & 0xFFFFFFFF)


def _check(model: Any, data: ClientData) -> None:
    if not isinstance(model, PerExampleModel):
        raise InvalidParameterError(
            "model", type(model).__name__,
            "a model with per-example gradients (logreg, mlp, cnn or lstm) for --privacy record")
    if bool((data.sizes <= 0).any()):
        raise InvalidParameterError("client data", "an empty client", ">= 1 record per client")


@torch.no_grad()
def local_dpsgd(model: Any, params: dict[str, Tensor], w_bar: dict[str, Tensor],
                data: ClientData, *, epochs: Tensor, settings: DpSgdSettings, lr: float,
                momentum: float, proximal_mu: float, clients: Any,
                rng: pt.ClientStreams | SecureRandom) -> dict[str, Tensor]:
    """K clients' DP-SGD in lockstep (module docstring); returns their final parameters.

    Args:
        params: (K, ...) starting parameters per client; w_bar: the global model (no axis).
        epochs: (K,) expected passes per client (0: the client does nothing).
        clients: (K,) the clients' ids (their stream keys).
        rng: the round's :func:`client_streams`, or a :class:`privkit.SecureRandom`.
    """
    _check(model, data)
    dtype = next(iter(params.values())).dtype  # the model's working precision
    dp = pt.ClientsDpSgd(l2_clip_norm=settings.l2_clip_norm,
                         noise_multiplier=settings.noise_multiplier,
                         clipped_grad_sum=clipped_sum_fn(model))
    p64 = {k: v.to(torch.float64) for k, v in params.items()}  # float64 master copy
    x = data.x.to(torch.float64) if data.x.is_floating_point() else data.x
    out = dp.run(p64, pt.ClientBatch(x, data.y, data.sizes),
                 steps=steps_per_client(data.sizes, epochs, settings.batch_size),
                 sampling_rates=sampling_rates(data.sizes, settings.batch_size),
                 client_keys=[int(c) for c in clients], rng=rng,
                 update=pt.LocalSgd(lr=float(lr), momentum=float(momentum),
                                    proximal_mu=float(proximal_mu)),
                 anchor={k: v.to(torch.float64) for k, v in w_bar.items()})
    return {n: v.to(dtype) for n, v in out.items()}


def benchmark(device: str) -> tuple[float, str]:
    """Seconds for one batched DP-SGD round of 1000 logistic-regression clients (5 epochs,
    expected batch 32), for bench/gpu_check.py."""
    import time

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
                lr=0.1, momentum=0.5, proximal_mu=0.1, clients=range(1000),
                rng=client_streams(0, 1))
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, "1000 logreg clients, 5 epochs, expected batch 32"
