"""The ack batch: acks made while the transport batches them, archived together.

Inside ``drain_events`` and in Celery's event loop, ``message.ack()`` only records the
ack here (any thread may: a lock guards the list); the poller archives the batch with its
next read (one round trip, ``kombu_pgmq.read``) or flushes it (one ``pgmq.archive`` per
queue). At least once: until archived, a message stays in its queue table, invisible; if
the process dies first it is delivered again after its visibility timeout.

The batch never opens a connection: :meth:`AckBatch.flush` takes the
:class:`~kombu_pgmq._db.broker.Broker` to archive on explicitly, so closing a connection
flushes on that connection and then closes it, never the other way round.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict

from .._db.broker import Broker
from ..errors import BrokerConnectionError, QueueNotFound

__all__ = ["AckBatch"]


class AckBatch:
    """Acked, not yet archived messages: ``(pgmq queue, msg_id)`` pairs."""

    def __init__(self) -> None:
        self._acks: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._acks)

    def __bool__(self) -> bool:
        return bool(self._acks)

    def add(self, queue: str, msg_id: int) -> None:
        with self._lock:
            self._acks.append((queue, msg_id))

    def take(self) -> list[tuple[str, int]]:
        """Remove and return every pending ack (the caller archives them or puts them
        back with :meth:`put_back`)."""
        with self._lock:
            acks, self._acks = self._acks, []
        return acks

    def put_back(self, acks: list[tuple[str, int]]) -> None:
        """Return acks that could not be archived (archived with the next batch)."""
        with self._lock:
            self._acks[:0] = acks

    def clear(self) -> None:
        """Forget every pending ack (in a forked child: they are the parent's)."""
        with self._lock:
            self._acks = []

    def flush(self, broker: Broker, *, durable: bool) -> None:
        """Archive the pending acks on ``broker`` now (one ``pgmq.archive`` per queue).

        Raises:
            BrokerConnectionError: the connection was lost; the acks are kept for the
                next flush or read.
        """
        acks = self.take()
        if acks:
            archive(broker, acks, durable=durable, on_lost=self.put_back)


def archive(
    broker: Broker,
    acks: list[tuple[str, int]],
    *,
    durable: bool,
    on_lost: object = None,
) -> None:
    """Archive ``acks`` (one statement per queue); a queue dropped meanwhile has nothing
    left to ack. On a lost connection ``on_lost(acks)`` (if given) gets them back."""
    by_queue: dict[str, list[int]] = defaultdict(list)
    for queue, msg_id in acks:
        by_queue[queue].append(msg_id)
    try:
        for queue, ids in by_queue.items():
            with contextlib.suppress(QueueNotFound):
                broker.archive(queue, ids, durable=durable)
    except BrokerConnectionError:
        if callable(on_lost):
            on_lost(acks)
        raise
