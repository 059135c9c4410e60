"""Broker operations: what the transport asks of PostgreSQL, one typed method per named
statement of ``sql/queries.sql``, sent through a :class:`~kombu_pgmq._db.connector.Connector`.

Queue names given here are PGMQ names (see :mod:`kombu_pgmq._naming`) unless a parameter
says ``kombu_queue``. Every method may raise
:class:`~kombu_pgmq.errors.BrokerConnectionError` (the connection was lost; the next call
reconnects) or :class:`~kombu_pgmq.errors.StatementError` (the statement failed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from psycopg import sql
from psycopg.types.json import Jsonb

from ..errors import PermissionDenied, QueueNotFound
from . import handoff
from .connector import Connector
from .declarations import Declarations
from .external import ExternalConnector
from .nowait import Nowait
from .positions import ReadPosition, ReadPositions
from .rows import (
    KEY_LIMITED,
    PositionedRow,
    QueueInfo,
    ReadRow,
    Reads,
    Receipt,
    Renewed,
    RoutingTable,
    Row,
    SentRow,
    Throttle,
    VersionRow,
    receipt_handles,
    slot_holds,
)

logger = logging.getLogger(__name__)

_ARCHIVE_COLUMNS = ("msg_id", "read_ct", "enqueued_at", "last_read_at", "vt", "message", "headers")


#: read statements' position parameters for a read of nothing (acks alone)
_NO_SCAN = {"scan_from": float("inf"), "watch_xids": [], "watch_bounds": [], "stamp": False}

__all__ = ["Broker", "QueueInfo", "Receipt", "RoutingTable", "Row"]


class Broker(Declarations, Nowait):
    """Typed broker operations over one connector (see the module docstring)."""

    def __init__(self, db: Connector) -> None:
        self.db = db
        #: (statement, PGMQ queue) -> the statement composed for that queue's tables
        self._statements: dict[tuple[str, str], bytes] = {}
        #: Reads of one queue go straight to PGMQ's tables (statement ``read_queue``);
        #: False once the role turned out not to have the privileges for it.
        self.direct_reads = True
        #: PGMQ queues known to be limited (migration 0021): read through
        #: ``kombu_pgmq.read``, never statement ``read_queue``; learned from each read.
        self.limited: set[str] = set()
        #: Those of them with key limits: read through ``kombu_pgmq.read`` only.
        self.keyed: set[str] = set()
        #: Publishes without deduplication go straight into PGMQ's queue tables
        #: (statement ``send_queue``): on the transport's own connection only (in the
        #: application's transaction the wake-up waits for its commit), and until the
        #: role turns out not to have the privileges for it.
        self.direct_writes = not isinstance(db, ExternalConnector)
        #: Direct publishes (statement ``send_queue``) that a waiting consumer gets now
        #: reach it (a NOTIFY, a hand-over) before their WAL flush and return after it
        #: (transport option ``visible_before_flush``; :meth:`_flushed`).
        self.visible_before_flush = False
        #: Where the reads of each queue start their walk of the vt index.
        self.positions = ReadPositions()

    def database_identity(self) -> tuple[str, Any]:
        """``(database name, server start time)`` of the database this connection
        reaches: two connections with the same identity reach the same database."""
        return tuple(self.db.fetch("database_identity")[0])  # type: ignore[return-value]

    # -- messages --------------------------------------------------------------------

    def send(
        self,
        queue: str,
        message: str,
        headers: str,
        delay_seconds: int = 0,
        *,
        deduplication_window: float = 300.0,
        deduplicated: bool = True,
        flush: bool = True,
    ) -> int | None:
        """Publish one message (``message``/``headers`` are JSON text); return its msg_id,
        or None when it carries a deduplication id already used within
        ``deduplication_window`` seconds (nothing was sent).

        ``flush=False``: commit without waiting for the WAL flush (transport option
        ``confirm_publish=False``; a server crash may forget it).

        ``deduplicated=False``: the caller knows the message has no deduplication id
        (no ``x-deduplication-id`` header, the queue has no ``x-deduplicate-task-id``);
        on the transport's own connection it is then written straight into the queue
        table (statement ``send_queue``, plan-cached).

        Raises:
            QueueNotFound: the queue does not exist.
            InvalidJsonBody: PostgreSQL rejected ``message`` as JSON.
        """
        if not deduplicated and self.direct_writes:
            try:
                return self._send_queue(queue, message, headers, max(delay_seconds, 0), flush)
            except PermissionDenied:
                # a least-privilege role publishes through kombu_pgmq.publish from now on
                self.direct_writes = False
        params = {
            "queue": queue,
            "message": message,
            "headers": headers,
            "delay_seconds": max(delay_seconds, 0),
            "deduplication_window": deduplication_window,
        }
        rows: list[Any] = self.db.fetch("send", params, synchronous=flush)
        return None if not rows or rows[0][0] is None else int(rows[0][0])

    def read(self, queue: str, vt_seconds: int, qty: int) -> Reads:
        """Deliver up to ``qty`` visible messages, invisible for ``vt_seconds`` afterwards
        (within the queue's limits, if it has any: ``Reads.limits``)."""
        positions, stamp = self.positions.positions([queue])
        params = {
            "queue": queue,
            "vt_seconds": vt_seconds,
            "qty": qty,
            "positions": Jsonb(positions),
            "stamp": stamp,
        }
        reads = self._positioned(self.db.fetch("read", params, PositionedRow, synchronous=None))
        self._learn_limits([queue], reads, complete=len(reads) < qty)
        return reads

    def read_many(
        self,
        queues: Sequence[str],
        vt_seconds: int,
        qty: int,
        acks: Sequence[Receipt] = (),
        *,
        durable_acks: bool = True,
    ) -> Reads:
        """Archive ``acks`` (receipts; a stale one is not applied and the server's notice
        is logged), then deliver up to ``qty`` messages
        from ``queues`` in the order given, all in one round trip and one transaction
        (each row names its ``queue``). A limited queue (migration 0021) delivers no
        more than its limits allow; ``Reads.limits`` says what they did.

        The commit is asynchronous unless there are acks and ``durable_acks``: a server
        crash may then forget the deliveries and acks, and those messages are delivered
        again (never lost).

        Raises:
            QueueNotFound: one of the queues is gone (nothing was archived or read).
        """
        if (
            self.direct_reads
            and len(queues) == 1
            and queues[0] not in self.keyed
            and all(a.queue == queues[0] for a in acks)
        ):
            try:
                reads = self._read_queue(queues[0], vt_seconds, qty, acks, durable_acks)
            except PermissionDenied:
                # A least-privilege role (kombu-pgmq schema grant worker) may use PGMQ's
                # tables only through kombu_pgmq's functions: read through them from now on.
                self.direct_reads = False
            else:
                if reads is not None:
                    return reads
                acks = ()  # applied; the queue has key limits: read through kombu_pgmq.read
        params = {
            "queues": list(queues),
            "vt_seconds": vt_seconds,
            "qty": qty,
            "ack_queues": [a.queue for a in acks],
            "ack_ids": [a.msg_id for a in acks],
            "ack_cts": [a.read_ct for a in acks],
            "ack_enqueued": [a.enqueued_at for a in acks],
            "durable_acks": durable_acks,
        }
        holds = slot_holds(acks)
        params["ack_holds"], params["hold_seconds"] = holds["holds"], holds["hold_seconds"]
        positions, params["stamp"] = self.positions.positions(queues if qty else ())
        params["positions"] = Jsonb(positions)
        # kombu_pgmq.read sets synchronous_commit itself
        rows = self.db.fetch("read_many", params, PositionedRow, synchronous=None)
        reads = self._positioned(rows)
        self._learn_limits(queues, reads, complete=len(reads) < qty)
        return reads

    def _positioned(self, rows: Sequence[PositionedRow]) -> Reads:
        """The rows of ``kombu_pgmq.read``: its position rows advance the positions of
        their queues, the rest are :meth:`Reads.of`."""
        messages: list[Row] = []
        for r in rows:
            if r.snapshot is not None:
                self.positions.advance(r.queue, ReadPosition.of(r))
            else:
                messages.append(
                    Row(
                        r.msg_id,  # type: ignore[arg-type]  # None: a limited queue's marker
                        r.read_ct or 0,
                        r.message or "",
                        r.headers,
                        r.age_seconds,  # type: ignore[arg-type]
                        r.queue,
                        r.enqueued_at,
                    )
                )
        return Reads.of(messages)

    def _learn_limits(self, queues: Sequence[str], reads: Reads, *, complete: bool) -> None:
        """Remember which of ``queues`` are limited (their reads skip statement
        ``read_queue``, their acks wake waiting consumers). ``complete``: every queue was
        read (the read was not filled), so one without a marker is not limited."""
        limited = self.limited
        limited.update(reads.limits)
        if complete and limited:
            gone = [q for q in queues if q not in reads.limits]
            limited.difference_update(gone)
            self.keyed.difference_update(gone)

    def _commit_mode(self, flush: bool) -> str | None:
        """Statement ``send_queue``'s ``commit`` parameter: ``"async"`` without the WAL
        flush (``confirm_publish=False``), ``"off"`` with ``visible_before_flush``, else
        None (the session's ``synchronous_commit``)."""
        if not flush:
            return "async"
        return "off" if self.visible_before_flush else None

    def _send_queue(
        self, queue: str, message: str, headers: str, delay_seconds: int, flush: bool = True
    ) -> int:
        params = {
            "queue": queue,
            "message": message,
            "headers": headers,
            "delay_seconds": delay_seconds,
            "handoff": handoff.tail(message, headers, delay_seconds),
            "commit": self._commit_mode(flush),
        }
        rows: list[SentRow] = self._fetch_direct(
            "send_queue", queue, lambda: self._compose_send_queue(queue), params, SentRow
        )
        return int(self._flushed(rows)[0].msg_id)

    def _flushed(self, rows: list[SentRow]) -> list[SentRow]:
        """``rows`` of statement ``send_queue``, once the publish is on disk: when it
        committed without waiting for the WAL flush (its column ``flush``: a waiting
        consumer got it), statement ``flush_commits`` waits for that flush first. A role
        that may not run it (a managed server that revoked ``pg_logical_emit_message``
        from PUBLIC) turns ``visible_before_flush`` off, with a warning naming the fix."""
        if rows and rows[0].flush:
            try:
                self.db.execute("flush_commits")
            except PermissionDenied as exc:
                # The publish is committed (asynchronously): the WAL writer flushes it
                # within wal_writer_delay. Later publishes commit synchronously.
                self.visible_before_flush = False
                logger.warning(
                    "kombu_pgmq: visible_before_flush is off for this connection from now "
                    "on: this role may not run pg_logical_emit_message (statement "
                    "flush_commits: %s). GRANT EXECUTE ON FUNCTION "
                    "pg_logical_emit_message(boolean, text, text) (PostgreSQL 17+: "
                    "(boolean, text, text, boolean)) TO the role, or set the transport "
                    "option visible_before_flush=False",
                    exc,
                )
        return rows

    def _compose_send_queue(self, queue: str, *, routed: bool = False) -> sql.Composed:
        """Statement ``send_queue`` for ``queue``'s table; ``routed``: guarded by the
        routing version (statement ``routed_guard``)."""
        guard = self.db.statement("routed_guard") if routed else ""
        table = f"pgmq.q_{queue}"
        touch = "last_read_at" in set(self.db.column("table_columns", {"table": table}))
        return sql.SQL(self.db.statement("send_queue")).format(
            queue_table=sql.Identifier("pgmq", f"q_{queue}"),
            routed=sql.SQL(guard),
            handed_columns=sql.SQL(self.db.statement("send_handed_columns") if touch else ""),
            handed_values=sql.SQL(self.db.statement("send_handed_values") if touch else ""),
        )

    def _read_queue(
        self, queue: str, vt_seconds: int, qty: int, acks: Sequence[Receipt], durable_acks: bool
    ) -> Reads | None:
        """:meth:`read_many` of one queue: statement ``read_queue`` on PGMQ's tables (one
        plan-cached statement; see sql/queries.sql), or ``read_limited_queue`` for a
        limited one. None: the acks are applied, but the queue has key limits (read it
        through ``kombu_pgmq.read``)."""
        # acks holding slots ride with read_limited_queue (which reads an unlimited queue
        # as read_queue does)
        limited = queue in self.limited or any(a.hold_seconds for a in acks)
        delivered, settled = self._read_queue_settled(
            queue, vt_seconds, qty, acks, durable_acks=durable_acks, limited=limited
        )
        if len(settled) < len(acks):
            logger.warning(
                "kombu_pgmq: %d stale ack(s) not applied (the message was delivered again "
                "after its visibility timeout, or is gone)",
                len(acks) - len(settled),
            )
        throttle = delivered.limits.get(queue)
        if throttle is None:
            if limited:  # its limits were cleared
                self.limited.discard(queue)
            return delivered
        self.limited.add(queue)
        if throttle.state == KEY_LIMITED:
            self.keyed.add(queue)
            return None
        if not limited:  # limited since we last looked: nothing was read, read within limits
            return self._read_queue(queue, vt_seconds, qty, (), durable_acks)
        return delivered

    def _read_queue_settled(
        self,
        queue: str,
        vt_seconds: int,
        qty: int,
        acks: Sequence[Receipt],
        *,
        durable_acks: bool,
        limited: bool = False,
    ) -> tuple[Reads, list[int]]:
        """Statement ``read_queue`` (``limited``: ``read_limited_queue``): (rows delivered,
        msg_ids of the acks applied). ``Reads.limits`` has the marker of a limited queue
        (``read_queue`` delivers nothing from one)."""
        durable = bool(acks) and durable_acks  # else a crash may forget it: redelivered
        params = {
            "queue": queue,
            "vt_seconds": vt_seconds,
            "qty": qty,
            "ack_ids": [a.msg_id for a in acks],
            "ack_cts": [a.read_ct for a in acks],
            "ack_enqueued": [a.enqueued_at for a in acks],
            # the commit mode of the statement's own transaction (no session SET)
            "commit": None if durable else "off",
            **slot_holds(acks),
            **(self.positions.params(queue) if qty else _NO_SCAN),
        }
        if limited:
            name = "read_limited_queue"
        else:  # the read alone plans in a third of the time (sql/queries.sql)
            name = "read_queue" if acks else "read_queue_without_acks"
        try:
            rows = self._fetch_direct(
                name,
                queue,
                lambda: self._compose_read_queue(queue, name),
                params,
                ReadRow,
                synchronous=True if durable else None,
            )
        except QueueNotFound:
            self.positions.forget(queue)
            raise
        delivered = Reads(
            Row(
                r.msg_id,
                r.read_ct,
                r.message or "",
                r.headers,
                r.age_seconds or 0.0,
                queue,
                r.enqueued_at,
            )
            for r in rows
            if r.acked is False and r.msg_id is not None
        )
        for r in rows:
            if r.snapshot is not None:
                if qty:
                    self.positions.advance(queue, ReadPosition.of(r))
            elif r.msg_id is None:
                delivered.limits[queue] = Throttle(r.read_ct, r.age_seconds)
        return delivered, [int(r.msg_id) for r in rows if r.acked]

    def _compose_read_queue(
        self, queue: str, name: str = "read_queue", *, wake: bool = False
    ) -> sql.Composed:
        """Statement ``read_queue`` (or ``ack_queue``, ``archive_expired``) for
        ``queue``'s tables (the columns differ between PGMQ versions: PGMQ < 1.11 has no
        last_read_at). ``wake``: ``ack_queue`` wakes the consumers waiting on the queue
        (a limited queue's settled message frees its slot)."""
        queue_table, archive_table = f"q_{queue}", f"a_{queue}"
        present = set(self.db.column("table_columns", {"table": f"pgmq.{queue_table}"}))
        archived = set(self.db.column("table_columns", {"table": f"pgmq.{archive_table}"}))
        columns = [c for c in _ARCHIVE_COLUMNS if c in present and c in archived]
        touch = self.db.statement("read_touch_last_read_at") if "last_read_at" in present else ""
        marks = sql.SQL(self.db.statement("expired_marks"))
        marked = sql.SQL(self.db.statement("expired_headers")).format(marks=marks)
        return sql.SQL(self.db.statement(name)).format(
            queue_table=sql.Identifier("pgmq", queue_table),
            archive_table=sql.Identifier("pgmq", archive_table),
            archive_columns=sql.SQL(", ").join(map(sql.Identifier, columns)),
            archive_values=sql.SQL(", ").join(
                marked if c == "headers" else sql.Identifier(c) for c in columns
            ),
            marks=marks,
            touch=sql.SQL(touch),
            last_read_at=sql.SQL("a.last_read_at" if "last_read_at" in columns else "NULL"),
            wake=sql.SQL(self.db.statement("ack_wake") if wake else ""),
            hold=self._hold_cte(name, wake),
            commit_mode=sql.SQL(self.db.statement("read_commit_mode")),
        )

    def _hold_cte(self, name: str, limited: bool) -> sql.Composable:
        """The ``{hold}`` of statement ``name``: ``hold_slots_cte`` in
        ``read_limited_queue`` and in ``ack_queue`` of a limited queue (with its $n
        placeholders), else nothing."""
        if name == "read_limited_queue":
            places = ("%(queue)s", "%(hold_ids)s", "%(hold_seconds)s")
        elif name == "ack_queue" and limited:
            places = ("$5", "$6", "$7")
        else:
            return sql.SQL("")
        queue, hold_ids, hold_seconds = map(sql.SQL, places)
        return sql.SQL(self.db.statement("hold_slots_cte")).format(
            queue=queue, hold_ids=hold_ids, hold_seconds=hold_seconds
        )

    def _fetch_direct(
        self,
        name: str,
        queue: str,
        compose: Callable[[], sql.Composable],
        params: dict[str, Any],
        row: Any = None,
        *,
        synchronous: bool | None = True,
    ) -> list[Any]:
        """Run direct statement ``name`` on ``queue``'s tables: composed (and turned into
        bytes) once per queue, forgotten when the queue turns out to be gone (composed
        again if it comes back).

        Raises:
            QueueNotFound: the queue's tables do not exist.
            PermissionDenied: the role has no rights on PGMQ's tables.
        """
        key = (name, queue)
        statement = self._statements.get(key)
        if statement is None:
            statement = self._statements[key] = compose().as_bytes(self.db.connection)
        try:
            return self.db.fetch(statement, params, row, synchronous=synchronous)
        except QueueNotFound:
            self._statements.pop(key, None)
            raise

    def pop(self, queue: str, qty: int) -> list[Row]:
        """Deliver and delete up to ``qty`` visible messages (no ack will follow)."""
        return self.db.fetch("pop", {"queue": queue, "qty": qty}, Row)

    def ack(self, receipts: Sequence[Receipt], *, durable: bool = True) -> set[tuple[str, int]]:
        """Archive the messages these deliveries still hold; return the ``(queue, msg_id)``
        settled (a stale receipt is left out, nothing is applied for it).
        ``durable=False`` commits asynchronously (a server crash may forget the ack)."""
        if (
            self.direct_reads
            and receipts
            and receipts[0].queue not in self.limited  # kombu_pgmq.ack wakes its consumers
            and not any(r.hold_seconds for r in receipts)  # and holds slots
            and all(r.queue == receipts[0].queue for r in receipts)
        ):
            # one queue: statement read_queue reading nothing (plan-cached, no EXECUTE)
            try:
                _, settled = self._read_queue_settled(
                    receipts[0].queue, 0, 0, receipts, durable_acks=durable
                )
                return {(receipts[0].queue, msg_id) for msg_id in settled}
            except PermissionDenied:
                self.direct_reads = False
        holds = slot_holds(receipts)
        rows = self.db.fetch(
            "ack" if durable else "ack_async",
            {**receipt_handles(receipts), **holds},
            Renewed,
            synchronous=True if durable else None,  # ack_async sets it off itself
        )
        return {(r.queue, int(r.msg_id)) for r in rows}

    def requeue(
        self, receipts: Sequence[Receipt], vt_seconds: int = 0, *, uncount: bool = False
    ) -> set[tuple[str, int]]:
        """Make messages these deliveries still hold visible in ``vt_seconds`` (0: now);
        ``uncount``: count the delivery as a restore (header ``x-kombu-restored``; the
        application never ran it, so it does not count toward ``max_deliveries``;
        ``read_ct`` is left alone, migration 0015). Returns the ``(queue, msg_id)``
        settled."""
        params = {**receipt_handles(receipts), "vt_seconds": vt_seconds, "uncount": uncount}
        settled = {(r.queue, int(r.msg_id)) for r in self.db.fetch("requeue", params, Renewed)}
        if vt_seconds <= 0:  # back to their place, below where the reads start
            for queue in {q for q, _ in settled}:
                self.positions.forget(queue)
        return settled

    def discard(self, receipts: Sequence[Receipt]) -> list[int]:
        """Delete, for good (no archive), the messages these deliveries still hold
        (what a no_ack consumer was handed); return the ids deleted.
        ``receipts`` are of one queue."""
        if not receipts:
            return []
        params = {"queue": receipts[0].queue, **receipt_handles(receipts)}
        return [int(i) for i in self.db.column("discard", params)]

    def archive_expired(self, receipts: Sequence[Receipt]) -> list[int]:
        """Move the expired messages these deliveries still hold to the archive, with the
        headers ``x-archive-reason: expired`` and ``x-expired-at`` (statement
        ``archive_expired``); return the ids archived. A role without rights on PGMQ's
        tables (least privilege) archives them through ``kombu_pgmq.archive_expired``
        (migration 0019), marked the same.
        ``receipts`` are of one queue; a queue that is gone archives nothing."""
        if not receipts:
            return []
        queue = receipts[0].queue
        if self.direct_reads:
            params = {"queue": queue, **receipt_handles(receipts)}
            try:
                rows = self._fetch_direct(
                    "archive_expired",
                    queue,
                    lambda: self._compose_read_queue(queue, "archive_expired"),
                    params,
                )
            except QueueNotFound:
                return []
            except PermissionDenied:
                self.direct_reads = False  # a least-privilege role
            else:
                return [int(r[0]) for r in rows]
        rows = self.db.fetch("archive_expired_rows", receipt_handles(receipts), Renewed)
        return sorted(int(r.msg_id) for r in rows)

    def renew(self, held: Sequence[Receipt], vt_seconds: int) -> set[tuple[str, int]]:
        """Extend the leases of held messages (receipts) to now + ``vt_seconds``, in one
        round trip. Returns the ``(queue, msg_id)`` renewed; the others lost their lease
        (read again elsewhere after their visibility timeout passed, or gone)."""
        params = {**receipt_handles(held), "vt_seconds": vt_seconds}
        return {(r.queue, int(r.msg_id)) for r in self.db.fetch("renew", params, Renewed)}

    def dead_letter(
        self,
        queue: str,
        receipts: Sequence[Receipt],
        *,
        dead_letter_queue: str,
        reason: str,
        kombu_queue: str,
        errors: Sequence[str | None] | None = None,
    ) -> list[int]:
        """Atomically move the messages these deliveries (of ``queue``) still hold to
        ``dead_letter_queue``.

        The moved copy keeps message and headers and gains an ``x-dead-letter`` header:
        ``{"queue", "pgmq_queue", "msg_id", "read_ct", "reason", "enqueued_at",
        "dead_lettered_at"}``, plus ``"error"`` where ``errors`` gives one (aligned with
        ``receipts``, e.g. why a row could not be decoded). Returns the new msg_ids in the
        dead-letter queue.

        Raises:
            QueueNotFound: ``dead_letter_queue`` does not exist (nothing was moved).
        """
        params = {
            "queue": queue,
            **receipt_handles(receipts),
            "dead_letter_queue": dead_letter_queue,
            "reason": reason,
            "kombu_queue": kombu_queue,
            "errors": list(errors) if errors is not None else [None] * len(receipts),
        }
        return [int(i) for i in self.db.column("dead_letter", params)]

    def send_routed(
        self,
        queues: Sequence[str],
        message: str,
        headers: str,
        *,
        version: int,
        delay_seconds: int = 0,
        deduplication_window: float = 300.0,
        deduplicated: bool = True,
        flush: bool = True,
    ) -> tuple[int | None, list[int | None]]:
        """Send one message to several PGMQ queues in one statement, if the routing version
        is still ``version``. Returns ``(current_version, msg_ids)``; when the versions
        differ nothing was sent (``current_version`` None: it moved, to a version not
        read). ``delay_seconds > 0``: visible only after that long. ``flush=False``: as
        for :meth:`send`.

        ``deduplicated=False``: the caller knows the message has no deduplication id in
        any of ``queues``; to one queue, on the transport's own connection, it is then
        written by statement ``send_queue`` guarded by the version (``routed_guard``,
        plan-cached), else by ``kombu_pgmq.publish_routed``.

        Raises:
            QueueNotFound: one of the queues is gone (nothing was sent).
        """
        if not deduplicated and self.direct_writes and len(queues) == 1:
            try:
                return self._send_routed_queue(
                    queues[0], message, headers, version, delay_seconds, flush
                )
            except PermissionDenied:
                # a least-privilege role publishes through kombu_pgmq.publish_routed
                self.direct_writes = False
        params = {
            "queues": list(queues),
            "message": message,
            "headers": headers,
            "version": version,
            "delay_seconds": delay_seconds,
            "deduplication_window": deduplication_window,
        }
        row = self.db.fetch("send_routed", params, VersionRow, synchronous=flush)[0]
        return int(row.version), list(row.msg_ids)

    def _send_routed_queue(
        self,
        queue: str,
        message: str,
        headers: str,
        version: int,
        delay_seconds: int,
        flush: bool = True,
    ) -> tuple[int | None, list[int | None]]:
        """:meth:`send_routed` to one queue: statement ``send_queue`` + ``routed_guard``."""
        params = {
            "queue": queue,
            "message": message,
            "headers": headers,
            "delay_seconds": max(delay_seconds, 0),
            "version": version,
            "handoff": handoff.tail(message, headers, delay_seconds),
            "commit": self._commit_mode(flush),
        }
        rows: list[SentRow] = self._fetch_direct(
            "send_routed_queue",
            queue,
            lambda: self._compose_send_queue(queue, routed=True),
            params,
            SentRow,
        )
        rows = self._flushed(rows)
        if not rows:
            return None, []
        return version, [int(rows[0].msg_id)]
