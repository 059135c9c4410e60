"""A real ``celery worker`` whose broker URL is a PgBouncer's in transaction mode:
``broker_transport_options = {"pooler": "transaction", "direct_url":
<the server>}``, kombu_pgmq's result backend on the broker's database (``postgresql://``:
the broker's pooler and direct_url). The session's PgBouncer (tests/conftest.py
``pgbouncer``) has 2 server connections per database, shared by the worker's and this
process's connections.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import psycopg
import pytest
from celery import Celery, chord

from tests.e2e import celery_app
from tests.e2e.helpers import Worker, runs, wait_for

RESULT_TIMEOUT_S = 60.0


@pytest.fixture
def e2e_env(e2e_env: dict[str, str], db_dsn: str, pgbouncer) -> dict[str, str]:
    options = {"pooler": "transaction", "direct_url": db_dsn, "polling_interval": 5}
    return {
        **e2e_env,
        "KPT_BROKER_URL": pgbouncer.pooled_url(db_dsn),
        "KPT_TRANSPORT_OPTIONS": json.dumps(options),
        "KPT_RESULT_BACKEND": "postgresql",
    }


def test_a_worker_through_pgbouncer_runs_every_task_once(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker], pgbouncer
) -> None:
    worker = start_worker()
    record, add, xsum = app.tasks["e2e.record"], app.tasks["e2e.add"], app.tasks["e2e.xsum"]
    results = [record.delay(f"r{i}") for i in range(30)]
    retried = app.tasks["e2e.retry_once"].delay("v")
    later = record.apply_async(("later",), countdown=2)
    assert [r.get(timeout=RESULT_TIMEOUT_S) for r in results] == [f"r{i}" for i in range(30)]
    assert retried.get(timeout=RESULT_TIMEOUT_S) == {"value": "v", "retries": 1}
    assert later.get(timeout=RESULT_TIMEOUT_S) == "later"
    assert chord(add.s(i, 1) for i in range(5))(xsum.s()).get(timeout=RESULT_TIMEOUT_S) == 15

    for result in [*results, later]:
        assert len(runs(db, result.id)) == 1, result.id
    assert [a["retries"] for a in runs(db, retried.id)] == [0, 1]
    wait_for(
        lambda: not db.execute("SELECT 1 FROM pgmq.q_celery").fetchall(),
        RESULT_TIMEOUT_S,
        "the last ack",
    )
    log = worker.log()
    assert "prepared statement" not in log and "Traceback" not in log
    assert "polling_interval" not in log  # direct_url given: no polling warning
    # The worker's statements went through PgBouncer: its clients are there.
    dbname = db.info.dbname
    pools = [p for p in pgbouncer.show("POOLS") if p["database"] == dbname]
    assert pools and pools[0]["cl_active"] + pools[0]["cl_waiting"] >= 2


def test_beat_through_pgbouncer_leads_on_direct_url(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker], pgbouncer
) -> None:
    """Two ``celery worker -B`` whose broker is PgBouncer: beat runs on ``direct_url`` (its
    leader's session advisory lock and backend pid are a direct connection's, never a
    server connection of PgBouncer's), one leads, and each tick's task runs once."""
    db.execute(celery_app.BEAT_RUNS_DDL)
    beat = {"KPT_BEAT": "1", "KPT_BEAT_TAKEOVER_SECONDS": "6"}
    workers = [start_worker(wait=False, extra_args=["-B"], **beat) for _ in range(2)]
    for worker in workers:
        worker.wait_ready(app)

    def runs_of_every_second() -> list[tuple[str, int]]:
        return db.execute(
            "SELECT task_id, count(*)::int FROM e2e_beat_runs WHERE entry = %s GROUP BY task_id",
            (celery_app.BEAT_EVERY_SECOND,),
        ).fetchall()

    wait_for(lambda: len(runs_of_every_second()) >= 4, RESULT_TIMEOUT_S, "4 ticks to run")
    assert all(n == 1 for _, n in runs_of_every_second())
    leaders = db.execute("SELECT backend_pid, epoch FROM kombu_pgmq.beat_leader").fetchall()
    assert len(leaders) == 1
    pooled_pids = {s["remote_pid"] for s in pgbouncer.show("SERVERS")}
    assert leaders[0][0] not in pooled_pids  # the leader's session is a direct one
    ticks = db.execute("SELECT DISTINCT epoch FROM kombu_pgmq.beat_ticks").fetchall()
    assert ticks == [(leaders[0][1],)]  # one leader sent every tick
