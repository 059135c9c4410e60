"""Concurrency limits count running tasks under Celery's defaults: task
``e2e.limited_run_early`` has no ``acks_late``, so Celery acks its message when the pool
starts it, and the worker holds the task's concurrency slot from that ack until the task
finishes (:mod:`kombu_pgmq.transport._slots`). Every assertion is on the wall-clock start
and end the task bodies record in ``e2e_limit_runs`` (see :mod:`tests.e2e.test_limits`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import psycopg
import pytest
from celery import Celery

from tests.e2e import celery_app
from tests.e2e.helpers import Worker, wait_for
from tests.e2e.test_limits import (
    QUEUE,
    finished,
    limit_runs,
    max_overlap,
    parent_pid,
    publish,
    set_limits,
    spans,
    start_workers,
    throttled_concurrency,
)

EARLY = "e2e.limited_run_early"


def held_slots(db: psycopg.Connection) -> int:
    """Slots held now (not lapsed)."""
    row = db.execute(
        "SELECT count(*) FROM kombu_pgmq.held_slots WHERE held_until > clock_timestamp()"
    ).fetchone()
    return int(row[0]) if row else 0


def cli_limit(db_dsn: str, *args: str) -> str:
    """``kombu-pgmq queue limit celery ARGS``, as an operator runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "kombu_pgmq", "queue", "limit", QUEUE, *args, "--url", db_dsn],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(
    ("pool", "concurrency", "limit", "tasks"),
    [
        ("prefork", 4, 3, 24),
        ("threads", 4, 3, 24),
        ("solo", 1, 1, 8),
        ("gevent", 4, 3, 24),
    ],
)
def test_concurrency_counts_running_tasks_with_early_acks(
    pool: str,
    concurrency: int,
    limit: int,
    tasks: int,
    start_worker: Callable[..., Worker],
    app: Celery,
    db: psycopg.Connection,
    db_dsn: str,
) -> None:
    """2 workers, Celery's default early acks, a concurrency limit set with the command
    line: never more than the limit of task bodies at once (it is reached), every task
    runs once, and no slot is left held afterwards."""
    if pool == "gevent":
        pytest.importorskip("gevent")
    db.execute(celery_app.LIMIT_RUNS_DDL)
    workers = start_workers(start_worker, app, 2, concurrency=concurrency, pool=pool)
    cli_limit(db_dsn, "--concurrency", str(limit))
    ids = publish(app, tasks, pool, 0.5, task_name=EARLY)
    wait_for(lambda: finished(db) == tasks, 120, f"{tasks} runs")
    runs = limit_runs(db)
    assert sorted(r.task_id for r in runs) == sorted(ids)  # each ran once
    peak = max_overlap(spans(runs))
    print(f"{pool}: concurrency {limit}, {tasks} tasks of 0.5 s: at most {peak} at once")
    assert peak == limit
    if pool in ("prefork", "threads"):  # the limit is fleet-wide: both workers ran tasks
        ran_in = {parent_pid(r.pid) if pool == "prefork" else r.pid for r in runs}
        assert len(ran_in) == 2, ran_in
        assert ran_in <= {w.pid for w in workers} or pool == "prefork"
    wait_for(lambda: held_slots(db) == 0, 30, "every slot released")


def test_a_killed_workers_slots_come_back_and_its_tasks_do_not_run_again(
    start_worker: Callable[..., Worker], app: Celery, db: psycopg.Connection
) -> None:
    """Concurrency 2, visibility timeout 5 s, early acks: worker A runs two 30-second
    tasks (their messages archived, their slots held) and is SIGKILLed; worker B, refused
    until then, gets the slots once A's slots lapse (within the visibility timeout of the
    kill, plus a polling interval); A's two tasks are not delivered again (acked: Celery's
    at most once) and the other tasks run."""
    db.execute(celery_app.LIMIT_RUNS_DDL)
    vt, polling = 5.0, 1.0
    env = {"KPT_VISIBILITY_TIMEOUT": str(vt), "KPT_POLLING_INTERVAL": str(polling)}
    a = start_worker(concurrency=2, **env)
    set_limits(db, {"concurrency": 2})
    long_ids = publish(app, 2, "long", 30.0, task_name=EARLY)
    wait_for(lambda: len(limit_runs(db)) == 2, 30, "worker A runs both long tasks")
    assert {parent_pid(r.pid) for r in limit_runs(db)} == {a.pid}
    wait_for(lambda: held_slots(db) == 2, 10, "A holds both slots")
    b = start_worker(concurrency=2, **env)
    throttled_before = throttled_concurrency(db)
    short_ids = publish(app, 2, "short", 0.5, task_name=EARLY)
    wait_for(lambda: throttled_concurrency(db) > throttled_before, 30, "a refused read")
    assert len(limit_runs(db)) == 2
    killed_at = time.time()
    a.kill()
    until = db.execute(
        "SELECT extract(epoch FROM max(held_until))::float8 FROM kombu_pgmq.held_slots"
    ).fetchone()
    assert until is not None and until[0] is not None and until[0] > killed_at
    wait_for(lambda: finished(db) == 2, 60, "the two short tasks complete")
    runs = limit_runs(db)
    assert sorted(r.task_id for r in runs) == sorted(long_ids + short_ids)  # no rerun
    after = [r for r in runs if r.task_id in short_ids]
    back = min(r.start for r in after) - killed_at
    print(
        f"vt {vt:g} s: A's slots held until {until[0] - killed_at:.2f} s after the kill;"
        f" first slot back after {back:.2f} s"
    )
    assert min(r.start for r in after) >= until[0] - 0.5  # not before A's slots lapsed
    assert back <= vt + polling + 3.0
    assert b.alive()
