"""The layers of docs/architecture.md: the library never imports the trainers; no import circle."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("privkit", "fl_examples")



def test_importing_every_privkit_module_imports_no_trainer():
    # a fresh interpreter: modules another test already imported cannot mask an import
    code = (
        "import importlib, pkgutil, sys\n"
        "import privkit\n"
        "for m in pkgutil.walk_packages(privkit.__path__, 'privkit.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] == 'fl_examples')\n"
        "print(len(list(pkgutil.walk_packages(privkit.__path__, 'privkit.'))))\n"
        "sys.exit('imported: ' + ', '.join(bad) if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) > 30  # every module was visited


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports anywhere in its body (lazy imports included);
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                         for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name)
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_no_privkit_module_imports_fl_examples():
    graph = _import_graph()
    arrows = sorted((m, d) for m, deps in graph.items() if m.split(".")[0] == "privkit"
                    for d in deps if d.split(".")[0] == "fl_examples")
    assert arrows == []


def test_no_import_circle():
    assert [sorted(c) for c in _circles(_import_graph())] == []


def _arrows(graph: dict[str, set[str]], src: str, dst: str) -> list[tuple[str, str]]:
    return sorted((m, d) for m, deps in graph.items() if m == src or m.startswith(src + ".")
                  for d in deps if d == dst or d.startswith(dst + "."))


def test_events_and_mechanisms_import_no_accountant_and_accountants_no_mechanism():
    # events are plain data; mechanisms emit events; accountants price events (DESIGN.md)
    graph = _import_graph()
    assert _arrows(graph, "privkit.events", "privkit.accountants") == []
    assert _arrows(graph, "privkit.mechanisms", "privkit.accountants") == []
    assert _arrows(graph, "privkit.accountants", "privkit.mechanisms") == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [{"a", "b", "c"}]
