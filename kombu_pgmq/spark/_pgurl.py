"""Where a PostgreSQL URL connects: the helper both :mod:`kombu_pgmq.spark.datasource`
(on executors) and :mod:`kombu_pgmq.spark.preflight` (on the driver) need, here so that
neither imports the other."""

from __future__ import annotations

import os
from typing import Any

from psycopg.conninfo import conninfo_to_dict

from .. import _conninfo as conninfo

__all__ = ["params", "unix_socket"]


def unix_socket(url: str) -> str | None:
    """The Unix socket file a PostgreSQL URL connects to, or None for TCP.

    Shapes: ``"postgresql://u@/db?host=/run/pg" -> "/run/pg/.s.PGSQL.5432"``;
    ``"postgresql://u@db:5432/db" -> None``. A URL without host uses libpq's default
    socket directory (``/var/run/postgresql``)."""
    found = params(url)
    host = str(found.get("host") or os.environ.get("PGHOST") or "/var/run/postgresql")
    if not host.startswith("/"):
        return None
    port = str(found.get("port") or os.environ.get("PGPORT") or conninfo.DEFAULT_PORT)
    return os.path.join(host.split(",")[0], f".s.PGSQL.{port.split(',')[0]}")


def params(url_or_dsn: str) -> dict[str, Any]:
    """libpq keywords of a broker URL or a DSN (``{"host": ..., "port": ..., ...}``)."""
    return dict(conninfo_to_dict(conninfo.to_dsn(url_or_dsn)))
