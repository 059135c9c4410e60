"""Enqueue inside the application's own transaction: the transactional outbox, with no
relay.

:func:`using` binds publishes to a connection the application has open, so a task is
written **in the application's transaction**: workers see it when that transaction
commits, never if it rolls back (or if the savepoint around it does), and kombu_pgmq
never commits it::

    with transaction.atomic():                                   # Django
        order = Order.objects.create(total=42)
        confirm.apply_async((order.id,), connection=kombu_pgmq.using(connection))

    with Session(engine) as session, session.begin():            # SQLAlchemy
        session.add(order)
        confirm.apply_async((order.id,), connection=kombu_pgmq.using(session))

    with psycopg.connect(url) as conn, conn.transaction():       # psycopg 3
        conn.execute("INSERT INTO orders ...")
        confirm.apply_async((17,), connection=kombu_pgmq.using(conn))

:func:`using` returns a Kombu :class:`~kombu.Connection`: give it to ``apply_async`` /
``send_task`` as ``connection=``, or make a producer of it (``producer=using(c).Producer()``,
what ``group``/``chain``/``chord.apply_async(producer=...)`` take). As a context manager
it binds **every** kombu_pgmq publish of the block (this thread or asyncio task) to the
connection, including the ones Celery makes on its own (a chord's ``chord_unlock``):

    with transaction.atomic(), kombu_pgmq.using(connection):
        chord(header)(callback)

Accepted connections: a psycopg 3 ``Connection``; a SQLAlchemy ``Session`` or
``Connection`` on the psycopg driver (``postgresql+psycopg://``); a Django connection
(``django.db.connection``, ``ENGINE`` ``django.db.backends.postgresql`` with psycopg 3).

The connection must be to the broker's database, and both forms check it before anything
is written (a :class:`~kombu_pgmq.errors.ConfigurationError` naming both databases):
the context manager against the broker of the transport that publishes; ``using(conn)``
as ``connection=``/``producer=`` against ``broker_url=`` if given, else the current
Celery app's broker (``broker_write_url``/``broker_url``: a broker that is not
kombu_pgmq's is refused too, its workers would never see the message). Without either
(plain kombu, or a Celery app not set as current and no ``broker_url=``), ``conn``'s
database is the broker. Checked once per application connection: one query on it, and
the broker's database looked up once per process.

What runs where: the message (and its deduplication claim, and the NOTIFY that wakes a
waiting consumer, which PostgreSQL delivers at commit) is written on the application's
connection. Declarations (Celery declares a task queue before its first publish) and the
routing table go through a connection of kombu_pgmq's own, one per process and database,
so that no row of kombu_pgmq's tables stays locked by the application's transaction: an
open application transaction never blocks a consumer's reads, lease renewals or start.
An application connection made with ``prepare_threshold=None`` (through PgBouncer in
transaction mode) makes that connection of kombu_pgmq's run in pooled mode too
(:mod:`kombu_pgmq._db.pooling`). A failure on the application's connection raises
:class:`~kombu_pgmq.errors.TransactionError` and is never retried (the transaction is
aborted; roll it back and repeat it).
"""

from __future__ import annotations

import atexit
import contextvars
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psycopg
from kombu import Connection

from . import errors
from ._conninfo import is_ours, redact
from ._db.batch import BatchedPublisher
from ._db.broker import Broker
from ._db.connector import Connector
from ._db.external import ExternalConnector
from ._db.pooling import mark_pooled
from .schema import ensure_schema
from .transport._binding import BINDING_OPTION, CURRENT_BINDING, current_binding
from .transport.transport import Transport

__all__ = [
    "BINDING_OPTION",
    "Binding",
    "BoundConnection",
    "BoundTransport",
    "current_binding",
    "using",
]
# One statement connection per process and database for bound publishes' declarations.
_SHARED: dict[tuple[int, str], Connector] = {}
_SHARED_LOCK = threading.Lock()
_BOUND: weakref.WeakKeyDictionary[psycopg.Connection[Any], BoundConnection] = (
    weakref.WeakKeyDictionary()
)
# Per process: which database each broker connection string reaches (database_identity).
_BROKER_DATABASES: dict[tuple[int, str], Any] = {}


@atexit.register
def _close_shared() -> None:
    for key, connector in list(_SHARED.items()):
        if key[0] == os.getpid():
            connector.close()
    _SHARED.clear()


class Binding:
    """An application's psycopg connection that publishes go through.

    Attributes:
        connection: the application's psycopg 3 connection (held weakly).
        dsn: libpq connection string of its database (its password included), for
            kombu_pgmq's own statement connection.
    """

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        # Weak: a binding (cached per connection) must not keep the connection alive.
        self._ref = weakref.ref(connection)
        info = connection.info
        params = {k: v for k, v in info.get_parameters().items() if k != "hostaddr"}
        if info.password:
            params["password"] = info.password
        params.setdefault("application_name", "kombu_pgmq")
        self.dsn = psycopg.conninfo.make_conninfo("", **params)
        if connection.prepare_threshold is None:
            # No prepared statements: the application reaches its database through a
            # transaction pooler, so does kombu_pgmq's own connection to it.
            mark_pooled(self.dsn)
        #: The application's connection as a connector: statements run in its transaction.
        self.external = ExternalConnector(connection)
        #: The broker a publish through this binding goes through: on ``external``, or
        #: the batch of :meth:`batched` inside its block.
        self.broker: Broker = Broker(self.external)
        self._database: Any = None
        self._same: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._same_broker: dict[str, bool] = {}

    def __repr__(self) -> str:
        return f"<kombu_pgmq.Binding {redact(self.dsn)}>"

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """The application's connection.

        Raises:
            ConfigurationError: it was garbage-collected.
        """
        conn = self._ref()
        if conn is None:
            raise errors.ConfigurationError("kombu_pgmq.using(): the connection is gone")
        return conn

    def statements(self) -> Connector:
        """kombu_pgmq's own connection to the same database (shared by the process),
        the schema checked once."""
        key = (os.getpid(), self.dsn)
        connector = _SHARED.get(key)
        if connector is None:
            with _SHARED_LOCK:
                connector = _SHARED.get(key)
                if connector is None:
                    connector = Connector(self.dsn, role="bound-statements")
                    ensure_schema(connector, self.dsn)
                    _SHARED[key] = connector
        return connector

    def database(self) -> Any:
        """``(name, server start)`` of the application connection's database (one query,
        the first time)."""
        if self._database is None:
            self._database = self.broker.database_identity()
        return self._database

    def broker_for(self, transport: Any) -> Broker:
        """The broker a transport's publish inside ``with using(conn):`` goes through
        (:attr:`broker`).

        Raises:
            ConfigurationError: the application's connection is to another database
                than the transport's broker (checked once per transport).
        """
        same = self._same.get(transport)
        broker: Any = None
        if same is None:
            broker = transport.broker().database_identity()
            same = self._same[transport] = broker == self.database()
        if not same:
            self._refuse(
                transport.dsn, broker, "the publishing connection's", "or publish outside the block"
            )
        return self.broker

    @contextmanager
    def batched(self) -> Iterator[BatchedPublisher]:
        """Publishes through this binding inside the block are recorded, then sent in one
        statement when the block ends without an error (still in the application's
        transaction; see :mod:`kombu_pgmq._db.batch`). A beat tick of many entries
        publishes this way.

        Raises (at the end of the block):
            StatementError: the routing table changed meanwhile (nothing was sent).
        """
        previous = self.broker
        batch = BatchedPublisher(previous)
        self.broker = batch
        try:
            yield batch
        finally:
            self.broker = previous
        batch.flush()

    def check_broker(self, broker_dsn: str, source: str) -> None:
        """Refuse to publish for a broker (libpq string ``broker_dsn``, from ``source``)
        in another database than the application's connection: before anything is
        written, once per broker (the broker's database is looked up once per process,
        on a short connection of its own, and again if it seems to differ: the server
        may have restarted since).

        Raises:
            ConfigurationError: another database.
            BrokerConnectionError: the broker cannot be reached.
        """
        if not self.in_database_of(broker_dsn):
            self._refuse(
                broker_dsn,
                _broker_database(broker_dsn),
                source,
                "or name the task's broker with using(conn, broker_url=...)",
            )

    def in_database_of(self, dsn: str) -> bool:
        """Whether the application's connection is to the database libpq string ``dsn``
        names (looked up once per ``dsn`` and process, on a short connection of its own,
        and again if it seems to differ: the server may have restarted since).

        Raises:
            BrokerConnectionError: that database cannot be reached.
        """
        same = self._same_broker.get(dsn)
        if same is None:
            mine = self.database()
            same = _broker_database(dsn) == mine or _broker_database(dsn, fresh=True) == mine
            self._same_broker[dsn] = same
        return same

    def _refuse(self, broker_dsn: str, broker: Any, source: str, fix: str) -> None:
        theirs = f"database {broker[0]!r} " if broker is not None else ""
        raise errors.ConfigurationError(
            f"kombu_pgmq.using(): the application's connection is to database "
            f"{self.database()[0]!r} ({redact(self.dsn)}), the broker ({source}) to another "
            f"one, {theirs}({redact(broker_dsn)}): nothing was written. Bind a connection "
            f"to the broker's database, {fix}"
        )


class BoundTransport(Transport):
    """The transport of :func:`kombu_pgmq.using`'s connections: publishes only, on the
    application's connection. Nothing it does is retried by kombu (a failed statement
    aborted the application's transaction; another try in it would fail too)."""

    recoverable_connection_errors = ()
    recoverable_channel_errors = ()

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        if self.binding is None:
            raise errors.ConfigurationError(
                "BoundTransport is made by kombu_pgmq.using(conn), not by a broker URL"
            )
        url = getattr(client, "broker_url", None)
        #: libpq string of the broker the publishes are for (None: the binding's database).
        self.broker_dsn = self._make_dsn(Connection(url)) if url else None
        self._broker_source: str = getattr(client, "broker_source", "given as broker_url=")
        self._broker_checked = False

    def _check_broker(self) -> None:
        """Refuse an application connection to another database than the broker's,
        before the first statement (declarations included); then never again."""
        if not self._broker_checked and self.broker_dsn is not None:
            self.binding.check_broker(self.broker_dsn, self._broker_source)
        self._broker_checked = True

    def broker(self) -> Broker:
        self._check_broker()
        return super().broker()

    def broker_for_publish(self) -> Broker:
        self._check_broker()
        return super().broker_for_publish()

    def register_consumer(self, queue: str, consumer_tag: str) -> None:
        raise errors.ConfigurationError(
            "a kombu_pgmq.using() connection only publishes (in the application's "
            "transaction): consume from a connection to the broker URL"
        )


class BoundConnection(Connection):
    """A Kombu connection whose publishes run on an application's connection (see the
    module docstring); also a context manager binding every kombu_pgmq publish of the
    block to it. Closing it never closes the application's connection."""

    def __init__(
        self,
        binding: Binding,
        transport_options: Mapping[str, Any] | None = None,
        broker_url: str | None = None,
        broker_source: str = "given as broker_url=",
    ):
        #: The transport options given (kombu adds a publish's retry policy to
        #: ``transport_options``: those are not compared by :func:`using`).
        self.options_given = dict(transport_options or {})
        options = {**self.options_given, BINDING_OPTION: binding}
        super().__init__("postgresql://", transport=BoundTransport, transport_options=options)
        self.binding = binding
        #: The broker its publishes are for (checked to be ``binding``'s database), and
        #: where that came from; None: the binding's database is the broker.
        self.broker_url = broker_url
        self.broker_source = broker_source
        self._tokens: list[contextvars.Token[Binding | None]] = []

    def __enter__(self) -> BoundConnection:
        self._tokens.append(CURRENT_BINDING.set(self.binding))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        CURRENT_BINDING.reset(self._tokens.pop())

    def clone(self, **kwargs: Any) -> BoundConnection:
        return BoundConnection(
            self.binding, self.options_given, self.broker_url, self.broker_source
        )


def using(
    conn: Any,
    *,
    broker_url: str | None = None,
    transport_options: Mapping[str, Any] | None = None,
) -> BoundConnection:
    """A Kombu connection that publishes inside ``conn``'s transaction.

    Arguments:
        conn: a psycopg 3 ``Connection``, a SQLAlchemy ``Session``/``Connection`` on the
            psycopg driver, or a Django connection (PostgreSQL, psycopg 3).
        broker_url: the broker the publishes are for; ``conn`` must be to its database
            (checked at the first publish, before anything is written). Default: the
            current Celery app's ``broker_write_url``/``broker_url``; with neither,
            ``conn``'s database is the broker.
        transport_options: transport options of its publishes (default: the current
            Celery app's ``broker_transport_options``, e.g. ``deduplication_window``).

    Shapes: ``(conn) -> BoundConnection`` (a :class:`kombu.Connection`), the same object
    again for the same application connection, broker and options.

    Raises:
        ConfigurationError: ``conn`` is none of those (e.g. psycopg 2, an async
            connection), or closed; the current Celery app's broker is not a PostgreSQL
            URL (and no ``broker_url`` was given).
    """
    pg = driver_connection(conn)
    conf = _celery_conf()
    if transport_options is None:
        transport_options = dict(conf.broker_transport_options or {}) if conf is not None else {}
    source = "given as broker_url="
    if broker_url is None and conf is not None:
        broker_url = _celery_broker_url(conf)
        source = "the current Celery app's broker_url"
    bound = _BOUND.get(pg)
    if bound is None:
        bound = _BOUND[pg] = BoundConnection(Binding(pg), transport_options, broker_url, source)
    elif bound.broker_url != broker_url or bound.options_given != transport_options:
        binding = bound.binding  # its checks stay cached
        bound = _BOUND[pg] = BoundConnection(binding, transport_options, broker_url, source)
    return bound


def driver_connection(conn: Any) -> psycopg.Connection[Any]:
    """The psycopg 3 connection behind ``conn`` (see :func:`using`).

    Raises:
        ConfigurationError: not a supported connection, or closed.
    """
    if isinstance(conn, BoundConnection):
        return conn.binding.connection
    pg: Any = conn
    module = type(conn).__module__
    if module.startswith("sqlalchemy."):
        if hasattr(conn, "get_bind") and callable(getattr(conn, "connection", None)):
            conn = conn.connection()  # Session: the Connection of its transaction
        pg = getattr(conn.connection, "driver_connection", None)
    elif hasattr(conn, "ensure_connection") and getattr(conn, "vendor", None) is not None:
        if conn.vendor != "postgresql":
            raise errors.ConfigurationError(
                f"kombu_pgmq.using(): Django connection {conn.alias!r} is {conn.vendor}, "
                "not PostgreSQL"
            )
        conn.ensure_connection()
        pg = conn.connection
    if isinstance(pg, psycopg.AsyncConnection):
        raise errors.ConfigurationError(
            "kombu_pgmq.using(): an async psycopg connection cannot be used: Kombu and "
            "Celery publish synchronously; give a psycopg.Connection"
        )
    if not isinstance(pg, psycopg.Connection):
        raise errors.ConfigurationError(
            f"kombu_pgmq.using(): {type(conn).__module__}.{type(conn).__name__} is not a "
            "psycopg 3 connection, a SQLAlchemy Session/Connection on the psycopg driver "
            "(postgresql+psycopg://) or a Django connection on psycopg 3"
        )
    if pg.closed:
        raise errors.ConfigurationError("kombu_pgmq.using(): the connection is closed")
    return pg


def _celery_conf() -> Any:
    """The current Celery app's configuration (None if the process does not use Celery)."""
    celery = sys.modules.get("celery")  # only if the application uses Celery already
    return None if celery is None else celery.current_app.conf


def _celery_broker_url(conf: Any) -> str | None:
    """The broker URL Celery publishes to (None: not configured).

    Raises:
        ConfigurationError: it is not kombu_pgmq's (not a PostgreSQL URL, and
            ``broker_transport`` does not name kombu_pgmq).
    """
    url = conf.broker_write_url
    if not url:
        return None
    if not isinstance(url, str):  # a failover list
        url = ";".join(url)
    if is_ours(url, conf.broker_transport):
        return url
    raise errors.ConfigurationError(
        f"kombu_pgmq.using(): the current Celery app's broker ({redact(url)}) is not "
        "kombu_pgmq's (postgresql://): its workers would never see the message; name the "
        "PostgreSQL broker with kombu_pgmq.using(conn, broker_url=...)"
    )


def _broker_database(dsn: str, *, fresh: bool = False) -> Any:
    """``(name, server start)`` of the database libpq string ``dsn`` reaches (cached per
    process; ``fresh``: look again)."""
    key = (os.getpid(), dsn)
    found = None if fresh else _BROKER_DATABASES.get(key)
    if found is None:
        connector = Connector(dsn)
        try:
            found = _BROKER_DATABASES[key] = Broker(connector).database_identity()
        finally:
            connector.close()
    return found
