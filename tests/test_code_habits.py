"""The project's code habits, checked on the source: no function (or method) over 100 lines in src/, bench/ and
scripts/ (decorators excluded, docstring and comments included); no class over 300 lines in the trainer's and the
engine's packages (``agentrl.training``, ``agentrl.inference``: collaborators of their own instead); no package of
``agentrl`` that imports another which imports it back, and no cycle among its modules (imports inside functions
count too)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 300
WIDE_CLASS_PACKAGES = ("src/agentrl/training", "src/agentrl/inference")



def long_functions(root: Path, limit: int) -> dict[str, int]:
    """``path:qualified.name`` -> length in lines of every function longer than ``limit`` under ``root``'s
    src/, bench/ and scripts/."""
    found: dict[str, int] = {}
    for folder in ("src", "bench", "scripts"):
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            _visit(tree, path.relative_to(root).as_posix(), "", limit, found)
    return found


def _visit(node: ast.AST, path: str, prefix: str, limit: int, found: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef) and (lines := child.end_lineno - child.lineno + 1) > limit:
                found[f"{path}:{name}"] = lines
            _visit(child, path, f"{name}.", limit, found)
        else:
            _visit(child, path, prefix, limit, found)


def test_no_function_over_100_lines() -> None:
    too_long = long_functions(ROOT, MAX_FUNCTION_LINES)
    assert not too_long, ("split these functions into smaller ones with one concern each (at most "
                          f"{MAX_FUNCTION_LINES} lines): " + ", ".join(f"{n} ({k} lines)" for n, k in too_long.items()))


def wide_classes(root: Path, limit: int) -> dict[str, int]:
    """``path:Class`` -> length in lines of every top-level class longer than ``limit`` in ``WIDE_CLASS_PACKAGES``."""
    return {f"{path.relative_to(root).as_posix()}:{node.name}": node.end_lineno - node.lineno + 1
            for folder in WIDE_CLASS_PACKAGES for path in sorted((root / folder).glob("*.py"))
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit}


def test_no_class_over_300_lines_in_the_trainer_and_the_engine() -> None:
    wide = wide_classes(ROOT, MAX_CLASS_LINES)
    assert not wide, (f"give these classes collaborators (at most {MAX_CLASS_LINES} lines each): "
                      + ", ".join(f"{n} ({k} lines)" for n, k in wide.items()))


def test_the_check_finds_wide_classes(tmp_path: Path) -> None:
    package = tmp_path / "src" / "agentrl" / "training"
    package.mkdir(parents=True)
    (package / "m.py").write_text("class Fits:\n" + _function("f", 299, "    ") + "\nclass Wide:\n"
                                  + _function("g", 300, "    "))
    assert wide_classes(tmp_path, MAX_CLASS_LINES) == {"src/agentrl/training/m.py:Wide": 301}


def _function(name: str, lines: int, indent: str = "") -> str:
    """Source of a function ``lines`` lines long (its ``def`` line included)."""
    return "\n".join([f"{indent}def {name}():"] + [f"{indent}    x{i} = {i}" for i in range(lines - 1)]) + "\n"


def test_the_check_finds_long_functions(tmp_path: Path) -> None:
    """The walk sees methods and nested functions, and counts lines from ``def`` to the end (limit included)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text(
        _function("fits", 100) + "\nclass C:\n" + _function("method", 101, "    ")
        + "\nasync def outer():\n" + _function("inner", 101, "    "))
    assert long_functions(tmp_path, MAX_FUNCTION_LINES) == {"src/m.py:C.method": 101, "src/m.py:outer": 102,
                                                            "src/m.py:outer.inner": 101}


def module_imports(package_dir: Path) -> dict[str, set[str]]:
    """Module name -> the modules of the same top-level package it imports (anywhere in its code). ``from p import
    name`` counts as importing ``p.name`` when that is a module, else ``p``."""
    top = package_dir.name
    modules = {".".join((top, *path.relative_to(package_dir).with_suffix("").parts)).removesuffix(".__init__"): path
               for path in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                               else node.module for alias in node.names)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def package_cycles(graph: dict[str, set[str]]) -> list[str]:
    """``a <-> b`` for every two packages that import each other, with one import each way."""
    edges: dict[tuple[str, str], str] = {}
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if package_of(module) != package_of(target):
                edges.setdefault((package_of(module), package_of(target)), f"{module} -> {target}")
    return [f"{a} <-> {b} ({edges[a, b]}; {edges[b, a]})" for a, b in edges if a < b and (b, a) in edges]


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    counter = itertools.count()

    def visit(node: str) -> None:
        index[node] = low[node] = next(counter)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            if group:
                found.append(sorted([node, *group]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_package_imports_one_that_imports_it_back() -> None:
    cycles = package_cycles(module_imports(ROOT / "src" / "agentrl"))
    assert not cycles, "move what both packages need down into a package below both: " + "; ".join(cycles)


def test_no_module_cycles() -> None:
    cycles = module_cycles(module_imports(ROOT / "src" / "agentrl"))
    assert not cycles, f"modules that import each other (directly or around a loop): {cycles}"


def test_the_cycle_checks_find_cycles(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    for folder, files in {"a": {"x": "from pkg.b.y import f", "z": ""}, "b": {"y": "def f():\n    import pkg.a.z"},
                          "c": {"p": "from pkg.c import q", "q": "from pkg.c.p import g"}}.items():
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
        for name, source in files.items():
            (package / folder / f"{name}.py").write_text(source + "\n")
    (package / "__init__.py").write_text("")
    graph = module_imports(package)
    assert package_cycles(graph) == ["pkg.a <-> pkg.b (pkg.a.x -> pkg.b.y; pkg.b.y -> pkg.a.z)"]
    assert module_cycles(graph) == [["pkg.c.p", "pkg.c.q"]]
