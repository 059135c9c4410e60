"""Lease renewal: messages a connection holds keep their visibility timeout.

A delivered message stays invisible in its queue table until its visibility timeout
(VT) passes; then it is delivered again. Redis and SQS brokers deliver a task that runs
longer than the VT a second time (celery/kombu#337, celery/celery#4400). kombu_pgmq keeps
the VT short (fast recovery after a crash) and renews it instead: a thread of each
connection pushes the VT of every message the connection holds - running, prefetched,
or waiting for its ETA, i.e. every unacked delivery of its channels - to now + VT, every
``lease_renewal_interval`` seconds (VT / 3 by default), one statement for all queues
(``kombu_pgmq.renew``). When the process dies, renewals stop and the
message is delivered again at most one VT after the last renewal.

The thread runs beside the consumer, so it renews while Celery's event loop waits,
while a plain Kombu callback runs for an hour, and while the pool runs the task. It has a
PostgreSQL connection of its own (:class:`~kombu_pgmq.transport._service.Service`): a
statement of the channels that blocks (a ``CREATE INDEX`` waiting for an application's
open transaction, a lock held by an operator) never delays a renewal, and a renewal never
joins a transaction of the channels. If its connection is lost it reconnects and renews
at once (retrying every second). A lease is *lost* when a renewal finds that the message
was read again by someone else (its ``read_ct`` moved on: the VT passed during an
outage longer than the VT) or is gone; that is logged as a warning, since the message
may then run twice. A round that finds nothing held closes the connection (the next
message held opens one again): an idle consumer holds no lease connection.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from .._db.broker import Broker, Receipt
from .._stats import STATS
from ._service import Service
from ._slots import Slots
from .acks import SETTLES_ITSELF

logger = logging.getLogger(__name__)


class Held(NamedTuple):
    """A message this connection holds: PGMQ queue, msg_id, the read_ct it was read
    with, its enqueued_at (the receipt), the visibility timeout (seconds) its channel
    uses, and whether its task may settle it in its own transaction (``SETTLES_ITSELF``)."""

    queue: str
    msg_id: int
    read_ct: int
    vt_seconds: int
    enqueued_at: Any = None
    settles_itself: bool = False

    @property
    def receipt(self) -> Receipt:
        return Receipt(self.queue, self.msg_id, self.read_ct, self.enqueued_at)


class Renewal(NamedTuple):
    """Result of one renewal round: how many leases were renewed, the ``(queue, msg_id)``
    whose lease was lost, and the statements sent."""

    renewed: int
    lost: list[tuple[str, int]]
    statements: int


def held_by(channels: Iterable[Any]) -> list[Held]:
    """Unacked deliveries of kombu_pgmq channels (any thread: the QoS dicts are copied
    atomically under the GIL). Acked ones kombu has not yet removed (``QoS._dirty``) are
    left out."""
    held = []
    for channel in list(channels):
        qos = getattr(channel, "qos", None)
        delivered = getattr(qos, "_delivered", None)
        if not delivered:
            continue
        settled = set(getattr(qos, "_dirty", ()))  # acked/rejected, removed lazily by kombu
        for _ in range(3):  # a copy racing a resize raises; retry
            try:
                messages = list(delivered.copy().values())
                break
            except RuntimeError:
                continue
        else:
            continue
        vt = channel.reader.vt_seconds
        for message in messages:
            if message.delivery_tag in settled:
                continue
            info = message.delivery_info
            held.append(
                Held(
                    info["pgmq_queue"],
                    info["pgmq_msg_id"],
                    info["pgmq_read_ct"],
                    vt,
                    info.get("pgmq_enqueued_at"),
                    info.get(SETTLES_ITSELF, False),
                )
            )
    return held


class LeaseKeeper(Service):
    """Renews the leases of the messages one Kombu connection holds, in a thread, on a
    connection of its own.

    Arguments:
        dsn: libpq connection string of the broker database.
        holdings: returns the messages held now (see :func:`held_by`).
        still_held: True if ``(queue, msg_id)`` is still held (not acked or rejected
            since the snapshot), so a missing renewal is a lost lease, not an ack.
        interval_seconds: seconds between renewal rounds (0: renewal off).
    """

    name = "lease renewal"
    role = "leases"

    def __init__(
        self,
        dsn: str,
        holdings: Callable[[], list[Held]],
        still_held: Callable[[str, int], bool],
        interval_seconds: float,
    ) -> None:
        super().__init__(dsn, interval_seconds)
        self._holdings = holdings
        self._still_held = still_held
        self._lost: set[tuple[str, int]] = set()  # reported once, not renewed again
        #: Held during a round. Code that makes a held message visible again (requeue,
        #: restore) holds it too, so a round cannot push that message's visibility
        #: timeout back into the future right after.
        self.lock = threading.Lock()
        self.statements = 0
        #: Concurrency slots of tasks running after their ack, renewed with the leases
        #: on this connection (:mod:`._slots`).
        self.slots = Slots(lambda: self.connector, lambda: self.lock)
        self._broker: Broker | None = None

    @property
    def broker(self) -> Broker:
        """The broker on this keeper's connection: one per connection (a new one with
        each connection the keeper opens)."""
        connector = self.connector
        broker = self._broker
        if broker is None or broker.db is not connector:
            broker = self._broker = Broker(connector)
        return broker

    def after_fork(self) -> None:
        forked = self._pid != os.getpid()
        super().after_fork()
        if forked:
            self.lock = threading.Lock()  # may have been held by the parent's thread
        self.slots.after_fork()

    def round(self) -> None:
        self.renew()

    def renew(self) -> Renewal:
        """One round: renew every held lease (one statement per visibility timeout in
        use, normally one). Returns what happened.

        Raises:
            BrokerConnectionError: the database connection was lost (the next round
                reconnects).
        """
        with self.lock:
            held = [h for h in self._holdings() if (h.queue, h.msg_id) not in self._lost]
            slots = self.slots.renew(self.connector) if self.slots else 0
            if not held:
                self._forget_settled()
                if not slots:
                    self.release()  # nothing to renew: no idle connection held for it
                return Renewal(0, [], 0)
            by_vt: dict[int, list[Held]] = defaultdict(list)
            for h in held:
                by_vt[h.vt_seconds].append(h)
            broker = self.broker
            renewed: set[tuple[str, int]] = set()
            for vt, group in by_vt.items():
                renewed |= broker.renew([h.receipt for h in group], vt)
        self.statements += len(by_vt)
        STATS.lease_renewals += len(renewed)
        missed = [
            h
            for h in held
            if (h.queue, h.msg_id) not in renewed and self._still_held(h.queue, h.msg_id)
        ]
        lost = [(h.queue, h.msg_id) for h in missed if not h.settles_itself]
        for h in missed:
            self._lost.add((h.queue, h.msg_id))
            if h.settles_itself:
                logger.debug(
                    "message %s in PGMQ queue %r not renewed: its task's transaction "
                    "settled it (or lost it to another delivery: the task says so)",
                    h.msg_id,
                    h.queue,
                )
        STATS.lost_leases += len(lost)
        for queue, msg_id in lost:
            logger.warning(
                "lost the lease of message %s in PGMQ queue %r: its visibility timeout "
                "passed (e.g. during a database outage) and it was delivered again, or it "
                "was removed; it may be processed twice",
                msg_id,
                queue,
            )
        self._forget_settled()
        return Renewal(len(renewed), lost, len(by_vt))

    def _forget_settled(self) -> None:
        if self._lost:
            current = {(h.queue, h.msg_id) for h in self._holdings()}
            self._lost &= current
