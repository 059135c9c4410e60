"""The publishing side of a :class:`~kombu_pgmq.transport.channel.Channel`: exchanges,
bindings and publish. Routing follows AMQP (:mod:`kombu_pgmq.transport._routing`); a
publish to an exchange reaches every bound queue in one statement, or none. The channel
keeps Kombu's API and hands these calls to its :class:`Publisher`."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import virtual

from .. import _encoding as encoding
from .. import errors, revocations
from .._db.broker import Broker
from .._naming import pgmq_queue_name
from .._stats import STATS
from ._delays import delay_seconds
from ._interfaces import ChannelView, TransportView
from ._routing import EXCHANGE_TYPES
from .options import TransportOptions

logger = logging.getLogger(__name__)

__all__ = ["DELAY_PROPERTY", "Publisher"]


#: Message property recording the delay a message was sent with (seconds): its
#: x-message-ttl / expiration count from when it became visible, not from the publish.
DELAY_PROPERTY = encoding.DELAY_PROPERTY


def _check_size(queue: str, body: str, headers: str, limit: int) -> None:
    """Refuse a message larger than ``max_message_bytes`` before anything is sent.

    Raises:
        ConfigurationError: too large (the message names the size, the queue and the fix).
    """
    if len(body) + len(headers) <= limit // 4:  # a character is at most 4 bytes in UTF-8
        return
    # ASCII text (isascii() reads a flag: no scan) is one byte a character
    size = len(body) if body.isascii() else len(body.encode("utf-8", "surrogatepass"))
    size += len(headers) if headers.isascii() else len(headers.encode("utf-8"))
    if size > limit:
        raise errors.ConfigurationError(
            f"message to {queue!r} is {size} bytes as stored, over the transport option "
            f"max_message_bytes={limit}: send a reference to the data instead (a table row, "
            "a file), or raise max_message_bytes (jsonb holds at most 255 MiB); nothing was sent"
        )


def _note_delay(message: dict[str, Any], lead_seconds: float) -> int:
    delay = delay_seconds(message, lead_seconds)
    if delay > 0:
        message.setdefault("properties", {})[DELAY_PROPERTY] = delay
    return delay


def _log_duplicates(queues: list[str]) -> None:
    logger.debug(
        "message not enqueued to PGMQ queue(s) %s: its deduplication id was published there "
        "within the deduplication window",
        ", ".join(queues),
    )


class Publisher:
    """Exchanges, bindings and publish of one channel (see the module docstring)."""

    def __init__(self, channel: ChannelView) -> None:
        self.channel = channel
        #: The connection's validated transport options.
        self.options: TransportOptions = channel.connection.options
        #: Kombu queue -> ``(exchange, routing key)`` this channel bound it with (to bind
        #: a consumed queue again if it is dropped under it).
        self.bindings_made: dict[str, set[tuple[str, str]]] = {}

    @property
    def connection(self) -> TransportView:
        """The channel's transport."""
        return self.channel.connection

    @property
    def broker(self) -> Broker:
        """Broker operations on the transport's statement connection."""
        return self.channel.broker

    # -- exchanges and bindings --------------------------------------------------------

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
            if self.broker.declarations.exchange_type(exchange) is None:
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
        try:
            stored = self.broker.declarations.declare_exchange(
                exchange, type, durable=bool(durable), auto_delete=bool(auto_delete)
            )
        except errors.PermissionDenied as exc:
            # a producer's role: a passive declaration of an exchange that exists
            found = self.broker.declarations.exchange_type(exchange)
            if found is None:
                raise errors.PermissionDenied(
                    f"exchange {exchange!r} does not exist and this role may not declare "
                    f"exchanges ({exc}); declare it once with a worker or the schema "
                    "owner's role"
                ) from exc
            stored = found
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
        self.broker.declarations.delete_exchange(exchange)

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
        self.channel.declare_queue(queue)
        try:
            self.broker.declarations.bind(exchange, routing_key or "", queue)
        except errors.PermissionDenied as exc:
            # a producer's role: a passive check of a binding that exists
            if not self.broker.declarations.binding_exists(exchange, routing_key or "", queue):
                raise errors.PermissionDenied(
                    f"queue {queue!r} is not bound to exchange {exchange!r} with routing key "
                    f"{routing_key!r} and this role may not bind ({exc}); bind it once with "
                    "a worker or the schema owner's role"
                ) from exc
        self.bindings_made.setdefault(queue, set()).add((exchange, routing_key or ""))

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        """Remove the binding in the database (every process routes without it from its
        next publish)."""
        if exchange:
            self.broker.declarations.unbind(exchange, routing_key or "", queue)
            self.bindings_made.get(queue, set()).discard((exchange, routing_key or ""))

    def list_bindings(self) -> Any:
        """Every binding as kombu's ``(queue, exchange, routing_key)`` rows (cached routes)."""
        return iter(self.connection.topology.routes().bindings())

    def get_table(self, exchange: str) -> list[tuple[str, str, str]]:
        """Bindings of ``exchange`` as kombu's ``(routing_key, pattern, queue)`` rows."""
        return [
            (routing_key, routing_key, queue)
            for queue, bound, routing_key in self.connection.topology.routes().bindings()
            if bound == exchange
        ]

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        """Kombu's exchange type object of ``exchange`` (as stored; ``default`` if unknown)."""
        return self.channel.exchange_types[
            self.connection.topology.routes().exchanges.get(exchange, default)
        ]

    def lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        """Kombu queues ``routing_key`` on ``exchange`` routes to (the default exchange:
        the queue named ``routing_key``)."""
        if not exchange:
            return [routing_key]
        return [
            queue for queue, _ in self.connection.topology.routes().route(exchange, routing_key)
        ]

    # -- publish ---------------------------------------------------------------------

    def publish(
        self,
        message: dict[str, Any],
        exchange: str,
        routing_key: str,
        priority: int = 0,
        **kwargs: Any,
    ) -> None:
        """Publish: to the queue named ``routing_key`` on the default exchange, else to
        every queue the exchange routes it to, in one statement (all or none).

        A message no binding matches is dropped with a debug log, as AMQP drops
        unroutable messages (or sent to kombu's ``deadletter_queue`` option, if set).

        Raises:
            Unroutable: ``mandatory=True`` and no binding matches (AMQP returns the
                message; nothing was sent).
            ConfigurationError: an ``x-delay`` or ETA PGMQ cannot take.
        """
        try:
            self._publish(message, exchange, routing_key, priority, **kwargs)
        except BaseException:
            STATS.publish_errors += 1
            raise
        STATS.publishes += 1

    def _publish(
        self,
        message: dict[str, Any],
        exchange: str,
        routing_key: str,
        priority: int,
        **kwargs: Any,
    ) -> None:
        if not exchange:
            return self.put(routing_key, message, priority)
        if exchange.endswith(".pidbox"):  # Celery's remote control: record revokes
            revoked = revocations.revoked_ids(message)
            if revoked:
                revocations.record(self.connection.broker_for_publish().db, revoked)
        delay = _note_delay(message, self.options.eta_lead_seconds)
        body, headers = encoding.encode(message)
        _check_size(exchange, body, headers, self.options.max_message_bytes)
        mandatory = bool(kwargs.get("mandatory"))
        try:
            self._publish_routed(exchange, routing_key, body, headers, priority, delay, mandatory)
        except errors.InvalidJsonBody:
            body, headers = encoding.reencode_opaque(body, headers)
            self._publish_routed(exchange, routing_key, body, headers, priority, delay, mandatory)
        return None

    def _publish_routed(
        self,
        exchange: str,
        routing_key: str,
        body: str,
        headers: str,
        priority: int = 0,
        delay: int = 0,
        mandatory: bool = False,
    ) -> None:
        transport = self.connection
        fresh = not transport.topology.routes_loaded  # routes (re)loaded during this publish
        for attempt in range(3):
            routes = transport.topology.routes()
            targets = routes.route(exchange, routing_key)
            if not targets:
                # Maybe bound since we loaded the table: a version check (one tiny query,
                # not a reload) decides. Celery's events take this path whenever no
                # monitor listens.
                if not fresh and self.broker.declarations.routing_version() != routes.version:
                    transport.topology.reload_routes()
                    fresh = True
                    continue
                if self.channel.deadletter_queue:
                    self._send_to(self.channel.deadletter_queue, body, headers, priority, delay)
                    return
                if mandatory:
                    raise errors.Unroutable(
                        f"message to exchange {exchange!r} with routing key {routing_key!r} "
                        "matched no binding and was published with mandatory=True: nothing "
                        "was sent; declare and bind a queue first"
                    )
                # Debug, not warning: Celery's events go unheard whenever no monitor runs.
                logger.debug(
                    "message to exchange %r with routing key %r matched no binding: dropped "
                    "(as AMQP does); declare and bind a queue first",
                    exchange,
                    routing_key,
                )
                return
            if priority:
                names = [
                    transport.topology.bands(queue).queue_for(priority) for queue, _ in targets
                ]
            else:
                names = [pgmq for _, pgmq in targets]
            # No deduplication id: the header is absent (a substring test, conservative)
            # and no target queue was declared with x-deduplicate-task-id (as of the
            # routes' version, which the statement checks).
            plain = '"x-deduplication-id"' not in headers and routes.deduplicated.isdisjoint(
                queue for queue, _ in targets
            )
            try:
                through = transport.broker_for_publish()
                version, msg_ids = through.send_routed(
                    names,
                    body,
                    headers,
                    version=routes.version,
                    delay_seconds=delay,
                    deduplication_window=self.options.deduplication_window,
                    deduplicated=not plain,
                    flush=self.options.confirm_publish or through is not self.broker,
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
                if None in msg_ids:
                    _log_duplicates(
                        [
                            name
                            for name, msg_id in zip(names, msg_ids, strict=False)
                            if msg_id is None
                        ]
                    )
                return
            transport.topology.reload_routes()
            fresh = True
        raise errors.StatementError(
            f"routing for exchange {exchange!r} kept changing while publishing; try again"
        )

    def put(self, queue: str, message: dict[str, Any], priority: int = 0) -> None:
        """Publish ``message`` to ``queue`` (the default exchange) at ``priority``."""
        delay = _note_delay(message, self.options.eta_lead_seconds)
        body, headers = encoding.encode(message)
        _check_size(queue, body, headers, self.options.max_message_bytes)
        self._send_to(queue, body, headers, priority, delay)

    def _send_to(
        self,
        queue: str,
        body: str,
        headers: str,
        priority: int = 0,
        delay: int = 0,
        *,
        confirm: bool | None = None,
    ) -> None:
        confirm = self.options.confirm_publish if confirm is None else confirm
        try:
            self._send(queue, body, headers, priority, delay, confirm)
        except errors.InvalidJsonBody:
            body, headers = encoding.reencode_opaque(body, headers)
            self._send(queue, body, headers, priority, delay, confirm)

    def _send(
        self, queue: str, body: str, headers: str, priority: int, delay: int, confirm: bool
    ) -> None:
        if priority:
            name = self.connection.topology.bands(queue).queue_for(priority)
        else:
            name = pgmq_queue_name(queue)
        window = self.options.deduplication_window
        # No deduplication id: the header is absent (a substring test, conservative) and
        # this channel declared the queue without x-deduplicate-task-id.
        plain = self.channel.plain(queue) and '"x-deduplication-id"' not in headers
        through = self.connection.broker_for_publish()
        if through is not self.broker and not self.channel.declared(queue):
            # In the application's transaction a failed statement aborts that transaction:
            # make sure the queue exists first (declared on our own connection).
            self.channel.declare_queue(queue)
            if priority:
                name = self.connection.topology.bands(queue).queue_for(priority)
        # in the application's transaction, its commit is the application's
        own = through is self.broker
        if (
            not confirm
            and plain
            and own
            and self._send_unconfirmed(queue, name, body, headers, priority, delay)
        ):
            return
        flush = confirm or not own
        try:
            msg_id = through.send(
                name,
                body,
                headers,
                delay,
                deduplication_window=window,
                deduplicated=not plain,
                flush=flush,
            )
        except errors.QueueNotFound:
            # Dropped by another process (or never declared): AMQP would drop the
            # message; we create the queue so nothing is lost.
            self.channel.forget_queue(queue)
            self.channel.declare_queue(queue)
            if priority:
                name = self.connection.topology.bands(queue).queue_for(priority)
            msg_id = through.send(
                name, body, headers, delay, deduplication_window=window, flush=flush
            )
        if msg_id is None:
            _log_duplicates([name])

    # -- unconfirmed publishes (confirm_publish=False) -----------------------------------

    def _send_unconfirmed(
        self, queue: str, name: str, body: str, headers: str, priority: int, delay: int
    ) -> bool:
        """Send without waiting for the server (:meth:`Broker.send_nowait`); a failure,
        read before the connection's next statement, puts the message on the transport's
        ``unconfirmed_failed`` list, and it is published again (confirmed) at once after
        the next publish or when the channel closes. False: not sent this way (the caller
        publishes it confirmed)."""
        failed = self.connection.unconfirmed_failed

        def keep(error: errors.KombuPgmqError) -> None:
            logger.warning(
                "an unconfirmed publish to %r failed (%s): publishing it again", queue, error
            )
            failed.append((queue, body, headers, priority, delay))

        try:
            sent = self.broker.send_nowait(name, body, headers, delay, on_error=keep)
        except errors.QueueNotFound:
            sent = False  # the confirmed path declares the queue again
        self.republish_failed()
        return sent

    def republish_failed(self) -> None:
        """Publish again, confirmed, the messages whose unconfirmed publish failed (at
        least once: a message whose connection was lost before its result came back may
        have been written, and is then delivered twice).

        Raises:
            KombuPgmqError: a publish failed again (the message stays on the list).
        """
        failed = self.connection.unconfirmed_failed
        while failed:
            queue, body, headers, priority, delay = failed[0]
            self._send_to(queue, body, headers, priority, delay, confirm=True)
            failed.pop(0)

    def flush_unconfirmed(self) -> None:
        """Wait for the result of an unconfirmed publish still in flight, and publish
        again what failed (the channel is closing)."""
        broker = self.connection.broker_if_connected()
        if broker is not None:
            with contextlib.suppress(errors.BrokerConnectionError):  # on the list already
                broker.db.collect()
        self.republish_failed()
