"""Failover with a real Celery worker: a primary and a synchronous
streaming standby made by the test (``initdb``, ``pg_basebackup``, ``pg_ctl``); the
worker and the producer use kombu's failover list ``url_standby;url_primary`` (the
standby first: a connection must never settle on the read-only server). Tasks run, the
primary is stopped hard (``pg_ctl stop -m immediate``) and the standby promoted: the
same worker process continues on the new primary and every task whose publish returned
runs. (With asynchronous replication the last commits before the crash can be missing on
the standby: ``benchmarks/failover_loss.py`` measures it.)
"""

from __future__ import annotations

import json
import os

from tests.e2e import chaos_app
from tests.e2e.chaos import executions
from tests.e2e.helpers import REPO_ROOT, Worker, wait_for
from tests.support import pgserver


def test_celery_worker_continues_on_the_promoted_standby(primary_and_standby, tmp_path):
    primary, standby = primary_and_standby
    log = tmp_path / "executions.log"
    failover_list = f"{pgserver.socket_url(standby)};{pgserver.socket_url(primary)}"  # kombu's
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_")}
    env.update(
        KPT_CHAOS_BROKER=failover_list,
        KPT_CHAOS_OPTIONS=json.dumps({"visibility_timeout": 10}),
        KPT_CHAOS_LOG=str(log),
        KPT_CHAOS_TASK_MS="20",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    )
    app = chaos_app.create_app(env)
    work = app.tasks["chaos.work"]
    retry_policy = {"max_retries": 60, "interval_start": 0.2, "interval_step": 0.2}
    worker = Worker(
        "failover",
        env,
        tmp_path / "worker.log",
        app_module="tests.e2e.chaos_app",
        queues=("chaos",),
        own_queue=False,
    )
    published: list[int] = []
    try:
        worker.start()
        for n in range(50):
            work.apply_async((n,), retry=True, retry_policy=retry_policy)
            published.append(n)
        wait_for(lambda: len(set(executions(log))) >= 20, 90, "the worker to run 20 tasks")

        primary.crash()  # the primary dies mid-run...
        pgserver.promote(standby)  # ...and the standby takes over
        for n in range(50, 100):
            work.apply_async((n,), retry=True, retry_policy=retry_policy)
            published.append(n)
        wait_for(lambda: set(executions(log)) >= set(published), 120, "every task to run")
        assert worker.alive(), "the worker process gave up instead of reconnecting"
    finally:
        worker.stop()
        app.close()
    assert published == list(range(100))
    assert set(executions(log)) == set(published)
    assert "read-only" in worker.log() or "connection" in worker.log()  # it saw the primary go
