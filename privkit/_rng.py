"""Random-number plumbing: rng validation and the secure-mode generator.

privkit never touches a global generator. Every sampler takes an explicit ``rng`` that is one
of three kinds (see :class:`RngKind`):

- ``numpy.random.Generator``: fast mode, numpy path;
- ``torch.Generator``: fast mode, torch path (noise drawn on the generator's device);
- :class:`SecureRandom`: secure mode (spec ``mechanisms.md`` section 4).

:class:`SecureRandom` reads every random bit straight from the operating system's CSPRNG
(``os.urandom``, i.e. ``getrandom(2)``; on Linux the kernel CRNG is ChaCha20). It needs no
third-party C extension, keeps no key or state of its own, and so has nothing to persist and
nothing to seed: a ``seed`` (or ``key``) argument is refused, and a failing entropy source
raises (there is no time or PID fallback). Floating-point work is in float64.

torch is never imported here: a torch object can only reach privkit if the caller already
imported torch, so ``sys.modules`` is enough to recognise one.
"""

from __future__ import annotations

import enum
import math
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError

__all__ = ["RngKind", "SecureRandom", "check_rng"]

#: Elements generated per chunk (bounds scratch memory: a few float64 arrays of this length).
CHUNK = 1 << 20
#: Candidates per element computed up front by the Marsaglia-Tsang gamma sampler.
_GAMMA_CANDIDATES = 4
_TWO_PI = 2.0 * math.pi
_2_POW_M53 = 2.0**-53


class RngKind(enum.Enum):
    """Which kind of generator an ``rng`` argument is."""

    NUMPY = "numpy"
    TORCH = "torch"
    SECURE = "secure"


def check_rng(rng: Any) -> RngKind:
    """Validate an ``rng`` argument and say which kind it is.

    Args:
        rng: a ``numpy.random.Generator``, a ``torch.Generator`` or a :class:`SecureRandom`.

    Returns:
        The :class:`RngKind` of ``rng``.

    Raises:
        InvalidParameterError: naming ``rng`` for anything else (None, an int seed,
            ``random.Random``, a legacy ``numpy.random.RandomState``).

    Example:
        >>> import numpy as np
        >>> check_rng(np.random.default_rng(0)).name
        'NUMPY'
    """
    if isinstance(rng, np.random.Generator):
        return RngKind.NUMPY
    if isinstance(rng, SecureRandom):
        return RngKind.SECURE
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(rng, torch.Generator):
        return RngKind.TORCH
    raise InvalidParameterError(
        "rng", rng, "a numpy.random.Generator, a torch.Generator or a privkit SecureRandom"
    )


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _size_to_shape(name: str, size: Any) -> tuple[int, ...]:
    if size is None:
        return ()
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        size = (size,)
    try:
        shape = tuple(_validate.nonnegative_int(name, s) for s in size)
    except TypeError:
        raise InvalidParameterError(name, size, "None, an int or a tuple of ints") from None
    return shape


def _as_output(flat: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | float:
    return float(flat[0]) if shape == () else flat.reshape(shape)


class SecureRandom:
    """Secure-mode generator: every bit from the OS CSPRNG, float64 arithmetic.

    Uniforms carry 53 random bits and lie in the open interval (0, 1); normals come from the
    Box-Muller transform in float64 (both outputs of each pair are used). Large requests are
    generated in chunks of :data:`CHUNK` elements, several chunks at once on a small thread
    pool (``os.urandom`` and numpy release the GIL); threads are created per call, so the
    object holds no thread and is safe to use after ``fork``.

    The hardened draws used by the samplers are :meth:`gaussian` (``stddev * (Z1 + Z2 + Z3 +
    Z4) / 2``) and :meth:`laplace` (``scale * (ln U1 cos(pi U2) + ln U3 cos(pi U4))``), each a
    fixed number of uniforms per element.

    Args:
        seed: must be None: secure mode draws its key from the OS, so seeds are refused.
        key: must be None, for the same reason.

    Raises:
        InvalidParameterError: naming ``seed`` or ``key``, whichever is given.
        OSError: if the OS entropy source fails (probed once at construction).

    Example:
        >>> rng = SecureRandom()
        >>> z = rng.gaussian(2.0, 1000)
        >>> z.dtype, z.shape
        (dtype('float64'), (1000,))
    """

    __slots__ = ()

    def __init__(self, seed: Any = None, *, key: Any = None) -> None:
        for name, value in (("seed", seed), ("key", key)):
            if value is not None:
                raise InvalidParameterError(name, value, "None (secure mode draws its key from "
                                            "the OS; seeds are refused, and so are keys)")
        # Fail closed at construction if the entropy source is unusable.
        os.urandom(16)

    def __repr__(self) -> str:
        return "SecureRandom()"

    # ------------------------------------------------------------------ raw bits
    @staticmethod
    def _random_bytes(nbytes: int) -> bytes:
        # Looked up at call time so that a monkeypatched os.urandom (tests) is honoured. Any
        # OSError propagates: there is deliberately no fallback.
        return os.urandom(nbytes)

    def _nonzero53(self, words: np.ndarray) -> np.ndarray:
        """The top 53 bits of each word, uniform on {1, ..., 2**53 - 1}.

        0 has probability 2**-53 per word and is redrawn; the number of redraws is
        independent of every value returned.
        """
        k = words >> np.uint64(11)
        if not k.all():
            zero = np.flatnonzero(k == 0)
            while zero.size:
                fresh = np.frombuffer(self._random_bytes(8 * zero.size), dtype=np.uint64)
                k[zero] = fresh >> np.uint64(11)
                zero = zero[k[zero] == 0]
        return k

    def _uniform53(self, n: int) -> np.ndarray:
        """n float64 uniforms k * 2**-53 in the open interval (0, 1), 53 random bits each."""
        words = np.frombuffer(self._random_bytes(8 * n), dtype=np.uint64)
        return self._nonzero53(words) * _2_POW_M53

    def _standard_normal_chunk(self, m: int) -> np.ndarray:
        """m N(0, 1) draws by Box-Muller, both outputs of each pair used.

        A pair takes two 64-bit words: 53 bits of the first give u in (0, 1) and the radius
        sqrt(-2 ln u); 53 bits of the second give phi uniform on [0, pi/4) and 3 of its
        spare bits pick one of the 8 symmetries of the square (swap, two sign flips), which
        maps the octant onto the whole circle. One sin per pair: s = sin(phi) <= 0.71, so
        cos(phi) = sqrt((1 - s)(1 + s)) is well conditioned (about 1 ulp).
        """
        pairs = (m + 1) // 2
        words = np.frombuffer(self._random_bytes(16 * pairs), dtype=np.uint64)
        out = np.empty(2 * pairs)
        radius = self._nonzero53(words[:pairs]) * _2_POW_M53
        np.log(radius, out=radius)
        radius *= -2.0
        np.sqrt(radius, out=radius)
        second = words[pairs:]
        phi = (second >> np.uint64(11)) * (_2_POW_M53 * math.pi / 4.0)
        s = np.sin(phi, out=phi)
        c = np.multiply(1.0 - s, 1.0 + s)
        np.sqrt(c, out=c)
        # Branch-free bit selects: spare bit 0 swaps (c, s), bits 1 and 2 flip the signs.
        s_bits, c_bits = s.view(np.uint64), c.view(np.uint64)
        swap_mask = ((second << np.uint64(63)).view(np.int64) >> np.int64(63)).view(np.uint64)
        diff = np.bitwise_xor(c_bits, s_bits)
        diff &= swap_mask
        x_bits, y_bits = out[:pairs].view(np.uint64), out[pairs:].view(np.uint64)
        np.bitwise_xor(c_bits, diff, out=x_bits)
        np.bitwise_xor(s_bits, diff, out=y_bits)
        x_bits ^= (second & np.uint64(2)) << np.uint64(62)
        y_bits ^= (second & np.uint64(4)) << np.uint64(61)
        out[:pairs] *= radius
        out[pairs:] *= radius
        return out[:m]

    def _fill(
        self, n: int, chunk_fn: Callable[[int], np.ndarray], chunk: int = CHUNK
    ) -> np.ndarray:
        """Concatenate ``chunk_fn(m)`` over chunks of at most ``chunk`` elements (threaded)."""
        if n <= chunk:
            return chunk_fn(n) if n else np.empty(0)
        out = np.empty(n)
        starts = range(0, n, chunk)

        def work(start: int) -> None:
            stop = min(start + chunk, n)
            out[start:stop] = chunk_fn(stop - start)

        workers = min(len(starts), _usable_cpus(), 8)
        if workers == 1:
            for s in starts:
                work(s)
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                # list() re-raises the first exception (e.g. an entropy failure).
                list(pool.map(work, starts))
        return out

    # ------------------------------------------------------------------ public draws
    def uniform(self, size: Any = None) -> np.ndarray | float:
        """Float64 uniforms in the open interval (0, 1), 53 random bits each."""
        shape = _size_to_shape("size", size)
        return _as_output(self._fill(math.prod(shape) if shape else 1, self._uniform53), shape)

    def standard_normal(self, size: Any = None) -> np.ndarray | float:
        """Float64 N(0, 1) by Box-Muller: one draw per element (two uniforms per pair)."""
        shape = _size_to_shape("size", size)
        n = math.prod(shape) if shape else 1
        return _as_output(self._fill(n, self._standard_normal_chunk), shape)

    def gaussian(self, stddev: float, size: Any = None) -> np.ndarray | float:
        """Hardened N(0, stddev**2): ``stddev * (Z1 + Z2 + Z3 + Z4) / 2``, float64.

        Four :meth:`standard_normal` draws per element (Holohan & Braghin 2021).
        """
        stddev = _validate.positive("stddev", stddev)
        shape = _size_to_shape("size", size)
        n = math.prod(shape) if shape else 1

        def chunk(m: int) -> np.ndarray:
            z = np.asarray(self.standard_normal(4 * m)).reshape(4, m)  # four draws per element
            z[0] += z[1]
            z[2] += z[3]
            z[0] += z[2]
            z[0] *= 0.5 * stddev
            return z[0]

        # 4 * chunk <= CHUNK, so each chunk's standard_normal call runs inline.
        return _as_output(self._fill(n, chunk, CHUNK // 4), shape)

    def laplace(self, scale: float = 1.0, size: Any = None) -> np.ndarray | float:
        """Hardened Laplace(scale): ``scale * (ln U1 cos(pi U2) + ln U3 cos(pi U4))``.

        -ln U1 cos(pi U2) has the law of Z1 Z2 (the Box-Muller product), and Z1 Z2 + Z3 Z4 is
        Laplace(1) (characteristic function 1 / (1 + t**2)). Four uniforms per element.
        """
        scale = _validate.positive("scale", scale)
        shape = _size_to_shape("size", size)
        n = math.prod(shape) if shape else 1

        def chunk(m: int) -> np.ndarray:
            u = self._uniform53(4 * m).reshape(4, m)
            np.log(u[0], out=u[0])
            np.log(u[2], out=u[2])
            u[1] *= math.pi
            u[3] *= math.pi
            np.cos(u[1], out=u[1])
            np.cos(u[3], out=u[3])
            u[0] *= u[1]
            u[2] *= u[3]
            u[0] += u[2]
            u[0] *= scale
            return u[0]

        return _as_output(self._fill(n, chunk), shape)

    def gamma(self, shape: float, scale: float = 1.0, size: Any = None) -> np.ndarray | float:
        """Gamma(shape, scale) in float64 by Marsaglia-Tsang (2000), numpy's parametrisation.

        Every element gets the same work: 4 candidates (a normal and a uniform each) are
        computed and the first accepted one is kept; for shape < 1 the boost
        Gamma(shape + 1) * U**(1/shape) costs one more uniform. All 4 candidates are rejected
        with probability < 0.05**4; those elements are redrawn. Rejection sampling makes the
        number of tries independent of the value returned, so the rare redraw leaks nothing
        about it.
        """
        a = _validate.positive("shape", shape)
        scale = _validate.positive("scale", scale)
        out_shape = _size_to_shape("size", size)
        n = math.prod(out_shape) if out_shape else 1
        a1 = a + 1.0 if a < 1.0 else a
        d = a1 - 1.0 / 3.0
        c = 1.0 / math.sqrt(9.0 * d)
        k = _GAMMA_CANDIDATES

        def chunk(m: int) -> np.ndarray:
            out = np.empty(m)
            pending = np.arange(m)
            while pending.size:
                p = pending.size
                x = self._standard_normal_chunk(k * p).reshape(k, p)
                log_u = np.log(self._uniform53(k * p)).reshape(k, p)
                w = c * x
                ok = w > -1.0
                with np.errstate(invalid="ignore", divide="ignore"):
                    # log v = 3 log1p(w); 1 - v + log v written to avoid cancellation.
                    vm1 = w * (3.0 + w * (3.0 + w))
                    accept = ok & (log_u < 0.5 * x * x + d * (3.0 * np.log1p(w) - vm1))
                first = np.argmax(accept, axis=0)
                done = accept[first, np.arange(p)]
                vals = d * (1.0 + vm1[first, np.arange(p)])
                out[pending[done]] = vals[done]
                pending = pending[~done]
            if a < 1.0:
                out *= np.exp(np.log(self._uniform53(m)) / a)
            out *= scale
            return out

        return _as_output(self._fill(n, chunk, CHUNK // k), out_shape)
