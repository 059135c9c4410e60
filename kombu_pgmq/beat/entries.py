"""Periodic task entries: checked and converted between Celery's ``beat_schedule`` form,
stored rows and the scheduler's loaded form.

Raises :class:`~kombu_pgmq.errors.ConfigurationError` for bad input, naming the entry
and the fix: an empty name or task, a task the app does not know, a schedule that cannot
be stored or parsed (an invalid crontab field, an unknown time zone), a queue that exists
neither in ``task_queues`` nor in the broker, options or arguments that are not JSON.
"""

from __future__ import annotations

import difflib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from celery.schedules import BaseSchedule, crontab

from .._db.beat import StoredEntry
from .._db.connector import Connector
from .._db.declarations import Declarations
from .._naming import pgmq_queue_name
from ..errors import ConfigurationError
from .schedules import CATCH_UP, from_row, latest_due, next_due, to_row

__all__ = [
    "LoadedEntry",
    "UnregisteredTask",
    "check_task",
    "queue_of",
    "tick_task_id",
    "to_stored",
]

#: Entry options that are kombu_pgmq's, never passed to ``apply_async``.
OWN_OPTIONS = ("catch_up",)


class UnregisteredTask(ConfigurationError):
    """A periodic task names a task its Celery app does not register."""


def _json(value: Any, what: str, name: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"periodic task {name!r}: {what} {value!r} is not JSON ({exc}): a schedule stored "
            "in PostgreSQL takes JSON values only (numbers, strings, lists, dicts)"
        ) from exc


def queue_of(options: Mapping[str, Any]) -> str | None:
    """The queue an entry's options name (a name, or a kombu ``Queue``'s name)."""
    queue = options.get("queue")
    if queue is None:
        return None
    return str(getattr(queue, "name", queue))


def _options(options: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    opts = dict(options or {})
    queue = queue_of(opts)
    if queue is not None:
        opts["queue"] = queue
    for key in ("exchange",):
        if key in opts and not isinstance(opts[key], str):
            opts[key] = str(getattr(opts[key], "name", opts[key]))
    if isinstance(opts.get("expires"), timedelta):
        opts["expires"] = opts["expires"].total_seconds()
    if isinstance(opts.get("expires"), datetime):
        raise ConfigurationError(
            f"periodic task {name!r}: options expires is a datetime: give seconds after "
            "each send (a number), which every tick can use"
        )
    result: dict[str, Any] = _json(opts, "options", name)
    return result


def check_task(app: Any, task: str, name: str) -> None:
    """Refuse a task name the app does not know, when the app knows its tasks (a beat
    app that imports no task module sends by name, as ``celery beat`` does).

    Raises:
        UnregisteredTask: ``task`` is not registered in ``app`` (a ConfigurationError).
    """
    if app is None:
        return
    known = [t for t in app.tasks if not t.startswith("celery.")]
    if task not in app.tasks and known:
        close = difflib.get_close_matches(task, known, n=1)
        hint = f": did you mean {close[0]!r}?" if close else ""
        raise UnregisteredTask(
            f"periodic task {name!r}: task {task!r} is not registered in app {app.main!r}"
            f"{hint} (misspelled, or its module is not imported: add it to the app's imports "
            "or include)"
        )


def to_stored(
    name: str,
    task: str,
    schedule: Any,
    *,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    enabled: bool = True,
    catch_up: str = "once",
    app: Any = None,
    known_task: bool = True,
) -> dict[str, Any]:
    """The row of one entry (``name``, ``task``, ``schedule_kind``, ``schedule``,
    ``args``, ``kwargs``, ``options``, ``enabled``, ``catch_up``). ``schedule``: seconds,
    a timedelta, a Celery schedule, or a crontab expression string (``"*/5 * * * *"``).
    ``known_task``: refuse a task ``app`` does not register (:func:`check_task`).

    Raises:
        ConfigurationError: see the module docstring.
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigurationError(f"periodic task name {name!r}: give a non-empty string")
    if not isinstance(task, str) or not task.strip():
        raise ConfigurationError(
            f"periodic task {name!r}: task {task!r}: give the task's registered name"
        )
    if known_task:
        check_task(app, task, name)
    if isinstance(schedule, str):
        try:
            schedule = crontab.from_string(schedule)
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(
                f"periodic task {name!r}: invalid crontab {schedule!r}: {exc} (five fields: "
                "minute hour day-of-month month day-of-week)"
            ) from exc
    kind, spec = to_row(schedule, name)
    from_row(kind, spec, app, name)  # parses as the scheduler will
    if catch_up not in CATCH_UP:
        raise ConfigurationError(
            f"periodic task {name!r}: catch_up {catch_up!r}: give one of {', '.join(CATCH_UP)}"
        )
    if isinstance(args, (str, bytes)) or not isinstance(args, (list, tuple)):
        raise ConfigurationError(f"periodic task {name!r}: args {args!r}: give a list or tuple")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ConfigurationError(f"periodic task {name!r}: kwargs {kwargs!r}: give a dict")
    opts = _options(options, name)
    for own in OWN_OPTIONS:
        opts.pop(own, None)
    return {
        "name": name,
        "task": task,
        "schedule_kind": kind,
        "schedule": spec,
        "args": _json(list(args), "args", name),
        "kwargs": _json(dict(kwargs or {}), "kwargs", name),
        "options": opts,
        "enabled": bool(enabled),
        "catch_up": catch_up,
    }


def from_config(name: str, item: Mapping[str, Any], app: Any, default_catch_up: str) -> dict:
    """The row of one ``beat_schedule`` entry (Celery's keys: ``task``, ``schedule``,
    ``args``, ``kwargs``, ``options``; kombu_pgmq's: ``catch_up``, also read from
    ``options``).

    Raises:
        ConfigurationError: see the module docstring.
    """
    options = dict(item.get("options") or {})
    catch_up = item.get("catch_up", options.pop("catch_up", default_catch_up))
    return to_stored(
        name,
        item.get("task", ""),
        item.get("schedule"),
        args=item.get("args") or (),
        kwargs=item.get("kwargs"),
        options=options,
        catch_up=catch_up,
        app=app,
    )


def tick_task_id(name: str, due_at: datetime) -> str:
    """The Celery task id of one tick (the same for the same entry and due time)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"kombu_pgmq-beat:{name}@{due_at.isoformat()}"))


@dataclass
class LoadedEntry:
    """An entry as the leader schedules it: the stored row, its Celery schedule (None:
    unusable, ``error`` says why) and its next due time."""

    row: StoredEntry
    schedule: BaseSchedule | None
    error: str | None = None
    due: datetime | None = None
    #: The time this entry is queued for (its due time, or a retry).
    when: datetime | None = None
    #: Monotonic time before which a failed entry is not tried again.
    retry_after: float = 0.0
    warned: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def anchor(self) -> datetime:
        """What the next due time is computed from: the last tick's due time, else the
        entry's creation (a new entry runs first one period after it was added, as a new
        entry of ``celery beat``)."""
        return self.row.last_run_at or self.row.created_at

    @classmethod
    def load(cls, row: StoredEntry, app: Any) -> LoadedEntry:
        try:
            sched = from_row(row.schedule_kind, row.schedule, app, row.name)
        except ConfigurationError as exc:
            return cls(row, None, str(exc))
        entry = cls(row, sched)
        try:
            entry.due = next_due(sched, entry.anchor)
        except Exception as exc:  # a custom failure of Celery's schedule code
            entry.schedule, entry.error = None, f"periodic task {row.name!r}: {exc!r}"
        return entry

    def passed(self, now: datetime) -> tuple[datetime | None, int, datetime]:
        """``(latest due time passed, how many passed, next due time after now)``."""
        assert self.schedule is not None
        return latest_due(self.schedule, self.anchor, now)


def validate_queue(name: str, options: Mapping[str, Any], app: Any, db: Connector) -> None:
    """Refuse options naming a queue unknown to ``app`` (``task_queues``, the default
    queue) and to the broker in ``db``'s database (one statement).

    Raises:
        ConfigurationError: the queue exists nowhere.
    """
    queue = queue_of(options)
    if queue is None:
        return
    if app is not None:
        declared = {str(getattr(q, "name", q)) for q in app.conf.task_queues or ()}
        if queue in declared or queue == app.conf.task_default_queue:
            return
    if Declarations(db).queue_exists(pgmq_queue_name(queue)):
        return
    raise ConfigurationError(
        f"periodic task {name!r}: queue {queue!r} does not exist (not in task_queues, not "
        f"declared in the broker): start a worker with -Q {queue}, add it to task_queues, "
        "or fix the entry's options"
    )
