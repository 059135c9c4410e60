"""Expired results deleted without Celery beat: a sweep in each ``celery worker``.

A worker whose result backend is kombu_pgmq's runs one :class:`ResultExpiry` in its main
process (started on ``worker_ready``, stopped on ``worker_shutdown``: see
:mod:`kombu_pgmq._worker_checks`, connected by ``import kombu_pgmq``; prefork children
never run it). Every ``expire_interval_seconds`` (``result_backend_transport_options``,
default 60; 0: off) it deletes the results past their ``result_expires`` (and expired
chord counters and revocations) in statements of ``expire_batch`` rows each, on a
connection of its own with ``lock_timeout`` set (:class:`~kombu_pgmq.transport._service.Service`),
opened for the round and closed after it (no connection is held between rounds).
Several workers sweeping the same database skip each other's rows (``SKIP LOCKED``).

``celery.backend_cleanup`` (Celery beat's daily task) and ``kombu-pgmq results expire``
run the same deletion at once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .._db.results import ResultStore
from ..schema import ensure_schema, verify
from ..transport._service import Service

__all__ = ["ResultExpiry", "running", "start", "stop"]

logger = logging.getLogger(__name__)

#: Statements of one round at most (a round never holds its thread for long; the rest
#: waits for the next round).
MAX_STATEMENTS_PER_ROUND = 100


class ResultExpiry(Service):
    """Delete expired results every ``interval_seconds``, ``batch`` rows per statement.

    Arguments:
        dsn: libpq connection string of the result backend's database.
        interval_seconds: seconds between rounds (0 or less: never started).
        batch: rows deleted per statement.
        install_schema: install the migrations if missing (else only check them) before
            the first round.
    """

    name = "result-expiry"
    role = "result-expiry"
    hold_connection = False  # a round a minute: connect for it, hold nothing between

    def __init__(
        self, dsn: str, interval_seconds: float, batch: int, install_schema: bool = True
    ) -> None:
        super().__init__(dsn, interval_seconds)
        self.batch = max(1, int(batch))
        self.install_schema = install_schema
        self._schema_checked = False
        #: Results deleted by this sweep so far.
        self.deleted = 0

    def round(self) -> None:
        if not self._schema_checked:
            if self.install_schema:
                ensure_schema(self.connector, self._dsn)
            else:
                verify(self.connector)
            self._schema_checked = True
        self.deleted += sweep(ResultStore(self.connector), self.batch, self._stop)


def sweep(store: ResultStore, batch: int, stop: threading.Event | None = None) -> int:
    """Delete expired results, ``batch`` per statement, until a statement deletes fewer
    (or :data:`MAX_STATEMENTS_PER_ROUND`, or ``stop`` is set); how many were deleted."""
    total = 0
    for _ in range(MAX_STATEMENTS_PER_ROUND):
        removed = store.expire(batch)
        total += removed
        if removed < batch or (stop is not None and stop.is_set()):
            break
    if total:
        logger.info("kombu_pgmq results: deleted %d expired results", total)
    return total


_lock = threading.Lock()
_current: ResultExpiry | None = None


def start(backend: Any) -> ResultExpiry | None:
    """Start the sweep of ``backend`` (a :class:`~kombu_pgmq.results.ResultBackend`) in
    this process, unless one runs already or ``expire_interval_seconds`` is 0; returns
    the running sweep (None: off)."""
    global _current
    with _lock:
        if _current is not None and _current.running:
            return _current
        interval = float(backend.expire_interval_seconds)
        if interval <= 0:
            return None
        _current = ResultExpiry(
            backend.dsn, interval, backend.expire_batch, install_schema=backend.install_schema
        )
        _current.start()
        logger.debug("kombu_pgmq results: expiry sweep every %.0f s", interval)
        return _current


def stop() -> None:
    """Stop this process's sweep (waits for its round) and close its connection."""
    global _current
    with _lock:
        current, _current = _current, None
    if current is not None:
        current.close()


def running() -> ResultExpiry | None:
    """This process's running sweep, if any."""
    current = _current
    return current if current is not None and current.running else None
