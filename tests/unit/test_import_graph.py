"""No import cycles in ``kombu_pgmq``: the import graph, built from the source with
:mod:`ast` (nothing is imported), has no strongly connected component.

Edges: every ``import``/``from ... import`` anywhere in a module (module level, functions,
methods, ``try`` blocks), relative imports resolved; ``from pkg import name`` is an import
of ``pkg.name`` when that is a module, else of ``pkg``; imports under
``if TYPE_CHECKING:`` are left out (never run). A package importing its own submodules
(``from . import x`` in ``__init__.py``) counts; a submodule's implicit import of its
parent package does not (Python runs it first, it cannot close a cycle on its own).
Only modules of ``kombu_pgmq`` are nodes.

Library code must never import :mod:`kombu_pgmq.cli`; a cycle through it (the old
``python -m kombu_pgmq.schema`` aliases) shows up here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kombu_pgmq"


def modules(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under package ``root``
    (a package is named by its ``__init__.py``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` (any module prefix)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree`` outside the body of ``if TYPE_CHECKING:`` (its
    ``else:`` runs, so it counts)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` for package directory ``root``."""
    mods = modules(root)
    top = root.name

    def resolve(name: str) -> str | None:
        """The module ``name`` is, or the innermost module holding it (``pkg.attr``)."""
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [
                    f"{module}.{alias.name}" if f"{module}.{alias.name}" in mods else module
                    for alias in node.names
                ]
            for target in targets:
                if target == top or target.startswith(top + "."):
                    resolved = resolve(target)
                    if resolved is not None and resolved != name:
                        deps.add(resolved)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), each
    sorted; in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through ``component``'s first module, e.g. ``[a, b, a]`` (breadth
    first: a shortest one)."""
    first = component[0]
    members = set(component)
    paths = {first: [first]}
    queue = [first]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & members):
            if child == first:
                return [*paths[node], first]
            if child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    raise AssertionError(f"{component} is not a cycle")  # pragma: no cover


def test_kombu_pgmq_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    assert "kombu_pgmq.cli" in graph and "kombu_pgmq.cli._base" in graph["kombu_pgmq.cli"]
    found = cycles(graph)
    assert not found, "import cycles in kombu_pgmq (break them):\n" + "\n".join(
        " -> ".join(cycle_path(graph, c)) for c in found
    )


def test_library_modules_never_import_the_cli() -> None:
    graph = import_graph(PACKAGE)
    importers = sorted(
        name
        for name, deps in graph.items()
        if not name.startswith(("kombu_pgmq.cli", "kombu_pgmq.__main__"))
        and any(d == "kombu_pgmq.cli" or d.startswith("kombu_pgmq.cli.") for d in deps)
    )
    assert not importers, f"library modules import the CLI (kombu_pgmq.cli): {importers}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_graph_follows_the_rules(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from . import sub\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/a.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg import c\nelse:\n    import os\n"
                "def f():\n    from .. import b\n    from ..b import helper\n"
            ),
            "pkg/b.py": "import pkg.sub.a\nfrom pkg.sub import a as again\n",
            "pkg/c.py": "from pkg.b import something\nimport json\n",
        },
    )
    graph = import_graph(package)
    assert graph == {
        "pkg": {"pkg.sub"},
        "pkg.sub": set(),
        "pkg.sub.a": {"pkg.b"},  # in a function; not c (TYPE_CHECKING only)
        "pkg.b": {"pkg.sub.a"},  # not pkg.sub: a submodule's parent is implied
        "pkg.c": {"pkg.b"},  # pkg.b.something is a name, not a module
    }
    assert cycles(graph) == [["pkg.b", "pkg.sub.a"]]
    assert cycle_path(graph, ["pkg.b", "pkg.sub.a"]) == ["pkg.b", "pkg.sub.a", "pkg.b"]


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        ("from . import b", {"pkg.b"}),
        ("from .b import x", {"pkg.b"}),
        ("from . import x", {"pkg"}),  # a name of the package
        ("import pkg", {"pkg"}),  # explicit, so it counts
        ("import os.path", set()),
    ],
)
def test_imports_resolve(tmp_path: Path, statement: str, expected: set[str]) -> None:
    package = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": statement, "pkg/b.py": ""})
    assert import_graph(package)["pkg.a"] == expected
