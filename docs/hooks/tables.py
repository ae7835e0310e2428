"""mkdocs hook: let identifiers in table cells wrap at sensible points, never mid-word.

Inside ``<code>`` in a table it inserts ``<wbr>`` (an optional line break, invisible and not
copied) after ``.``, ``_`` and ``/`` that sit between letters or digits, so
``privkit.accountants.fftpld`` or ``CLIP_REPLACE_ONE`` can wrap after a dot or an underscore.
docs/stylesheets/extra.css stops the browser from breaking them anywhere else.
"""

from __future__ import annotations

import re

_TABLE = re.compile(r"<table>.*?</table>", re.S)
_CODE = re.compile(r"(<code>)(.*?)(</code>)", re.S)
_BREAK_AFTER = re.compile(r"(?<=[A-Za-z0-9])([._/])(?=[A-Za-z0-9])")
_TAG = re.compile(r"(<[^>]*>)")  # tags (and their attributes) are left alone


def add_break_points(page_html: str) -> str:
    """page_html with <wbr> break points in the code of its tables."""

    def text(part: str) -> str:
        return part if part.startswith("<") else _BREAK_AFTER.sub(r"\1<wbr>", part)

    def code(m: re.Match) -> str:
        body = "".join(text(part) for part in _TAG.split(m.group(2)))
        return m.group(1) + body + m.group(3)

    return _TABLE.sub(lambda t: _CODE.sub(code, t.group(0)), page_html)


def on_page_content(html: str, page, config, files) -> str:  # noqa: A002 (mkdocs' name)
    return add_break_points(html)
