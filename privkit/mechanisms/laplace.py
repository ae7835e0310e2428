"""MAPA / AUDP gradient noise: per-example clipping, mean, and Laplace-type noise (pure DP).

An edge computes per-example gradients on b distinct records, clips each to
``G`` (``l2_clip_norm``), averages them and uploads ``g~ = mean + eta`` (Li et
al., "Asynchronous Federated Learning with Differential Privacy for Edge
Intelligence", arXiv 1912.07902, Thm 1 and Eq. 6). Neighbouring batches differ
in one record (replace-one), so the mean moves by at most ``DeltaS = 2G/b`` in
L2 norm (mapa.md 4).

The paper's Eq. 6 density ``(eps/(2 DeltaS)) exp(-eps ||eta|| / DeltaS)`` is
normalised only in d = 1, and its variance ``2 DeltaS^2/eps^2`` is the 1-D
Laplace's (mapa.md 6). privkit offers two sound noises (:class:`NoiseShape`):

* ``L2`` (default): density ~ ``exp(-alpha ||eta||_2)`` with
  ``alpha = eps / DeltaS``: pure eps-DP; ``E||eta||^2 = d(d+1)/alpha^2``.
* ``L1``: i.i.d. ``Laplace(Delta_1/eps)`` per coordinate with the L1
  sensitivity ``Delta_1 = sqrt(d) DeltaS`` (valid under L2 clipping):
  pure eps-DP; ``E||eta||^2 = 2 d (Delta_1/eps)^2``, about twice ``L2``'s.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.events import L2LaplaceDpEvent, LaplaceDpEvent, ReplaceOneLaplaceDpEvent
from privkit.mechanisms._tree import (
    _add_noise,
    _cast_like,
    _check_enum,
    _check_noise_scale,
    _check_tree,
    _no_grad,
    _to_float64,
)
from privkit.mechanisms.clipping import _clip_per_example
from privkit.mechanisms.sampling import (
    l2_laplace_noise,
    l2_laplace_variance,
    laplace_noise,
    num_coordinates,
    tree_map,
)

__all__ = ["NoiseShape", "LaplaceGradientNoise"]


class NoiseShape(enum.Enum):
    """Which Laplace-type noise calibrates the upload to pure epsilon-DP."""

    #: density ~ exp(-alpha ||eta||_2), alpha = eps / (2G/b) (default; less noise).
    L2 = "l2"
    #: i.i.d. Laplace(sqrt(d) (2G/b) / eps) per coordinate (the L1 mechanism).
    L1 = "l1"


@dataclass(frozen=True)
class LaplaceGradientNoise:
    """Clip per-example gradients to G, average the b rows, add pure-DP Laplace-type noise.

    MAPA / AUDP upload (Li et al., arXiv 1912.07902, Thm 1, Eq. 6), made sound:
    with per-example clipping the L2 sensitivity of the mean under replace-one
    neighbours is ``2G/b`` deterministically (the paper's Thm 3 only bounds the
    *realised* sensitivity with probability 1 - delta; privkit always clips),
    and the noise density is normalised in d dimensions (:class:`NoiseShape`).
    One upload is pure ``epsilon``-DP; composition over uploads is the caller's
    (one event per upload).

    Assumes the b rows are b **distinct** records (a record that can appear c
    times multiplies the sensitivity by c) and that the batch composition is not
    secret beyond what the event states (no amplification is claimed).

    Attributes:
        l2_clip_norm: G, per-example L2 clip (gradient units), finite and > 0.
        batch_size: b, rows per call (distinct records), integer >= 1.
        epsilon: privacy of one upload (pure DP), finite and > 0.
        shape: :class:`NoiseShape` (default ``L2``).

    Example:
        >>> import numpy as np
        >>> mech = LaplaceGradientNoise(l2_clip_norm=1.0, batch_size=4, epsilon=1.0)
        >>> mech.sensitivity, mech.l1_sensitivity(9)
        (0.5, 1.5)
        >>> mech.noise_variance(3)  # d(d+1)/alpha^2, alpha = eps / (2G/b) = 2
        3.0
        >>> grads = np.ones((4, 3), np.float32)  # 4 examples, 3 coordinates
        >>> g = mech(grads, rng=np.random.default_rng(0))
        >>> g.shape, g.dtype
        ((3,), dtype('float32'))
        >>> mech.event(3)
        L2LaplaceDpEvent(epsilon=1.0, dimension=3)
    """

    l2_clip_norm: float
    batch_size: int
    epsilon: float
    shape: NoiseShape = NoiseShape.L2
    _noise_scale: float = field(default=1.0, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("l2_clip_norm", _validate.positive("l2_clip_norm", self.l2_clip_norm))
        put("batch_size", _validate.positive_int("batch_size", self.batch_size))
        put("epsilon", _validate.positive("epsilon", self.epsilon))
        _check_enum("shape", self.shape, NoiseShape)
        put("_noise_scale", _check_noise_scale(self._noise_scale))

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped mean, 2G/b (replace-one neighbours)."""
        return 2.0 * self.l2_clip_norm / self.batch_size

    @property
    def neighboring_relation(self) -> Any:
        """``REPLACE_ONE``: the relation :attr:`sensitivity` is for (the report names it)."""
        from privkit.events.mechanisms import NeighboringRelation

        return NeighboringRelation.REPLACE_ONE

    @property
    def alpha(self) -> float:
        """Rate of the ``L2`` noise, epsilon / sensitivity (1 / gradient units)."""
        return self.epsilon / self.sensitivity

    def l1_sensitivity(self, d: int) -> float:
        """L1 sensitivity bound sqrt(d) * 2G/b of the clipped mean in d coordinates."""
        n = _validate.positive_int("d", d)
        return math.sqrt(n) * self.sensitivity

    def noise_variance(self, d: int) -> float:
        """E||eta||^2 of the noise added in d coordinates (times ``_noise_scale^2``).

        ``L2``: d(d+1)/alpha^2; ``L1``: 2 d (Delta_1/epsilon)^2 = 2 d^2 (2G/b)^2/epsilon^2.
        This, not the paper's 2 DeltaS^2/eps^2, is MAPA's Delta_0 (mapa.md 6).
        """
        n = _validate.positive_int("d", d)
        if self.shape is NoiseShape.L2:
            v = l2_laplace_variance(n, self.alpha)
        else:
            v = 2.0 * n * (self.l1_sensitivity(n) / self.epsilon) ** 2
        return float(v) * self._noise_scale**2

    def __call__(self, per_example_grads: Any, *, rng: Any) -> Any:
        """Noisy mean of the clipped rows.

        Args:
            per_example_grads: a tree whose every leaf has ``batch_size`` rows
                along dim 0 (one per example; row i of all leaves together is
                example i's gradient), floating point, finite.
            rng: ``numpy.random.Generator``, ``torch.Generator`` or ``SecureRandom``.

        Returns:
            The tree of per-coordinate means plus noise: leaves shaped like
            ``leaf[0]``, same dtypes/devices/structure. Clipped rows are summed
            in float64 and the noise added in float64 before the cast back.

        Raises:
            InvalidParameterError: ``per_example_grads`` has no coordinates or
                rows other than ``batch_size`` (names ``per_example_grads``).
        """
        leaves = _check_tree("per_example_grads", per_example_grads, nonempty=False)
        if not leaves:
            raise InvalidParameterError("per_example_grads", "an empty tree",
                                        f"batch_size = {self.batch_size} rows of gradients")
        b = self.batch_size
        rows = sorted({int(x.shape[0]) if x.ndim > 0 else -1 for x in leaves})
        if rows != [b]:
            got = "a 0-d leaf" if -1 in rows else f"rows {rows}"
            raise InvalidParameterError(
                "per_example_grads", got, f"batch_size = {b} rows along dim 0 in every leaf")
        if any(0 in tuple(x.shape) for x in leaves):
            raise InvalidParameterError("per_example_grads", "a leaf with no coordinate",
                                        "at least one coordinate per example in every leaf")
        d = num_coordinates(per_example_grads) // b
        with _no_grad():
            clipped = _clip_per_example(per_example_grads, self.l2_clip_norm, "per_example_grads")
            # float64 accumulation (mechanisms.md 1, "Summation").
            mean64 = tree_map(lambda x: _mean_rows64(x, b), clipped)
            if self.shape is NoiseShape.L2:
                noise = l2_laplace_noise(mean64, self.alpha, rng=rng)
            else:
                noise = laplace_noise(mean64, self.l1_sensitivity(d) / self.epsilon, rng=rng)
            noisy = _add_noise(mean64, noise, self._noise_scale)
            return tree_map(_cast_like, noisy, clipped)

    def event(self, d: int) -> L2LaplaceDpEvent | LaplaceDpEvent:
        """Event of one upload in d coordinates.

        ``L2``: ``L2LaplaceDpEvent(epsilon, d)`` (epsilon-DP under replace-one, the relation
        it is priced with); ``L1``: ``ReplaceOneLaplaceDpEvent(2/epsilon)``, a dp-accounting
        ``LaplaceDpEvent`` whose noise multiplier is the scale over the L1 bound on one
        contribution, half the replace-one L1 sensitivity: under ``REPLACE_ONE`` (the
        accountant doubling the sensitivity) one upload costs exactly epsilon, and privkit
        refuses to price it under another relation (it would read C as the sensitivity).
        """
        n = _validate.positive_int("d", d)
        if self.shape is NoiseShape.L2:
            return L2LaplaceDpEvent(self.epsilon, n)
        return ReplaceOneLaplaceDpEvent(2.0 / self.epsilon)


def _mean_rows64(x: Any, b: int) -> Any:
    """Mean over dim 0, accumulated in float64 (a 0-d array, not a numpy scalar, for 1-D x)."""
    total = _to_float64(x).sum(0)
    if isinstance(x, np.ndarray):
        return np.asarray(total / b, dtype=np.float64)
    return total / b
