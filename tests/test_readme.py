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


#: Each console block's ``$ privkit`` lines, in order: one shell session (a ``--resume``
#: line continues the run of the line before it).
CLI_BLOCKS = [(n, [line[2:].split()[1:] for line in code.splitlines()
                   if line.startswith("$ privkit ")]) for n, code in blocks("console")]
CLI_BLOCKS = [(n, lines) for n, lines in CLI_BLOCKS if lines]
CLI_LINES = [(n, argv) for n, lines in CLI_BLOCKS for argv in lines]


@pytest.mark.parametrize("name,lines", CLI_BLOCKS, ids=lambda x: x if isinstance(x, str) else "")
def test_cli_lines_run(name, lines, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # e.g. --out runs/...; the lines of a block share it
    for argv in lines:
        assert main(argv) == 0, argv
        assert capsys.readouterr().out.strip()


def test_there_are_examples():
    assert len(blocks("python")) >= 2 and len(CLI_LINES) >= 3
