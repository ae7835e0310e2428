"""Every example in the README and the docs runs, and prints what the page says it prints.

Examples are ```python blocks (run as code) and the ``$ privkit`` lines of ```console blocks
(run via the CLI; one block is one shell session, so a ``--resume`` line continues the run of
the line before it).

Convention for the output shown under an example: the example's closing fence is followed
(after blank lines) by a label line and then a ```text block holding what the example prints
on stdout (for a console block: what its ``$ privkit`` lines print, one after the other):

- ``Output:`` -- the output is deterministic (seeded or analytic) and is compared with what the
  example prints now: equal after stripping trailing whitespace, or else equal up to numbers
  that agree to a relative tolerance of 1e-6 (float formatting may differ across platforms).
  Where the shown output is JSON it is compared as parsed JSON (so a page may indent it).
- ``Output (times vary):`` -- the output holds wall-clock times (trainers' tables, audits,
  ``demo --json``); it shows one run's values, may be trimmed with ``...``, and is not compared.
- ``Output (may vary):`` -- a trained model's numbers without times (seeded, but torch's
  arithmetic may differ across platforms); shown, may be trimmed, not compared.

Any other label starting with "Output" fails, so a typo cannot silently skip a comparison.
Python blocks and ``privkit epsilon``/``calibrate``/``midp`` lines must use ``Output:``; every
example outside the pages in NO_OUTPUT_SHOWN must show its output.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from privkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]

COMPARED = "Output:"
NOT_COMPARED = ("Output (times vary):", "Output (may vary):")
#: Pages whose examples do not show their output yet.
NO_OUTPUT_SHOWN = {"flower.md"}
#: CLI commands whose output is analytic or seeded, so it must be shown and compared.
DETERMINISTIC_COMMANDS = {"epsilon", "calibrate", "midp"}

_LABEL = re.compile(r"\n*(Output[^\n]*)\n")
_TEXT = re.compile(r"\n*```text\n(.*?)```", re.S)


@dataclass(frozen=True)
class Example:
    name: str  # page#index (the index counts blocks of the same language on the page)
    page: str
    lang: str
    code: str
    label: str | None  # the output label, None if no output is shown
    expected: str | None  # the text block under the label

    @property
    def compared(self) -> bool:
        return self.label == COMPARED


def examples(lang: str) -> list[Example]:
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for i, m in enumerate(re.finditer(rf"```{lang}\n(.*?)```", text, re.S)):
            label = expected = None
            lm = _LABEL.match(text, m.end())
            if lm:
                label = lm.group(1)
                tm = _TEXT.match(text, lm.end())
                expected = tm.group(1) if tm else None
            out.append(Example(f"{path.name}#{i}", path.name, lang, m.group(1), label, expected))
    return out


def cli_lines(code: str) -> list[list[str]]:
    return [line[2:].split()[1:] for line in code.splitlines() if line.startswith("$ privkit ")]


PYTHON = examples("python")
CONSOLE = [ex for ex in examples("console") if cli_lines(ex.code)]
CLI_LINES = [argv for ex in CONSOLE for argv in cli_lines(ex.code)]

_NUMBER = re.compile(r"([-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)")


def _close(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def _same_json(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return _close(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same_json, a, b))
    return a == b


def same_output(actual: str, expected: str) -> bool:
    """Whether ``actual`` is what a page shows as ``expected`` (see the module docstring)."""
    a = "\n".join(line.rstrip() for line in actual.strip("\n").splitlines())
    e = "\n".join(line.rstrip() for line in expected.strip("\n").splitlines())
    if a == e:
        return True
    try:
        return _same_json(json.loads(a), json.loads(e))
    except ValueError:
        pass
    pa, pe = _NUMBER.split(a), _NUMBER.split(e)
    return len(pa) == len(pe) and all(
        _close(float(x), float(y)) if k % 2 else x == y for k, (x, y) in enumerate(zip(pa, pe))
    )


def _shape(line: str) -> str:
    """A line with its numbers masked and its spacing collapsed."""
    return " ".join(_NUMBER.sub("#", line).split())


def stale_lines(actual: str, expected: str) -> list[str]:
    """The lines a page shows under an uncompared label (times or a trained model's numbers
    vary) that the example no longer prints, up to their numbers: a renamed column, a changed
    label or a note the command stopped printing. Lines with ``...`` (a trimmed output) are
    skipped."""
    try:  # JSON: the same keys, whatever the values
        got = json.loads(actual)
    except ValueError:
        got = None
    else:
        try:
            return [] if _same_keys(got, json.loads(expected)) else [expected]
        except ValueError:  # a trimmed JSON page: compare its lines with the indented JSON
            actual = json.dumps(got, indent=2)
    have = {_shape(line) for line in actual.splitlines()}
    return [line for line in expected.splitlines()
            if line.strip() and "..." not in line and _shape(line) not in have]


def _same_keys(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_keys(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return all(_same_keys(x, y) for x, y in zip(a, b))
    return True


def same_shape(actual: str, expected: str) -> bool:
    return not stale_lines(actual, expected)


def check_output(ex: Example, printed: str) -> None:
    if ex.compared:
        assert same_output(printed, ex.expected), (
            f"{ex.name} prints\n{printed}\nbut the page shows\n{ex.expected}"
        )
    elif ex.expected is not None:
        stale = stale_lines(printed, ex.expected)
        assert not stale, (f"{ex.name}: the page shows lines the example no longer prints "
                           "(numbers aside):\n" + "\n".join(stale) + f"\n\nit prints\n{printed}")


@pytest.mark.parametrize("ex", PYTHON, ids=lambda ex: ex.name)
def test_python_block_runs(ex, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write files
    exec(compile(ex.code, ex.name, "exec"), {"__name__": "__readme__"})
    check_output(ex, capsys.readouterr().out)


@pytest.mark.parametrize("ex", CONSOLE, ids=lambda ex: ex.name)
def test_cli_lines_run(ex, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # e.g. --out runs/...; the lines of a block share it
    printed = []
    for argv in cli_lines(ex.code):
        assert main(argv) == 0, argv
        printed.append(capsys.readouterr().out)
        assert printed[-1].strip()
    check_output(ex, "".join(printed))


@pytest.mark.parametrize("ex", PYTHON + CONSOLE, ids=lambda ex: f"{ex.name}-{ex.lang}")
def test_example_shows_its_output(ex):
    if ex.page in NO_OUTPUT_SHOWN:
        return
    assert ex.label in (COMPARED, *NOT_COMPARED), (
        f"{ex.name}: expected one of {(COMPARED, *NOT_COMPARED)} as a line under the example, "
        f"got {ex.label!r}"
    )
    assert ex.expected is not None, f"{ex.name}: no ```text block under {ex.label!r}"
    commands = {argv[0] for argv in cli_lines(ex.code)}
    if ex.lang == "python" or commands <= DETERMINISTIC_COMMANDS:
        assert ex.compared, f"{ex.name} is deterministic: label its output {COMPARED!r}"


def test_a_wrong_number_is_caught():
    shown = "eps <= 1.51537 at delta=1e-05\n{'c0': 1.591}"
    assert same_output(shown + "  \n", shown)
    assert same_output("eps <= 1.5153700001 at delta=1e-05\n{'c0': 1.591}", shown)
    assert not same_output(shown.replace("1.51537", "1.51538"), shown)
    assert not same_output(shown.replace("1e-05", "1e-06"), shown)
    assert not same_output(shown.replace("eps", "EPS"), shown)
    assert same_output('{"a": [1, 2.0], "b": "x"}', '{\n  "a": [1, 2.0000000001],\n  "b": "x"\n}')
    assert not same_output('{"a": [1, 2.0], "b": "x"}', '{"a": [1, 2.1], "b": "x"}')


def test_a_stale_uncompared_output_is_caught():
    shown = "algorithm  acc  wall s\nfedavg  0.91  0.12\n..."
    assert same_shape("algorithm  acc  wall s\nfedavg  0.87  3.4\nmore", shown)
    assert not same_shape("algorithm  heldout acc  wall s\nfedavg  0.87  3.4", shown)
    assert not same_shape("algorithm  acc  wall s\nfedprox  0.87  3.4", shown)


def test_there_are_examples():
    assert len(PYTHON) >= 2 and len(CLI_LINES) >= 3
    assert sum(ex.compared for ex in PYTHON + CONSOLE) >= 10
