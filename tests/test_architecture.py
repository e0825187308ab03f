"""The shape of the code, checked from its source (nothing is imported): no import cycle between tltlib's modules
(imports inside functions count), no function over 80 lines in tltlib/ or bench/, modules of at most ~500 lines, and
docs/architecture.md names every module."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "tltlib"


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its source (``from .x import y``, ``from . import
    x``, ``import tltlib.x``)."""
    names = {p.stem for p in pkg.glob("*.py")}
    graph = {}
    for path in pkg.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level == 1 or (node.module or "").startswith("tltlib")):
                mod = (node.module or "").removeprefix("tltlib").lstrip(".").split(".")[0]
                deps |= {mod} if mod else {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("tltlib.")}
        graph[path.stem] = (deps & names) - {path.stem}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}                     # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d, path + [d])):
                return found
        state[m] = 2
        return None
    return next((c for m in sorted(graph) if m not in state and (c := visit(m, [m]))), None)


def long_functions(folder: Path, limit: int) -> list[str]:
    out = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_the_cycle_finder_finds_a_cycle_through_an_import_inside_a_function(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "c.py").write_text("import tltlib.a\n")
    assert cycle(import_graph(tmp_path)) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("import os\n")
    assert cycle(import_graph(tmp_path)) is None


def test_tltlib_has_no_import_cycle():
    assert cycle(import_graph()) is None, f"import cycle: {' -> '.join(cycle(import_graph()))}"


@pytest.mark.parametrize("folder", ["tltlib", "bench"])
def test_no_function_over_80_lines(folder):
    assert not long_functions(ROOT / folder, 80), long_functions(ROOT / folder, 80)


def test_modules_stay_readable():
    big = [f"{p.name} ({n} lines)" for p in PKG.glob("*.py") if (n := len(p.read_text().splitlines())) > 520]
    assert not big, f"split these by concept: {big}"


def test_the_architecture_document_names_every_module():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = sorted(p.stem for p in PKG.glob("*.py") if not p.stem.startswith("_") and f"`{p.stem}`" not in doc)
    assert not missing, f"docs/architecture.md does not describe {missing}"
