"""Celery schedules as stored rows, and their due times as Celery's own scheduler computes
them.

A periodic task's schedule is stored as ``(schedule_kind, schedule)``:

=============  ==========================================================================
kind           JSON (``schedule`` column)
=============  ==========================================================================
``interval``   ``{"every": seconds, "relative": false}`` (:class:`celery.schedules.schedule`,
               a number of seconds or a :class:`~datetime.timedelta`)
``crontab``    ``{"minute": "*/15", "hour": "*", "day_of_week": "*", "day_of_month": "*",
               "month_of_year": "*", "tz": "Europe/Paris" | null}``
               (:class:`celery.schedules.crontab`; ``tz`` null: the app's ``timezone``)
``solar``      ``{"event": "sunrise", "lat": 48.85, "lon": 2.35}``
               (:class:`celery.schedules.solar`, needs the ``ephem`` package)
=============  ==========================================================================

Due times: :func:`next_due` is the first instant after a run at which Celery's
``schedule.is_due(last_run_at)`` holds, computed with Celery's own code
(``remaining_estimate`` with the clock set to that instant), so crontab fields, time zones
and DST transitions give the same times as ``celery beat``'s default scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.exceptions import ImproperlyConfigured
from celery.schedules import BaseSchedule, crontab, schedule, solar

from ..errors import ConfigurationError

__all__ = ["CATCH_UP", "KINDS", "from_row", "latest_due", "next_due", "to_row"]

#: Schedule kinds a row may hold.
KINDS = ("interval", "crontab", "solar")
#: Catch-up policies: after ticks were missed (no leader ran), send one tick (``once``,
#: as ``celery beat`` does after a restart) or none (``skip``); never one per missed tick.
CATCH_UP = ("once", "skip")
_CRON_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
#: Most due times :func:`latest_due` walks through before it jumps to the clock.
_MAX_STEPS = 10_000


def _cron_value(value: Any) -> Any:
    if isinstance(value, (set, frozenset, list, tuple, range)):
        return sorted(int(v) for v in value)
    return value if isinstance(value, (int, str)) else str(value)


def to_row(value: Any, name: str = "?") -> tuple[str, dict[str, Any]]:
    """``(schedule_kind, schedule)`` of a Celery schedule, a number of seconds or a
    :class:`~datetime.timedelta`.

    Raises:
        ConfigurationError: a schedule kind that cannot be stored (a custom class), or a
            non-positive interval.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = timedelta(seconds=value)
    if isinstance(value, timedelta):
        value = schedule(value)
    if isinstance(value, crontab):
        spec: dict[str, Any] = {
            field: _cron_value(getattr(value, f"_orig_{field}")) for field in _CRON_FIELDS
        }
        tz = value.__dict__.get("tz")
        spec["tz"] = None if tz is None else str(tz)
        return "crontab", spec
    if isinstance(value, solar):
        return "solar", {"event": value.event, "lat": value.lat, "lon": value.lon}
    if type(value) is schedule:
        every = value.run_every.total_seconds()
        if every <= 0:
            raise ConfigurationError(
                f"periodic task {name!r}: interval {every} s is not positive: give seconds > 0"
            )
        return "interval", {"every": every, "relative": bool(value.relative)}
    raise ConfigurationError(
        f"periodic task {name!r}: schedule {value!r} ({type(value).__name__}) cannot be "
        "stored in PostgreSQL: use a number of seconds, a timedelta, celery.schedules."
        "schedule, crontab or solar"
    )


def from_row(kind: str, spec: Mapping[str, Any], app: Any, name: str = "?") -> BaseSchedule:
    """The Celery schedule of a stored row.

    Raises:
        ConfigurationError: an unknown kind, an invalid crontab field or time zone, a
            solar event Celery does not know, a solar schedule without the ``ephem``
            package (each names the entry and the fix).
    """
    try:
        if kind == "interval":
            every = float(spec["every"])
            if every <= 0:
                raise ValueError(f"interval {every} s is not positive")
            return schedule(timedelta(seconds=every), relative=bool(spec.get("relative")), app=app)
        if kind == "crontab":
            fields = {f: spec.get(f, "*") for f in _CRON_FIELDS}
            cron = crontab(app=app, **fields)
            tz = spec.get("tz")
            if tz:
                cron.tz = ZoneInfo(str(tz))  # the app's timezone otherwise
            return cron
        if kind == "solar":
            return solar(str(spec["event"]), float(spec["lat"]), float(spec["lon"]), app=app)
    except ZoneInfoNotFoundError as exc:
        raise ConfigurationError(
            f"periodic task {name!r}: unknown time zone {spec.get('tz')!r}: give an IANA "
            "name such as 'Europe/Paris'"
        ) from exc
    except (KeyError, TypeError, ValueError, ImportError, ImproperlyConfigured) as exc:
        # ImproperlyConfigured: a solar schedule without the ephem package
        raise ConfigurationError(
            f"periodic task {name!r}: invalid {kind} schedule {dict(spec)!r}: {exc}"
        ) from exc
    raise ConfigurationError(
        f"periodic task {name!r}: unknown schedule kind {kind!r} (one of {', '.join(KINDS)})"
    )


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def _remaining(sched: BaseSchedule, last_run_at: datetime, now: datetime) -> timedelta:
    # A copy with its clock at ``now``. Not copy.copy: crontab's __reduce__ rebuilds it
    # from its fields and drops a time zone set on it (``cron.tz = ...``).
    frozen = object.__new__(type(sched))
    frozen.__dict__.update(sched.__dict__)
    frozen.nowfun = lambda: now
    result: timedelta = frozen.remaining_estimate(last_run_at)
    return result


def next_due(sched: BaseSchedule, last_run_at: datetime) -> datetime:
    """The first instant after ``last_run_at`` at which Celery's ``is_due`` holds (an
    aware UTC datetime), except where Celery's crontab is due at once after a run in the
    repeated hour of a DST fall-back (its target is before its last run; celery beat sends
    at every tick then, until the target's wall time comes again): the target's second
    occurrence."""
    last = _aware(last_run_at)
    t = last
    if isinstance(sched, crontab):
        end = last + _remaining(sched, last, last)
        if end < last:
            # Celery's crontab, run last in the repeated hour of a DST fall-back before
            # the minute it runs at (01:02 EST, second 01:00-02:00), aims at that minute's
            # first occurrence (01:30 EDT, already past) and is due at once, and again
            # after each run, until then: the same wall time's second occurrence is
            # the next run (01:30 EST).
            later = end.astimezone(sched.tz).replace(fold=1).astimezone(timezone.utc)
            if later > last:
                return later
    for _ in range(4):  # a DST shift moves the end once; the loop settles at once
        rem = _remaining(sched, last, t)
        if rem <= timedelta(0) and t > last:
            break
        step = rem if rem > timedelta(0) else timedelta(microseconds=1)
        t = t + step
    return t.astimezone(timezone.utc)


def latest_due(
    sched: BaseSchedule, last_run_at: datetime, now: datetime
) -> tuple[datetime | None, int, datetime]:
    """Due times after ``last_run_at`` up to ``now``: ``(latest, count, next)``, the
    latest due time passed (None: none yet), how many passed, and the first due time
    after ``now``."""
    now = _aware(now)
    latest: datetime | None = None
    count = 0
    if type(sched) is schedule and not sched.relative:  # elapsed time: plain arithmetic
        every = sched.run_every
        due = _aware(last_run_at).astimezone(timezone.utc) + every
        if due > now:
            return None, 0, due
        count = int((now - due) / every) + 1
        latest = due + every * (count - 1)
        return latest, count, latest + every
    due = next_due(sched, last_run_at)
    while due <= now:
        latest, count = due, count + 1
        if count >= _MAX_STEPS:  # a very long outage: jump
            return latest, count, next_due(sched, now)
        due = next_due(sched, due)
    return latest, count, due
