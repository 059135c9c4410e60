"""The beat scheduler's schedule in PostgreSQL: the :class:`PeriodicTasks` API, bad input
(refused with the entry's name and the fix, never stopping the other entries), the
``beat_schedule`` sync, run-time changes reaching a ticking leader by NOTIFY, and the
least-privilege roles.

Schedulers (:class:`kombu_pgmq.beat.Scheduler`) run in-process on a scratch database,
ticked by hand or in a thread (``tests/integration/beat_helpers.py``). Leader election,
fencing and catch-up: ``test_beat_leader.py``.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from celery.schedules import crontab, schedule

from kombu_pgmq import errors
from kombu_pgmq.beat import PeriodicTasks, Scheduler, UnknownPeriodicTask
from tests.integration.beat_helpers import (
    TASK,
    entry_row,
    lead,
    make_app,
    messages,
    running,
    tick_until,
    ticks,
)
from tests.integration.helpers import sql, wait_for


@pytest.fixture
def tasks(db_dsn):
    with PeriodicTasks(app=make_app(db_dsn)) as api:
        yield api


@pytest.fixture
def schedulers(db_dsn):
    """``schedulers(**conf)``: a new Scheduler on the test database; closed at teardown."""
    made: list[Scheduler] = []

    def make(app=None, **conf):
        made.append(Scheduler(app or make_app(db_dsn, **conf)))
        return made[-1]

    yield make
    for s in made:
        s.close()


# -- API -------------------------------------------------------------------------------------


def test_the_api_adds_changes_and_removes_entries(tasks):
    added = tasks.add(
        "report",
        TASK,
        crontab(minute=0, hour=3),
        args=[1, "a"],
        kwargs={"k": 2},
        options={"priority": 3},
    )
    assert (added.name, added.task, added.schedule_kind) == ("report", TASK, "crontab")
    assert (added.args, added.kwargs, added.options) == ([1, "a"], {"k": 2}, {"priority": 3})
    assert added.schedule["hour"] == 3 and added.enabled and added.source == "api"
    assert added.last_run_at is None and added.total_run_count == 0

    changed = tasks.update("report", schedule=30, kwargs={"k": 3})
    assert (changed.schedule_kind, changed.schedule) == (
        "interval",
        {"every": 30.0, "relative": False},
    )
    assert changed.kwargs == {"k": 3} and changed.args == [1, "a"]  # the rest stays
    assert changed.updated_at > added.updated_at

    tasks.disable("report")
    assert tasks.get("report").enabled is False
    tasks.enable("report")
    assert tasks.get("report").enabled is True

    tasks.add("every-5", TASK, "*/5 * * * *")
    assert [e.name for e in tasks.all()] == ["every-5", "report"]
    assert tasks.get("every-5").schedule["minute"] == "*/5"

    requested = tasks.run_now("report")
    assert tasks.get("report").run_requested_at == requested
    assert tasks.remove("report") is True
    assert tasks.remove("report") is False
    assert [e.name for e in tasks.all()] == ["every-5"]
    assert tasks.history() == [] and tasks.leader() is None


def test_adding_an_existing_name_is_refused_unless_replaced(tasks):
    tasks.add("x", TASK, 10)
    with pytest.raises(errors.ConfigurationError, match="'x' exists already.*replace=True"):
        tasks.add("x", TASK, 20)
    assert tasks.get("x").schedule["every"] == 10.0
    tasks.add("x", TASK, 20, replace=True)
    assert tasks.get("x").schedule["every"] == 20.0


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.get("nope"),
        lambda t: t.update("nope", schedule=5),
        lambda t: t.enable("nope"),
        lambda t: t.disable("nope"),
        lambda t: t.run_now("nope"),
    ],
)
def test_an_unknown_name_is_unknown_periodic_task(tasks, call):
    with pytest.raises(UnknownPeriodicTask, match="'nope'") as info:
        call(tasks)
    assert isinstance(info.value, (errors.ConfigurationError, LookupError))


def test_history_and_leader_show_what_a_beat_sent(db_dsn, tasks, schedulers):
    tasks.add("often", TASK, 1)
    s = lead(schedulers())
    tick_until([s], lambda: len(ticks(db_dsn, "often")) >= 2, 10, "two ticks")
    history = tasks.history("often")
    assert len(history) >= 2 and history[0].sent_at >= history[1].sent_at  # newest first
    assert {t.kind for t in history} == {"scheduled"}
    assert history[1].due_at - history[0].due_at == timedelta(seconds=-1)
    assert sorted(messages(db_dsn)) == sorted(t.task_id for t in tasks.history())
    info = tasks.leader()
    assert info is not None and info.alive and info.epoch == history[0].epoch
    entry = tasks.get("often")
    assert entry.last_run_at == max(t.due_at for t in history)
    assert entry.next_run_at == entry.last_run_at + timedelta(seconds=1)
    assert entry.total_run_count == len(tasks.history("often"))


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"task": "kpt.beat.misspelt"}, "'bad'.*'kpt.beat.misspelt' is not registered"),
        ({"schedule": "61 * * * *"}, "'bad'.*invalid crontab '61 \\* \\* \\* \\*'"),
        ({"schedule": "* * *"}, "'bad'.*invalid crontab.*five fields"),
        ({"schedule": -1}, "'bad'.*not positive"),
        ({"args": [object()]}, "'bad'.*args .* is not JSON"),
        ({"kwargs": {"when": datetime.now()}}, "'bad'.*kwargs .* is not JSON"),
        ({"args": "abc"}, "'bad'.*args 'abc': give a list"),
        ({"catch_up": "all"}, "'bad'.*catch_up 'all'.*once, skip"),
        ({"options": {"queue": "no-such-queue"}}, "'bad'.*queue 'no-such-queue' does not exist"),
    ],
)
def test_bad_input_is_refused_naming_the_entry_and_the_fix(tasks, kwargs, match):
    call = {"name": "bad", "task": TASK, "schedule": 10, **kwargs}
    with pytest.raises(errors.ConfigurationError, match=match):
        tasks.add(call.pop("name"), call.pop("task"), call.pop("schedule"), **call)
    assert tasks.all() == []


def test_an_unknown_time_zone_is_refused(tasks):
    cron = crontab(minute=0)
    cron.tz = "Mars/Olympus"  # as a str: to_row stores it, from_row refuses it
    with pytest.raises(errors.ConfigurationError, match="'tz'.*unknown time zone 'Mars/Olympus'"):
        tasks.add("tz", TASK, cron)
    assert tasks.all() == []


def test_a_bad_entry_never_stops_the_others(db_dsn, tasks, schedulers):
    """A row whose schedule is broken (written by SQL), an entry whose queue does not
    exist and a task the beat's app does not know: their last_error says why; the good
    entry is sent all along."""
    tasks.add("good", TASK, 1)
    sql(
        db_dsn,
        "INSERT INTO kombu_pgmq.beat_entries (name, task, schedule_kind, schedule, options) "
        "VALUES ('broken', %s, 'interval', '{\"every\": \"often\"}', '{}'),"
        " ('no-queue', %s, 'interval', '{\"every\": 1}', '{\"queue\": \"kpt_beat_missing\"}'),"
        " ('unknown-task', 'kpt.beat.misspelt', 'interval', '{\"every\": 1}', '{}')",
        (TASK, TASK),
    )
    s = lead(schedulers())
    tick_until([s], lambda: len(ticks(db_dsn, "good")) >= 3, 15, "three ticks of good")
    assert {t[0] for t in ticks(db_dsn)} == {"good"}
    errors_ = {e.name: e.last_error for e in tasks.all()}
    assert errors_["good"] is None
    assert "'broken'" in errors_["broken"] and "invalid interval" in errors_["broken"]
    assert "queue 'kpt_beat_missing' does not exist" in errors_["no-queue"]
    assert "-Q kpt_beat_missing" in errors_["no-queue"]
    assert "'kpt.beat.misspelt' is not registered" in errors_["unknown-task"]
    assert len(messages(db_dsn)) == len(ticks(db_dsn))
