"""The docs render maths: arithmatex + the build-time MathML hook, and no ASCII maths on the
theory pages. Nothing here builds the site (make test does that with --strict)."""

import importlib.util
import re
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "docs" / "hooks"
THEORY = sorted((ROOT / "docs" / "theory").glob("*.md"))


def load_hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", HOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- (a) the hook turns arithmatex's generic output into MathML -----------------------------

def test_hook_converts_tex_to_mathml():
    pytest.importorskip("latex2mathml", reason="the docs extra: pip install -e '.[docs]'")
    mathml = load_hook("mathml")
    out = mathml.tex_to_mathml(r"\frac{a}{b}")
    assert out.startswith("<math") and "<mfrac>" in out
    page = ('<p>inline <span class="arithmatex">\\(\\frac{a}{b} &lt; 1\\)</span></p>\n'
            '<div class="arithmatex">\\[\n\\sqrt{\\rho \\log(1/\\delta)}\n\\]</div>')
    html = mathml.render(page)
    assert html.count("<math") == 2 and 'display="block"' in html
    assert "<msqrt>" in html and "<mo>&#x0003C;</mo>" in html  # the escaped < is an operator
    assert "\\(" not in html and "\\[" not in html and "\\frac" not in html


def test_hook_refuses_tex_it_cannot_render():
    pytest.importorskip("latex2mathml", reason="the docs extra: pip install -e '.[docs]'")
    mathml = load_hook("mathml")
    with pytest.raises(ValueError):
        mathml.tex_to_mathml(r"\arg\min_w f(w)")  # latex2mathml would print "\arg" literally
    page = '<span class="arithmatex">\\(\\arg\\min_w f\\)</span>'
    assert mathml.render(page, "x.md") == page  # left as TeX, and a warning fails --strict


def test_table_hook_adds_break_points_only_in_table_code():
    tables = load_hook("tables")
    page = ('<p><code>a_b.c</code></p><table><tr><td><code>CLIP_REPLACE_ONE</code> '
            '<code><a href="x.y_z">privkit.mechanisms</a></code></td></tr></table>')
    out = tables.add_break_points(page)
    assert "<p><code>a_b.c</code></p>" in out
    assert "<code>CLIP_<wbr>REPLACE_<wbr>ONE</code>" in out
    assert 'href="x.y_z"' in out and "privkit.<wbr>mechanisms" in out


# --- (b) the theory pages write maths as TeX, not ASCII ---------------------------------------

def prose(text: str) -> str:
    """A page's text outside fenced code, code spans, maths and link targets (indented
    blocks are kept: the theory pages used them for ASCII display formulas)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\$\$.*?\$\$", "", text, flags=re.S)
    text = re.sub(r"\$[^$]+\$", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


ASCII_MATHS = {
    "sqrt(": r"sqrt\(",
    "||x|| norms": r"\|\|",
    "<= or >=": r"<=|>=",
    "^ powers": r"\^",
    "_ subscripts": r"[A-Za-z]_[A-Za-z0-9{]",
    "~ as 'distributed as'": r"~",
    "exp( / log( / min(": r"\b(?:exp|log|ln|min|max|argmin)\(",
    "Greek letters spelled out":
        r"\b(?:alpha|beta|sigma|mu|rho|tau|psi|eta|xi|eps|eps0|Phi|Delta)\b",
    "E[...] expectations": r"\bE\[",
}


@pytest.mark.parametrize("page", THEORY, ids=lambda p: p.name)
def test_theory_pages_have_no_ascii_maths(page):
    text = prose(page.read_text(encoding="utf-8"))
    found = {what: re.findall(rf".{{0,30}}(?:{pattern}).{{0,30}}", text)
             for what, pattern in ASCII_MATHS.items()}
    assert not {k: v for k, v in found.items() if v}, "write these as $...$ TeX"


@pytest.mark.parametrize("page", THEORY, ids=lambda p: p.name)
def test_theory_pages_use_tex(page):
    text = page.read_text(encoding="utf-8")
    assert re.search(r"\$[^$\s][^$]*\$", text), "no $...$ maths on a theory page"


def test_there_are_theory_pages():
    assert len(THEORY) >= 5


# --- (c) mkdocs.yml wires it up, and the renderer is a docs dependency ------------------------

def test_mkdocs_enables_arithmatex_and_the_hook():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    extensions = {}
    for ext in config["markdown_extensions"]:
        extensions.update(ext if isinstance(ext, dict) else {ext: None})
    assert "pymdownx.arithmatex" in extensions
    assert (extensions["pymdownx.arithmatex"] or {}).get("generic") is True  # no MathJax markup
    hooks = [Path(h).as_posix() for h in config.get("hooks", [])]
    assert "docs/hooks/mathml.py" in hooks and "docs/hooks/tables.py" in hooks
    for hook in hooks:
        assert (ROOT / hook).is_file(), hook
    assert "stylesheets/extra.css" in config.get("extra_css", [])
    # nothing fetched when the site is viewed: no maths script or font from a network
    assert not [s for s in config.get("extra_javascript", []) if "://" in str(s)]
    assert config["theme"].get("font") is False  # Material would load Google Fonts
    assert "://" not in (ROOT / "docs" / "stylesheets" / "extra.css").read_text(encoding="utf-8")


def test_docs_extra_has_the_renderer():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    docs = meta["project"]["optional-dependencies"]["docs"]
    assert any(re.match(r"latex2mathml\b", d) for d in docs)
