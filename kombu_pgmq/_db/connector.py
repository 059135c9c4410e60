"""The connector: one PostgreSQL connection, and the only place SQL is executed.

A :class:`Connector` owns one psycopg 3 connection in autocommit mode (every call is its
own transaction unless inside :meth:`Connector.transaction`) and is used by one concern
only (a channel's statements, lease renewal, heartbeats, LISTEN): a statement that blocks
on one of them never holds up another. Statements are named blocks of ``sql/queries/*.sql``
(or a :class:`psycopg.sql.Composed` built from one, for table names); result rows are
decoded **by column name** with psycopg row factories (NamedTuple fields matched to the
result's column names), so a column added or moved by a PGMQ release cannot shift a value
into the wrong field.

Errors: every :class:`psycopg.Error` is translated here, once, by
:func:`kombu_pgmq.errors.translate` (``raise ... from exc``); after a lost connection the
next call reconnects.

Each connection is named by its role in ``pg_stat_activity``: ``application_name`` is the
connection string's (``kombu_pgmq`` by default) plus ``:<role>`` (``kombu_pgmq:listener``;
see ``docs/connections.md``). PgBouncer tracks ``application_name`` per client.

Fork safety (as psycopg's own ``PGconn`` and kombu's Redis transport): the connector
records the pid that opened its connection. In a forked child the inherited connection is
*abandoned*, never used, closed or finished (closing would send a Terminate message on the
parent's socket and end the parent's session); the child opens its own connection on its
first statement. ``os.register_at_fork`` abandons every live connector's connection in the
child at once. Through a transaction pooler (PgBouncer): :mod:`kombu_pgmq._db.pooling`.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

import psycopg
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import RowFactory, class_row

from ..errors import (
    BrokerConnectionError,
    ConfigurationError,
    KombuPgmqError,
    translate,
)
from . import pooling
from .pooling import is_pooled, local_settings, pooler_prepares
from .queries import queries
from .row_factory import named_row as _named_row

__all__ = ["Connector", "Query", "numbered"]

logger = logging.getLogger(__name__)

#: A statement: the name of a block of ``sql/queries/*.sql``, or SQL composed from one.
Query = str | bytes | sql.Composable
T = TypeVar("T")

#: Connections inherited from a parent process: kept referenced (never closed, never
#: collected: psycopg would warn) until the child exits.
_ABANDONED: list[Any] = []
_LIVE: weakref.WeakSet[Connector] = weakref.WeakSet()


class _Pending(NamedTuple):
    """A statement sent by :meth:`Connector.send_nowait` whose result is not read yet."""

    on_result: Callable[[list[tuple[str | None, ...]]], None]
    on_error: Callable[[KombuPgmqError], None]


def _wait_for(fd: int, event: int) -> None:
    """Block until ``fd`` is ready for ``event`` (``select.POLLIN``/``POLLOUT``): poll(2),
    no limit on descriptor numbers (select() refuses those above 1023)."""
    poller = select.poll()
    poller.register(fd, event)
    poller.poll()


def _log_notice(diagnostic: Any) -> None:
    """Server notices of kombu_pgmq's own functions ("kombu_pgmq: ...", e.g. stale acks
    not applied) are logged as warnings; others are left to the server log."""
    text = diagnostic.message_primary or ""
    if text.startswith("kombu_pgmq: "):
        logger.warning("%s", text[len("kombu_pgmq: ") :])


def _after_fork_in_child() -> None:
    for connector in list(_LIVE):
        connector._abandon()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: libpq >= 17 closes a prepared statement at the protocol level (PgBouncer >= 1.21 tracks
#: that, not ``DEALLOCATE``).
_CLOSE_PREPARED = psycopg.capabilities.has_send_close_prepared()

#: SQLSTATEs of a statement prepared through a pooler that does not keep prepared
#: statements per client (pooler_prepared_statements=True where it should be False).
_NOT_KEPT = ("26000", "42P05")
#: The same, seen as a protocol violation: "bind message supplies 5 parameters, but
#: prepared statement ... requires 11" (another client's statement of the same name).
_NOT_KEPT_BIND = "08P01"


def numbered(statement: bytes, names: Sequence[str]) -> bytes:
    """``statement`` with psycopg's named placeholders (``%(name)s``) as PostgreSQL's
    ``$1``... in the order of ``names`` (and ``%%`` as ``%``): the form a statement sent
    by :meth:`Connector.send_nowait` takes.

    Raises:
        ValueError: the statement has a placeholder not in ``names``.
    """
    for number, param in enumerate(names, 1):
        statement = statement.replace(b"%(" + param.encode() + b")s", b"$%d" % number)
    if b"%(" in statement:
        raise ValueError(f"statement has placeholders not in {names}: {statement[:200]!r}")
    return statement.replace(b"%%", b"%")


def _not_kept(exc: psycopg.Error) -> bool:
    """Whether ``exc`` is what a pooler that does not keep prepared statements causes."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate == _NOT_KEPT_BIND:
        return "prepared statement" in str(exc)
    return sqlstate in _NOT_KEPT


class Connector:
    """One fork-safe PostgreSQL connection for one concern.

    Arguments:
        dsn: libpq connection string (may hold a password: never shown by ``repr``).
        settings: session settings (``{"lock_timeout": "2s"}``) applied on every
            (re)connect, e.g. so a background service never waits long for a lock.
        on_notify: called with the channel name and payload of every NOTIFY psycopg
            reads.
        pooled: through a transaction pooler (None: as :func:`~kombu_pgmq._db.pooling.
            mark_pooled` says for ``dsn``): no prepared statements, ``settings`` per
            transaction, no ``synchronous_commit`` toggling.
        role: what the connection is for (``"listener"``): appended to the connection
            string's ``application_name`` as ``:<role>`` (None: left as it is).
        lz4: the session compresses the values it writes that PostgreSQL compresses
            (TOAST: messages and results over about 2 kB) with lz4 instead of pglz, when
            the server was built with lz4 and its configuration names no method
            (statement ``toast_compression_lz4``; not through a transaction pooler). For
            connections that write large values.

    Raises:
        ConfigurationError: ``on_notify`` in pooled mode (LISTEN needs a direct
            connection).
    """

    def __init__(
        self,
        dsn: str,
        *,
        settings: Mapping[str, str] | None = None,
        on_notify: Callable[[str, str], None] | None = None,
        pooled: bool | None = None,
        role: str | None = None,
        lz4: bool = False,
    ) -> None:
        self._dsn = dsn
        self.role = role
        self._lz4 = lz4
        #: Through a transaction pooler (see :mod:`kombu_pgmq._db.pooling`).
        self.pooled = is_pooled(dsn) if pooled is None else pooled
        #: Statements are prepared: a direct connection, or a pooler that keeps them.
        self.prepares = not self.pooled or pooler_prepares(dsn)
        if self.pooled and on_notify is not None:
            raise ConfigurationError(
                "LISTEN through a transaction pooler hears nothing: listen on a direct "
                "connection (the direct_url option)"
            )
        self._settings = dict(settings or {})
        self._on_notify = on_notify
        self._conn: psycopg.Connection[Any] | None = None
        self._synchronous = True  # synchronous_commit is the session's default
        self._pending: _Pending | None = None  # sent by send_nowait, result not read
        self._prepared: set[str] = set()  # statements send_nowait prepared on _conn
        self._stale: set[str] = set()  # prepared, to DEALLOCATE before preparing again
        self._busy = False  # inside fetch (free() says no)
        self._pid = os.getpid()
        self._closed = False
        self._lock = threading.Lock()
        self._q = queries()
        _LIVE.add(self)

    def __repr__(self) -> str:
        state = "open" if self._conn is not None and not self._conn.closed else "closed"
        return f"<Connector {state}>"

    # -- connection ------------------------------------------------------------------

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """The open psycopg connection (connects on first use, and again after a lost
        connection was reported, or in a forked child).

        Raises:
            BrokerConnectionError: the server cannot be reached, or :meth:`close` was called.
        """
        if self._pid != os.getpid():
            self._abandon()
        conn = self._conn
        if conn is None or conn.closed:
            with self._lock:
                if self._closed:
                    raise BrokerConnectionError("the PostgreSQL connection was closed")
                conn = self._conn
                if conn is None or conn.closed:
                    conn = self._connect()
        return conn

    def _connect(self) -> psycopg.Connection[Any]:
        try:
            dsn = self._dsn
            if self.role:  # a keyword overrides the connection string's value
                dsn = make_conninfo(dsn, application_name=self._application_name())
            # pooled: no prepared statements (the next transaction may run elsewhere),
            # unless the pooler keeps them (pooler_prepared_statements)
            extra = {} if self.prepares else {"prepare_threshold": None}
            conn = psycopg.connect(dsn, autocommit=True, **extra)
            self._synchronous = True
            self._prepared = set()
            self._stale = set()
            for name, value in self._settings.items() if not self.pooled else ():
                conn.execute("SELECT set_config(%s, %s, false)", (name, value))
            if self._lz4 and not self.pooled:
                conn.execute(self._q["toast_compression_lz4"])
            if self.pooled and self.prepares:
                try:  # once per connection: a pooler that does not keep them fails here
                    pooling.check_prepared_kept(conn, self._q["pooler_keeps_prepared"])
                except BaseException:
                    conn.close()
                    raise
        except psycopg.Error as exc:
            raise translate(exc) from exc
        if self._on_notify is not None:
            on_notify = self._on_notify
            conn.add_notify_handler(lambda n: on_notify(n.channel, n.payload))
        conn.add_notice_handler(_log_notice)
        self._conn = conn
        return conn

    def _application_name(self) -> str:
        """``application_name`` of the connection string (``kombu_pgmq`` if none) plus
        ``:<role>``, at most 63 bytes (the server's limit)."""
        base = conninfo_to_dict(self._dsn).get("application_name") or "kombu_pgmq"
        return f"{base}:{self.role}".encode()[:63].decode(errors="ignore")

    @property
    def connected(self) -> bool:
        """True while an open connection of this process exists (sends nothing)."""
        conn = self._conn
        return self._pid == os.getpid() and conn is not None and not conn.closed

    def close(self) -> None:
        """Close the connection for good (idempotent); later calls raise. In a forked
        child the parent's connection is abandoned instead: nothing is sent."""
        if self._pid != os.getpid():
            self._abandon()
        with self._lock:
            self._closed = True
            self._drop()
        _LIVE.discard(self)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        pending, self._pending = self._pending, None
        if conn is not None:
            conn.close()
        if pending is not None:
            pending.on_error(BrokerConnectionError("the PostgreSQL connection was closed"))

    def _abandon(self) -> None:
        """In a forked child: forget the parent's connection without a word to the server."""
        if self._pid == os.getpid():
            return
        conn, self._conn = self._conn, None
        self._pending = None  # the parent's to read
        if conn is not None:
            _ABANDONED.append(conn)
        self._pid = os.getpid()
        self._lock = threading.Lock()  # the parent's may have been held at fork time

    @property
    def backend_pid(self) -> int:
        """PID of the server process serving this connection (diagnostics and tests)."""
        return self.connection.info.backend_pid

    def fileno(self) -> int:
        """The connection's socket (to wait for notifications with a selector)."""
        return self.connection.pgconn.socket

    # -- statements ------------------------------------------------------------------

    def _fail(self, exc: psycopg.Error) -> KombuPgmqError:
        # 26000 "prepared statement ... does not exist" (prepared on another server
        # connection), 42P05 "... already exists" (another client's, of the same name, on
        # this one), 08P01 "bind message supplies N parameters, but prepared statement ...
        # requires M" (that other statement, bound): the pooler does not keep each
        # client's prepared statements
        if self.pooled and self.prepares and _not_kept(exc):
            return ConfigurationError(f"{exc}: {pooling.NOT_KEPT_FIX}")
        err = translate(exc)
        if isinstance(err, BrokerConnectionError):
            with self._lock:
                self._drop()  # the next call reconnects
        return err

    def _query(self, query: Query) -> Any:
        return self._q[query] if isinstance(query, str) else query

    def _commit_mode(self, conn: psycopg.Connection[Any], synchronous: bool | None) -> None:
        """Put the session's ``synchronous_commit`` in the state the next statement needs:
        off for reads and acks a crash may forget (they are redelivered), the session's
        default (``RESET``) for everything else; None: either (the statement sets it
        itself). One extra round trip when it changes, none in a run of reads.

        Pooled mode: never (a session ``SET`` would stay on a server connection other
        clients use next): every commit waits for the WAL flush, see
        :mod:`kombu_pgmq._db.pooling`."""
        if synchronous is None or synchronous == self._synchronous or self.pooled:
            return
        name = "synchronous_commit_reset" if synchronous else "synchronous_commit_off"
        conn.execute(self._q[name])
        self._synchronous = synchronous

    def _local_settings(self, synchronous: bool | None) -> dict[str, str]:
        """Pooled mode: the settings of the next statement's own transaction (inside
        :meth:`transaction` they are set already)."""
        if synchronous is False and pooling.ASYNC_COMMIT_PER_TRANSACTION:
            return {**self._settings, "synchronous_commit": "off"}
        return self._settings

    def fetch(
        self,
        query: Query,
        params: Any = None,
        row: RowFactory[T] | type[T] | None = None,
        *,
        synchronous: bool | None = True,
        binary: bool = False,
    ) -> list[T]:
        """Run a statement; return its rows, each built by column name.

        ``row``: a class (NamedTuple, dataclass) whose fields are the statement's column
        names, or a psycopg row factory; None: plain tuples. ``synchronous=False``: the
        commit does not wait for the WAL flush (a server crash may forget the statement's
        effect: only for reads and acks, which are then delivered again); None: the
        statement sets ``synchronous_commit`` itself (``set_config(..., true)``).
        ``binary``: the rows come in PostgreSQL's binary format (a ``bytea`` column as
        its bytes, not twice as many hex digits to decode).
        """
        factory: Any = row
        if isinstance(row, type):
            kind: Any = row
            factory = _named_row(kind) if hasattr(kind, "_fields") else class_row(row)
        self._busy = True
        try:
            conn = self.connection
            if self._pending is not None:
                self._collect(conn)
            self._commit_mode(conn, synchronous)
            cur = conn.cursor(row_factory=factory) if factory else conn.cursor()
            local = self._local_settings(synchronous) if self.pooled else None
            if local and conn.info.transaction_status == pq.TransactionStatus.IDLE:
                with conn.transaction(), cur:  # the settings hold for this transaction only
                    conn.execute(*local_settings(local))
                    cur.execute(self._query(query), params, binary=binary)
                    return cur.fetchall() if cur.description is not None else []
            with cur:
                cur.execute(self._query(query), params, binary=binary)
                return cur.fetchall() if cur.description is not None else []
        except psycopg.Error as exc:
            raise self._fail(exc) from exc
        finally:
            self._busy = False

    def execute(self, query: Query, params: Any = None) -> None:
        """Run a statement for its effect."""
        self.fetch(query, params)

    def scalar(self, query: Query, params: Any = None) -> Any:
        """First column of the first row (None without rows)."""
        rows: list[Any] = self.fetch(query, params)
        return rows[0][0] if rows else None

    def column(self, query: Query, params: Any = None) -> list[Any]:
        """First column of every row."""
        rows: list[Any] = self.fetch(query, params)
        return [r[0] for r in rows]

    def execute_literals(self, name: str, **values: Any) -> None:
        """Run named statement ``name`` with its ``{placeholders}`` filled by quoted
        literals (psycopg's quoting, never string formatting), sent without parameters:
        the simple query protocol, so its text may hold several statements, one round
        trip for all."""
        statement = sql.SQL(self._q[name]).format(
            **{key: sql.Literal(value) for key, value in values.items()}
        )
        try:
            conn = self.connection
            if self._pending is not None:
                self._collect(conn)
            conn.execute(statement, prepare=False)
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    def script(self, text: str) -> None:
        """Run a multi-statement SQL script without parameters (a migration file)."""
        try:
            conn = self.connection
            if self._pending is not None:
                self._collect(conn)
            conn.execute(text.encode())
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    def compose(self, name: str, **identifiers: str | tuple[str, ...]) -> sql.Composed:
        """Statement ``name`` with ``{placeholders}`` filled by quoted identifiers
        (``queue_table=("pgmq", "q_celery")``): never string formatting."""
        return sql.SQL(self._q[name]).format(
            **{
                key: sql.Identifier(*value) if isinstance(value, tuple) else sql.Identifier(value)
                for key, value in identifiers.items()
            }
        )

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Run the statements inside the block in one transaction (commit, or rollback on
        error)."""
        try:
            conn = self.connection
            if self._pending is not None:
                self._collect(conn)
            with conn.transaction():
                if self.pooled and self._settings:
                    conn.execute(*local_settings(self._settings))
                yield
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    def statement(self, name: str) -> str:
        """The text of named statement ``name`` (to compose it with :mod:`psycopg.sql`)."""
        return self._q[name]

    def stream(
        self, query: Query, params: Any, row: type[T], *, name: str, itersize: int
    ) -> Iterator[T]:
        """Rows of a large read through a server-side cursor (``itersize`` per fetch),
        inside a transaction, each built by column name."""
        try:
            if self._pending is not None:
                self._collect(self.connection)
            with (
                self.connection.transaction(),
                self.connection.cursor(name=name, row_factory=class_row(row)) as cur,
            ):
                cur.itersize = itersize
                if self.pooled and self._settings:
                    self.connection.execute(*local_settings(self._settings))
                cur.execute(self._query(query), params)
                yield from cur
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    # -- statements sent without waiting for their result ------------------------------

    def send_nowait(
        self,
        name: str | None,
        statement: bytes,
        params: Sequence[bytes | None],
        *,
        on_result: Callable[[list[tuple[str | None, ...]]], None],
        on_error: Callable[[KombuPgmqError], None],
    ) -> None:
        """Send a statement and return without waiting for its result (it commits on the
        server as soon as it runs: its own transaction). ``statement`` uses PostgreSQL's
        ``$1``... placeholders, ``params`` are text values; it is prepared once per
        connection under ``name`` (plan-cached, as psycopg's own prepared statements);
        in pooled mode, or with ``name`` None (a rare statement), it is sent unnamed
        instead (no prepared statement: the next transaction may run on another server
        connection).

        The result is read before this connector's next statement (or by
        :meth:`collect`): ``on_result(rows)`` gets the rows as text values,
        ``on_error(error)`` the translated error, also when the connection is lost before
        the result was read (the statement may or may not have run). One statement is
        pending at a time: a second call first reads the first one's result.

        Raises:
            BrokerConnectionError: the statement could not be sent (``on_error`` is not
                called: nothing is pending).
            StatementError: it could not be prepared (e.g. :class:`QueueNotFound`: its
                table is gone); nothing is pending.
        """
        try:
            conn = self.connection
            if self._pending is not None:
                self._collect(conn)
            with conn.lock:
                pgconn = conn.pgconn
                if name is None or not self.prepares:
                    pgconn.send_query_params(statement, params)
                else:
                    self._prepare(pgconn, name, statement)
                    pgconn.send_query_prepared(name.encode(), params)
                while pgconn.flush():  # nonblocking connection: the rest when writable
                    _wait_for(pgconn.socket, select.POLLOUT)
        except psycopg.Error as exc:
            raise self._fail(exc) from exc
        self._pending = _Pending(on_result, on_error)

    def _prepare(self, pgconn: Any, name: str, statement: bytes) -> None:
        """Prepare ``statement`` as ``name`` on this session unless it is (again after
        :meth:`forget_prepared`)."""
        if name in self._stale:
            if _CLOSE_PREPARED:  # the protocol's Close: PgBouncer >= 1.21 tracks it
                pgconn.close_prepared(name.encode())
            else:
                pgconn.exec_(b"DEALLOCATE " + name.encode())  # gone already: fine too
            self._stale.discard(name)
        if name not in self._prepared:
            result = pgconn.prepare(name.encode(), statement)
            if result.status != pq.ExecStatus.COMMAND_OK:
                raise psycopg.errors.error_from_result(result)
            self._prepared.add(name)

    def free(self) -> bool:
        """True when a statement can be sent without waiting: no statement of ours is
        running (inside :meth:`fetch`, e.g. from another greenlet), and the result of
        what :meth:`send_nowait` sent, if anything, has arrived (it is read now). Never
        blocks.

        Raises:
            BrokerConnectionError: the connection was lost.
        """
        if self._busy:
            return False
        if self._pending is None:
            return True
        try:
            conn = self.connection
            with conn.lock:
                pgconn = conn.pgconn
                pgconn.consume_input()
                if pgconn.is_busy():
                    return False
            self._collect(conn)
        except psycopg.Error as exc:
            raise self._fail(exc) from exc
        return True

    def forget_prepared(self, name: str) -> None:
        """Prepare statement ``name`` of :meth:`send_nowait` again at its next use (its
        table was dropped and may come back different)."""
        if name in self._prepared:
            self._prepared.discard(name)
            self._stale.add(name)

    def collect(self) -> None:
        """Read the result of the statement :meth:`send_nowait` sent (nothing if none).

        Raises:
            BrokerConnectionError: the connection was lost (``on_error`` got it too).
        """
        if self._pending is not None:
            try:
                self._collect(self.connection)
            except psycopg.Error as exc:
                raise self._fail(exc) from exc

    def _collect(self, conn: psycopg.Connection[Any]) -> None:
        """Wait for the pending statement's result and hand it to its callback; a lost
        connection is raised (psycopg's error) after ``on_error`` got it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        results: list[Any] = []
        try:
            with conn.lock:
                pgconn = conn.pgconn
                while True:
                    pgconn.consume_input()
                    while not pgconn.is_busy():
                        result = pgconn.get_result()
                        if result is None:
                            break
                        results.append(result)
                    else:
                        _wait_for(pgconn.socket, select.POLLIN)
                        continue
                    break
        except psycopg.Error as exc:
            pending.on_error(translate(exc))
            raise
        for result in results:
            if result.status == pq.ExecStatus.FATAL_ERROR:
                pending.on_error(translate(psycopg.errors.error_from_result(result)))
                return
        rows: list[tuple[str | None, ...]] = []
        for result in results:
            for i in range(result.ntuples):
                values = (result.get_value(i, j) for j in range(result.nfields))
                rows.append(tuple(None if v is None else bytes(v).decode() for v in values))
        pending.on_result(rows)

    def poll_notifies(self) -> None:
        """Read pending input from the socket without blocking; notifications go to
        ``on_notify``.

        Raises:
            BrokerConnectionError: the connection was lost (the next call reconnects).
        """
        conn = self.connection
        try:
            pgconn = conn.pgconn
            pgconn.consume_input()
            while (notify := pgconn.notifies()) is not None:
                if self._on_notify is not None:
                    self._on_notify(notify.relname.decode(), notify.extra.decode())
        except psycopg.Error as exc:
            raise self._fail(exc) from exc
