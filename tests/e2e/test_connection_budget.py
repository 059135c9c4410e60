"""The connection budget (``docs/connections.md``): the PostgreSQL
connections a real ``celery worker`` holds per pool type (prefork, threads, solo, gevent),
idle and after running tasks, with and without the result backend, beat (``-B``) and
events (``-E``), and those of a producer process, counted in ``pg_stat_activity``.

Each test has a database of its own, so every client backend of it is the worker's or
the test's: the test's own connections are named ``kpt_*`` (its Celery app's URL carries
``application_name=kpt_budget``; tasks write ``e2e_runs`` as ``kpt_e2e_task``) and left
out; everything else is counted by ``application_name`` (``kombu_pgmq:<role>``, see
:mod:`kombu_pgmq._db.connector`), so an unnamed connection shows up too. The budget is
exact per role, and must hold for :data:`STEADY_S` once reached; a connection added to
any role, or one held for a feature not in use, fails the test.

Worker heartbeats, leases and the consumer heartbeat run on short intervals
(``KPT_CONSUMER_HEARTBEAT_INTERVAL``, ``KPT_LEASE_RENEWAL_INTERVAL``) so each count
settles within a second or two.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from tests.e2e import celery_app
from tests.e2e.helpers import REPO_ROOT, Worker

pytestmark = [pytest.mark.e2e]

#: Longest wait for a count to reach its budget (a cold worker start on 2 cores).
SETTLE_S = 45.0
#: How long a count must then stay at its budget (every background service has run by
#: then: heartbeat and lease intervals are 0.3 s here).
STEADY_S = 1.0
#: Tasks run before the "after tasks" count.
TASKS = 20
#: Seconds between lease renewal rounds of the workers here.
LEASE_ROUND_S = 0.3

#: The budget of a worker's main process with Celery's defaults (worker heartbeat events
#: on) and no result backend: the consumer's statements, its LISTEN connection and its
#: consumer heartbeat, plus the event dispatcher's statements (Celery's second Kombu
#: connection: worker heartbeats every 2 s, task events with -E).
WORKER = {"statements": 2, "listener": 1, "heartbeat": 1}
#: gevent (and eventlet): Celery consumes remote control (pidbox) on a Kombu connection of
#: its own, with its own statements, LISTEN and consumer heartbeat.
GEVENT = {"statements": 3, "listener": 2, "heartbeat": 2}
BUDGET = {"prefork": WORKER, "threads": WORKER, "solo": WORKER, "gevent": GEVENT}


def _tagged(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


def roles(conn: psycopg.Connection) -> dict[str, int]:
    """``{role: backends}`` of the database's client backends, the test's own (``kpt_*``)
    left out; ``kombu_pgmq:`` is stripped from the names."""
    rows = conn.execute(
        "SELECT application_name, count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND backend_type = 'client backend' AND application_name NOT LIKE 'kpt\\_%'"
        " GROUP BY 1"
    ).fetchall()
    return {str(name).removeprefix("kombu_pgmq:"): int(n) for name, n in rows}


def settle(conn: psycopg.Connection, expected: dict[str, int], what: str) -> None:
    """Wait until :func:`roles` equals ``expected``, then check it stays so for
    :data:`STEADY_S` (a connection opened late, or one that lingers, fails)."""
    deadline = time.monotonic() + SETTLE_S
    seen = roles(conn)
    while seen != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: connections {seen}, budget {expected}")
        time.sleep(0.1)
        seen = roles(conn)
    until = time.monotonic() + STEADY_S
    while time.monotonic() < until:
        time.sleep(0.1)
        seen = roles(conn)
        assert seen == expected, f"{what}: connections {seen} after settling, budget {expected}"


def ran(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM e2e_runs").fetchone()
    return int(row[0]) if row else 0


def wait_ran(conn: psycopg.Connection, n: int) -> None:
    """Wait until ``n`` tasks ran, then until every message of queue ``celery`` is acked
    (see :func:`wait_acked`)."""
    deadline = time.monotonic() + SETTLE_S
    while ran(conn) < n:
        assert time.monotonic() < deadline, f"{ran(conn)} of {n} tasks ran"
        time.sleep(0.1)
    wait_acked(conn)


def wait_acked(conn: psycopg.Connection) -> None:
    """Wait until queue ``celery`` holds no message (each task's message acked), then two
    lease rounds more. A task writes its row, or its result, a moment before its message
    is acked; a lease round in that moment finds the message held and opens the lease
    connection (as it should), and the next round closes it again. Counting before then
    would see a connection that is about to go."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        row = conn.execute("SELECT count(*) FROM pgmq.q_celery").fetchone()
        if row is not None and row[0] == 0:
            break
        assert time.monotonic() < deadline, f"{row} messages of queue celery not acked"
        time.sleep(0.1)
    time.sleep(2 * LEASE_ROUND_S + 0.2)


@pytest.fixture
def budget_env(db_dsn: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_")}
    env.update(
        KPT_BROKER_URL=db_dsn,
        KPT_RESULT_BACKEND="none",
        KPT_CONSUMER_HEARTBEAT_INTERVAL="0.3",
        KPT_LEASE_RENEWAL_INTERVAL=str(LEASE_ROUND_S),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def conn(db_dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(db_dsn, autocommit=True, application_name="kpt_budget_count") as c:
        c.execute(celery_app.RUNS_DDL)
        c.execute(celery_app.BEAT_RUNS_DDL)
        yield c


@pytest.fixture
def worker(
    budget_env: dict[str, str], tmp_path: Path, reported_logs: list[Any]
) -> Iterator[Callable[..., Worker]]:
    """``worker(pool, *extra_args, without=(), concurrency=2, **env) -> Worker``: a
    started ``celery worker -P <pool> -c <concurrency>`` (Celery's defaults: worker
    heartbeat events on); killed at teardown."""
    started: list[Worker] = []

    def start(
        pool: str,
        *extra_args: str,
        without: tuple[str, ...] = (),
        concurrency: int = 2,
        **env: str,
    ) -> Worker:
        name = f"b{len(started) + 1}_{pool}"
        w = Worker(
            name,
            {**budget_env, **env},
            tmp_path / f"worker_{name}.log",
            extra_args=extra_args,
            pool=pool,
            without=without,
            own_queue=False,
            concurrency=concurrency,
        )
        started.append(w)
        reported_logs.append(w)
        w.start()
        return w

    yield start
    for w in started:
        w.kill()


@pytest.fixture
def client(budget_env: dict[str, str], db_dsn: str) -> Iterator[Callable[..., Celery]]:
    """``client(**env) -> Celery``: the test's app (its connections named ``kpt_budget``)."""
    apps: list[Celery] = []

    def make(**env: str) -> Celery:
        apps.append(
            celery_app.create_app(
                {**budget_env, **env, "KPT_BROKER_URL": _tagged(db_dsn, "kpt_budget")}
            )
        )
        return apps[-1]

    yield make
    for app in apps:
        app.close()


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["prefork", "threads", "solo", "gevent"])
def test_worker_budget_per_pool(pool, worker, client, conn):
    """Idle, after tasks, and while a task runs (its lease connection, closed again once
    nothing is held), no result backend: exactly the budget of the pool type."""
    budget = BUDGET[pool]
    worker(pool)
    settle(conn, budget, f"idle {pool} worker")
    app = client()
    for i in range(TASKS):
        app.tasks["e2e.record"].apply_async((str(i),))
    wait_ran(conn, TASKS)
    settle(conn, budget, f"{pool} worker after {TASKS} tasks")
    if pool == "prefork":  # a task held for 3 s: its lease is renewed on a connection
        app.tasks["e2e.record_and_sleep"].apply_async((3.0,))
        settle(conn, {**budget, "leases": 1}, "prefork worker holding a task")
        wait_ran(conn, TASKS + 1)
        settle(conn, budget, "prefork worker after the held task")


@pytest.mark.parametrize(
    ("pool", "results"),
    [("prefork", 2), ("threads", 1), ("gevent", 1)],
    ids=["prefork", "threads", "gevent"],
)
def test_worker_budget_with_the_result_backend(pool, results, worker, client, conn):
    """``result_backend = "postgresql://"``: nothing before a result is stored, then one
    connection per pool process (prefork), one per process for threads and gevent (not
    one per thread or task greenlet); the main process's expiry sweep holds none."""
    env = {"KPT_RESULT_BACKEND": "postgresql"}
    worker(pool, **env)
    settle(conn, BUDGET[pool], f"idle {pool} worker with the result backend")
    app = client(**env)
    for i in range(TASKS):
        app.tasks["e2e.record"].apply_async((str(i),))
    wait_ran(conn, TASKS)
    settle(conn, {**BUDGET[pool], "results": results}, f"{pool} worker storing results")


def test_prefork_children_that_publish(worker, client, conn):
    """Tasks that publish (``retry`` here; ``apply_async``, a chord's callback) open the
    producer pool's statement connection in their process: one per prefork child (one
    child here, so which child ran the tasks does not matter)."""
    worker("prefork", concurrency=1)
    settle(conn, WORKER, "idle prefork worker")
    app = client()
    for i in range(TASKS):
        app.tasks["e2e.retry_once"].apply_async((i,))
    wait_ran(conn, 2 * TASKS)  # each task ran twice: once, then its retry
    settle(conn, {**WORKER, "statements": 3}, "prefork worker whose task published")


def test_beat_and_task_events(worker, conn):
    """``-B`` with kombu_pgmq's scheduler adds the beat process's leader connection and its
    producer's statements; ``-E`` adds nothing (task events go out on the event
    dispatcher's connection, there for worker heartbeats already).

    Beat sends a task every second, so with 0.3 s lease rounds one round in a few finds
    a tick task held and opens the lease connection for it (as it should; the per-pool
    test checks that): lease renewal is off here, so the count is beat's alone."""
    worker("prefork", "-B", "-E", KPT_BEAT="1", KPT_LEASE_RENEWAL_INTERVAL="0")
    settle(conn, {**WORKER, "beat-leader": 1, "statements": 3}, "prefork worker -B -E")


def test_without_worker_heartbeats_no_event_connection(worker, conn):
    """Events off (``--without-heartbeat --without-gossip``, no ``-E``): Celery's event
    dispatcher never connects, so the worker holds one statement connection."""
    worker("prefork", without=("heartbeat", "gossip", "mingle"))
    settle(conn, {**WORKER, "statements": 1}, "prefork worker without events")


PRODUCER = """
import sys
import kombu, kombu_pgmq
with kombu.Connection(sys.argv[1]) as c:
    kombu.Producer(c).publish({"x": 1}, routing_key="budget", declare=[kombu.Queue("budget")])
    print("ready", flush=True)
    sys.stdin.read()
"""

CELERY_PRODUCER = """
import sys
from tests.e2e import celery_app
app = celery_app.create_app()
print(app.tasks["e2e.add"].delay(1, 2).get(timeout=60), flush=True)
sys.stdin.read()
"""


def _producer(code: str, env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, env["KPT_BROKER_URL"]],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() in ("ready", "3"), f"the producer failed: {line!r}"
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.communicate(timeout=10)  # reaps it and closes the pipes


def test_producer_budget(budget_env, worker, conn, db_dsn):
    """A Kombu producer holds one connection (no listener, no services: it never
    consumes); a Celery producer that waited for a result adds the result store and the
    result LISTEN connection, and nothing else."""
    proc = _producer(PRODUCER, budget_env)
    try:
        settle(conn, {"statements": 1}, "a Kombu producer")
    finally:
        _stop(proc)
    settle(conn, {}, "after the producer exited")
    env = {**budget_env, "KPT_RESULT_BACKEND": "postgresql"}
    worker("solo", without=("heartbeat", "gossip", "mingle"), **env)
    solo = {**WORKER, "statements": 1}
    settle(conn, solo, "solo worker without events")
    proc = _producer(CELERY_PRODUCER, {**env, "KPT_BROKER_URL": _tagged(db_dsn, "producer")})
    try:
        wait_acked(conn)  # get() returned (the producer printed 3): the result is stored
        settle(
            conn,
            {
                **solo,
                "results": 1,  # the worker's, storing the result
                "producer:statements": 1,
                "producer:results": 1,
                "producer:results-listener": 1,
            },
            "a Celery producer after get()",
        )
    finally:
        _stop(proc)
