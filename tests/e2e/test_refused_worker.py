"""End to end: a ``celery worker`` whose broker database does not exist, or whose role is
refused, says so first, with the fix, in Celery's own retry line; and durable revocations
it could not load at start are loaded once the database answers.

What the user reads is the worker's output (stdout and stderr, in order): before logging
starts only Celery's banner (and its warning about running as root), then Celery's
``consumer: Cannot connect to ...: PostgreSQL refused the connection: ...`` naming the
database (``createdb``) or the role (``createuser``), and nothing about revocations.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

import psycopg
import pytest
from celery import Celery
from psycopg import sql

from tests.e2e.helpers import Worker, runs, wait_for
from tests.support import pgserver

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

#: Longest wait for a worker's first connection attempt (cold imports on a loaded machine).
FIRST_ATTEMPT_S = 60.0
RESULT_TIMEOUT_S = 30.0
#: A line a user reads as a message about a problem: a log record of WARNING or above,
#: or anything kombu_pgmq prints (Celery's banner and its SecurityWarning are neither).
_MESSAGE = re.compile(r"WARNING|ERROR|CRITICAL|kombu_pgmq|durable revocations")


@pytest.fixture
def e2e_env(e2e_env: dict[str, str]) -> dict[str, str]:
    """kombu_pgmq's result backend (Celery's SQLAlchemy one ends a worker that cannot
    connect when it starts: no retry line to read)."""
    return {**e2e_env, "KPT_RESULT_BACKEND": "postgresql"}


def first_problem(worker: Worker) -> tuple[str, str]:
    """Wait for the worker's first connection retry; return its first problem line and
    its whole output (the worker is killed)."""
    wait_for(lambda: "Trying again" in worker.log(), FIRST_ATTEMPT_S, "a connection retry")
    worker.kill()
    output = worker.log()
    lines = [line for line in output.splitlines() if _MESSAGE.search(line)]
    assert lines, output
    return lines[0], output


def test_a_worker_on_a_missing_database_names_it_and_createdb(
    pg_server: str, start_worker: Callable[..., Worker]
) -> None:
    name = f"kpt_missing_{uuid.uuid4().hex[:12]}"  # never created
    url = pgserver.database_url(pg_server, name)
    worker = start_worker(wait=False, KPT_BROKER_URL=url)
    first, output = first_problem(worker)
    assert "consumer: Cannot connect to" in first, output
    assert f'PostgreSQL refused the connection: database "{name}" does not exist' in first
    assert re.search(rf"\(createdb [^)]*{name}\)", first), first
    assert "durable revocations" not in output


def test_a_worker_whose_role_does_not_exist_names_it_and_createuser(
    pg_server: str, db_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    role = f"kpt_norole_{uuid.uuid4().hex[:12]}"  # never created
    name = str(psycopg.conninfo.conninfo_to_dict(db_dsn)["dbname"])
    url = pgserver.database_url(pg_server, name, user=role)
    worker = start_worker(wait=False, KPT_BROKER_URL=url, KPT_RESULT_BACKEND="none")
    first, output = first_problem(worker)
    assert "consumer: Cannot connect to" in first, output
    assert f'PostgreSQL refused the connection: role "{role}" does not exist' in first
    assert "createuser" in first and f"schema grant worker {role}" in first
    assert "durable revocations" not in output


def _allow_connections(pg_server: str, name: str, allow: bool) -> None:
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(
            sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {}").format(
                sql.Identifier(name), sql.Literal(allow)
            )
        )


def test_revocations_are_loaded_once_the_database_answers(
    app: Celery,
    db: psycopg.Connection,
    db_dsn: str,
    pg_server: str,
    start_worker: Callable[..., Worker],
) -> None:
    """The database refuses connections when the worker starts (``worker_init`` cannot
    load the revocations), then accepts them: Celery's retry connects, and the revoked
    task is refused all the same."""
    doomed_id = str(uuid.uuid4())
    app.control.revoke(doomed_id)  # recorded in kombu_pgmq.revoked; no worker runs
    name = str(psycopg.conninfo.conninfo_to_dict(db_dsn)["dbname"])
    _allow_connections(pg_server, name, False)
    try:
        worker = start_worker(wait=False, concurrency=1)
        wait_for(lambda: "Trying again" in worker.log(), FIRST_ATTEMPT_S, "a connection retry")
    finally:
        _allow_connections(pg_server, name, True)
    worker.wait_ready(app)
    assert "durable revocations" not in worker.log().split("Trying again", 1)[0]

    doomed = app.send_task("e2e.record", ("doomed",), task_id=doomed_id)
    kept = app.send_task("e2e.record", ("kept",))
    assert kept.get(timeout=RESULT_TIMEOUT_S) == "kept"  # the queue was consumed past it
    assert app.AsyncResult(doomed.id).state == "REVOKED"
    assert runs(db, doomed_id) == []
