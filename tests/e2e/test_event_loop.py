"""A real worker runs our transport in Celery's event loop: woken by NOTIFY, quiet when idle."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
import pytest
from celery import Celery

from tests.e2e.helpers import Worker, wait_for, waiting_on


def test_worker_is_woken_by_a_publish_not_by_polling(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    # The fallback poll runs every 60 s: a task that starts within seconds was woken by
    # the NOTIFY of its publish, in Celery's event loop (asynloop).
    start_worker(KPT_POLLING_INTERVAL="60")
    # the worker found its queues empty and went to sleep (LISTEN)
    wait_for(lambda: waiting_on(db, "celery"), 30, "the idle worker to wait on LISTEN")
    for x in range(5):
        start = time.monotonic()
        assert app.tasks["e2e.add"].delay(x, 1).get(timeout=20) == x + 1
        assert time.monotonic() - start < 10


@pytest.mark.slow
def test_idle_worker_sends_no_query_more_often_than_the_fallback_interval(
    db: psycopg.Connection, db_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(KPT_POLLING_INTERVAL="1")
    time.sleep(2.0)  # settle: initial reads, waiting rows, result backend set-up
    dbname = db.info.dbname
    seen: set[tuple[int, float]] = set()
    window_s = 5.0
    t0 = time.time()
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        rows = db.execute(
            "SELECT pid, extract(epoch FROM query_start) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid() "
            "AND application_name <> 'kpt_e2e_test' AND query_start IS NOT NULL",
            (dbname,),
        ).fetchall()
        seen.update((pid, float(ts)) for pid, ts in rows)
        time.sleep(0.01)
    started = sorted(ts for _, ts in seen if t0 <= ts <= t0 + window_s)
    # One fallback round per second reads the task queues and the pidbox queue (2 queries),
    # plus a heartbeat every 10 s; the 0.1 s polling of before would show ~100.
    assert len(started) <= 4 * window_s, started
    assert len(started) >= 1  # the sampler sees the fallback polls at all


def test_worker_recovers_when_its_database_connections_are_killed(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(KPT_POLLING_INTERVAL="60")
    assert app.tasks["e2e.add"].delay(1, 1).get(timeout=20) == 2
    killed = db.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND application_name <> 'kpt_e2e_test'"
    ).fetchone()[0]
    assert killed >= 2  # at least the worker's statement and LISTEN connections
    # The worker reconnects by itself (the transport retries every second, without
    # making Celery restart its consumer) and LISTENs again.
    assert app.tasks["e2e.add"].delay(2, 2).get(timeout=20) == 4
    time.sleep(1.0)
    assert app.tasks["e2e.add"].delay(3, 3).get(timeout=20) == 6
    assert worker.alive()
    log = worker.log()
    assert "database connection re-established" in log
    assert "lost the lease" not in log  # acked messages are not held
