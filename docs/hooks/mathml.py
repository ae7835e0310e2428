"""mkdocs hook: render the site's maths to MathML at build time.

pymdownx.arithmatex (``generic: true``) turns ``$...$`` into
``<span class="arithmatex">\\(...\\)</span>`` and ``$$...$$`` into
``<div class="arithmatex">\\[...\\]</div>``. This hook replaces the TeX inside those
elements with MathML from the pure-Python ``latex2mathml`` package, so the built pages need
no JavaScript, no web font and no network access: browsers render MathML natively.

TeX that latex2mathml cannot convert, or converts into a literal ``\\command`` (an unknown
macro), is left as it is and logged as a warning, which fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import html
import logging
import re

from latex2mathml.converter import convert

log = logging.getLogger("mkdocs.hooks.mathml")

_ELEMENT = re.compile(r'<(?P<tag>span|div) class="arithmatex">(?P<body>.*?)</(?P=tag)>', re.S)
_DELIMITERS = {"span": (r"\(", r"\)"), "div": (r"\[", r"\]")}


def tex_to_mathml(tex: str, display: bool = False) -> str:
    """MathML for one TeX formula; ValueError if latex2mathml cannot render it faithfully."""
    try:
        out = convert(tex.strip(), display="block" if display else "inline")
    except Exception as exc:  # latex2mathml raises its own exception types
        raise ValueError(f"latex2mathml cannot convert {tex!r}: {exc}") from exc
    if "\\" in out:  # an unknown macro comes back as literal text such as <mi>\arg</mi>
        raise ValueError(f"unsupported TeX command in {tex!r}")
    return out


def render(page_html: str, where: str = "") -> str:
    """Replace every arithmatex span/div in page_html by its MathML rendering."""

    def replace(m: re.Match) -> str:
        tag = m.group("tag")
        opening, closing = _DELIMITERS[tag]
        tex = html.unescape(m.group("body")).strip()
        if tex.startswith(opening) and tex.endswith(closing):
            tex = tex[len(opening):-len(closing)]
        try:
            mathml = tex_to_mathml(tex, display=tag == "div")
        except ValueError as exc:
            log.warning("%s: %s", where or "page", exc)
            return m.group(0)
        return f'<{tag} class="arithmatex">{mathml}</{tag}>'

    return _ELEMENT.sub(replace, page_html)


def on_page_content(html: str, page, config, files) -> str:  # noqa: A002 (mkdocs' name)
    return render(html, page.file.src_uri)
