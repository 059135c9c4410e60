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
from datetime import datetime, timedelta

import psycopg
import pytest
from celery.schedules import crontab

from kombu_pgmq import errors
from kombu_pgmq.beat import PeriodicTasks, Scheduler, UnknownPeriodicTask
from tests.integration.beat_helpers import (
    TASK,
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
    with pytest.raises(errors.ConfigurationError, match=r"'x' exists already.*replace=True"):
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


def test_close_leaves_no_connection_open(db_dsn):
    """A leader that published ticks holds the leader's connection and Celery's producer
    connection; ``close()`` (what ``celery beat`` calls at exit) closes both, whatever
    Celery's ``Scheduler.close`` does with the producer (5.5 and 5.6 keep it open)."""
    with PeriodicTasks(app=make_app(db_dsn)) as api:
        api.add("often", TASK, 1)
    s = lead(Scheduler(make_app(db_dsn)))
    try:
        tick_until([s], lambda: ticks(db_dsn, "often"), 10, "a tick")
    finally:
        s.close()
    others = (
        "SELECT application_name FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    wait_for(lambda: sql(db_dsn, others) == [], 10, "no connection to the database")


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
    with pytest.raises(errors.ConfigurationError, match=r"'tz'.*unknown time zone 'Mars/Olympus'"):
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


# -- beat_schedule sync ----------------------------------------------------------------------


def test_beat_schedule_is_synced_and_the_config_wins_for_what_it_names(db_dsn, schedulers):
    """A process writes its beat_schedule when it starts and when it starts to lead:
    config entries are rewritten from it, entries added by the API persist, a config
    entry no longer named is deleted, and enabled stays as it was set."""
    conf = {
        "beat_schedule": {
            "cfg-a": {"task": TASK, "schedule": 60.0, "args": [1]},
            "cfg-b": {"task": TASK, "schedule": crontab(minute="*/5"), "catch_up": "skip"},
            "cfg-bad": {"task": "kpt.beat.misspelt", "schedule": 60.0},  # left out, logged
        }
    }
    with PeriodicTasks(db_dsn) as api:
        api.add("api-x", TASK, 30)
        schedulers(**conf)  # starts (follower or not: its config is written now)
        rows = {e.name: e for e in api.all()}
        assert sorted(rows) == ["api-x", "cfg-a", "cfg-b"]
        assert (rows["cfg-a"].source, rows["cfg-a"].args) == ("config", [1])
        assert (rows["cfg-b"].catch_up, rows["api-x"].source) == ("skip", "api")

        api.disable("cfg-a")
        api.update("cfg-b", schedule=7)  # a run-time change of a config entry
        conf2 = {
            "beat_schedule": {
                "cfg-a": {"task": TASK, "schedule": 60.0, "args": [2]},
                "cfg-b": {"task": TASK, "schedule": crontab(minute="*/5"), "catch_up": "skip"},
            }
        }
        s = schedulers(**conf2)
        rows = {e.name: e for e in api.all()}
        assert rows["cfg-a"].args == [2] and rows["cfg-a"].enabled is False  # kept disabled
        assert rows["cfg-b"].schedule_kind == "crontab"  # the config wins again

        api.update("cfg-b", schedule=9)
        lead(s)  # leading: written again
        assert api.get("cfg-b").schedule_kind == "crontab"

        schedulers(beat_schedule={"cfg-b": conf2["beat_schedule"]["cfg-b"]})
        assert sorted(e.name for e in api.all()) == ["api-x", "cfg-b"]  # cfg-a removed


# -- run-time changes ------------------------------------------------------------------------


def _first_tick(url: str, name: str, timeout: float) -> float:
    """Seconds until ``name`` has a tick."""
    start = time.monotonic()
    wait_for(lambda: ticks(url, name), timeout, f"a tick of {name}")
    return time.monotonic() - start


def test_changes_reach_a_ticking_leader_without_a_restart(db_dsn, tasks, schedulers):
    """Added, changed, disabled and removed entries take effect within about a second
    (NOTIFY wakes the leader: it waits on its connection, not on a poll)."""
    tasks.add("slow", TASK, 3600)
    s = lead(schedulers())
    with running(s):
        added = tasks.add("added", TASK, 1)
        elapsed = _first_tick(db_dsn, "added", 10)
        first = ticks(db_dsn, "added")[0]
        assert first[1] == added.created_at + timedelta(seconds=1)  # one period after
        assert elapsed < 3.0

        tasks.update("slow", schedule=1)  # next run: last (creation) + 1 s, long past
        assert _first_tick(db_dsn, "slow", 10) < 3.0

        tasks.disable("added")
        time.sleep(0.5)  # the leader hears it
        count = len(ticks(db_dsn, "added"))
        time.sleep(2.0)
        assert len(ticks(db_dsn, "added")) == count

        tasks.remove("slow")
        time.sleep(0.5)
        count = len(ticks(db_dsn, "slow"))
        time.sleep(2.0)
        assert len(ticks(db_dsn, "slow")) == count
    assert len(messages(db_dsn)) == len(ticks(db_dsn))


def test_run_now_sends_once_and_the_schedule_does_not_move(db_dsn, tasks, schedulers):
    tasks.add("hourly", TASK, 3600)
    s = lead(schedulers())
    tick_until([s], lambda: tasks.get("hourly").next_run_at, 5, "next_run_at")
    before = tasks.get("hourly")
    with running(s):
        requested = tasks.run_now("hourly")
        elapsed = _first_tick(db_dsn, "hourly", 10)
        time.sleep(1.0)  # nothing more comes
    assert elapsed < 3.0
    (tick,) = ticks(db_dsn, "hourly")
    assert (tick[1], tick[2], tick[3]) == (requested, "manual", 0)
    assert messages(db_dsn) == [tick[4]]
    after = tasks.get("hourly")
    assert after.run_requested_at is None and after.total_run_count == 1
    assert (after.last_run_at, after.next_run_at) == (before.last_run_at, before.next_run_at)


# -- least privilege -------------------------------------------------------------------------


def test_a_worker_role_runs_beat_and_a_producer_role_manages_entries(least_privilege_db):
    """kombu-pgmq schema grant: a beat as a worker role elects, claims and sends; a
    producer role adds, changes and reads entries; neither reads or deletes the beat
    tables directly."""
    db = least_privilege_db
    with PeriodicTasks(db.producer_url) as api:
        api.add("lp", TASK, 1)
        api.update("lp", kwargs={"n": 1})
        api.add("gone", TASK, 60)
        assert api.remove("gone") is True
    s = Scheduler(make_app(db.worker_url))
    try:
        tick_until([s], lambda: len(ticks(db.owner_url, "lp")) >= 2, 15, "two ticks")
    finally:
        s.close()
    with PeriodicTasks(db.producer_url) as api:
        assert api.get("lp").total_run_count >= 2
        assert len(api.history("lp")) >= 2
        info = api.leader()  # resigned at close
        assert info is not None and not info.alive
        assert info.heartbeat_age < 60  # resigned: the lock released, its time recorded
    assert len(messages(db.owner_url)) == len(ticks(db.owner_url))
    for url in (db.producer_url, db.worker_url):
        for statement in (
            "SELECT * FROM kombu_pgmq.beat_entries",
            "DELETE FROM kombu_pgmq.beat_ticks",
            "UPDATE kombu_pgmq.beat_leader SET epoch = epoch + 1",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                sql(url, statement)
