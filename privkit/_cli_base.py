"""What every command group of the ``privkit`` command line shares.

The parser class (errors in one line, exit status 2, the flags the user typed recorded for
the error line), its help formatter, the number arguments, ``--quiet`` after a command, and
the output (one line of text, or exactly one JSON object with ``--json``). Apart from
:mod:`privkit.cli` because the command groups (``privkit._cli_accounting``,
``privkit._cli_audit``, ``privkit._cli_ledger``) build on it and :mod:`privkit.cli` builds on
them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, NoReturn

__all__ = ["HelpFormatter", "Parser", "flag_of", "number", "integer_or_number", "add_quiet",
           "add_json", "subcommands", "emit"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help (``(default: ...)``, left out where the help already
    says it or there is none to say), and descriptions and epilogs shown as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower() or any(
                action.default is x for x in (None, False, argparse.SUPPRESS)) \
                or action.nargs == 0:
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """Also record, as ``_flags``, the options of the innermost (sub)command parsed: dest
        -> the flag (errors name the flag the user typed)."""
        ns, rest = super().parse_known_args(args, namespace)
        if "_flags" not in vars(ns):
            ns._flags = {a.dest: flag_of(a) for a in self._actions
                         if a.option_strings and a.dest != "help"}
        return ns, rest


def flag_of(action: argparse.Action) -> str:
    """The flag an error names: an action's canonical spelling (``privkit_canonical``, when
    it also answers to older ones), else its longest (``--quiet`` rather than ``-q``)."""
    return str(getattr(action, "privkit_canonical", None)
               or max(action.option_strings, key=len))


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def integer_or_number(text: str) -> int | float:
    try:
        return int(text)  # exact for large seeds
    except ValueError:
        return number(text)  # validated (and named) by the command


def add_quiet(parser: argparse.ArgumentParser) -> None:
    """``--quiet`` after a command (the same as ``privkit --quiet COMMAND``)."""
    parser.add_argument("--quiet", "-q", action="store_true", default=argparse.SUPPRESS,
                        help="no progress bars and no non-essential output (as privkit "
                        "--quiet)")


def add_json(parser: argparse.ArgumentParser) -> None:
    """``--json``: print one JSON object (:func:`emit`)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def subcommands(sub: Any, name: str, help_text: str, dest: str = "mechanism") -> Any:
    """The command ``name`` (its help ``help_text``) added to ``sub``, and the subparsers of
    its (required) subcommands, chosen into ``dest``."""
    command = sub.add_parser(name, help=help_text)
    return command.add_subparsers(dest=dest, required=True, parser_class=Parser)


def emit(obj: dict[str, Any], as_json: bool, text: str) -> None:
    """Print ``obj`` as one JSON object (``--json``), else ``text``."""
    if as_json:
        print(json.dumps(obj, allow_nan=True))
    else:
        print(text)
