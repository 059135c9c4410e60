"""End to end: durable revocations (issue 27, item 5; :mod:`kombu_pgmq.revocations`).

Celery keeps revoked task ids in each worker's memory: a task revoked while no worker runs
is executed by the next worker that starts. On kombu_pgmq the revoke broadcast is also
recorded in ``kombu_pgmq.revoked``, and every worker loads those ids when it starts: the
task is refused (REVOKED in the result backend, whichever backend that is: here Celery's
SQLAlchemy one) and never runs.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from celery import Celery

from kombu_pgmq.management import Management
from tests.e2e.helpers import Worker, runs

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
