"""The Kombu transport: :class:`Transport`, :class:`Channel` and :class:`QoS` (user
documentation: :mod:`kombu_pgmq.transport`)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from collections import defaultdict
from collections.abc import Sequence
from itertools import count
from queue import Empty
from time import monotonic, sleep
from typing import Any

import psycopg
from kombu.exceptions import ChannelError
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments
from kombu.utils.objects import cached_property

from .. import _conninfo as conninfo
from .. import _encoding as encoding
from .. import _priorities as priorities
from .. import errors
from .._db.client import PgmqClient, Row
from .._naming import pgmq_queue_name
from .._priorities import Bands
from ..schema import ensure_schema, verify
from ._delays import delay_seconds
from ._leases import LeaseKeeper, held_by
from ._maintenance import Maintainer
from ._routing import EXCHANGE_TYPES, Routes
from ._wakeups import Wakeups

logger = logging.getLogger(__name__)

__all__ = ["Channel", "QoS", "Transport"]

#: Seconds between reconnection attempts of a consumer in Celery's event loop.
RECONNECT_SECONDS = 1.0


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


def _expired(payload: dict[str, Any], row: Row, ttl_seconds: float | None) -> bool:
    """x-message-ttl of the queue, or the message's own ``expiration`` (ms), has passed."""
    if ttl_seconds is not None and row.age_seconds > ttl_seconds:
        return True
    expiration = payload["properties"].get("expiration")
    if expiration is None:
        return False
    try:
        return row.age_seconds > float(expiration) / 1000.0
    except (TypeError, ValueError):
        return False


class QoS(virtual.QoS):
    """Prefetch bookkeeping; acks archive, rejects requeue or dead-letter in PGMQ."""

    channel: Channel

    def _locate(self, delivery_tag: Any) -> tuple[str, int, str]:
        info = self._delivered[delivery_tag].delivery_info
        return info["pgmq_queue"], info["pgmq_msg_id"], info["kombu_queue"]

    def ack(self, delivery_tag: Any) -> None:
        """Archive the message: at once, or batched with others (see
        :meth:`Transport.defer_ack`: inside ``drain_events`` and in Celery's event
        loop)."""
        queue, msg_id, _ = self._locate(delivery_tag)
        transport = self.channel.connection
        if transport.defers_acks:
            super().ack(delivery_tag)
            transport.defer_ack(queue, msg_id)
        else:
            self.channel.pgmq.archive(queue, [msg_id], durable=transport.durable_acks)
            super().ack(delivery_tag)
            transport.wake()  # a prefetch slot is free: read now

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        queue, msg_id, kombu_queue = self._locate(delivery_tag)
        with self.channel.connection.leases.lock:
            if requeue:
                self.channel.pgmq.set_vt(queue, [msg_id], 0)
            else:
                self.channel._dead_letter(kombu_queue, queue, [msg_id], "rejected")
            self._quick_ack(delivery_tag)
        self.channel.connection.wake(requeued=queue if requeue else None)

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """Make every unacked message visible again (one ``set_vt`` per queue); batched
        acks are archived first."""
        self._flush()
        transport = self.channel.connection
        if transport is not None:
            transport.flush_acks()
            with transport.leases.lock:  # no renewal round may extend them afterwards
                return self._requeue_unacked()
        return self._requeue_unacked()

    def _requeue_unacked(self) -> list[tuple[BaseException, Any]]:
        by_queue: dict[str, list[Any]] = defaultdict(list)
        for message in self._delivered.values():
            by_queue[message.delivery_info["pgmq_queue"]].append(message)
        self._delivered.clear()
        for queue, messages in by_queue.items():
            ids = [m.delivery_info["pgmq_msg_id"] for m in messages]
            try:
                self.channel.pgmq.set_vt(queue, ids, 0)
            except errors.KombuPgmqError as exc:
                # Not lost: they become visible anyway when their visibility timeout ends.
                logger.warning(
                    "could not requeue %d unacked messages of %s (%s); they are delivered "
                    "again after the visibility timeout",
                    len(ids),
                    queue,
                    exc,
                )
        return []  # nothing is lost on failure: the visibility timeout restores it


class Channel(virtual.Channel):
    """One Kombu channel; all channels of a connection share its PostgreSQL connection."""

    QoS = QoS
    connection: Transport

    #: Bodies are stored by :mod:`kombu_pgmq._encoding` (JSON as JSON), not base64'd by
    #: Kombu. The ``body_encoding`` transport option still applies if set.
    body_encoding = None  # type: ignore[assignment]

    #: Seconds a delivered, unacked message stays invisible before redelivery, unless
    #: its lease is renewed (see :mod:`kombu_pgmq.transport._leases`).
    visibility_timeout: float = 30
    #: Deliveries after which a message is dead-lettered (None: unlimited).
    max_deliveries: int | None = None
    #: Kombu name of the dead-letter queue.
    dead_letter_queue: str = "kombu_pgmq_dlq"
    #: Most messages read in one round trip.
    read_batch_size: int = 100
    #: Floors of the priority bands of queues declared with x-max-priority (None: one
    #: band per priority level); see :mod:`kombu_pgmq._priorities`.
    priority_steps: Any = None
    #: Seconds before its ETA that a Celery task becomes visible (native delayed
    #: delivery); see :mod:`kombu_pgmq.transport._delays`.
    eta_lead_seconds: float = 2.0

    from_transport_options = (  # type: ignore[assignment]
        *virtual.Channel.from_transport_options,
        "visibility_timeout",
        "max_deliveries",
        "dead_letter_queue",
        "read_batch_size",
        "priority_steps",
        "eta_lead_seconds",
    )

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self._validate_options()
        self._tags = count(1)
        self._turns = count()
        self._no_ack_queues: set[str] = set()
        self._vt_seconds = max(1, round(float(self.visibility_timeout)))
        self._known_queues: set[str] = set()
        self._message_ttl: dict[str, int | None] = {}
        # What this channel declared and bound, to recreate a consumed queue that was
        # dropped under it (by an operator, or reaped after a long database outage).
        self._declared: dict[str, dict[str, Any]] = {}
        self._bound: dict[str, set[tuple[str, str]]] = {}
        # Connects now (and bootstraps the schema once per process), so connection
        # errors surface at channel creation as kombu expects.
        self.connection.pgmq_client()

    def _validate_options(self) -> None:
        def bad(name: str, value: Any, want: str) -> errors.ConfigurationError:
            return errors.ConfigurationError(
                f"transport option {name}={value!r} is invalid: expected {want}"
            )

        try:
            vt = float(self.visibility_timeout)
        except (TypeError, ValueError):
            vt = -1.0
        if vt < 1:
            raise bad("visibility_timeout", self.visibility_timeout, "seconds >= 1")
        md = self.max_deliveries
        if md is not None and (not isinstance(md, int) or isinstance(md, bool) or md < 1):
            raise bad("max_deliveries", md, "an int >= 1, or None for unlimited")
        rb = self.read_batch_size
        if not isinstance(rb, int) or isinstance(rb, bool) or rb < 1:
            raise bad("read_batch_size", rb, "an int >= 1")
        if not isinstance(self.dead_letter_queue, str) or not self.dead_letter_queue:
            raise bad("dead_letter_queue", self.dead_letter_queue, "a queue name")
        self.priority_steps = priorities.validate_steps(self.priority_steps)
        lead = self.eta_lead_seconds
        if isinstance(lead, bool) or not isinstance(lead, int | float) or lead < 0:
            raise bad("eta_lead_seconds", lead, "seconds >= 0")

    @property
    def pgmq(self) -> PgmqClient:
        """The connection's :class:`~kombu_pgmq._db.client.PgmqClient`."""
        return self.connection.pgmq_client()

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
        bands = priorities.make_bands(queue, max_priority, self.priority_steps)
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
        )
        self._message_ttl[queue] = info.message_ttl_ms
        self.connection.set_bands(queue, priorities.stored(name, info.floors, info.band_queues))
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
        self.pgmq.drop_queue(name, queue)  # every band with it
        self.connection.forget_bands(queue)

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> None:
        """Delete the queue, its archive, bindings and consumers (also if declared by
        another process)."""
        if if_empty and self._size(queue):
            return
        self._delete(queue)

    # -- exchanges and bindings (kombu_pgmq.transport._routing) ----------------------------------

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
        """Declare an exchange in the database, visible to every process.

        Raises:
            ChannelError: ``passive`` and the exchange does not exist (404, as AMQP).
            NotEquivalentError: it exists with another type.
            ConfigurationError: ``type`` is not direct, topic or fanout.
        """
        if not exchange:
            return
        if passive:
            if self.pgmq.exchange_type(exchange) is None:
                raise ChannelError(
                    f"NOT_FOUND - no exchange {exchange!r} in vhost {self._vhost()!r}",
                    (50, 10),
                    "Channel.exchange_declare",
                    "404",
                )
            return
        if type not in EXCHANGE_TYPES:
            raise errors.ConfigurationError(
                f"exchange {exchange!r} has type {type!r}: kombu_pgmq routes "
                f"{', '.join(sorted(EXCHANGE_TYPES))}"
            )
        stored = self.pgmq.declare_exchange(
            exchange, type, durable=bool(durable), auto_delete=bool(auto_delete)
        )
        if stored != type:
            raise virtual.NotEquivalentError(
                f"Cannot redeclare exchange {exchange!r} in vhost {self._vhost()!r} with "
                f"different type {type!r}: it is {stored!r}"
            )

    def _vhost(self) -> str:
        client: Any = self.connection.client
        return str(client.virtual_host or "/")

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        """Delete the exchange and its bindings (queues stay)."""
        self.pgmq.delete_exchange(exchange)

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        """Bind in the database: every process routes by it from its next publish."""
        if not exchange:
            return  # the default exchange routes by queue name, no binding needed
        self._new_queue(queue)
        self.pgmq.bind(exchange, routing_key or "", queue)
        self._bound.setdefault(queue, set()).add((exchange, routing_key or ""))

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        if exchange:
            self.pgmq.unbind(exchange, routing_key or "", queue)
            self._bound.get(queue, set()).discard((exchange, routing_key or ""))

    def list_bindings(self) -> Any:
        return iter(self.connection.routes().bindings())

    def get_table(self, exchange: str) -> list[tuple[str, str, str]]:
        """Bindings of ``exchange`` as kombu's ``(routing_key, pattern, queue)`` rows."""
        return [
            (routing_key, routing_key, queue)
            for queue, bound, routing_key in self.connection.routes().bindings()
            if bound == exchange
        ]

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        return self.exchange_types[self.connection.routes().exchanges.get(exchange, default)]

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        if not exchange:
            return [routing_key]
        return [queue for queue, _ in self.connection.routes().route(exchange, routing_key)]

    # -- publish ---------------------------------------------------------------------

    def basic_publish(
        self, message: dict[str, Any], exchange: str, routing_key: str, **kwargs: Any
    ) -> None:
        """Publish: to the queue named ``routing_key`` on the default exchange, else to
        every queue the exchange routes it to, in one statement (all or none).

        A message no binding matches is dropped with a warning, as AMQP drops unroutable
        messages (or sent to kombu's ``deadletter_queue`` option, if set).
        """
        self._inplace_augment_message(message, exchange, routing_key)
        if not exchange:
            return self._put(routing_key, message, **kwargs)
        body, headers = encoding.encode(message)
        priority = self._get_message_priority(message)
        delay = delay_seconds(message, self.eta_lead_seconds)
        try:
            self._publish_routed(exchange, routing_key, body, headers, priority, delay)
        except errors.InvalidJsonBody:
            body, headers = encoding.reencode_opaque(body, headers)
            self._publish_routed(exchange, routing_key, body, headers, priority, delay)
        return None

    def _publish_routed(
        self,
        exchange: str,
        routing_key: str,
        body: str,
        headers: str,
        priority: int = 0,
        delay: int = 0,
    ) -> None:
        transport = self.connection
        fresh = transport._routes is None  # routes (re)loaded during this publish
        for attempt in range(3):
            routes = transport.routes()
            targets = routes.route(exchange, routing_key)
            if not targets:
                # Maybe bound since we loaded the table: a version check (one tiny query,
                # not a reload) decides. Celery's events take this path whenever no
                # monitor listens.
                if not fresh and self.pgmq.routing_version() != routes.version:
                    transport.reload_routes()
                    fresh = True
                    continue
                if self.deadletter_queue:
                    self._send_to(self.deadletter_queue, body, headers, priority, delay)
                    return
                # Debug, not warning: Celery's events go unheard whenever no monitor runs.
                logger.debug(
                    "message to exchange %r with routing key %r matched no binding: dropped "
                    "(as AMQP does); declare and bind a queue first",
                    exchange,
                    routing_key,
                )
                return
            if priority:
                names = [transport.bands(queue).queue_for(priority) for queue, _ in targets]
            else:
                names = [pgmq for _, pgmq in targets]
            try:
                version, _ = self.pgmq.send_routed(
                    names, body, headers, version=routes.version, delay_seconds=delay
                )
            except errors.QueueNotFound as exc:
                # A bound queue was dropped meanwhile (its bindings normally go with it):
                # nothing was sent. Reload and retry; if the route still names a missing
                # queue, its PGMQ table was dropped behind kombu_pgmq's back.
                if attempt == 2:
                    raise errors.QueueNotFound(
                        f"exchange {exchange!r} routes {routing_key!r} to a queue whose PGMQ "
                        f"table is gone ({exc}); nothing was published: delete that queue "
                        "(queue_delete) or declare it again"
                    ) from exc
                version = -1
            if version == routes.version:
                return
            transport.reload_routes()
            fresh = True
        raise errors.OperationalError(
            f"routing for exchange {exchange!r} kept changing while publishing; try again"
        )

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        body, headers = encoding.encode(message)
        priority = self._get_message_priority(message)
        self._send_to(queue, body, headers, priority, delay_seconds(message, self.eta_lead_seconds))

    def _send_to(
        self, queue: str, body: str, headers: str, priority: int = 0, delay: int = 0
    ) -> None:
        try:
            self._send(queue, body, headers, priority, delay)
        except errors.InvalidJsonBody:
            body, headers = encoding.reencode_opaque(body, headers)
            self._send(queue, body, headers, priority, delay)

    def _send(self, queue: str, body: str, headers: str, priority: int, delay: int) -> None:
        if priority:
            name = self.connection.bands(queue).queue_for(priority)
        else:
            name = pgmq_queue_name(queue)
        try:
            self.pgmq.send(name, body, headers, delay)
        except errors.QueueNotFound:
            # Dropped by another process (or never declared): AMQP would drop the
            # message; we create the queue so nothing is lost.
            self._known_queues.discard(pgmq_queue_name(queue))
            self.connection.forget_bands(queue)
            self._new_queue(queue)
            if priority:
                name = self.connection.bands(queue).queue_for(priority)
            self.pgmq.send(name, body, headers, delay)

    # -- consume ---------------------------------------------------------------------

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        if no_ack:
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self.connection.register_consumer(queue, consumer_tag)
        self.connection.on_consume(self.connection.bands(queue).queues)
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None:
            if queue not in self._active_queues:
                self._no_ack_queues.discard(queue)
            if self.connection.release_consumer(queue, consumer_tag):
                self._known_queues.discard(pgmq_queue_name(queue))
            self.connection.on_cancel(self.connection.bands(queue).queues)
        return result

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        """Get one message synchronously (``None`` if the queue has none ready)."""
        payloads = self._fetch(queue, 1, no_ack=no_ack)
        if not payloads:
            return None
        message = self.Message(payloads[0], channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
            self.connection.keep_leases()
        return message

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        payloads = self._fetch(queue, 1, no_ack=queue in self._no_ack_queues)
        if not payloads:
            raise Empty()
        return payloads[0]

    def _consume(
        self, only: set[str] | None, acks: list[tuple[str, int]]
    ) -> tuple[int, set[str], set[str], bool]:
        """Read up to the free prefetch from the consumed queues (those in ``only``, PGMQ
        names; None: all) in one round trip, archiving ``acks`` in the same transaction,
        and deliver each message to its consumer.

        Returns ``(delivered, drained, full, acks_sent)``: PGMQ names of queues found
        empty, and of queues that filled the read (may hold more); ``acks_sent`` is
        False when ``acks`` were not archived (the caller archives them).
        """
        queues = self._active_queues
        if not queues:
            return 0, set(), set(), False
        free = self.qos.can_consume_max_estimate()
        remaining = self.read_batch_size if free is None else min(free, self.read_batch_size)
        if remaining <= 0:
            return 0, set(), set(), False
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
            for name in names:
                if remaining > 0:
                    account(queue, name, self._rows(queue, name, remaining, no_ack=True), True)
        acks_sent = False
        if acked and remaining > 0:
            try:
                durable = self.connection.durable_acks
                pairs = self.pgmq.read_many(
                    [name for _, name in acked],
                    self._vt_seconds,
                    remaining,
                    acks,
                    durable_acks=durable,
                )
                acks_sent = True
            except errors.QueueNotFound:
                pairs = None  # one is gone: go queue by queue (recreates it)
            if pairs is None:
                for queue, name in acked:
                    if remaining > 0:
                        account(queue, name, self._rows(queue, name, remaining), False)
            else:
                by_name: dict[str, list[Row]] = defaultdict(list)
                for name, row in pairs:
                    by_name[name].append(row)
                for queue, name in acked:
                    if remaining > 0:
                        account(queue, name, by_name.get(name, []), False)
        deliveries = [
            (payload, queue)
            for queue, name, rows, no_ack in batches
            for payload in self._to_payloads(queue, name, rows, no_ack=no_ack)
        ]
        deliver = self.connection._deliver
        for index, (payload, queue) in enumerate(deliveries):
            try:
                deliver(payload, queue)
            except BaseException:
                self._release([p for p, _ in deliveries[index + 1 :]])
                raise
        return len(deliveries), drained, full, acks_sent

    def _release(self, payloads: list[dict[str, Any]]) -> None:
        """Make read but undelivered messages visible again (a callback failed)."""
        by_queue: dict[str, list[int]] = defaultdict(list)
        for payload in payloads:
            info = payload["properties"]["delivery_info"]
            by_queue[info["pgmq_queue"]].append(info["pgmq_msg_id"])
        for name, ids in by_queue.items():
            self.pgmq.set_vt(name, ids, 0)

    def _fetch(self, queue: str, qty: int, *, no_ack: bool) -> list[dict[str, Any]]:
        """Read up to ``qty`` messages of one queue, priority bands highest first (all
        bands in one round trip, unless popping)."""
        names = self.connection.bands(queue).read_order
        if len(names) > 1 and not no_ack:
            try:
                pairs = self.pgmq.read_many(names, self._vt_seconds, qty)
            except errors.QueueNotFound:
                pass  # one is gone: band by band below (recreates a consumed queue)
            else:
                by_name: dict[str, list[Row]] = defaultdict(list)
                for name, row in pairs:
                    by_name[name].append(row)
                return [
                    payload
                    for name in names
                    for payload in self._to_payloads(queue, name, by_name[name], no_ack)
                ]
        payloads: list[dict[str, Any]] = []
        for name in names:
            if qty <= 0:
                break
            rows = self._rows(queue, name, qty, no_ack)
            qty -= len(rows)
            payloads += self._to_payloads(queue, name, rows, no_ack)
        return payloads

    def _rows(self, queue: str, name: str, qty: int, no_ack: bool = False) -> list[Row]:
        """Read (or pop, for no_ack) up to ``qty`` rows of one queue; a consumed queue
        found dropped is declared again (and yields nothing this time)."""
        try:
            if no_ack:
                return self.pgmq.pop(name, qty)
            return self.pgmq.read(name, self._vt_seconds, qty)
        except errors.QueueNotFound:
            if queue in self._active_queues:
                self._recreate(queue)
            return []

    def _to_payloads(
        self, queue: str, name: str, rows: list[Row], no_ack: bool
    ) -> list[dict[str, Any]]:
        """Rows -> Kombu payloads: poison messages dead-lettered, expired ones deleted."""
        if self.max_deliveries is not None and not no_ack:
            rows = self._drop_poison(queue, name, rows)
        payloads = [self._payload(queue, name, row) for row in rows]
        ttl = self._queue_ttl_seconds(queue)
        expired = [p for p, row in zip(payloads, rows, strict=True) if _expired(p, row, ttl)]
        if expired:
            if not no_ack:
                self.pgmq.delete(
                    name, [p["properties"]["delivery_info"]["pgmq_msg_id"] for p in expired]
                )
            gone = {id(p) for p in expired}
            payloads = [p for p in payloads if id(p) not in gone]
        return payloads

    def _queue_ttl_seconds(self, queue: str) -> float | None:
        if queue not in self._message_ttl:
            self._message_ttl[queue] = self.pgmq.message_ttl_ms(queue)
        ttl = self._message_ttl[queue]
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

    def _drop_poison(self, queue: str, name: str, rows: list[Row]) -> list[Row]:
        limit = self.max_deliveries
        assert limit is not None
        poison = [row.msg_id for row in rows if row.read_ct > limit]
        if not poison:
            return rows
        self._dead_letter(queue, name, poison, "max_deliveries")
        return [row for row in rows if row.read_ct <= limit]

    def _payload(self, queue: str, name: str, row: Row) -> dict[str, Any]:
        payload = encoding.decode(row.message, row.headers)
        props = payload["properties"]
        props["delivery_tag"] = next(self._tags)
        info = props["delivery_info"]
        info["redelivered"] = row.read_ct > 1
        info["pgmq_queue"] = name
        info["pgmq_msg_id"] = row.msg_id
        info["pgmq_read_ct"] = row.read_ct
        info["kombu_queue"] = queue
        info.setdefault("routing_key", queue)
        info.setdefault("exchange", "")
        return payload

    def _dead_letter(self, kombu_queue: str, name: str, msg_ids: list[int], reason: str) -> None:
        dlq_kombu = self.dead_letter_queue
        dlq = pgmq_queue_name(dlq_kombu)
        kwargs = {"dead_letter_queue": dlq, "reason": reason, "kombu_queue": kombu_queue}
        try:
            moved = self.pgmq.dead_letter(name, msg_ids, **kwargs)
        except errors.QueueNotFound:
            self._new_queue(dlq_kombu)
            moved = self.pgmq.dead_letter(name, msg_ids, **kwargs)
        logger.warning(
            "dead-lettered %d message(s) of queue %r to %r (reason: %s)",
            len(moved),
            kombu_queue,
            dlq_kombu,
            reason,
        )

    def _restore(self, message: Any) -> None:
        """Make one unacked message visible again (no copy is published)."""
        info = message.delivery_info
        self.pgmq.set_vt(info["pgmq_queue"], [info["pgmq_msg_id"]], 0)


class Transport(virtual.Transport):
    """Kombu transport on PostgreSQL/PGMQ. See the module docstring for options."""

    Channel = Channel

    #: We parse the URL ourselves: libpq parameters in the query string must survive.
    can_parse_url = True
    default_port = 5432  # type: ignore[assignment]
    driver_type = "postgresql"
    driver_name = "psycopg"
    #: Seconds between fallback polls of every consumed queue (messages that become
    #: visible without a publish: visibility timeout expiry, delayed sends). New
    #: messages wake consumers at once through LISTEN/NOTIFY.
    polling_interval = 1.0
    #: Consecutive full reads of a queue after which this connection stops waiting on
    #: it (a backlog: publishers stop notifying until it is drained again).
    busy_after_full_reads = 3

    connection_errors = (  # type: ignore[assignment]
        *virtual.Transport.connection_errors,
        errors.BrokerConnectionError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
    )
    channel_errors = (  # type: ignore[assignment]
        *virtual.Transport.channel_errors,
        errors.OperationalError,
    )

    implements = virtual.Transport.implements.extend(
        asynchronous=True,  # Celery runs its event loop: see register_with_event_loop
        exchange_type=frozenset(["direct", "topic", "fanout"]),
    )

    #: Seconds between heartbeats of this connection's consumers (keeps auto_delete and
    #: x-expires queues alive) and runs of the reaper that drops abandoned ones.
    consumer_heartbeat_interval: float = 10.0
    #: A consumer without a heartbeat for this many seconds counts as gone.
    consumer_stale_after: float = 30.0
    #: Dead row versions in a consumed queue's table after which the heartbeat thread
    #: VACUUMs it (0: never; leave it to autovacuum).
    vacuum_threshold: int = 20_000

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self._client: PgmqClient | None = None
        self._routes: Routes | None = None
        #: Identifies this connection's consumers in kombu_pgmq.consumers.
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._consumers: set[tuple[str, str]] = set()
        # Wake-ups and polling state (PGMQ queue names).
        self._wakeups: Wakeups | None = None
        self._ready: set[str] = set()  # may hold visible messages: read when prefetch allows
        self._waiting: set[str] = set()  # our row is in kombu_pgmq.waiting: publishers notify
        self._full_reads: dict[str, int] = {}  # consecutive reads that filled the request
        self._next_fallback = 0.0
        self._acks: list[tuple[str, int]] = []  # acked, not yet archived
        self._acks_lock = threading.Lock()
        self._draining = 0
        self._hub: Any = None
        self._hub_fds: list[int] = []
        self._hub_listener = (-1, -1)  # (fd, generation) of the LISTEN socket watched
        self._hub_timer: Any = None
        self._bands: dict[str, Bands] = {}  # Kombu queue -> priority bands, as stored
        self._connection_lost_at: float | None = None
        self._retry_pending = False  # a reconnection attempt is scheduled in the event loop
        options = client.transport_options
        self.leases = LeaseKeeper(
            lambda: self._client,
            lambda: held_by(self.channels),
            self._still_held,
            self._lease_renewal_interval(options),
        )
        for name in ("consumer_heartbeat_interval", "consumer_stale_after"):
            if name in options:
                try:
                    value = float(options[name])
                except (TypeError, ValueError):
                    value = -1.0
                if value <= 0:
                    raise errors.ConfigurationError(
                        f"transport option {name}={options[name]!r} is invalid: "
                        "expected seconds > 0"
                    )
                setattr(self, name, value)
        self.install_schema = bool(client.transport_options.get("install_schema", True))
        threshold = options.get("vacuum_threshold", self.vacuum_threshold)
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise errors.ConfigurationError(
                f"transport option vacuum_threshold={threshold!r} is invalid: expected a "
                "number of dead tuples >= 0 (0: never vacuum, leave it to autovacuum)"
            )
        self.vacuum_threshold = threshold
        durable_acks = options.get("durable_acks", False)
        if not isinstance(durable_acks, bool):
            raise errors.ConfigurationError(
                f"transport option durable_acks={durable_acks!r} is invalid: expected True or False"
            )
        #: Commit acks synchronously. False (default): a server crash may forget the last
        #: acks, and those messages are delivered again; publishes always commit
        #: synchronously, so no message is lost either way.
        self.durable_acks = durable_acks
        #: Heartbeats, reaper and VACUUM of the consumed queue tables (a thread).
        self.maintainer = Maintainer(
            client=lambda: self._client,
            owner=self.owner,
            interval_seconds=self.consumer_heartbeat_interval,
            consuming=lambda: bool(self._consumers),
            consumed_tables=lambda: sorted(
                {n for queue, _ in self._consumers for n in self.known_bands(queue).queues}
            ),
            reap=self.reap,
            conninfo=self.conninfo,
            vacuum_threshold=self.vacuum_threshold,
        )

    def __repr__(self) -> str:
        return f"<kombu_pgmq.Transport {conninfo.redact(self._url)}>"

    @staticmethod
    def _lease_renewal_interval(options: dict[str, Any]) -> float:
        try:
            vt = float(options.get("visibility_timeout", Channel.visibility_timeout))
        except (TypeError, ValueError):
            return 0.0  # the channel reports the bad visibility_timeout
        value = options.get("lease_renewal_interval")
        if value is None:
            return vt / 3.0
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < vt:
            raise errors.ConfigurationError(
                f"transport option lease_renewal_interval={value!r} is invalid: expected "
                f"seconds below visibility_timeout ({vt:g}), e.g. {vt / 3:g}; 0 turns lease "
                "renewal off"
            )
        return float(value)

    # -- leases (transport._leases) ---------------------------------------------------------

    def keep_leases(self) -> None:
        """Start renewing the leases of held messages (idempotent; see
        :mod:`kombu_pgmq.transport._leases`)."""
        self.leases.start()

    def _still_held(self, queue: str, msg_id: int) -> bool:
        return any(h.queue == queue and h.msg_id == msg_id for h in held_by(self.channels))

    # -- priority bands (kombu_pgmq._priorities) ------------------------------------------

    def bands(self, queue: str) -> Bands:
        """Priority bands of Kombu queue ``queue`` as stored in the database (cached; a
        queue without x-max-priority, or unknown yet, has one band: its PGMQ queue)."""
        bands = self._bands.get(queue)
        if bands is None:
            name = pgmq_queue_name(queue)
            info = self.pgmq_client().queue_info(queue)
            if info is None:  # not declared yet: ask again next time
                return priorities.single(name)
            bands = self._bands[queue] = priorities.stored(name, info.floors, info.band_queues)
        return bands

    def known_bands(self, queue: str) -> Bands:
        """:meth:`bands` as cached, without a query (for threads that must not reopen a
        closed connection)."""
        return self._bands.get(queue) or priorities.single(pgmq_queue_name(queue))

    def set_bands(self, queue: str, bands: Bands) -> None:
        self._bands[queue] = bands

    def forget_bands(self, queue: str) -> None:
        self._bands.pop(queue, None)

    @cached_property
    def _url(self) -> str:
        client: Any = self.client
        host = client.hostname or ""
        if "://" in host:
            return str(host)
        parts = ["postgresql://"]
        if client.userid:
            parts.append(client.userid)
            if client.password:
                parts.append(":**")
            parts.append("@")
        parts.append(f"{host or 'localhost'}:{client.port or self.default_port}")
        parts.append(f"/{client.virtual_host or ''}".replace("//", "/"))
        return "".join(parts)

    def conninfo(self) -> str:
        """Return the libpq connection string for this connection (holds the password)."""
        client: Any = self.client
        host = client.hostname or ""
        if "://" in host:
            params = conninfo.url_to_params(host)
        else:
            params = {
                "host": host or "localhost",
                "port": str(client.port or self.default_port),
                "user": client.userid,
                "password": client.password,
                "dbname": (client.virtual_host or "").strip("/") or None,
            }
            if params["dbname"] is None:
                params.pop("dbname")
        params.update(client.transport_options.get("connection_options") or {})
        return conninfo.make_dsn(params)

    def pgmq_client(self) -> PgmqClient:
        """Return the connection's PGMQ client, connecting (and bootstrapping) if needed."""
        client = self._client
        if client is None:
            dsn = self.conninfo()
            client = PgmqClient(dsn)
            client.connection  # noqa: B018 - connect now: errors surface here
            try:
                if self.install_schema:
                    ensure_schema(client, dsn)
                else:
                    verify(client)
            except BaseException:
                client.close()
                raise
            self._client = client
            try:
                self.reap(client)
            except errors.KombuPgmqError as exc:
                logger.warning("reaping abandoned queues failed: %s", exc)
        return client

    # -- routing -------------------------------------------------------------------------

    def routes(self) -> Routes:
        """The cached routing table (loaded on first use; see :mod:`._routing`)."""
        routes = self._routes
        if routes is None:
            routes = self.reload_routes()
        return routes

    def reload_routes(self) -> Routes:
        table = self.pgmq_client().routing_table()
        for queue, (floors, queues) in table.bands.items():
            self._bands[queue] = priorities.stored(pgmq_queue_name(queue), floors, queues)
        routes = self._routes = Routes(table)
        return routes

    # -- consumers and queue lifetime ---------------------------------------------------

    def register_consumer(self, queue: str, consumer_tag: str) -> None:
        """Record a consumer (its heartbeats keep auto_delete/x-expires queues alive)."""
        self.pgmq_client().register_consumer(
            queue, self.owner, consumer_tag, stale_after_seconds=self.consumer_stale_after
        )
        self._consumers.add((queue, consumer_tag))
        self.keep_leases()
        self.maintainer.start()

    def release_consumer(self, queue: str, consumer_tag: str) -> bool:
        """Forget a consumer; True if that auto-deleted its queue."""
        self._consumers.discard((queue, consumer_tag))
        client = self._client
        if client is None:
            return False
        try:
            return client.release_consumer(queue, self.owner, consumer_tag)
        except errors.KombuPgmqError as exc:
            logger.warning("could not release consumer of %r (%s); it goes stale", queue, exc)
            return False

    def reap(self, client: PgmqClient | None = None) -> list[str]:
        """Drop queues whose consumers are gone (auto_delete) or unused too long (x-expires).

        Runs on connect and in each consuming process's heartbeat thread; call it on an
        established connection (``conn.connect()``). Returns the Kombu names dropped.
        """
        dropped = (client or self.pgmq_client()).reap()
        if dropped:
            logger.info("dropped %d abandoned queue(s): %s", len(dropped), ", ".join(dropped))
        return dropped

    # -- wake-ups, polling and acks ------------------------------------------------------

    def _get_wakeups(self) -> Wakeups:
        wakeups = self._wakeups
        if wakeups is None:
            wakeups = self._wakeups = Wakeups(self.conninfo())
        return wakeups

    def on_consume(self, names: Sequence[str]) -> None:
        """A channel consumes PGMQ queues ``names`` (a queue's priority bands): LISTEN for
        them and read them now."""
        wakeups = self._get_wakeups()
        wakeups.listen(names)
        wakeups.fileno()  # connected and LISTENing from now on
        self._ready.update(names)
        wakeups.wake()

    def on_cancel(self, names: Sequence[str]) -> None:
        """A consumer of PGMQ queues ``names`` was cancelled: stop listening to those no
        consumer is left for."""
        consumed = self._consumed()
        for name in names:
            if name in consumed:
                continue
            self._ready.discard(name)
            self._full_reads.pop(name, None)
            if self._wakeups is not None:
                self._wakeups.unlisten([name])
            if name in self._waiting:
                self._waiting.discard(name)
                client = self._client
                if client is not None:
                    # the reaper removes the row with our consumers
                    with contextlib.suppress(errors.KombuPgmqError):
                        client.stop_waiting(self.owner, [name])

    def _consumed(self) -> set[str]:
        """PGMQ queues (every priority band) of the queues consumed now."""
        return {
            name for c in self.channels for q in c._active_queues for name in self.bands(q).queues
        }

    def wake(self, requeued: str | None = None) -> None:
        """End the current wait of :meth:`drain_events` (or run a poll in Celery's event
        loop) now; safe from any thread.

        Called when an ack or reject frees a prefetch slot (often from another thread,
        e.g. Celery's pool result handler), so the next read does not wait for a poll.
        ``requeued``: a PGMQ queue a message was just made visible in (read it too).
        """
        if requeued is not None:
            self._ready.add(requeued)
        wakeups = self._wakeups
        if wakeups is not None:
            wakeups.wake()

    @property
    def defers_acks(self) -> bool:
        """True while acks are batched: inside :meth:`drain_events` (archived before it
        returns) and once registered with Celery's event loop (archived at the loop's
        next turn, with the next read)."""
        return self._draining > 0 or self._hub is not None

    def defer_ack(self, queue: str, msg_id: int) -> None:
        """Queue an ack for the next read or flush (one statement for many).

        At least once: until it is archived, the message stays in its queue table,
        invisible; if the process dies first it is delivered again after its visibility
        timeout.
        """
        with self._acks_lock:
            self._acks.append((queue, msg_id))
        self.wake()

    def _take_acks(self) -> list[tuple[str, int]]:
        with self._acks_lock:
            acks, self._acks = self._acks, []
        return acks

    def _requeue_acks(self, acks: list[tuple[str, int]]) -> None:
        with self._acks_lock:
            self._acks[:0] = acks

    def _connection_lost(self, exc: BaseException) -> None:
        """The statement connection was lost in the event loop: keep every held message
        (leases renew once reconnected) and retry at the next fallback poll, instead of
        making Celery restart its consumer (which would requeue the running tasks)."""
        if self._connection_lost_at is None:
            self._connection_lost_at = monotonic()
            logger.warning(
                "database connection lost (%s); reconnecting every %.1f s, held messages are kept",
                exc,
                self.polling_interval,
            )
        self._waiting.clear()  # recorded again as queues are found empty
        with contextlib.suppress(errors.KombuPgmqError):
            self._ready |= self._consumed()
        if self._hub is not None and not self._retry_pending:
            # retry soon, not at the next fallback poll only; one timer at a time
            self._retry_pending = True
            self._hub.call_later(RECONNECT_SECONDS, self._on_hub_retry)

    def _on_hub_retry(self) -> None:
        self._retry_pending = False
        self._on_hub_fallback()

    def _connection_ok(self) -> None:
        if self._connection_lost_at is not None:
            logger.warning(
                "database connection re-established after %.1f s",
                monotonic() - self._connection_lost_at,
            )
            self._connection_lost_at = None

    def flush_acks(self) -> None:
        """Archive the batched acks now (one ``pgmq.archive`` per queue)."""
        acks = self._take_acks()
        if acks:
            self._archive(acks)

    def _archive(self, acks: list[tuple[str, int]]) -> None:
        by_queue: dict[str, list[int]] = defaultdict(list)
        for queue, msg_id in acks:
            by_queue[queue].append(msg_id)
        client = self.pgmq_client()
        for queue, ids in by_queue.items():
            # dropped with its messages: nothing left to ack
            with contextlib.suppress(errors.QueueNotFound):
                client.archive(queue, ids, durable=self.durable_acks)

    def _note_wakeups(self, wakeups: Wakeups) -> None:
        """Mark notified queues ready; every consumed queue when the fallback poll is due
        or notifications may have been missed."""
        notified = wakeups.collect()
        now = monotonic()
        if notified is None:
            # A new LISTEN connection: the database may have restarted and forgotten our
            # waiting rows; record them again as queues are found empty.
            self._waiting.clear()
        if notified is None or now >= self._next_fallback:
            self._next_fallback = now + self.polling_interval
            self._ready |= self._consumed()
        else:
            self._ready |= notified

    def _poll(self) -> tuple[int, bool]:
        """One round: read the ready queues of every channel (batched acks ride along)
        and deliver. Returns ``(delivered, again)``; ``again`` asks for another round at
        once (queues that just went to sleep get their final read, see migration 0003).
        """
        acks = self._take_acks()
        delivered = 0
        drained: set[str] = set()
        full: set[str] = set()
        ready = set(self._ready)
        try:
            for channel in list(self.channels):
                if not channel._active_queues or not ready:
                    continue
                n, empty, filled, sent = channel._consume(ready, acks)
                if sent:
                    acks = []
                delivered += n
                drained |= empty
                full |= filled
        finally:
            if acks:
                try:
                    self._archive(acks)
                except errors.BrokerConnectionError:
                    self._requeue_acks(acks)  # archived at the next round instead
                    raise
        self._ready -= drained
        self._ready |= full
        to_wait = drained - self._waiting
        to_busy = []
        for name in drained:
            self._full_reads.pop(name, None)
        for name in full:
            streak = self._full_reads[name] = self._full_reads.get(name, 0) + 1
            if streak >= self.busy_after_full_reads and name in self._waiting:
                to_busy.append(name)
        client = self.pgmq_client() if to_busy or to_wait else None
        if to_busy:
            assert client is not None
            # A backlog: publishers stop notifying (their commits would serialize).
            client.stop_waiting(self.owner, sorted(to_busy))
            self._waiting.difference_update(to_busy)
        if to_wait:
            assert client is not None
            self._get_wakeups().fileno()  # LISTEN before publishers can see us waiting
            client.wait_for(self.owner, sorted(to_wait))
            self._waiting |= to_wait
            self._ready |= to_wait  # the final read, after wait_for committed
        if full and self._hub is not None:
            self.wake()  # more may wait: read again after the loop's other work
        return delivered, bool(to_wait)

    def drain_events(  # type: ignore[override]
        self, connection: Any, timeout: float | None = None
    ) -> None:
        """Deliver messages from the consumed queues; raise ``TimeoutError`` if none came
        within ``timeout`` seconds.

        Sleeps on the LISTEN connection: woken by a publish to a consumed queue, by
        :meth:`wake` (an ack freed a prefetch slot), or by the fallback poll every
        ``polling_interval`` seconds. Acks made by the callbacks are archived in one
        statement per queue before this returns.

        Raises:
            TimeoutError: nothing was delivered within ``timeout`` seconds.
            ConfigurationError: nothing is consumed and ``timeout`` is None (it would
                wait forever; kombu's virtual transports would sleep without end).
        """
        start = monotonic()
        wakeups = self._wakeups
        if wakeups is None:  # nothing consumed
            if timeout is None:
                raise errors.ConfigurationError(
                    "drain_events() without a consumer would wait forever: "
                    "start a Consumer first, or give a timeout"
                )
            sleep(timeout)
            raise TimeoutError()
        self._draining += 1
        retried = False
        try:
            while True:
                try:
                    self._note_wakeups(wakeups)
                    if self._ready or self._acks:
                        delivered, again = self._poll()
                        self._connection_ok()
                        if delivered:
                            return
                        if again:
                            continue
                except errors.BrokerConnectionError as exc:
                    # A dropped connection (server restart, pg_terminate_backend): the
                    # next statement reconnects. Retry once; raise if that fails too.
                    if retried:
                        raise
                    retried = True
                    self._connection_lost(exc)
                    continue
                now = monotonic()
                if timeout is not None and now - start >= timeout:
                    raise TimeoutError()
                wait = self._next_fallback - now
                if timeout is not None:
                    wait = min(wait, timeout - (now - start))
                if wait > 0:
                    wakeups.wait(wait)
        finally:
            self._draining -= 1
            if not self._draining and self._hub is None:
                self.flush_acks()

    # -- Celery's event loop (asynloop) ---------------------------------------------------

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """Run consumers in Celery's event loop: readers on the LISTEN socket and the wake
        pipe, a fallback poll every ``polling_interval`` seconds. Acks are batched from
        here on (archived at the loop's next turn, with the next read)."""
        self._unregister_from_event_loop()  # registered twice: the last loop wins
        self._hub = loop
        wakeups = self._get_wakeups()
        self._hub_fds = [wakeups.wake_fileno]
        self._hub_listener = (-1, -1)
        loop.add_reader(wakeups.wake_fileno, self._on_hub_event)
        self._watch_listener(wakeups)
        self._hub_timer = loop.call_repeatedly(self.polling_interval, self._on_hub_fallback)
        loop.call_soon(self._on_hub_event)

    def _watch_listener(self, wakeups: Wakeups) -> None:
        fd = wakeups.fileno()  # connects (and LISTENs) after a lost connection
        if (fd, wakeups.generation) != self._hub_listener:
            for old in self._hub_fds[1:]:
                with contextlib.suppress(Exception):  # closed with the lost connection
                    self._hub.remove_reader(old)
            self._hub_fds[1:] = [fd]
            self._hub_listener = (fd, wakeups.generation)
            self._hub.add_reader(fd, self._on_hub_event)

    def _on_hub_fallback(self) -> None:
        self._next_fallback = 0.0
        self._on_hub_event()

    def _on_hub_event(self) -> None:
        wakeups = self._wakeups
        if wakeups is None or self._hub is None:
            return
        try:
            self._note_wakeups(wakeups)
            self._watch_listener(wakeups)
            for _ in range(2):  # a round, and the final read of queues that went to sleep
                if not (self._ready or self._acks):
                    break
                _, again = self._poll()
                if not again:
                    break
        except errors.BrokerConnectionError as exc:
            self._connection_lost(exc)  # the fallback poll retries
        else:
            self._connection_ok()

    def _unregister_from_event_loop(self) -> None:
        hub, self._hub = self._hub, None
        if hub is None:
            return
        for fd in self._hub_fds:
            with contextlib.suppress(Exception):  # the loop may be closing too
                hub.remove_reader(fd)
        self._hub_fds = []
        if self._hub_timer is not None:
            self._hub_timer.cancel()
            self._hub_timer = None

    def establish_connection(self) -> Transport:
        self.pgmq_client()
        try:
            return super().establish_connection()  # creates a first channel
        except BaseException:
            # kombu never calls close_connection for a connection it did not get.
            self._close_client()
            raise

    def _close_client(self) -> None:
        self.maintainer.stop()
        self.leases.stop()
        self._unregister_from_event_loop()
        client, self._client = self._client, None
        if client is not None:
            try:
                self._flush_on_close(client)
            finally:
                client.close()
        wakeups, self._wakeups = self._wakeups, None
        if wakeups is not None:
            wakeups.close()

    def _flush_on_close(self, client: PgmqClient) -> None:
        acks = self._take_acks()
        try:
            if acks:
                self._archive(acks)
            if self._waiting:
                client.stop_waiting(self.owner)
        except errors.KombuPgmqError as exc:
            logger.warning("closing: %s (unarchived acks are delivered again)", exc)
        self._waiting.clear()

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)
        finally:
            self._close_client()

    def verify_connection(self, connection: Any) -> bool:
        return self._client is not None and self._client.connection is not None

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"port": self.default_port, "hostname": "localhost"}
