"""Wake-ups for consumers: PostgreSQL LISTEN/NOTIFY plus a self-pipe.

A consuming Kombu connection owns one :class:`Wakeups`: a second PostgreSQL connection
that LISTENs on ``kombu_pgmq.<pgmq queue>`` for each consumed queue, and a pipe that
other threads write to (an ack freed a prefetch slot). Both file descriptors can be
waited on with ``select`` (blocking ``drain_events``) or registered with Celery's event
loop (:meth:`kombu_pgmq.transport.Transport.register_with_event_loop`).

Publishers notify only while a consumer waits on the queue (``kombu_pgmq.waiting``,
migration 0003); notifications are hints, never the message, and the transport keeps a
fallback poll (``polling_interval``) for messages that become visible without an insert
(visibility timeout expiry, delayed sends).
"""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Iterable

from .._db.client import PgmqClient
from ..errors import KombuPgmqError

__all__ = ["CHANNEL_PREFIX", "Wakeups"]

#: NOTIFY channel of a PGMQ queue: CHANNEL_PREFIX + pgmq name (at most 58 characters).
CHANNEL_PREFIX = "kombu_pgmq."


class Wakeups:
    """The LISTEN connection and wake pipe of one consuming Kombu connection.

    Arguments:
        conninfo: libpq connection string of the broker database.
    """

    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self._listener: PgmqClient | None = None
        self._queues: set[str] = set()
        self._pipe_r, self._pipe_w = os.pipe()
        os.set_blocking(self._pipe_r, False)
        os.set_blocking(self._pipe_w, False)
        self._closed = False
        #: Bumped on every (re)connect of the LISTEN connection: its socket may get the
        #: number of the lost one, so an event loop must not go by the number alone.
        self.generation = 0

    # -- listening -----------------------------------------------------------------------

    def _client(self) -> PgmqClient:
        listener = self._listener
        if listener is None:
            listener = PgmqClient(self._conninfo)
            try:
                listener.listen(CHANNEL_PREFIX + q for q in sorted(self._queues))
            except BaseException:
                listener.close()
                raise
            self._listener = listener
            self.generation += 1
        return listener

    def listen(self, queues: Iterable[str]) -> None:
        """LISTEN for publishes to these PGMQ queues (idempotent)."""
        new = set(queues) - self._queues
        if not new:
            return
        self._queues |= new
        if self._listener is not None:
            self._listener.listen(CHANNEL_PREFIX + q for q in sorted(new))

    def unlisten(self, queues: Iterable[str]) -> None:
        gone = set(queues) & self._queues
        self._queues -= gone
        if gone and self._listener is not None:
            try:
                self._listener.unlisten(CHANNEL_PREFIX + q for q in sorted(gone))
            except KombuPgmqError:
                self._drop()  # reconnects listening to the rest

    def fileno(self) -> int:
        """Socket of the LISTEN connection (connects, and LISTENs, if needed).

        Raises:
            BrokerConnectionError: the server cannot be reached.
        """
        return self._client().fileno()

    @property
    def wake_fileno(self) -> int:
        """Read end of the wake pipe (readable after :meth:`wake`)."""
        return self._pipe_r

    # -- waking --------------------------------------------------------------------------

    def wake(self) -> None:
        """Make the wait end now (safe from any thread: one byte into the pipe)."""
        if self._closed:
            return
        # pipe full (it is readable then anyway) or closed
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._pipe_w, b"w")

    def collect(self) -> set[str] | None:
        """Return the notified queues without blocking (and empty the wake pipe).

        None when the LISTEN connection was not there or was lost: it is
        (re)connected and LISTENing when this returns, but notifications may have been
        missed before, so poll every queue.

        Raises:
            BrokerConnectionError: the LISTEN connection cannot be (re)established.
        """
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._pipe_r, 4096):
                pass
        listener = self._listener
        if listener is None:
            self._client()
            return None
        try:
            channels = listener.notifications()
        except KombuPgmqError:
            self._drop()
            self._client()
            return None
        cut = len(CHANNEL_PREFIX)
        return {c[cut:] for c in channels if c.startswith(CHANNEL_PREFIX)}

    def wait(self, timeout: float | None) -> None:
        """Block until a notification, a :meth:`wake`, or ``timeout`` seconds."""
        fds = [self._pipe_r]
        # the server is away: sleep, the next poll reports the error
        with contextlib.suppress(KombuPgmqError):
            fds.append(self.fileno())
        # a descriptor closed under us: return, the caller polls
        with contextlib.suppress(OSError, ValueError):
            select.select(fds, [], [], timeout)

    def _drop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def close(self) -> None:
        """Close the LISTEN connection and the pipe (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._drop()
        for fd in (self._pipe_r, self._pipe_w):
            with contextlib.suppress(OSError):
                os.close(fd)
