"""Kombu semantics on PGMQ: :class:`Channel` (queues, exchanges, publish, consume) and
:class:`QoS` (prefetch, ack, reject, restore). No SQL here: statements go through the
transport's :class:`~kombu_pgmq._db.broker.Broker` (``channel.broker``)."""

from __future__ import annotations

import contextlib
import logging
from queue import Empty
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments

from .. import _priorities as priorities
from .. import errors
from .._db.broker import Broker, QueueInfo
from .._naming import pgmq_queue_name
from .._stats import STATS
from ._interfaces import PollerView, TransportView
from ._leases import LeaseKeeper
from ._slots import running_request
from .acks import SETTLED, warn_stale
from .options import TransportOptions
from .publisher import Publisher
from .reader import Reader, receipt

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


def _inequivalent(queue: str, argument: str, received: Any, current: Any) -> ChannelError:
    """The error of a declaration whose ``argument`` differs from the queue's as first
    declared (RabbitMQ's 406 PRECONDITION_FAILED, raised only for an argument given)."""
    return ChannelError(
        f"PRECONDITION_FAILED - inequivalent arg {argument!r} for queue {queue!r}: "
        f"received {received!r} but current is {current!r}; declare it with the same "
        f"{argument}, or delete the queue first (queue_delete)",
        (50, 10),
        "Channel.queue_declare",
        "406",
    )


class QoS(virtual.QoS):
    """Prefetch bookkeeping; acks archive, rejects requeue or dead-letter in PGMQ, each
    by receipt handle (:class:`~kombu_pgmq._db.broker.Receipt`): a stale one (the lease
    lapsed and the message was delivered again) is logged, never applied.

    Arguments:
        channel: the channel whose deliveries it holds.
        prefetch_count: the prefetch window (0: unlimited).
        poller: the transport's poller: acks are batched there while it defers them,
            and an ack or reject wakes it (a prefetch slot is free).
        leases: the transport's lease keeper: the concurrency slots of early-acked
            tasks, and its lock, held while a delivery is made visible again.
    """

    channel: Channel

    def __init__(
        self, channel: Channel, prefetch_count: int = 0, *, poller: PollerView, leases: LeaseKeeper
    ) -> None:
        super().__init__(channel, prefetch_count)
        self.poller = poller
        self.leases = leases

    def ack(self, delivery_tag: Any) -> None:
        """Archive the message: at once, or batched with others (see
        :meth:`Poller.defer_ack`: inside ``drain_events`` and in Celery's event loop).
        Acking a message that is not held (``no_ack`` consumers, already settled) does
        nothing, as kombu's virtual QoS; nor does acking one its task's transaction
        settled (``delivery_info[SETTLED]``, :class:`kombu_pgmq.AtomicTask`)."""
        message = self._delivered.get(delivery_tag)
        if message is None:
            return
        if message.delivery_info.get(SETTLED):
            # its task's transaction archived it (kombu_pgmq.AtomicTask): nothing to send
            STATS.settled_in_transaction += 1
            super().ack(delivery_tag)
            self.poller.wake()
            return
        held = receipt(message.delivery_info)
        STATS.acks += 1
        if held.queue in self.channel.broker.limited:
            # Celery's early ack of a task that runs on: the ack holds its concurrency
            # slot, released when the task finishes (see _slots)
            request = running_request(message)
            if request is not None:
                held = held._replace(hold_seconds=self.channel.reader.vt_seconds)
                self.leases.slots.track(held.queue, held.msg_id, request, held.hold_seconds)
        if self.poller.defers_acks:
            super().ack(delivery_tag)
            self.poller.defer_ack(held)
        else:
            durable = self.channel.options.durable_acks
            warn_stale("ack", [held], self.channel.broker.ack([held], durable=durable))
            super().ack(delivery_tag)
            self.poller.wake()  # a prefetch slot is free: read now

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        """Requeue the message (visible again at once), or dead-letter it (reason
        ``rejected``); a stale receipt is logged, never applied."""
        message = self._delivered.get(delivery_tag)
        if message is None:
            return
        held = receipt(message.delivery_info)
        STATS.rejects += 1
        with self.leases.lock:
            if requeue:
                STATS.requeues += 1
                warn_stale("requeue", [held], self.channel.broker.requeue([held], 0))
            else:
                kombu_queue = message.delivery_info["kombu_queue"]
                self.channel.reader.dead_letter(kombu_queue, held.queue, [held], "rejected")
            self._quick_ack(delivery_tag)
        self.poller.wake(requeued=held.queue if requeue else None)

    def holds(self, delivery_tag: Any) -> bool:
        """Whether the message of ``delivery_tag`` is held for its ack (not settled)."""
        return delivery_tag in self._delivered

    def forget(self, delivery_tag: Any) -> None:
        """Stop holding a message settled some other way (dead-lettered)."""
        self._quick_ack(delivery_tag)

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """Make every unacked message visible again (one statement); batched acks are
        archived first. Restored deliveries do not count toward ``max_deliveries``."""
        self._flush()
        if self.channel.connection is not None:  # the channel is open
            self.poller.flush_acks()
            with self.leases.lock:  # no renewal round may extend them afterwards
                return self._requeue_unacked()
        return self._requeue_unacked()

    def _requeue_unacked(self) -> list[tuple[BaseException, Any]]:
        held = [receipt(m.delivery_info) for m in self._delivered.values()]
        self._delivered.clear()
        if held:
            try:
                self.channel.broker.requeue(held, 0, uncount=True)
            except errors.KombuPgmqError as exc:
                # Not lost: they become visible anyway when their visibility timeout ends.
                logger.warning(
                    "could not requeue %d unacked messages (%s); they are delivered "
                    "again after the visibility timeout",
                    len(held),
                    exc,
                )
        return []  # nothing is lost on failure: the visibility timeout restores it


class Channel(virtual.Channel):
    """One Kombu channel; all channels of a connection share its PostgreSQL connection."""

    connection: TransportView

    #: Bodies are stored by :mod:`kombu_pgmq._encoding` (JSON as JSON), not base64'd by
    #: Kombu. The ``body_encoding`` transport option still applies if set.
    body_encoding = None  # type: ignore[assignment]

    def __init__(self, connection: TransportView, **kwargs: Any) -> None:
        # the transport's, kept for the channel's QoS (made on first use, maybe after
        # kombu closed the channel and let go of its connection)
        self._poller = connection.poller
        self._leases: LeaseKeeper = connection.leases
        super().__init__(connection, **kwargs)
        #: The connection's validated transport options.
        self.options: TransportOptions = connection.options
        self._known_queues: set[str] = set()
        # What this channel declared and bound, to recreate a consumed queue that was
        # dropped under it (by an operator, or reaped after a long database outage).
        self._declared: dict[str, dict[str, Any]] = {}
        # Connects now (and bootstraps the schema once per process), so connection
        # errors surface at channel creation as kombu expects.
        self.connection.broker()
        #: The read path: coalesced reads, poison rows, TTL, deliveries to consumers.
        self.reader = Reader(
            self,
            connection.options,
            connection.topology,
            connection.broker,
            in_event_loop=lambda: self._poller.in_event_loop,
            leases=self._leases,
            propagate=(*connection.connection_errors, *connection.channel_errors),
        )
        #: The publishing side: exchanges, bindings, publish.
        self.publisher = Publisher(self)

    @property
    def broker(self) -> Broker:
        """Broker operations on the connection's statement connection."""
        return self.connection.broker()

    @property
    def qos(self) -> QoS:
        """The channel's QoS: prefetch window, held messages, ack, reject, restore."""
        if self._qos is None:
            self._qos = QoS(self, poller=self._poller, leases=self._leases)
        return self._qos

    # -- queues ----------------------------------------------------------------------

    @property
    def consumed_queues(self) -> list[str]:
        """The Kombu queues this channel consumes now, in the order they were consumed."""
        return list(self._active_queues)

    def forget_held(self) -> None:
        """In a forked child: drop the parent's held messages without a word to the
        server (they are the parent's to settle)."""
        qos = self._qos
        if qos is not None:
            qos._delivered.clear()
            qos._dirty.clear()

    def declared(self, queue: str) -> bool:
        """Whether this channel declared Kombu queue ``queue`` (and it was not dropped)."""
        return pgmq_queue_name(queue) in self._known_queues

    def plain(self, queue: str) -> bool:
        """Whether ``queue`` was declared without ``x-deduplicate-task-id`` (by any
        channel of this transport, or as stored: :meth:`Topology.plain
        <kombu_pgmq.transport.topology.Topology.plain>`), so that a Kombu connection's
        second channel, which ``maybe_declare`` does not declare again, publishes as fast
        as the first."""
        return self.connection.topology.plain(queue)

    def forget_queue(self, queue: str) -> None:
        """``queue`` was found dropped: declare it again on next use."""
        self._known_queues.discard(pgmq_queue_name(queue))
        self.connection.topology.forget_bands(queue)

    def declare_queue(self, queue: str) -> None:
        """Declare ``queue`` with default arguments unless this channel did already (the
        dead-letter queue, on its first use)."""
        self._new_queue(queue)

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
            info = self.broker.declarations.create_queue(
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
        self.reader.set_lifetime(queue, info.message_ttl_ms, info.expires_ms)
        self.connection.topology.set_bands(
            queue, priorities.stored(name, info.floors, info.band_queues)
        )
        limits = self.options.queue_limits.get(queue)
        if limits is not None:
            self.connection.topology.set_limits(queue, limits)
        if max_priority is not None and info.max_priority != max_priority:
            raise _inequivalent(queue, "x-max-priority", max_priority, info.max_priority)
        for argument, current in (
            (FIFO_ARGUMENT, info.fifo_groups),
            (DEDUPLICATE_TASK_ID_ARGUMENT, info.deduplicate_task_id),
        ):
            if argument in args and args[argument] != current:
                raise _inequivalent(queue, argument, args[argument], current)
        self._known_queues.add(name)
        self.connection.topology.set_plain(queue, not info.deduplicate_task_id)

    def _passive_declare(self, queue: str, refused: errors.PermissionDenied) -> QueueInfo:
        """A role that may not declare queues (a producer) may still use one that exists:
        its declaration becomes a passive one, as Celery declares the task queue before
        every first publish.

        Raises:
            PermissionDenied: the queue does not exist (the message names the fix).
        """
        info = self.broker.declarations.queue_info(queue)
        if info is None:
            raise errors.PermissionDenied(
                f"queue {queue!r} does not exist and this role may not create queues "
                f"({refused}); declare it once with a worker or the schema owner's role"
            ) from refused
        ttl, expires = self.broker.declarations.lifetime(queue)
        return info._replace(message_ttl_ms=ttl, expires_ms=expires)

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        """Kombu ``Queue(expires=, message_ttl=, max_length=...)`` -> ``x-*`` arguments
        (seconds to milliseconds), as for RabbitMQ."""
        return to_rabbitmq_queue_arguments(arguments, **kwargs)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.broker.declarations.queue_exists(pgmq_queue_name(queue))

    def _size(self, queue: str) -> int:
        total = 0
        for name in self.connection.topology.bands(queue).queues:
            with contextlib.suppress(errors.QueueNotFound):
                total += self.broker.declarations.size(name)
        return total

    def _purge(self, queue: str) -> int:
        total = 0
        for name in self.connection.topology.bands(queue).queues:
            with contextlib.suppress(errors.QueueNotFound):
                total += self.broker.declarations.purge(name)
        return total

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        name = pgmq_queue_name(queue)
        self._known_queues.discard(name)
        declarations = self.broker.declarations
        try:
            declarations.drop_queue(name, queue)  # every band with it
        except errors.PermissionDenied as exc:
            # a worker's role: its transient queues only (kombu deletes pidbox reply
            # queues once it read the replies)
            if not declarations.drop_transient_queue(queue) and declarations.queue_info(queue):
                raise errors.PermissionDenied(
                    f"queue {queue!r} is durable and this role may delete only transient "
                    f"queues (non-durable, auto_delete, x-expires) ({exc}); the schema "
                    "owner's role deletes it"
                ) from exc
        self.connection.topology.forget_bands(queue)

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> None:
        """Delete the queue, its archive, bindings and consumers (also if declared by
        another process)."""
        if if_empty and self._size(queue):
            return
        self._delete(queue)

    # -- exchanges, bindings, publish (publisher.py) ------------------------------------

    def exchange_declare(
        self,
        exchange: str | None = None,
        type: str = "direct",
        durable: bool = False,
        auto_delete: bool = False,
        arguments: Any = None,
        nowait: bool = False,
        passive: bool = False,
    ) -> None:
        """Declare an exchange in the database, visible to every process (see
        :meth:`kombu_pgmq.transport.publisher.Publisher.exchange_declare`)."""
        self.publisher.exchange_declare(
            exchange, type, durable, auto_delete, arguments, nowait, passive
        )

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        """Delete the exchange and its bindings (queues stay)."""
        self.publisher.exchange_delete(exchange, if_unused, nowait)

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        """Bind in the database: every process routes by it from its next publish."""
        self.publisher.queue_bind(queue, exchange, routing_key, arguments, **kwargs)

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        """Remove the binding in the database."""
        self.publisher.queue_unbind(queue, exchange, routing_key, arguments, **kwargs)

    def list_bindings(self) -> Any:
        """Every binding as ``(queue, exchange, routing_key)``."""
        return self.publisher.list_bindings()

    def get_table(self, exchange: str) -> list[tuple[str, str, str]]:
        """Bindings of ``exchange`` as kombu's ``(routing_key, pattern, queue)`` rows."""
        return self.publisher.get_table(exchange)

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        """Kombu's exchange type object of ``exchange``."""
        return self.publisher.typeof(exchange, default)

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        return self.publisher.lookup(exchange, routing_key, default)

    def basic_publish(
        self, message: dict[str, Any], exchange: str, routing_key: str, **kwargs: Any
    ) -> None:
        """Publish: to the queue named ``routing_key`` on the default exchange, else to
        every queue the exchange routes it to, in one statement (all or none). See
        :meth:`Publisher.publish <kombu_pgmq.transport.publisher.Publisher.publish>`.

        Raises:
            Unroutable: ``mandatory=True`` and no binding matches.
            ConfigurationError: an ``x-delay`` or ETA PGMQ cannot take; a message over
                ``max_message_bytes``.
        """
        self._inplace_augment_message(message, exchange, routing_key)
        priority = self._get_message_priority(message)
        self.publisher.publish(message, exchange, routing_key, priority, **kwargs)

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self.publisher.put(queue, message, self._get_message_priority(message))

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
        self.reader.set_prefetch(int(prefetch_count or 0))

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        """Consume ``queue``: its messages go to ``callback`` (held for an ack unless
        ``no_ack``); registers the consumer (heartbeats keep auto_delete queues alive)."""
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self.reader.add_consumer(queue, callback, no_ack)
        self.connection.register_consumer(queue, consumer_tag)
        self._poller.on_consume(self.connection.topology.bands(queue).queues)
        return result

    def close(self) -> None:
        """Close the channel (kombu's: consumers cancelled, unacked messages restored).
        With ``confirm_publish=False`` first: the last unconfirmed publish's result is
        waited for, and the ones that failed are published again."""
        if not self.closed and not self.connection.options.confirm_publish:
            try:
                self.publisher.flush_unconfirmed()
            except errors.KombuPgmqError as exc:
                logger.error(
                    "closing: %d unconfirmed publish(es) failed and could not be published "
                    "again (%s); they are lost unless this connection publishes again",
                    len(self.connection.unconfirmed_failed),
                    exc,
                )
        super().close()

    def basic_cancel(self, consumer_tag: str) -> Any:
        """Stop the consumer ``consumer_tag``; its queue is dropped if it was auto_delete
        and this was its last consumer."""
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None:
            if queue not in self._active_queues:
                self.reader.remove_consumer(queue)
            if self.connection.release_consumer(queue, consumer_tag):
                self._known_queues.discard(pgmq_queue_name(queue))
            self._poller.on_cancel(self.connection.topology.bands(queue).queues)
        return result

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        """Get one message synchronously (``None`` if the queue has none ready)."""
        message = self.reader.read_one(queue, no_ack)
        if self.reader.lifetime(queue)[1] is not None:
            self.broker.declarations.touch_queue(queue)  # basic.get counts as use (x-expires)
        if message is not None and not no_ack:
            self.qos.append(message, message.delivery_tag)
            self.connection.keep_leases()
        return message

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        """Kombu's raw read: the payload of one message (``Empty`` if none is ready)."""
        message = self.reader.read_one(queue, self.reader.is_no_ack(queue))
        if message is None:
            raise Empty()
        return dict(message._raw)

    def recreate(self, queue: str) -> None:
        """Declare, bind and register again a queue this channel consumes but that is gone."""
        logger.warning(
            "queue %r was dropped while this process consumed it; declaring it again "
            "(with the arguments and bindings this channel gave it)",
            queue,
        )
        self._known_queues.discard(pgmq_queue_name(queue))
        self._new_queue(queue, **self._declared.get(queue, {}))
        for exchange, routing_key in self.publisher.bindings_made.get(queue, ()):
            self.broker.declarations.bind(exchange, routing_key, queue)
        for tag, consumed in self._tag_to_queue.items():
            if consumed == queue:
                self.connection.register_consumer(queue, tag)

    def _restore(self, message: Any) -> None:
        """Make one unacked message visible again (no copy is published; the delivery
        does not count toward ``max_deliveries``)."""
        self.broker.requeue([receipt(message.delivery_info)], 0, uncount=True)
