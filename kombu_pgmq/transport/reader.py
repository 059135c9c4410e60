"""The read path of a :class:`~kombu_pgmq.transport.channel.Channel`: what its consumers
are handed and how.

* **Coalesced reads**: up to the free prefetch window, every consumed queue (and every
  priority band) in one round trip, with the held acks archived in the same transaction;
  while messages are held, the next read waits until half the window is free.
* **Poison rows**: a row that cannot become a Kombu message (undecodable), or delivered
  more than ``max_deliveries`` times, is dead-lettered alone; a consumer callback that
  raises in Celery's event loop dead-letters its message (``consumer_error``).
* **TTL**: expired messages (``x-message-ttl``, ``expiration``) are not delivered: they
  are archived with the headers ``x-archive-reason: expired`` and ``x-expired-at``
  (AMQP's meaning, auditable). A Celery task (protocol 2: ``task`` and ``id`` headers)
  is never dropped that way: it is handed to the worker, which revokes it (state
  REVOKED in the result store) and acks it. Celery's ``expiration`` is its copy of the
  task's ``expires`` header, which the worker applies itself; past the queue's
  ``x-message-ttl`` (or an ``expiration`` without ``expires``), the task is delivered
  with ``expires`` set to when that TTL passed, so the worker revokes it.
* ``no_ack`` consumers: what they were handed is deleted once delivered (AMQP auto-ack).
* **Limits** (:mod:`kombu_pgmq.limits`): a limited queue's read delivers no more than its
  fleet-wide limits allow (the statement enforces them); a queue a rate limit held back
  is read again when its tokens are due (``Consumed.retry``: no notification says so).

No SQL here: statements go through the channel's :class:`~kombu_pgmq._db.broker.Broker`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from itertools import count
from types import MappingProxyType
from typing import Any, NamedTuple

from .. import _encoding as encoding
from .. import errors
from .._db.broker import Broker, Receipt, Row
from .._db.rows import THROTTLED_RATE, Reads
from .._naming import pgmq_queue_name
from .._stats import STATS
from ._interfaces import ChannelView, QoSView
from ._leases import LeaseKeeper
from .acks import warn_stale
from .options import TransportOptions
from .publisher import DELAY_PROPERTY
from .topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["Consumed", "Reader", "receipt"]


def _expired(
    properties: dict[str, Any], row: Row, ttl_seconds: float | None
) -> tuple[bool, float] | None:
    """Whether x-message-ttl of the queue, or the message's own ``expiration`` (ms), has
    passed since the message became visible (a delayed message's TTL starts after its
    delay): ``(by the queue's TTL, seconds since it passed)``, or None."""
    try:
        age = row.age_seconds - float(properties.get(DELAY_PROPERTY) or 0)
    except (TypeError, ValueError):
        age = row.age_seconds
    if ttl_seconds is not None and age > ttl_seconds:
        return True, age - ttl_seconds
    expiration = properties.get("expiration")
    if expiration is None:
        return None
    try:
        limit = float(expiration) / 1000.0
    except (TypeError, ValueError):
        return None
    return (False, age - limit) if age > limit else None


def _celery_task(headers: dict[str, Any]) -> bool:
    """A Celery task message (protocol 2: ``task`` and ``id`` headers)."""
    return "task" in headers and "id" in headers


def _revoke_on_delivery(message: Any, by_queue: bool, overdue_seconds: float) -> None:
    """An expired Celery task goes to the worker, which revokes it as Celery does (state
    REVOKED, reason expired) if its ``expires`` header has passed: Celery's own
    ``expires`` decides when only the ``expiration`` Celery derived from it passed;
    otherwise ``expires`` becomes the moment the TTL passed."""
    headers = message.headers
    if by_queue or headers.get("expires") is None:
        passed = datetime.now(timezone.utc) - timedelta(seconds=overdue_seconds)
        headers["expires"] = passed.isoformat()


class Consumed(NamedTuple):
    """What one read round of a channel did (``Reader.consume``)."""

    #: Messages handed to consumers.
    delivered: int
    #: PGMQ names of queues found empty.
    drained: set[str]
    #: PGMQ names of queues that filled the read (they may hold more).
    full: set[str]
    #: Whether the acks given were archived with the read (False: the caller archives them).
    acks_sent: bool
    #: The read was put off until half the prefetch window is free.
    deferred: bool
    #: PGMQ names of queues a rate limit held back -> seconds until it allows more
    #: (``kombu_pgmq.read_limited``): read them again then (no notification comes for it).
    retry: Mapping[str, float] = MappingProxyType({})


def read_size(free: int | None, prefetch_count: int, batch_size: int, floor: int) -> int | None:
    """How many messages a channel's read asks for: its free prefetch window ``free``
    (None: unlimited), at most ``batch_size``; 0 when the window is full. None: the read
    is put off, since messages are still held (``free`` is not the whole window
    ``prefetch_count``) and fewer than ``floor`` (half the window) are free: the
    application has work, and a backlog is then read in batches, not one message per
    ack (see :meth:`Reader.set_prefetch`)."""
    size = batch_size if free is None else min(free, batch_size)
    if size <= 0:
        return 0
    if size < floor and free != prefetch_count:
        return None
    return size


def smallest_read(base_prefetch: int | None, prefetch_count: int, batch_size: int) -> int:
    """The smallest read of a channel that holds messages: half its prefetch window (at
    least 1), of the first window set (``base_prefetch``) if it was smaller: Celery
    widens the window for each ETA/countdown task it holds, which must not hold back
    reads. With an unlimited window (0), 1."""
    base = min(base_prefetch or 0, prefetch_count) if prefetch_count else 0
    return max(1, min(base, batch_size) // 2)


def receipt(delivery_info: dict[str, Any]) -> Receipt:
    """The receipt handle of a delivered message (from its ``delivery_info``)."""
    return Receipt(
        delivery_info["pgmq_queue"],
        delivery_info["pgmq_msg_id"],
        delivery_info["pgmq_read_ct"],
        delivery_info.get("pgmq_enqueued_at"),
    )


class Reader:
    """The read path of one channel (see the module docstring).

    Arguments:
        channel: the channel it reads for (its consumed queues, QoS, messages;
            it declares the dead-letter queue and recreates a dropped consumed queue).
        options: the transport's options.
        topology: the transport's priority bands (a queue's PGMQ queues).
        broker: the statement connection's broker (connects if needed).
        in_event_loop: whether the transport runs in Celery's event loop now.
        leases: the transport's lease keeper (its lock is held while a delivery is
            dead-lettered, so no renewal round extends it).
        propagate: the transport's connection and channel errors: a consumer callback
            raising one of them ends the round (the caller recovers).
    """

    def __init__(
        self,
        channel: ChannelView,
        options: TransportOptions,
        topology: Topology,
        broker: Callable[[], Broker],
        *,
        in_event_loop: Callable[[], bool],
        leases: LeaseKeeper,
        propagate: tuple[type[BaseException], ...],
    ) -> None:
        self.channel = channel
        #: The connection's validated transport options.
        self.options = options
        self.topology = topology
        self._broker = broker
        self._in_event_loop = in_event_loop
        self._leases = leases
        self._propagate = propagate
        #: Visibility timeout of a read (seconds): a delivery's lease.
        self.vt_seconds = self.options.vt_seconds
        #: Smallest read while this channel holds messages (half the prefetch window).
        self.read_floor = 1
        #: Reads put off until the prefetch window was half free (statistics).
        self.deferred_reads = 0
        self._base_prefetch: int | None = None
        self._tags = count(1)
        self._turns = count()
        self._no_ack_queues: set[str] = set()
        #: Kombu queue -> (consumer callback, no_ack) of this channel's consumers.
        self._consumer_callbacks: dict[str, tuple[Any, bool]] = {}
        #: Kombu queue -> (x-message-ttl, x-expires) in ms, as stored (first declaration).
        self._lifetimes: dict[str, tuple[int | None, int | None]] = {}

    @property
    def broker(self) -> Broker:
        """Broker operations on the transport's statement connection."""
        return self._broker()

    @property
    def qos(self) -> QoSView:
        """The channel's QoS: prefetch window and held messages."""
        return self.channel.qos

    @property
    def consumed_queues(self) -> list[str]:
        """The Kombu queues the channel consumes now, in the order they were consumed."""
        return self.channel.consumed_queues

    def can_consume(self) -> bool:
        """Whether the channel's prefetch window has room for one more message."""
        return self.qos.can_consume()

    # -- consumers and windows -------------------------------------------------------

    def set_prefetch(self, prefetch_count: int) -> None:
        """The channel's prefetch window changed (see ``Channel.basic_qos``)."""
        count_ = int(prefetch_count or 0)
        if count_ and self._base_prefetch is None:
            self._base_prefetch = count_
        self.read_floor = smallest_read(self._base_prefetch, count_, self.options.read_batch_size)

    def add_consumer(self, queue: str, callback: Any, no_ack: bool) -> None:
        """Deliver what is read from Kombu queue ``queue`` to ``callback``."""
        if no_ack:
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        self._consumer_callbacks[queue] = (callback, no_ack)

    def remove_consumer(self, queue: str) -> None:
        """Nothing more is delivered from ``queue`` (its last consumer was cancelled)."""
        self._no_ack_queues.discard(queue)
        self._consumer_callbacks.pop(queue, None)

    def is_no_ack(self, queue: str) -> bool:
        """Whether ``queue``'s consumer takes messages without acks."""
        return queue in self._no_ack_queues

    def set_lifetime(self, queue: str, ttl_ms: int | None, expires_ms: int | None) -> None:
        """Record ``queue``'s x-message-ttl and x-expires (ms) as stored."""
        self._lifetimes[queue] = (ttl_ms, expires_ms)

    # -- reading ---------------------------------------------------------------------

    def read_one(self, queue: str, no_ack: bool) -> Any:
        """The next deliverable message of ``queue``, or None: rows dead-lettered
        (undecodable, too many deliveries) or expired on the way are skipped."""
        while True:
            messages, read = self.fetch(queue, 1, no_ack=no_ack)
            if messages or not read:
                return messages[0] if messages else None

    def consume(self, only: set[str] | None, acks: list[Receipt]) -> Consumed:
        """Read up to the free prefetch from the consumed queues (those in ``only``, PGMQ
        names; None: all) in one round trip, archiving ``acks`` in the same transaction,
        and deliver each message to its consumer.

        Returns ``(delivered, drained, full, acks_sent, deferred)``: PGMQ names of queues
        found empty, and of queues that filled the read (may hold more); ``acks_sent`` is
        False when ``acks`` were not archived (the caller archives them); ``deferred``:
        the read was put off until half the prefetch window is free (see
        :meth:`basic_qos`).
        """
        queues = self.consumed_queues
        if not queues:
            return Consumed(0, set(), set(), False, False)
        size = read_size(
            self.qos.can_consume_max_estimate(),
            self.qos.prefetch_count,
            self.options.read_batch_size,
            self.read_floor,
        )
        if size is None:  # messages held: wait until half the prefetch window is free
            self.deferred_reads += 1
            return Consumed(0, set(), set(), False, True)
        if size == 0:
            return Consumed(0, set(), set(), False, False)
        remaining = size
        drained: set[str] = set()
        full: set[str] = set()
        retry: dict[str, float] = {}
        batches: list[tuple[str, str, list[Row], bool]] = []

        def account(queue: str, name: str, rows: list[Row], no_ack: bool) -> None:
            nonlocal remaining
            (drained if len(rows) < remaining else full).add(name)
            remaining -= len(rows)
            if rows:
                batches.append((queue, name, rows, no_ack))

        def throttled(reads: Reads) -> None:
            for name, throttle in reads.limits.items():
                if throttle.state == THROTTLED_RATE and throttle.retry_seconds is not None:
                    retry[name] = throttle.retry_seconds

        bands = self.topology.bands
        acked: list[tuple[str, str]] = []  # (kombu queue, PGMQ queue of a band)
        turn = next(self._turns) % len(queues)  # rotate: fair across queues
        for queue in queues[turn:] + queues[:turn]:
            # priority bands highest first (kombu_pgmq._priorities)
            names = [n for n in bands(queue).read_order if only is None or n in only]
            if queue not in self._no_ack_queues:
                acked.extend((queue, name) for name in names)
                continue
            for name in names:  # no_ack: read (not popped), deleted once delivered
                if remaining > 0:
                    account(queue, name, self._rows(queue, name, remaining), True)
        acks_sent = False
        if acked and remaining > 0:
            try:
                durable = self.options.durable_acks
                names = [name for _, name in acked]
                rows = self.broker.read_many(
                    names,
                    self.vt_seconds,
                    remaining,
                    acks,
                    durable_acks=durable,
                )
                acks_sent = True
            except errors.QueueNotFound:
                rows = None  # one is gone: go queue by queue (recreates it)
            if rows is None:
                for queue, name in acked:
                    if remaining > 0:
                        one = self._rows(queue, name, remaining)
                        throttled(one)
                        account(queue, name, one, False)
            else:
                throttled(rows)
                by_name: dict[str, list[Row]] = defaultdict(list)
                for row in rows:
                    by_name[row.queue].append(row)
                for queue, name in acked:
                    if remaining > 0:
                        account(queue, name, by_name.get(name, []), False)
        deliveries = [
            (message, queue)
            for queue, name, rows, no_ack in batches
            for message in self._to_messages(queue, name, rows, no_ack=no_ack)
        ]
        no_ack_read: dict[str, list[Receipt]] = defaultdict(list)
        for _, name, batch, no_ack in batches:
            if no_ack:
                no_ack_read[name].extend(
                    Receipt(name, r.msg_id, r.read_ct, r.enqueued_at) for r in batch
                )
        self._deliver_all(deliveries, no_ack_read)
        return Consumed(len(deliveries), drained, full, acks_sent, False, retry)

    def deliver_rows(self, queue: str, name: str, rows: list[Row]) -> int:
        """Deliver rows of PGMQ queue ``name`` (a band of Kombu queue ``queue``) handed
        over at publish (delivered to this connection already) as a read's
        rows are: poison and expired ones settled on the way. Returns how many reached the
        consumer's callback."""
        deliveries = [(m, queue) for m in self._to_messages(queue, name, rows, no_ack=False)]
        self._deliver_all(deliveries, {})
        return len(deliveries)

    def _deliver_all(
        self, deliveries: list[tuple[Any, str]], no_ack_read: dict[str, list[Receipt]]
    ) -> None:
        """Hand ``(message, kombu queue)`` pairs to their consumers in order; a callback
        that raises gets its message dead-lettered in Celery's event loop (see
        :meth:`_callback_failed`), else the messages after it are released and the error
        propagates. ``no_ack_read``: what ``no_ack`` consumers were handed, deleted
        afterwards (those a failure kept from them excepted)."""
        undelivered: list[Any] = []
        try:
            for index, (message, queue) in enumerate(deliveries):
                try:
                    self._deliver(message, queue)
                except Exception as exc:
                    if self._callback_failed(message, exc):
                        continue
                    undelivered = [m for m, _ in deliveries[index + 1 :]]
                    self.release(undelivered)
                    raise
                except BaseException:
                    undelivered = [m for m, _ in deliveries[index + 1 :]]
                    self.release(undelivered)
                    raise
        finally:
            if no_ack_read:
                self._forget_no_ack(no_ack_read, undelivered)

    def _deliver(self, message: Any, queue: str) -> None:
        """Hand a message to the consumer of ``queue`` on this channel (held for its ack
        unless the consumer is ``no_ack``), as kombu's virtual ``basic_consume`` does; a
        consumer cancelled since the read gets nothing (the message is made visible
        again, not counted)."""
        consumer = self._consumer_callbacks.get(queue)
        if consumer is None:
            self.release([message])
            return
        callback, no_ack = consumer
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        callback(message)

    def _callback_failed(self, message: Any, exc: Exception) -> bool:
        """In Celery's event loop, a consumer callback that raises (not a broker error)
        would end the worker ("Unrecoverable error"), and the message, restored, would
        end the next one: e.g. Celery's own ``on_task_received`` on a row with a ``task``
        header and no ``id``. The message is dead-lettered alone (reason
        ``consumer_error``, with the error) unless the callback settled it, the error is
        logged with its traceback, and delivery goes on (True). Outside the event loop
        (``drain_events``), or for a connection or statement error, the exception
        propagates as in kombu's transports (False)."""
        if not self._in_event_loop() or isinstance(exc, self._propagate):
            return False
        info = message.delivery_info
        logger.error(
            "the consumer of queue %r raised on message %s; it is dead-lettered "
            "(reason consumer_error) and the queue goes on",
            info["kombu_queue"],
            info["pgmq_msg_id"],
            exc_info=exc,
        )
        tag = message.delivery_tag
        if self.qos.holds(tag):  # not acked or rejected by the callback
            held = receipt(info)
            with self._leases.lock:
                error = [f"{type(exc).__name__}: {exc}"]
                self.dead_letter(info["kombu_queue"], held.queue, [held], "consumer_error", error)
                self.qos.forget(tag)
        return True

    def _forget_no_ack(self, read: dict[str, list[Receipt]], undelivered: list[Any]) -> None:
        """Delete what ``no_ack`` consumers were handed: as AMQP auto-ack, a message is
        gone once delivered, but one a failed callback kept from the application stays
        (it was requeued). Expired rows read with them were archived already."""
        kept = {
            (info["pgmq_queue"], info["pgmq_msg_id"])
            for info in (m.delivery_info for m in undelivered)
        }
        for name, held in read.items():
            gone = [r for r in held if (name, r.msg_id) not in kept]
            if gone:
                with contextlib.suppress(errors.QueueNotFound):
                    self.broker.discard(gone)

    def release(self, messages: list[Any]) -> None:
        """Make read but undelivered messages visible again (a callback failed): the
        application never saw them, so the delivery does not count."""
        held = [receipt(m.delivery_info) for m in messages]
        if held:
            self.broker.requeue(held, 0, uncount=True)

    def fetch(self, queue: str, qty: int, *, no_ack: bool) -> tuple[list[Any], int]:
        """Read up to ``qty`` messages of one queue, priority bands highest first (all
        bands in one round trip, unless popping). Returns ``(messages, rows read)``: rows
        dead-lettered or expired on the way are read but not returned."""
        names = self.topology.bands(queue).read_order
        if len(names) > 1 and not no_ack:
            try:
                rows = self.broker.read_many(names, self.vt_seconds, qty)
            except errors.QueueNotFound:
                pass  # one is gone: band by band below (recreates a consumed queue)
            else:
                by_name: dict[str, list[Row]] = defaultdict(list)
                for row in rows:
                    by_name[row.queue].append(row)
                return [
                    message
                    for name in names
                    for message in self._to_messages(queue, name, by_name[name], no_ack)
                ], len(rows)
        messages: list[Any] = []
        read = 0
        for name in names:
            if qty <= 0:
                break
            rows = self._rows(queue, name, qty, no_ack)
            qty -= len(rows)
            read += len(rows)
            messages += self._to_messages(queue, name, rows, no_ack)
        return messages, read

    def _rows(self, queue: str, name: str, qty: int, no_ack: bool = False) -> Reads:
        """Read (or pop, for no_ack) up to ``qty`` rows of one queue; a consumed queue
        found dropped is declared again (and yields nothing this time)."""
        try:
            if no_ack:
                return Reads(self.broker.pop(name, qty))
            return self.broker.read(name, self.vt_seconds, qty)
        except errors.QueueNotFound:
            if queue in self.channel.consumed_queues:
                self.channel.recreate(queue)
            return Reads()

    def _to_messages(self, queue: str, name: str, rows: list[Row], no_ack: bool) -> list[Any]:
        """Rows -> Kombu messages: poison messages dead-lettered (undecodable: any
        failure before the consumer's callback, e.g. an unknown body encoding; or
        delivered more than ``max_deliveries`` times, restores not counted), expired
        ones archived (reason ``expired``) unless they are Celery tasks, which are
        handed off for the worker to revoke (see the module docstring)."""
        limit = None if no_ack else self.options.max_deliveries
        messages: list[Any] = []
        decoded: list[Row] = []
        undecodable: list[tuple[Row, str]] = []
        poison: list[Receipt] = []
        for row in rows:
            try:
                message = self._message(queue, name, row)
            except Exception as exc:  # one bad row never blocks its batch
                undecodable.append((row, f"{type(exc).__name__}: {exc}"))
                continue
            if limit is not None and message.delivery_info["pgmq_deliveries"] > limit:
                poison.append(Receipt(name, row.msg_id, row.read_ct, row.enqueued_at))
                continue
            messages.append(message)
            decoded.append(row)
        if poison:
            self.dead_letter(queue, name, poison, "max_deliveries")
        if undecodable:
            self.dead_letter(
                queue,
                name,
                [Receipt(name, r.msg_id, r.read_ct, r.enqueued_at) for r, _ in undecodable],
                "undecodable",
                error_texts=[error for _, error in undecodable],
            )
        rows = decoded
        ttl = self._queue_ttl_seconds(queue)
        expired: list[Any] = []
        for message, row in zip(messages, rows, strict=True):
            passed = _expired(message.properties, row, ttl)
            if passed is None:
                continue
            if _celery_task(message.headers):
                _revoke_on_delivery(message, *passed)
            else:
                expired.append(message)
        if expired:
            self._archive_expired(queue, expired)
            gone = {id(m) for m in expired}
            messages = [m for m in messages if id(m) not in gone]
        STATS.deliveries += len(messages)
        STATS.redeliveries += sum(1 for row in rows if row.read_ct > 1)
        return messages

    def _archive_expired(self, queue: str, expired: list[Any]) -> None:
        """Archive expired messages (reason ``expired``) instead of delivering them; one
        popped by a ``no_ack`` get is gone already (logged)."""
        held = [receipt(m.delivery_info) for m in expired]
        archived = self.broker.archive_expired(held)
        logger.debug(
            "%d expired message(s) of queue %r archived (reason expired), not delivered",
            len(archived),
            queue,
        )
        if len(archived) < len(held):
            logger.debug(
                "%d expired message(s) of queue %r not archived: popped by a no_ack get, "
                "or no longer held by this delivery",
                len(held) - len(archived),
                queue,
            )

    def lifetime(self, queue: str) -> tuple[int | None, int | None]:
        """``(x-message-ttl, x-expires)`` of ``queue`` in ms (cached per channel)."""
        lifetime = self._lifetimes.get(queue)
        if lifetime is None:
            lifetime = self._lifetimes[queue] = self.broker.declarations.lifetime(queue)
        return lifetime

    def _queue_ttl_seconds(self, queue: str) -> float | None:
        ttl = self.lifetime(queue)[0]
        return None if ttl is None else ttl / 1000.0

    def _message(self, queue: str, name: str, row: Row) -> Any:
        """The Kombu message of a row, built here (not in kombu's consumer callback) so
        that whatever cannot be turned into one (an unknown ``body-encoding``, a body
        its encoding cannot decode, headers or properties of the wrong shape, a
        compressed body that does not decompress) raises before any consumer is
        involved."""
        payload = encoding.decode(row.message, row.headers)
        props = payload["properties"]
        props["delivery_tag"] = next(self._tags)
        info = props["delivery_info"]
        info["redelivered"] = row.read_ct > 1
        info["pgmq_queue"] = name
        info["pgmq_msg_id"] = row.msg_id
        info["pgmq_read_ct"] = row.read_ct
        # deliveries that reached the application (this one included): restores (the
        # x-kombu-restored header; read_ct only grows) do not count toward max_deliveries
        info["pgmq_deliveries"] = row.read_ct - info.pop("pgmq_restored")
        info["pgmq_enqueued_at"] = row.enqueued_at
        info["kombu_queue"] = queue
        info.setdefault("routing_key", queue)
        info.setdefault("exchange", "")
        message = self.channel.Message(payload, channel=self.channel)
        if message.errors:  # kombu keeps decompression errors for the consumer
            error = message.errors[0][1]
            assert error is not None
            raise error
        return message

    def dead_letter(
        self,
        kombu_queue: str,
        name: str,
        receipts: list[Receipt],
        reason: str,
        error_texts: list[str] | None = None,
    ) -> None:
        """Move these deliveries of PGMQ queue ``name`` (of Kombu queue ``kombu_queue``) to the
        dead-letter queue with ``reason`` (and one error text per receipt, if given), declaring
        the dead-letter queue first if it is missing; receipts no longer held (stale) are
        logged, never applied (mirrors SQS redrive to a dead-letter queue)."""
        dlq_kombu = self.options.dead_letter_queue
        dlq = pgmq_queue_name(dlq_kombu)
        kwargs: dict[str, Any] = {
            "dead_letter_queue": dlq,
            "reason": reason,
            "kombu_queue": kombu_queue,
            "errors": error_texts,
        }
        try:
            moved = self.broker.dead_letter(name, receipts, **kwargs)
        except errors.QueueNotFound:
            self.channel.declare_queue(dlq_kombu)
            moved = self.broker.dead_letter(name, receipts, **kwargs)
        STATS.dead_lettered += len(moved)
        if moved:
            logger.warning(
                "dead-lettered %d message(s) of queue %r to %r (reason: %s)",
                len(moved),
                kombu_queue,
                dlq_kombu,
                reason,
            )
        if len(moved) < len(receipts):
            action = "reject" if reason == "rejected" else f"dead-letter ({reason})"
            warn_stale(action, receipts, applied=len(moved))
