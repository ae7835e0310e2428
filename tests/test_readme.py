"""Every example in the README runs: python blocks as code, '$ privkit' lines via the CLI."""

import re
from pathlib import Path

import pytest

from privkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def blocks(lang: str) -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for i, m in enumerate(re.finditer(rf"```{lang}\n(.*?)```", text, re.S)):
            out.append((f"{path.name}#{i}", m.group(1)))
    return out


@pytest.mark.parametrize("name,code", blocks("python"), ids=lambda x: x if "#" in x else "")
def test_python_block_runs(name, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write files
    exec(compile(code, name, "exec"), {"__name__": "__readme__"})


CLI_LINES = [(n, line[2:].split()[1:]) for n, code in blocks("console")
             for line in code.splitlines() if line.startswith("$ privkit ")]


@pytest.mark.parametrize("name,argv", CLI_LINES, ids=lambda x: x if isinstance(x, str) else "")
def test_cli_line_runs(name, argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # e.g. --out runs/...
    assert main(argv) == 0
    assert capsys.readouterr().out.strip()


def test_there_are_examples():
    assert len(blocks("python")) >= 2 and len(CLI_LINES) >= 3
