"""Celery app of ``celery_bench.py``, configured from environment variables.

The worker subprocess loads it with ``celery -A celery_bench_app worker`` (cwd
``benchmarks/``); the benchmark process builds its own instance per broker with
:func:`create_app`.

Environment
    ``CELERY_BENCH_BROKER``: broker URL (``postgresql://``, ``pgmq://``, ``redis://``,
    ``amqp://``...).
    ``CELERY_BENCH_TRANSPORT_OPTIONS``: JSON object of broker transport options (optional).
    ``CELERY_BENCH_LOG``: file where every task appends one line ``kind,value,ts`` (``ts``
    = ``time.time()`` when the task body runs). The file is opened with ``O_APPEND`` and
    each line is one ``write``, so lines of the pool processes never interleave; the same
    mechanism for every broker, and no result backend.
    ``CELERY_BENCH_RESULT_BACKEND`` (optional, ``connection_budget.py``): a result backend
    URL (tasks then store their results). ``CELERY_BENCH_BEAT`` (optional): beat runs
    kombu_pgmq's scheduler with one entry, ``bench.noop(-1)`` every second.

Tasks
    ``bench.ping()``: line ``ping,0,<start>`` (warm-up; marks the worker ready).
    ``bench.latency(sent_ts)``: line ``lat,<sent_ts>,<start>``.
    ``bench.noop(i)``: line ``noop,<i>,<done>`` (written when the task body ends).

Signal
    ``task_received`` of a ``bench.latency`` task, in the worker's main process (the
    message decoded, the request made, before it goes to the pool): line
    ``rx,<sent_ts>,<now>``. ``celery_bench.py`` splits each latency sample there.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery
from celery.signals import task_received

import kombu_pgmq  # noqa: F401  (registers postgresql:// with kombu)

QUEUE = "celery_bench"

_fd: int | None = None
_fd_pid: int | None = None


def _record(kind: str, value: Any, ts: float) -> None:
    """Append one line to ``$CELERY_BENCH_LOG`` (one ``write`` on an ``O_APPEND`` fd)."""
    global _fd, _fd_pid
    pid = os.getpid()
    if _fd is None or _fd_pid != pid:  # one fd per pool process, opened after the fork
        _fd = os.open(os.environ["CELERY_BENCH_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        _fd_pid = pid
    os.write(_fd, f"{kind},{value},{ts!r}\n".encode())


def create_app(broker_url: str, transport_options: dict[str, Any] | None = None) -> Celery:
    app = Celery("celery_bench", broker=broker_url, set_as_current=False)
    app.conf.update(
        broker_transport_options=transport_options or {},
        broker_connection_retry_on_startup=True,
        task_default_queue=QUEUE,
        task_ignore_result=True,
        result_backend=None,
        worker_hijack_root_logger=False,
    )
    if os.environ.get("CELERY_BENCH_RESULT_BACKEND"):
        app.conf.result_backend = os.environ["CELERY_BENCH_RESULT_BACKEND"]
        app.conf.task_ignore_result = False
    if os.environ.get("CELERY_BENCH_BEAT"):
        app.conf.beat_scheduler = "kombu_pgmq.beat:Scheduler"
        app.conf.beat_schedule = {
            "bench-noop": {"task": "bench.noop", "schedule": 1.0, "args": [-1]}
        }

    @app.task(name="bench.ping", shared=False)
    def ping() -> None:
        _record("ping", 0, time.time())

    @app.task(name="bench.latency", shared=False)
    def latency(sent_ts: float) -> None:
        _record("lat", repr(sent_ts), time.time())

    @app.task(name="bench.noop", shared=False)
    def noop(i: int) -> None:
        _record("noop", i, time.time())

    return app


@task_received.connect
def _on_received(request: Any = None, **_: Any) -> None:
    """``rx,<sent_ts>,<now>`` for a latency task received by the worker's main process."""
    if request is not None and request.name == "bench.latency":
        _record("rx", repr(request.args[0]), time.time())


app = create_app(
    os.environ.get("CELERY_BENCH_BROKER", "memory://"),
    json.loads(os.environ.get("CELERY_BENCH_TRANSPORT_OPTIONS") or "{}"),
)
