"""Wake-ups for consumers: PostgreSQL LISTEN/NOTIFY plus a self-pipe.

A consuming Kombu connection owns one :class:`Listener`: a PostgreSQL connection of its
own that LISTENs on ``kombu_pgmq.<pgmq queue>`` for each consumed queue, and a pipe that
other threads write to (an ack freed a prefetch slot). Both file descriptors are waited on
with a :mod:`selectors` selector (epoll on Linux: no ``select()`` limit of 1024 file
descriptors) by a blocking ``drain_events``, or registered with Celery's event loop by
:class:`~kombu_pgmq.transport.poller.Poller`.

Publishers notify only while a consumer waits on the queue (``kombu_pgmq.waiting``); on a
queue's channel notifications are hints, never the message: an empty payload means a
message is visible now, a number when a delayed one becomes due (epoch seconds, server
clock). The poller keeps a fallback poll (``polling_interval``) for messages that become
visible without an insert (visibility timeout expiry).

Hand-offs (``kombu_pgmq.hand_off``): the LISTEN connection also listens on a channel of
its own (:attr:`Listener.slot`) and holds a session advisory lock while it does; a publish to a
queue this connection offered a slot on sends the delivered row there
(:mod:`kombu_pgmq._db.handoff`), collected by :meth:`Listener.take_handed`.

Without a LISTEN connection (``dsn`` None: behind a transaction pooler without
``direct_url``) the listener only has the wake pipe: consumers find messages by the poll
every ``polling_interval`` seconds (:attr:`Listener.polling`).
"""

from __future__ import annotations

import contextlib
import os
import selectors
from collections.abc import Callable, Iterable

from .._db import handoff
from .._db.connector import Connector
from .._db.consumers import Consumers
from .._db.rows import Row
from ..errors import KombuPgmqError, PermissionDenied

__all__ = ["CHANNEL_PREFIX", "Listener"]

#: NOTIFY channel of a PGMQ queue: CHANNEL_PREFIX + pgmq name (at most 58 characters).
CHANNEL_PREFIX = "kombu_pgmq."

#: ``lock_timeout`` of the LISTEN connection: its fallback probe (:meth:`Listener.probe`)
#: gives up on a queue table another session holds exclusively (DROP, TRUNCATE, ALTER)
#: instead of holding back the notifications (hand-offs) the connection would read
#: meanwhile; the poller then reads those queues itself. Nothing else it runs waits for
#: a lock (LISTEN, its own advisory lock key).
PROBE_LOCK_TIMEOUT = "100ms"


class Listener:
    """The LISTEN connection and wake pipe of one consuming Kombu connection.

    Arguments:
        dsn: libpq connection string of the broker database for LISTEN; None: no LISTEN
            (:attr:`polling`).
    """

    def __init__(self, dsn: str | None) -> None:
        self._dsn = dsn
        self._connector: Connector | None = None
        #: Consumers' statements on the LISTEN connection (one per connection).
        self._consumers: Consumers | None = None
        self._notified: list[tuple[str, str]] = []
        #: Queues where a message was requeued to its place (NOTIFY payload 'rewind'),
        #: below the position reads start at: read from the start (:meth:`take_rewound`).
        self._rewound: set[str] = set()
        self._handed: list[Row] = []
        #: ``(channel, advisory lock key)`` of this connection's hand-offs (migration
        #: 0023), the same across reconnects; None when :attr:`polling`.
        self.slot: tuple[str, int] | None = None if dsn is None else handoff.new_slot()
        #: The number of the sequence this connection's slot is claimed on, leased with
        #: its lock (None until the LISTEN connection is open).
        self.slot_seq: int | None = None
        self._queues: set[str] = set()
        self._pipe_r, self._pipe_w = os.pipe()
        os.set_blocking(self._pipe_r, False)
        os.set_blocking(self._pipe_w, False)
        self._pid = os.getpid()
        self._closed = False
        self._selector: selectors.BaseSelector | None = None
        self._selected: tuple[int, int] = (-1, -1)  # (fd, generation) in the selector
        #: Bumped on every (re)connect of the LISTEN connection: its socket may get the
        #: number of the lost one, so an event loop must not go by the number alone.
        self.generation = 0
        #: Queues the last :meth:`probe` found a visible message in (or all it asked
        #: about, if it failed), for the next :meth:`collect`.
        self._probed: set[str] = set()
        #: False once a probe was refused (a role without rights on PGMQ's tables):
        #: :meth:`probe` then sends nothing and the poller reads every queue.
        self.probes = True

    # -- listening -----------------------------------------------------------------------

    @property
    def polling(self) -> bool:
        """True without a LISTEN connection: nothing notifies, consumers poll."""
        return self._dsn is None

    def _connect(self) -> Connector:
        """The LISTEN connection, LISTENing and holding its hand-off lock (connected
        if needed)."""
        connector = self._connector
        if connector is None:
            if self._dsn is None:
                raise RuntimeError("no LISTEN connection: the listener polls")
            connector = Connector(
                self._dsn,
                settings={"lock_timeout": PROBE_LOCK_TIMEOUT},
                on_notify=self._on_notify,
                role="listener",
            )
            try:
                consumers = Consumers(connector)
                consumers.listen(CHANNEL_PREFIX + q for q in sorted(self._queues))
                if self.slot is not None:
                    # LISTEN first: once the lock is held, publishers may hand off
                    consumers.listen([self.slot[0]])
                    self.slot_seq = consumers.hold_handoff_lock(self.slot[1])
            except BaseException:
                connector.close()
                raise
            self._connector, self._consumers = connector, consumers
            self.generation += 1
        return connector

    def _on_notify(self, channel: str, payload: str) -> None:
        if self.slot is not None and channel == self.slot[0]:
            row = handoff.parse(payload)
            if row is not None:
                self._handed.append(row)
            return
        self._notified.append((channel, payload))

    def take_handed(self) -> list[Row]:
        """The rows handed off to this connection since the last call (read from the
        socket by :meth:`collect` or :meth:`settle`): delivered to it already (read_ct 1,
        its visibility timeout running), to be delivered to the application or given
        back."""
        handed, self._handed = self._handed, []
        return handed

    def settle(self) -> list[Row]:
        """A round trip on the LISTEN connection, so every hand-off committed before
        this call has arrived, then :meth:`take_handed` (e.g. after giving up the slots,
        before closing). Empty without a connection.

        Raises:
            BrokerConnectionError: the LISTEN connection was lost (what it had not read
                is delivered again after its visibility timeout).
        """
        connector = self._connector
        if connector is not None:
            connector.execute("round_trip")
            connector.poll_notifies()
        return self.take_handed()

    def probe(
        self,
        queues: Iterable[str],
        scan_from: Callable[[str], float] | None = None,
    ) -> bool:
        """Ask the server, without waiting, which of PGMQ queues ``queues`` hold a
        visible message at or after ``scan_from(queue)`` (epoch seconds; None: any: see
        :meth:`ReadPositions.probe_from`) (the fallback poll in Celery's event loop;
        statement ``visible_probe`` on the LISTEN connection, whose socket the loop
        watches). The answer comes in a later :meth:`collect`'s ready queues (every queue
        asked about, if the probe failed). False, sending nothing, where a probe does not
        apply (no LISTEN connection, the last probe still unanswered, a role that may not
        read PGMQ's tables, nothing to ask): the caller reads the queues itself."""
        connector, consumers = self._connector, self._consumers
        names = sorted(queues)
        if connector is None or consumers is None or not self.probes or not names:
            return False

        def failed(error: KombuPgmqError) -> None:
            if isinstance(error, PermissionDenied):
                self.probes = False
            self._probed.update(names)

        try:
            if not connector.free():
                return False
            froms = [scan_from(n) if scan_from else float("-inf") for n in names]
            consumers.visible_nowait(
                names, froms, on_visible=lambda found: self._probed.update(found), on_error=failed
            )
        except KombuPgmqError:
            return False  # a lost connection: the next collect() finds out
        return True

    def listen(self, queues: Iterable[str]) -> None:
        """LISTEN for publishes to these PGMQ queues (idempotent)."""
        new = set(queues) - self._queues
        if not new:
            return
        self._queues |= new
        if self._consumers is not None and self._dsn is not None:
            self._consumers.listen(CHANNEL_PREFIX + q for q in sorted(new))

    def unlisten(self, queues: Iterable[str]) -> None:
        gone = set(queues) & self._queues
        self._queues -= gone
        if gone and self._consumers is not None:
            try:
                self._consumers.unlisten(CHANNEL_PREFIX + q for q in sorted(gone))
            except KombuPgmqError:
                self._drop()  # reconnects listening to the rest

    def fileno(self) -> int:
        """Socket of the LISTEN connection (connects, and LISTENs, if needed); -1 when
        :attr:`polling`.

        Raises:
            BrokerConnectionError: the server cannot be reached.
        """
        if self._dsn is None:
            return -1
        return self._connect().fileno()

    @property
    def wake_fileno(self) -> int:
        """Read end of the wake pipe (readable after :meth:`wake`)."""
        return self._pipe_r

    # -- waking --------------------------------------------------------------------------

    def wake(self) -> None:
        """Make the wait end now (safe from any thread: one byte into the pipe)."""
        if self._closed or self._pid != os.getpid():
            return
        # pipe full (it is readable then anyway) or closed
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._pipe_w, b"w")

    def collect(self) -> tuple[set[str], dict[str, float]] | None:
        """Return ``(ready, due)`` without blocking (and empty the wake pipe): the queues
        notified of a visible message, and ``{queue: due}`` for queues notified of a
        delayed one (the earliest due time, epoch seconds by the server's clock).

        None when the LISTEN connection was not there or was lost: it is
        (re)connected and LISTENing when this returns, but notifications may have been
        missed before, so poll every queue.

        Raises:
            BrokerConnectionError: the LISTEN connection cannot be (re)established.
        """
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._pipe_r, 4096):
                pass
        if self._dsn is None:
            return set(), {}
        connector = self._connector
        if connector is None:
            self._connect()
            return None
        try:
            connector.poll_notifies()
            connector.free()  # a probe's answer, if it came (never blocks)
        except KombuPgmqError:
            self._drop()
            self._connect()
            return None
        notified, self._notified[:] = list(self._notified), []
        cut = len(CHANNEL_PREFIX)
        ready, self._probed = self._probed, set()
        due: dict[str, float] = {}
        for channel, payload in notified:
            if not channel.startswith(CHANNEL_PREFIX):
                continue
            queue = channel[cut:]
            if payload == "rewind":
                self._rewound.add(queue)
                ready.add(queue)
                continue
            try:
                when = float(payload) if payload else None
            except ValueError:
                when = None  # not ours: read the queue
            if when is None:
                ready.add(queue)
            elif queue not in due or when < due[queue]:
                due[queue] = when
        return ready, due

    def take_rewound(self) -> set[str]:
        """The queues collected (:meth:`collect`) where a message was requeued to its
        place, below where reads start (see :mod:`kombu_pgmq._db.positions`), since the
        last call."""
        rewound, self._rewound = self._rewound, set()
        return rewound

    def wait(self, timeout: float | None) -> None:
        """Block until a notification, a :meth:`wake`, or ``timeout`` seconds."""
        selector = self._selector
        if selector is None:
            selector = self._selector = selectors.DefaultSelector()
            selector.register(self._pipe_r, selectors.EVENT_READ)
        try:
            fd = self.fileno()
        except KombuPgmqError:
            fd = -1  # the server is away: sleep, the next poll reports the error
        if (fd, self.generation) != self._selected:
            old = self._selected[0]
            if old >= 0:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    selector.unregister(old)
            self._selected = (-1, -1)
            if fd >= 0:
                selector.register(fd, selectors.EVENT_READ)
                self._selected = (fd, self.generation)
        try:
            selector.select(timeout)
        except (OSError, ValueError):
            # a descriptor closed under us: forget it, the caller polls (no busy loop:
            # the next wait registers the new socket)
            self._reset_selector()

    def _reset_selector(self) -> None:
        selector, self._selector = self._selector, None
        self._selected = (-1, -1)
        if selector is not None:
            with contextlib.suppress(Exception):
                selector.close()

    def _drop(self) -> None:
        self._probed = set()  # the caller reads every queue after a lost connection
        self.slot_seq = None  # the lease ended with the session
        connector, self._connector, self._consumers = self._connector, None, None
        if connector is not None:
            connector.close()

    def abandon(self) -> None:
        """In a forked child: let go of the parent's LISTEN connection without a word to
        the server (the connector abandons it) and close this process's copies of the
        pipe."""
        self._connector, connector = None, self._connector
        self._consumers = None
        self.slot_seq = None
        if connector is not None:
            connector.close()  # in a child, the connector abandons: nothing is sent
        self.close()

    def close(self) -> None:
        """Close the LISTEN connection and the pipe (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._drop()
        self._reset_selector()
        for fd in (self._pipe_r, self._pipe_w):
            with contextlib.suppress(OSError):
                os.close(fd)
