"""Which settings apply to which privacy model: a setting given where it does not apply, or
two settings that contradict each other, are errors that name them, never silently dropped.

A trainer's configuration leaves its privacy settings at None (or False) when they are not
given; :func:`check_and_resolve` refuses a given setting that its mode does not use, then
fills the mode's defaults, so that the configuration a report records holds the values the
run used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from privkit.errors import InvalidParameterError

__all__ = ["check_and_resolve", "refuse_together"]


def _given(value: Any) -> bool:
    return value is not None and value is not False


def check_and_resolve(cfg: Any, mode: str, applies: Mapping[str, tuple[str, ...]],
                      defaults: Mapping[str, Any], *, mode_flag: str = "--privacy",
                      why: Mapping[str, str] | None = None) -> None:
    """Refuse a setting of ``cfg`` given for a mode it does not apply to; set the mode's
    defaults on a frozen dataclass ``cfg`` for the settings left at None.

    Args:
        applies: setting -> the modes that use it.
        defaults: setting -> its value when a mode that uses it leaves it at None.
        mode_flag: how errors name the mode's flag.
        why: setting -> a note added to its error (what the mode means instead).
    """
    for name, modes in applies.items():
        value = getattr(cfg, name)
        if _given(value) and mode not in modes:
            note = (why or {}).get(name)
            where = " or ".join(modes)
            raise InvalidParameterError(
                name, value, f"given only with {mode_flag} {where} (this run has {mode_flag} "
                f"{mode}{'; ' + note if note else ''})")
    for name, value in defaults.items():
        if getattr(cfg, name) is None and mode in applies.get(name, (mode,)):
            object.__setattr__(cfg, name, value)


def refuse_together(cfg: Any, first: str, second: str, reason: str) -> None:
    """``first`` and ``second`` both given: an error naming both."""
    a, b = getattr(cfg, first), getattr(cfg, second)
    if _given(a) and _given(b):
        flag = "--" + second.replace("_", "-")
        raise InvalidParameterError(first, a, f"left out with {flag} ({reason})")
