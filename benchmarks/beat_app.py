"""The Celery app of ``beat_takeover.py``: broker and schedule in ``$BEAT_BENCH_URL``,
one entry every second (task ``beat_bench.noop``, never consumed: the queue is purged)."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("beat_bench", broker=os.environ.get("BEAT_BENCH_URL", "postgresql://"))
app.conf.beat_scheduler = "kombu_pgmq.beat:Scheduler"
app.conf.beat_schedule = {"every-second": {"task": "beat_bench.noop", "schedule": 1.0}}
if os.environ.get("BEAT_BENCH_TAKEOVER"):
    app.conf.beat_takeover_seconds = float(os.environ["BEAT_BENCH_TAKEOVER"])


@app.task(name="beat_bench.noop")
def noop() -> None:
    return None
