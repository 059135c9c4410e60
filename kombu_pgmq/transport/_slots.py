"""Concurrency slots held by tasks that run on after their message is acked.

A queue's ``concurrency`` and ``key_concurrency`` limits (:mod:`kombu_pgmq.limits`) count
what is in flight: messages delivered and not settled. Celery acks a task's message when
the task starts unless ``acks_late`` (its default), and the ack archives the message, so
that count alone would cap tasks waiting in workers, not running ones. For such a task
the ack holds the task's *slot* (a row of ``kombu_pgmq.held_slots``, written by the ack
statement itself, in its transaction, before it archives the message: the limit never
sees the slot free): the limits count it until the task finishes. The ack archives the
message all the same, so an early-acked task is never delivered again (Celery's
at most once); only its slot outlives the ack.

* **Which acks hold a slot**: an ack, in a Celery worker's main process, of a message of a
  limited queue whose task Celery runs now (``celery.worker.state.active_requests``):
  Celery's early ack comes when the pool starts the task, its late ack after the task
  finished (the request is no longer active then: no slot). Its receipt carries
  ``hold_seconds``; :class:`Slots` remembers the slot.
* **Released** when the request leaves ``active_requests`` (the task succeeded, failed,
  was retried, revoked or terminated, or its pool process died): checked at every turn of
  Celery's event loop (prefork and solo: the pool's results arrive there), right after
  the task in its own process (``task_postrun``: threads, gevent, solo), and at each
  lease renewal round (any pool).
* **Never lost for good**: a slot is held for one visibility timeout and renewed with the
  leases (:mod:`._leases`); if the worker dies, its slots stop counting one visibility
  timeout after their last renewal.

Renewals and releases go through the lease keeper's connection and lock (a release may
run on a pool thread; the statement connection may have a read in flight). A release is
sent without waiting for its result (read before that connection's next statement): the
event loop that saw the task finish goes on at once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from time import monotonic
from typing import Any, NamedTuple

from .._db.connector import Connector
from .._db.limits import LimitStore
from ..errors import KombuPgmqError

logger = logging.getLogger(__name__)

__all__ = ["Slots", "release_task", "running_request"]

#: Every live :class:`Slots` of this process (``task_postrun`` reaches them by task id).
_ALL: weakref.WeakSet[Slots] = weakref.WeakSet()


class _Slot(NamedTuple):
    task_id: str
    request: Callable[[], Any]  # weak reference to Celery's request
    hold_seconds: int
    since: float  # monotonic() when its ack was made


def running_request(message: Any) -> Any:
    """Celery's request for the task of Kombu ``message`` if this process's worker runs
    it now (``celery.worker.state.active_requests``), else None: not a Celery worker, not
    a task message, or the task is not running (waiting for its ETA, or finished: a late
    ack comes after ``task_ready``)."""
    state = sys.modules.get("celery.worker.state")
    if state is None:
        return None
    headers = getattr(message, "headers", None) or {}
    task_id = headers.get("id") or (getattr(message, "properties", None) or {}).get(
        "correlation_id"
    )
    if not task_id:
        return None
    request = state.requests.get(task_id)
    if request is None or getattr(request, "message", None) is not message:
        return None
    return request if request in state.active_requests else None


def release_task(task_id: str) -> None:
    """Release the slots of task ``task_id`` held in this process (Celery's
    ``task_postrun``, in the process that ran the task: with threads, gevent or solo
    pools, the worker's own). Failures are logged: the lease round releases it later."""
    for slots in list(_ALL):
        if slots:
            slots.release_task(task_id)


class Slots:
    """The slots this connection holds for tasks running after their ack.

    Arguments:
        connector: returns the connection the statements go through (the lease keeper's).
        lock: held around each statement (the lease keeper's: a renewal round uses the
            same connection).
    """

    def __init__(self, connector: Callable[[], Connector], lock: Callable[[], Any]) -> None:
        self._connector = connector
        self._lock = lock
        self._held: dict[tuple[str, int], _Slot] = {}
        self._mutex = threading.Lock()
        self._pid = os.getpid()
        #: Slots held since start (for tests and diagnostics).
        self.holds = 0
        _ALL.add(self)

    def __bool__(self) -> bool:
        return bool(self._held) and self._pid == os.getpid()

    def __len__(self) -> int:
        return len(self._held) if self._pid == os.getpid() else 0

    def after_fork(self) -> None:
        """In a forked child: forget the parent's slots (they are the parent's to release)."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._held = {}
            self._mutex = threading.Lock()

    def track(self, queue: str, msg_id: int, request: Any, hold_seconds: int) -> None:
        """Remember the slot the ack of delivery ``msg_id`` of PGMQ queue ``queue`` holds
        for its running task (Celery ``request``): it is renewed with the leases and
        released when the task ends. The ack itself holds it (its receipt's
        ``hold_seconds``); a queue without a concurrency limit holds none, and the first
        renewal forgets it."""
        self.after_fork()
        with self._mutex:
            self._held[(queue, msg_id)] = _Slot(
                str(request.id), weakref.ref(request), hold_seconds, monotonic()
            )
        self.holds += 1

    def release_finished(self) -> None:
        """Release the slots whose task finished (its request is no longer active)."""
        if not self:
            return
        state = sys.modules.get("celery.worker.state")
        active = state.active_requests if state is not None else ()
        with self._mutex:
            done = [k for k, s in self._held.items() if s.request() not in active]
        if done:
            self._release(done)

    def release_task(self, task_id: str) -> None:
        """Release the slots of task ``task_id`` (it finished)."""
        with self._mutex:
            done = [k for k, s in self._held.items() if s.task_id == task_id]
        if done:
            self._release(done)

    def _release(self, done: list[tuple[str, int]]) -> None:
        with self._mutex:
            done = [k for k in done if self._held.pop(k, None) is not None]
        if not done:
            return
        try:
            with self._lock():
                LimitStore(self._connector()).release_slots_nowait(done, on_error=_failed(done))
        except KombuPgmqError as exc:
            _failed(done)(exc)

    def renew(self, connector: Connector) -> int:
        """One lease round (the caller holds the lock): release the slots whose task
        finished, renew the others on ``connector``; returns how many are held.

        Raises:
            BrokerConnectionError: the connection was lost (the next round retries).
        """
        if not self:
            return 0
        state = sys.modules.get("celery.worker.state")
        active = state.active_requests if state is not None else ()
        with self._mutex:
            done = [k for k, s in self._held.items() if s.request() not in active]
            for key in done:
                del self._held[key]
            by_hold: dict[int, list[tuple[str, int]]] = {}
            for key, slot in self._held.items():
                by_hold.setdefault(slot.hold_seconds, []).append(key)
        store = LimitStore(connector)
        if done:
            store.release_slots(done)
        for hold_seconds, keys in by_hold.items():
            kept = store.renew_slots(keys, hold_seconds)
            now = monotonic()
            with self._mutex:
                for key in keys:
                    found = self._held.get(key)
                    # not held: its queue has no concurrency limit (or was dropped), once
                    # its ack had time to arrive (it may still be in a batch)
                    if found is not None and key not in kept and now - found.since > hold_seconds:
                        del self._held[key]
        return len(self._held)


def _failed(slots: list[tuple[str, int]]) -> Callable[[KombuPgmqError], None]:
    """The ``on_error`` of a release of ``slots``: logged. Not lost: the slots stop
    counting one visibility timeout after their last renewal."""

    def failed(exc: KombuPgmqError) -> None:
        logger.warning(
            "could not release %d concurrency slot(s) (%s): they free themselves within "
            "the visibility timeout",
            len(slots),
            exc,
        )

    return failed
