"""The test toolchain is reproducible and the docs check can fail.

``mkdocs build --strict -q`` never fails on a warning (``-q`` keeps warnings from being
emitted, so strict mode has none to count); and unpinned docs/dev extras made CI pass or fail
with whatever the registry served that day. make test installs from constraints.txt.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _recipe(target: str) -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    out = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        out.append(line.strip())
    return out


def test_the_strict_docs_build_counts_warnings():
    for target in ("test", "docs"):
        builds = [c for c in _recipe(target) if "mkdocs build" in c]
        assert builds, target
        for cmd in builds:
            assert "--strict" in cmd, cmd
            assert not re.search(r"\s(-q|--quiet)(\s|$)", cmd), cmd


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_every_install_of_the_toolchain_uses_the_constraints_file():
    text = (ROOT / "Makefile").read_text()
    assert re.search(r"^PIP\s*:=.*pip install .*-c constraints\.txt", text, re.M)
    for target in ("$(STAMP)", "$(FULL)", "$(BENCH)"):
        recipe = _recipe(target)
        assert any(c.startswith("$(PIP) -e ") for c in recipe), (target, recipe)
        # the one other install is torch==2.13.0 when no torch is present (a CPU build)
        others = [c for c in recipe if "pip install" in c]
        assert all("torch==2.13.0" in c for c in others), (target, others)


def test_the_constraints_pin_every_test_tool_and_runtime_requirement():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not pinned with ==: {line}"
            pins[name.lower().replace("_", "-")] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in ("dev", "docs", "examples", "flower"):
        wanted += project["optional-dependencies"][extra]
    missing = sorted({_name(r) for r in wanted} - set(pins))
    assert not missing, f"constraints.txt lacks {missing}: run make lock"
    assert pins["torch"] == "2.13.0"


def test_every_slow_entry_names_a_test_that_exists():
    """A stale entry in tests/conftest.py would silently move nothing to make test-slow."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("slow_conftest", ROOT / "tests/conftest.py")
    assert spec is not None and spec.loader is not None
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    for module in conf.SLOW_MODULES:
        assert (ROOT / module).is_file(), module
    for entry in conf.SLOW_TESTS:
        path, _, name = entry.partition("::")
        text = (ROOT / path).read_text()
        # a test function, or one bound by a factory (tests/coupling: coupling_tests)
        assert re.search(rf"^def {re.escape(name)}\(|^(\w+, )*{re.escape(name)}\b.* = ",
                         text, re.M), entry


def test_make_test_skips_the_slow_tests_and_ci_runs_both():
    assert any("-m \"not slow\"" in c or "-m 'not slow'" in c for c in _recipe("test"))
    assert any("-m slow" in c for c in _recipe("test-slow"))
    ci = (ROOT / ".ci/run").read_text()
    assert "make test" in ci and "make test-slow" in ci
