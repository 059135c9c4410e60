"""Periodic tasks managed at run time from application code: what django-celery-beat's
models give, without Django.

::

    from celery.schedules import crontab
    from kombu_pgmq.beat import PeriodicTasks

    with PeriodicTasks(app=app) as tasks:           # or PeriodicTasks("postgresql://...")
        tasks.add("nightly-report", "reports.nightly", crontab(hour=3, minute=0),
                  kwargs={"format": "pdf"}, options={"queue": "reports"})
        tasks.update("nightly-report", schedule=crontab(hour=4, minute=30))
        tasks.disable("nightly-report"); tasks.enable("nightly-report")
        tasks.run_now("nightly-report")             # once, now; the schedule does not move
        for t in tasks.history("nightly-report"): print(t.due_at, t.task_id)
        tasks.remove("nightly-report")

Every change is committed at once and reaches the leading beat without a restart
(``NOTIFY kombu_pgmq_beat``). Entries added here persist; entries named by a beat's
``beat_schedule`` are rewritten from it when a beat starts to lead (the config stays the
source of truth for what it names).

Errors: :class:`~kombu_pgmq.errors.ConfigurationError` for bad input (see
:mod:`kombu_pgmq.beat.entries`), :class:`UnknownPeriodicTask` for a name that is not
there, :class:`~kombu_pgmq.errors.BrokerConnectionError` when the database cannot be
reached.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from types import TracebackType
from typing import Any

from .. import _conninfo as conninfo
from .._db.beat import BeatStore, LeaderInfo, StoredEntry, StoredTick
from .._db.connector import Connector
from ..errors import ConfigurationError
from ..schema import ensure_schema
from .entries import to_stored, validate_queue

__all__ = ["PeriodicTask", "PeriodicTasks", "Tick", "UnknownPeriodicTask", "load_app"]

#: One stored periodic task (schedule and options as JSON values).
PeriodicTask = StoredEntry
#: One sent (or skipped) tick.
Tick = StoredTick


class UnknownPeriodicTask(ConfigurationError, LookupError):
    """No periodic task has that name."""


def load_app(name: str) -> Any:
    """The Celery app ``name`` names, found as ``celery -A name`` finds it (a module with
    an ``app`` or ``celery`` attribute, or ``module:attribute``; the current directory is
    searched first), its task modules imported (``imports``, ``include``): what
    ``PeriodicTasks(app=...)`` checks task names against.

    Raises:
        ConfigurationError: it cannot be found, or importing it (or its task modules)
            raised (the message says which and what to give).
    """
    from celery.app.utils import find_app

    try:
        app = find_app(name)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            f"cannot find the Celery app {name!r} ({type(exc).__name__}: {exc}): give the "
            "module that holds it (proj, proj.celery or proj.celery:app), from the "
            "directory that holds that module, as for celery -A"
        ) from None
    except Exception as exc:  # raised by the user's module as it was imported
        raise ConfigurationError(
            f"importing the Celery app {name!r} raised {type(exc).__name__}: {exc}"
        ) from None
    try:
        app.loader.import_default_modules()
    except Exception as exc:  # the app's imports or include
        raise ConfigurationError(
            f"importing the task modules of {name!r} (its imports or include) raised "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return app


class PeriodicTasks:
    """The schedule in PostgreSQL (see the module docstring).

    Arguments:
        url: the schedule's database (``postgresql://...``); default: ``app``'s
            (:func:`kombu_pgmq.beat.settings.database_url`).
        app: a Celery app: its settings give the database, and task names and queues
            are checked against it.
        check_queues: refuse options naming a queue that exists neither in the app's
            ``task_queues`` nor in the broker (default True).
        check_tasks: refuse a task name ``app`` does not register, when it registers
            tasks (default True; False: e.g. a task of workers deployed later).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        app: Any = None,
        check_queues: bool = True,
        check_tasks: bool = True,
    ) -> None:
        if url is None:
            if app is None:
                raise ConfigurationError(
                    "PeriodicTasks(): give the schedule's database URL or a Celery app"
                )
            from .settings import database_url

            self.dsn = database_url(app)
        else:
            self.dsn = conninfo.to_dsn(url)
        self.app = app
        self.check_queues = check_queues
        self.check_tasks = check_tasks
        self._db = Connector(self.dsn, role="beat-api")
        self._store = BeatStore(self._db)
        self._installed = False

    def __enter__(self) -> PeriodicTasks:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    @property
    def store(self) -> BeatStore:
        if not self._installed:
            if not self._store.installed():
                ensure_schema(self._db, self.dsn)
            self._installed = True
        return self._store

    def _check_queue(self, row: Mapping[str, Any]) -> None:
        if not self.check_queues:
            return
        validate_queue(row["name"], row["options"], self.app, self._db)

    def add(
        self,
        name: str,
        task: str,
        schedule: Any,
        *,
        args: Any = (),
        kwargs: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        enabled: bool = True,
        catch_up: str = "once",
        replace: bool = False,
    ) -> PeriodicTask:
        """Add a periodic task (``replace``: or replace the one of that name; its last
        run and counts are kept). ``schedule``: seconds, a timedelta, a Celery
        ``schedule``/``crontab``/``solar``, or a crontab string (``"*/5 * * * *"``).

        Raises:
            ConfigurationError: bad input, or the name exists and ``replace`` is False.
        """
        row = to_stored(
            name, task, schedule, args=args, kwargs=kwargs, options=options,
            enabled=enabled, catch_up=catch_up, app=self.app, known_task=self.check_tasks,
        )  # fmt: skip
        self._check_queue(row)
        from ..errors import StatementError

        try:
            self.store.upsert(row, replace=replace)
        except StatementError as exc:
            if "exists already" in str(exc):
                raise ConfigurationError(
                    f"periodic task {name!r} exists already: change it with update(), or "
                    "add(..., replace=True)"
                ) from None
            raise
        return self.get(name)

    def update(self, name: str, **changes: Any) -> PeriodicTask:
        """Change some of ``task``, ``schedule``, ``args``, ``kwargs``, ``options``,
        ``enabled``, ``catch_up`` of ``name``; the rest stays.

        Raises:
            UnknownPeriodicTask: no such name.
            ConfigurationError: bad input (an unknown key too).
        """
        allowed = {"task", "schedule", "args", "kwargs", "options", "enabled", "catch_up"}
        unknown = set(changes) - allowed
        if unknown:
            raise ConfigurationError(
                f"PeriodicTasks.update({name!r}): unknown field(s) {sorted(unknown)}: give "
                f"some of {sorted(allowed)}"
            )
        current = self.get(name)
        schedule = changes.get("schedule")
        if schedule is None:
            from .schedules import from_row

            schedule = from_row(current.schedule_kind, current.schedule, self.app, name)
        row = to_stored(
            name,
            changes.get("task", current.task),
            schedule,
            args=changes.get("args", current.args),
            kwargs=changes.get("kwargs", current.kwargs),
            options=changes.get("options", current.options),
            enabled=changes.get("enabled", current.enabled),
            catch_up=changes.get("catch_up", current.catch_up),
            app=self.app,
            known_task=self.check_tasks,
        )
        if "options" in changes:
            self._check_queue(row)
        self.store.upsert(row, replace=True)
        return self.get(name)

    def enable(self, name: str) -> None:
        """Send ``name`` again on its schedule.

        Raises:
            UnknownPeriodicTask: no such name.
        """
        if not self.store.set_enabled(name, True):
            raise self._unknown(name)

    def disable(self, name: str) -> None:
        """Stop sending ``name`` (kept, with its history).

        Raises:
            UnknownPeriodicTask: no such name.
        """
        if not self.store.set_enabled(name, False):
            raise self._unknown(name)

    def remove(self, name: str) -> bool:
        """Delete ``name`` (its history stays until pruned); False if it was not there."""
        return self.store.remove(name)

    def run_now(self, name: str) -> datetime:
        """Ask the leader to send ``name`` once, now (history kind ``manual``); the
        schedule does not move. Returns the request time (sent when a beat leads).

        Raises:
            UnknownPeriodicTask: no such name.
        """
        requested = self.store.run_now(name)
        if requested is None:
            raise self._unknown(name)
        return requested

    def get(self, name: str) -> PeriodicTask:
        """One periodic task.

        Raises:
            UnknownPeriodicTask: no such name.
        """
        entry = self.store.entry(name)
        if entry is None:
            raise self._unknown(name)
        return entry

    def all(self) -> list[PeriodicTask]:
        """Every periodic task, by name."""
        return self.store.entries()

    def history(self, name: str | None = None, limit: int = 50) -> list[StoredTick]:
        """Ticks sent (newest first) of ``name``, or of every entry."""
        return self.store.history(name, limit)

    def leader(self) -> LeaderInfo | None:
        """The leading beat (None: none ever led here); ``alive`` False: it is gone and
        no other took over yet."""
        return self.store.leader()

    def _unknown(self, name: str) -> UnknownPeriodicTask:
        return UnknownPeriodicTask(
            f"no periodic task named {name!r} (kombu-pgmq beat list shows them)"
        )
