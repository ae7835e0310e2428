"""dp-accounting's event algebra without the cost of its package import.

``import dp_accounting`` runs a package ``__init__`` that imports every accountant, and with
them ``scipy.signal``, ``scipy.stats`` and ``scipy.optimize`` (~1 s of a ~1.3 s
``import privkit``). privkit needs only two plain modules at import time:
``dp_accounting.dp_event`` (the event classes) and ``dp_accounting.privacy_accountant``
(``NeighboringRelation``); both import nothing but ``attr``.

So, when dp-accounting is not imported yet, this module registers the package object without
running its ``__init__`` and imports those two submodules into it. The package completes itself
on first need: any submodule is imported on attribute access, and the first attribute that is
not a submodule (``dp_accounting.PLDAccountant``, say) runs the real ``__init__`` in place, so
code that imports dp-accounting after privkit sees the whole package. The classes are the very
same objects either way (``isinstance`` and pickling are unaffected).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

__all__ = ["dp_event", "privacy_accountant"]


def _deferred_package() -> None:
    if "dp_accounting" in sys.modules:
        return
    spec = importlib.util.find_spec("dp_accounting")
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        importlib.import_module("dp_accounting")  # let the import system say what is wrong
        return
    pkg = importlib.util.module_from_spec(spec)
    state = {"initialised": False, "running": False}

    def complete(name: str) -> Any:
        if importlib.util.find_spec(f"dp_accounting.{name}") is not None:
            return importlib.import_module(f"dp_accounting.{name}")
        if state["initialised"] or state["running"] or name.startswith("__"):
            raise AttributeError(f"module 'dp_accounting' has no attribute {name!r}")
        state["running"] = True
        try:
            spec.loader.exec_module(pkg)  # type: ignore[union-attr]  # the real __init__
            state["initialised"] = True
        finally:
            state["running"] = False
        return getattr(pkg, name)

    pkg.__getattr__ = complete  # type: ignore[method-assign]  # PEP 562
    sys.modules["dp_accounting"] = pkg


if TYPE_CHECKING:  # the type checker sees the plain modules (their classes are types)
    from dp_accounting import dp_event, privacy_accountant
else:
    _deferred_package()
    dp_event: ModuleType = importlib.import_module("dp_accounting.dp_event")
    privacy_accountant: ModuleType = importlib.import_module("dp_accounting.privacy_accountant")
