"""The thin :class:`Transport`: one Kombu connection, its PostgreSQL connections (one per
concern) and what its channels share. User documentation: :mod:`kombu_pgmq.transport`.

Connections of a transport, each used by one concern only:

* statements: the channels' (declare, publish, read, ack), :meth:`Transport.broker`;
* LISTEN: the poller's (:class:`~kombu_pgmq.transport._listener.Listener`), once it consumes
  (to ``direct_url`` behind a transaction pooler; none without it: consumers poll);
* lease renewal: :class:`~kombu_pgmq.transport._leases.LeaseKeeper`'s, while it holds messages;
* heartbeats/reaper: :class:`~kombu_pgmq.transport._maintenance.Maintainer`'s, once it
  consumes (plus a short-lived one per VACUUM).

Each is named by its role in ``pg_stat_activity`` (``application_name`` ``kombu_pgmq:statements``,
``:listener``, ``:leases``, ``:heartbeat``, ``:vacuum``); ``docs/connections.md`` counts them
per Celery pool type.

Fork safety: after ``fork()`` the child's transport forgets the parent's state (consumers,
held messages, batched acks, waiting rows) without sending anything, abandons the parent's
connections (see :mod:`kombu_pgmq._db.connector`), and opens its own on first use; kombu's
``ConnectionPool(close_after_fork=True)`` collects it through :meth:`Transport._collect`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
import weakref
from typing import Any

import psycopg
from kombu.transport import virtual
from kombu.utils.objects import cached_property

from .. import _conninfo as conninfo
from .. import errors
from .._db.broker import Broker
from .._db.connector import Connector
from .._db.consumers import Consumers
from .._db.pooling import mark_pooled
from .._db.positions import ReadPositions
from ..schema import ensure_schema, verify
from ._binding import BINDING_OPTION, current_binding
from ._leases import LeaseKeeper, held_by
from ._maintenance import Maintainer
from .channel import Channel
from .options import TransportOptions
from .poller import Poller
from .topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["Transport"]

_TRANSPORTS: weakref.WeakSet[Transport] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for transport in list(_TRANSPORTS):
        with contextlib.suppress(Exception):
            transport._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Transport(virtual.Transport):
    """Kombu transport on PostgreSQL/PGMQ. See :mod:`kombu_pgmq.transport` for options."""

    Channel = Channel

    #: We parse the URL ourselves: libpq parameters in the query string must survive.
    can_parse_url = True
    default_port = 5432  # type: ignore[assignment]
    driver_type = "postgresql"
    driver_name = "psycopg"

    connection_errors = (  # type: ignore[assignment]
        *virtual.Transport.connection_errors,
        errors.BrokerConnectionError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
    )
    channel_errors = (  # type: ignore[assignment]
        *virtual.Transport.channel_errors,
        errors.StatementError,
    )

    implements = virtual.Transport.implements.extend(
        asynchronous=True,  # Celery runs its event loop: see register_with_event_loop
        exchange_type=frozenset(["direct", "topic", "fanout"]),
    )

    def __init__(self, client: Any, **kwargs: Any) -> None:
        #: The validated transport options (parsed once, here).
        self.options = TransportOptions.parse(
            {k: v for k, v in client.transport_options.items() if k != BINDING_OPTION}
        )
        super().__init__(client, **kwargs)
        self.polling_interval = self.options.polling_interval
        #: An application's connection publishes go through (:func:`kombu_pgmq.using`).
        self.binding: Any = client.transport_options.get(BINDING_OPTION)
        #: libpq connection string of the broker database (holds the password).
        self.dsn = self.binding.dsn if self.binding is not None else self._make_dsn(client)
        #: libpq string LISTEN connects to: ``dsn``; behind a transaction pooler
        #: (``pooler="transaction"``) ``direct_url``'s, or None (consumers poll).
        self.listen_dsn: str | None = self.dsn
        if self.options.pooler == "transaction" and self.binding is None:
            # every connector to it: no session state (prepared statements only if the
            # pooler keeps them)
            mark_pooled(self.dsn, prepared=self.options.pooler_prepared_statements)
            direct = self.options.direct_url
            self.listen_dsn = None if direct is None else self._direct_dsn(direct)
        self._pid = os.getpid()
        self._statements: Connector | None = None
        self._broker: Broker | None = None  # operations on _statements
        #: Unconfirmed publishes (``confirm_publish=False``) the server refused or whose
        #: connection was lost: ``(queue, body, headers, priority, delay)``, published again.
        self.unconfirmed_failed: list[tuple[str, str, str, int, int]] = []
        #: Priority bands, FIFO queues and the routing table, as stored (cached).
        self.topology = Topology(self.broker)
        #: Identifies this connection's consumers in kombu_pgmq.consumers.
        self.owner = self._new_owner()
        self._consumers: set[tuple[str, str]] = set()
        self._consumers_lock = threading.Lock()
        #: Lease renewal of held messages (a thread and a connection of its own).
        self.leases = LeaseKeeper(
            self.dsn,
            lambda: held_by(self.channels),
            self._still_held,
            self.options.renewal_interval_seconds,
        )
        #: Event-loop I/O: wake-ups, polling rounds, batched acks.
        self.poller = Poller(
            self.options,
            self.topology,
            listen_dsn=self.listen_dsn,
            readers=lambda: [channel.reader for channel in self.channels],
            broker=self.broker,
            broker_if_connected=self.broker_if_connected,
            owner=lambda: self.owner,
            slots=self.leases.slots,
        )
        #: Heartbeats, reaper and VACUUM of consumed tables (a thread and a connection).
        self.maintainer = Maintainer(
            self.dsn,
            owner=lambda: self.owner,
            interval_seconds=self.options.consumer_heartbeat_interval,
            consumed_tables=self._consumed_tables,
            vacuum_threshold=self.options.vacuum_threshold,
            positions=self._read_positions,
            found_below=self.poller.found_below,
        )
        _TRANSPORTS.add(self)

    def __repr__(self) -> str:
        return f"<kombu_pgmq.Transport {conninfo.redact(self._url)}>"

    @staticmethod
    def _new_owner() -> str:
        return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"

    def _make_dsn(self, client: Any) -> str:
        host = client.hostname or ""
        alternates = [u for u in getattr(client, "alt", None) or () if isinstance(u, str)]
        if len(alternates) > 1 and all("://" in u for u in alternates):
            # kombu's failover list (url1;url2): one libpq multi-host connection string
            # (libpq tries the hosts in order on every connect, the primary wins with
            # target_session_attrs=read-write). kombu's own switching is turned off for
            # this connection: Connection.switch cannot carry libpq query parameters.
            params = conninfo.failover_params(alternates)
            client.cycle = None
        elif "://" in host:
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
        params.update(self.options.connection_options)
        return conninfo.make_dsn(params)

    def _direct_dsn(self, url: str) -> str:
        """libpq string of ``direct_url`` (with ``connection_options``).

        Raises:
            ConfigurationError: it is the broker URL itself (the pooler's).
        """
        params = conninfo.url_to_params(url)
        params.update(self.options.connection_options)
        dsn = conninfo.make_dsn(params)
        if dsn == self.dsn:
            raise errors.ConfigurationError(
                f"transport option direct_url={conninfo.redact(url)!r} is the broker URL "
                "itself: give the PostgreSQL server's URL, not the pooler's"
            )
        return dsn

    # -- the statement connection -------------------------------------------------------

    def broker(self) -> Broker:
        """Broker operations on the channels' statement connection (connecting, and
        bootstrapping the schema once per process, if needed).

        Raises:
            BrokerConnectionError: the server cannot be reached.
            BootstrapError, UnsupportedPgmqVersion: the schema cannot be installed.
        """
        self._check_fork()
        broker = self._broker
        if broker is not None:
            return broker
        connector = self._statements
        fresh = False
        if connector is None and self.binding is not None:
            # A bound connection (kombu_pgmq.using) declares through the process's shared
            # connection to that database: no connection of its own, no reaper run.
            connector = self._statements = self.binding.statements()
        if connector is None:
            connector = Connector(self.dsn, role="statements", lz4=True)
            try:
                connector.connection  # noqa: B018 - connect now: errors surface here
                if self.options.install_schema:
                    ensure_schema(connector, self.dsn)
                else:
                    verify(connector)
            except BaseException:
                connector.close()
                raise
            self._statements = connector
            fresh = True
        broker = Broker(connector)
        broker.visible_before_flush = self.options.visible_before_flush
        if fresh:
            try:
                self.reap(broker.consumers)
            except errors.PermissionDenied:
                logger.debug("not reaping abandoned queues: this role is not a worker")
            except errors.KombuPgmqError as exc:
                logger.warning("reaping abandoned queues failed: %s", exc)
        self._broker = broker
        return broker

    def broker_for_publish(self) -> Broker:
        """The broker this transport's publishes go through: on the application's
        connection of a bound connection or of the innermost ``with
        kombu_pgmq.using(conn):`` block (:mod:`kombu_pgmq.transactional`), else
        :meth:`broker` (the statement connection)."""
        if self.binding is not None:
            return self.binding.broker
        binding = current_binding()
        if binding is not None:
            return binding.broker_for(self)
        return self.broker()

    def _read_positions(self) -> ReadPositions | None:
        """The read positions of this connection's reads (None: not connected)."""
        broker = self.broker_if_connected()
        return None if broker is None else broker.positions

    def broker_if_connected(self) -> Broker | None:
        """:meth:`broker` without connecting (None when closed): for cleanup paths."""
        return self._broker if self._pid == os.getpid() else None

    # -- leases (transport._leases) ---------------------------------------------------------

    def keep_leases(self) -> None:
        """Start renewing the leases of held messages (idempotent)."""
        self.leases.start()

    def _still_held(self, queue: str, msg_id: int) -> bool:
        return any(h.queue == queue and h.msg_id == msg_id for h in held_by(self.channels))

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

    # -- consumers and queue lifetime ---------------------------------------------------

    def register_consumer(self, queue: str, consumer_tag: str) -> None:
        """Record a consumer (its heartbeats keep auto_delete/x-expires queues alive)."""
        self.broker().consumers.register_consumer(
            queue, self.owner, consumer_tag, stale_after_seconds=self.options.consumer_stale_after
        )
        with self._consumers_lock:
            self._consumers.add((queue, consumer_tag))
        self.keep_leases()
        self.maintainer.start()

    def release_consumer(self, queue: str, consumer_tag: str) -> bool:
        """Forget a consumer; True if that auto-deleted its queue."""
        with self._consumers_lock:
            if (queue, consumer_tag) not in self._consumers:
                return False  # not ours (e.g. a parent's, in a forked child)
            self._consumers.discard((queue, consumer_tag))
        broker = self.broker_if_connected()
        if broker is None:
            return False
        try:
            return broker.consumers.release_consumer(queue, self.owner, consumer_tag)
        except errors.KombuPgmqError as exc:
            logger.warning("could not release consumer of %r (%s); it goes stale", queue, exc)
            return False

    def consumers(self) -> frozenset[tuple[str, str]]:
        """``(queue, consumer_tag)`` of this connection's consumers (a snapshot, safe
        from any thread)."""
        with self._consumers_lock:
            return frozenset(self._consumers)

    def _consumed_tables(self) -> list[str]:
        """PGMQ tables of the consumed queues, every band (for the heartbeat thread: uses
        cached bands only, never a query)."""
        return sorted(
            {n for queue, _ in self.consumers() for n in self.topology.known_bands(queue).queues}
        )

    def reap(self, consumers: Consumers | None = None) -> list[str]:
        """Drop queues whose consumers are gone (auto_delete) or unused too long (x-expires).

        Runs on connect and in each consuming process's heartbeat thread; a queue whose
        tables are locked by an open transaction is skipped until the next run. Returns
        the Kombu names dropped.
        """
        dropped = (consumers or self.broker().consumers).reap()
        if dropped:
            logger.info("dropped %d abandoned queue(s): %s", len(dropped), ", ".join(dropped))
        return dropped

    # -- wake-ups, polling and acks (poller.py) ------------------------------------------

    def drain_events(  # type: ignore[override]
        self, connection: Any, timeout: float | None = None
    ) -> None:
        """Deliver messages from the consumed queues; raise ``TimeoutError`` if none came
        within ``timeout`` seconds.

        Sleeps on the LISTEN connection: woken by a publish to a consumed queue, by an ack
        that freed a prefetch slot, or by the fallback poll every ``polling_interval``
        seconds. Acks made by the callbacks are archived in one statement per queue
        before this returns.

        Raises:
            TimeoutError: nothing was delivered within ``timeout`` seconds.
            ConfigurationError: nothing is consumed and ``timeout`` is None (it would
                wait forever; kombu's virtual transports would sleep without end).
            BrokerConnectionError: the connection was lost and a retry failed too.
        """
        self._check_fork()
        self.poller.drain_events(timeout)

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """Run consumers in Celery's event loop: readers on the LISTEN socket and the wake
        pipe, a fallback poll every ``polling_interval`` seconds. Acks are sent from
        ``ack()`` from here on (see :meth:`Poller.defer_ack
        <kombu_pgmq.transport.poller.Poller.defer_ack>`)."""
        self._check_fork()
        self.poller.register_with_event_loop(loop)

    # -- connection lifetime -----------------------------------------------------------

    def establish_connection(self) -> Transport:
        self.broker()
        try:
            return super().establish_connection()  # creates a first channel
        except BaseException:
            # kombu never calls close_connection for a connection it did not get.
            self._close_all()
            raise

    def close_connection(self, connection: Any) -> None:
        if self._pid != os.getpid():
            self._collect(connection)  # a parent's connection: let go, send nothing
            return
        try:
            super().close_connection(connection)
        finally:
            self._close_all()

    def _close_all(self) -> None:
        """Stop the services, flush acks and waiting rows on the statement connection,
        then close every connection (none is reopened on the way)."""
        self.maintainer.close()
        self.leases.close()
        statements, broker = self._statements, self.broker_if_connected()
        try:
            self.poller.close(broker)
        finally:
            self._statements = self._broker = None
            if statements is not None and self.binding is None:  # a bound one's is shared
                statements.close()

    def _collect(self, connection: Any) -> None:
        """kombu's fast close after fork (``ConnectionPool(close_after_fork=True)``): in a
        forked child, let go of everything without a word to the server; in the process
        that opened it, a normal close."""
        if self._pid == os.getpid():
            with contextlib.suppress(errors.KombuPgmqError):
                self.close_connection(connection)
            return
        self._after_fork()
        for channel in list(self.channels):
            channel.closed = True  # nothing to restore or cancel: it was the parent's
        self.channels = []
        self._avail_channels = []

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._after_fork()

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's consumers, held messages, acks and
        waiting rows (they are the parent's to settle) and its connections (abandoned,
        never closed); this process gets its own on first use."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self.owner = self._new_owner()
        self._consumers_lock = threading.Lock()
        self._consumers = set()
        self.unconfirmed_failed = []  # the parent's to publish again
        statements, self._statements, self._broker = self._statements, None, None
        if statements is not None:
            statements.close()  # abandons: nothing is sent
        self.poller.after_fork()
        self.leases.after_fork()
        self.maintainer.after_fork()
        for channel in list(self.channels):
            channel.forget_held()

    def verify_connection(self, connection: Any) -> bool:
        return self._statements is not None and self._statements.connected

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"port": self.default_port, "hostname": "localhost"}
