"""Exactly-once effects through the application's own database library, with real
workers: :class:`kombu_pgmq.AtomicTask` with ``atomic_db`` a SQLAlchemy ``Engine`` (a
Session per task, a ``text()`` write), a ``sessionmaker`` (an ORM ``add``) and Django's
``django.db.connection`` (an ORM ``create`` inside ``transaction.atomic``); the tasks are
in :mod:`tests.e2e.atomic_drivers_app`.

Commit: the write, the result (SUCCESS) and the ack commit together; the message is
archived once, by the task (the queue counts it as settled in a transaction), and the
task it sent (``delay`` in the body) is not queued while the transaction is open, then
runs once after the commit (Django's also in a threads pool: a connection per thread).
An exception rolls the write back, and the task it sent before raising is never
queued, so never runs; Celery fails the task as any other.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.e2e.helpers import runs, wait_for

#: The workers' app (not imported here: it configures Django in its process).
APP_MODULE = "tests.e2e.atomic_drivers_app"
#: DDL of the rows the tasks write: ``writer`` is the driver that wrote it in a task's
#: transaction, or ``sent`` (written by ``drivers.mark`` through its own connection).
WRITES_DDL = """
CREATE TABLE IF NOT EXISTS e2e_driver_writes (
    id bigserial PRIMARY KEY,
    key text NOT NULL,
    writer text NOT NULL
)
"""
#: DDL of the steps a task and the test tell each other, outside any task's transaction:
#: ``sent`` (the task called ``delay``), ``release`` (the test lets a gated task commit).
STEPS_DDL = """
CREATE TABLE IF NOT EXISTS e2e_driver_steps (
    key text NOT NULL,
    step text NOT NULL,
    PRIMARY KEY (key, step)
)
"""
#: The ``drivers.<name>`` tasks; each writes its rows with ``writer`` = its name.
DRIVERS = ("engine", "sessionmaker", "django")


@pytest.fixture
def e2e_env(e2e_env: dict[str, str]) -> dict[str, str]:
    """Workers and the test's app: kombu_pgmq's result backend, in the broker's database
    (the result commits in the task's transaction)."""
    return {**e2e_env, "KPT_RESULT_BACKEND": "postgresql"}


@pytest.fixture
def tables(db: psycopg.Connection) -> psycopg.Connection:
    db.execute(WRITES_DDL)
    db.execute(STEPS_DDL)
    return db


def writes(db: psycopg.Connection, key: str) -> list[str]:
    """Who wrote row *key*: the driver (in a task's transaction) or ``sent``."""
    rows = db.execute(
        "SELECT writer FROM e2e_driver_writes WHERE key = %s ORDER BY writer", (key,)
    ).fetchall()
    return [row[0] for row in rows]


def step(db: psycopg.Connection, key: str, name: str) -> bool:
    found = db.execute(
        "SELECT 1 FROM e2e_driver_steps WHERE key = %s AND step = %s", (key, name)
    ).fetchone()
    return found is not None


def archived(db: psycopg.Connection, task_id: str) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT msg_id, read_ct FROM pgmq.a_celery WHERE headers->>'id' = %s", (task_id,)
    ).fetchall()


def queued(db: psycopg.Connection) -> int:
    return int(db.execute("SELECT count(*) FROM pgmq.q_celery").fetchone()[0])


def marks_published(db: psycopg.Connection) -> int:
    """Messages of ``drivers.mark`` in queue ``celery`` or its archive."""
    row = db.execute(
        "SELECT (SELECT count(*) FROM pgmq.q_celery WHERE headers->>'task' = 'drivers.mark')"
        " + (SELECT count(*) FROM pgmq.a_celery WHERE headers->>'task' = 'drivers.mark')"
    ).fetchone()
    return int(row[0])


def settled_in_transaction(db: psycopg.Connection) -> int:
    row = db.execute(
        "SELECT coalesce(sum(settled), 0) FROM kombu_pgmq.settled_in_transaction() "
        "WHERE pgmq_queue = 'celery'"
    ).fetchone()
    return int(row[0])


@pytest.mark.parametrize(
    ("driver", "pool"),
    [
        ("engine", "prefork"),
        ("sessionmaker", "prefork"),
        ("django", "prefork"),
        ("django", "threads"),
    ],
)
def test_commit_applies_write_result_ack_and_sent_task_once(
    start_worker, app, tables, driver, pool
):
    worker = start_worker(app_module=APP_MODULE, pool=pool)
    key = f"commit-{driver}-{pool}"
    result = app.send_task(f"drivers.{driver}", (key,), {"send": True, "gate": True})
    # the body sent drivers.mark and waits for the release: its transaction is open
    wait_for(lambda: step(tables, key, "sent"), timeout=60, what="the task's send")
    assert marks_published(tables) == 0  # the sent task is not queued before the commit
    assert writes(tables, key) == []
    tables.execute("INSERT INTO e2e_driver_steps (key, step) VALUES (%s, 'release')", (key,))
    assert result.get(timeout=60)["runs"] == 1
    assert writes(tables, key) == [driver]  # committed with the result
    wait_for(lambda: "sent" in writes(tables, key), timeout=60, what="the sent task's run")
    wait_for(lambda: queued(tables) == 0, timeout=30, what="the sent task's ack")
    assert sorted(writes(tables, key)) == sorted([driver, "sent"])  # each once
    assert marks_published(tables) == 1
    assert len(archived(tables, result.id)) == 1
    assert settled_in_transaction(tables) == 1  # drivers.mark is acked by its worker
    assert len(runs(tables, result.id)) == 1
    log = worker.log()
    assert "stale" not in log and "lost the lease" not in log, log


@pytest.mark.parametrize("driver", DRIVERS)
def test_exception_rolls_back_the_write_and_the_sent_task(start_worker, app, tables, driver):
    start_worker(app_module=APP_MODULE)
    key = f"rollback-{driver}"
    result = app.send_task(f"drivers.{driver}", (key,), {"send": True, "fail": True})
    with pytest.raises(ValueError, match=f"drivers.{driver} {key} fails"):
        result.get(timeout=60)
    wait_for(lambda: queued(tables) == 0, timeout=30, what="the failed task's ack")
    assert step(tables, key, "sent")  # delay() was called before the exception
    assert writes(tables, key) == []  # the write was rolled back
    assert marks_published(tables) == 0  # the sent task never reached the queue
    assert len(archived(tables, result.id)) == 1  # acked by the worker, as any failure
    assert len(runs(tables, result.id)) == 1  # and not run again
    assert settled_in_transaction(tables) == 0
