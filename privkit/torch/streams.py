"""Per-client random streams for batched DP-SGD: one generator per client, keyed by client.

:class:`ClientStreams` gives every client its own ``torch.Generator``, seeded with a 64-bit
value derived from ``(seed, round, client key)`` by Philox4x32-10 (Salmon et al., SC 2011;
a counter-based function, so a client's seed needs no other client's). At each local step a
client draws, from its own generator only, first its Poisson uniforms (one per record) and
then its noise. Hence

- a client's draws never depend on which other clients train beside it, on their number or
  order, or on the padded width of the data: the batched trainer, a one-client loop, or a
  Flower ClientApp with the same seed, round and client key draw the same numbers (on the
  same kind of device: torch's CPU and CUDA generators differ);
- the draws of a step are K small calls (one generator each); everything else is batched.

The generators are torch's (fast mode, idealised numerics like ``torch.randn``); for
hardened noise use :class:`privkit.SecureRandom` instead (OS CSPRNG, nothing to seed or
reproduce). A seed is for reproducible simulations only: whoever knows it can subtract the
noise.
"""

from __future__ import annotations

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
#: The last counter word of a client's seed derivation ("DPSG").
_PURPOSE = 0x44505347


def philox4x32_10(counter: list[Any], key: tuple[int, int]) -> list[Tensor]:
    """Philox4x32-10 of 32-bit counter words under a 64-bit key ``(k0, k1)``.

    Counter words are int64 tensors (values in [0, 2**32)) or Python ints that broadcast
    against each other; the four output words are int64 tensors of the broadcast shape.
    Matches Random123's known-answer tests.

    Examples:
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


def client_keys_tensor(client_keys: Any) -> Tensor:
    """Client keys as a 1-D int64 tensor of integers in [0, 2**32) (named error otherwise)."""
    k = torch.as_tensor(client_keys if isinstance(client_keys, Tensor) else list(client_keys))
    if k.dim() != 1 or k.is_floating_point() or k.is_complex() or k.dtype == torch.bool:
        raise InvalidParameterError("client_keys", client_keys, "a 1-D sequence of integers")
    k = k.to(torch.int64)
    if k.numel() and not bool(((k >= 0) & (k <= _MASK32)).all()):
        raise InvalidParameterError("client_keys", client_keys, "integers in [0, 2**32)")
    return k


@dataclass(frozen=True)
class ClientStreams:
    """One ``torch.Generator`` per client, keyed by client (see the module docstring).

    Attributes:
        seed: the key of every client's seed derivation, an integer in [0, 2**64).
        round: which block of streams (e.g. the FL round), an integer in [0, 2**32): the
            same client draws independent numbers in different rounds.

    Examples:
        >>> s = ClientStreams(seed=7, round=1)
        >>> a = [torch.rand(3, generator=g) for g in s.generators([3, 5])]
        >>> b = torch.rand(3, generator=s.generators([5])[0])  # client 5 alone
        >>> bool(torch.equal(a[1], b)), s.seeds([3, 5]).tolist() == s.seeds([3, 5]).tolist()
        (True, True)
    """

    seed: int
    round: int = 0

    def __post_init__(self) -> None:
        seed = _validate.nonnegative_int("seed", self.seed)
        if seed >= 1 << 64:
            raise InvalidParameterError("seed", self.seed, "an integer in [0, 2**64)")
        r = _validate.nonnegative_int("round", self.round)
        if r > _MASK32:
            raise InvalidParameterError("round", self.round, "an integer in [0, 2**32)")
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "round", r)

    def seeds(self, client_keys: Any) -> Tensor:
        """(K,) int64: each client's 64-bit generator seed (as its int64 bit pattern),
        ``Philox4x32-10(counter (key, round, 0, "DPSG"), key = seed)``'s first two words."""
        keys = client_keys_tensor(client_keys)
        w = philox4x32_10([keys, self.round, 0, _PURPOSE],
                          (self.seed & _MASK32, self.seed >> 32))
        return (w[0] << 32) | w[1]

    def generators(self, client_keys: Any, *, device: Any = "cpu") -> list[torch.Generator]:
        """A fresh generator per client, on ``device``, seeded with :meth:`seeds`."""
        return [torch.Generator(device=device).manual_seed(int(s) & ((1 << 64) - 1))
                for s in self.seeds(client_keys).tolist()]
