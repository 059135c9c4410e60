"""Celery beat with its schedule in PostgreSQL, a leader elected among any number of beat
processes, and each tick sent once.

Use::

    celery -A proj beat -S kombu_pgmq.beat:Scheduler
    # or: app.conf.beat_scheduler = "kombu_pgmq.beat:Scheduler"; celery -A proj worker -B

Run as many beat processes as you like (on every host, or ``worker -B`` on every worker):
one leads (:mod:`kombu_pgmq.beat.leader`), the others wait and take over within
``beat_takeover_seconds`` when it dies, hangs or loses its connection. The schedule lives
in ``kombu_pgmq.beat_entries``: ``beat_schedule`` is written there when a process starts,
and again when it starts to lead (the config wins for the entries it names; entries
added at run time through :class:`~kombu_pgmq.beat.PeriodicTasks` or ``kombu-pgmq beat
add`` persist), and any
change reaches the leader at once (``NOTIFY kombu_pgmq_beat``).

Each tick once: the leader claims a tick, ``(entry, due time)`` under a unique key, in
the transaction that publishes the task (:func:`kombu_pgmq.using` on the leader's own
session, when the broker is kombu_pgmq in the same database), fenced by the leader's lock
(``kombu_pgmq.beat_claim``). A leader that dies mid-tick leaves nothing; its successor
sends the tick. Ticks missed while no leader ran are caught up per entry: ``once`` (one
tick, as ``celery beat`` after a restart) or ``skip``; never one per missed tick. With a
broker elsewhere (RabbitMQ, Redis) the publish precedes the commit: at least once.

Settings
========
Celery settings (``app.conf``), read by :mod:`kombu_pgmq.beat.settings`; the list below
is made from its :data:`~kombu_pgmq.beat.settings.SETTINGS` when this module is imported.

<!-- beat-settings -->

Bad entries never stop the others: an unknown task (when the app knows its tasks), an
invalid schedule, a queue that exists nowhere is logged once as an error naming the fix,
recorded as the entry's ``last_error`` (``kombu-pgmq beat list``) and tried again.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import select
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from time import monotonic
from typing import Any

from celery import beat

from .. import _conninfo as conninfo
from .. import errors
from .._db.batch import BatchedPublisher
from .._db.beat import Claim
from ..schema import ensure_schema, verify
from .entries import LoadedEntry, check_task, from_config, tick_task_id, validate_queue
from .leader import Leader
from .settings import (
    OPTIONS_MARKER,
    catch_up,
    database_url,
    history_seconds,
    install_schema,
    lookahead_seconds,
    options_rst,
    takeover_seconds,
)

if __doc__:  # None under python -OO
    __doc__ = __doc__.replace(OPTIONS_MARKER, options_rst())

__all__ = ["Scheduler"]

logger = logging.getLogger(__name__)

#: Ticks claimed and published per transaction (heartbeats run between batches).
BATCH = 500
#: A failing entry (its publish or its checks) is tried again after this many seconds.
RETRY_SECONDS = 10.0
#: ``skip``: a due time at most this old when the leader gets to it is on time (sent).
ON_TIME_SECONDS = 2.0
#: Seconds between prunes of old ticks.
PRUNE_SECONDS = 60.0


class _Fenced(Exception):
    """The claim found this session no longer leads."""


class Scheduler(beat.Scheduler):
    """Celery's :class:`celery.beat.Scheduler` on PostgreSQL (see the module docstring)."""

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        conf = app.conf
        self.dsn = database_url(app)
        self.takeover_seconds = takeover_seconds(conf)
        self.default_catch_up = catch_up(conf)
        self.history_seconds = history_seconds(conf)
        self.install_schema = install_schema(conf)
        self.lookahead_seconds = lookahead_seconds(conf)
        self._ready = False  # schema installed or checked
        self._waiting = False  # the database could not be reached (logged once)
        self._leader: Leader | None = None
        self._entries: dict[str, LoadedEntry] = {}
        self._queue: list[tuple[datetime, str]] = []
        self._manual: set[str] = set()
        self._dirty = True
        self._config: list[dict[str, Any]] = []
        self._broker_here: bool | None = None
        self._next_prune = 0.0
        self._queues_seen: dict[str, float] = {}
        #: Ticks this process sent, and claims a fence refused (diagnostics, tests).
        self.sent = 0
        self.fenced = 0
        super().__init__(app, *args, **kwargs)

    # -- Celery's Scheduler API ------------------------------------------------------------

    @property
    def leader(self) -> Leader:
        if self._leader is None:
            self._leader = Leader(self.dsn, self.takeover_seconds, self._on_notify)
        return self._leader

    def setup_schedule(self) -> None:
        self._config = self._read_config()
        if self._prepare():
            self._sync_config()  # this process's config applies now (and again when it leads)
        if not [t for t in self.app.tasks if not t.startswith("celery.")]:
            logger.warning(
                "beat: app %r registers no task: periodic tasks are sent by name, unchecked",
                self.app.main,
            )

    def _prepare(self) -> bool:
        """Install (or check) the schema once; False while the database cannot be reached
        (a beat started during an outage waits for it instead of exiting).

        Raises:
            BootstrapError: the schema is missing and ``beat_install_schema`` is off.
        """
        if self._ready:
            return True
        connector = self.leader.connector
        try:
            if self.install_schema:
                ensure_schema(connector, self.dsn)
            else:
                verify(connector)
        except errors.BrokerConnectionError as exc:
            if not self._waiting:
                logger.warning("beat: the database cannot be reached (%s); waiting for it", exc)
                self._waiting = True
            return False
        self._ready = True
        return True

    def get_schedule(self) -> dict[str, Any]:
        return {
            e.name: self.Entry(
                name=e.name,
                task=e.row.task,
                last_run_at=e.row.last_run_at,
                total_run_count=e.row.total_run_count,
                schedule=e.schedule,
                args=e.row.args,
                kwargs=e.row.kwargs,
                options=e.row.options,
                app=self.app,
            )
            for e in self._entries.values()
            if e.schedule is not None
        }

    def set_schedule(self, schedule: Any) -> None:  # the table is the schedule
        pass

    schedule = property(get_schedule, set_schedule)

    @property
    def info(self) -> str:
        return (
            f"kombu_pgmq: {conninfo.redact(self.dsn)} (leader election, takeover "
            f"{self.takeover_seconds:g} s)"
        )

    def sync(self) -> None:  # every change is committed as it is made
        pass

    def close(self) -> None:
        try:
            if self._leader is not None:
                self._leader.close()
                self._leader = None
            super().close()
        finally:
            # Celery's producer and its broker connection (cached properties): Celery 5.7's
            # Scheduler.close releases them, 5.5 and 5.6 leave them open.
            self.__dict__.pop("producer", None)
            connection = self.__dict__.pop("connection", None)
            if connection is not None:
                connection.release()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Elect, then (leading) send what is due; returns seconds to the next call."""
        leader = self.leader
        if not self._prepare():
            return leader.round_seconds
        if monotonic() >= leader.round_due and leader.elect():
            self._on_lead()
        if not leader.is_leader:
            return max(0.0, leader.round_due - monotonic())
        try:
            self._poll()
            if self._dirty:
                self._load()
            self._send_due()
            if monotonic() >= self._next_prune:
                self._next_prune = monotonic() + PRUNE_SECONDS
                leader.store.prune(self.history_seconds, 10_000)
        except errors.BrokerConnectionError as exc:
            leader.step_down(f"the connection was lost ({exc})")
            return 0.0
        return self._wait()

    # -- leading -------------------------------------------------------------------------

    def _on_lead(self) -> None:
        try:
            self.leader.store.listen()
        except errors.KombuPgmqError as exc:
            self.leader.step_down(f"LISTEN failed ({exc})")
            return
        self._sync_config()
        self._dirty = True

    def _sync_config(self) -> None:
        """Write this process's ``beat_schedule`` (the config wins for what it names)."""
        try:
            written, removed = self.leader.store.sync_config(self._config)
        except errors.KombuPgmqError as exc:
            logger.warning("beat: syncing beat_schedule failed (%s); trying when leading", exc)
            return
        if written or removed:
            logger.info("beat: beat_schedule synced (%d written, %d removed)", written, removed)

    def _read_config(self) -> list[dict[str, Any]]:
        data: dict[str, Any] = {}
        if self.app.conf.result_expires and not self.app.backend.supports_autoexpire:
            from celery.schedules import crontab

            data["celery.backend_cleanup"] = {
                "task": "celery.backend_cleanup",
                "schedule": crontab("0", "4", "*"),
                "options": {"expires": 12 * 3600},
            }
        data.update(self.app.conf.beat_schedule or {})
        rows = []
        for name, item in data.items():
            try:
                rows.append(from_config(name, item, self.app, self.default_catch_up))
            except errors.ConfigurationError as exc:
                logger.error("beat: %s; this entry is left out, the others run", exc)
        return rows

    def _on_notify(self, channel: str, payload: str) -> None:
        self._dirty = True

    def _poll(self) -> None:
        self.leader.connector.poll_notifies()

    def _load(self) -> None:
        """Read every entry, compute due times, record next runs and errors."""
        self._dirty = False
        rows = self.leader.store.entries()
        old = self._entries
        self._entries = {}
        self._queue = []
        self._manual = set()
        for row in rows:
            entry = LoadedEntry.load(row, self.app)
            previous = old.get(row.name)
            if previous is not None and previous.row.updated_at == row.updated_at:
                entry.retry_after, entry.warned = previous.retry_after, previous.warned
                if previous.error and not entry.error and entry.retry_after > monotonic():
                    entry.error = previous.error  # a failed send: kept until its retry
            if entry.schedule is not None:
                try:
                    check_task(self.app, row.task, row.name)
                except errors.ConfigurationError as exc:
                    entry.schedule, entry.error = None, str(exc)
            if entry.error:
                self._warn(entry, entry.error)
            self._entries[row.name] = entry
            if row.enabled and entry.due is not None:
                self._schedule(entry, entry.due)
            if row.enabled and row.run_requested_at is not None:
                self._manual.add(row.name)
        self._note(list(self._entries.values()))

    def _note(self, entries: list[LoadedEntry]) -> None:
        epoch = self.leader.epoch
        if epoch is None or not entries:
            return
        self.leader.store.note(
            epoch, [e.name for e in entries], [e.due for e in entries], [e.error for e in entries]
        )

    def _warn(self, entry: LoadedEntry, message: str) -> None:
        if message not in entry.warned:
            entry.warned.add(message)
            logger.error("beat: %s; the other entries run", message)

    # -- sending -------------------------------------------------------------------------

    def _schedule(self, entry: LoadedEntry, when: datetime) -> None:
        entry.when = when
        heapq.heappush(self._queue, (when, entry.name))

    def _horizon(self) -> float:
        """Seconds ahead a tick may be published (0 unless the broker is here)."""
        if self.lookahead_seconds and self._broker_here is None:
            self._broker_here = self._check_broker_here(self._broker_url())
        return self.lookahead_seconds if self._broker_here else 0.0

    def _send_due(self) -> None:
        now = datetime.now(timezone.utc)
        horizon = now + timedelta(seconds=self._horizon())
        batch: list[tuple[LoadedEntry, Claim]] = []
        for name in sorted(self._manual):
            entry = self._entries.get(name)
            requested = entry.row.run_requested_at if entry is not None else None
            if entry is None or requested is None or not entry.row.enabled:
                self._manual.discard(name)
                continue
            task_id = tick_task_id(name, requested)
            batch.append((entry, Claim(name, requested, requested, None, task_id, "manual", 0)))
        if batch:  # a transaction of their own: one claim per entry and statement
            self._commit(batch)
            batch = []
        while self._queue and self._queue[0][0] <= horizon:
            when, name = heapq.heappop(self._queue)
            entry = self._entries.get(name)
            if entry is None or when != entry.when or not entry.row.enabled:
                continue  # superseded by a reload, a retry or a later due time
            if monotonic() < entry.retry_after:
                self._schedule(entry, now + timedelta(seconds=entry.retry_after - monotonic()))
                continue
            claim = self._claim_for(entry, now, horizon)
            if claim is None:
                continue
            try:
                self._check(entry)
            except errors.ConfigurationError as exc:
                entry.error = str(exc)
                self._warn(entry, entry.error)
                self._retry_later(entry)
                continue
            batch.append((entry, claim))
            if len(batch) >= BATCH:
                self._commit(batch)
                batch = []
                if monotonic() >= self.leader.round_due and not self._heartbeat():
                    return
        if batch:
            self._commit(batch)

    def _claim_for(self, entry: LoadedEntry, now: datetime, horizon: datetime) -> Claim | None:
        row = entry.row
        if entry.schedule is None:
            return None
        latest, count, following = entry.passed(now)
        if latest is None:
            if following > horizon:
                entry.due = following
                self._schedule(entry, following)
                return None
            # Due within beat_lookahead_seconds: published now, invisible until then.
            _, _, after = entry.passed(following)
            ahead = tick_task_id(row.name, following)
            return Claim(row.name, following, row.last_run_at, after, ahead, "scheduled", 0)
        missed, kind = count - 1, "scheduled" if count == 1 else "catch-up"
        if row.catch_up == "skip" and count > 1:
            kind = "scheduled"
            if (now - latest).total_seconds() > ON_TIME_SECONDS:
                kind, missed = "skipped", count
        task_id = None if kind == "skipped" else tick_task_id(row.name, latest)
        return Claim(row.name, latest, row.last_run_at, following, task_id, kind, missed)

    def _check(self, entry: LoadedEntry) -> None:
        """Refuse a queue that exists nowhere (cached a minute per queue)."""
        queue = entry.row.options.get("queue")
        if not queue or self._queues_seen.get(queue, 0.0) > monotonic():
            return
        validate_queue(entry.name, entry.row.options, self.app, self.leader.connector)
        self._queues_seen[queue] = monotonic() + 60.0

    def _heartbeat(self) -> bool:
        self.leader.elect()
        return self.leader.is_leader

    def _commit(self, batch: list[tuple[LoadedEntry, Claim]]) -> None:
        leader = self.leader
        epoch = leader.epoch
        if epoch is None:
            return
        try:
            with leader.store.transaction():
                claimed = leader.store.claim(epoch, leader.me, [c for _, c in batch])
                if claimed is None:
                    raise _Fenced
                with self._publishing() as published:
                    for entry, claim in batch:
                        if claim.name in claimed and claim.kind != "skipped":
                            self._apply(entry, claim, published)
        except _Fenced:
            self.fenced += 1
            leader.step_down("another process leads now (its claim was fenced)")
            return
        except errors.BrokerConnectionError:
            raise
        except Exception as exc:
            if len(batch) > 1:  # find the entry that fails; the others go on
                for item in batch:
                    self._commit([item])
                return
            entry = batch[0][0]
            entry.error = (
                f"periodic task {entry.name!r}: sending {entry.row.task!r} failed: {exc!r}"
            )
            self._warn(entry, entry.error)
            self._retry_later(entry)
            return
        for entry, claim in batch:
            if claim.name not in claimed:
                self._dirty = True  # changed or sent by someone else meanwhile: re-read
                continue
            self._advance(entry, claim)

    def _advance(self, entry: LoadedEntry, claim: Claim) -> None:
        row = entry.row
        if claim.kind == "manual":
            self._manual.discard(row.name)
            entry.row = row._replace(run_requested_at=None, total_run_count=row.total_run_count + 1)
            self.sent += 1
            logger.info("beat: sent %s (%s) now, as asked", row.name, row.task)
            return
        sent = claim.kind != "skipped"
        entry.row = row._replace(
            last_run_at=claim.due_at,
            total_run_count=row.total_run_count + sent,
            missed_ticks=row.missed_ticks + claim.missed,
            last_error=None,
        )
        entry.error = None
        entry.warned.clear()
        entry.due = claim.next_run
        self.sent += sent
        if claim.next_run is not None:
            self._schedule(entry, claim.next_run)
        if sent:
            logger.info("beat: sent %s (%s) due %s", row.name, row.task, claim.due_at.isoformat())

    def _retry_later(self, entry: LoadedEntry) -> None:
        entry.retry_after = monotonic() + RETRY_SECONDS
        self._schedule(entry, datetime.now(timezone.utc) + timedelta(seconds=RETRY_SECONDS))
        try:
            self._note([entry])
        except errors.KombuPgmqError as exc:
            logger.debug("beat: recording an entry's error failed: %s", exc)

    @contextlib.contextmanager
    def _publishing(self) -> Iterator[BatchedPublisher | None]:
        """Publishes of the block go into the leader's transaction when the broker is
        kombu_pgmq in the schedule's database."""
        url = self._broker_url()
        if self._broker_here is None:
            self._broker_here = self._check_broker_here(url)
        if self._broker_here:
            from ..transactional import using

            bound = using(self.leader.connector.connection, broker_url=url)
            with bound, bound.binding.batched() as batch:
                yield batch
        else:
            yield None

    def _broker_url(self) -> str | None:
        conf = self.app.conf
        url = conf.broker_write_url or conf.broker_url
        return ";".join(url) if isinstance(url, (list, tuple)) else url

    def _check_broker_here(self, url: str | None) -> bool:
        if not url or not conninfo.is_ours(url, self.app.conf.broker_transport) or ";" in url:
            logger.warning(
                "beat: the broker is not kombu_pgmq in the schedule's database: each tick is "
                "sent at least once (exactly once needs both in one database)"
            )
            return False
        from ..transactional import using

        bound = using(self.leader.connector.connection, broker_url=url)
        try:
            bound.binding.check_broker(conninfo.to_dsn(url), "the Celery app's broker_url")
        except errors.ConfigurationError as exc:
            logger.warning("beat: %s: each tick is sent at least once", exc)
            return False
        return True

    def _apply(self, entry: LoadedEntry, claim: Claim, batch: BatchedPublisher | None) -> None:
        row = entry.row
        options = dict(row.options)
        ahead = claim.kind != "manual" and claim.due_at > datetime.now(timezone.utc)
        if batch is not None:
            # Published ahead (beat_lookahead_seconds): invisible until the due time, and
            # a relative expiry counts from then.
            batch.visible_at = claim.due_at if ahead else None
            expires = options.get("expires")
            if ahead and isinstance(expires, (int, float)) and not isinstance(expires, bool):
                options["expires"] = claim.due_at + timedelta(seconds=expires)
        options["headers"] = {**dict(options.get("headers") or {}), "celery_beat_task": True}
        options["task_id"] = claim.task_id
        task = self.app.tasks.get(row.task)
        if task is not None:
            task.apply_async(row.args, row.kwargs, producer=self.producer, **options)
        else:
            self.app.send_task(row.task, row.args, row.kwargs, producer=self.producer, **options)

    def _wait(self) -> float:
        """Wait on the leader's connection until the next due time, the next election
        round, or a notification; returns 0 (call tick again)."""
        until = self.leader.round_due
        if self._queue:
            head = self._queue[0][0] - timedelta(seconds=self._horizon())
            delta = (head - datetime.now(timezone.utc)).total_seconds()
            until = min(until, monotonic() + max(delta, 0.0))
        timeout = until - monotonic()
        if timeout > 0:
            try:
                select.select([self.leader.connector.fileno()], [], [], timeout)
            except (OSError, ValueError, errors.BrokerConnectionError):
                return max(0.0, until - monotonic())
        return 0.0
