"""One base for the background services of a Kombu connection (lease renewal,
heartbeats/reaper/VACUUM), after River's ``BaseStartStop``: start, stop, join, restart,
and a loop that never dies.

Each service runs :meth:`Service.round` every ``interval_seconds`` in a daemon thread,
on a PostgreSQL connection of its own (never the channels' one: a statement blocked
there must not stop a lease renewal, nor the other way round), opened lazily with
``lock_timeout`` set so a service waits at most :data:`LOCK_TIMEOUT` for a lock and
skips the round instead. A service with nothing to do gives its connection back
(:meth:`Service.release`): the lease keeper when no message is held, a service with
``hold_connection = False`` (the result expiry sweep, once a minute) after every round,
so no idle connection is held for a feature not in use (``docs/connections.md``). Any
exception from a round is logged and the loop goes on
(a connection error is retried every :data:`RETRY_SECONDS`, and logged once per outage).

Fork safety: a thread does not survive ``fork()``; in a child the service counts as not
started (its next :meth:`start` starts a new thread) and its connector abandons the
parent's connection without a word to the server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from time import monotonic

from .._db.connector import Connector
from ..errors import BrokerConnectionError, KombuPgmqError

__all__ = ["LOCK_TIMEOUT", "RETRY_SECONDS", "Service"]

logger = logging.getLogger(__name__)

#: Longest a background statement waits for a lock before it gives up (the round is
#: skipped and tried again), e.g. a reaper's DROP behind a reader's open transaction.
LOCK_TIMEOUT = "1s"
#: Seconds between attempts while the database cannot be reached: as the consumer's own
#: reconnection (:data:`~kombu_pgmq.transport.poller.RECONNECT_SECONDS`), so leases and
#: heartbeats resume with it.
RETRY_SECONDS = 1.0


class Service:
    """A background loop on a connection of its own.

    Subclasses implement :meth:`round`; ``name`` names the thread and the log lines.

    Arguments:
        dsn: libpq connection string of the broker database.
        interval_seconds: seconds between rounds (0 or less: never started).
    """

    name = "service"
    #: The connection's role in ``application_name`` (``kombu_pgmq:<role>``).
    role = "service"
    #: Keep the connection open between rounds (False: closed after each round; for
    #: services whose rounds are rare).
    hold_connection = True

    def __init__(self, dsn: str, interval_seconds: float) -> None:
        self._dsn = dsn
        self.interval_seconds = interval_seconds
        self._connector: Connector | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._failing_since: float | None = None
        self._lock = threading.Lock()
        #: Rounds completed, and rounds that failed (for tests and diagnostics).
        self.rounds = 0
        self.failures = 0

    @property
    def connector(self) -> Connector:
        """This service's own connection (opened on first use, ``lock_timeout`` set)."""
        if self._connector is None:
            self._connector = Connector(
                self._dsn, settings={"lock_timeout": LOCK_TIMEOUT}, role=self.role
            )
        return self._connector

    def release(self) -> None:
        """Close this service's connection until its next statement reopens one (run in
        the service's thread, or once it is stopped)."""
        connector, self._connector = self._connector, None
        if connector is not None:
            _close(connector)

    def after_fork(self) -> None:
        """In a forked child: forget the parent's thread and abandon its connection
        (nothing is sent); the next :meth:`start` starts this process's own. Idempotent."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._thread = None
            self._stop = threading.Event()
            self._lock = threading.Lock()
            if self._connector is not None:
                self._connector.close()  # abandons the parent's connection, sends nothing
                self._connector = None

    @property
    def running(self) -> bool:
        self.after_fork()
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the loop (idempotent; again after :meth:`stop`, or after a fork)."""
        self.after_fork()
        with self._lock:
            if self.interval_seconds <= 0 or (self._thread and self._thread.is_alive()):
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stop,), name=f"kombu_pgmq-{self.name}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Ask the loop to stop after its current round (returns at once)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def restart(self) -> None:
        self.stop()
        self.join()
        self.start()

    def close(self) -> None:
        """Stop the loop, wait for its round to end, close its connection."""
        self.stop()
        self.join(timeout=10)
        connector, self._connector = self._connector, None
        if connector is not None:
            _close(connector)

    def _run(self, stop: threading.Event) -> None:
        wait = self.interval_seconds
        while not stop.wait(wait):
            wait = self.interval_seconds
            try:
                try:
                    self.round()
                finally:
                    if not self.hold_connection:
                        self.release()
            except BrokerConnectionError as exc:
                self.failures += 1
                if stop.is_set():
                    return
                if self._failing_since is None:
                    self._failing_since = monotonic()
                    logger.warning(
                        "%s failed: %s; reconnecting every %.0f s",
                        self.name,
                        exc,
                        RETRY_SECONDS,
                    )
                wait = RETRY_SECONDS
                continue
            except KombuPgmqError as exc:  # a lock timeout, a refused statement
                self.failures += 1
                if not stop.is_set():
                    logger.warning("%s failed (%s); retrying", self.name, exc)
                wait = min(RETRY_SECONDS, self.interval_seconds)
                continue
            except Exception:  # never let the loop die: the service would silently stop
                self.failures += 1
                if not stop.is_set():
                    logger.exception("%s round failed; retrying", self.name)
                wait = min(RETRY_SECONDS, self.interval_seconds)
                continue
            self.rounds += 1
            if self._failing_since is not None:
                logger.warning(
                    "%s works again after %.1f s", self.name, monotonic() - self._failing_since
                )
                self._failing_since = None

    def round(self) -> None:
        """One round of work (runs in the service's thread)."""
        raise NotImplementedError


def _close(connector: Connector) -> None:
    """Close ``connector`` once the result of what it sent without waiting (a slot
    release) has arrived: that statement ran, and its callback hears no error."""
    with contextlib.suppress(KombuPgmqError):  # lost already: the callback got the error
        connector.collect()
    connector.close()
