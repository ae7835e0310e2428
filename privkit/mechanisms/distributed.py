"""Distributed DP with secure aggregation: the distributed Skellam mechanism.

:class:`~privkit.mechanisms.ClientLevelGaussian` trusts the aggregator to add the noise.
Distributed DP removes that trust: each client turns its update into integers, adds its own
share of discrete noise, and the server learns only the sum modulo ``m = 2^bits`` through
secure aggregation (SecAgg, as in Flower's SecAgg+; simulated here by :func:`secure_sum`). This
is the distributed Skellam mechanism of Agarwal, Kairouz & Liu (NeurIPS 2021), with the
rotation, scaling and conditional rounding of Kairouz, Liu & Steinke (ICML 2021) as in
TensorFlow Federated's ``DistributedDpSumFactory``.

**Client** (:meth:`DistributedSkellam.encode`, one client per call: what runs on a device):

1. flatten the update tree into one float64 vector of ``dim`` coordinates (a non-finite
   update becomes zeros, silently, as in the central mechanism) and clip it to L2 norm ``C``;
2. zero-pad to ``d = 2^k`` coordinates and rotate: random signs, then the fast Walsh-Hadamard
   transform, scaled by ``1/sqrt(d)`` (orthogonal, so the norm is kept). The signs come from
   ``rotation_seed``, **public** shared randomness (every client and the server use the same
   seed in a round; it must not depend on the updates);
3. divide by the granularity ``gamma`` (the grid step), so the norm is at most ``c = C/gamma``;
4. round each coordinate up or down at random, up with probability its fractional part
   (unbiased), and redraw all the coins until the integer vector's squared norm is at most
   ``T`` (:func:`~privkit.events.distributed.rounded_norm_bound_sq`: Kairouz et al.'s bound with
   parameter ``beta``, exceeded by one try with probability at most ``beta``). After
   ``max_rounding_tries`` failures it rounds towards zero (norm at most the input's, so within
   ``T``). The bound therefore holds with probability one: the sensitivities ``Delta_2 =
   sqrt(T)``, ``Delta_1 = min(T, sqrt(d T))`` are certain, and nothing is added to delta;
5. add ``Skellam(mu)`` noise, ``Poisson(mu/2) - Poisson(mu/2)`` per coordinate
   (:func:`skellam_noise`; in secure mode each Poisson is drawn by exact inversion against
   certified CDF bounds, see ``privkit.mechanisms._distributed_poisson``);
6. reduce modulo ``m`` (exact int64 / uint64 arithmetic) and send the ``uint64`` vector.

**Server**: SecAgg yields ``sum_i y_i mod m`` (:func:`secure_sum`), equal to
``(sum_i x_i + Z) mod m`` with ``Z ~ Skellam(n mu)`` when ``n`` clients survived (Poisson sums
are Poisson). :meth:`DistributedSkellam.decode` refuses a round with fewer than
``min_survivors`` survivors, centres the integers into ``[-m/2, m/2)``, multiplies by
``gamma``, rotates back, drops the padding and divides by a public ``divisor`` (the expected
cohort, never the realised count). If the true integer sum leaves ``[-m/2, m/2)`` it wraps: a
utility failure, not a privacy one (the release is a post-processing of the noisy sum);
:func:`privkit.accountants.distributed.wraparound_probability` bounds its probability.

Randomness: the rounding coins and the noise come from ``rng`` (a ``numpy.random.Generator``,
a ``torch.Generator``, from whose stream a numpy generator is derived, or
:class:`~privkit.SecureRandom`); only the noise matters for privacy (the rounding's coins
change the utility, never the norm bound). The rotation uses the public seed only.

Privacy (:meth:`DistributedSkellam.event`): a :class:`~privkit.events.distributed.SkellamDpEvent`
priced under zero-out (a client's update replaced by zero, the client still adding its noise
share) or replace-one, never add/remove (a removed client removes its noise share too); see
:mod:`privkit.accountants.distributed`.

Example:
    >>> import numpy as np
    >>> mech = DistributedSkellam(l2_clip_norm=1.0, granularity=1e-3, noise_per_client=1e4,
    ...                           bits=20, dim=3, min_survivors=2)
    >>> rng = np.random.default_rng(0)
    >>> ups = [np.array([0.3, -0.2, 0.1]), np.array([0.1, 0.0, -0.1])]
    >>> enc = [mech.encode(u, rng=rng, rotation_seed=7) for u in ups]
    >>> total = mech.secure_sum(enc)
    >>> mean = mech.decode(total, survivors=2, divisor=2, rotation_seed=7)
    >>> mean.shape, bool(np.abs(mean - np.array([0.2, -0.1, 0.0])).max() < 0.2)
    ((3,), True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privkit import _validate
from privkit._rng import RngKind, SecureRandom, check_rng
from privkit.errors import InvalidParameterError
from privkit.events import DpEvent, SelfComposedDpEvent
from privkit.events.distributed import (
    DISTRIBUTED_TRUST_ASSUMPTION,
    MAX_BITS,
    MAX_NOISE_PER_CLIENT,
    SkellamDpEvent,
    check_bits,
    honest_shares,
    padded_dimension,
    rounded_norm_bound_sq,
    skellam_relation,
    skellam_sensitivities,
)
from privkit.mechanisms._distributed_modular import _residues, center_modular, secure_sum
from privkit.mechanisms._distributed_poisson import MAX_LAMBDA, exact_poisson
from privkit.mechanisms._distributed_rotation import hadamard_rotate, inverse_hadamard_rotate
from privkit.mechanisms._tree import _no_grad, _torch
from privkit.mechanisms.sampling import (
    _float_leaves,
    _from_f64,
    _is_tensor,
    _leaf_size,
    _torch_seeded_numpy,
    _unflatten,
)

__all__ = [
    "DistributedSkellam",
    "DISTRIBUTED_TRUST_ASSUMPTION",
    "MAX_BITS",
    "secure_sum",
    "center_modular",
    "hadamard_rotate",
    "inverse_hadamard_rotate",
    "conditional_round",
    "skellam_noise",
]

MAX_NOISE = MAX_NOISE_PER_CLIENT


# ------------------------------------------------------------------ rounding and noise
def _uniforms(rng: Any, n: int) -> np.ndarray:
    if isinstance(rng, SecureRandom):
        return np.asarray(rng.uniform((n,)), dtype=np.float64)
    return rng.random(n)


def _numpy_or_secure(rng: Any) -> Any:
    """``rng`` itself, or for a torch.Generator a numpy generator drawn from its stream."""
    kind = check_rng(rng)
    return _torch_seeded_numpy(rng) if kind is RngKind.TORCH else rng


def conditional_round(x: Any, norm_bound_sq: int, *, rng: Any, max_tries: int = 100
                      ) -> tuple[np.ndarray, int]:
    """Conditional randomized rounding of Kairouz, Liu & Steinke (ICML 2021, Section 4.1).

    Each coordinate is rounded up with probability equal to its fractional part, down
    otherwise (unbiased); all coins are redrawn until the integer vector's squared L2 norm,
    computed exactly in int64, is at most ``norm_bound_sq``. After ``max_tries`` failed tries
    the vector is rounded towards zero (squared norm at most ``||x||^2``), and if even that
    exceeded the bound, zeros are returned: the bound holds with probability one.

    Args:
        x: a 1-D float vector, every coordinate finite and of magnitude < 2^31.
        norm_bound_sq: T, an integer >= 0 below 2^62.
        rng: ``numpy.random.Generator``, ``torch.Generator`` or :class:`SecureRandom`.
        max_tries: random tries before the deterministic fallback, >= 0.

    Returns:
        ``(v, tries)``: the int64 vector and the number of random tries used
        (``max_tries + 1`` when the fallback was taken).

    Example:
        >>> import numpy as np
        >>> v, tries = conditional_round(np.array([0.5, 2.25, -1.75]), 10,
        ...                              rng=np.random.default_rng(0))
        >>> int(v @ v) <= 10, tries >= 1
        (True, True)
    """
    v = np.asarray(x, dtype=np.float64)
    if v.ndim != 1 or not np.isfinite(v).all() or (np.abs(v) >= 2.0**31).any():
        raise InvalidParameterError("x", v.shape, "a 1-D finite vector with |x_i| < 2^31")
    t = _validate.nonnegative_int("norm_bound_sq", norm_bound_sq)
    if t >= 1 << 62:
        raise InvalidParameterError("norm_bound_sq", t, "< 2^62")
    tries = _validate.nonnegative_int("max_tries", max_tries)
    gen = _numpy_or_secure(rng)
    low = np.floor(v)
    frac = v - low
    base = low.astype(np.int64)
    for k in range(tries):
        out = base + (_uniforms(gen, v.size) < frac)
        if int(np.dot(out, out)) <= t:
            return out, k + 1
    out = np.trunc(v).astype(np.int64)
    if int(np.dot(out, out)) > t:
        out = np.zeros(v.size, dtype=np.int64)
    return out, tries + 1


def skellam_noise(size: int, mu: float, *, rng: Any) -> np.ndarray:
    """``size`` i.i.d. Skellam(mu) draws, ``Poisson(mu/2) - Poisson(mu/2)`` (variance mu), int64.

    Fast modes use numpy's Poisson sampler (a ``torch.Generator`` seeds a numpy generator from
    its stream). Secure mode draws each Poisson by exact inversion from the OS generator's
    bits (module ``privkit.mechanisms._distributed_poisson``), for ``mu <= 2^41``.

    Example:
        >>> import numpy as np
        >>> z = skellam_noise(4, 10.0, rng=np.random.default_rng(0))
        >>> z.dtype, z.shape
        (dtype('int64'), (4,))
    """
    n = _validate.nonnegative_int("size", size)
    m = _validate.positive("mu", mu)
    if m > MAX_NOISE:
        raise InvalidParameterError("mu", mu, "<= 2^51")
    gen = _numpy_or_secure(rng)
    lam = m / 2.0  # exact
    if isinstance(gen, SecureRandom):
        if lam > MAX_LAMBDA:
            raise InvalidParameterError("mu", mu, "<= 2^41 in secure mode")

        def words(k: int) -> np.ndarray:
            return np.frombuffer(gen._random_bytes(8 * k), dtype=np.uint64).copy()

        return exact_poisson(lam, n, words) - exact_poisson(lam, n, words)
    a = gen.poisson(lam, n).astype(np.int64)
    return a - gen.poisson(lam, n).astype(np.int64)


# ------------------------------------------------------------------ tree helpers
def _flat_update(update: Any, dim: int) -> np.ndarray:
    leaves, _ = _float_leaves(update, "update")
    parts = []
    for _, leaf in leaves:
        if _is_tensor(leaf):
            parts.append(leaf.detach().to(_torch().float64).cpu().numpy().reshape(-1))
        else:
            parts.append(np.asarray(leaf, dtype=np.float64).reshape(-1))
    v = np.concatenate(parts)
    if v.size != dim:
        raise InvalidParameterError("update", f"{v.size} coordinates", f"{dim} coordinates (dim)")
    return v


def _unflat(vector: np.ndarray, like: Any, dim: int) -> Any:
    leaves, spec = _float_leaves(like, "like")
    total = sum(_leaf_size(leaf) for _, leaf in leaves)
    if total != dim:
        raise InvalidParameterError("like", f"{total} coordinates", f"{dim} coordinates (dim)")
    out, start = [], 0
    for _, leaf in leaves:
        size = _leaf_size(leaf)
        out.append(_from_f64(vector[start:start + size], leaf))
        start += size
    return _unflatten(spec, iter(out))


# ------------------------------------------------------------------ the mechanism
@dataclass(frozen=True)
class DistributedSkellam:
    """The distributed Skellam mechanism with secure aggregation (module docstring).

    Args:
        l2_clip_norm: C, the bound on one client's update (whole tree, L2), finite and > 0.
        granularity: gamma, the grid step in update units (the client divides by it), > 0.
        noise_per_client: mu, each client's Skellam variance per coordinate in integer
            units, finite, > 0 and <= 2^51 (2^41 in secure mode).
        bits: the SecAgg modulus is 2^bits, an integer in [2, 62].
        dim: the number of coordinates of one update, >= 1 (padded to a power of 2).
        min_survivors: n_min, the fewest clients a released sum may contain (decode refuses
            fewer), >= 1.
        colluders: how many clients may collude with the server (their noise is not
            counted), 0 <= colluders < min_survivors.
        beta: the conditional rounding's parameter in [0, 1) (default ``exp(-0.5)``, as in
            Kairouz et al. and TFF); 0: unconditional rounding, bound ``(c + sqrt(d))^2``.
        sampling_probability: q in (0, 1], the Poisson rate at which clients take part (the
            event's amplification; the server, which samples, knows the cohort).
        max_rounding_tries: random rounding tries before the deterministic fallback, >= 1.

    Raises:
        InvalidParameterError: a bad argument (named), or a granularity so fine that the
            rounded norms would not be exact in int64.
    """

    l2_clip_norm: float
    granularity: float
    noise_per_client: float
    bits: int
    dim: int
    min_survivors: int
    colluders: int = 0
    beta: float = math.exp(-0.5)
    sampling_probability: float = 1.0
    max_rounding_tries: int = 100
    _noise: bool = field(default=True, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        c = _validate.positive("l2_clip_norm", self.l2_clip_norm)
        g = _validate.positive("granularity", self.granularity)
        mu = _validate.positive("noise_per_client", self.noise_per_client)
        if mu > MAX_NOISE:
            raise InvalidParameterError("noise_per_client", self.noise_per_client, "<= 2^51")
        check_bits(self.bits)
        d = padded_dimension(self.dim)
        honest_shares(self.min_survivors, self.colluders)
        _validate.probability("sampling_probability", self.sampling_probability)
        _validate.positive_int("max_rounding_tries", self.max_rounding_tries)
        if not isinstance(self._noise, bool):
            raise InvalidParameterError("_noise", self._noise, "a bool")
        scaled = c / g
        if not (scaled + math.sqrt(d) + 1.0) ** 2 < 2.0**62:
            raise InvalidParameterError("granularity", self.granularity,
                                        f"such that (C / granularity + sqrt({d}) + 1)^2 < 2^62")
        rounded_norm_bound_sq(scaled, d, self.beta)  # validates beta

    # ---------------------------------------------------------------- derived numbers
    @property
    def padded_dim(self) -> int:
        """d, the rotated length: the smallest power of 2 >= ``dim``."""
        return padded_dimension(self.dim)

    @property
    def modulus(self) -> int:
        """m = 2^bits."""
        return 1 << int(self.bits)

    @property
    def scaled_clip(self) -> float:
        """c = C / gamma, the norm bound before rounding (integer units)."""
        return float(self.l2_clip_norm) / float(self.granularity)

    @property
    def norm_bound_sq(self) -> int:
        """T, the squared norm a rounded update never exceeds."""
        return rounded_norm_bound_sq(self.scaled_clip, self.padded_dim, self.beta)

    @property
    def sensitivities(self) -> tuple[float, float]:
        """(Delta_2, Delta_1) of one rounded contribution, integer units."""
        return skellam_sensitivities(self.norm_bound_sq, self.padded_dim)

    @property
    def honest_survivors(self) -> int:
        """The noise shares every released sum is guaranteed: min_survivors - colluders."""
        return int(self.min_survivors) - int(self.colluders)

    @property
    def neighboring_relation(self) -> Any:
        """The relation of :meth:`event`'s default: zero-out (``REPLACE_SPECIAL``)."""
        return skellam_relation(None)

    # ---------------------------------------------------------------- events
    def event(self, neighboring_relation: Any = None) -> DpEvent:
        """One round (Poisson-sampled at ``sampling_probability``), the same event under
        zero-out and replace-one (the accountant doubles the sensitivities under replace-one);
        refused under add/remove.

        Example:
            >>> m = DistributedSkellam(1.0, 0.01, 400.0, bits=16, dim=10, min_survivors=50)
            >>> ev = m.event()
            >>> ev.survivors, ev.l2_sensitivity > m.scaled_clip
            (50, True)
        """
        skellam_relation(neighboring_relation)
        l2, l1 = self.sensitivities
        return SkellamDpEvent(float(self.noise_per_client), self.honest_survivors, l2, l1,
                              float(self.sampling_probability))

    def unamplified_event(self, rounds: int, neighboring_relation: Any = None) -> DpEvent:
        """``rounds`` rounds a client took part in, without amplification: what the server,
        which picks the cohort, can be held to. ``rounds`` >= 1."""
        skellam_relation(neighboring_relation)
        k = _validate.positive_int("rounds", rounds)
        l2, l1 = self.sensitivities
        return SelfComposedDpEvent(
            SkellamDpEvent(float(self.noise_per_client), self.honest_survivors, l2, l1),
            k)

    # ---------------------------------------------------------------- client side
    def encode(self, update: Any, *, rng: Any, rotation_seed: int) -> np.ndarray:
        """One client's masked-aggregation input: clip, rotate, scale, round, noise, wrap.

        Args:
            update: the client's update, a tree (numpy arrays or torch tensors) of ``dim``
                floating coordinates in all.
            rng: the client's private randomness (``numpy.random.Generator``,
                ``torch.Generator`` or :class:`SecureRandom`).
            rotation_seed: the round's public rotation seed, an integer >= 0.

        Returns:
            A uint64 vector of ``padded_dim`` residues modulo 2^bits.
        """
        if check_rng(rng) is RngKind.SECURE and self.noise_per_client / 2 > MAX_LAMBDA:
            raise InvalidParameterError("noise_per_client", self.noise_per_client,
                                        "<= 2^41 with SecureRandom")
        d = self.padded_dim
        with _no_grad():
            v = _flat_update(update, int(self.dim))
        if not np.isfinite(v).all():
            v = np.zeros_like(v)
        peak = float(np.max(np.abs(v)))
        norm = peak * float(np.linalg.norm(v / peak)) if peak > 0 else 0.0  # no overflow
        c = float(self.l2_clip_norm)
        if norm > c:
            v = v * (c / norm)
        padded = np.zeros(d)
        padded[: v.size] = v
        x = hadamard_rotate(padded, rotation_seed) / float(self.granularity)
        gen = _numpy_or_secure(rng)
        rounded, _ = conditional_round(x, self.norm_bound_sq, rng=gen,
                                       max_tries=int(self.max_rounding_tries))
        if self._noise:
            rounded = rounded + skellam_noise(d, float(self.noise_per_client), rng=gen)
        return np.mod(rounded, self.modulus).astype(np.uint64)

    # ---------------------------------------------------------------- server side
    def check_survivors(self, survivors: int) -> int:
        """``survivors`` if a sum of that many clients may be released, else raise.

        Raises:
            InvalidParameterError: fewer than ``min_survivors`` (named ``survivors``).
        """
        s = _validate.nonnegative_int("survivors", survivors)
        if s < int(self.min_survivors):
            raise InvalidParameterError(
                "survivors", s, f">= min_survivors = {self.min_survivors} to release the "
                "round (its noise was calibrated for that many shares); discard the round")
        return s

    def secure_sum(self, encoded: Sequence[Any]) -> np.ndarray:
        """:func:`secure_sum` of the survivors' inputs, refused below ``min_survivors``."""
        if isinstance(encoded, Sequence) and not isinstance(encoded, np.ndarray):
            self.check_survivors(len(encoded))
        return secure_sum(encoded, int(self.bits))

    def decode(self, modular_sum: Any, *, survivors: int, divisor: float, rotation_seed: int,
               like: Any = None) -> Any:
        """The server's estimate of the mean update from SecAgg's modular sum.

        Args:
            modular_sum: the residues SecAgg revealed (``padded_dim`` of them).
            survivors: how many clients' inputs the sum holds (refused below
                ``min_survivors``).
            divisor: the public denominator (the expected cohort), > 0.
            rotation_seed: the round's public rotation seed.
            like: optional tree of the update's structure, dtypes and devices; without it a
                float64 vector of ``dim`` coordinates is returned.
        """
        self.check_survivors(survivors)
        div = _validate.positive("divisor", divisor)
        s = _residues(modular_sum, int(self.bits), "modular_sum")
        if s.shape != (self.padded_dim,):
            raise InvalidParameterError("modular_sum", s.shape, f"shape ({self.padded_dim},)")
        centred = center_modular(s, int(self.bits)).astype(np.float64)
        vec = inverse_hadamard_rotate(centred * float(self.granularity), rotation_seed)
        out = vec[: int(self.dim)] / div
        return out if like is None else _unflat(out, like, int(self.dim))
