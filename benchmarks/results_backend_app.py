"""Celery app of ``results_backend.py``, configured from environment variables.

The worker subprocess loads it with ``celery -A results_backend_app worker`` (cwd
``benchmarks/``); the benchmark process builds its own instance per result backend with
:func:`create_app`.

Environment
    ``RESULTS_BENCH_BROKER``: broker URL (kombu_pgmq's ``postgresql://...``).
    ``RESULTS_BENCH_BACKEND``: result backend URL (``postgresql://``, ``redis://``,
    ``db+postgresql+psycopg://``...).

Tasks
    ``rb.add(x, y)``: ``x + y``.
    ``rb.tsum(values)``: ``sum(values)`` (a chord's callback).
"""

from __future__ import annotations

import os

from celery import Celery

import kombu_pgmq  # noqa: F401  (registers postgresql:// with kombu)

QUEUE = "results_bench"


def create_app(broker_url: str, backend_url: str) -> Celery:
    app = Celery("results_bench", broker=broker_url, backend=backend_url, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        task_default_queue=QUEUE,
        worker_hijack_root_logger=False,
        # Celery's database backend: create its tables on first use
        database_create_tables_at_setup=True,
    )

    @app.task(name="rb.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="rb.tsum", shared=False)
    def tsum(values: list[int]) -> int:
        return sum(values)

    return app


app = create_app(
    os.environ.get("RESULTS_BENCH_BROKER", "memory://"),
    os.environ.get("RESULTS_BENCH_BACKEND", "cache+memory://"),
)
