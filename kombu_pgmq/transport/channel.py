"""Kombu semantics on PGMQ: :class:`Channel` (queues, exchanges, publish, consume) and
:class:`QoS` (prefetch, ack, reject, restore). No SQL here: statements go through the
transport's :class:`~kombu_pgmq._db.broker.Broker` (``channel.pgmq``)."""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from itertools import count
from queue import Empty
from typing import TYPE_CHECKING, Any

from kombu.exceptions import ChannelError
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments

from .. import _encoding as encoding
from .. import _priorities as priorities
from .. import errors
from .._db.broker import Broker, QueueInfo, Receipt, Row
from .._naming import pgmq_queue_name
from .._stats import STATS
from ._publishing import DELAY_PROPERTY, Publishing
from .options import TransportOptions

if TYPE_CHECKING:
    from .transport import Transport

logger = logging.getLogger(__name__)

__all__ = ["Channel", "QoS"]


def _milliseconds(arguments: dict[str, Any], key: str) -> int | None:
    value = arguments.get(key)
    if value is None:
        return None
    try:
        ms = int(value)
    except (TypeError, ValueError):
        ms = -1
    if ms <= 0:
        raise errors.ConfigurationError(
            f"queue argument {key}={value!r} is invalid: expected milliseconds > 0"
        )
    return ms


#: Queue argument: messages with the same ``x-group-id`` header are delivered one at a
#: time, in publish order (SQS FIFO message groups).
FIFO_ARGUMENT = "x-fifo-groups"
#: Queue argument: a Celery task id counts as a deduplication id.
DEDUPLICATE_TASK_ID_ARGUMENT = "x-deduplicate-task-id"


def _flag(arguments: dict[str, Any], key: str) -> bool:
    value = arguments.get(key, False)
    if not isinstance(value, bool):
        raise errors.ConfigurationError(
            f"queue argument {key}={value!r} is invalid: expected True or False"
        )
    return value


def _expired(properties: dict[str, Any], row: Row, ttl_seconds: float | None) -> bool:
    """x-message-ttl of the queue, or the message's own ``expiration`` (ms), has passed
    since the message became visible (a delayed message's TTL starts after its delay)."""
    try:
        age = row.age_seconds - float(properties.get(DELAY_PROPERTY) or 0)
    except (TypeError, ValueError):
        age = row.age_seconds
    if ttl_seconds is not None and age > ttl_seconds:
        return True
    expiration = properties.get("expiration")
    if expiration is None:
        return False
    try:
        return age > float(expiration) / 1000.0
    except (TypeError, ValueError):
        return False


def receipt(delivery_info: dict[str, Any]) -> Receipt:
    """The receipt handle of a delivered message (from its ``delivery_info``)."""
    return Receipt(
        delivery_info["pgmq_queue"],
        delivery_info["pgmq_msg_id"],
        delivery_info["pgmq_read_ct"],
        delivery_info.get("pgmq_enqueued_at"),
    )


def _log_stale(action: str, given: list[Receipt], settled: set[tuple[str, int]]) -> None:
    stale = [r for r in given if (r.queue, r.msg_id) not in settled]
    for r in stale:
        logger.warning(
            "stale %s of message %s in PGMQ queue %r not applied: its lease lapsed and it "
            "was delivered again (read_ct moved past %d), or it is gone",
            action,
            r.msg_id,
            r.queue,
            r.read_ct,
        )


class QoS(virtual.QoS):
    """Prefetch bookkeeping; acks archive, rejects requeue or dead-letter in PGMQ, each
    by receipt handle (:class:`~kombu_pgmq._db.broker.Receipt`): a stale one (the lease
    lapsed and the message was delivered again) is logged, never applied."""

    channel: Channel

    def ack(self, delivery_tag: Any) -> None:
        """Archive the message: at once, or batched with others (see
        :meth:`Poller.defer_ack`: inside ``drain_events`` and in Celery's event loop).
        Acking a message that is not held (``no_ack`` consumers, already settled) does
        nothing, as kombu's virtual QoS."""
        message = self._delivered.get(delivery_tag)
        if message is None:
            return
        held = receipt(message.delivery_info)
        STATS.acks += 1
        transport = self.channel.connection
        if transport.poller.defers_acks:
            super().ack(delivery_tag)
            transport.poller.defer_ack(held)
        else:
            durable = transport.options.durable_acks
            _log_stale("ack", [held], self.channel.pgmq.ack([held], durable=durable))
            super().ack(delivery_tag)
            transport.poller.wake()  # a prefetch slot is free: read now

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        message = self._delivered.get(delivery_tag)
        if message is None:
            return
        held = receipt(message.delivery_info)
        STATS.rejects += 1
        with self.channel.connection.leases.lock:
            if requeue:
                STATS.requeues += 1
                _log_stale("requeue", [held], self.channel.pgmq.requeue([held], 0))
            else:
                kombu_queue = message.delivery_info["kombu_queue"]
                self.channel._dead_letter(kombu_queue, held.queue, [held], "rejected")
            self._quick_ack(delivery_tag)
        self.channel.connection.poller.wake(requeued=held.queue if requeue else None)

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """Make every unacked message visible again (one statement); batched acks are
        archived first. Restored deliveries do not count toward ``max_deliveries``."""
        self._flush()
        transport = self.channel.connection
        if transport is not None:
            transport.poller.flush_acks()
            with transport.leases.lock:  # no renewal round may extend them afterwards
                return self._requeue_unacked()
        return self._requeue_unacked()

    def _requeue_unacked(self) -> list[tuple[BaseException, Any]]:
        held = [receipt(m.delivery_info) for m in self._delivered.values()]
        self._delivered.clear()
        if held:
            try:
                self.channel.pgmq.requeue(held, 0, uncount=True)
            except errors.KombuPgmqError as exc:
                # Not lost: they become visible anyway when their visibility timeout ends.
                logger.warning(
                    "could not requeue %d unacked messages (%s); they are delivered "
                    "again after the visibility timeout",
                    len(held),
                    exc,
                )
        return []  # nothing is lost on failure: the visibility timeout restores it


class Channel(Publishing, virtual.Channel):
    """One Kombu channel; all channels of a connection share its PostgreSQL connection."""

    QoS = QoS
    connection: Transport

    #: Bodies are stored by :mod:`kombu_pgmq._encoding` (JSON as JSON), not base64'd by
    #: Kombu. The ``body_encoding`` transport option still applies if set.
    body_encoding = None  # type: ignore[assignment]

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        #: The connection's validated transport options.
        self.options: TransportOptions = connection.options
        self._tags = count(1)
        #: Smallest read while this channel holds messages (half the prefetch window).
        self._read_floor = 1
        self._base_prefetch: int | None = None
        #: Reads put off until the prefetch window was half free (statistics).
        self.deferred_reads = 0
        self._turns = count()
        self._no_ack_queues: set[str] = set()
        #: Kombu queue -> (consumer callback, no_ack) of this channel's consumers.
        self._consumer_callbacks: dict[str, tuple[Any, bool]] = {}
        self._vt_seconds = self.options.vt_seconds
        self._known_queues: set[str] = set()
        #: Kombu queues this channel declared without x-deduplicate-task-id.
        self._plain_queues: set[str] = set()
        #: Kombu queue -> (x-message-ttl, x-expires) in ms, as stored (first declaration).
        self._lifetimes: dict[str, tuple[int | None, int | None]] = {}
        # What this channel declared and bound, to recreate a consumed queue that was
        # dropped under it (by an operator, or reaped after a long database outage).
        self._declared: dict[str, dict[str, Any]] = {}
        self._bound: dict[str, set[tuple[str, str]]] = {}
        # Connects now (and bootstraps the schema once per process), so connection
        # errors surface at channel creation as kombu expects.
        self.connection.broker()

    @property
    def pgmq(self) -> Broker:
        """Broker operations on the connection's statement connection."""
        return self.connection.broker()

    # -- queues ----------------------------------------------------------------------

    def _new_queue(
        self,
        queue: str,
        durable: bool = True,
        auto_delete: bool = False,
        exclusive: bool = False,
        arguments: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Create the queue if this channel has not yet; record its AMQP arguments.

        ``durable=False`` makes an UNLOGGED PGMQ queue; ``auto_delete`` (and
        ``exclusive``, which implies it here) drops it when its last consumer cancels;
        ``x-expires`` (ms) drops it after that long unused; ``x-message-ttl`` (ms) drops
        older messages instead of delivering them.
        """
        name = pgmq_queue_name(queue)
        if name in self._known_queues:
            return
        self._declared[queue] = {
            "durable": durable,
            "auto_delete": auto_delete,
            "exclusive": exclusive,
            "arguments": arguments,
        }
        args = arguments or {}
        expires = _milliseconds(args, "x-expires")
        ttl = _milliseconds(args, "x-message-ttl")
        max_priority = priorities.max_priority_argument(args, queue)
        fifo = _flag(args, FIFO_ARGUMENT)
        if fifo and max_priority is not None:
            raise errors.ConfigurationError(
                f"queue {queue!r} has both {FIFO_ARGUMENT} and x-max-priority: a FIFO queue "
                "delivers each group in publish order, so it has no priorities; drop one"
            )
        bands = priorities.make_bands(queue, max_priority, self.options.priority_steps)
        try:
            info = self.pgmq.create_queue(
                name,
                queue,
                durable=bool(durable),
                auto_delete=bool(auto_delete or exclusive),
                expires_ms=expires,
                message_ttl_ms=ttl,
                max_priority=max_priority,
                floors=bands.floors,
                band_queues=bands.queues,
                fifo_groups=fifo,
                deduplicate_task_id=_flag(args, DEDUPLICATE_TASK_ID_ARGUMENT),
            )
        except errors.PermissionDenied as exc:
            info = self._passive_declare(queue, exc)
        self._lifetimes[queue] = (info.message_ttl_ms, info.expires_ms)
        self.connection.set_bands(
            queue, priorities.stored(name, info.floors, info.band_queues), fifo=info.fifo_groups
        )
        if max_priority is not None and info.max_priority != max_priority:
            raise ChannelError(
                f"PRECONDITION_FAILED - inequivalent arg 'x-max-priority' for queue {queue!r}: "
                f"received {max_priority} but current is {info.max_priority}; declare it "
                "with the same x-max-priority, or delete the queue first (queue_delete)",
                (50, 10),
                "Channel.queue_declare",
                "406",
            )
        self._known_queues.add(name)
        if info.deduplicate_task_id:
            self._plain_queues.discard(queue)
        else:
            self._plain_queues.add(queue)

    def _passive_declare(self, queue: str, refused: errors.PermissionDenied) -> QueueInfo:
        """A role that may not declare queues (a producer) may still use one that exists:
        its declaration becomes a passive one, as Celery declares the task queue before
        every first publish.

        Raises:
            PermissionDenied: the queue does not exist (the message names the fix).
        """
        info = self.pgmq.queue_info(queue)
        if info is None:
            raise errors.PermissionDenied(
                f"queue {queue!r} does not exist and this role may not create queues "
                f"({refused}); declare it once with a worker or the schema owner's role"
            ) from refused
        ttl, expires = self.pgmq.lifetime(queue)
        return info._replace(message_ttl_ms=ttl, expires_ms=expires)

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        """Kombu ``Queue(expires=, message_ttl=, max_length=...)`` -> ``x-*`` arguments
        (seconds to milliseconds), as for RabbitMQ."""
        return to_rabbitmq_queue_arguments(arguments, **kwargs)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.pgmq.queue_exists(pgmq_queue_name(queue))

    def _size(self, queue: str) -> int:
        total = 0
        for name in self.connection.bands(queue).queues:
            with contextlib.suppress(errors.QueueNotFound):
                total += self.pgmq.size(name)
        return total

    def _purge(self, queue: str) -> int:
        total = 0
        for name in self.connection.bands(queue).queues:
            with contextlib.suppress(errors.QueueNotFound):
                total += self.pgmq.purge(name)
        return total

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        name = pgmq_queue_name(queue)
        self._known_queues.discard(name)
        self._plain_queues.discard(queue)
        try:
            self.pgmq.drop_queue(name, queue)  # every band with it
        except errors.PermissionDenied as exc:
            # a worker's role: its transient queues only (kombu deletes pidbox reply
            # queues once it read the replies)
            if not self.pgmq.drop_transient_queue(queue) and self.pgmq.queue_info(queue):
                raise errors.PermissionDenied(
                    f"queue {queue!r} is durable and this role may delete only transient "
                    f"queues (non-durable, auto_delete, x-expires) ({exc}); the schema "
                    "owner's role deletes it"
                ) from exc
        self.connection.forget_bands(queue)

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> None:
        """Delete the queue, its archive, bindings and consumers (also if declared by
        another process)."""
        if if_empty and self._size(queue):
            return
        self._delete(queue)

    # -- consume ---------------------------------------------------------------------

    def basic_qos(
        self, prefetch_size: int = 0, prefetch_count: int = 0, apply_global: bool = False
    ) -> None:
        """Set the prefetch window (``prefetch_count`` unacked messages; 0: unlimited).

        Reads are coalesced: while the channel holds messages, it reads again only once
        half of the window is free (at least 1), so a consumer draining a backlog reads
        several messages per round trip instead of one per ack; with nothing held it
        reads at once. The half is of the first window set (Celery's
        ``worker_prefetch_multiplier`` times concurrency): Celery widens the window for
        each ETA/countdown task it holds, which must not hold back reads.
        """
        super().basic_qos(prefetch_size, prefetch_count, apply_global)
        count_ = int(prefetch_count or 0)
        if count_ and self._base_prefetch is None:
            self._base_prefetch = count_
        base = min(self._base_prefetch or 0, count_) if count_ else 0
        self._read_floor = max(1, min(base, self.options.read_batch_size) // 2)

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        if no_ack:
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self._consumer_callbacks[queue] = (callback, no_ack)
        self.connection.register_consumer(queue, consumer_tag)
        self.connection.poller.on_consume(self.connection.bands(queue).queues)
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None:
            if queue not in self._active_queues:
                self._no_ack_queues.discard(queue)
                self._consumer_callbacks.pop(queue, None)
            if self.connection.release_consumer(queue, consumer_tag):
                self._known_queues.discard(pgmq_queue_name(queue))
            self.connection.poller.on_cancel(self.connection.bands(queue).queues)
        return result

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        """Get one message synchronously (``None`` if the queue has none ready)."""
        message = self._read_one(queue, no_ack)
        if self._lifetime(queue)[1] is not None:
            self.pgmq.touch_queue(queue)  # basic.get counts as use (x-expires)
        if message is not None and not no_ack:
            self.qos.append(message, message.delivery_tag)
            self.connection.keep_leases()
        return message

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        """Kombu's raw read: the payload of one message (``Empty`` if none is ready)."""
        message = self._read_one(queue, queue in self._no_ack_queues)
        if message is None:
            raise Empty()
        return dict(message._raw)

    def _read_one(self, queue: str, no_ack: bool) -> Any:
        """The next deliverable message of ``queue``, or None: rows dead-lettered
        (undecodable, too many deliveries) or expired on the way are skipped."""
        while True:
            messages, read = self._fetch(queue, 1, no_ack=no_ack)
            if messages or not read:
                return messages[0] if messages else None

    def _consume(
        self, only: set[str] | None, acks: list[Receipt]
    ) -> tuple[int, set[str], set[str], bool, bool]:
        """Read up to the free prefetch from the consumed queues (those in ``only``, PGMQ
        names; None: all) in one round trip, archiving ``acks`` in the same transaction,
        and deliver each message to its consumer.

        Returns ``(delivered, drained, full, acks_sent, deferred)``: PGMQ names of queues
        found empty, and of queues that filled the read (may hold more); ``acks_sent`` is
        False when ``acks`` were not archived (the caller archives them); ``deferred``:
        the read was put off until half the prefetch window is free (see
        :meth:`basic_qos`).
        """
        queues = self._active_queues
        if not queues:
            return 0, set(), set(), False, False
        free = self.qos.can_consume_max_estimate()
        remaining = (
            self.options.read_batch_size
            if free is None
            else min(free, self.options.read_batch_size)
        )
        if remaining <= 0:
            return 0, set(), set(), False, False
        if remaining < self._read_floor and free != self.qos.prefetch_count:
            # Messages are still held (the application has work): wait until half the
            # prefetch window is free, so a backlog is read in batches, not one message
            # per ack (see the ``Channel.basic_qos`` note).
            self.deferred_reads += 1
            return 0, set(), set(), False, True
        drained: set[str] = set()
        full: set[str] = set()
        batches: list[tuple[str, str, list[Row], bool]] = []

        def account(queue: str, name: str, rows: list[Row], no_ack: bool) -> None:
            nonlocal remaining
            (drained if len(rows) < remaining else full).add(name)
            remaining -= len(rows)
            if rows:
                batches.append((queue, name, rows, no_ack))

        bands = self.connection.bands
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
                durable = self.connection.options.durable_acks
                names = [name for _, name in acked]
                rows = self.pgmq.read_many(
                    names,
                    self._vt_seconds,
                    remaining,
                    acks,
                    durable_acks=durable,
                    fifo_queues=self.connection.fifo_queues(names),
                )
                acks_sent = True
            except errors.QueueNotFound:
                rows = None  # one is gone: go queue by queue (recreates it)
            if rows is None:
                for queue, name in acked:
                    if remaining > 0:
                        account(queue, name, self._rows(queue, name, remaining), False)
            else:
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
        for _, name, rows, no_ack in batches:
            if no_ack:
                no_ack_read[name].extend(
                    Receipt(name, r.msg_id, r.read_ct, r.enqueued_at) for r in rows
                )
        undelivered: list[Any] = []
        try:
            for index, (message, queue) in enumerate(deliveries):
                try:
                    self._deliver(message, queue)
                except Exception as exc:
                    if self._callback_failed(message, exc):
                        continue
                    undelivered = [m for m, _ in deliveries[index + 1 :]]
                    self._release(undelivered)
                    raise
                except BaseException:
                    undelivered = [m for m, _ in deliveries[index + 1 :]]
                    self._release(undelivered)
                    raise
        finally:
            if no_ack_read:
                self._forget_no_ack(no_ack_read, undelivered)
        return len(deliveries), drained, full, acks_sent, False

    def _deliver(self, message: Any, queue: str) -> None:
        """Hand a message to the consumer of ``queue`` on this channel (held for its ack
        unless the consumer is ``no_ack``), as kombu's virtual ``basic_consume`` does; a
        consumer cancelled since the read gets nothing (the message is made visible
        again, not counted)."""
        consumer = self._consumer_callbacks.get(queue)
        if consumer is None:
            self._release([message])
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
        transport = self.connection
        if not transport.poller.in_event_loop or isinstance(
            exc, (*transport.connection_errors, *transport.channel_errors)
        ):
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
        if tag in self.qos._delivered:  # not acked or rejected by the callback
            held = receipt(info)
            with transport.leases.lock:
                error = [f"{type(exc).__name__}: {exc}"]
                self._dead_letter(info["kombu_queue"], held.queue, [held], "consumer_error", error)
                self.qos._quick_ack(tag)
        return True

    def _forget_no_ack(self, read: dict[str, list[Receipt]], undelivered: list[Any]) -> None:
        """Delete what ``no_ack`` consumers were handed (and expired rows read with
        them): as AMQP auto-ack, a message is gone once delivered, but one a failed
        callback kept from the application stays (it was requeued)."""
        kept = {
            (info["pgmq_queue"], info["pgmq_msg_id"])
            for info in (m.delivery_info for m in undelivered)
        }
        for name, held in read.items():
            gone = [r for r in held if (name, r.msg_id) not in kept]
            if gone:
                with contextlib.suppress(errors.QueueNotFound):
                    self.pgmq.discard(gone)

    def _release(self, messages: list[Any]) -> None:
        """Make read but undelivered messages visible again (a callback failed): the
        application never saw them, so the delivery does not count."""
        held = [receipt(m.delivery_info) for m in messages]
        if held:
            self.pgmq.requeue(held, 0, uncount=True)

    def _fetch(self, queue: str, qty: int, *, no_ack: bool) -> tuple[list[Any], int]:
        """Read up to ``qty`` messages of one queue, priority bands highest first (all
        bands in one round trip, unless popping). Returns ``(messages, rows read)``: rows
        dead-lettered or expired on the way are read but not returned."""
        names = self.connection.bands(queue).read_order
        if len(names) > 1 and not no_ack:
            try:
                rows = self.pgmq.read_many(
                    names, self._vt_seconds, qty, fifo_queues=self.connection.fifo_queues(names)
                )
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

    def _rows(self, queue: str, name: str, qty: int, no_ack: bool = False) -> list[Row]:
        """Read (or pop, for no_ack) up to ``qty`` rows of one queue; a consumed queue
        found dropped is declared again (and yields nothing this time)."""
        try:
            if no_ack:
                return self.pgmq.pop(name, qty)
            return self.pgmq.read(
                name, self._vt_seconds, qty, fifo=bool(self.connection.fifo_queues([name]))
            )
        except errors.QueueNotFound:
            if queue in self._active_queues:
                self._recreate(queue)
            return []

    def _to_messages(self, queue: str, name: str, rows: list[Row], no_ack: bool) -> list[Any]:
        """Rows -> Kombu messages: poison messages dead-lettered (undecodable: any
        failure before the consumer's callback, e.g. an unknown body encoding; or
        delivered more than ``max_deliveries`` times, restores not counted), expired
        ones deleted."""
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
            self._dead_letter(queue, name, poison, "max_deliveries")
        if undecodable:
            self._dead_letter(
                queue,
                name,
                [Receipt(name, r.msg_id, r.read_ct, r.enqueued_at) for r, _ in undecodable],
                "undecodable",
                error_texts=[error for _, error in undecodable],
            )
        rows = decoded
        ttl = self._queue_ttl_seconds(queue)
        expired = [
            m for m, row in zip(messages, rows, strict=True) if _expired(m.properties, row, ttl)
        ]
        if expired:
            if not no_ack:
                self.pgmq.discard([receipt(m.delivery_info) for m in expired])
            gone = {id(m) for m in expired}
            messages = [m for m in messages if id(m) not in gone]
        STATS.deliveries += len(messages)
        STATS.redeliveries += sum(1 for row in rows if row.read_ct > 1)
        return messages

    def _lifetime(self, queue: str) -> tuple[int | None, int | None]:
        """``(x-message-ttl, x-expires)`` of ``queue`` in ms (cached per channel)."""
        lifetime = self._lifetimes.get(queue)
        if lifetime is None:
            lifetime = self._lifetimes[queue] = self.pgmq.lifetime(queue)
        return lifetime

    def _queue_ttl_seconds(self, queue: str) -> float | None:
        ttl = self._lifetime(queue)[0]
        return None if ttl is None else ttl / 1000.0

    def _recreate(self, queue: str) -> None:
        """Declare, bind and register again a queue this channel consumes but that is gone."""
        logger.warning(
            "queue %r was dropped while this process consumed it; declaring it again "
            "(with the arguments and bindings this channel gave it)",
            queue,
        )
        self._known_queues.discard(pgmq_queue_name(queue))
        self._new_queue(queue, **self._declared.get(queue, {}))
        for exchange, routing_key in self._bound.get(queue, ()):
            self.pgmq.bind(exchange, routing_key, queue)
        for tag, consumed in self._tag_to_queue.items():
            if consumed == queue:
                self.connection.register_consumer(queue, tag)

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
        # x-kombu-restored header, migration 0015) do not count toward max_deliveries
        info["pgmq_deliveries"] = row.read_ct - info.pop("pgmq_restored")
        info["pgmq_enqueued_at"] = row.enqueued_at
        info["kombu_queue"] = queue
        info.setdefault("routing_key", queue)
        info.setdefault("exchange", "")
        message = self.Message(payload, channel=self)
        if message.errors:  # kombu keeps decompression errors for the consumer
            error = message.errors[0][1]
            assert error is not None
            raise error
        return message

    def _dead_letter(
        self,
        kombu_queue: str,
        name: str,
        receipts: list[Receipt],
        reason: str,
        error_texts: list[str] | None = None,
    ) -> None:
        dlq_kombu = self.options.dead_letter_queue
        dlq = pgmq_queue_name(dlq_kombu)
        kwargs: dict[str, Any] = {
            "dead_letter_queue": dlq,
            "reason": reason,
            "kombu_queue": kombu_queue,
            "errors": error_texts,
        }
        try:
            moved = self.pgmq.dead_letter(name, receipts, **kwargs)
        except errors.QueueNotFound:
            self._new_queue(dlq_kombu)
            moved = self.pgmq.dead_letter(name, receipts, **kwargs)
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
            logger.warning(
                "stale %s of %d message(s) of queue %r not applied: their lease lapsed and "
                "they were delivered again, or they are gone",
                "reject" if reason == "rejected" else f"dead-letter ({reason})",
                len(receipts) - len(moved),
                kombu_queue,
            )

    def _restore(self, message: Any) -> None:
        """Make one unacked message visible again (no copy is published; the delivery
        does not count toward ``max_deliveries``)."""
        self.pgmq.requeue([receipt(message.delivery_info)], 0, uncount=True)
