"""The ack batch: acks made while the transport batches them, archived together.

Inside ``drain_events`` and in Celery's event loop, ``message.ack()`` only records the
ack here (any thread may: a lock guards the list); the poller archives the batch with its
next read (one round trip, ``kombu_pgmq.read``) or flushes it (one ``pgmq.archive`` per
queue). At least once: until archived, a message stays in its queue table, invisible; if
the process dies first it is delivered again after its visibility timeout. Acks are
receipt handles (:class:`~kombu_pgmq._db.broker.Receipt`): a stale one is never applied.

The batch never opens a connection: :meth:`AckBatch.flush`, :meth:`AckBatch.send` and
:meth:`AckBatch.send_soon` take the :class:`~kombu_pgmq._db.broker.Broker` to archive on
explicitly, so closing a connection flushes on that connection and then closes it, never
the other way round; the event loop's timers are the caller's (the poller's), so the
batch's decisions are tested without PostgreSQL or an event loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from time import monotonic

from .._db.broker import Broker, Receipt
from ..errors import (
    BrokerConnectionError,
    KombuPgmqError,
    PermissionDenied,
    QueueNotFound,
    StatementCanceled,
)

__all__ = ["ACK_BATCH_SECONDS", "SETTLED", "SETTLES_ITSELF", "AckBatch"]

logger = logging.getLogger(__name__)

#: ``delivery_info`` key set (True) on a message its task settled in its own transaction
#: (:class:`kombu_pgmq.AtomicTask`): the channel's ack of it then sends nothing.
SETTLED = "pgmq_settled"
#: ``delivery_info`` key set (True) on a message whose task may settle it in its own
#: transaction (an AtomicTask's): a lease renewal that misses it is that commit, most
#: likely, and is not warned about (a fenced run warns in the task's own log).
SETTLES_ITSELF = "pgmq_settles_itself"

#: Seconds, in Celery's event loop, between two statements of acks alone (not riding
#: with a read): an ack made sooner after the last one waits for a read or for this, so a
#: backlog drains with acks batched while a lone ack goes at once (Nagle's algorithm).
#: 2 ms: every ack sent alone cost 30 % of the backlog drain rate, batched within 2 ms
#: 2-5 %, and a task's ack still reached the server a median 1.8 ms after the task ended
#: (3.5 ms while acks waited for the next read), which is what a worker killed right
#: after a task takes along (benchmarks/README.md, "acks sent at once, duplicates per
#: kill").
ACK_BATCH_SECONDS = 0.002


class AckBatch:
    """Acked, not yet archived deliveries (receipt handles), and when acks last went to
    the server.

    Arguments:
        durable: archive with a synchronous commit (transport option ``durable_acks``).
    """

    def __init__(self, *, durable: bool) -> None:
        self.durable = durable
        self._acks: list[Receipt] = []
        self._lock = threading.Lock()
        #: ``monotonic()`` when the oldest pending ack was made (0.0: none pending).
        self.since = 0.0
        #: ``monotonic()`` when acks last went to the server, alone or riding with a read.
        self.sent_at = 0.0
        #: A timer of the event loop is set to call :meth:`send_soon` again.
        self.timer_pending = False

    def __len__(self) -> int:
        return len(self._acks)

    def __bool__(self) -> bool:
        return bool(self._acks)

    def add(self, held: Receipt) -> None:
        with self._lock:
            if not self._acks:
                self.since = monotonic()
            self._acks.append(held)

    def take(self) -> list[Receipt]:
        """Remove and return every pending ack (the caller archives them or puts them
        back with :meth:`put_back`)."""
        with self._lock:
            acks, self._acks = self._acks, []
        return acks

    def put_back(self, acks: list[Receipt], since: float | None = None) -> None:
        """Return acks that were not archived (archived with the next batch); ``since``:
        when the oldest of them was made (default: now)."""
        if not acks:
            return
        with self._lock:
            oldest = monotonic() if since is None else since
            self.since = min(self.since, oldest) if self._acks else oldest
            self._acks[:0] = acks

    def clear(self) -> None:
        """Forget every pending ack (in a forked child: they are the parent's)."""
        with self._lock:
            self._acks = []

    def flush(self, broker: Broker) -> None:
        """Archive the pending acks on ``broker`` now (one statement).

        Raises:
            BrokerConnectionError: the connection was lost; the acks are kept for the
                next flush or read.
            StatementCanceled: the statement was cancelled (``statement_timeout``); the
                acks are kept too.
        """
        acks = self.take()
        if acks:
            archive(broker, acks, durable=self.durable, on_lost=self.put_back)

    def send(self, broker: Broker, acks: list[Receipt], since: float) -> None:
        """Archive ``acks`` (taken from the batch, the oldest made at ``since``) on
        ``broker`` now: without waiting for the result where the broker can
        (:func:`archive_nowait`), else in one statement that waits. Those not archived
        (a lost connection, a cancelled statement) are put back.

        Raises:
            BrokerConnectionError, StatementCanceled: as :func:`archive` (put back).
        """

        def put_back(lost: list[Receipt]) -> None:
            self.put_back(lost, since)

        self.sent_at = monotonic()
        if not archive_nowait(broker, acks, durable=self.durable, on_lost=put_back):
            archive(broker, acks, durable=self.durable, on_lost=put_back)

    def send_soon(
        self,
        broker: Broker | None,
        now: float,
        failed: Callable[[KombuPgmqError], None],
    ) -> float | None:
        """The pacing of acks in Celery's event loop (Nagle's algorithm): send the
        pending acks on ``broker`` now if the last ones went at least
        :data:`ACK_BATCH_SECONDS` before ``now`` (monotonic) and its connection is free
        (not waiting for a result; None: not connected, nothing is sent). Returns the
        seconds after which to call this again, at a timer the caller sets (one at a
        time: :attr:`timer_pending`, cleared by the caller when it fires), or None: no
        ack is left, or a timer is set already (a read may take them first). A lost
        connection or a cancelled statement goes to ``failed`` (the acks were put back,
        tried again at the timer)."""
        wait = self.sent_at + ACK_BATCH_SECONDS - now
        if wait <= 0:
            if broker is not None:
                try:
                    if broker.db.free():
                        since = self.since
                        acks = self.take()
                        if acks:
                            self.send(broker, acks, since)
                except (BrokerConnectionError, StatementCanceled) as exc:
                    failed(exc)
            if not self._acks:
                return None
            wait = ACK_BATCH_SECONDS  # the connection was busy: try again then
        if self.timer_pending:
            return None
        self.timer_pending = True
        return wait


def archive(
    broker: Broker,
    acks: list[Receipt],
    *,
    durable: bool,
    on_lost: Callable[[list[Receipt]], None] | None = None,
) -> None:
    """Archive ``acks`` in one statement; a stale receipt (delivered again since, or
    gone with its queue) is logged, never applied. On a lost connection, or a cancelled
    statement (nothing was archived), ``on_lost(acks)`` (if given) gets them back."""
    try:
        settled = broker.ack(acks, durable=durable)
    except (BrokerConnectionError, StatementCanceled):
        if on_lost is not None:
            on_lost(acks)
        raise
    warn_stale("ack", acks, settled)


def warn_stale(
    action: str,
    given: Sequence[Receipt],
    settled: set[tuple[str, int]] | None = None,
    *,
    applied: int | None = None,
) -> None:
    """Log the receipts of ``given`` that were not applied: their lease lapsed and the
    message was delivered again (read_ct moved on), or it is gone. ``settled``: the
    ``(queue, msg_id)`` applied; or ``applied``: how many were, when which is not known
    (one line for the lot). The one place this warning is worded."""
    if settled is None:
        stale = len(given) - (applied or 0)
        if stale > 0:
            logger.warning(
                "stale %s of %d message(s) in PGMQ queue %r not applied: their lease lapsed "
                "and they were delivered again, or they are gone",
                action,
                stale,
                given[0].queue,
            )
        return
    for held in given:
        if (held.queue, held.msg_id) not in settled:
            logger.warning(
                "stale %s of message %s in PGMQ queue %r not applied: its lease lapsed and "
                "it was delivered again (read_ct moved past %d), or it is gone",
                action,
                held.msg_id,
                held.queue,
                held.read_ct,
            )


def archive_nowait(
    broker: Broker,
    acks: list[Receipt],
    *,
    durable: bool,
    on_lost: Callable[[list[Receipt]], None],
) -> bool:
    """Send ``acks`` without waiting for the result (:meth:`Broker.ack_nowait`): the
    server archives them as soon as the statement arrives, the result is read before the
    connection's next statement. A stale receipt is logged then, never applied; if the
    connection is lost meanwhile, the statement is cancelled, or the role turns out to
    lack the privilege for this path, ``on_lost(acks)`` gets them back (archived again
    with the next read or flush: a receipt already settled is then stale, nothing is
    applied twice). Returns False, sending nothing, where the broker cannot (acks of
    several queues, a least-privilege role): archive them with :func:`archive`.

    Raises:
        BrokerConnectionError: the statement could not be sent (``on_lost`` got them).
    """

    def settled(done: set[tuple[str, int]]) -> None:
        warn_stale("ack", acks, done)

    def failed(error: KombuPgmqError) -> None:
        if isinstance(error, (BrokerConnectionError, StatementCanceled, PermissionDenied)):
            on_lost(acks)
        else:
            logger.warning("acks of %d message(s) not applied: %s", len(acks), error)

    try:
        return broker.ack_nowait(acks, durable=durable, on_settled=settled, on_error=failed)
    except BrokerConnectionError:
        on_lost(acks)
        raise
    except QueueNotFound as exc:  # the statement could not be prepared: the queue is gone
        logger.warning("acks of %d message(s) not applied: %s", len(acks), exc)
        return True
