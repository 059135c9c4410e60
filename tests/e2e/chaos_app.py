"""Celery app of the fault-injection runs (:mod:`tests.e2e.chaos`), configured from the
environment, the same for every broker (ours, Redis, RabbitMQ).

Each execution of ``chaos.work(n)``, ``chaos.count(n)`` or ``chaos.count_plain(n)``
appends one line ``n,pid,task_id,time`` (``time.time()`` when the body ended;
``benchmarks/ack_window.py`` measures from it) to a file (one ``write`` on an
``O_APPEND`` descriptor opened after the fork, so lines of concurrent pool processes
never interleave, and a line written survives the kill of its process and a crash of the
database). A line means "the task body ran to its end"; a task killed before it wrote
its line did not run (its message is delivered again).

``chaos.work(n)`` writes nothing else. The counting tasks (kombu_pgmq broker only) each add
1 to the one row of ``chaos_counter`` and insert ``n`` into ``chaos_applied`` (one row per
applied run: a task applied twice has two rows; :data:`COUNT_DDL`):

* ``chaos.count`` -- a :class:`kombu_pgmq.AtomicTask`: both writes, its result and the ack
  of its message commit in one transaction (``self.db``); its line is written when the
  body ends, before that commit (a line is an attempt, not an applied run).
* ``chaos.count_plain`` -- a plain ``acks_late`` task: both writes commit in one
  transaction on the process's own connection, then the worker acks (a kill between the
  two applies the task again on redelivery). A lost connection (a server restart) closes
  it and requeues the message (``Reject(requeue=True)``), as ``chaos.count`` does.

Environment
    ``KPT_CHAOS_BROKER`` broker URL; ``KPT_CHAOS_OPTIONS`` transport options (JSON);
    ``KPT_CHAOS_LOG`` the executions file; ``KPT_CHAOS_TASK_MS`` how long a task works
    (ms, default 0); ``KPT_CHAOS_QUEUE`` the task queue (default ``chaos``);
    ``KPT_CHAOS_RESULTS`` ``postgresql``: kombu_pgmq's result backend in the broker's
    database (``result_backend = "postgresql://"``), results stored; unset: no result
    backend, results ignored.

Settings: ``task_acks_late`` and ``task_reject_on_worker_lost`` (a message is acked only
after its task ran; a pool process that dies requeues its message), a connection retried
without limit (the workers outlive a database restart).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import psycopg
from celery import Celery
from celery.exceptions import Reject

import kombu_pgmq  # noqa: F401  (registers postgresql:// with kombu)
from kombu_pgmq import AtomicTask

#: Tables the counting tasks write (created, and emptied, by :func:`tests.e2e.chaos.run`).
COUNT_DDL = """
CREATE TABLE IF NOT EXISTS chaos_counter (id int PRIMARY KEY, n bigint NOT NULL);
CREATE TABLE IF NOT EXISTS chaos_applied (
    n bigint NOT NULL,
    pid int NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
TRUNCATE chaos_counter, chaos_applied;
INSERT INTO chaos_counter (id, n) VALUES (1, 0);
"""
COUNT_SQL = "UPDATE chaos_counter SET n = n + 1 WHERE id = 1"
APPLIED_SQL = "INSERT INTO chaos_applied (n, pid) VALUES (%s, %s)"

_fd: int | None = None
_fd_pid: int | None = None


def record(path: str, line: str) -> None:
    """Append ``line`` to ``path`` with one ``write`` (one descriptor per process)."""
    global _fd, _fd_pid
    if _fd is None or _fd_pid != os.getpid():
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd_pid = os.getpid()
    os.write(_fd, f"{line}\n".encode())


_plain: psycopg.Connection[Any] | None = None


def plain_connection(url: str) -> psycopg.Connection[Any]:
    """This process's autocommit connection for ``chaos.count_plain`` (made again after a
    loss or a fork)."""
    global _plain
    if _plain is None or _plain.closed or _plain.broken:
        _plain = psycopg.connect(url, autocommit=True)
    return _plain


def create_app(env: Any = os.environ) -> Celery:
    broker = env.get("KPT_CHAOS_BROKER", "memory://")
    results = env.get("KPT_CHAOS_RESULTS") == "postgresql"
    app = Celery("chaos", broker=broker, set_as_current=False)
    app.conf.update(
        broker_transport_options=json.loads(env.get("KPT_CHAOS_OPTIONS") or "{}"),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_default_queue=env.get("KPT_CHAOS_QUEUE", "chaos"),
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=not results,
        result_backend="postgresql://" if results else None,
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    log = env.get("KPT_CHAOS_LOG", os.devnull)
    work_s = float(env.get("KPT_CHAOS_TASK_MS") or 0) / 1000

    @app.task(name="chaos.work", shared=False, bind=True)
    def work(self: Any, n: int) -> None:
        if work_s:
            time.sleep(work_s)
        record(log, f"{n},{os.getpid()},{self.request.id},{time.time():.6f}")

    def line(task: Any, n: int) -> None:
        record(log, f"{n},{os.getpid()},{task.request.id},{time.time():.6f}")

    @app.task(name="chaos.count", shared=False, base=AtomicTask, bind=True)
    def count(self: Any, n: int) -> int:
        if work_s:
            time.sleep(work_s)
        self.db.execute(COUNT_SQL)
        self.db.execute(APPLIED_SQL, (n, os.getpid()))
        line(self, n)
        return n

    @app.task(name="chaos.count_plain", shared=False, bind=True)
    def count_plain(self: Any, n: int) -> int:
        if work_s:
            time.sleep(work_s)
        try:
            conn = plain_connection(broker)
            with conn.transaction():
                conn.execute(COUNT_SQL)
                conn.execute(APPLIED_SQL, (n, os.getpid()))
        except psycopg.OperationalError as exc:
            if _plain is not None:
                _plain.close()
            raise Reject(exc, requeue=True) from exc
        line(self, n)
        return n

    @app.task(name="chaos.ping", shared=False)
    def ping(token: str) -> None:
        record(log, f"ping:{token},{os.getpid()}")

    return app


app = create_app()
