"""Beat leader election and each tick once: several :class:`kombu_pgmq.beat.Scheduler`
instances on one database (threads, or ticked in turn by hand), a leader whose session is
ended (``pg_terminate_backend``) or that hangs, late claims of a deposed leader (fenced:
nothing sent), and catch-up after missed ticks (``once``, ``skip``).

``beat_takeover_seconds`` is 2.5 here: election rounds every 0.5 s, a leader whose
heartbeat is 1.5 s old is deposed. Every test checks the invariant: the messages in the
``celery`` queue are exactly the ticks recorded, one per ``(entry, due_at)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from itertools import pairwise
from time import monotonic

import pytest

from kombu_pgmq.beat import PeriodicTasks, Scheduler
from tests.integration.beat_helpers import (
    TAKEOVER,
    TASK,
    entry_row,
    lead,
    make_app,
    messages,
    running,
    step,
    tick_until,
    ticks,
)
from tests.integration.helpers import sql


@pytest.fixture
def schedulers(db_dsn) -> Iterator:
    made: list[Scheduler] = []

    def make(**conf):
        made.append(Scheduler(make_app(db_dsn, **conf)))
        return made[-1]

    yield make
    for s in made:
        s.close()


def sent_once(url: str) -> list[tuple]:
    """The ticks, checked against the queue: one message per tick sent, none twice."""
    all_ticks = ticks(url)
    keys = [(t[0], t[1]) for t in all_ticks]
    assert len(keys) == len(set(keys))
    sent_ids = [t[4] for t in all_ticks if t[2] != "skipped"]
    in_queue = messages(url)
    assert sorted(in_queue) == sorted(sent_ids)
    assert len(set(in_queue)) == len(in_queue)
    return all_ticks


def test_one_of_three_leads_and_each_tick_is_sent_once(db_dsn, schedulers):
    with PeriodicTasks(db_dsn) as api:
        api.add("a", TASK, 1)
        api.add("b", TASK, 1, args=[2])
    trio = [schedulers(beat_takeover_seconds=10) for _ in range(3)]  # none stale
    with running(trio[0]), running(trio[1]), running(trio[2]):
        time.sleep(4.0)
    leaders = [s for s in trio if s.sent]
    assert len(leaders) == 1, [s.sent for s in trio]
    all_ticks = sent_once(db_dsn)
    assert leaders[0].sent == len(all_ticks) >= 4
    assert {t[5] for t in all_ticks} == {1}  # one epoch: nobody else led
    for name in ("a", "b"):
        due = [t[1] for t in all_ticks if t[0] == name]
        assert all(b - a == timedelta(seconds=1) for a, b in pairwise(due))  # no gap


def late_claim(s: Scheduler, epoch: int) -> None:
    """``s`` claims as the leader of ``epoch`` without an election round first, as a
    leader that hung between its round and its claim does, once an entry is due."""
    s.leader.is_leader, s.leader.epoch = True, epoch
    s.leader._next_round = monotonic() + 60
    time.sleep(1.1)  # an entry (every second) is due
    s.tick()


def _takes_over(old: Scheduler, new: Scheduler, url: str, kill: bool) -> float:
    """``old`` leads and sends; it is killed (its session ended) or hangs (no more
    ticks); ``new`` ticks until it leads: the seconds that took."""
    lead(old)
    tick_until([old], lambda: ticks(url), 5, "a first tick")
    step(new)
    assert not new.leader.is_leader
    started = monotonic()
    if kill:
        pid = sql(url, "SELECT backend_pid FROM kombu_pgmq.beat_leader_info()")[0][0]
        assert sql(url, "SELECT pg_terminate_backend(%s)", (pid,)) == [(True,)]
    tick_until([new], lambda: new.leader.is_leader, 10, "a new leader")
    return monotonic() - started


@pytest.mark.parametrize("kill", [True, False], ids=["terminated", "hung"])
def test_a_deposed_leader_is_fenced_and_another_leads(db_dsn, schedulers, kill):
    """The leader's session is ended (a dead or cut-off process) or its heartbeat stops
    (a hung process): another leads (within a round, or once the heartbeat is stale),
    and the old leader's late claims send nothing (its statement fails on the dead
    session; on a new session the fence refuses it)."""
    with PeriodicTasks(db_dsn) as api:
        api.add("every-second", TASK, 1)
    old, new = schedulers(), schedulers()
    took = _takes_over(old, new, db_dsn, kill)
    assert took < (2.0 if kill else TAKEOVER + 1.5)
    if not kill:  # not before its heartbeat is stale (1.5 s; one round of 0.5 s earlier)
        assert took > TAKEOVER - 1.0 - 0.5 - 0.2
    old_epoch = old.leader.epoch or 1
    assert new.leader.epoch == old_epoch + 1
    tick_until([new], lambda: any(t[5] == new.leader.epoch for t in ticks(db_dsn)), 5, "tick")

    sent_before = old.sent
    late_claim(old, old_epoch)  # the dead session: the statement fails, it steps down
    assert not old.leader.is_leader
    late_claim(old, old_epoch)  # a new session, not holding the lock: fenced
    assert old.fenced == 1 and not old.leader.is_leader
    assert old.sent == sent_before
    all_ticks = sent_once(db_dsn)
    assert {t[5] for t in all_ticks} == {old_epoch, old_epoch + 1}
    before = [t[1] for t in all_ticks if t[5] == old_epoch]
    after = [t[1] for t in all_ticks if t[5] == old_epoch + 1]
    assert max(before) < min(after)
    assert entry_row(db_dsn, "every-second")["last_run_at"] is not None


def _set_last_run(url: str, name: str, ago: float) -> datetime:
    rows = sql(
        url,
        "UPDATE kombu_pgmq.beat_entries SET last_run_at = clock_timestamp() - "
        "make_interval(secs => %s) WHERE name = %s RETURNING last_run_at",
        (ago, name),
    )
    return rows[0][0]


def test_catch_up_once_sends_one_tick_for_the_missed_ones(db_dsn, schedulers):
    with PeriodicTasks(db_dsn) as api:
        api.add("often", TASK, 2, catch_up="once")
    s = lead(schedulers())
    last = _set_last_run(db_dsn, "often", 61.0)  # 30 due times passed; NOTIFY: reload
    tick_until([s], lambda: len(ticks(db_dsn)) >= 3, 10, "the catch-up and two more")
    first, second, third = ticks(db_dsn)[:3]
    passed = int((first[1] - last) / timedelta(seconds=2))
    assert first[1] == last + timedelta(seconds=2 * passed)  # the latest due time passed
    assert (first[2], first[3]) == ("catch-up", passed - 1) and passed >= 30
    assert (second[1] - first[1], third[1] - second[1]) == (timedelta(seconds=2),) * 2
    assert (second[2], second[3], third[2]) == ("scheduled", 0, "scheduled")
    assert entry_row(db_dsn, "often")["missed_ticks"] == passed - 1
    sent_once(db_dsn)


def test_catch_up_skip_sends_none_of_the_missed_ones(db_dsn, schedulers):
    with PeriodicTasks(db_dsn) as api:
        api.add("often", TASK, 5, catch_up="skip")
    s = lead(schedulers())
    # 20 due times passed, the latest 3 s ago: older than ON_TIME_SECONDS (2 s); the
    # leader hears it (NOTIFY) and claims at its next tick
    last = _set_last_run(db_dsn, "often", 103.0)
    tick_until([s], lambda: len(ticks(db_dsn)) >= 2, 10, "the skip and the next tick")
    skipped, scheduled = ticks(db_dsn)[:2]
    assert (skipped[2], skipped[3], skipped[4]) == ("skipped", 20, None)
    assert skipped[1] == last + timedelta(seconds=100)
    assert (scheduled[1], scheduled[2]) == (skipped[1] + timedelta(seconds=5), "scheduled")
    assert messages(db_dsn) == [scheduled[4]]
    row = entry_row(db_dsn, "often")
    assert (row["missed_ticks"], row["total_run_count"]) == (20, 1)
    sent_once(db_dsn)


def test_a_due_time_no_leader_reached_is_sent_by_the_next(db_dsn, schedulers):
    """A leader that stops cleanly (close: resign) hands over at once: the next leader
    sends what came due meanwhile, once."""
    with PeriodicTasks(db_dsn) as api:
        api.add("every-second", TASK, 1)
    first = lead(schedulers())
    tick_until([first], lambda: ticks(db_dsn), 5, "a first tick")
    first.close()
    stopped = datetime.now(timezone.utc)
    time.sleep(1.5)
    second = schedulers()
    tick_until([second], lambda: second.sent >= 2, 5, "ticks of the next leader")
    all_ticks = sent_once(db_dsn)
    assert any(t[1] < stopped for t in all_ticks) and any(t[1] > stopped for t in all_ticks)
    assert {t[5] for t in all_ticks} == {1, 2}


def test_lookahead_publishes_ahead_invisible_until_the_due_time(db_dsn, schedulers):
    # beat_lookahead_seconds: a tick is claimed and published up to that early; its
    # message's visibility time is the due time itself (sub-second), and a relative
    # expiry counts from the due time.
    with PeriodicTasks(db_dsn) as api:
        api.add("ahead", TASK, 1, options={"expires": 30})
    s = lead(schedulers(beat_lookahead_seconds=1.5))
    tick_until([s], lambda: len(ticks(db_dsn)) >= 3, 15, "three ticks")
    rows = sql(
        db_dsn,
        "SELECT t.due_at, t.sent_at, q.vt, q.headers->>'expires' FROM kombu_pgmq.beat_ticks t "
        "JOIN pgmq.q_celery q ON q.headers->>'id' = t.task_id ORDER BY t.due_at",
    )
    assert len(rows) >= 3
    for due_at, sent_at, vt, expires in rows[1:]:  # the first may be claimed late
        assert sent_at < due_at - timedelta(seconds=1)  # published ahead
        assert vt == due_at  # invisible until the due time, to the microsecond
        assert datetime.fromisoformat(expires) == due_at + timedelta(seconds=30)
    sent_once(db_dsn)


def test_lookahead_setting_is_checked(db_dsn):
    from kombu_pgmq.errors import ConfigurationError

    for bad in (-1, 61, "soon"):
        with pytest.raises(ConfigurationError, match="beat_lookahead_seconds"):
            Scheduler(make_app(db_dsn, beat_lookahead_seconds=bad), lazy=True)


def test_run_now_and_a_due_tick_of_the_same_entry_in_one_pass(db_dsn, schedulers):
    # Both are claimed, each in its own transaction: the scheduled tick moves the last
    # run on, the manual one does not (claimed together, one UPDATE would lose one).
    with PeriodicTasks(db_dsn) as api:
        api.add("both", TASK, 60)
    s = lead(schedulers())
    with PeriodicTasks(db_dsn) as api:
        last = _set_last_run(db_dsn, "both", 60.5)  # one due time passed
        api.run_now("both")
    tick_until([s], lambda: len(ticks(db_dsn)) >= 2, 10, "the manual and the due tick")
    step(s)
    kinds = sorted(t[2] for t in ticks(db_dsn))
    assert kinds == ["manual", "scheduled"]
    row = entry_row(db_dsn, "both")
    assert row["total_run_count"] == 2 and row["run_requested_at"] is None
    assert datetime.fromisoformat(row["last_run_at"]) == last + timedelta(seconds=60)
    sent_once(db_dsn)


def test_a_beat_started_while_the_database_is_down_waits_for_it(caplog):
    # Nothing listens on port 1: the beat neither exits nor spins; it says so once.
    url = "postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=1"
    s = Scheduler(make_app(url))
    try:
        with caplog.at_level("WARNING", logger="kombu_pgmq.beat.scheduler"):
            delays = [s.tick() for _ in range(2)]
        assert all(d == s.leader.round_seconds for d in delays)
        assert not s.leader.is_leader
        waiting = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
        assert len(waiting) == 1
    finally:
        s.close()
