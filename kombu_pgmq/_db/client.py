"""PGMQ client: the only module of kombu_pgmq that sends SQL.

One :class:`PgmqClient` wraps one psycopg 3 connection in autocommit mode (every call is
its own transaction unless inside :meth:`PgmqClient.transaction`). Statements come from
``sql/queries.sql`` by name; psycopg prepares the frequent ones on the server after a
few uses. Queue names given to it are PGMQ names (see :mod:`kombu_pgmq._naming`).

Every psycopg error is translated by :func:`kombu_pgmq.errors.translate`; after a
connection error the client is closed and later calls raise
:class:`~kombu_pgmq.errors.BrokerConnectionError` (kombu then reconnects).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from ..errors import BrokerConnectionError, KombuPgmqError, translate
from .queries import queries


class Row(NamedTuple):
    """One delivered message: ``message`` and ``headers`` are JSON text (headers may be None);
    ``age_seconds`` is the time since it was sent, by the server's clock."""

    msg_id: int
    read_ct: int
    message: str
    headers: str | None
    age_seconds: float


class RoutingTable(NamedTuple):
    """Exchanges and bindings as of ``version`` (see ``kombu_pgmq.transport._routing``).

    ``exchanges``: ``{exchange: type}``; ``bindings``: ``[(exchange, routing_key, queue,
    pgmq_queue)]`` where ``queue`` is the Kombu name.
    """

    version: int
    exchanges: dict[str, str]
    bindings: list[tuple[str, str, str, str]]
    #: ``{queue: (priority_floors, band_pgmq_queues)}`` of bound queues with priorities.
    bands: dict[str, tuple[list[int], list[str]]] = {}


class QueueInfo(NamedTuple):
    """A queue's arguments in force (as first declared): ``message_ttl_ms`` (None:
    unlimited), ``max_priority`` (None: no priorities), the priority band ``floors`` and
    the PGMQ queue of each band (None, None without priorities)."""

    message_ttl_ms: int | None
    max_priority: int | None
    floors: list[int] | None
    band_queues: list[str] | None


class DeadLetter(NamedTuple):
    """A row of a dead-letter queue: ``message``/``headers`` are JSON text."""

    msg_id: int
    read_ct: int
    enqueued_at: Any  # datetime (timezone-aware)
    message: str
    headers: str | None


@lru_cache(maxsize=2048)
def _with_table(name: str, queue: str) -> sql.Composed:
    return sql.SQL(queries()[name]).format(queue_table=sql.Identifier("pgmq", f"q_{queue}"))


def _with_archive(name: str, queue: str) -> sql.Composed:
    return sql.SQL(queries()[name]).format(archive_table=sql.Identifier("pgmq", f"a_{queue}"))


class PgmqClient:
    """Typed PGMQ operations over one connection.

    Arguments:
        conninfo: libpq connection string (``key=value``) or URL; may hold a password,
            which is never shown by ``repr``.
    """

    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self._conn: psycopg.Connection[Any] | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._q = queries()
        self._notified: list[str] = []  # notifications psycopg read during a statement

    def __repr__(self) -> str:
        state = "open" if self._conn is not None and not self._conn.closed else "closed"
        return f"<PgmqClient {state}>"

    # -- connection ------------------------------------------------------------------

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """The open psycopg connection (connects on first use, and again after a lost
        connection was reported).

        Raises:
            BrokerConnectionError: the server cannot be reached, or :meth:`close` was called.
        """
        conn = self._conn
        if conn is None or conn.closed:
            with self._lock:
                if self._closed:
                    raise BrokerConnectionError("the PGMQ client was closed")
                conn = self._conn
                if conn is None or conn.closed:
                    try:
                        conn = psycopg.connect(self._conninfo, autocommit=True)
                    except psycopg.Error as exc:
                        raise translate(exc) from exc
                    conn.add_notify_handler(self._on_notify)
                    self._conn = conn
        return conn

    def close(self) -> None:
        """Close the connection for good (idempotent): later calls raise."""
        with self._lock:
            self._closed = True
            self._drop()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    @property
    def backend_pid(self) -> int:
        """PID of the server process serving this connection (for diagnostics and tests)."""
        return self.connection.info.backend_pid

    def _fail(self, exc: psycopg.Error) -> KombuPgmqError:
        err = translate(exc)
        if isinstance(err, BrokerConnectionError):
            self._drop()  # the next call reconnects
        return err

    def _run(self, query: Any, params: Any = None) -> list[tuple[Any, ...]]:
        try:
            cur = self.connection.execute(query, params)
            return cur.fetchall() if cur.description is not None else []
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Run the calls inside the block in one transaction (commit, or rollback on error)."""
        try:
            with self.connection.transaction():
                yield
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    # -- messages --------------------------------------------------------------------

    def send(self, queue: str, message: str, headers: str, delay_seconds: int = 0) -> int:
        """Publish one message (``message``/``headers`` are JSON text); return its msg_id.

        Raises:
            QueueNotFound: the queue does not exist.
            InvalidJsonBody: PostgreSQL rejected ``message`` as JSON.
        """
        if delay_seconds > 0:
            rows = self._run(
                self._q["send_delayed"],
                {
                    "queue": queue,
                    "message": message,
                    "headers": headers,
                    "delay_seconds": delay_seconds,
                },
            )
        else:
            rows = self._run(
                self._q["send"], {"queue": queue, "message": message, "headers": headers}
            )
        return int(rows[0][0])

    def read(self, queue: str, vt_seconds: int, qty: int) -> list[Row]:
        """Deliver up to ``qty`` visible messages, invisible for ``vt_seconds`` afterwards."""
        rows = self._run(self._q["read"], {"queue": queue, "vt_seconds": vt_seconds, "qty": qty})
        return [Row(*r) for r in rows]

    def read_many(
        self,
        queues: Sequence[str],
        vt_seconds: int,
        qty: int,
        acks: Sequence[tuple[str, int]] = (),
        *,
        durable_acks: bool = True,
    ) -> list[tuple[str, Row]]:
        """Archive ``acks`` (``(queue, msg_id)`` pairs), then deliver up to ``qty`` messages
        from ``queues`` in the order given, all in one round trip and one transaction.

        Returns ``(queue, Row)`` pairs. The commit is asynchronous unless there are acks
        and ``durable_acks``: a server crash may then forget the deliveries and acks, and
        those messages are delivered again (never lost).

        Raises:
            QueueNotFound: one of the queues is gone (nothing was archived or read).
        """
        rows = self._run(
            self._q["read_many"],
            {
                "queues": list(queues),
                "vt_seconds": vt_seconds,
                "qty": qty,
                "ack_queues": [q for q, _ in acks],
                "ack_ids": [i for _, i in acks],
                "durable_acks": durable_acks,
            },
        )
        return [(r[0], Row(r[1], r[2], r[3], r[4], r[5])) for r in rows]

    def wait_for(self, owner: str, queues: Sequence[str]) -> None:
        """Record that ``owner`` sleeps until notified on ``queues`` (publishers then
        NOTIFY); returns once publishers that missed the record have committed, so a
        read of the queues after this call sees their messages (see migration 0003)."""
        self._run(self._q["wait_for"], {"owner": owner, "queues": list(queues)})

    def stop_waiting(self, owner: str, queues: Sequence[str] | None = None) -> None:
        """Publishers need not notify ``owner`` for ``queues`` (None: any queue) any more."""
        if queues is None:
            self._run(self._q["stop_waiting_all"], {"owner": owner})
        else:
            self._run(self._q["stop_waiting"], {"owner": owner, "queues": list(queues)})

    def pop(self, queue: str, qty: int) -> list[Row]:
        """Deliver and delete up to ``qty`` visible messages (no ack will follow)."""
        return [Row(*r) for r in self._run(self._q["pop"], {"queue": queue, "qty": qty})]

    def archive(self, queue: str, msg_ids: Sequence[int], *, durable: bool = True) -> list[int]:
        """Move messages to the archive ``pgmq.a_<queue>``; return the ids that were there.

        ``durable=False`` commits asynchronously (a server crash may forget the ack).
        """
        rows = self._run(
            self._q["archive" if durable else "archive_async"],
            {"queue": queue, "msg_ids": list(msg_ids)},
        )
        return [r[0] for r in rows]

    def set_vt(self, queue: str, msg_ids: Sequence[int], vt_seconds: int) -> list[int]:
        """Make messages visible again in ``vt_seconds`` (0: now); return the ids updated."""
        rows = self._run(
            self._q["set_vt"],
            {"queue": queue, "msg_ids": list(msg_ids), "vt_seconds": vt_seconds},
        )
        return [r[0] for r in rows]

    def renew(self, held: Sequence[tuple[str, int, int]], vt_seconds: int) -> set[tuple[str, int]]:
        """Extend the leases of held messages, ``(queue, msg_id, read_ct)`` each, to now +
        ``vt_seconds``, in one round trip. Returns the ``(queue, msg_id)`` renewed; the
        others lost their lease (read again elsewhere after their visibility timeout
        passed, or gone)."""
        rows = self._run(
            self._q["renew"],
            {
                "queues": [h[0] for h in held],
                "msg_ids": [h[1] for h in held],
                "read_cts": [h[2] for h in held],
                "vt_seconds": vt_seconds,
            },
        )
        return {(str(q), int(i)) for q, i in rows}

    def dead_letter(
        self,
        queue: str,
        msg_ids: Sequence[int],
        *,
        dead_letter_queue: str,
        reason: str,
        kombu_queue: str,
    ) -> list[int]:
        """Atomically move messages from ``queue`` to ``dead_letter_queue``.

        The moved copy keeps message and headers and gains an ``x-dead-letter`` header:
        ``{"queue", "pgmq_queue", "msg_id", "read_ct", "reason", "enqueued_at",
        "dead_lettered_at"}``. Returns the new msg_ids in the dead-letter queue.

        Raises:
            QueueNotFound: ``dead_letter_queue`` does not exist (nothing was moved).
        """
        rows = self._run(
            _with_table("dead_letter", queue),
            {
                "queue": queue,
                "msg_ids": list(msg_ids),
                "dead_letter_queue": dead_letter_queue,
                "reason": reason,
                "kombu_queue": kombu_queue,
            },
        )
        return [r[0] for r in rows]

    # -- queues ----------------------------------------------------------------------

    def create_queue(
        self,
        queue: str,
        kombu_queue: str,
        *,
        durable: bool = True,
        auto_delete: bool = False,
        expires_ms: int | None = None,
        message_ttl_ms: int | None = None,
        max_priority: int | None = None,
        floors: Sequence[int] | None = None,
        band_queues: Sequence[str] | None = None,
    ) -> QueueInfo:
        """Create the PGMQ queue (idempotent; UNLOGGED if not durable) and record its Kombu
        name and arguments in ``kombu_pgmq.queues`` (the first declaration's arguments
        stay), then the PGMQ queues of its priority bands as stored. Returns the
        arguments in force."""
        create = self._q["create_queue" if durable else "create_queue_unlogged"]
        with self.transaction():
            self._run(create, {"queue": queue})
            rows = self._run(
                self._q["register_queue"],
                {
                    "queue": queue,
                    "kombu_queue": kombu_queue,
                    "durable": durable,
                    "auto_delete": auto_delete,
                    "expires_ms": expires_ms,
                    "message_ttl_ms": message_ttl_ms,
                    "max_priority": max_priority,
                    "priority_bands": list(floors) if max_priority is not None and floors else None,
                    "band_queues": list(band_queues)
                    if max_priority is not None and band_queues
                    else None,
                },
            )
            ttl, stored_max, stored_floors, stored_queues = rows[0]
            for band in (stored_queues or [])[1:]:
                self._run(create, {"queue": band})
        return QueueInfo(
            None if ttl is None else int(ttl),
            None if stored_max is None else int(stored_max),
            None if stored_floors is None else [int(f) for f in stored_floors],
            None if stored_queues is None else [str(q) for q in stored_queues],
        )

    def queue_info(self, kombu_queue: str) -> QueueInfo | None:
        """Priority arguments of a Kombu queue as stored (None: no such queue recorded)."""
        rows = self._run(self._q["queue_bands"], {"kombu_queue": kombu_queue})
        if not rows:
            return None
        max_priority, floors, band_queues = rows[0]
        return QueueInfo(
            None,
            None if max_priority is None else int(max_priority),
            None if floors is None else [int(f) for f in floors],
            None if band_queues is None else [str(q) for q in band_queues],
        )

    def drop_queue(self, queue: str, kombu_queue: str) -> bool:
        """Drop the queue, its archive, bindings and consumers; False if it did not exist."""
        rows = self._run(self._q["drop_queue"], {"queue": queue, "kombu_queue": kombu_queue})
        return bool(rows[0][0])

    def message_ttl_ms(self, kombu_queue: str) -> int | None:
        """The queue's ``x-message-ttl`` in milliseconds (None: unlimited or unknown queue)."""
        value = self.scalar("message_ttl", {"kombu_queue": kombu_queue})
        return None if value is None else int(value)

    def delete(self, queue: str, msg_ids: Sequence[int]) -> list[int]:
        """Delete messages for good (no archive); return the ids that were there."""
        rows = self._run(self._q["delete_messages"], {"queue": queue, "msg_ids": list(msg_ids)})
        return [r[0] for r in rows]

    # -- exchanges and bindings --------------------------------------------------------

    def declare_exchange(
        self, exchange: str, type: str, *, durable: bool = True, auto_delete: bool = False
    ) -> str:
        """Declare an exchange (idempotent); return its type as stored (first one wins)."""
        return str(
            self.scalar(
                "declare_exchange",
                {
                    "exchange": exchange,
                    "type": type,
                    "durable": durable,
                    "auto_delete": auto_delete,
                },
            )
        )

    def exchange_type(self, exchange: str) -> str | None:
        value = self.scalar("exchange_type", {"exchange": exchange})
        return None if value is None else str(value)

    def delete_exchange(self, exchange: str) -> None:
        """Delete an exchange and its bindings."""
        self._run(self._q["delete_exchange"], {"exchange": exchange})

    def bind(self, exchange: str, routing_key: str, kombu_queue: str) -> None:
        self._run(
            self._q["bind"],
            {"exchange": exchange, "routing_key": routing_key, "kombu_queue": kombu_queue},
        )

    def unbind(self, exchange: str, routing_key: str, kombu_queue: str) -> None:
        self._run(
            self._q["unbind"],
            {"exchange": exchange, "routing_key": routing_key, "kombu_queue": kombu_queue},
        )

    def routing_table(self) -> RoutingTable:
        """Every exchange and binding, with the routing version, from one snapshot."""
        version, exchanges, bindings = self._run(self._q["routing_table"])[0]
        return RoutingTable(
            int(version),
            dict(exchanges),
            [(b[0], b[1], b[2], b[3]) for b in bindings],
            {b[2]: (list(b[4]), list(b[5])) for b in bindings if b[4] and b[5]},
        )

    def routing_version(self) -> int:
        """Current routing version (bumped by every exchange or binding change)."""
        return int(self.scalar("routing_version"))

    def send_routed(
        self,
        queues: Sequence[str],
        message: str,
        headers: str,
        *,
        version: int,
        delay_seconds: int = 0,
    ) -> tuple[int, list[int]]:
        """Send one message to several PGMQ queues in one statement, if the routing version
        is still ``version``. Returns ``(current_version, msg_ids)``; when the versions
        differ nothing was sent. ``delay_seconds > 0``: visible only after that long.

        Raises:
            QueueNotFound: one of the queues is gone (nothing was sent).
        """
        row = self._run(
            self._q["send_routed"],
            {
                "queues": list(queues),
                "message": message,
                "headers": headers,
                "version": version,
                "delay_seconds": delay_seconds,
            },
        )[0]
        return int(row[0]), list(row[1])

    # -- consumers and queue lifetime ----------------------------------------------------

    def register_consumer(
        self, kombu_queue: str, owner: str, consumer_tag: str, *, stale_after_seconds: float
    ) -> None:
        """Record a live consumer; it counts as gone ``stale_after_seconds`` after its last
        heartbeat (the owner's setting, not the reaper's)."""
        self._run(
            self._q["register_consumer"],
            {
                "kombu_queue": kombu_queue,
                "owner": owner,
                "consumer_tag": consumer_tag,
                "stale_after_seconds": stale_after_seconds,
            },
        )

    def release_consumer(self, kombu_queue: str, owner: str, consumer_tag: str) -> bool:
        """Forget a consumer; True if its queue was auto-deleted as a result."""
        return bool(
            self.scalar(
                "release_consumer",
                {"kombu_queue": kombu_queue, "owner": owner, "consumer_tag": consumer_tag},
            )
        )

    def heartbeat(self, owner: str) -> None:
        """Mark ``owner``'s consumers live and their queues used, now."""
        self._run(self._q["heartbeat"], {"owner": owner})

    def reap(self) -> list[str]:
        """Drop queues AMQP would have deleted (see ``kombu_pgmq.reap``); return their
        Kombu names."""
        return self.column("reap")

    def dead_tuples(self, queues: Sequence[str]) -> dict[str, int]:
        """Dead row versions of each queue's table ``pgmq.q_<queue>`` (from the server's
        cumulative statistics; queues without statistics yet are left out)."""
        rows = self._run(self._q["dead_tuples"], {"tables": [f"q_{q}" for q in queues]})
        return {str(name)[2:]: int(n) for name, n in rows}

    def vacuum(self, queue: str) -> None:
        """``VACUUM`` the queue's table (skipped if another VACUUM holds it).

        Raises:
            OperationalError: e.g. the role does not own the table.
        """
        self._run(_with_table("vacuum", queue))

    def queue_exists(self, queue: str) -> bool:
        return bool(self._run(self._q["queue_exists"], {"queue": queue})[0][0])

    def size(self, queue: str) -> int:
        """Number of ready (visible) messages."""
        return int(self._run(_with_table("size", queue))[0][0])

    def purge(self, queue: str) -> int:
        """Delete the ready messages (not the unacked ones); return how many."""
        return int(self._run(_with_table("purge", queue))[0][0])

    # -- dead letters and archive retention (kombu_pgmq.dlq, kombu_pgmq.retention) ------

    def dead_letters(
        self,
        queue: str,
        *,
        take: bool = False,
        msg_ids: Sequence[int] | None = None,
        original_queue: str | None = None,
        reason: str | None = None,
        task: str | None = None,
        after_id: int = 0,
        limit: int = 100,
        any_header: bool = True,
    ) -> list[DeadLetter]:
        """Rows of dead-letter queue ``queue`` matching the filters (None: any), oldest
        first, msg_id > ``after_id``, at most ``limit``. ``take=True`` deletes them too
        (use inside :meth:`transaction` to send them elsewhere atomically).
        ``any_header=False``: only rows with an ``x-dead-letter`` header.

        Raises:
            QueueNotFound: the dead-letter queue does not exist.
        """
        rows = self._run(
            _with_table("take_dead_letters" if take else "dead_letters", queue),
            {
                "msg_ids": None if msg_ids is None else list(msg_ids),
                "queue": original_queue,
                "reason": reason,
                "task": task,
                "after_id": after_id,
                "limit": limit,
                "any_header": any_header,
            },
        )
        return [DeadLetter(*r) for r in rows]

    def queue_tables(self) -> list[tuple[str, bool]]:
        """Every PGMQ queue: ``(name, has_archive_table)``."""
        return [(str(q), bool(a)) for q, a in self._run(self._q["queue_tables"])]

    def prune_archive(self, queue: str, older_than_seconds: float, batch_size: int) -> int:
        """Delete up to ``batch_size`` messages archived more than ``older_than_seconds``
        ago from ``pgmq.a_<queue>`` (one short transaction); return how many."""
        return int(
            self._run(
                _with_archive("prune_archive", queue),
                {"older_than_seconds": older_than_seconds, "batch_size": batch_size},
            )[0][0]
        )

    # -- Spark writes and reads (kombu_pgmq.spark, migration 0005) ---------------------

    def open_write(self, write_id: str, queue: str) -> int:
        """Register a Spark write (``kombu_pgmq.spark_writes``) on the queue; return the
        queue's highest msg_id now (every message the write stages will be above it)."""
        return int(self._run(self._q["open_write"], {"write_id": write_id, "queue": queue})[0][0])

    def stage_messages(self, write_id: str, messages: Sequence[str], headers: Sequence[str]) -> int:
        """Send a batch of a Spark write hidden for 10 years (``headers`` carry the task
        attempt's marker); return how many. Made visible by :meth:`commit_write`.

        Raises:
            OperationalError: the write is no longer open (committed or aborted).
        """
        params = {"write_id": write_id, "messages": list(messages), "headers": list(headers)}
        return int(self._run(self._q["stage_messages"], params)[0][0])

    def commit_write(self, write_id: str, attempts: Sequence[str]) -> int:
        """End the write: make the messages of the committed task ``attempts``
        (``"<write id>/<partition>/<attempt>"``) visible and delete what other attempts
        staged, in one transaction, after staging in flight finished; return how many
        became visible.

        Raises:
            OperationalError: the write is not open (aborted, committed, unknown).
        """
        params = {"write_id": write_id, "attempts": list(attempts)}
        return int(self._run(self._q["commit_write"], params)[0][0])

    def abort_write(self, write_id: str) -> int:
        """End the write: delete every message it staged (after staging in flight
        finished); return how many. 0 if the write was not open."""
        return int(self._run(self._q["abort_write"], {"write_id": write_id})[0][0])

    def _table(self, queue: str, archive: bool) -> sql.Identifier:
        return sql.Identifier("pgmq", f"{'a' if archive else 'q'}_{queue}")

    def msg_id_range(self, queue: str, *, archive: bool = False) -> tuple[int, int] | None:
        """``(lowest, highest)`` msg_id of the queue or its archive; None when empty."""
        query = sql.SQL(self._q["msg_id_range"]).format(table=self._table(queue, archive))
        lo, hi = self._run(query)[0]
        return None if lo is None else (int(lo), int(hi))

    def snapshot(
        self, queue: str, lo: int, hi: int, *, archive: bool = False, batch_rows: int = 10_000
    ) -> Iterator[tuple[Any, ...]]:
        """Rows with ``lo < msg_id <= hi`` of the queue or its archive, by msg_id, through a
        server-side cursor (``batch_rows`` per fetch); nothing is consumed. Row shape:
        ``(msg_id, read_ct, enqueued_at, last_read_at | None, vt, archived_at | None,
        task | None, task_id | None, message_json, headers_json | None)``."""
        table = self._table(queue, archive)
        present = set(
            self.column("table_columns", {"table": f"pgmq.{'a' if archive else 'q'}_{queue}"})
        )
        cols = {
            name: sql.Identifier(name) if name in present else sql.SQL("NULL::timestamptz")
            for name in ("last_read_at", "archived_at")
        }
        query = sql.SQL(self._q["snapshot"]).format(table=table, **cols)
        try:
            with self.connection.transaction(), self.connection.cursor(name="snapshot") as cur:
                cur.itersize = batch_rows
                cur.execute(query, {"lo": lo, "hi": hi})
                yield from cur
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    def stream_horizon(self, queue: str, after_id: int, max_rows: int, wait_seconds: float) -> int:
        """Highest msg_id a streaming reader may take after ``after_id`` (see migration
        0005); ``after_id`` itself when nothing can be taken yet."""
        params = {
            "queue": queue,
            "after_id": after_id,
            "max_rows": max_rows,
            "wait_seconds": wait_seconds,
        }
        return int(self._run(self._q["stream_horizon"], params)[0][0])

    def archive_range(self, queue: str, lo: int, hi: int) -> int:
        """Archive the messages with ``lo < msg_id <= hi``; return how many."""
        params = {"queue": queue, "lo": lo, "hi": hi}
        return int(self._run(_with_table("archive_range", queue), params)[0][0])

    # -- notifications (a client used as a listener) ------------------------------------

    def listen(self, channels: Iterable[str]) -> None:
        """``LISTEN`` on each channel (names are quoted identifiers, case kept)."""
        for channel in channels:
            self._run(sql.SQL(self._q["listen"]).format(channel=sql.Identifier(channel)))

    def unlisten(self, channels: Iterable[str]) -> None:
        for channel in channels:
            self._run(sql.SQL(self._q["unlisten"]).format(channel=sql.Identifier(channel)))

    def fileno(self) -> int:
        """The connection's socket, to wait for notifications with select/epoll."""
        return self.connection.pgconn.socket

    def notifications(self) -> list[str]:
        """Channels notified since the last call, without blocking (read from the socket
        if it has data; duplicates folded).

        Raises:
            BrokerConnectionError: the connection was lost (the next call reconnects;
                LISTEN again then).
        """
        conn = self.connection
        received = self._notified
        self._notified = []
        try:
            pgconn = conn.pgconn
            pgconn.consume_input()
            while (notify := pgconn.notifies()) is not None:
                received.append(notify.relname.decode())
        except psycopg.Error as exc:
            raise self._fail(exc) from exc
        return list(dict.fromkeys(received))

    def _on_notify(self, notify: psycopg.Notify) -> None:
        self._notified.append(notify.channel)

    # -- server and schema (used by kombu_pgmq.embedded and kombu_pgmq.schema) -------

    def create_database_if_missing(self, name: str, *, lock_key: int) -> bool:
        """Create database *name* unless it exists; True if created.

        Concurrent callers are serialized by the session advisory lock *lock_key*
        (``CREATE DATABASE`` cannot run inside a transaction block).
        """
        self._run(self._q["session_lock"], {"key": lock_key})
        try:
            if self.scalar("database_exists", {"name": name}):
                return False
            self._run(sql.SQL(self._q["create_database"]).format(database=sql.Identifier(name)))
            return True
        finally:
            self._run(self._q["session_unlock"], {"key": lock_key})

    def scalar(self, name: str, params: dict[str, Any] | None = None) -> Any:
        """Run the named statement and return the first column of its first row (or None)."""
        rows = self._run(self._q[name], params)
        return rows[0][0] if rows else None

    def column(self, name: str, params: dict[str, Any] | None = None) -> list[Any]:
        """Run the named statement and return the first column of every row."""
        return [r[0] for r in self._run(self._q[name], params)]

    def execute_script(self, script: str) -> None:
        """Run a multi-statement SQL script (no parameters), e.g. a migration file."""
        self._run(script)
