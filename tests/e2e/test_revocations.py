"""End to end: durable revocations (:mod:`kombu_pgmq.revocations`).

Celery keeps revoked task ids in each worker's memory: a task revoked while no worker runs
is executed by the next worker that starts. On kombu_pgmq the revoke broadcast is also
recorded in ``kombu_pgmq.revoked``, and every worker loads those ids when it starts: the
task is refused (REVOKED in the result backend, whichever backend that is: here Celery's
SQLAlchemy one) and never runs.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from celery import Celery

from kombu_pgmq.management import Management
from tests.e2e import celery_app
from tests.e2e.helpers import Worker, runs, wait_for
from tests.e2e.test_limits import limit_runs

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

RESULT_TIMEOUT_S = 30.0


def revoked(conn: psycopg.Connection, task_id: str) -> bool:
    row = conn.execute("SELECT 1 FROM kombu_pgmq.revoked WHERE task_id = %s", (task_id,))
    return row.fetchone() is not None


def test_a_task_revoked_while_no_worker_runs_is_refused_by_a_worker_started_later(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    doomed = app.send_task("e2e.record", ("doomed",))
    app.control.revoke(doomed.id)  # broadcast to no worker: Celery alone would forget it
    assert revoked(db, doomed.id)
    kept = app.send_task("e2e.record", ("kept",))

    start_worker(concurrency=1)

    assert kept.get(timeout=RESULT_TIMEOUT_S) == "kept"  # the queue was consumed past it
    assert app.AsyncResult(doomed.id).state == "REVOKED"
    assert runs(db, doomed.id) == []
    assert len(runs(db, kept.id)) == 1


def test_task_cancel_records_the_revocation(
    app: Celery, db: psycopg.Connection, db_dsn: str
) -> None:
    doomed = app.send_task("e2e.record", ("doomed",))
    with Management(db_dsn) as management:
        result = management.cancel_task(doomed.id)
    assert [q for q, _ in result.cancelled] == ["celery"]
    assert revoked(db, doomed.id)


@pytest.mark.parametrize("commit", [True, False])
def test_a_revoke_inside_the_applications_transaction_is_recorded_with_it(
    app: Celery, db_dsn: str, db: psycopg.Connection, commit: bool
) -> None:
    import kombu_pgmq

    task_id = f"task-{commit}"
    with psycopg.connect(db_dsn) as conn:
        with kombu_pgmq.using(conn, broker_url=app.conf.broker_url):
            app.control.revoke(task_id)
        assert not revoked(db, task_id)  # not committed yet
        if commit:
            conn.commit()
        else:
            conn.rollback()
    assert revoked(db, task_id) is commit


@pytest.mark.slow
@pytest.mark.parametrize("task", ["e2e.limited_run_early", "e2e.limited_run"])
def test_task_cancel_terminate_stops_a_running_task_in_either_ack_mode(
    task: str,
    app: Celery,
    db: psycopg.Connection,
    db_dsn: str,
    start_worker: Callable[..., Worker],
) -> None:
    """A 60-second task running (its message acked at its start, or held until its end
    with ``acks_late``): ``kombu-pgmq task cancel --terminate`` revokes it and kills its
    pool process, as ``celery control revoke --terminate`` does: the worker lists it
    revoked, its body never finishes, and the worker goes on. Recorded: a worker started
    later refuses a message of the same task id."""
    db.execute(celery_app.LIMIT_RUNS_DDL)
    worker = start_worker(concurrency=2)
    running = app.tasks[task].apply_async(("cancelled", 60.0), queue="celery")
    wait_for(lambda: len(limit_runs(db)) == 1, 30, "the task starts")
    pid = limit_runs(db)[0].pid
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kombu_pgmq",
            "task",
            "cancel",
            running.id,
            "--terminate",
            "--url",
            db_dsn,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"{running.id} revoked and terminated if it runs" in done.stdout, done.stdout
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 30, "its pool process terminated")
    listed = app.control.inspect(destination=[worker.node], timeout=10).revoked() or {}
    assert running.id in listed.get(worker.node, []), listed
    assert limit_runs(db)[0].end is None
    assert revoked(db, running.id)
    assert worker.alive()
    if task != "e2e.limited_run_early":
        return
    worker.kill()
    again = app.tasks[task].apply_async(("again", 0.0), queue="celery", task_id=running.id)
    after = app.tasks[task].apply_async(("after", 0.0), queue="celery")
    start_worker(concurrency=1)
    wait_for(lambda: any(r.task_id == after.id for r in limit_runs(db)), 30, "the next task")
    assert [r.task_id for r in limit_runs(db)] == [running.id, after.id]  # refused
    assert again.id == running.id
