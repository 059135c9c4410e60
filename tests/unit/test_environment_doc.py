"""Every environment variable the package reads is on docs/reference/environment.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "environment.md"
_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def _is_environ_read(node: ast.Call) -> bool:
    """``os.environ.get(...)`` or ``os.getenv(...)``."""
    func = node.func
    return isinstance(func, ast.Attribute) and (
        (func.attr == "get" and ast.unparse(func.value) == "os.environ")
        or (func.attr == "getenv" and ast.unparse(func.value) == "os")
    )


def _names_read() -> dict[str, str]:
    """``{variable: file}``: the literal first argument of ``os.environ.get`` /
    ``os.getenv`` / ``os.environ[...]``, click's ``envvar=``, and the value of every
    module-level constant named ``ENV_*`` or ``*_ENV`` (how the package names a variable
    it reads through a constant)."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "kombu_pgmq").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            values: list[ast.expr] = []
            if isinstance(node, ast.Call) and _is_environ_read(node) and node.args:
                values.append(node.args[0])
            if isinstance(node, ast.Call):
                values += [k.value for k in node.keywords if k.arg == "envvar"]
            if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                values.append(node.slice)
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and (
                    target.id.startswith("ENV_") or target.id.endswith("_ENV")
                ):
                    values.append(node.value)
            for value in values:
                text = value.value if isinstance(value, ast.Constant) else None
                if isinstance(text, str) and _NAME.match(text):
                    found.setdefault(text, where)
    return found


def test_every_variable_read_is_documented():
    names = _names_read()
    expected = {
        "KOMBU_PGMQ_URL",
        "KOMBU_PGMQ_EMBEDDED_DIR",
        "KOMBU_PGMQ_METRICS_PASSWORD",
        "KOMBU_PGMQ_SPARK_DIR",
        "KOMBU_PGMQ_SPARK_CONNECT_PORT",
        "KOMBU_PGMQ_SPARK_MASTER",
        "KOMBU_PGMQ_SPARK_CLUSTER_DIR",
        "DATABASE_URL",
        "PGHOST",
        "PGPORT",
        "XDG_DATA_HOME",
        "SPARK_REMOTE",
    }
    assert expected <= set(names)  # the scan finds what it should
    page = PAGE.read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]*)`(?:, `([A-Z][A-Z0-9_]*)`)?", page, re.M))
    rows = {name for pair in documented for name in pair if name}
    missing = {name: where for name, where in names.items() if name not in rows}
    assert not missing, f"read but not on {PAGE.relative_to(ROOT)}: {missing}"
