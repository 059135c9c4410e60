"""Brokers compared by the benchmarks, and helpers to prepare their databases.

* ``kombu_pgmq``   ``postgresql://postgres@127.0.0.1:5432/kpb_ours`` (this project)
* ``redis``        ``redis://127.0.0.1:6379/0``
* ``rabbitmq``     ``amqp://guest:guest@127.0.0.1:5672//``
* ``kombu57_pgmq`` ``pgmq://postgres@127.0.0.1:5432/kpb_kombu57``: kombu 5.7's built-in
  ``pgmq`` transport, transport option ``init_extension=False`` on an SQL-only PGMQ
  install (``pgmq.install.install_pgmq_from_sql``, run once if ``pgmq.meta`` is missing).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

REPO_ROOT = Path(__file__).resolve().parent.parent

DEFAULT_BROKERS = {
    "kombu_pgmq": "postgresql://postgres@127.0.0.1:5432/kpb_ours",
    "redis": "redis://127.0.0.1:6379/0",
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672//",
    "kombu57_pgmq": "pgmq://postgres@127.0.0.1:5432/kpb_kombu57",
}
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {"kombu57_pgmq": {"init_extension": False}}


def pg_dsn(url: str) -> str | None:
    """psycopg URL of a ``postgresql://`` / ``pgmq://`` broker URL, else ``None``."""
    parts = urlsplit(url)
    if parts.scheme in ("postgresql", "postgres", "pgmq"):
        return urlunsplit(parts._replace(scheme="postgresql"))
    return None


def ensure_database(dsn: str) -> None:
    parts = urlsplit(dsn)
    dbname = parts.path.lstrip("/") or "postgres"
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{dbname}"')


def ensure_sql_pgmq(dsn: str) -> None:
    """SQL-only PGMQ install (no extension) if ``pgmq.meta`` is missing."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        present = conn.execute("SELECT to_regclass('pgmq.meta')").fetchone()[0]
    if present is None:
        from pgmq.install import install_pgmq_from_sql

        install_pgmq_from_sql(dsn=dsn)


def pg_version(dsn: str) -> str | None:
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            return conn.execute("SHOW server_version").fetchone()[0]
    except Exception as exc:  # environment info only
        return f"error: {exc}"


def dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_describe() -> str | None:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def prepare(url: str, options: dict[str, Any]) -> None:
    """Create the PostgreSQL database of ``url`` if missing; for kombu 5.7's ``pgmq://``
    without ``init_extension``, install PGMQ's SQL there first."""
    dsn = pg_dsn(url)
    if dsn is None:
        return
    ensure_database(dsn)
    if urlsplit(url).scheme == "pgmq" and not options.get("init_extension", True):
        ensure_sql_pgmq(dsn)


# -- pg_stat_statements (profile_worker.py, scale.py) -------------------------------------

_TOP_STATEMENTS = """
SELECT calls, total_exec_time, mean_exec_time, rows,
       regexp_replace(left(query, 110), '\\s+', ' ', 'g') AS query
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY total_exec_time DESC LIMIT %s
"""


def reset_statement_stats(dsn: str) -> None:
    """Create pg_stat_statements in the database if missing and reset it (the server must
    load it: ``shared_preload_libraries``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute("SELECT pg_stat_statements_reset()")


def top_statements(dsn: str, limit: int) -> list[dict[str, Any]]:
    """The database's statements by total execution time since the last reset: calls,
    total and mean ms, rows, rows per call and the start of the text."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(_TOP_STATEMENTS, (limit,)).fetchall()
    return [
        {
            "calls": calls,
            "total_ms": round(total, 1),
            "mean_ms": round(mean, 3),
            "rows": n,
            "rows_per_call": round(n / calls, 2) if calls else None,
            "query": query,
        }
        for calls, total, mean, n, query in rows
    ]
