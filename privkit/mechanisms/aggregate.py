"""Client-level DP for federated averaging: clip each client's update, noise the sum once.

DP-FedAvg (McMahan, Ramage, Talwar & Zhang, ICLR 2018): each participating client's update
``Delta_i`` (its model minus the global model; the whole tree) is clipped to L2 norm ``C``,
the clipped updates are summed, and Gaussian noise ``N(0, (z C)^2 I)`` is added **once** to
the sum. Adding or removing one client moves the sum by at most ``C``, so one round is the
Gaussian mechanism with noise multiplier ``z`` under ``ADD_OR_REMOVE_ONE`` *clients*; with
Poisson client sampling at rate ``q`` (each client independently, the outcome secret) it is
``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, priced with amplification by
:func:`privkit.epsilon`.

Assumption, printed in every report that uses it: **a trusted aggregator or secure
aggregation** (the server sees only the noisy sum, not the individual updates). Without it,
the per-client updates themselves are released and client-level DP does not hold.

The server then divides the noisy sum by a *fixed* number (the expected number of clients
``q N``), never by the realised count, which would depend on who was sampled.

Weights: a weighted average is fine when each client's weight ``w_i`` lies in [0, 1] and is
public (fixed before training, not computed from the data): client i contributes
``w_i clip(Delta_i)``, whose norm is still <= ``C``. |D_i|-weighted averaging must use
``w_i = min(1, |D_i| / D_max)`` with a public ``D_max``.

:class:`AdaptiveClipping` is the quantile-based clip norm of Andrew, Thakkar, McMahan &
Ramaswamy (NeurIPS 2021): each round the fraction of sampled clients whose update norm is at
most ``C`` is estimated with its own Gaussian noise and ``C`` moves geometrically towards the
target quantile. That count is a second release per round, priced as its own
Poisson-sampled Gaussian event on the same ledger.

Examples:
    >>> import numpy as np
    >>> agg = ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1.0,
    ...                           sampling_probability=0.1)
    >>> updates = {"w": np.ones((3, 4)), "b": np.zeros((3, 1))}  # 3 clients
    >>> noisy = agg(updates, rng=np.random.default_rng(0))
    >>> noisy["w"].shape, agg.event().sampling_probability
    ((4,), 0.1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.events import DpEvent, GaussianDpEvent, PoissonSampledDpEvent
from privkit.mechanisms._tree import _no_grad, _torch
from privkit.mechanisms.clipping import clip_per_example
from privkit.mechanisms.sampling import _float_leaves, _unflatten, gaussian_noise

__all__ = ["ClientLevelGaussian", "AdaptiveClipping", "TRUST_ASSUMPTION"]

#: What client-level DP assumes about the aggregator (every report states it).
TRUST_ASSUMPTION = ("trusted aggregator or secure aggregation: the server sees only the noisy "
                    "sum of the clipped updates")


def _rows(updates: Any, name: str) -> tuple[list[tuple[str, Any]], Any, int]:
    leaves, spec = _float_leaves(updates, name, allow_empty=True)  # K = 0 clients is fine
    if not leaves:
        raise InvalidParameterError(name, updates, "a tree with at least one array or tensor")
    k = None
    for path, leaf in leaves:
        shape = tuple(leaf.shape)
        if not shape:
            raise InvalidParameterError(path, shape, "an array of shape (clients, ...)")
        if k is None:
            k = shape[0]
        elif shape[0] != k:
            raise InvalidParameterError(path, shape, f"leading (client) dimension {k}")
    assert k is not None
    return leaves, spec, int(k)


def _check_weights(weights: Any, k: int) -> np.ndarray:
    w = np.asarray(weights.detach().cpu() if hasattr(weights, "detach") else weights,
                   dtype=np.float64)
    if w.shape != (k,):
        raise InvalidParameterError("weights", w.shape, f"shape ({k},), one per client")
    if not (np.isfinite(w).all() and (w >= 0).all() and (w <= 1).all()):
        bad = w[~(np.isfinite(w) & (w >= 0) & (w <= 1))][0]
        raise InvalidParameterError("weights", float(bad), "public weights in [0, 1]")
    return w


def _sum_rows(leaf: Any, w: np.ndarray | None) -> Any:
    """Sum over the client axis in float64 (weighted), cast back to the leaf's dtype."""
    torch = _torch()
    if torch is not None and isinstance(leaf, torch.Tensor):
        x = leaf.to(torch.float64)
        if w is not None:
            x = x * torch.as_tensor(w, dtype=torch.float64, device=x.device).reshape(
                (-1,) + (1,) * (x.dim() - 1))
        return x.sum(0)
    x = np.asarray(leaf, dtype=np.float64)
    if w is not None:
        x = x * w.reshape((-1,) + (1,) * (x.ndim - 1))
    return x.sum(0)


def _cast(x: Any, like: Any) -> Any:
    torch = _torch()
    if torch is not None and isinstance(like, torch.Tensor):
        return x.to(like.dtype)
    return np.asarray(x, dtype=like.dtype)


@dataclass(frozen=True)
class ClientLevelGaussian:
    """DP-FedAvg's aggregate: per-client L2 clipping of whole updates, one Gaussian noise draw.

    Args:
        l2_clip_norm: C, the bound on one client's update (whole tree, L2), finite and > 0.
        noise_multiplier: z = stddev / C, finite and > 0; the sum gets N(0, (z C)^2) per
            coordinate.
        sampling_probability: q, the Poisson rate at which each client takes part in a
            round, in (0, 1]; 1 means every client every round (no amplification).

    Calling it on ``updates`` (a tree whose every leaf has a leading client axis of size K,
    numpy or torch, K = 0 allowed) returns the noisy sum as a tree without that axis: noise
    is drawn even when no client took part (the release exists either way).
    """

    l2_clip_norm: float
    noise_multiplier: float
    sampling_probability: float = 1.0

    def __post_init__(self) -> None:
        _validate.positive("l2_clip_norm", self.l2_clip_norm)
        _validate.positive("noise_multiplier", self.noise_multiplier)
        _validate.probability("sampling_probability", self.sampling_probability)

    @property
    def stddev(self) -> float:
        """Absolute noise standard deviation on each coordinate of the sum, z C."""
        return float(self.noise_multiplier) * float(self.l2_clip_norm)

    @property
    def neighboring_relation(self) -> Any:
        """The relation of the event: adding or removing one whole client."""
        from privkit.events.mechanisms import NeighboringRelation

        return NeighboringRelation.ADD_OR_REMOVE_ONE

    def event(self) -> DpEvent:
        """One round: Poisson-subsampled Gaussian (plain Gaussian when q = 1)."""
        inner = GaussianDpEvent(float(self.noise_multiplier))
        q = float(self.sampling_probability)
        return inner if q == 1 else PoissonSampledDpEvent(q, inner)

    def clip(self, updates: Any) -> Any:
        """Each client's update (row along the client axis) clipped to ``l2_clip_norm``."""
        return clip_per_example(updates, self.l2_clip_norm)

    def __call__(self, updates: Any, *, rng: Any, weights: Any = None) -> Any:
        """The noisy (weighted) sum of the clipped updates.

        Args:
            updates: tree of arrays or tensors with a leading client axis.
            rng: ``numpy.random.Generator``, ``torch.Generator`` on the updates' device,
                or :class:`~privkit.mechanisms.sampling.SecureRandom`.
            weights: optional public per-client weights in [0, 1] (module docstring).
        """
        leaves, spec, k = _rows(updates, "updates")
        w = None if weights is None else _check_weights(weights, k)
        with _no_grad():
            clipped = self.clip(updates) if k > 0 else updates
            c_leaves, _ = _float_leaves(clipped, "updates", allow_empty=True)
            sums = [_sum_rows(leaf, w) for _, leaf in c_leaves]
            noise = gaussian_noise(_unflatten(spec, iter(sums)), self.stddev, rng=rng)
            n_leaves, _ = _float_leaves(noise, "noise", allow_empty=False)
            out = [_cast(s + n, leaf) for s, (_, n), (_, leaf)
                   in zip(sums, n_leaves, leaves)]
        return _unflatten(spec, iter(out))

    @staticmethod
    def mean(noisy_sum: Any, expected_clients: float) -> Any:
        """The noisy sum divided by a fixed, public number (the expected participants q N)."""
        n = _validate.positive("expected_clients", expected_clients)
        leaves, spec = _float_leaves(noisy_sum, "noisy_sum", allow_empty=False)
        return _unflatten(spec, (leaf / n for _, leaf in leaves))


@dataclass(frozen=True)
class AdaptiveClipping:
    """The clip norm C tracks a quantile of the update norms (Andrew et al., NeurIPS 2021).

    Each round releases the noisy fraction of sampled clients whose update norm is <= C:
    ``b = (sum_i 1[||Delta_i|| <= C] + N(0, count_stddev^2)) / expected_clients``, and moves
    ``C <- C exp(-learning_rate (b - target_quantile))``. The count has sensitivity 1 under
    add/remove of a client, so the release is ``PoissonSampledDpEvent(q,
    GaussianDpEvent(count_stddev))``: charge :meth:`event` every round beside the sum's event.

    Args:
        target_quantile: gamma in (0, 1), the fraction of updates to leave unclipped.
        learning_rate: eta_C > 0 of the geometric update (0.2 in the paper).
        count_stddev: sigma_b > 0, the noise on the count (the paper: expected clients / 20).
        sampling_probability: q of the clients, as for the sum.
    """

    target_quantile: float
    learning_rate: float = 0.2
    count_stddev: float = 1.0
    sampling_probability: float = 1.0

    def __post_init__(self) -> None:
        g = _validate.positive("target_quantile", self.target_quantile)
        if not g < 1:
            raise InvalidParameterError("target_quantile", self.target_quantile, "in (0, 1)")
        _validate.positive("learning_rate", self.learning_rate)
        _validate.positive("count_stddev", self.count_stddev)
        _validate.probability("sampling_probability", self.sampling_probability)

    def event(self) -> DpEvent:
        inner = GaussianDpEvent(float(self.count_stddev))
        q = float(self.sampling_probability)
        return inner if q == 1 else PoissonSampledDpEvent(q, inner)

    def update(self, clip: float, norms: Any, *, expected_clients: float, rng: Any) -> float:
        """The next clip norm from this round's update norms (one noisy release)."""
        c = _validate.positive("clip", clip)
        n = np.asarray(norms.detach().cpu() if hasattr(norms, "detach") else norms,
                       dtype=np.float64).reshape(-1)
        if not np.isfinite(n).all():
            raise InvalidParameterError("norms", "non-finite values", "finite update norms")
        below = float((n <= c).sum())
        torch = _torch()
        if torch is not None and isinstance(rng, torch.Generator):
            like: Any = torch.zeros(1, dtype=torch.float64, device=rng.device)
        else:
            like = np.zeros(1)
        z = gaussian_noise(like, float(self.count_stddev), rng=rng)
        z0 = float(z.reshape(-1)[0])
        noisy = (below + z0) / _validate.positive("expected_clients", expected_clients)
        return c * math.exp(-float(self.learning_rate) * (noisy - float(self.target_quantile)))
