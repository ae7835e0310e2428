"""Training schedules in the vocabulary of DP-SGD libraries: steps and a sampling probability
from epochs, an expected batch size and a dataset size.

Opacus and most DP-SGD code describe a run by epochs and a sample rate (or a batch size and a
dataset size); privkit's accountants price steps. One epoch is ``ceil(N / B)`` steps with an
expected batch size ``B`` out of ``N`` records (Poisson sampling at ``q = B / N``), or
``ceil(1 / q)`` steps with a sampling probability ``q`` alone, as the bundled DP-SGD trainers
and :mod:`privkit.torch` count them; ``E`` epochs are ``ceil(E * steps per epoch)`` steps, so
a run is never priced for fewer steps than it takes (Opacus's ``int(epochs / sample_rate)``
can be one fewer). A product within 1e-9 of an integer counts as that integer (``0.3 * 10``
is 3 steps, not 4).

Example:
    >>> schedule(epochs=3, batch_size=256, dataset_size=60_000)
    Schedule(steps=705, sampling_probability=0.004266666666666667, epochs=3.0)
    >>> schedule(steps=1000, sampling_probability=0.01).epochs
    10.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from privkit import _validate
from privkit.errors import InvalidParameterError

__all__ = ["Schedule", "schedule"]


@dataclass(frozen=True)
class Schedule:
    """A run of ``steps`` Poisson-sampled steps at ``sampling_probability``.

    Attributes:
        steps: T, an integer >= 1.
        sampling_probability: q in (0, 1].
        epochs: T / (steps per epoch): the passes over the data it makes (module doc).
    """

    steps: int
    sampling_probability: float
    epochs: float


def _ceil(x: float) -> int:
    """ceil(x), but an x within 1e-9 (relative) of an integer is that integer."""
    r = round(x)
    return int(r) if abs(x - r) <= 1e-9 * max(1.0, abs(x)) else math.ceil(x)


def steps_per_epoch(sampling_probability: float, batch_size: int | None = None,
                    dataset_size: int | None = None) -> int:
    """``ceil(N / B)`` with a batch size and a dataset size, else ``ceil(1 / q)``."""
    if batch_size is not None and dataset_size is not None:
        return -(-dataset_size // batch_size)
    return _ceil(1.0 / sampling_probability)


def schedule(*, steps: Any = None, epochs: Any = None, sampling_probability: Any = None,
             batch_size: Any = None, dataset_size: Any = None) -> Schedule:
    """The steps and sampling probability of a run given by ``steps`` or by ``epochs``, and by
    ``sampling_probability`` or by ``batch_size`` and ``dataset_size`` (neither: q = 1, full
    batches).

    Raises:
        InvalidParameterError: naming the argument: neither or both of ``steps`` and
            ``epochs``; both a sampling probability and a batch size; a batch size without a
            dataset size or the other way round; a batch size larger than the dataset; a
            value that is NaN, infinite or out of range.
    """
    if steps is None and epochs is None:
        raise InvalidParameterError("steps", None, "given (or epochs instead)")
    if steps is not None and epochs is not None:
        raise InvalidParameterError("epochs", epochs, "left out when steps are given (give "
                                    "one of the two)")
    if batch_size is not None and sampling_probability is not None:
        raise InvalidParameterError("batch_size", batch_size, "left out when a sampling "
                                    "probability is given (give one of the two)")
    if (batch_size is None) != (dataset_size is None):
        name, value = (("dataset_size", dataset_size) if batch_size is not None
                       else ("batch_size", batch_size))
        raise InvalidParameterError(name, value, "given with the "
                                    + ("batch size" if name == "dataset_size" else
                                       "dataset size") + " (the sampling probability is "
                                    "batch size / dataset size)")
    b: int | None = None
    n: int | None = None
    if batch_size is not None:
        b = _validate.positive_int("batch_size", batch_size)
        n = _validate.positive_int("dataset_size", dataset_size)
        if b > n:
            raise InvalidParameterError("batch_size", batch_size,
                                        f"at most the dataset size {n}")
        q = b / n
    else:
        q = 1.0 if sampling_probability is None else _validate.probability(
            "sampling_probability", sampling_probability)
    per_epoch = steps_per_epoch(q, b, n)
    if steps is not None:
        t = _validate.positive_int("steps", steps)
        return Schedule(t, q, t / per_epoch)
    e = _validate.positive("epochs", epochs)
    x = e * per_epoch
    if not x <= 2**62:
        raise InvalidParameterError("epochs", epochs, "at most 2^62 steps' worth")
    return Schedule(max(1, _ceil(x)), q, e)
