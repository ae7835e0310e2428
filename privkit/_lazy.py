"""Modules imported on first use, so that ``import privkit`` stays fast.

``scipy.special``, ``scipy.optimize`` and friends cost 0.1-0.5 s to import and most uses of
privkit never need them; accountants reach them through a :class:`LazyModule`, which imports
the module on first attribute access (afterwards the lookup is a dict hit).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["LazyModule"]


class LazyModule:
    """Stands for the module ``name``; imports it on first attribute access."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)
