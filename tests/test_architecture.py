"""The shape of the code, checked from its source (nothing is imported): tltlib's subpackages import only the
subpackages below them in the order docs/architecture.md declares (imports inside functions count), no import cycle
between modules, no function over 80 lines in tltlib/ or bench/, modules of a readable size, and
docs/architecture.md names every module."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "tltlib"
DOC = ROOT / "docs" / "architecture.md"


def module_files(pkg: Path = PKG) -> dict[str, Path]:
    """dotted module name (relative to the package: ``rollout.engine``, ``fileio``; a subpackage's ``__init__`` is
    the subpackage's own name, the root's is ``__init__``) -> its file."""
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = list(path.relative_to(pkg).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _package_of(name: str, path: Path) -> list[str]:
    """The package path (as parts) a module's relative imports start from."""
    parts = name.split(".")
    return parts if path.name == "__init__.py" and name != "__init__" else parts[:-1]


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its source (``from .x import y``, ``from ..a import
    b`` where ``b`` may itself be a module, ``import tltlib.a.b``); an import of a subpackage is an import of its
    ``__init__``."""
    files = module_files(pkg)
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = _package_of(name, path)
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                elif (node.module or "").split(".")[0] == "tltlib":
                    base = []
                    node = ast.ImportFrom(module=node.module.removeprefix("tltlib").lstrip("."), names=node.names)
                else:
                    continue
                target = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{target}.{a.name}" if target else a.name
                    deps.add(sub if sub in files else target or "__init__")
            elif isinstance(node, ast.Import):
                deps |= {a.name.removeprefix("tltlib.") for a in node.names if a.name.startswith("tltlib.")}
        graph[name] = (deps & set(files)) - {name}
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


def declared_layers(doc: str) -> list[list[str]]:
    """The subpackage layers docs/architecture.md declares, lowest first: the lines ``layer N  name  name ...`` of
    its first code block (``root`` stands for tltlib's top-level modules)."""
    block = doc.split("```")[1]
    return [line.split()[2:] for line in block.splitlines() if re.match(r"\s*layer \d+\s", line)]


def group(module: str) -> str:
    """The subpackage a module belongs to (``root`` for top-level modules)."""
    return module.split(".")[0] if "." in module or (PKG / module).is_dir() else "root"


def upward_imports(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Imports from a subpackage into one on the same or a higher layer (another subpackage), named."""
    level = {g: i for i, names in enumerate(layers) for g in names}
    bad = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            a, b = group(m), group(d)
            if a != b and m not in ("__init__", "__main__") and level.get(b, 99) >= level.get(a, -1):
                bad.append(f"{m} ({a}, layer {level.get(a)}) imports {d} ({b}, layer {level.get(b)})")
    return bad


def long_functions(folder: Path, limit: int) -> list[str]:
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_the_cycle_finder_finds_a_cycle_through_an_import_inside_a_function(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from .p.b import x\n")
    (tmp_path / "p" / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "p" / "c.py").write_text("import tltlib.a\n")
    assert cycle(import_graph(tmp_path)) == ["a", "p.b", "p.c", "a"]
    (tmp_path / "p" / "c.py").write_text("from .. import a as _\n")
    assert cycle(import_graph(tmp_path)) == ["a", "p.b", "p.c", "a"]
    (tmp_path / "p" / "c.py").write_text("import os\n")
    assert cycle(import_graph(tmp_path)) is None


def test_the_layering_check_finds_an_upward_import():
    graph = {"rollout.engine": {"model.decoder", "fileio"}, "model.decoder": {"rollout.engine"}, "fileio": set()}
    layers = [["root"], ["model"], ["rollout"]]
    assert upward_imports(graph, layers) == [
        "model.decoder (model, layer 1) imports rollout.engine (rollout, layer 2)"]


def test_tltlib_has_no_import_cycle():
    assert cycle(import_graph()) is None, f"import cycle: {' -> '.join(cycle(import_graph()))}"


def test_subpackages_import_only_the_layers_below_them():
    layers = declared_layers(DOC.read_text())
    groups = {group(m) for m in module_files() if m not in ("__init__", "__main__")}
    assert groups == {g for names in layers for g in names}, \
        f"docs/architecture.md's layers name {sorted(g for n in layers for g in n)}; the package has {sorted(groups)}"
    bad = upward_imports(import_graph(), layers)
    assert not bad, "imports against the layers of docs/architecture.md:\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", ["tltlib", "bench"])
def test_no_function_over_80_lines(folder):
    assert not long_functions(ROOT / folder, 80), long_functions(ROOT / folder, 80)


def test_modules_stay_readable():
    """A module past ~500 lines holds more than one concept: split it by concern (never squeeze its lines)."""
    big = [f"{p.relative_to(ROOT)} ({n} lines)" for p in module_files().values()
           if (n := len(p.read_text().splitlines())) > 560]
    assert not big, f"split these by concern: {big}"


def test_the_architecture_document_names_every_module():
    doc = DOC.read_text()
    missing = sorted(m for m in module_files() if "." in m and f"`{m}`" not in doc)
    missing += sorted(m for m in module_files() if "." not in m and not m.startswith("_") and f"`{m}`" not in doc)
    assert not missing, f"docs/architecture.md does not describe {missing}"
