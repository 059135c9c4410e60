"""Exactly-once effects with real workers (:class:`kombu_pgmq.AtomicTask`): a task's
write, its ack, its result and the tasks it sends commit in one transaction.

Commit: the counter moves once per task, the message is archived by the task (the
worker's own ack sends nothing and warns of nothing), the result is SUCCESS, and the
queue counts it as settled in a transaction. An exception rolls the write back, then
Celery's failure (FAILURE result, message archived) or ``self.retry()`` (a new message,
the write once) behave as for any task. Fencing: a delivery whose visibility timeout
passed while another worker ran the message loses: exactly one commit, the loser's
write absent. A worker killed before its commit leaves neither the row nor the chord
it sent; the redelivery makes both, once. Prefork, threads and solo pools.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from celery.result import AsyncResult

from tests.e2e.celery_app import COUNTERS_DDL
from tests.e2e.helpers import runs, wait_for


@pytest.fixture
def e2e_env(e2e_env: dict[str, str]) -> dict[str, str]:
    """Workers and the test's app: kombu_pgmq's result backend, in the broker's database."""
    return {**e2e_env, "KPT_RESULT_BACKEND": "postgresql"}


@pytest.fixture
def counters(db: psycopg.Connection) -> psycopg.Connection:
    db.execute(COUNTERS_DDL)
    return db


def counter(db: psycopg.Connection, key: str) -> int | None:
    row = db.execute("SELECT n FROM e2e_counters WHERE key = %s", (key,)).fetchone()
    return None if row is None else int(row[0])


def archived(db: psycopg.Connection, task_id: str) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT msg_id, read_ct FROM pgmq.a_celery WHERE headers->>'id' = %s", (task_id,)
    ).fetchall()


def queued(db: psycopg.Connection) -> int:
    return int(db.execute("SELECT count(*) FROM pgmq.q_celery").fetchone()[0])


def settled_in_transaction(db: psycopg.Connection) -> int:
    row = db.execute(
        "SELECT coalesce(sum(settled), 0) FROM kombu_pgmq.settled_in_transaction() "
        "WHERE pgmq_queue = 'celery'"
    ).fetchone()
    return int(row[0])


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_write_ack_and_result_commit_once(start_worker, app, counters, pool):
    worker = start_worker(pool=pool)
    results = [app.tasks["e2e.atomic_add"].delay(f"k{i}") for i in range(20)]
    for result in results:
        assert result.get(timeout=60)["runs"] == 1
    assert [counter(counters, f"k{i}") for i in range(20)] == [1] * 20
    assert queued(counters) == 0
    for result in results:
        assert len(archived(counters, result.id)) == 1
    assert settled_in_transaction(counters) == 20
    log = worker.log()
    assert "stale" not in log and "lost the lease" not in log, log


def test_exception_rolls_back_then_celery_fails_the_task(start_worker, app, counters):
    start_worker()
    result = app.tasks["e2e.atomic_add"].delay("failing", fail="always")
    with pytest.raises(ValueError, match="atomic_add failing fails"):
        result.get(timeout=60)
    assert counter(counters, "failing") is None  # the write was rolled back
    assert len(runs(counters, result.id)) == 1  # and not run again
    wait_for(lambda: queued(counters) == 0, timeout=30, what="the failed task's ack")
    assert len(archived(counters, result.id)) == 1  # acked by the worker, as any failure
    assert settled_in_transaction(counters) == 0


def test_retry_rolls_back_and_sends_the_retry(start_worker, app, counters):
    start_worker()
    result = app.tasks["e2e.atomic_add"].delay("retried", fail="retry_once")
    assert result.get(timeout=60)["runs"] == 2
    assert counter(counters, "retried") == 1  # the first run's write was rolled back
    wait_for(lambda: queued(counters) == 0, timeout=30, what="the first message's ack")
    assert len(archived(counters, result.id)) == 2


def test_fencing_the_delivery_that_lost_its_message_commits_nothing(start_worker, app, counters):
    # The first worker renews no lease: its run's visibility timeout (2 s) passes while it
    # sleeps, and the second worker receives the message again. The second run's write
    # waits for the first run's uncommitted one (the same row) and renews its own lease
    # meanwhile; the first run's ack is fenced, it rolls back, the second run commits.
    env = {"KPT_VISIBILITY_TIMEOUT": "2", "KPT_PREFETCH_MULTIPLIER": "1"}
    first = start_worker(concurrency=1, **env, KPT_LEASE_RENEWAL_INTERVAL="0")
    result = app.tasks["e2e.atomic_add"].delay("fenced", sleep_seconds=6)
    wait_for(lambda: len(runs(counters, result.id)) == 1, timeout=60, what="the first run")
    second = start_worker(concurrency=1, **env)
    wait_for(lambda: len(runs(counters, result.id)) == 2, timeout=60, what="the second run")
    assert result.get(timeout=60)["runs"] == 2  # the second run's result
    wait_for(lambda: "went to another delivery" in first.log(), timeout=30, what="the fenced run")
    assert counter(counters, "fenced") == 1  # the first run's write is absent
    assert len(archived(counters, result.id)) == 1
    assert AsyncResult(result.id, app=app).state == "SUCCESS"
    assert queued(counters) == 0
    assert settled_in_transaction(counters) == 1
    assert "went to another delivery" not in second.log()
    assert "stale" not in first.log(), first.log()  # its own ack sent nothing


def test_killed_before_commit_leaves_neither_row_nor_chord(start_worker, app, counters):
    worker = start_worker(concurrency=1, KPT_VISIBILITY_TIMEOUT="3")
    result = app.tasks["e2e.atomic_add"].delay("chorded", chord_size=3, sleep_seconds=30)
    wait_for(lambda: len(runs(counters, result.id)) == 1, timeout=60, what="the first run")
    worker.kill()  # the whole worker, before the task's commit
    assert counter(counters, "chorded") is None
    sent = counters.execute(
        "SELECT count(*) FROM pgmq.q_celery WHERE headers->>'task' IN ('e2e.add', 'e2e.record_sum')"
    ).fetchone()
    assert sent == (0,)  # the chord's header tasks were never queued
    assert counters.execute("SELECT count(*) FROM kombu_pgmq.chords").fetchone() == (0,)
    start_worker(concurrency=2, KPT_VISIBILITY_TIMEOUT="3")
    assert result.get(timeout=90)["runs"] == 2
    assert counter(counters, "chorded") == 1
    wait_for(
        lambda: (
            counters.execute(
                "SELECT count(*) FROM e2e_runs WHERE name = 'e2e.record_sum'"
            ).fetchone()
            == (1,)
        ),
        timeout=60,
        what="the chord callback",
    )


@pytest.mark.parametrize("limit", ["soft_time_limit", "time_limit"])
def test_a_time_limit_rolls_the_write_back(start_worker, app, counters, limit):
    # soft: SoftTimeLimitExceeded raised in the body; hard: the pool process is killed and
    # the server rolls its transaction back. Either way Celery fails the task and acks it.
    start_worker()
    result = app.tasks["e2e.atomic_add"].apply_async(
        ("limited",), {"sleep_seconds": 30}, **{limit: 1}
    )
    with pytest.raises(Exception, match=r"TimeLimitExceeded|SoftTimeLimitExceeded"):
        result.get(timeout=60)
    assert counter(counters, "limited") is None
    wait_for(lambda: queued(counters) == 0, timeout=30, what="the ack of the failed task")
    assert len(archived(counters, result.id)) == 1
    assert len(runs(counters, result.id)) == 1


def test_a_lost_connection_requeues_the_task_and_it_runs_again(start_worker, app, counters):
    # the task's session is terminated while its transaction is open (as a server restart
    # would end it): rolled back, requeued, run again on a new connection, applied once
    worker = start_worker()
    result = app.tasks["e2e.atomic_add"].delay("reconnected", sleep_seconds=3)
    wait_for(lambda: len(runs(counters, result.id)) == 1, timeout=60, what="the first run")
    pids = wait_for(
        lambda: [
            r[0]
            for r in counters.execute(
                "SELECT pid FROM pg_stat_activity WHERE state = 'idle in transaction' "
                "AND query LIKE '%%e2e_counters%%'"
            )
        ],
        timeout=30,
        what="the task's open transaction",
    )
    counters.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))
    assert result.get(timeout=60)["runs"] == 2
    assert counter(counters, "reconnected") == 1
    assert len(archived(counters, result.id)) == 1
    assert queued(counters) == 0
    assert "reject requeue=True" in worker.log(), worker.log()
