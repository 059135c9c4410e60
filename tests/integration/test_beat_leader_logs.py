"""What the beat's leader election logs, and at which level (as ``celery beat`` and the
worker log: the normal course at INFO, what an operator should look at as WARNING):

- a process that starts to lead, first or after another one (stopped, killed or
  deposed): INFO ``leads now (epoch N[, after host:pid])``; following: INFO;
- a leader deposed because its heartbeat stopped (it hangs): WARNING, by the process
  that ends its session.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kombu_pgmq.beat.leader import Leader
from tests.integration.beat_helpers import TAKEOVER
from tests.support.waiting import wait_for

from .helpers import sql

LOGGER = "kombu_pgmq.beat.leader"


@pytest.fixture
def leaders(db_dsn: str) -> Iterator[list[Leader]]:
    """``Leader`` objects of 'processes' on the test database (closed at the end); each
    gets a distinct identity, as distinct processes have."""
    made: list[Leader] = []
    yield made
    for leader in made:
        leader.close()


def make(db_dsn: str, made: list[Leader], name: str) -> Leader:
    leader = Leader(db_dsn, TAKEOVER)
    leader.me = name
    made.append(leader)
    return leader


def records(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


def test_leading_is_info_first_and_after_a_leader_that_stopped_or_was_killed(
    db_dsn: str, leaders: list[Leader], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    first, second, third = (make(db_dsn, leaders, f"host:{n}") for n in (1, 2, 3))
    assert first.elect() is True
    assert second.elect() is False and third.elect() is False
    [led] = records(caplog, "host:1 leads now")
    assert led.levelno == logging.INFO
    assert led.getMessage().startswith("beat: host:1 leads now (epoch ")
    assert all(r.levelno == logging.INFO for r in records(caplog, "following host:1"))

    first.close()  # a clean stop: the lock is released
    assert second.elect() is True
    [after_stop] = records(caplog, "host:2 leads now")
    assert after_stop.levelno == logging.INFO and ", after host:1)" in after_stop.getMessage()

    third.elect()  # follows host:2
    sql(db_dsn, f"SELECT pg_terminate_backend({second.connector.backend_pid})")  # killed
    assert wait_for(third.elect, 10.0, "host:3 to lead after host:2 was killed")
    [after_kill] = records(caplog, "host:3 leads now")
    assert after_kill.levelno == logging.INFO and ", after host:2)" in after_kill.getMessage()
    assert [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING] == []


def test_deposing_a_hung_leader_is_a_warning(
    db_dsn: str, leaders: list[Leader], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    hung, other = make(db_dsn, leaders, "host:1"), make(db_dsn, leaders, "host:2")
    assert hung.elect() is True
    other.elect()
    # host:1 runs no more rounds (it hangs): its heartbeat grows stale, host:2 deposes it
    wait_for(lambda: other.elect() or (other.last and other.last.deposed), 10.0, "a deposition")
    [deposed] = records(caplog, "leader host:1 (server pid")
    assert deposed.levelno == logging.WARNING
    assert "stopped its heartbeat" in deposed.getMessage()
    assert wait_for(lambda: other.is_leader or other.elect(), 10.0, "host:2 to lead")
    [leads] = records(caplog, "host:2 leads now")
    assert leads.levelno == logging.INFO and ", after host:1)" in leads.getMessage()
