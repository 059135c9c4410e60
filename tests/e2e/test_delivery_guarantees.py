"""End to end, real ``celery worker`` subprocesses: lease renewal, kill -9 recovery,
countdown via PGMQ's native delay, priorities, poison tasks to the dead-letter queue,
a killed database connection during renewals."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg
import pytest
from celery import Celery

from kombu_pgmq.dlq import DeadLetterQueue
from tests.e2e import celery_app
from tests.e2e.helpers import REPO_ROOT, Worker, runs, wait_for
from tests.support import pgserver

RESULT_TIMEOUT_S = 30.0


def _parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _queue(db: psycopg.Connection, table: str = "q_celery") -> list[tuple]:
    return db.execute(
        f"SELECT msg_id, read_ct, headers->>'id', vt FROM pgmq.{table} ORDER BY msg_id"
    ).fetchall()


#: Lease renewal interval of the tests where a late renewal would mean a duplicate: with
#: a 2 s visibility timeout a renewal may come 1.75 s late (the default, VT / 3, leaves a
#: loaded 2-core machine 1.33 s).
RENEWAL_S = "0.25"


@pytest.mark.slow
def test_task_running_five_times_the_visibility_timeout_runs_once(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    vt = 2
    # Two workers: the idle one reads the queue all along, and must not get the message.
    start_worker(KPT_VISIBILITY_TIMEOUT=str(vt), KPT_LEASE_RENEWAL_INTERVAL=RENEWAL_S)
    start_worker(KPT_VISIBILITY_TIMEOUT=str(vt), KPT_LEASE_RENEWAL_INTERVAL=RENEWAL_S)
    result = app.tasks["e2e.record_and_sleep"].delay(5 * vt, 0.0)
    assert result.get(timeout=RESULT_TIMEOUT_S + 5 * vt)["runs"] == 1
    assert len(runs(db, result.id)) == 1
    wait_for(lambda: not _queue(db), RESULT_TIMEOUT_S, "the ack")
    assert [r[1] for r in _queue(db, "a_celery") if r[2] == result.id] == [1]


@pytest.mark.slow
def test_killed_worker_task_runs_again_within_one_visibility_timeout(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    vt = 3
    workers = [start_worker(KPT_VISIBILITY_TIMEOUT=str(vt)) for _ in range(2)]
    # First run sleeps 60 s (killed mid-task); the redelivered run 0.2 s.
    result = app.tasks["e2e.record_and_sleep"].delay(60, 0.2)
    [first_run] = wait_for(lambda: runs(db, result.id), RESULT_TIMEOUT_S, "the first run")
    holder = next(w for w in workers if w.pid == _parent_pid(first_run["pid"]))
    survivor = next(w for w in workers if w is not holder)
    time.sleep(2.5 * vt)  # renewed meanwhile: not delivered again
    assert len(runs(db, result.id)) == 1
    holder.kill()
    (killed_at,) = db.execute("SELECT clock_timestamp()").fetchone() or ()

    assert result.get(timeout=RESULT_TIMEOUT_S)["runs"] == 2
    attempts = runs(db, result.id)
    assert [a["redelivered"] for a in attempts] == [False, True]
    delay = (attempts[1]["started_at"] - killed_at).total_seconds()
    print(f"redelivery delay after kill -9: {delay:.2f} s (visibility timeout {vt} s)")
    # The last renewal was at most vt/3 before the kill: the lease ends within
    # (2/3 vt, vt] after it; the survivor's fallback poll adds up to 1 s.
    assert vt / 3 < delay <= vt + 1.5
    wait_for(lambda: not _queue(db), RESULT_TIMEOUT_S, "the ack")
    assert survivor.alive()


def test_countdown_of_three_visibility_timeouts_runs_once_on_time(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    vt = 2
    start_worker(KPT_VISIBILITY_TIMEOUT=str(vt))
    eta = datetime.now(timezone.utc) + timedelta(seconds=3 * vt)
    result = app.tasks["e2e.record_and_sleep"].apply_async((0.0,), eta=eta)
    # Waiting in the queue table (PGMQ's native delay), not in the worker's memory.
    time.sleep(1.0)
    [(_, read_ct, task_id, visible_at)] = _queue(db)
    assert (read_ct, task_id) == (0, result.id)
    assert eta - timedelta(seconds=3.5) <= visible_at <= eta
    assert result.get(timeout=RESULT_TIMEOUT_S)["runs"] == 1
    [run] = runs(db, result.id)
    print(f"countdown task started {(run['started_at'] - eta).total_seconds():+.3f} s from ETA")
    assert abs(run["started_at"] - eta) <= timedelta(seconds=1)


def test_a_worker_fed_random_rows_runs_the_tasks_among_them_and_never_stops(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    """The fault suite's fuzz under Celery: 300 random rows inserted by SQL
    (tests/support/fuzz_rows.py: envelopes of every wrong shape, unknown encodings,
    valid Kombu messages that are no Celery task) among 20 real tasks. The worker runs
    every task, never stops, and each row ends settled: archived (Celery acked it, e.g.
    a body it could not decode), or in the dead-letter queue (undecodable before any
    callback; or rejected by Celery as an unknown message)."""
    from tests.support import fuzz_rows

    add = app.tasks["e2e.add"]
    results = [add.delay(i, 1) for i in range(10)]  # declares the queue
    for message, headers, _ in fuzz_rows.rows(300, seed=2025):
        db.execute("SELECT pgmq.send('celery', %s::jsonb, %s::jsonb)", (message, headers))
    results += [add.delay(i, 1) for i in range(10, 20)]
    worker = start_worker()
    assert [r.get(timeout=RESULT_TIMEOUT_S) for r in results] == [i + 1 for i in range(20)]
    wait_for(lambda: not _queue(db), 60, "every row settled")
    (archived,) = db.execute("SELECT count(*) FROM pgmq.a_celery").fetchone() or ()
    (dead,) = db.execute("SELECT count(*) FROM pgmq.q_kombu_pgmq_dlq").fetchone() or ()
    assert archived + dead == 320
    assert worker.alive()
    assert "Unrecoverable error" not in worker.log()


def test_a_due_countdown_task_wakes_the_worker_not_its_fallback_poll(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker], e2e_env: dict
) -> None:
    """Due messages wake consumers in Celery's event loop too: with a 30 s fallback poll and no ETA
    lead, a countdown task becomes visible in its queue table and the idle worker reads
    it then (a timer at the due time the publish announced), not 30 s later."""
    settings = {"KPT_POLLING_INTERVAL": "30", "KPT_ETA_LEAD_SECONDS": "0"}
    start_worker(**settings)
    publisher = celery_app.create_app({**e2e_env, **settings})
    try:
        eta = datetime.now(timezone.utc) + timedelta(seconds=3)
        result = publisher.tasks["e2e.record_and_sleep"].apply_async((0.0,), eta=eta)
        assert result.get(timeout=RESULT_TIMEOUT_S)["runs"] == 1
    finally:
        publisher.close()
    [run] = runs(db, result.id)
    late = (run["started_at"] - eta).total_seconds()
    print(f"countdown task started {late:+.3f} s from its ETA (fallback poll: 30 s)")
    assert -0.5 <= late <= 2.0


def test_priority_order_under_a_backlog(
    db: psycopg.Connection, start_worker: Callable[..., Worker], e2e_env: dict[str, str]
) -> None:
    settings = {"KPT_MAX_PRIORITY": "9", "KPT_PREFETCH_MULTIPLIER": "1"}
    start_worker(extra_args=["-c", "1"], **settings)
    publisher = celery_app.create_app({**e2e_env, **settings})
    sleep_task = publisher.tasks["e2e.record_and_sleep"]
    blocker = sleep_task.delay(2.0)
    wait_for(lambda: runs(db, blocker.id), RESULT_TIMEOUT_S, "the blocker to run")
    # The worker's single prefetch slot is taken: these wait in the queue's bands.
    priorities = [3, 0, 9, 5, 9, 1, 7, 0, 5, 3, 8, 6]
    results = [sleep_task.apply_async((0.0,), priority=p) for p in priorities]
    try:
        for r in results:
            r.get(timeout=RESULT_TIMEOUT_S)
    finally:
        publisher.close()
    order = [
        row[0]
        for row in db.execute(
            "SELECT task_id FROM e2e_runs WHERE task_id <> %s ORDER BY id", (blocker.id,)
        ).fetchall()
    ]
    by_id = {r.id: (p, i) for i, (r, p) in enumerate(zip(results, priorities, strict=True))}
    ran = [by_id[task_id] for task_id in order if task_id in by_id]
    # highest priority first, FIFO (publish order) within a priority
    assert ran == sorted(ran, key=lambda pi: (-pi[0], pi[1]))


def test_task_crashing_its_worker_process_is_dead_lettered_after_max_deliveries(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker], db_dsn: str
) -> None:
    worker = start_worker(KPT_MAX_DELIVERIES="3")
    poison = app.tasks["e2e.crash"].delay()
    with DeadLetterQueue(db_dsn) as dlq:
        [letter] = wait_for(dlq.list, 60, "the poison task in the dead-letter queue")
    assert (letter.queue, letter.reason, letter.task_id) == ("celery", "max_deliveries", poison.id)
    assert len(runs(db, poison.id)) == 3  # three deliveries, each killed its process
    assert letter.deliveries == 3 and letter.read_ct == 4
    assert not [r for r in _queue(db) if r[2] == poison.id]
    # The worker keeps serving others.
    assert app.tasks["e2e.add"].delay(20, 22).get(timeout=RESULT_TIMEOUT_S) == 42
    assert worker.alive()


def test_rows_no_worker_can_decode_never_stop_the_queue(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker], db_dsn: str
) -> None:
    """Rows naming a body encoding kombu does not know (``rot13``, ``BASE64``) are each
    dead-lettered alone (reason ``undecodable``, with the error) and the worker runs the
    rest. Raised out of the worker's event loop ("Unrecoverable error"), they would stop
    it on every start, and the tasks behind them would never run."""
    add = app.tasks["e2e.add"]
    first = add.delay(1, 1)  # declares the queue
    for encoding in ("rot13", "BASE64"):
        envelope = {
            "x-kombu": {
                "content-type": "application/json",
                "content-encoding": "utf-8",
                "body-encoding": encoding,
                "properties": {},
            }
        }
        db.execute(
            "SELECT pgmq.send('celery', %s::jsonb, %s::jsonb)",
            ('"cm90MTM="', json.dumps({"task": "e2e.add", "id": encoding, **envelope})),
        )
    later = [add.delay(i, i) for i in range(5)]
    worker = start_worker()
    assert first.get(timeout=RESULT_TIMEOUT_S) == 2
    assert [r.get(timeout=RESULT_TIMEOUT_S) for r in later] == [0, 2, 4, 6, 8]
    with DeadLetterQueue(db_dsn) as dlq:
        letters = wait_for(lambda: len(dlq.list()) == 2 and dlq.list(), 30, "2 dead letters")
    assert sorted((d.reason, d.task_id) for d in letters) == [
        ("undecodable", "BASE64"),
        ("undecodable", "rot13"),
    ]
    assert all(d.headers["x-dead-letter"]["error"] for d in letters)
    assert worker.alive()
    assert "Unrecoverable error" not in worker.log()


def test_a_message_celery_itself_cannot_handle_is_dead_lettered_not_fatal(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker], db_dsn: str
) -> None:
    """A valid Kombu message with a ``task`` header, no ``id`` and a body that is no
    Celery payload makes Celery's own ``on_task_received`` raise (``KeyError: 'id'``,
    then ``TypeError``) out of the event loop: "Unrecoverable error", the worker exits,
    and the restored message ends every next worker. The transport dead-letters it
    alone (reason ``consumer_error``, with the error) and the worker runs the rest."""
    from kombu_pgmq import _encoding

    add = app.tasks["e2e.add"]
    first = add.delay(1, 1)  # declares the queue
    stored, headers = _encoding.encode(
        {
            "body": "false",
            "content-type": "application/json",
            "content-encoding": "utf-8",
            "headers": {"task": "no.such.task"},
            "properties": {"delivery_info": {"exchange": "", "routing_key": "celery"}},
        }
    )
    db.execute("SELECT pgmq.send('celery', %s::jsonb, %s::jsonb)", (stored, headers))
    later = [add.delay(i, i) for i in range(5)]
    worker = start_worker()
    assert first.get(timeout=RESULT_TIMEOUT_S) == 2
    assert [r.get(timeout=RESULT_TIMEOUT_S) for r in later] == [0, 2, 4, 6, 8]
    with DeadLetterQueue(db_dsn) as dlq:
        [letter] = wait_for(lambda: dlq.list(), 30, "1 dead letter")
    assert letter.reason == "consumer_error" and letter.task == "no.such.task"
    assert "TypeError" in letter.headers["x-dead-letter"]["error"]
    assert worker.alive()
    assert "Unrecoverable error" not in worker.log()


@pytest.mark.slow
def test_database_connections_killed_during_renewals_cause_no_duplicate(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    vt = 2
    worker = start_worker(KPT_VISIBILITY_TIMEOUT=str(vt), KPT_LEASE_RENEWAL_INTERVAL=RENEWAL_S)
    result = app.tasks["e2e.record_and_sleep"].delay(4 * vt, 0.0)
    wait_for(lambda: runs(db, result.id), RESULT_TIMEOUT_S, "the task to start")
    for _ in range(2):
        killed = db.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE 'kombu_pgmq%'"
        ).fetchone()[0]
        # the transport's connections (statements, LISTEN, leases...): not the result
        # backend's (Celery's SQLAlchemy backend logs its own retries with a traceback)
        assert killed >= 2
        time.sleep(1.5 * vt)  # past the visibility timeout
    assert result.get(timeout=RESULT_TIMEOUT_S)["runs"] == 1
    assert len(runs(db, result.id)) == 1
    wait_for(lambda: not _queue(db), RESULT_TIMEOUT_S, "the ack")
    assert [r[1] for r in _queue(db, "a_celery") if r[2] == result.id] == [1]
    # Recovered by itself: still consuming, no restart of its consumer needed.
    assert app.tasks["e2e.add"].delay(1, 2).get(timeout=RESULT_TIMEOUT_S) == 3
    assert worker.alive()
    log = worker.log()
    assert "Traceback" not in log
    assert "lost the lease" not in log


@pytest.mark.slow
def test_database_restart_during_a_long_task_causes_no_duplicate(tmp_path: Path) -> None:
    """A real outage: the worker's PostgreSQL server restarts (``pg_ctl restart -m
    fast``, every connection gone for about a second) while a task runs. Leases resume
    after the restart; the task runs once and the worker recovers by itself."""
    try:
        server = pgserver.start_server()
    except pgserver.EmbeddedPostgresMissing as exc:
        pytest.skip(str(exc))
    worker = None
    try:
        url = pgserver.database_url(server.dsn, "restart")
        with psycopg.connect(server.dsn, autocommit=True) as admin:
            admin.execute("CREATE DATABASE restart")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_")}
        env.update(
            KPT_BROKER_URL=url,
            KPT_VISIBILITY_TIMEOUT="10",
            PYTHONPATH=str(REPO_ROOT),
            PYTHONUNBUFFERED="1",
        )
        app = celery_app.create_app(env)
        app.backend.ResultSession().close()
        with psycopg.connect(url, autocommit=True) as db:
            db.execute(celery_app.RUNS_DDL)
        worker = Worker("restart", env, tmp_path / "worker_restart.log")
        worker.start()
        worker.wait_ready(app)
        task_id = app.tasks["e2e.record_and_sleep"].delay(14, 0.0).id
        app.close()

        def rows(query: str) -> list[tuple]:
            with psycopg.connect(url, autocommit=True) as db:
                return db.execute(query, (task_id,)).fetchall()

        run_rows = "SELECT 1 FROM e2e_runs WHERE task_id = %s"
        wait_for(lambda: rows(run_rows), RESULT_TIMEOUT_S, "the task to start")
        time.sleep(2.0)
        server._pg_ctl("-m", "fast", "restart")  # every connection is cut
        archived = "SELECT read_ct FROM pgmq.a_celery WHERE headers->>'id' = %s"
        assert wait_for(lambda: rows(archived), 40, "the task's ack") == [(1,)]
        assert len(rows(run_rows)) == 1
        log = worker.log()
        assert "database connection re-established" in log
        assert "lost the lease" not in log
        # Still serving, no restart of its consumer.
        app = celery_app.create_app(env)
        try:
            assert app.tasks["e2e.add"].delay(2, 5).get(timeout=RESULT_TIMEOUT_S) == 7
        finally:
            app.close()
        assert worker.alive()
    finally:
        if worker is not None:
            worker.stop()
        server.stop()


@pytest.mark.slow
def test_locked_table_and_open_enqueue_transaction_starve_no_lease(
    app: Celery, db: psycopg.Connection, db_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Workers start while an application's transaction that enqueued stays
    open; while one runs a task of 4 x VT, a session holds ACCESS EXCLUSIVE on the table
    the heartbeats write for 3 x VT. The task runs exactly once (the other worker reads
    the queue all along): leases renew on a connection of their own."""
    vt = 2
    env = {
        "KPT_VISIBILITY_TIMEOUT": str(vt),
        "KPT_CONSUMER_HEARTBEAT_INTERVAL": "0.5",
        "KPT_LEASE_RENEWAL_INTERVAL": RENEWAL_S,
    }
    with app.connection_for_write() as conn:
        app.amqp.queues[app.conf.task_default_queue](conn.default_channel).declare()
    with psycopg.connect(db_dsn) as producer:  # left open until the end, then rolled back
        producer.execute("SELECT kombu_pgmq.publish('celery', '{\"n\": 1}', '{}')")
        start_worker(**env)
        start_worker(**env)
        result = app.tasks["e2e.record_and_sleep"].delay(4 * vt, 0.0)
        wait_for(lambda: runs(db, result.id), RESULT_TIMEOUT_S, "the first run")
        with psycopg.connect(db_dsn) as locker:
            locker.execute("LOCK TABLE kombu_pgmq.consumers IN ACCESS EXCLUSIVE MODE")
            time.sleep(3 * vt)
            locker.rollback()
        assert result.get(timeout=RESULT_TIMEOUT_S)["runs"] == 1
        producer.rollback()
    assert len(runs(db, result.id)) == 1
    wait_for(lambda: not _queue(db), RESULT_TIMEOUT_S, "the ack")
    assert [r[1] for r in _queue(db, "a_celery") if r[2] == result.id] == [1]
