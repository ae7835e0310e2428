"""mkdocs hook: Sphinx cross-reference roles in docstrings read as plain code.

privkit's docstrings follow the Python convention of ``:class:`Ledger``` and
``:func:`~privkit.epsilon```; mkdocstrings renders them as the role's text followed by the
code (``:class:<code>Ledger</code>``). This hook drops the role and, for a ``~`` target,
keeps its last component (``~privkit.epsilon`` reads ``epsilon``), as Sphinx shows them.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|term):"
                   r"(<code[^>]*>)(~?)([^<]*)(</code>)")


def strip_roles(page_html: str) -> str:
    """page_html without the roles before its code spans."""

    def one(m: re.Match) -> str:
        target = m.group(3).rsplit(".", 1)[-1] if m.group(2) else m.group(3)
        return m.group(1) + target + m.group(4)

    return _ROLE.sub(one, page_html)


def on_page_content(html: str, page, config, files) -> str:  # noqa: A002 (mkdocs' name)
    return strip_roles(html)
