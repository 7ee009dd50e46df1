"""The package layout holds (docs/ARCHITECTURE.md, "The layers and what each may use"): imports point down, no
cycles, no private names cross, small modules.

Folders from the top: the face (``autoshard/*.py``: api, cli, report, ...), ``compiler``, ``runtime``,
``passes``, ``plans``, ``meshes``, ``ir``, and at the bottom ``errors`` and ``version``. A module may
import from its own folder or from folders below it. Every import statement counts, module level or
inside a function: a deferred import is still a dependency.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "autoshard"
RANKS = {"face": 7, "compiler": 6, "runtime": 5, "passes": 4, "plans": 3, "meshes": 2, "ir": 1, "base": 0}
BASE_MODULES = {"autoshard.errors", "autoshard.version"}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


MODULES = _modules()


def folder(module: str) -> str:
    if module in BASE_MODULES:
        return "base"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANKS) else "face"


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported from, names taken, line) for every import of an autoshard module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("autoshard"):
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("autoshard")]
    return found


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for target, names, _ in _imports(path):
            targets = {target} | {f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES}
            edges[mod] |= {t for t in targets if t in MODULES and t != mod}
    return edges


def test_imports_point_down_the_folders():
    wrong = []
    for mod, targets in _edges().items():
        for target in targets:
            a, b = folder(mod), folder(target)
            if a != b and RANKS[b] >= RANKS[a]:
                wrong.append(f"{mod} ({a}) imports {target} ({b})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    edges = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("tree", ["autoshard", "tests", "benchmarks", "examples"])
def test_no_private_name_crosses_modules(tree):
    crossing = []
    for path in (ROOT / tree).rglob("*.py"):
        here = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for target, names, line in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != here:
                crossing.append(f"{path.relative_to(ROOT)}:{line} takes {', '.join(private)} from {target}")
    assert not crossing, "private names imported from another module:\n" + "\n".join(crossing)


def test_modules_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them along their ideas): {big}"


def test_every_folder_has_a_rank():
    folders = {folder(m) for m in MODULES}
    assert folders <= set(RANKS), f"folders without a place in the layout: {folders - set(RANKS)}"
