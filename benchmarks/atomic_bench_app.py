"""Celery app of ``atomic_bench.py``, configured from environment variables.

The worker subprocess loads it with ``celery -A atomic_bench_app worker`` (cwd
``benchmarks/``); the benchmark process builds its own instance with :func:`create_app`.

Environment
    ``ATOMIC_BENCH_BROKER``: broker URL (kombu_pgmq's ``postgresql://...``). The result
    backend is kombu_pgmq's in the same database (``postgresql://``).
    ``ATOMIC_BENCH_RESULTS``: ``1`` (default) tasks store their results, ``0``
    ``task_ignore_result=True`` (no result written by either kind).

Table ``atomic_bench_rows`` (:data:`ROWS_DDL`, created by ``atomic_bench.py``): one row
per task run, ``kind``, ``i``, the pool process's pid and ``done_at`` (the server's
``clock_timestamp()`` when the row was inserted).

Tasks (queue ``atomic_bench``)
    ``ab.ping()``: row ``('ping', 0)`` on the pool process's own connection, no result
    (the worker is ready).
    ``ab.plain(i)``: ``acks_late=True``; row ``('plain', i)`` inserted on the pool
    process's own psycopg connection (one per process, opened at its first task,
    autocommit: the INSERT is its own transaction); returns ``i``. Its result is stored
    by Celery after the body, its message acked by the worker's main process.
    ``ab.atomic(i)``: ``base=kombu_pgmq.AtomicTask``; the same INSERT through
    ``self.db``, so the row, the result and the ack commit in one transaction; returns
    ``i``.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from brokers import pg_dsn
from celery import Celery

import kombu_pgmq  # noqa: F401  (registers postgresql:// with kombu)
from kombu_pgmq import AtomicTask

QUEUE = "atomic_bench"

#: One row per task run (``done_at``: the server's clock at the INSERT).
ROWS_DDL = """
CREATE TABLE IF NOT EXISTS atomic_bench_rows (
    id bigserial PRIMARY KEY,
    kind text NOT NULL,
    i int NOT NULL,
    pid int NOT NULL,
    done_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

INSERT = "INSERT INTO atomic_bench_rows (kind, i, pid) VALUES (%s, %s, %s)"

_conn: psycopg.Connection[Any] | None = None
_conn_pid: int | None = None


def own_connection(url: str) -> psycopg.Connection[Any]:
    """This pool process's autocommit connection (opened after the fork, at its first
    task)."""
    global _conn, _conn_pid
    pid = os.getpid()
    if _conn is None or _conn_pid != pid or _conn.closed:
        _conn = psycopg.connect(pg_dsn(url) or url, autocommit=True)
        _conn_pid = pid
    return _conn


def create_app(broker_url: str, results: bool = True) -> Celery:
    app = Celery("atomic_bench", broker=broker_url, backend="postgresql://", set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        task_default_queue=QUEUE,
        task_ignore_result=not results,
        worker_hijack_root_logger=False,
    )

    @app.task(name="ab.ping", shared=False, ignore_result=True)
    def ping() -> None:
        own_connection(broker_url).execute(INSERT, ("ping", 0, os.getpid()))

    @app.task(name="ab.plain", shared=False, acks_late=True)
    def plain(i: int) -> int:
        own_connection(broker_url).execute(INSERT, ("plain", i, os.getpid()))
        return i

    @app.task(name="ab.atomic", shared=False, base=AtomicTask, bind=True)
    def atomic(self: Any, i: int) -> int:
        self.db.execute(INSERT, ("atomic", i, os.getpid()))
        return i

    return app


app = create_app(
    os.environ.get("ATOMIC_BENCH_BROKER", "memory://"),
    os.environ.get("ATOMIC_BENCH_RESULTS", "1") != "0",
)
