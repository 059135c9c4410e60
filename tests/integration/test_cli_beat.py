"""``kombu-pgmq beat list|add|remove|enable|disable|run-now|history|leader`` on a real
PostgreSQL: entries added from the command line with each schedule kind and option, as
JSON and as a table; a beat leading in this process (:class:`kombu_pgmq.beat.Scheduler`,
ticked as ``celery beat`` ticks it) whose ticks, catch-up, errors, run-now and leader the
commands show; a leader that stopped shown as gone (exit 1); bad input as one error line
naming the fix, and nothing stored.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kombu_pgmq import cli

from .helpers import connect, publish, sql
from .test_cli import assert_one_error_line

TASK = "beatcli.noop"
ENTRY_KEYS = {
    "name", "task", "schedule_kind", "schedule", "schedule_text", "args", "kwargs", "options",
    "enabled", "catch_up", "source", "last_run_at", "next_run_at", "total_run_count",
    "missed_ticks", "last_error", "run_requested_at", "created_at", "updated_at",
}  # fmt: skip
TICK_KEYS = {"entry", "due_at", "sent_at", "kind", "missed", "task_id", "leader", "epoch"}
LEADER_KEYS = {
    "identity",
    "backend_pid",
    "epoch",
    "since",
    "heartbeat_at",
    "heartbeat_age",
    "alive",
}


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli.main, ["beat", *args])


def ok(*args: str) -> Result:
    result = invoke(*args)
    assert result.exit_code == 0, (args, result.output, result.exception)
    return result


def json_lines(result: Result) -> list[dict[str, Any]]:
    return [json.loads(line) for line in result.stdout.splitlines()]


def entries(url: str) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in json_lines(ok("list", "--url", url, "--json"))}


def when(text: str) -> datetime:
    return datetime.fromisoformat(text)


def history(url: str, *args: str) -> list[dict[str, Any]]:
    return json_lines(ok("history", "--url", url, "--json", *args))


class Beat:
    """A :class:`kombu_pgmq.beat.Scheduler` of a Celery app (broker: ``url``; task
    :data:`TASK` registered) leading in this process; :meth:`run_until` ticks it."""

    def __init__(self, url: str) -> None:
        from celery import Celery

        from kombu_pgmq.beat import Scheduler

        app = Celery("beatcli", broker=url)
        app.conf.update(result_backend=None, result_expires=None, beat_schedule={})

        @app.task(name=TASK, shared=False)
        def noop() -> None:
            return None

        self.scheduler = Scheduler(app)

    @property
    def identity(self) -> str:
        return self.scheduler.leader.me

    def run_until(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        """Tick (each call waits at most one election round, 1 s) until ``done()``."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"not done within {timeout} s"
            self.scheduler.tick()

    def close(self) -> None:
        self.scheduler.close()


@contextlib.contextmanager
def leading_beat(url: str) -> Iterator[Beat]:
    beat = Beat(url)
    try:
        beat.run_until(lambda: beat.scheduler.leader.is_leader)
        yield beat
    finally:
        beat.close()


def test_add_every_schedule_kind_and_option_then_list(db_dsn: str) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "reports", [1])  # a queue the broker knows
    ok("add", "--url", db_dsn, "tick", TASK, "--every", "30")
    added = ok(
        "add", "--url", db_dsn, "report", "app.report", "--cron", "*/5 8-18 * * 1-5",
        "--tz", "Europe/Paris", "--args", "[1, \"a\"]", "--kwargs", '{"format": "pdf"}',
        "--queue", "reports", "--priority", "3", "--expires", "60",
        "--options", '{"countdown": 2, "priority": 9}', "--catch-up", "skip", "--disabled",
    )  # fmt: skip
    assert added.stdout.strip() == (
        "added 'report': app.report cron */5 8-18 * * 1-5 (Europe/Paris), disabled"
    )
    ok("add", "--url", db_dsn, "hourly", TASK, "--cron", "0 * * * *")
    # a solar entry as stored (adding one needs the ephem package: see the next test)
    from kombu_pgmq._db.beat import BeatStore
    from kombu_pgmq._db.connector import Connector

    with contextlib.closing(Connector(db_dsn)) as db:
        solar = {"event": "sunrise", "lat": 48.85, "lon": 2.35}
        row = {"name": "dawn", "task": TASK, "schedule_kind": "solar", "schedule": solar}
        BeatStore(db).upsert(row, replace=False)

    found = entries(db_dsn)
    assert sorted(found) == ["dawn", "hourly", "report", "tick"]
    assert all(set(e) == ENTRY_KEYS for e in found.values())
    tick, report = found["tick"], found["report"]
    assert tick["schedule_kind"] == "interval" and tick["schedule"]["every"] == 30
    assert tick["schedule_text"] == "every 30 s"
    assert tick["enabled"] is True and tick["catch_up"] == "once" and tick["source"] == "api"
    assert tick["last_run_at"] is None and tick["total_run_count"] == 0
    assert datetime.fromisoformat(tick["created_at"]).tzinfo is not None
    assert report["schedule"] == {
        "minute": "*/5", "hour": "8-18", "day_of_month": "*", "month_of_year": "*",
        "day_of_week": "1-5", "tz": "Europe/Paris",
    }  # fmt: skip
    assert report["args"] == [1, "a"] and report["kwargs"] == {"format": "pdf"}
    # the explicit options win over --options
    assert report["options"] == {"queue": "reports", "priority": 3, "expires": 60, "countdown": 2}
    assert report["enabled"] is False and report["catch_up"] == "skip"
    assert found["hourly"]["schedule_text"] == "cron 0 * * * *"
    assert found["dawn"]["schedule_text"] == "solar sunrise 48.85,2.35"

    table = ok("list", "--url", db_dsn).stdout
    for text in ("every 30 s", "cron */5 8-18 * * 1-5 (Europe/Paris)", "solar sunrise 48.85,2.35",
                 "- (disabled)", "skip", "app.report"):  # fmt: skip
        assert text in table, (text, table)
    assert "leader: none (no beat has led on this database" in table

    # the name is taken: --replace replaces (its runs kept), without it one error line
    assert_one_error_line(
        invoke("add", "--url", db_dsn, "tick", TASK, "--every", "5"), "'tick' exists", "--replace"
    )
    sql(db_dsn, "UPDATE kombu_pgmq.beat_entries SET total_run_count = 7 WHERE name = 'tick'")
    replaced = ok("add", "--url", db_dsn, "tick", TASK, "--every", "5", "--replace")
    assert replaced.stdout.strip() == f"replaced 'tick': {TASK} every 5 s"
    again = entries(db_dsn)["tick"]
    assert again["schedule_text"] == "every 5 s" and again["total_run_count"] == 7

    # run-now of a disabled entry, no beat leading: asked, with both warnings
    asked = ok("run-now", "--url", db_dsn, "report")
    assert asked.stdout.startswith("run of 'report' requested at ")
    assert "'report' is disabled" in asked.stderr and "no beat leads now" in asked.stderr
    assert entries(db_dsn)["report"]["run_requested_at"] is not None

    ok("disable", "--url", db_dsn, "tick")
    assert entries(db_dsn)["tick"]["enabled"] is False
    ok("enable", "--url", db_dsn, "tick")
    assert entries(db_dsn)["tick"]["enabled"] is True
    assert ok("remove", "--url", db_dsn, "hourly").stdout.strip() == "removed 'hourly'"
    assert "hourly" not in entries(db_dsn)


def test_bad_input_is_one_error_line_and_nothing_is_stored(db_dsn: str) -> None:
    def add(*args: str) -> Result:
        return invoke("add", "--url", db_dsn, "bad", TASK, *args)

    assert_one_error_line(add("--cron", "61 * * * *"), "'bad'", "invalid crontab", "five fields")
    assert_one_error_line(add("--cron", "* * *"), "invalid crontab", "five fields")
    assert_one_error_line(add("--cron", "* * *", "--tz", "UTC"), "invalid crontab", "five fields")
    assert_one_error_line(
        add("--cron", "0 3 * * *", "--tz", "Mars/Olympus"), "unknown time zone", "IANA"
    )
    assert_one_error_line(add("--cron", "0 3 * * *", "--tz", "Europe/Nowhere"), "Europe/Nowhere")
    assert_one_error_line(
        add("--every", "5", "--queue", "nowhere"),
        "queue 'nowhere' does not exist",
        "-Q nowhere",
    )
    assert_one_error_line(add("--every", "0"), "not positive")
    assert_one_error_line(add("--every", "5", "--args", '{"x": 1}'), "--args", "JSON list")
    assert_one_error_line(add("--every", "5", "--kwargs", "{x"), "--kwargs", "not JSON")
    assert_one_error_line(add("--every", "5", "--options", "[1]"), "--options", "JSON dict")
    assert_one_error_line(invoke("add", "--url", db_dsn, " ", TASK, "--every", "5"), "name")
    for usage in (
        add(),  # no schedule
        add("--every", "5", "--cron", "* * * * *"),  # two
        add("--every", "5", "--tz", "UTC"),  # --tz without --cron
        add("--every", "5", "--catch-up", "always"),
    ):
        assert usage.exit_code == 2, usage.output
    try:
        import ephem  # noqa: F401
    except ImportError:  # Celery's solar needs it: an error naming the package
        assert_one_error_line(add("--solar", "sunrise", "48.85", "2.35"), "solar", "ephem")
    else:
        ok("add", "--url", db_dsn, "bad", TASK, "--solar", "sunrise", "48.85", "2.35")
        ok("remove", "--url", db_dsn, "bad")
    assert_one_error_line(add("--solar", "noon", "48.85", "2.35"), "invalid solar")
    assert entries(db_dsn) == {}
    # a queue no worker declared yet: accepted with --no-check-queue
    ok("add", "--url", db_dsn, "later", TASK, "--every", "5", "--queue", "later",
       "--no-check-queue")  # fmt: skip
    assert entries(db_dsn)["later"]["options"] == {"queue": "later"}

    for command in ("remove", "enable", "disable", "run-now"):
        assert_one_error_line(
            invoke(command, "--url", db_dsn, "ghost"),
            "no periodic task named 'ghost'",
            "kombu-pgmq beat list",
        )


def test_a_leading_beat_shown_by_list_history_leader_and_run_now(db_dsn: str) -> None:
    ok("add", "--url", db_dsn, "every-second", TASK, "--every", "1")
    ok("add", "--url", db_dsn, "late", TASK, "--every", "1")
    ok("add", "--url", db_dsn, "unknown", "beatcli.missing", "--every", "1")
    ok("add", "--url", db_dsn, "daily", TASK, "--cron", "0 3 * * *")
    # "late" last ran 10 s ago (as if no beat had led since): one catch-up tick
    sql(
        db_dsn,
        "UPDATE kombu_pgmq.beat_entries SET last_run_at = clock_timestamp() - interval '10.5 s'"
        " WHERE name = 'late'",
    )
    with leading_beat(db_dsn) as beat:
        beat.run_until(lambda: len(history(db_dsn, "every-second")) >= 2)
        leader = invoke("leader", "--url", db_dsn, "--json")
        assert leader.exit_code == 0, leader.output
        info = json.loads(leader.stdout)
        assert set(info) == LEADER_KEYS
        assert info["identity"] == beat.identity and info["alive"] is True
        assert 0 <= info["heartbeat_age"] < 5

        ticks = history(db_dsn)
        assert all(set(t) == TICK_KEYS for t in ticks)
        assert {t["leader"] for t in ticks} == {beat.identity}
        sent = [t["sent_at"] for t in ticks]
        assert sent == sorted(sent, reverse=True)  # newest first
        assert "unknown" not in {t["entry"] for t in ticks}
        late = [t for t in ticks if t["entry"] == "late"]
        assert late[-1]["kind"] == "catch-up" and late[-1]["missed"] >= 5, late
        assert len(history(db_dsn, "--limit", "1")) == 1

        found = entries(db_dsn)
        every = found["every-second"]
        assert every["total_run_count"] >= 2 and every["last_error"] is None
        assert every["last_run_at"] == history(db_dsn, "every-second")[0]["due_at"]
        assert when(every["next_run_at"]) > when(every["last_run_at"])
        assert found["late"]["missed_ticks"] == sum(t["missed"] for t in late)
        assert "'beatcli.missing' is not registered" in found["unknown"]["last_error"]
        assert found["unknown"]["total_run_count"] == 0
        assert found["daily"]["next_run_at"].endswith("03:00:00+00:00")  # the app's UTC

        table = ok("list", "--url", db_dsn).stdout
        assert f"leader: {beat.identity} (epoch " in table and ", alive" in table
        assert "is not registered" in table  # the last error column

        # run-now: once, at once, kind manual; the schedule does not move
        next_run = entries(db_dsn)["daily"]["next_run_at"]
        asked = ok("run-now", "--url", db_dsn, "daily")
        assert asked.stdout.startswith("run of 'daily' requested at ")
        assert "warning" not in asked.stderr
        beat.run_until(lambda: bool(history(db_dsn, "daily")))
        (manual,) = history(db_dsn, "daily")
        assert manual["kind"] == "manual" and manual["task_id"]
        daily = entries(db_dsn)["daily"]
        assert daily["total_run_count"] == 1 and daily["next_run_at"] == next_run

        # disabled: no more ticks (the leader hears the change at once)
        ok("disable", "--url", db_dsn, "every-second")
        beat.run_until(lambda: entries(db_dsn)["every-second"]["enabled"] is False)
        beat.scheduler.tick()
        count = entries(db_dsn)["every-second"]["total_run_count"]
        stop = time.monotonic() + 2.5
        beat.run_until(lambda: time.monotonic() > stop)
        assert entries(db_dsn)["every-second"]["total_run_count"] == count

    # the beat stopped (it resigned): no beat leads, exit status 1
    gone = invoke("leader", "--url", db_dsn, "--json")
    assert gone.exit_code == 1, gone.output
    info = json.loads(gone.stdout)
    assert info["identity"] == beat.identity and info["alive"] is False
    text = invoke("leader", "--url", db_dsn)
    assert text.exit_code == 1 and text.stdout.startswith("leader: none alive;"), text.stdout
    asked = ok("run-now", "--url", db_dsn, "late")
    assert "no beat leads now" in asked.stderr


def test_no_beat_ever_led(db_dsn: str) -> None:
    nobody = invoke("leader", "--url", db_dsn, "--json")
    assert nobody.exit_code == 1 and nobody.stdout.strip() == "null"
    text = invoke("leader", "--url", db_dsn)
    assert text.exit_code == 1 and "kombu_pgmq.beat:Scheduler" in text.stdout
    assert ok("history", "--url", db_dsn).stdout.strip() == "no ticks sent"
    assert history(db_dsn) == []
    assert "no periodic tasks" in ok("list", "--url", db_dsn).stdout


READING = [("list",), ("history",), ("leader",)]
CHANGING = [("remove", "x"), ("enable", "x"), ("disable", "x"), ("run-now", "x")]


@pytest.mark.parametrize("command", READING + CHANGING)
def test_a_database_without_the_beat_tables_names_the_fix(
    empty_db_dsn: str, command: tuple[str, ...]
) -> None:
    assert_one_error_line(
        invoke(*command, "--url", empty_db_dsn), "no kombu_pgmq beat tables", "schema install"
    )
    # nothing was installed by the attempt (only "beat add" installs, as PeriodicTasks.add)
    assert sql(empty_db_dsn, "SELECT to_regnamespace('kombu_pgmq') IS NULL") == [(True,)]


def test_add_installs_the_schema_of_an_empty_database(empty_db_dsn: str) -> None:
    ok("add", "--url", empty_db_dsn, "tick", TASK, "--every", "30")
    assert list(entries(empty_db_dsn)) == ["tick"]
