"""Failover with a real Celery worker (issue 14, item 10): a primary and a synchronous
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
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

from tests.e2e import chaos_app
from tests.e2e.helpers import REPO_ROOT, Worker, wait_for
from tests.support import pgserver

SETTINGS = {**pgserver.TEST_SETTINGS, **pgserver.REPLICATION_SETTINGS, "synchronous_commit": "on"}


@pytest.fixture
def primary_and_standby() -> Any:
    try:
        primary = pgserver.start_server(settings=SETTINGS)
    except pgserver.EmbeddedPostgresMissing as exc:
        pytest.skip(str(exc))
    standby = None
    try:
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE broker")
        standby = pgserver.start_standby(primary)
        pgserver.make_synchronous(primary)
        yield primary, standby
    finally:
        for server in (standby, primary):
            if server is not None:
                server.stop()


def _url(server: pgserver.LocalServer) -> str:
    return f"postgresql://{pgserver.SUPERUSER}@/broker?host={quote(str(server.socket_dir))}"


def _executed(log: Path) -> set[int]:
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return set()
    return {int(line.split(",")[0]) for line in lines if line.split(",")[0].isdigit()}


def test_celery_worker_continues_on_the_promoted_standby(primary_and_standby, tmp_path):
    primary, standby = primary_and_standby
    log = tmp_path / "executions.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_")}
    env.update(
        KPT_CHAOS_BROKER=f"{_url(standby)};{_url(primary)}",  # kombu's failover list
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
        wait_for(lambda: len(_executed(log)) >= 20, 90, "the worker to run 20 tasks")

        primary.crash()  # the primary dies mid-run...
        pgserver.promote(standby)  # ...and the standby takes over
        for n in range(50, 100):
            work.apply_async((n,), retry=True, retry_policy=retry_policy)
            published.append(n)
        wait_for(lambda: _executed(log) >= set(published), 120, "every task to run")
        assert worker.alive(), "the worker process gave up instead of reconnecting"
    finally:
        worker.stop()
        app.close()
    assert published == list(range(100))
    assert _executed(log) == set(published)
    assert "read-only" in worker.log() or "connection" in worker.log()  # it saw the primary go
