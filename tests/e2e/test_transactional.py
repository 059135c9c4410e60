"""Enqueue inside the application's transaction, with a real worker:
``kombu_pgmq.using(conn)`` on a psycopg 3 connection, a SQLAlchemy Session and a Django
connection. Commit: the task runs once; rollback: it never runs (it never reached the
queue table); a savepoint rolled back: its tasks never run, the rest of the transaction's
do. Group, chain and chord publishes (the chord's ``chord_unlock`` included, inside
``with kombu_pgmq.using(conn):``). A waiting worker is woken at the commit, not by its
fallback poll; an open application transaction does not hold up a worker's start.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest
from celery import chain, chord, group
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

import kombu_pgmq
from tests.e2e.celery_app import result_backend_url
from tests.e2e.helpers import REPO_ROOT, runs, wait_for, waiting_on


class Rollback(Exception):
    pass


def _never_queued(db: psycopg.Connection, *task_ids: str) -> bool:
    """True if no message of these task ids is in a queue table or an archive."""
    rows = db.execute(
        "SELECT count(*) FROM pgmq.q_celery WHERE headers->>'id' = ANY(%s)", (list(task_ids),)
    ).fetchone()
    archived = db.execute(
        "SELECT count(*) FROM pgmq.a_celery WHERE headers->>'id' = ANY(%s)", (list(task_ids),)
    ).fetchone()
    return rows == (0,) and archived == (0,)


def _drain(app: Any, db: psycopg.Connection) -> None:
    """Run a sentinel task published after everything else, and wait for it."""
    app.tasks["e2e.record"].delay("sentinel").get(timeout=60)


def test_psycopg_commit_rollback_and_savepoint(start_worker, app, db, db_dsn):
    start_worker()
    record = app.tasks["e2e.record"]
    with psycopg.connect(db_dsn) as pg:
        with pg.transaction():
            committed = record.apply_async(("commit",), connection=kombu_pgmq.using(pg))
        with pytest.raises(Rollback), pg.transaction():
            rolled_back = record.apply_async(("rollback",), connection=kombu_pgmq.using(pg))
            raise Rollback
        with pg.transaction():
            outer = record.apply_async(("outer",), connection=kombu_pgmq.using(pg))
            with pytest.raises(Rollback), pg.transaction():  # a savepoint
                inner = record.apply_async(("inner",), connection=kombu_pgmq.using(pg))
                raise Rollback
    assert committed.get(timeout=60) == "commit"
    assert outer.get(timeout=60) == "outer"
    _drain(app, db)
    assert len(runs(db, committed.id)) == 1 and len(runs(db, outer.id)) == 1
    assert runs(db, rolled_back.id) == [] and runs(db, inner.id) == []
    assert _never_queued(db, rolled_back.id, inner.id)


def test_sqlalchemy_session_commit_rollback_and_savepoint(start_worker, app, db, db_dsn):
    start_worker()
    record = app.tasks["e2e.record"]
    engine = create_engine(result_backend_url(db_dsn).removeprefix("db+"))
    try:
        with Session(engine) as session, session.begin():
            committed = record.apply_async(("commit",), connection=kombu_pgmq.using(session))
        with pytest.raises(Rollback), Session(engine) as session, session.begin():
            rolled_back = record.apply_async(("rollback",), connection=kombu_pgmq.using(session))
            raise Rollback
        with Session(engine) as session, session.begin():
            outer = record.apply_async(("outer",), connection=kombu_pgmq.using(session))
            with pytest.raises(Rollback), session.begin_nested():
                inner = record.apply_async(("inner",), connection=kombu_pgmq.using(session))
                raise Rollback
        with engine.connect() as connection, connection.begin():  # a SQLAlchemy Connection
            via_connection = record.apply_async(
                ("connection",), connection=kombu_pgmq.using(connection)
            )
    finally:
        engine.dispose()
    for result, label in ((committed, "commit"), (outer, "outer"), (via_connection, "connection")):
        assert result.get(timeout=60) == label
    _drain(app, db)
    assert runs(db, rolled_back.id) == [] and runs(db, inner.id) == []
    assert _never_queued(db, rolled_back.id, inner.id)


def test_django_atomic_commit_rollback_and_savepoint(start_worker, app, db, e2e_env):
    start_worker()
    done = subprocess.run(
        [sys.executable, "-m", "tests.e2e.django_enqueue"],
        cwd=REPO_ROOT,
        env=e2e_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ids = json.loads(done.stdout.strip().splitlines()[-1])
    for task_id in ids["committed"]:
        assert app.AsyncResult(task_id).get(timeout=60) in ("django-commit", "django-outer")
    _drain(app, db)
    assert [len(runs(db, task_id)) for task_id in ids["committed"]] == [1, 1]
    assert all(runs(db, task_id) == [] for task_id in ids["rolled_back"])
    assert _never_queued(db, *ids["rolled_back"])


def test_group_chain_and_chord_commit_together_or_not_at_all(start_worker, app, db, db_dsn):
    start_worker()
    add, xsum = app.tasks["e2e.add"], app.tasks["e2e.xsum"]
    with psycopg.connect(db_dsn) as pg:
        with pytest.raises(Rollback), pg.transaction(), kombu_pgmq.using(pg):
            chord([add.s(i, i) for i in range(3)])(xsum.s())
            group(add.s(1, 1), add.s(2, 2)).apply_async()
            raise Rollback
        with psycopg.connect(db_dsn) as other:  # nothing of it, not even chord_unlock
            assert other.execute("SELECT count(*) FROM pgmq.q_celery").fetchone() == (0,)
        with pg.transaction():
            producer = kombu_pgmq.using(pg).Producer()
            grouped = group(add.s(1, 1), add.s(2, 2)).apply_async(producer=producer)
            # Celery's chain.apply_async drops producer= (canvas.py, _chain.run): a chain
            # joins the transaction only through the context manager
            with kombu_pgmq.using(pg):  # Celery's own chord_unlock joins the transaction
                chained = chain(add.s(1, 2), add.s(3)).apply_async()
                chorded = chord([add.s(i, i) for i in range(3)])(xsum.s())
            with psycopg.connect(db_dsn) as other:  # nothing queued, nothing run and acked
                assert other.execute(
                    "SELECT (SELECT count(*) FROM pgmq.q_celery)"
                    " + (SELECT count(*) FROM pgmq.a_celery)"
                ).fetchone() == (0,)
    assert grouped.get(timeout=60) == [2, 4]
    assert chained.get(timeout=60) == 6
    assert chorded.get(timeout=60) == 6


def test_a_waiting_worker_is_woken_at_commit_not_by_its_fallback_poll(
    start_worker, app, db, db_dsn
):
    # A fallback poll every 60 s: a wake-up by NOTIFY at the commit is the only way the
    # task can start within seconds of it (the bound below leaves a loaded machine 10 s).
    start_worker(KPT_POLLING_INTERVAL="60")
    record = app.tasks["e2e.record"]
    record.delay("warm-up").get(timeout=60)
    wait_for(lambda: waiting_on(db, "celery"), 30, "the idle worker to wait on LISTEN")
    with psycopg.connect(db_dsn) as pg, pg.transaction():
        result = record.apply_async(("woken",), connection=kombu_pgmq.using(pg))
        time.sleep(1.5)  # not before the commit
        committed_at = pg.execute("SELECT clock_timestamp()").fetchone()[0]
    assert result.get(timeout=30) == "woken"
    started = runs(db, result.id)[0]["started_at"]
    delay = (started - committed_at).total_seconds()
    assert 0 < delay < 10.0, delay


def test_an_open_application_transaction_does_not_hold_up_a_worker(start_worker, app, db, db_dsn):
    record = app.tasks["e2e.record"]
    with psycopg.connect(db_dsn) as pg:
        with pg.transaction():
            pending = record.apply_async(("pending",), connection=kombu_pgmq.using(pg))
            start_worker()  # declares, registers its consumers, runs its ping task
            assert record.delay("meanwhile").get(timeout=60) == "meanwhile"
            assert runs(db, pending.id) == []
        assert pending.get(timeout=60) == "pending"
    wait_for(lambda: len(runs(db, pending.id)) == 1, 30, "one run of the committed task")
