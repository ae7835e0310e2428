"""Tree helpers shared by the mechanisms (private to :mod:`privkit.mechanisms`).

A *tree* is a numpy array, a torch tensor, or a list / tuple / dict of trees (see
:func:`privkit.mechanisms.sampling.tree_map`). These helpers check that every leaf is a
floating array, add noise leafwise in float64 and cast back, and keep released outputs off the
autograd graph. torch is never imported here, only recognised when the caller already has it.
Used by :mod:`~privkit.mechanisms.gaussian`, :mod:`~privkit.mechanisms.objective` and
:mod:`~privkit.mechanisms.laplace`.
"""

from __future__ import annotations

import contextlib
import enum
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.mechanisms.sampling import tree_map

__all__: list[str] = []


def _torch() -> Any:
    """The torch module if it has been imported (no tensor can exist otherwise)."""
    return sys.modules.get("torch")


def _leaves(tree: Any) -> list[Any]:
    out: list[Any] = []

    def grab(x: Any) -> Any:
        out.append(x)
        return x

    tree_map(grab, tree)
    return out


def _is_float_leaf(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return x.dtype.kind == "f"
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor) and x.is_floating_point()


def _check_tree(name: str, tree: Any, *, nonempty: bool = True) -> list[Any]:
    """Every leaf a floating numpy array or torch tensor, and (if nonempty) one coordinate."""
    try:
        leaves = _leaves(tree)
    except (TypeError, ValueError) as exc:  # InvalidParameterError is a ValueError
        raise InvalidParameterError(
            name, type(tree).__name__,
            f"a numpy array, torch tensor or list/tuple/dict of them ({exc})") from None
    for x in leaves:
        if not _is_float_leaf(x):
            what = getattr(x, "dtype", type(x).__name__)
            raise InvalidParameterError(
                name, what, "floating-point numpy arrays or torch tensors in every leaf")
    if nonempty:
        if not leaves:
            raise InvalidParameterError(name, "an empty tree", "at least one coordinate")
        for x in leaves:
            if 0 in tuple(x.shape):
                raise InvalidParameterError(
                    name, f"a leaf of shape {tuple(x.shape)}", "non-empty leaves")
    return leaves


def _to_float64(x: Any) -> Any:
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return x.to(torch.float64)
    return np.asarray(x, dtype=np.float64)


def _cast_like(x: Any, like: Any) -> Any:
    if isinstance(like, np.ndarray):
        return np.asarray(x, dtype=like.dtype)
    return x.to(like.dtype)


def _add_noise(values: Any, noise: Any, noise_scale: float) -> Any:
    """``values + noise_scale * noise`` leafwise, added in float64 and cast back."""

    def add(x: Any, n: Any) -> Any:
        return _cast_like(_to_float64(x) + noise_scale * _to_float64(n), x)

    return tree_map(add, values, noise)


@contextlib.contextmanager
def _no_grad() -> Iterator[None]:
    """torch.no_grad() when torch is loaded: released models carry no autograd graph."""
    torch = _torch()
    if torch is None:
        yield
    else:
        with torch.no_grad():
            yield


def _check_noise_scale(value: Any) -> float:
    # Audit knob: multiplies the noise, never the claimed privacy; 0 (no noise) is allowed.
    return _validate.nonnegative("_noise_scale", value)


def _check_enum(name: str, value: Any, cls: type[enum.Enum]) -> None:
    if not isinstance(value, cls):
        raise InvalidParameterError(name, value, f"a {cls.__name__} member")


def _optional(name: str, value: Any, check: Callable[[str, Any], Any]) -> Any:
    return None if value is None else check(name, value)
