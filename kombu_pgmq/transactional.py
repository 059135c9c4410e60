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
The connection must be to the broker's database.

What runs where: the message (and its deduplication claim, and the NOTIFY that wakes a
waiting consumer, which PostgreSQL delivers at commit) is written on the application's
connection. Declarations (Celery declares a task queue before its first publish) and the
routing table go through a connection of kombu_pgmq's own, one per process and database,
so that no row of kombu_pgmq's tables stays locked by the application's transaction: an
open application transaction never blocks a consumer's reads, lease renewals or start.
A failure on the application's connection raises
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
from collections.abc import Mapping
from typing import Any

import psycopg
from kombu import Connection

from . import errors
from ._conninfo import redact
from ._db.broker import Broker
from ._db.connector import Connector, ExternalConnector
from .schema import ensure_schema

__all__ = ["BINDING_OPTION", "Binding", "BoundConnection", "current_binding", "using"]

#: Transport option carrying the :class:`Binding` of a :class:`BoundConnection`.
BINDING_OPTION = "kombu_pgmq_binding"

_CURRENT: contextvars.ContextVar[Binding | None] = contextvars.ContextVar(
    "kombu_pgmq_binding", default=None
)
# One statement connection per process and database for bound publishes' declarations.
_SHARED: dict[tuple[int, str], Connector] = {}
_SHARED_LOCK = threading.Lock()
_BOUND: weakref.WeakKeyDictionary[psycopg.Connection[Any], BoundConnection] = (
    weakref.WeakKeyDictionary()
)


@atexit.register
def _close_shared() -> None:
    for key, connector in list(_SHARED.items()):
        if key[0] == os.getpid():
            connector.close()
    _SHARED.clear()


def current_binding() -> Binding | None:
    """The binding of the innermost ``with using(conn):`` block, if any."""
    return _CURRENT.get()


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
        self.publisher = Broker(ExternalConnector(connection))
        self._same: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

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
                    connector = Connector(self.dsn)
                    ensure_schema(connector, self.dsn)
                    _SHARED[key] = connector
        return connector

    def publisher_for(self, transport: Any) -> Broker:
        """The publishing broker for a transport's publish inside ``with using(conn):``.

        Raises:
            ConfigurationError: the application's connection is to another database
                than the transport's broker (checked once per transport).
        """
        same = self._same.get(transport)
        if same is None:
            ours: Any = transport.broker().db.fetch("database_identity")[0]
            theirs: Any = self.publisher.db.fetch("database_identity")[0]
            same = self._same[transport] = ours == theirs
        if not same:
            raise errors.ConfigurationError(
                f"kombu_pgmq.using(): the application's connection ({redact(self.dsn)}) is "
                f"to another database than the broker ({redact(transport.dsn)}): bind a "
                "connection to the broker's database, or publish outside the block"
            )
        return self.publisher


class BoundConnection(Connection):
    """A Kombu connection whose publishes run on an application's connection (see the
    module docstring); also a context manager binding every kombu_pgmq publish of the
    block to it. Closing it never closes the application's connection."""

    def __init__(self, binding: Binding, transport_options: Mapping[str, Any] | None = None):
        from .transport.transport import BoundTransport

        options = dict(transport_options or {})
        options[BINDING_OPTION] = binding
        super().__init__("postgresql://", transport=BoundTransport, transport_options=options)
        self.binding = binding
        self._tokens: list[contextvars.Token[Binding | None]] = []

    def __enter__(self) -> BoundConnection:
        self._tokens.append(_CURRENT.set(self.binding))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _CURRENT.reset(self._tokens.pop())

    def clone(self, **kwargs: Any) -> BoundConnection:
        return BoundConnection(self.binding, self.transport_options)


def using(conn: Any, *, transport_options: Mapping[str, Any] | None = None) -> BoundConnection:
    """A Kombu connection that publishes inside ``conn``'s transaction.

    Arguments:
        conn: a psycopg 3 ``Connection``, a SQLAlchemy ``Session``/``Connection`` on the
            psycopg driver, or a Django connection (PostgreSQL, psycopg 3).
        transport_options: transport options of its publishes (default: the current
            Celery app's ``broker_transport_options``, e.g. ``deduplication_window``).

    Shapes: ``(conn) -> BoundConnection`` (a :class:`kombu.Connection`), the same object
    again for the same application connection and options.

    Raises:
        ConfigurationError: ``conn`` is none of those (e.g. psycopg 2, an async
            connection), or closed.
    """
    pg = driver_connection(conn)
    if transport_options is None:
        transport_options = _celery_transport_options()
    bound = _BOUND.get(pg)
    if bound is None or bound.transport_options != {
        **transport_options,
        BINDING_OPTION: bound.binding,
    }:
        bound = _BOUND[pg] = BoundConnection(Binding(pg), transport_options)
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


def _celery_transport_options() -> dict[str, Any]:
    celery = sys.modules.get("celery")  # only if the application uses Celery already
    if celery is None:
        return {}
    return dict(celery.current_app.conf.broker_transport_options or {})
