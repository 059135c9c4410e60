"""End to end: Celery's operator commands (``celery inspect|control|status|events``) against
real ``celery worker`` subprocesses on PostgreSQL/PGMQ.

Remote control is a fanout exchange (``celery.pidbox``) bound to one auto_delete queue per
worker (``<node>.celery.pidbox``), replies a direct exchange to the caller's reply queue:
all of it is routed through ``kombu_pgmq.exchanges``/``bindings`` across processes. The
CLI is run as a subprocess where an operator would type it; ``app.control`` where the
test needs precise replies. Each test gets its own database.

The ping round trip's latency is measured by ``benchmarks/control_ping.py``, not here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu import Connection

from tests.e2e.helpers import (
    REPO_ROOT,
    WORKER_STOP_TIMEOUT_S,
    Worker,
    celery_cli,
    pgmq_queues,
    runs,
    wait_for,
)

RESULT_TIMEOUT_S = 30.0
#: Reply timeout of CLI commands addressed to one node (``-d``): they return on its reply.
CLI_REPLY_TIMEOUT_S = "20"
E2E_TASKS = [
    "e2e.add",
    "e2e.atomic_add",
    "e2e.beat_tick",
    "e2e.big",
    "e2e.chord_part",
    "e2e.crash",
    "e2e.echo",
    "e2e.fail",
    "e2e.fifo_step",
    "e2e.fifo_step_early",
    "e2e.limited_run",
    "e2e.limited_run_early",
    "e2e.on_chord_error",
    "e2e.ping",
    "e2e.record",
    "e2e.record_and_sleep",
    "e2e.record_sum",
    "e2e.retry_once",
    "e2e.spark_sleep",
    "e2e.spark_sum",
    "e2e.xsum",
]


def cli_ok(env: dict[str, str], *args: str) -> str:
    """Run a ``celery`` command that must succeed; return its stdout."""
    proc = celery_cli(env, *args)
    assert proc.returncode == 0, f"celery {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def inspect_json(env: dict[str, str], worker: Worker, command: str) -> Any:
    """``celery inspect COMMAND -d <node> --json``: the node's reply."""
    out = cli_ok(env, "inspect", command, "-d", worker.node, "-t", CLI_REPLY_TIMEOUT_S, "--json")
    replies = json.loads(out)
    assert list(replies) == [worker.node], replies
    return replies[worker.node]


def control_text(env: dict[str, str], worker: Worker, *command: str) -> str:
    """``celery control COMMAND... -d <node>`` (human output)."""
    return cli_ok(env, "control", *command, "-d", worker.node, "-t", CLI_REPLY_TIMEOUT_S)


def queue_rows(db: psycopg.Connection, pgmq_queue: str) -> list[tuple[int, int, str]]:
    """``(msg_id, read_ct, task id)`` of every message in ``pgmq.q_<pgmq_queue>``."""
    return db.execute(
        f"SELECT msg_id, read_ct, headers->>'id' FROM pgmq.q_{pgmq_queue} ORDER BY msg_id"
    ).fetchall()


def registry(db: psycopg.Connection, kombu_queue: str) -> tuple[str, bool, bool] | None:
    """``(pgmq_queue, durable, auto_delete)`` of a queue in ``kombu_pgmq.queues``."""
    row = db.execute(
        "SELECT pgmq_queue, durable, auto_delete FROM kombu_pgmq.queues WHERE queue = %s",
        (kombu_queue,),
    ).fetchone()
    return None if row is None else (row[0], row[1], row[2])


def consumer_count(db: psycopg.Connection, kombu_queue: str) -> int:
    row = db.execute(
        "SELECT count(*) FROM kombu_pgmq.consumers WHERE queue = %s", (kombu_queue,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def owned_queues(db: psycopg.Connection, kombu_queue: str) -> set[str]:
    """PGMQ names of the auto_delete queues consumed by the process consuming
    *kombu_queue* (same ``kombu_pgmq.consumers.owner``)."""
    rows = db.execute(
        "SELECT DISTINCT q.pgmq_queue FROM kombu_pgmq.consumers c"
        " JOIN kombu_pgmq.queues q USING (queue)"
        " WHERE q.auto_delete AND c.owner IN"
        " (SELECT owner FROM kombu_pgmq.consumers WHERE queue = %s)",
        (kombu_queue,),
    ).fetchall()
    return {row[0] for row in rows}


def active_queue_names(app: Celery, worker: Worker) -> set[str]:
    replies = app.control.inspect([worker.node], timeout=10).active_queues() or {}
    return {q["name"] for q in replies[worker.node]}


# -- inspect, status ------------------------------------------------------------------


@pytest.mark.slow
def test_inspect_ping_active_stats_active_queues_registered(
    app: Celery,
    db: psycopg.Connection,
    e2e_env: dict[str, str],
    start_worker: Callable[..., Worker],
) -> None:
    worker = start_worker()
    # A long task runs in a pool process while the commands are answered.
    long = app.tasks["e2e.record_and_sleep"].delay(6.0)
    started = wait_for(lambda: runs(db, long.id), RESULT_TIMEOUT_S, "the long task to start")

    (active,) = inspect_json(e2e_env, worker, "active")
    assert active["id"] == long.id
    assert active["name"] == "e2e.record_and_sleep"
    assert active["worker_pid"] == started[0]["pid"]
    assert active["acknowledged"] is False  # acks_late: still leased in pgmq.q_celery
    assert active["hostname"] == worker.node

    out = cli_ok(e2e_env, "inspect", "ping", "-d", worker.node, "-t", CLI_REPLY_TIMEOUT_S)
    assert f"->  {worker.node}: OK" in out, out
    assert re.search(r"^\s+pong$", out, re.M), out
    assert "1 node online." in out, out

    stats = inspect_json(e2e_env, worker, "stats")
    assert {"pool", "total", "broker", "pid"} <= stats.keys(), stats
    assert stats["pid"] == worker.pid
    assert stats["pool"]["max-concurrency"] == 2
    assert started[0]["pid"] in stats["pool"]["processes"]
    # The readiness ping and the long task, each accepted once.
    assert stats["total"] == {"e2e.ping": 1, "e2e.record_and_sleep": 1}, stats["total"]
    assert stats["broker"]["transport"] == "postgresql"

    queues = inspect_json(e2e_env, worker, "active_queues")
    assert sorted(q["name"] for q in queues) == sorted(["celery", worker.queue]), queues

    assert sorted(inspect_json(e2e_env, worker, "registered")) == E2E_TASKS

    assert long.get(timeout=RESULT_TIMEOUT_S)["runs"] == 1
    # (The result is stored a moment before the worker forgets the request.)
    wait_for(lambda: inspect_json(e2e_env, worker, "active") == [], 30, "no active task")


def test_status_lists_every_online_worker(
    e2e_env: dict[str, str], app: Celery, start_worker: Callable[..., Worker]
) -> None:
    workers = [start_worker(wait=False), start_worker(wait=False)]
    for worker in workers:
        worker.wait_ready(app)
    # No -d: a broadcast every worker answers; the command waits the whole timeout.
    out = cli_ok(e2e_env, "status", "-t", "5")
    for worker in workers:
        assert f"->  {worker.node}: OK" in out, out
    assert "2 nodes online." in out, out


# -- control --------------------------------------------------------------------------


@pytest.mark.slow
def test_control_add_consumer_cancel_consumer_and_rate_limit(
    app: Celery,
    db: psycopg.Connection,
    e2e_env: dict[str, str],
    start_worker: Callable[..., Worker],
) -> None:
    worker = start_worker()
    add = app.tasks["e2e.add"]
    extra = "e2e_extra"

    out = control_text(e2e_env, worker, "add_consumer", extra)
    assert f"->  {worker.node}: OK" in out and f"add consumer {extra}" in out, out
    assert extra in active_queue_names(app, worker)
    assert add.apply_async((2, 3), queue=extra).get(timeout=RESULT_TIMEOUT_S) == 5

    out = control_text(e2e_env, worker, "cancel_consumer", extra)
    assert f"no longer consuming from {extra}" in out, out
    assert active_queue_names(app, worker) == {"celery", worker.queue}

    pending = add.apply_async((20, 22), queue=extra)
    ((msg_id, _, task_id),) = queue_rows(db, extra)
    assert task_id == pending.id
    # Not consumed: for 3 s (30 polling intervals) the worker keeps running tasks from
    # its own queue while the message in e2e_extra is never read.
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        assert app.tasks["e2e.ping"].apply_async(queue=worker.queue).get(timeout=10) == "pong"
        assert queue_rows(db, extra) == [(msg_id, 0, pending.id)]
    assert pending.status == "PENDING"

    # Consuming again, the kept message runs.
    replies = app.control.add_consumer(extra, destination=[worker.node], reply=True, timeout=10)
    assert replies == [{worker.node: {"ok": f"add consumer {extra}"}}]
    assert pending.get(timeout=RESULT_TIMEOUT_S) == 42

    out = control_text(e2e_env, worker, "rate_limit", "e2e.add", "10/m")
    assert f"->  {worker.node}: OK" in out, out
    assert "new rate limit set successfully" in out, out
    registered = app.control.inspect([worker.node], timeout=10).registered("rate_limit") or {}
    assert "e2e.add [rate_limit=10/m]" in registered[worker.node], registered


def test_control_shutdown_stops_worker_and_drops_its_pidbox_queue(
    db: psycopg.Connection, e2e_env: dict[str, str], start_worker: Callable[..., Worker]
) -> None:
    # Consumers never go stale during the test: only a clean cancel can drop the queue.
    worker = start_worker(KPT_CONSUMER_STALE_AFTER="600")
    entry = registry(db, worker.pidbox_queue)
    assert entry is not None, "no pidbox queue registered"
    pidbox, durable, auto_delete = entry
    assert (durable, auto_delete) == (False, True)
    ((unlogged,),) = db.execute(
        "SELECT is_unlogged FROM pgmq.meta WHERE queue_name = %s", (pidbox,)
    ).fetchall()
    assert unlogged  # non-durable queue: UNLOGGED tables
    assert consumer_count(db, worker.pidbox_queue) == 1

    proc = celery_cli(e2e_env, "control", "shutdown", "-d", worker.node, "-t", "2")
    # The worker raises WorkerShutdown instead of replying: Celery's CLI then reports
    # "No nodes replied" (exit 69).
    assert proc.returncode in (0, 69), proc.stdout + proc.stderr
    assert worker.proc is not None
    assert worker.proc.wait(timeout=WORKER_STOP_TIMEOUT_S) == 0
    assert "Got shutdown from remote" in worker.log()

    assert registry(db, worker.pidbox_queue) is None
    assert pidbox not in pgmq_queues(db)
    assert consumer_count(db, worker.pidbox_queue) == 0
    # Durable queues stay, without consumers.
    assert {"celery", worker.queue} <= pgmq_queues(db)
    assert consumer_count(db, "celery") == 0


# -- events ---------------------------------------------------------------------------


def _restore_sigint_in_new_session() -> None:
    """Child setup: own session; default SIGINT (an ignored SIGINT would be inherited when
    the test runs in a background job, and ``celery events`` could not be interrupted)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_events_dump_shows_task_events_and_worker_heartbeats(
    app: Celery,
    db: psycopg.Connection,
    e2e_env: dict[str, str],
    start_worker: Callable[..., Worker],
) -> None:
    worker = start_worker(extra_args=["-E"], without=["gossip", "mingle"])  # heartbeats on
    dump_log = Path(worker.log_path).with_name("events_dump.log")
    node = re.escape(worker.node)
    with dump_log.open("wb") as out:
        dump = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.e2e.celery_app", "events", "--dump"],
            cwd=REPO_ROOT,
            env=e2e_env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_restore_sigint_in_new_session,
        )
    try:

        def dumped(pattern: str) -> re.Match[str] | None:
            return re.search(pattern, dump_log.read_text(errors="replace"), re.M)

        # The first heartbeat answers the receiver's wake-up broadcast: its queue is bound.
        wait_for(lambda: dumped(rf"^{node} \[.+\] heartbeat: "), 30, "a heartbeat in the dump")
        result = app.tasks["e2e.add"].delay(4, 5)
        assert result.get(timeout=RESULT_TIMEOUT_S) == 9
        task = rf"e2e\.add\({result.id}\) args=\(4, 5\) kwargs=\{{\}}"
        wait_for(
            lambda: dumped(rf"^{node} \[.+\] task succeeded: {task} .*result=9"),
            20,
            "task succeeded in the dump",
        )
        assert dumped(rf"^{node} \[.+\] task received: {task} ")
        assert dumped(rf"^{node} \[.+\] task started: {task} ")
        # A periodic worker heartbeat (every 2 s) counting both tasks (readiness ping, add).
        wait_for(
            lambda: dumped(rf"^{node} \[.+\] heartbeat: active=0, .*freq=2\.0, .*processed=2,"),
            20,
            "a periodic heartbeat counting the task",
        )

        dump.send_signal(signal.SIGINT)
        assert dump.wait(timeout=20) == 0
    except BaseException:
        print(f"--- celery events --dump output ---\n{dump_log.read_text(errors='replace')}")
        raise
    finally:
        if dump.poll() is None:
            os.killpg(dump.pid, signal.SIGKILL)
            dump.wait(timeout=10)
    # Its event queue (auto_delete) went with its consumer.
    assert not [q for q in pgmq_queues(db) if q.startswith("celeryev")]


# -- remote-control round trips ------------------------------------------------------


def test_remote_control_ping_round_trip(app: Celery, start_worker: Callable[..., Worker]) -> None:
    """Every ping is answered, by the one worker; how fast is ``benchmarks/control_ping.py``
    (timings are not asserted here: a loaded CI machine says nothing about them)."""
    worker = start_worker()
    expected = [{worker.node: {"ok": "pong"}}]
    for _ in range(20):
        assert app.control.ping(timeout=2, limit=1) == expected


# -- queue lifetime of dead workers ---------------------------------------------------

HEARTBEAT_S = 1.0
STALE_AFTER_S = 3.0
CYCLES = 6


@pytest.mark.slow
def test_queues_of_stopped_and_killed_workers_do_not_pile_up(
    app: Celery, db: psycopg.Connection, db_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Workers start and stop, half warm-stopped, half SIGKILLed; each leaves its pidbox
    queue (auto_delete) behind only if killed, until its consumers are stale and a reaper
    runs (a live worker's heartbeat thread, any connect); with no worker left, a new
    connection reaps on connect. The PGMQ queues are then those of the start again.

    (Celery enables gossip and mingle, which would add ``celeryev``/reply queues, only for
    the amqp and redis transports, so each worker has just the one auto_delete queue.)"""
    lifetimes = {
        "KPT_CONSUMER_HEARTBEAT_INTERVAL": str(HEARTBEAT_S),
        "KPT_CONSUMER_STALE_AFTER": str(STALE_AFTER_S),
    }
    live = start_worker(**lifetimes)
    baseline = pgmq_queues(db)
    live_pidbox = registry(db, live.pidbox_queue)
    assert live_pidbox is not None
    assert baseline == {"celery", live.queue, live_pidbox[0]}

    for cycle in range(CYCLES):
        worker = start_worker(own_queue=False, **lifetimes)
        own = owned_queues(db, worker.pidbox_queue)
        assert len(own) == 1, own  # its pidbox queue
        assert own <= pgmq_queues(db)
        if cycle % 2 == 0:
            assert worker.stop() == 0
            # Clean shutdown: its queues went with its consumers, at once.
            assert not own & pgmq_queues(db)
        else:
            worker.kill()
            # Its consumers are not stale yet: the queues are still there ...
            assert own <= pgmq_queues(db)

    # ... until a reaper drops them: the live worker's heartbeat thread, a later worker's
    # connect, or a connect of this process (the app's control pings).
    wait_for(
        lambda: pgmq_queues(db) == baseline,
        STALE_AFTER_S + HEARTBEAT_S + 8,
        f"the queue count to return to the baseline of {len(baseline)}",
        interval=0.2,
    )

    # No worker left: the killed live worker's queues are dropped by the next connect
    # once its consumers are stale.
    live.kill()
    durable = {"celery", live.queue}

    def reap_on_connect() -> bool:
        with Connection(db_dsn) as conn:
            conn.connect()
        return pgmq_queues(db) == durable

    wait_for(reap_on_connect, STALE_AFTER_S + HEARTBEAT_S + 5, "a connect to reap", interval=0.3)
