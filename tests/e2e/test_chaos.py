"""Fault injection in CI: Celery workers SIGKILLed every 2 s and PostgreSQL
crashed (``pg_ctl stop -m immediate``) while 2,000 ``acks_late`` tasks are published
and run: every published task runs, none is lost. The full-size run (4 workers x
20,000 tasks, against Redis and RabbitMQ too) is ``benchmarks/chaos.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.e2e import chaos
from tests.support import pgserver

#: Commits are synchronous (a publish that returned survives the crash); fsync stays off
#: for speed: only PostgreSQL crashes here, not the machine, so the OS keeps its writes.
SETTINGS = {**pgserver.TEST_SETTINGS, "synchronous_commit": "on"}


@pytest.fixture
def crashable_server() -> Any:
    with pgserver.throwaway_server(SETTINGS, "chaos") as server:
        yield server


@pytest.mark.slow
@pytest.mark.heavy
def test_no_task_lost_when_workers_are_killed_and_postgresql_crashes(
    crashable_server: pgserver.LocalServer, tmp_path: Path
) -> None:
    server = crashable_server

    def crash() -> None:
        server.crash()
        time.sleep(3)
        server.start_again()

    result = chaos.run(
        chaos.ChaosConfig(
            broker_url=server.dsn.replace("/postgres?", "/chaos?"),
            transport_options={"visibility_timeout": 5},
            tasks=2_000,
            workers=2,
            concurrency=2,
            kill_every_s=2.0,
            kill_tail_s=2.0,
            crash=crash,
            task_ms=2,
            settle_timeout_s=120.0,
            workdir=tmp_path,
        )
    )
    report = json.dumps(result.as_dict(), indent=1)
    assert not [e for e in result.errors if e.startswith(("run:", "crash:"))], report
    assert result.crashes == 1 and result.kills >= 2, report  # the faults happened
    assert result.published + result.publish_errors == 2_000, report
    # One publisher thread publishes one task at a time, each with kombu's retry on a lost
    # connection (120 retries, up to 1 s apart: ~2 min, against ~3 s down plus crash
    # recovery). Workers' SIGKILLs never touch the publisher's connection. So the only
    # publish the crash can fail is the one in flight when PostgreSQL went down (an
    # ambiguous answer); every other task must be published.
    assert result.publish_errors <= 1, report
    assert result.lost == 0, report  # every published task ran
    assert result.distinct >= result.published, report


@pytest.mark.slow
@pytest.mark.heavy
def test_no_task_lost_when_workers_are_killed_behind_a_held_snapshot(
    crashable_server: pgserver.LocalServer, tmp_path: Path
) -> None:
    """The same faults without the crash, while a session sits idle in a REPEATABLE READ
    transaction for the whole run: every row version the deliveries, acks and kills leave
    stays, and the reads start at their positions (a message handed back by a lapsed
    visibility timeout comes due below them). Every published task runs."""
    url = crashable_server.dsn.replace("/postgres?", "/chaos?")
    with psycopg.connect(url, application_name="report_job") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class")
        result = chaos.run(
            chaos.ChaosConfig(
                broker_url=url,
                transport_options={"visibility_timeout": 5},
                tasks=1_500,
                workers=2,
                concurrency=2,
                # kills go on for the publishing (under a second) and 4 s more: >= 3
                kill_every_s=1.0,
                kill_tail_s=4.0,
                task_ms=2,
                settle_timeout_s=120.0,
                workdir=tmp_path,
            )
        )
        with psycopg.connect(url, autocommit=True) as observer:
            holding = observer.execute(
                "SELECT backend_xmin IS NOT NULL, state FROM pg_stat_activity WHERE pid = %s",
                (holder.info.backend_pid,),
            ).fetchall()
        holder.rollback()
    report = json.dumps(result.as_dict(), indent=1)
    assert holding == [(True, "idle in transaction")], holding  # held the whole run
    assert not [e for e in result.errors if e.startswith("run:")], report
    assert result.kills >= 2, report
    assert result.published == 1_500, report
    assert result.lost == 0, report
    assert result.distinct >= result.published, report
