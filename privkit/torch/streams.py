"""Per-client random streams for batched DP-SGD: counter-based, keyed by client.

:class:`ClientStreams` gives every client its own stream of Poisson uniforms and Gaussian
noise. A draw is a pure function of ``(seed, round, client key, step, purpose, index)``: it
is Philox4x32-10 (Salmon et al., SC 2011) of the counter ``(index block, step, client key,
purpose + 4 round)`` under the 64-bit ``seed``, so

- a client's draws never depend on which other clients train beside it, on their number or
  order, or on the padded width of the data (the batched trainer and a one-client loop, or
  a Flower ClientApp with the same seed and client key, draw the same numbers);
- the draws of all K clients of a step are one vectorised computation (no loop over
  clients), and any step can be drawn without drawing the steps before it.

Words are computed with 64-bit integer tensor arithmetic (32-bit products are exact there),
identically on every device; the stream matches Random123's known-answer tests. Uniforms are
``(w + 1) 2**-32`` in (0, 1], so a record joins a batch (``u < q``) with probability at most q
(never above it). Normals come from Box-Muller on two 32-bit words (in float64 for float64
parameters, else float32): *fast mode*, idealised numerics like ``torch.randn``; for hardened
noise use :class:`privkit.SecureRandom` instead (OS CSPRNG, nothing to seed or reproduce).
A seed is for reproducible simulations only: whoever knows it can subtract the noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from privkit import _validate
from privkit.errors import InvalidParameterError

__all__ = ["ClientStreams", "philox4x32_10"]

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_POISSON, _NOISE = 1, 2
_TWO_PI = 2.0 * math.pi


def philox4x32_10(counter: list[Any], key: tuple[int, int]) -> list[Tensor]:
    """Philox4x32-10 of 32-bit counter words under a 64-bit key ``(k0, k1)``.

    Counter words are int64 tensors (values in [0, 2**32)) or Python ints that broadcast
    against each other; the four output words are int64 tensors of the broadcast shape.

    Example:
        >>> z = torch.zeros(1, dtype=torch.int64)
        >>> [hex(int(w)) for w in philox4x32_10([z, 0, 0, 0], (0, 0))]
        ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        p0 = c0 * _M0  # < 2**64: exact as a wrapping int64 bit pattern
        p1 = c2 * _M1
        hi0 = (p0 >> 32) & _MASK32
        hi1 = (p1 >> 32) & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, p1 & _MASK32, hi0 ^ c3 ^ k1, p0 & _MASK32
    return [torch.as_tensor(c) for c in (c0, c1, c2, c3)]


def _keys(client_keys: Any, device: Any) -> Tensor:
    k = torch.as_tensor(client_keys, device=device)
    if k.dim() != 1 or k.is_floating_point() or k.is_complex() or k.dtype == torch.bool:
        raise InvalidParameterError("client_keys", client_keys, "a 1-D sequence of integers")
    k = k.to(torch.int64)
    if k.numel() and not bool(((k >= 0) & (k <= _MASK32)).all()):
        raise InvalidParameterError("client_keys", client_keys, "integers in [0, 2**32)")
    return k


@dataclass(frozen=True)
class ClientStreams:
    """Counter-based random streams, one per client (see the module docstring).

    Attributes:
        seed: the 64-bit key of every stream, an integer in [0, 2**64).
        round: which block of streams (e.g. the FL round), an integer in [0, 2**30): the
            same client and step draw independent numbers in different rounds.

    Example:
        >>> s = ClientStreams(seed=7)
        >>> u = s.uniforms([3, 5], step=0, n=4)
        >>> u.shape, bool((u > 0).all() and (u <= 1).all())
        (torch.Size([2, 4]), True)
        >>> bool((s.uniforms([5], step=0, n=4)[0] == u[1]).all())  # client 5 alone: same draws
        True
    """

    seed: int
    round: int = 0

    def __post_init__(self) -> None:
        seed = _validate.nonnegative_int("seed", self.seed)
        if seed >= 1 << 64:
            raise InvalidParameterError("seed", self.seed, "an integer in [0, 2**64)")
        r = _validate.nonnegative_int("round", self.round)
        if r >= 1 << 30:
            raise InvalidParameterError("round", self.round, "an integer in [0, 2**30)")
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "round", r)

    def _words(self, client_keys: Any, steps: Tensor, purpose: int, n: int,
               device: Any) -> Tensor:
        """(S, K, 4 * ceil(n / 4)) int64 words in [0, 2**32) for steps (S,) and clients."""
        keys = _keys(client_keys, device)
        blocks = (n + 3) // 4
        j = torch.arange(blocks, dtype=torch.int64, device=device).view(1, 1, blocks)
        s = steps.to(device=device, dtype=torch.int64).view(-1, 1, 1)
        shape = (s.shape[0], keys.shape[0], blocks)
        counter = [j.expand(shape), s.expand(shape), keys.view(1, -1, 1).expand(shape),
                   purpose + 4 * self.round]
        w = philox4x32_10(counter, (self.seed & _MASK32, self.seed >> 32))
        return torch.stack(w, dim=-1).reshape(*shape[:2], 4 * blocks)

    def _steps(self, step: Any) -> Tensor:
        s = torch.as_tensor(step)
        if s.is_floating_point() or s.dim() > 1 or (s.numel() and not bool(
                ((s >= 0) & (s <= _MASK32)).all())):
            raise InvalidParameterError("step", step, "an integer (or 1-D integers) in "
                                        "[0, 2**32)")
        return s.reshape(-1)

    def uniforms(self, client_keys: Any, step: Any, n: int, *, device: Any = "cpu") -> Tensor:
        """Uniforms ``(w + 1) 2**-32`` in (0, 1], float64: ``(K, n)`` for one step, or
        ``(S, K, n)`` for a 1-D tensor of S steps. Row k belongs to ``client_keys[k]``;
        element j is the client's j-th uniform of that step (Poisson inclusion of record j).
        """
        n = _validate.nonnegative_int("n", n)
        s = self._steps(step)
        w = self._words(client_keys, s, _POISSON, n, device)[..., :n]
        u = (w + 1).to(torch.float64).mul_(2.0**-32)
        return u if torch.as_tensor(step).dim() else u[0]

    def normals(self, client_keys: Any, step: Any, d: int, *, dtype: torch.dtype = torch.float32,
                device: Any = "cpu") -> Tensor:
        """Standard normals, ``(K, d)`` (or ``(S, K, d)`` for a 1-D tensor of steps), in
        ``dtype`` (float32 or float64) by Box-Muller on word pairs: row k is the noise of
        ``client_keys[k]`` at that step."""
        d = _validate.nonnegative_int("d", d)
        if dtype not in (torch.float32, torch.float64):
            raise InvalidParameterError("dtype", dtype, "torch.float32 or torch.float64")
        s = self._steps(step)
        w = self._words(client_keys, s, _NOISE, d + (d & 1), device).to(dtype)
        w.add_(1.0).mul_(2.0**-32)  # (0, 1]: log is finite
        radius = w[..., 0::2].log_().mul_(-2.0).sqrt_()
        angle = w[..., 1::2].mul_(_TWO_PI)
        z = torch.stack((radius * torch.cos(angle), radius.mul_(torch.sin_(angle))), dim=-1)
        z = z.reshape(*z.shape[:-2], -1)[..., :d]
        return z if torch.as_tensor(step).dim() else z[0]
