"""Push-based waiting for results: LISTEN/NOTIFY instead of polling.

:class:`ResultConsumer` is Celery's async result consumer
(:class:`celery.backends.asynchronous.BaseResultConsumer`, the model being the Redis
backend's pub/sub consumer) for :class:`~kombu_pgmq.results.backend.ResultBackend`.
Every stored result and revocation NOTIFYs channel ``kombu_pgmq_results`` (migration
0018); a process waiting in ``AsyncResult.get()``, ``ResultSet.join_native()``,
``iter_native()`` or ``get_many()`` holds one connection that LISTENs there and wakes when
a task it waits for is written: no polling, no ``interval``.

Payloads: ``<key>\\n<meta base64>`` (results up to 5,000 bytes: no read needed),
``<key>`` (larger results: read by key), ``revoked\\n<task id>`` (a durable revocation).

A notification cannot be missed: waiting starts by subscribing (LISTEN is on before
anything is read), then reads the current state. After a lost connection (a server
restart, a failover) the consumer reconnects, LISTENs again and **re-reads** every task it
still waits for, so a result stored while it was disconnected is found; while the server
is unreachable it retries every second and ``get(timeout=...)`` still times out on time.
Every :data:`RESYNC_SECONDS` (30) it re-reads what it waits for anyway: a notification lost
by means nobody saw (a half-open TCP connection) costs at most that long.

Behind a transaction pooler without ``direct_url`` (the backend's ``listen_dsn`` is
None) there is no LISTEN: waiting re-reads what it waits for every ``polling_interval``.

One connection per process and thread that waits (the backend is per thread in Celery);
processes that never wait (workers) open none.
"""

from __future__ import annotations

import base64
import logging
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from celery import states
from celery.backends.asynchronous import BaseResultConsumer

from .. import errors
from .._db.connector import Connector
from .._db.results import CHANNEL, ResultStore

logger = logging.getLogger(__name__)

__all__ = ["ResultConsumer"]

#: Seconds between re-reads of what is waited for, whatever the notifications said: the
#: longest a result whose notification was lost unseen (a half-open TCP connection) waits.
#: 30 s: such a loss is rare, and the re-read costs one statement per waiting process
#: every period.
RESYNC_SECONDS = 30.0
#: Seconds between reconnect attempts while the server is unreachable: a restarted
#: server is found within a second; an attempt while it is down is refused at once.
RECONNECT_SECONDS = 1.0


class ResultConsumer(BaseResultConsumer):
    """Waits for results of the task ids it is told to :meth:`consume_from`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.RLock()
        self._db: Connector | None = None
        self._listening = False
        self._listener_pid = 0  # the server process that LISTENs (a reconnect changes it)
        self._subscribed: set[str] = set()
        self._inbox: deque[tuple[str, str]] = deque()
        self._watchers: list[Callable[[dict[str, Any]], None]] = []
        self._next_resync = 0.0
        self._warned = False

    # -- Celery's consumer API ------------------------------------------------------------

    def start(self, initial_task_id: str, **kwargs: Any) -> None:
        self.consume_from(initial_task_id)

    def stop(self) -> None:
        with self._lock:
            db, self._db = self._db, None
            self._listening = False
            if db is not None:
                db.close()

    def on_after_fork(self) -> None:
        # The parent's connection is abandoned by the connector in the child (never used).
        self._lock = threading.RLock()
        self._db = None
        self._listening = False
        self._listener_pid = 0
        self._subscribed = set()
        self._inbox.clear()
        self._watchers = []

    def consume_from(self, task_id: str) -> None:
        """Wait for ``task_id`` too: LISTEN is on when this returns (a result stored
        after it wakes the waiter), unless the server is unreachable (then the first
        successful reconnect re-reads it)."""
        with self._lock:
            self._subscribed.add(task_id)
            self._ensure_listening()

    def cancel_for(self, task_id: str) -> None:
        with self._lock:
            self._subscribed.discard(task_id)

    def watch(self, task_ids: Iterable[str], watcher: Callable[[dict[str, Any]], None]) -> set[str]:
        """Subscribe ``task_ids`` and call ``watcher(meta)`` with every result handed to
        Celery (``get_many``); returns the ids that were not subscribed before."""
        with self._lock:
            added = set(task_ids) - self._subscribed
            self._watchers.append(watcher)
            self._subscribed |= added
            self._ensure_listening()
        return added

    def unwatch(self, task_ids: Iterable[str], watcher: Callable[[dict[str, Any]], None]) -> None:
        """Undo :meth:`watch` (``task_ids``: the ids it returned)."""
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)
            self._subscribed.difference_update(task_ids)

    def on_wait_for_pending(self, result: Any, **kwargs: Any) -> None:
        # Subscribed already (add_pending_result -> consume_from): read the state now, so
        # a result stored before LISTEN was on is not waited for in vain.
        for meta in result._iter_meta(**kwargs):
            if meta is not None:
                self.on_state_change(meta, None)

    def on_state_change(self, meta: dict[str, Any], message: Any) -> None:
        for watcher in list(self._watchers):
            watcher(meta)
        super().on_state_change(meta, message)
        if meta["status"] in states.READY_STATES:
            self.cancel_for(meta["task_id"])

    def drain_events(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (None: one second) for notifications and hand
        every stored result of a subscribed task to Celery (``on_state_change``)."""
        wait = 1.0 if timeout is None else max(0.0, timeout)
        if self.backend.listen_dsn is None:  # no LISTEN: poll
            left = self._next_resync - time.monotonic()
            if left > 0:
                time.sleep(min(wait, left))
            if time.monotonic() >= self._next_resync:
                with self._lock:
                    self._resync(self.backend.polling_interval)
            return
        with self._lock:
            db = self._ensure_listening()
            if db is not None and time.monotonic() >= self._next_resync:
                self._resync()
        if db is None:
            time.sleep(min(wait, RECONNECT_SECONDS))
            return
        if not self._inbox:
            try:
                ready, _, _ = select.select([db.fileno()], [], [], wait)
            except (OSError, ValueError, errors.BrokerConnectionError):
                ready = [True]  # a closed socket: poll_notifies reports it
            if ready:
                with self._lock:
                    try:
                        db.poll_notifies()
                    except errors.BrokerConnectionError as exc:
                        self._lost(exc)
                        return
        self._deliver()

    # -- internals --------------------------------------------------------------------------

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == CHANNEL:
            self._inbox.append((channel, payload))

    def _ensure_listening(self) -> Connector | None:
        """The LISTEN connection (connecting, LISTENing and re-reading every subscribed
        task after a reconnect); None while the server is unreachable, or without LISTEN
        (behind a transaction pooler without ``direct_url``: waiting polls)."""
        if self.backend.listen_dsn is None:
            return None
        db = self._db
        if (
            db is not None
            and self._listening
            and db.connected
            and db.backend_pid == self._listener_pid
        ):
            return db
        # The first LISTEN of a consumer that never lost one: whoever subscribed reads
        # next (on_wait_for_pending, get_many), no re-read needed.
        first = self._listener_pid == 0 and not self._warned
        if db is None:
            db = self._db = self.backend.listen_connector(self._on_notify)
            if db is None:
                return None
        try:
            ResultStore(db).listen()
            self._listener_pid = db.backend_pid
        except errors.BrokerConnectionError as exc:
            self._lost(exc)
            return None
        if self._warned:
            logger.warning("result backend: listening again; re-reading awaited results")
            self._warned = False
        self._listening = True
        if first:
            self._next_resync = time.monotonic() + RESYNC_SECONDS
        else:
            self._resync()
        return db

    def _lost(self, exc: Exception) -> None:
        self._listening = False
        if not self._warned:
            logger.warning(
                "result backend: the LISTEN connection was lost (%s); reconnecting every "
                "%.0f s, then re-reading the results waited for",
                exc,
                RECONNECT_SECONDS,
            )
            self._warned = True

    def _resync(self, every: float | None = None) -> None:
        """Re-read every subscribed task (results stored while nothing listened); the
        next re-read in ``every`` seconds (None: :data:`RESYNC_SECONDS`)."""
        self._next_resync = time.monotonic() + (RESYNC_SECONDS if every is None else every)
        ids = list(self._subscribed)
        if not ids:
            return
        try:
            metas = self.backend.read_metas(ids)
        except errors.BrokerConnectionError as exc:
            self._lost(exc)
            return
        for meta in metas:
            self.on_state_change(meta, None)

    def _deliver(self) -> None:
        """Hand the notified results of subscribed tasks to Celery."""
        to_read: list[str] = []
        while self._inbox:
            _, payload = self._inbox.popleft()
            head, _, rest = payload.partition("\n")
            if head == "revoked":
                task_id = rest
                if task_id in self._subscribed:
                    to_read.append(task_id)
                continue
            task_id = self.backend.task_id_of(head)
            if task_id is None or task_id not in self._subscribed:
                continue
            if not rest:
                to_read.append(task_id)
                continue
            try:
                meta = self.backend.decode_result(base64.b64decode(rest))
            except Exception:  # undecodable here: read it the normal way
                to_read.append(task_id)
                continue
            self.on_state_change(meta, None)
        if to_read:
            try:
                metas = self.backend.read_metas(to_read)
            except errors.BrokerConnectionError as exc:
                with self._lock:
                    self._lost(exc)
                return
            for meta in metas:
                self.on_state_change(meta, None)
