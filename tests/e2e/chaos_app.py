"""Celery app of the fault-injection runs (:mod:`tests.e2e.chaos`), configured from the
environment, the same for every broker (ours, Redis, RabbitMQ).

No result backend: each execution of ``chaos.work(n)`` appends one line
``n,pid,task_id,time`` (``time.time()`` when the body ended; ``benchmarks/ack_window.py``
measures from it) to a file (one ``write`` on an ``O_APPEND`` descriptor opened after the
fork, so lines of concurrent pool processes never interleave, and a line written survives
the kill of its process and a crash of the database). A line means "the task body ran to
its end"; a task killed before it wrote its line did not run (its message is delivered
again).

Environment
    ``KPT_CHAOS_BROKER`` broker URL; ``KPT_CHAOS_OPTIONS`` transport options (JSON);
    ``KPT_CHAOS_LOG`` the executions file; ``KPT_CHAOS_TASK_MS`` how long a task works
    (ms, default 0); ``KPT_CHAOS_QUEUE`` the task queue (default ``chaos``).

Settings: ``task_acks_late`` and ``task_reject_on_worker_lost`` (a message is acked only
after its task ran; a pool process that dies requeues its message), a connection retried
without limit (the workers outlive a database restart).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

import kombu_pgmq  # noqa: F401  (registers postgresql:// with kombu)

_fd: int | None = None
_fd_pid: int | None = None


def record(path: str, line: str) -> None:
    """Append ``line`` to ``path`` with one ``write`` (one descriptor per process)."""
    global _fd, _fd_pid
    if _fd is None or _fd_pid != os.getpid():
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd_pid = os.getpid()
    os.write(_fd, f"{line}\n".encode())


def create_app(env: Any = os.environ) -> Celery:
    app = Celery("chaos", broker=env.get("KPT_CHAOS_BROKER", "memory://"), set_as_current=False)
    app.conf.update(
        broker_transport_options=json.loads(env.get("KPT_CHAOS_OPTIONS") or "{}"),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_default_queue=env.get("KPT_CHAOS_QUEUE", "chaos"),
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        result_backend=None,
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

    @app.task(name="chaos.ping", shared=False)
    def ping(token: str) -> None:
        record(log, f"ping:{token},{os.getpid()}")

    return app


app = create_app()
