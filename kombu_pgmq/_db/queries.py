"""Named SQL statements loaded from ``sql/queries/*.sql`` (one file per area; their
conventions: ``sql/queries/README.md``), the current schema ``sql/schema.sql`` (what a
new install runs) and the migrations ``sql/migrations/`` (what upgrades an install of an
earlier release).

In a source checkout the files live in the top-level ``sql/`` directory; in an installed
wheel they are shipped as ``kombu_pgmq/sql/`` (hatch ``force-include``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import NamedTuple

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_MIGRATION = re.compile(r"^(\d{4})_(\w+)\.sql$")


def sql_dir() -> Path:
    """Return the directory holding ``queries/``, ``schema.sql`` and ``migrations/``."""
    package = Path(__file__).resolve().parent.parent  # kombu_pgmq/
    for candidate in (package / "sql", package.parent / "sql"):
        if (candidate / "schema.sql").is_file() and (candidate / "queries").is_dir():
            return candidate
    raise FileNotFoundError(
        f"kombu_pgmq's SQL files are missing (looked in {package / 'sql'} and "
        f"{package.parent / 'sql'}): reinstall the package"
    )


@cache
def queries() -> dict[str, str]:
    """Return ``{name: statement}`` for every ``-- name: <name>`` block of the files
    ``sql/queries/*.sql`` (comment lines left out).

    Raises:
        RuntimeError: a name is defined twice (in one file or in two).
    """
    return parse_queries(sorted((sql_dir() / "queries").glob("*.sql")))


def parse_queries(paths: Iterable[Path]) -> dict[str, str]:
    """Return ``{name: statement}`` for every named block of the files ``paths``.

    Raises:
        RuntimeError: a name is defined twice (in one file or in two).
    """
    result: dict[str, str] = {}
    where: dict[str, Path] = {}
    for path in paths:
        parts = _NAME.split(path.read_text(encoding="utf-8"))
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in where:
                raise RuntimeError(
                    f"statement {name!r} is defined twice: in {where[name]} and in {path}"
                )
            lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
            result[name] = "\n".join(lines).strip()
            where[name] = path
    return result


@cache
def current_schema() -> str:
    """Return ``sql/schema.sql``: the schema as the latest migration leaves it, one script
    that installs it on a database with PGMQ and without kombu_pgmq."""
    return (sql_dir() / "schema.sql").read_text(encoding="utf-8")


class Migration(NamedTuple):
    version: int
    name: str
    sql: str


@cache
def migrations() -> tuple[Migration, ...]:
    """Return the migrations in ``sql/migrations`` (``NNNN_name.sql``) in version order."""
    found = []
    for path in sorted((sql_dir() / "migrations").iterdir()):
        match = _MIGRATION.match(path.name)
        if match:
            found.append(Migration(int(match[1]), match[2], path.read_text(encoding="utf-8")))
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..N without gaps, found {versions}")
    return tuple(found)
