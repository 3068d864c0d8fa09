"""dtr's modules import one another without cycles, function-level imports included.

A function-level import that closes a cycle only hides it: the two modules still need
each other, and which one may be imported first depends on who calls what. Every import
of a dtr module counts here, wherever it stands in the file; importing ``a.b.c`` counts as
importing the packages ``a.b`` and ``a`` too (Python runs their ``__init__`` first), except
the importer's own packages, which are already being imported. ``dtr._C`` (the extension)
imports no dtr module. Optional third-party imports are not dtr modules.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests.utils import REPO

ROOT = pathlib.Path(REPO)
EXTENSION = "dtr._C"


def module_name(path: pathlib.Path) -> tuple[str, bool]:
    """(dotted name, whether it is a package's __init__) of a file under ROOT."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def dtr_modules() -> dict[str, tuple[pathlib.Path, bool]]:
    found = {}
    for path in sorted((ROOT / "dtr").rglob("*.py")):
        name, is_package = module_name(path)
        found[name] = (path, is_package)
    return found


def absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module `from ... import` names, relative levels resolved."""
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every dotted name the module imports, at any depth of its code."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = absolute(node, module, is_package)
            names.add(target)
            names.update(f"{target}.{a.name}" for a in node.names)
    return names


def with_packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the dtr modules it imports, from {module: (source, is_package)}."""
    known = set(sources) | {EXTENSION}
    graph = {EXTENSION: set()}
    for module, (source, is_package) in sources.items():
        own = set(with_packages(module)) if is_package else set(with_packages(module)[:-1])
        edges = set()
        for name in imported(ast.parse(source), module, is_package):
            # `from pkg import name` names a module or an attribute: only modules count
            edges.update(m for m in with_packages(name) if m in known and m not in own)
        edges.discard(module)
        graph[module] = edges
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in import order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_every_dtr_import_names_a_dtr_module():
    """A function-level import of a module that is not there fails only when it runs
    (dtr's own, and the tests' and benchmarks' imports of dtr)."""
    modules = dtr_modules()
    known = set(modules) | {EXTENSION}
    missing = []
    for module, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = absolute(node, module, is_package)
                if target.split(".")[0] == "dtr" and target not in known:
                    missing.append(f"{module}:{node.lineno}: {target}")
            elif isinstance(node, ast.Import):
                missing += [
                    f"{module}:{node.lineno}: {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] == "dtr" and a.name not in known
                ]
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            missing += [
                f"{where}:{node.lineno}: {n}"
                for n in names
                if n.split(".")[0] == "dtr" and n not in known
            ]
    assert not missing, "imports of no dtr module:\n" + "\n".join(missing)


def test_dtr_imports_have_no_cycle():
    sources = {m: (p.read_text(), pkg) for m, (p, pkg) in dtr_modules().items()}
    graph = import_graph(sources)
    assert len(graph) > 40, "the graph should cover every dtr module"
    found = cycle(graph)
    assert found is None, "import cycle: " + " -> ".join(found)


@pytest.mark.parametrize(
    "sources, expected",
    [
        # a function-level import closing the cycle still counts
        (
            {
                "dtr": ("", True),
                "dtr.a": ("from . import b", False),
                "dtr.b": ("def f():\n    from .a import g\n", False),
            },
            ["dtr.a", "dtr.b", "dtr.a"],
        ),
        # importing a module runs its package's __init__, which imports back
        (
            {
                "dtr": ("", True),
                "dtr.config": ("def f():\n    from .engines.key import taken\n", False),
                "dtr.engines": ("from .. import config", True),
                "dtr.engines.key": ("", False),
            },
            ["dtr.config", "dtr.engines", "dtr.config"],
        ),
        # absolute imports, and `import a.b` forms
        (
            {
                "dtr": ("", True),
                "dtr.x": ("import dtr.y.z", False),
                "dtr.y": ("", True),
                "dtr.y.z": ("from dtr.x import thing", False),
            },
            ["dtr.x", "dtr.y.z", "dtr.x"],
        ),
    ],
)
def test_cycles_are_found(sources, expected):
    assert cycle(import_graph(sources)) == expected


def test_own_package_and_attributes_are_no_cycle():
    sources = {
        "dtr": ("from .session import enable\nfrom . import _C", True),
        "dtr.session": ("from . import errors\nfrom .errors import DTRError", False),
        "dtr.errors": ("", False),
        "dtr.engines": ("", True),
        "dtr.engines.native": ("from . import key", True),
        "dtr.engines.native.key": ("from ... import errors", False),
    }
    assert cycle(import_graph(sources)) is None
