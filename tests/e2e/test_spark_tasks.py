"""End to end: Celery tasks with ``base=SparkTask`` in real prefork workers, against the
test session's local Spark Connect server (``local[2]``).

Cancellation is asserted from Spark's side: the server's log line "Asked to cancel jobs
with tag SparkConnect_OperationTag_User__Session_<session id>_..." names the task's
deterministic session, and Spark then kills the job's tasks.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.result import AsyncResult

from kombu_pgmq.spark import PROGRESS, session_id
from tests.e2e.helpers import Worker, runs, wait_for

pytestmark = pytest.mark.spark

RESULT_TIMEOUT_S = 120.0


def _log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _cancel_lines(log: Path, offset: int, sid: str) -> list[str]:
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    pattern = re.compile(rf"Asked to cancel jobs with tag \S*Session_{re.escape(sid)}_")
    return [line for line in text.splitlines() if pattern.search(line)]


def _wait_cancelled(log: Path, offset: int, sid: str, timeout: float) -> float:
    """Seconds until the server logged the cancellation of session *sid*'s jobs."""
    t0 = time.monotonic()
    while not _cancel_lines(log, offset, sid):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"Spark did not cancel session {sid} within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def _meta(result: AsyncResult) -> tuple[str, Any]:
    """State and info read together (``result.state`` then ``result.info`` are two reads)."""
    meta = result.backend.get_task_meta(result.id)
    return meta["status"], meta["result"]


def _wait_progress(result: AsyncResult, timeout: float = RESULT_TIMEOUT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state, info = _meta(result)
        if state == PROGRESS and info and info.get("total_tasks"):
            return dict(info)
        if state in ("SUCCESS", "FAILURE", "REVOKED"):
            raise AssertionError(f"task ended before reporting progress: {state}")
        if time.monotonic() > deadline:
            raise AssertionError("no PROGRESS state")
        time.sleep(0.05)


@pytest.mark.slow
def test_spark_tasks_share_one_local_server_and_report_progress(
    spark_server: dict[str, Any],
    start_worker: Callable[..., Worker],
    app: Celery,
    db: psycopg.Connection,
) -> None:
    from kombu_pgmq.spark import server

    server_pid = server.status(spark_server["port"])["pid"]
    start_worker()
    # Both pool processes run Spark tasks at once, on the one server the fixture started.
    sums = [app.tasks["e2e.spark_sum"].delay(n) for n in (10, 1000)]
    slow = app.tasks["e2e.spark_sleep"].delay(8, 1000)  # 8 Spark tasks on 2 cores: ~4 s
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while time.monotonic() < deadline:
        state, info = _meta(slow)
        if state == PROGRESS and (not seen or seen[-1] != info):
            seen.append(dict(info))
        elif state != PROGRESS and seen:
            break
        time.sleep(0.05)
    assert slow.get(timeout=5)["rows"] == 8
    assert [s.get(timeout=RESULT_TIMEOUT_S) for s in sums] == [45, 499500]
    assert seen, "PROGRESS was never reported"
    assert {s["total_tasks"] for s in seen} == {8}, seen
    completed = [s["completed_tasks"] for s in seen]
    assert completed == sorted(completed), seen
    assert any(0 < c < 8 for c in completed), f"no intermediate progress: {seen}"
    assert len(runs(db, slow.id)) == 1
    # The pool processes used the running server: none started or replaced it.
    assert server.status(spark_server["port"])["pid"] == server_pid


def test_revoke_terminate_cancels_the_spark_job(
    spark_server: dict[str, Any],
    start_worker: Callable[..., Worker],
    app: Celery,
    db: psycopg.Connection,
) -> None:
    start_worker()
    result = app.tasks["e2e.spark_sleep"].delay(2, 120_000)
    _wait_progress(result)
    log = spark_server["log"]
    offset = _log_size(log)
    app.control.revoke(result.id, terminate=True)
    # How fast (~0.1 s): benchmarks/spark_cancel.py.
    elapsed = _wait_cancelled(log, offset, session_id(result.id), timeout=30)
    print(f"revoke -> Spark cancel: {elapsed:.3f} s")
    wait_for(lambda: result.state == "REVOKED", 30, "state REVOKED")


def _seconds_to_cancel_with(
    limit: dict[str, float], log: Path, app: Celery, db: psycopg.Connection
) -> tuple[AsyncResult, float]:
    """Run a long Spark task with the time limit *limit*; seconds from the task's start
    (server clock) until Spark logged the cancellation of its session."""
    offset = _log_size(log)
    result = app.tasks["e2e.spark_sleep"].apply_async((2, 120_000), **limit)
    _wait_progress(result)
    started = runs(db, result.id)[0]["started_at"]
    _wait_cancelled(log, offset, session_id(result.id), timeout=30)
    now = db.execute("SELECT clock_timestamp()").fetchone()[0]
    return result, (now - started).total_seconds()


@pytest.mark.slow
def test_soft_time_limit_cancels_the_spark_job(
    spark_server: dict[str, Any],
    start_worker: Callable[..., Worker],
    app: Celery,
    db: psycopg.Connection,
) -> None:
    start_worker()
    result, cancelled_after = _seconds_to_cancel_with(
        {"soft_time_limit": 4}, spark_server["log"], app, db
    )
    print(f"task start -> Spark cancel: {cancelled_after:.3f} s (soft limit 4 s)")
    # Not before the limit (how soon after it: benchmarks/spark_cancel.py).
    assert cancelled_after >= 3.5
    with pytest.raises(Exception, match="SoftTimeLimitExceeded"):
        result.get(timeout=30, propagate=True)


def test_hard_time_limit_cancels_the_spark_job(
    spark_server: dict[str, Any],
    start_worker: Callable[..., Worker],
    app: Celery,
    db: psycopg.Connection,
) -> None:
    """The pool kills the process at the hard limit (SIGTERM, SIGKILL 0.1 s later): the
    process interrupts its session on SIGTERM, the main process once more afterwards."""
    start_worker()
    result, cancelled_after = _seconds_to_cancel_with(
        {"time_limit": 4}, spark_server["log"], app, db
    )
    print(f"task start -> Spark cancel: {cancelled_after:.3f} s (hard limit 4 s)")
    # Not before the limit (how soon after it: benchmarks/spark_cancel.py).
    assert cancelled_after >= 3.5
    wait_for(lambda: result.state == "FAILURE", 30, "state FAILURE")
    assert "TimeLimitExceeded" in repr(result.info)


@pytest.mark.slow
def test_kill9_of_the_pool_process_interrupts_the_orphaned_spark_job(
    spark_server: dict[str, Any],
    start_worker: Callable[..., Worker],
    app: Celery,
    db: psycopg.Connection,
) -> None:
    worker = start_worker()
    result = app.tasks["e2e.spark_sleep"].delay(2, 120_000)
    _wait_progress(result)
    pid = runs(db, result.id)[0]["pid"]
    log = spark_server["log"]
    offset = _log_size(log)
    os.kill(pid, signal.SIGKILL)
    # The worker's main process interrupts the session from a subprocess (Spark Connect
    # would otherwise run the job on, detached, for minutes).
    elapsed = _wait_cancelled(log, offset, session_id(result.id), timeout=30)
    print(f"kill -9 -> Spark cancel: {elapsed:.3f} s")
    assert worker.alive()
    wait_for(lambda: result.state == "FAILURE", 30, "state FAILURE")
    assert "WorkerLostError" in repr(result.info)


@pytest.mark.slow
def test_spark_job_longer_than_the_visibility_timeout_runs_once(
    spark_server: dict[str, Any],
    start_worker: Callable[..., Worker],
    app: Celery,
    db: psycopg.Connection,
) -> None:
    # VT 5 s (leases renewed every 5/3 s: a renewal may come ~3 s late on a loaded
    # machine and still be in time); the job takes ~11 s (2 Spark tasks of 11 s on 2
    # cores), two VTs; the other pool process polls the queue all along and would take
    # the message if its lease lapsed.
    start_worker(KPT_VISIBILITY_TIMEOUT="5")
    result = app.tasks["e2e.spark_sleep"].delay(2, 11_000)
    assert result.get(timeout=RESULT_TIMEOUT_S)["runs"] == 1
    assert len(runs(db, result.id)) == 1
    row = db.execute(
        "SELECT read_ct FROM pgmq.a_celery WHERE headers->>'id' = %s", (result.id,)
    ).fetchone()
    assert row is not None and row[0] == 1
