"""Stored schedules (:mod:`kombu_pgmq.beat.schedules`) against Celery's own scheduler.

Round trips: a Celery schedule stored as ``(kind, JSON)`` and read back is the same
schedule (fields, time zone, relative flag).

Parity: :func:`next_due` must give the times Celery's default scheduler
(:class:`celery.beat.Scheduler`, its heap, ``ScheduleEntry.is_due`` and ``next(entry)``)
sends an entry at. Celery's scheduler is run here on a fake clock (the schedule's
``nowfun``): each ``tick()`` returns how long ``celery beat`` would sleep, and the clock
moves by that much (whole seconds, rounded up; one second when a tick sends nothing and
asks to be called again at once, as the real loop does while time passes). Due times of
crontab and whole-second intervals fall on whole seconds, so the real loop and the fake
clock send at the same instants. Clocks cross DST transitions (America/New_York
2026-03-08 and 2026-11-01, Europe/London 2026-03-29 and 2026-10-25).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery, beat
from celery.schedules import BaseSchedule, crontab, schedule, solar

from kombu_pgmq.beat.schedules import from_row, latest_due, next_due, to_row
from kombu_pgmq.errors import ConfigurationError

UTC = timezone.utc
NY = ZoneInfo("America/New_York")
LONDON = ZoneInfo("Europe/London")


def make_app(tz: str = "UTC") -> Celery:
    app = Celery("kpt_beat_schedules", set_as_current=False)
    app.conf.update(timezone=tz, enable_utc=True, result_expires=None)
    return app


# -- round trips -----------------------------------------------------------------------------


def _cron_fields(c: crontab) -> tuple[Any, ...]:
    return (c.minute, c.hour, c.day_of_week, c.day_of_month, c.month_of_year)


@pytest.mark.parametrize(
    "cron",
    [
        crontab(),
        crontab(minute="*/15"),
        crontab(minute=30, hour=2),
        crontab(minute={0, 20, 40}, hour=range(8, 18)),
        crontab(minute="5,35", hour="9-17", day_of_week="mon-fri"),
        crontab(minute=0, hour=0, day_of_month="1,15", month_of_year="*/3"),
        crontab(minute=0, hour=4, day_of_week={0, 6}),
        crontab.from_string("*/5 1-3 * * sun"),
    ],
    ids=lambda c: str(c),
)
def test_a_crontab_round_trips(cron):
    app = make_app("Europe/Paris")
    kind, spec = to_row(cron, "e")
    assert kind == "crontab"
    assert spec["tz"] is None
    back = from_row(kind, spec, app, "e")
    assert isinstance(back, crontab)
    assert _cron_fields(back) == _cron_fields(cron)
    assert to_row(back, "e") == (kind, spec)  # stable
    assert back.tz == app.timezone  # no tz of its own: the app's


def test_a_crontab_with_its_own_time_zone_round_trips():
    cron = crontab(minute=0, hour=9)
    cron.tz = ZoneInfo("Asia/Tokyo")
    kind, spec = to_row(cron, "e")
    assert spec["tz"] == "Asia/Tokyo"
    back = from_row(kind, spec, make_app("UTC"), "e")
    assert back.tz == ZoneInfo("Asia/Tokyo")
    assert _cron_fields(back) == _cron_fields(cron)


@pytest.mark.parametrize(
    ("value", "every", "relative"),
    [
        (30, 30.0, False),
        (0.5, 0.5, False),
        (timedelta(hours=1, seconds=1), 3601.0, False),
        (schedule(timedelta(minutes=5)), 300.0, False),
        (schedule(timedelta(hours=1), relative=True), 3600.0, True),
    ],
)
def test_an_interval_round_trips(value, every, relative):
    kind, spec = to_row(value, "e")
    assert (kind, spec) == ("interval", {"every": every, "relative": relative})
    back = from_row(kind, spec, make_app(), "e")
    assert type(back) is schedule
    assert back.run_every == timedelta(seconds=every)
    assert back.relative is relative


def test_a_solar_schedule_round_trips():
    pytest.importorskip("ephem", reason="solar schedules need the ephem package (not a dep)")
    sun = solar("sunrise", 48.85, 2.35)
    kind, spec = to_row(sun, "e")
    assert (kind, spec) == ("solar", {"event": "sunrise", "lat": 48.85, "lon": 2.35})
    back = from_row(kind, spec, make_app(), "e")
    assert (back.event, back.lat, back.lon) == ("sunrise", 48.85, 2.35)


@pytest.mark.parametrize(
    ("kind", "spec", "match"),
    [
        ("interval", {"every": 0}, "not positive"),
        ("interval", {}, "invalid interval"),
        ("crontab", {"minute": "61"}, "invalid crontab"),
        ("crontab", {"hour": "x"}, "invalid crontab"),
        ("crontab", {"minute": "0", "tz": "Mars/Olympus"}, "unknown time zone 'Mars/Olympus'"),
        ("weekly", {}, "unknown schedule kind 'weekly'"),
    ],
)
def test_a_bad_row_is_a_configuration_error_naming_the_entry(kind, spec, match):
    with pytest.raises(ConfigurationError, match=match) as info:
        from_row(kind, spec, make_app(), "nightly")
    assert "'nightly'" in str(info.value)


def test_a_schedule_that_cannot_be_stored_is_refused():
    class Custom(BaseSchedule):
        pass

    with pytest.raises(ConfigurationError, match=r"'e'.*cannot be stored"):
        to_row(Custom(), "e")
    with pytest.raises(ConfigurationError, match="not positive"):
        to_row(-5, "e")


# -- parity with celery beat -----------------------------------------------------------------


class Clock:
    """A fake wall clock (aware UTC), moved by hand."""

    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now


class RecordingScheduler(beat.Scheduler):
    """Celery's default scheduler that records what it would send, and when."""

    producer = None  # nothing is sent (no broker connection)

    def __init__(self, *args: Any, clock: Clock, **kwargs: Any) -> None:
        self.clock = clock
        self.sent: list[datetime] = []
        super().__init__(*args, **kwargs)

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        self.sent.append(self.clock())


def celery_fires(app: Celery, sched: BaseSchedule, start: datetime, end: datetime) -> list:
    """The instants Celery's scheduler sends an entry of ``sched`` last run at ``start``,
    up to ``end``, driven as ``celery beat``'s loop drives it (sleep what tick returns)."""
    clock = Clock(start)
    sched.nowfun = clock
    sched.app = app
    scheduler = RecordingScheduler(app, clock=clock, lazy=True)
    scheduler.data = {
        "e": beat.ScheduleEntry(name="e", task="t", last_run_at=start, schedule=sched, app=app)
    }
    while clock.now <= end:
        before = len(scheduler.sent)
        delay = scheduler.tick()
        if len(scheduler.sent) > 1 and scheduler.sent[-1] == scheduler.sent[-2]:
            raise AssertionError(f"celery beat sends twice at {clock.now}")
        if delay and delay > 0:
            clock.now += timedelta(seconds=math.ceil(delay))
        elif len(scheduler.sent) == before:
            clock.now += timedelta(seconds=1)  # asked again at once: time passes meanwhile
    return [t for t in scheduler.sent if t <= end]


def our_fires(app: Celery, sched: BaseSchedule, start: datetime, end: datetime) -> list:
    stored = from_row(*to_row(sched, "e"), app, "e")
    fires, due = [], next_due(stored, start)
    while due <= end:
        fires.append(due)
        due = next_due(stored, due)
    return fires


def _with_tz(cron: crontab, tz: ZoneInfo) -> crontab:
    cron.tz = tz
    return cron


def _local(tz: ZoneInfo, *args: int, fold: int = 0) -> datetime:
    return datetime(*args, tzinfo=tz, fold=fold).astimezone(UTC)


PARITY_CASES = {
    # 02:30 does not exist in New York on 2026-03-08 (02:00 -> 03:00).
    "ny-02:30-spring-forward": (
        "America/New_York",
        lambda: crontab(hour=2, minute=30),
        _local(NY, 2026, 3, 5, 12),
        _local(NY, 2026, 3, 11, 12),
    ),
    # 01:00-02:00 happens twice in New York on 2026-11-01.
    "ny-hourly-fall-back": (
        "America/New_York",
        lambda: crontab(minute=0),
        _local(NY, 2026, 10, 31, 20),
        _local(NY, 2026, 11, 1, 6),
    ),
    "ny-01:30-fall-back": (
        "America/New_York",
        lambda: crontab(hour=1, minute=30),
        _local(NY, 2026, 10, 29, 12),
        _local(NY, 2026, 11, 3, 12),
    ),
    "ny-every-20-min-spring-forward": (
        "America/New_York",
        lambda: crontab(minute="*/20"),
        _local(NY, 2026, 3, 8, 0),
        _local(NY, 2026, 3, 8, 5),
    ),
    "london-half-hourly-spring": (
        "Europe/London",
        lambda: crontab(minute="0,30"),
        _local(LONDON, 2026, 3, 28, 22),
        _local(LONDON, 2026, 3, 29, 4),
    ),
    "london-01:15-autumn": (
        "Europe/London",
        lambda: crontab(hour=1, minute=15),
        _local(LONDON, 2026, 10, 22, 12),
        _local(LONDON, 2026, 10, 28, 12),
    ),
    # The app in UTC, the crontab in New York: the crontab's zone decides.
    "utc-app-ny-crontab": (
        "UTC",
        lambda: _with_tz(crontab(hour="1-3", minute=0), NY),
        _local(NY, 2026, 3, 6, 12),
        _local(NY, 2026, 3, 10, 12),
    ),
    "london-app-ny-crontab-fall-back": (
        "Europe/London",
        lambda: _with_tz(crontab(minute=30, hour="*/1"), NY),
        _local(NY, 2026, 10, 31, 22),
        _local(NY, 2026, 11, 1, 4),
    ),
    "ny-weekdays-9-and-17": (
        "America/New_York",
        lambda: crontab(minute=0, hour="9,17", day_of_week="mon-fri"),
        _local(NY, 2026, 3, 1, 0),
        _local(NY, 2026, 3, 15, 0),
    ),
    "ny-day-of-month": (
        "America/New_York",
        lambda: crontab(minute=0, hour=2, day_of_month="1,8,15"),
        _local(NY, 2026, 2, 20, 0),
        _local(NY, 2026, 4, 2, 0),
    ),
    "interval-90s-over-spring-forward": (
        "America/New_York",
        lambda: schedule(timedelta(seconds=90)),
        _local(NY, 2026, 3, 8, 1, 30),
        _local(NY, 2026, 3, 8, 4),
    ),
    "relative-hourly-over-spring-forward": (
        "America/New_York",
        lambda: schedule(timedelta(hours=1), relative=True),
        _local(NY, 2026, 3, 7, 23, 17),
        _local(NY, 2026, 3, 8, 6),
    ),
    "relative-daily-over-fall-back": (
        "America/New_York",
        lambda: schedule(timedelta(days=1), relative=True),
        _local(NY, 2026, 10, 29, 13, 5),
        _local(NY, 2026, 11, 4, 2),
    ),
    "interval-1-day-over-fall-back": (
        "America/New_York",
        lambda: schedule(timedelta(days=1)),
        _local(NY, 2026, 10, 30, 1, 30),
        _local(NY, 2026, 11, 4, 2),
    ),
}


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_next_due_gives_the_times_celery_beat_sends_at(case):
    tz, make, start, end = PARITY_CASES[case]
    app = make_app(tz)
    celery = celery_fires(app, make(), start, end)
    ours = our_fires(app, make(), start, end)
    assert celery, "the window holds due times"
    assert [t.isoformat() for t in ours] == [t.isoformat() for t in celery]


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_latest_due_counts_the_due_times_passed(case):
    """latest_due over the whole window: the last due time, how many, the next one."""
    tz, make, start, end = PARITY_CASES[case]
    app = make_app(tz)
    stored = from_row(*to_row(make(), "e"), app, "e")
    fires = our_fires(app, make(), start, end)
    latest, count, following = latest_due(stored, start, end)
    assert (latest, count) == (fires[-1], len(fires))
    assert following == next_due(stored, fires[-1])
    assert following > end


def _walk(start: datetime, end: datetime, step: timedelta) -> Iterator[datetime]:
    while start <= end:
        yield start
        start += step


def _due_at_once(app: Celery, cron: crontab, last: datetime) -> bool:
    cron.app, cron.nowfun = app, (lambda: last + timedelta(seconds=1))
    return bool(cron.is_due(last).is_due)


def test_next_due_from_any_instant_is_the_next_firing():
    """From any last run (not only due times), next_due is the first of Celery's firings
    after it: New York, hourly at :30, across both 2026 transitions (except where
    Celery is due at once: see the next test)."""
    app = make_app("America/New_York")
    stored = from_row(*to_row(crontab(minute=30), "e"), app, "e")
    checked = 0
    for start, end in [
        (_local(NY, 2026, 3, 8, 0), _local(NY, 2026, 3, 8, 6)),
        (_local(NY, 2026, 11, 1, 0), _local(NY, 2026, 11, 1, 4)),
    ]:
        for t in _walk(start, end, timedelta(minutes=7, seconds=13)):
            if _due_at_once(app, crontab(minute=30), t):
                continue
            expected = celery_fires(app, crontab(minute=30), t, t + timedelta(hours=3))[0]
            assert next_due(stored, t) == expected, t
            checked += 1
    assert checked > 50


@pytest.mark.parametrize(
    ("cron", "last", "expected"),
    [
        (crontab(minute=30), (2026, 11, 1, 1, 2, 41), (2026, 11, 1, 1, 30)),
        (crontab(minute="*/20"), (2026, 11, 1, 1, 45), (2026, 11, 1, 2, 0)),
        (crontab(hour=1, minute=50), (2026, 11, 1, 1, 10), (2026, 11, 1, 1, 50)),
    ],
)
def test_a_last_run_in_the_repeated_hour_is_not_due_at_once(cron, last, expected):
    """Celery's crontab, last run in New York's second 01:00-02:00 (EST) before its
    minute, aims at that minute's first occurrence (EDT, past) and is due at once: celery
    beat sends at every tick until then. next_due gives the wall time's second
    occurrence instead."""
    app = make_app("America/New_York")
    last_utc = datetime(*last, tzinfo=NY, fold=1).astimezone(UTC)
    stored = from_row(*to_row(cron, "e"), app, "e")
    due = next_due(stored, last_utc)
    assert due > last_utc
    if _due_at_once(app, from_row(*to_row(cron, "e"), app, "e"), last_utc):
        assert due == datetime(*expected, tzinfo=NY, fold=1).astimezone(UTC)
    else:  # Celery fixed: then it is Celery's next firing
        assert due == celery_fires(app, cron, last_utc, last_utc + timedelta(days=2))[0]
    latest, count, following = latest_due(stored, last_utc, due + timedelta(minutes=1))
    assert (latest, count) == (due, 1)
    assert following > due


@pytest.mark.parametrize("event", ["sunrise", "sunset", "dawn_civil", "solar_noon"])
def test_next_due_of_a_solar_schedule_is_celery_beats(event):
    """Solar events in Paris over a week across the 2026-03-29 DST change (Celery's
    firings on the fake clock: the whole second at or after each of ours)."""
    pytest.importorskip("ephem", reason="solar schedules need the ephem package (not a dep)")
    app = make_app("Europe/Paris")
    start = datetime(2026, 3, 26, 12, tzinfo=UTC)
    end = start + timedelta(days=7)
    celery = celery_fires(app, solar(event, 48.85, 2.35), start, end)
    ours = our_fires(app, solar(event, 48.85, 2.35), start, end)
    assert len(celery) >= 6 and len(ours) == len(celery)
    # Solar events fall between seconds: the fake clock's second is at most 1 s late.
    late = [c - o for o, c in zip(ours, celery, strict=True)]
    assert all(timedelta(0) <= d < timedelta(seconds=1) for d in late), late
