"""End to end: a real ``celery worker`` subprocess on PostgreSQL/PGMQ, tasks published here.

Each test gets its own database (cloned from the template), so the queue ``celery``
(tables ``pgmq.q_celery`` / ``pgmq.a_celery``) holds only this test's messages.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from celery import Celery, chain, chord, group
from celery.exceptions import TaskRevokedError

from tests.e2e import celery_app
from tests.e2e.helpers import REPO_ROOT, Worker, runs, wait_for

RESULT_TIMEOUT_S = 30.0


def queue_rows(db: psycopg.Connection, table: str) -> list[tuple[int, int, str]]:
    """``(msg_id, read_ct, task id)`` of every message in ``pgmq.<table>``."""
    return db.execute(
        f"SELECT msg_id, read_ct, headers->>'id' FROM pgmq.{table} ORDER BY msg_id"
    ).fetchall()


def test_results_of_add_chain_group_chord_and_retry(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    start_worker()
    add, xsum = app.tasks["e2e.add"], app.tasks["e2e.xsum"]

    assert add.delay(2, 3).get(timeout=RESULT_TIMEOUT_S) == 5
    assert chain(add.s(1, 2), add.s(3), add.s(4))().get(timeout=RESULT_TIMEOUT_S) == 10
    assert group(add.s(i, i) for i in range(10))().get(timeout=RESULT_TIMEOUT_S) == [
        2 * i for i in range(10)
    ]
    assert chord(add.s(i, 1) for i in range(5))(xsum.s()).get(timeout=RESULT_TIMEOUT_S) == 15

    result = app.tasks["e2e.retry_once"].delay("v")
    assert result.get(timeout=RESULT_TIMEOUT_S) == {"value": "v", "retries": 1}
    attempts = runs(db, result.id)
    assert [a["retries"] for a in attempts] == [0, 1]
    assert attempts[1]["started_at"] - attempts[0]["started_at"] >= timedelta(seconds=0.9)

    # Every task message was acked: archived, none left in the queue.
    wait_for(lambda: not queue_rows(db, "q_celery"), RESULT_TIMEOUT_S, "the last ack")
    archived = queue_rows(db, "a_celery")
    assert len(archived) >= 1 + 3 + 10 + 5 + 2
    assert {read_ct for _, read_ct, _ in archived} == {1}


def test_celery_purge_deletes_queued_tasks(
    app: Celery, db: psycopg.Connection, e2e_env: dict[str, str]
) -> None:
    n = 7
    for i in range(n):
        app.tasks["e2e.add"].delay(i, i)
    assert len(queue_rows(db, "q_celery")) == n

    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.e2e.celery_app", "purge", "-f"],
        cwd=REPO_ROOT,
        env=e2e_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Purged {n} messages from 1 known task queue" in proc.stdout, proc.stdout
    assert queue_rows(db, "q_celery") == []


def test_task_published_without_worker_runs_when_worker_starts(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    result = app.tasks["e2e.add"].delay(20, 22)
    ((msg_id, read_ct, task_id),) = queue_rows(db, "q_celery")
    assert (read_ct, task_id) == (0, result.id)
    assert result.status == "PENDING"

    start_worker()
    assert result.get(timeout=RESULT_TIMEOUT_S) == 42
    wait_for(lambda: not queue_rows(db, "q_celery"), RESULT_TIMEOUT_S, "the ack")
    assert (msg_id, 1, result.id) in queue_rows(db, "a_celery")


def test_warm_shutdown_makes_unacked_message_visible_again_without_a_copy(
    app: Celery,
    db: psycopg.Connection,
    start_worker: Callable[..., Worker],
    e2e_env: dict[str, str],
) -> None:
    """An ETA task is held unacked in the worker; on warm shutdown the channel close
    releases it at once (visible now, the delivery not counted), not after the visibility
    timeout, and publishes no copy (kombu's default ``_restore`` would)."""
    worker = start_worker()
    # An ETA lead longer than the countdown: delivered at once and held by the worker
    # (by default it would wait in the queue table until 2 s before its ETA).
    publisher = celery_app.create_app({**e2e_env, "KPT_ETA_LEAD_SECONDS": "1000"})
    try:
        result = publisher.send_task("e2e.add", (1, 2), countdown=120)
    finally:
        publisher.close()
    wait_for(
        lambda: [r for r in queue_rows(db, "q_celery") if r[1] == 1],
        RESULT_TIMEOUT_S,
        "the worker to reserve the ETA task",
    )
    assert worker.stop() == 0
    ((_, read_ct, task_id),) = queue_rows(db, "q_celery")
    # read_ct only grows (a receipt names one delivery forever); the restore is counted
    # in x-kombu-restored, so it never counts toward max_deliveries
    assert (read_ct, task_id) == (1, result.id)
    (restored,) = db.execute("SELECT headers->'x-kombu-restored' FROM pgmq.q_celery").fetchone()
    assert restored == 1
    (visible,) = db.execute("SELECT vt <= clock_timestamp() FROM pgmq.q_celery").fetchone() or ()
    assert visible
    assert "Traceback" not in worker.log()


def test_expired_tasks_end_revoked_not_pending(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    """As Celery's ``test_tasks::test_expired``: ``expires=`` becomes the
    message's ``expiration`` too; the transport hands the expired task to the worker,
    which revokes it (REVOKED in the result store) and acks it, instead of dropping it
    unseen (PENDING forever)."""
    add = app.tasks["e2e.add"]
    waited = add.apply_async((1, 1), expires=1)  # expires while no worker runs
    time.sleep(1.5)
    start_worker()
    past = add.apply_async((2, 2), expires=datetime.now(timezone.utc) - timedelta(seconds=5))
    fresh = add.apply_async((3, 3), expires=60)
    for result in (waited, past):
        with pytest.raises(TaskRevokedError):
            result.get(timeout=RESULT_TIMEOUT_S)
        assert result.state == "REVOKED"
    assert fresh.get(timeout=RESULT_TIMEOUT_S) == 6
    # acked by the worker once revoked: archived, none left in the queue
    wait_for(lambda: not queue_rows(db, "q_celery"), RESULT_TIMEOUT_S, "the acks")
    archived = {task_id for _, _, task_id in queue_rows(db, "a_celery")}
    assert {waited.id, past.id, fresh.id} <= archived
