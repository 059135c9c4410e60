"""The examples' Celery app: PostgreSQL is both the broker (PGMQ queues) and the result store.

Broker URL: ``$KOMBU_PGMQ_URL``, else ``$DATABASE_URL``, else an embedded PostgreSQL that
``kombu_pgmq`` starts on first use (see :func:`kombu_pgmq.default_broker_url`).

Run a worker from the repository root (``-B``: with Celery beat, its schedule and leader
election in PostgreSQL)::

    celery -A examples.celeryapp worker -B --pool prefork --concurrency 2 --loglevel info
"""

from __future__ import annotations

from celery import Celery
from celery.schedules import schedule

import kombu_pgmq  # registers postgresql:// and postgres:// with kombu

#: Queue of the example tasks: a name of its own, so that other Celery apps sharing the
#: database (and Celery's default queue ``celery``) never take or hand over its messages.
QUEUE = "examples"


broker_url = kombu_pgmq.default_broker_url()

app = Celery("examples", include=["examples.tasks", "examples.pipeline"])
app.conf.update(
    broker_url=broker_url,
    # kombu_pgmq's result backend in the same database (chords counted in SQL, get()
    # woken by LISTEN/NOTIFY): the one line is result_backend = "postgresql://...".
    result_backend=broker_url,
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    # Ack after the task ran: a task whose worker dies is delivered again, not lost.
    task_acks_late=True,
    # Each process reserves one message at a time: a long task (Spark) does not sit on
    # messages that another process could run now.
    worker_prefetch_multiplier=1,
    # Store name, args, kwargs and worker in the result row, and report STARTED.
    result_extended=True,
    task_track_started=True,
    # Results are rows of kombu_pgmq.results; expire them after a day (the worker
    # deletes expired rows itself, no celery beat needed).
    result_expires=86400,
    # Celery beat on PostgreSQL: the schedule in kombu_pgmq.beat_entries, one leader among
    # any number of beats (`worker -B` on every worker is fine), each tick sent once.
    beat_scheduler="kombu_pgmq.beat:Scheduler",
    beat_schedule={
        "examples-every-2s": {
            "task": "examples.tasks.add",
            "schedule": schedule(2.0),
            "args": (40, 2),
            "options": {"expires": 60},
        },
    },
    # Fleet-wide limits, enforced in the read of every worker (kombu_pgmq.limits): the
    # example tasks keyed x-limit-key (apply_async(headers=...)) start at most 20 a second
    # per key, however many workers run; tasks without the header are not limited.
    broker_transport_options={"queue_limits": {QUEUE: {"key_rate": "20/s", "key_burst": 1}}},
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
)
