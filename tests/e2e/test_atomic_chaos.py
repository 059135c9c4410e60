"""Exactly-once effects under faults (:class:`kombu_pgmq.AtomicTask`): 3,000
``chaos.count`` tasks (``KPT_ATOMIC_CHAOS_TASKS`` sets another number, such as the
benchmark's 10,000; the suite's size leaves the 2 cores to the tests beside it), each
adding 1 to one counter row and inserting its ``n`` in its transaction, run by 2 workers x
4 prefork processes while a worker is SIGKILLed every 2-3 s until the last task is
applied, and PostgreSQL crashes once and starts again. The counter ends at exactly the
number of tasks, each ``n`` is applied once, every result is SUCCESS, and the queue is
empty. The same run with plain ``acks_late`` tasks (``chaos.count_plain``, which applies
some tasks twice) is ``benchmarks/chaos.py --modes count,count_plain``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import chaos
from tests.support import pgserver

#: As test_chaos: synchronous commits, fsync off (only PostgreSQL crashes, not the machine).
SETTINGS = {**pgserver.TEST_SETTINGS, "synchronous_commit": "on"}
TASKS = int(os.environ.get("KPT_ATOMIC_CHAOS_TASKS") or 3_000)


@pytest.fixture
def crashable_server() -> Any:
    with pgserver.throwaway_server(SETTINGS, "chaos") as server:
        yield server


@pytest.mark.slow
@pytest.mark.heavy
def test_every_task_applied_once_when_workers_are_killed_and_postgresql_crashes(
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
            task="count",
            tasks=TASKS,
            workers=2,
            concurrency=4,
            kill_every_s=2.0,
            kill_jitter_s=1.0,
            kill_until_done=True,
            kill_tail_s=0.0,
            crash=crash,
            settle_timeout_s=240.0,
            workdir=tmp_path,
        )
    )
    report = json.dumps({k: v for k, v in result.as_dict().items() if k != "kill_times"}, indent=1)
    assert not [e for e in result.errors if e.startswith(("run:", "crash:", "account:"))], report
    assert result.crashes == 1 and result.kills >= 2, report  # the faults happened
    # the publisher retries on a lost connection: only the publish in flight at the crash
    # may fail (see test_chaos)
    assert result.published + result.publish_errors == TASKS, report
    assert result.publish_errors <= 1, report
    assert result.unapplied == 0, report  # every published task applied
    # and none twice: one row per n, the counter moved once per task
    assert result.applied_duplicates == 0 and result.applied_twice_sample == [], report
    assert result.applied_distinct == result.published + result.executed_unpublished, report
    assert result.counter == result.applied_rows == result.applied_distinct, report
    if result.publish_errors == 0:
        assert result.counter == TASKS, report
    assert result.results == {"SUCCESS": result.published}, report
    assert result.queue_left == 0, report
