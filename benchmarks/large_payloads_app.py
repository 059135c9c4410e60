"""Celery app of ``large_payloads.py``, configured from environment variables.

The worker subprocess loads it with ``celery -A large_payloads_app worker`` (cwd
``benchmarks/``); the benchmark process builds its own instance per target with
:func:`create_app`.

Environment
    ``LARGE_BENCH_BROKER``: broker URL (``postgresql://...``, ``redis://...``).
    ``LARGE_BENCH_BACKEND``: result backend URL (``postgresql://``: the broker's
    database; ``redis://...``).
    ``LARGE_BENCH_LOG``: file where the worker appends one line ``kind,task_id,ts`` per
    event (``ts`` = ``time.time()``; ``O_APPEND``, one ``write`` per line).

Task
    ``lp.echo(data)``: returns ``data``. Lines ``start`` (the task body starts) and
    ``return`` (the task body ends: Celery then encodes and stores the result).

Signal
    ``task_success`` (sent by Celery once the result is stored, in the pool process): line
    ``stored``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery.signals import task_success

import kombu_pgmq  # noqa: F401  (registers postgresql:// with kombu)

QUEUE = "large_payloads"

_fd: int | None = None
_fd_pid: int | None = None


def _record(kind: str, task_id: str, ts: float) -> None:
    """Append one line to ``$LARGE_BENCH_LOG`` (one ``write`` on an ``O_APPEND`` fd)."""
    global _fd, _fd_pid
    pid = os.getpid()
    if _fd is None or _fd_pid != pid:  # one fd per pool process, opened after the fork
        _fd = os.open(os.environ["LARGE_BENCH_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        _fd_pid = pid
    os.write(_fd, f"{kind},{task_id},{ts!r}\n".encode())


def create_app(broker_url: str, backend_url: str) -> Celery:
    app = Celery("large_payloads", broker=broker_url, backend=backend_url, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        task_default_queue=QUEUE,
        task_serializer="json",
        result_serializer="json",
        result_expires=3600,
        worker_hijack_root_logger=False,
    )

    @app.task(name="lp.echo", bind=True, shared=False)
    def echo(self: Any, data: Any) -> Any:
        _record("start", self.request.id, time.time())
        _record("return", self.request.id, time.time())
        return data

    return app


@task_success.connect
def _stored(sender: Any = None, **kwargs: Any) -> None:
    if sender is not None and sender.name == "lp.echo" and "LARGE_BENCH_LOG" in os.environ:
        _record("stored", sender.request.id, time.time())


app = create_app(
    os.environ.get("LARGE_BENCH_BROKER", "memory://"),
    os.environ.get("LARGE_BENCH_BACKEND", "cache+memory://"),
)
