"""Broker operations: what the transport asks of PostgreSQL, one typed method per named
statement of ``sql/queries/messages.sql``, sent through a
:class:`~kombu_pgmq._db.connector.Connector`.
The :class:`Broker`'s own methods are the messages' (publish, read, ack, requeue, dead
letters: some sent without waiting for their result); it has the connector's
:class:`~kombu_pgmq._db.declarations.Declarations` (``broker.declarations``: queues,
exchanges, bindings), :class:`~kombu_pgmq._db.queue_functions.QueueFunctions`
(``broker.queue_functions``: the statements through the queues' own functions) and
:class:`~kombu_pgmq._db.consumers.Consumers` (``broker.consumers``: consumers, wake-ups,
the reaper).

Queue names given here are PGMQ names (see :mod:`kombu_pgmq._naming`) unless a parameter
says ``kombu_queue``. Every method may raise
:class:`~kombu_pgmq.errors.BrokerConnectionError` (the connection was lost; the next call
reconnects) or :class:`~kombu_pgmq.errors.StatementError` (the statement failed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from psycopg.types.json import Jsonb

from ..errors import KombuPgmqError, PermissionDenied, QueueNotFound
from . import handoff
from .connector import Connector
from .consumers import Consumers
from .declarations import Declarations
from .external import ExternalConnector
from .positions import ReadPosition, ReadPositions
from .queue_functions import QueueFunctions
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
    text_array,
)

logger = logging.getLogger(__name__)

#: read statements' position parameters for a read of nothing (acks alone)
_NO_SCAN = {"scan_from": float("inf"), "watch_xids": [], "watch_bounds": [], "stamp": False}

__all__ = ["Broker", "QueueInfo", "Receipt", "RoutingTable", "Row"]


class Broker:
    """Typed broker operations over one connector (see the module docstring)."""

    def __init__(self, db: Connector) -> None:
        self.db = db
        #: Queues, exchanges and bindings: declared, bound, sized and purged on the same
        #: connector.
        self.declarations = Declarations(db)
        #: The statements this connector sends through the queues' own functions.
        self.queue_functions = QueueFunctions(db)
        #: Consumers, wake-ups and the reaper on the same connector.
        self.consumers = Consumers(db)
        #: PGMQ queues known to be limited, learned from each read (their acks of tasks
        #: that run on hold concurrency slots).
        self.limited: set[str] = set()
        #: Those of them with key limits: read through ``kombu_pgmq.read`` only.
        self.keyed: set[str] = set()
        #: Direct publishes (statement ``send_queue``) that a waiting consumer gets now
        #: reach it (a NOTIFY, a hand-off) before their WAL flush and return after it
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
        on the transport's own connection it is then written by the queue's send
        function (statement ``send_queue``, plan-cached; in the application's
        transaction, ``kombu_pgmq.publish`` wakes consumers at its commit).

        Raises:
            QueueNotFound: the queue does not exist.
            InvalidJsonBody: PostgreSQL rejected ``message`` as JSON.
        """
        if not deduplicated and not isinstance(self.db, ExternalConnector):
            sent = self._send_queue(queue, message, headers, max(delay_seconds, 0), flush)
            return int(sent[0].msg_id)
        params = {
            "queue": queue,
            "message": message,
            "headers": headers,
            "delay_seconds": max(delay_seconds, 0),
            "deduplication_window": deduplication_window,
        }
        rows: list[Any] = self.db.fetch("send", params, synchronous=flush)
        return None if not rows or rows[0][0] is None else int(rows[0][0])

    def send_nowait(
        self,
        queue: str,
        message: str,
        headers: str,
        delay_seconds: int,
        *,
        on_error: Callable[[KombuPgmqError], None],
    ) -> bool:
        """Publish one message without deduplication (statement ``send_queue`` through
        the queue's send function, prepared on this connection) and return without
        waiting for the server: the statement commits on its own as soon as it arrives,
        without waiting for the WAL flush (``confirm_publish=False``: a server crash may
        forget it). ``on_error`` gets a failure when the result is read, before this
        connection's next statement (the message may then not be in the queue: publish
        it again). Returns False, sending nothing, where this path does not apply (an
        application's connection, a queue whose functions this connection has not called
        yet): the caller publishes with :meth:`send`.

        Raises:
            BrokerConnectionError: the statement could not be sent.
        """
        if isinstance(self.db, ExternalConnector):
            return False
        handed = handoff.tail(message, headers, delay_seconds)
        params = {
            "message": message.encode("utf-8", "surrogatepass"),
            "headers": headers.encode("utf-8", "surrogatepass"),
            "delay_seconds": str(delay_seconds).encode(),
            "handoff": None if handed is None else handed.encode("utf-8", "surrogatepass"),
            "commit": b"async",  # without waiting for the WAL flush
            "version": None,  # a publish to the queue, not routed
        }
        return self.queue_functions.send_nowait(
            "send_queue", queue, params, on_result=_ignore, on_error=on_error
        )

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
        (each row names its ``queue``). A limited queue (``kombu_pgmq.read_limited``)
        delivers no more than its limits allow; ``Reads.limits`` says what they did.

        The commit is asynchronous unless there are acks and ``durable_acks``: a server
        crash may then forget the deliveries and acks, and those messages are delivered
        again (never lost).

        Raises:
            QueueNotFound: one of the queues is gone (nothing was archived or read).
        """
        if (
            len(queues) == 1
            and queues[0] not in self.keyed
            and all(a.queue == queues[0] for a in acks)
        ):
            reads = self._read_queue(queues[0], vt_seconds, qty, acks, durable_acks)
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
        self,
        queue: str,
        message: str,
        headers: str,
        delay_seconds: int,
        flush: bool = True,
        version: int | None = None,
    ) -> list[SentRow]:
        """Statement ``send_queue`` (``version``: a routed publish, guarded by the routing
        version); the rows once the publish is on disk (:meth:`_flushed`)."""
        params = {
            "message": message,
            "headers": headers,
            "delay_seconds": delay_seconds,
            "handoff": handoff.tail(message, headers, delay_seconds),
            "commit": self._commit_mode(flush),
            "version": version,
        }
        rows: list[SentRow] = self.queue_functions.fetch("send_queue", queue, params, SentRow)
        return self._flushed(rows)

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

    def _read_queue(
        self, queue: str, vt_seconds: int, qty: int, acks: Sequence[Receipt], durable_acks: bool
    ) -> Reads | None:
        """:meth:`read_many` of one queue, through the queue's read function
        (statement ``read_queue``). None: the acks are applied, but the queue has key
        limits (read it through ``kombu_pgmq.read``)."""
        delivered, settled = self._read_queue_settled(
            queue, vt_seconds, qty, acks, durable_acks=durable_acks
        )
        if len(settled) < len(acks):
            logger.warning(
                "kombu_pgmq: %d stale ack(s) not applied (the message was delivered again "
                "after its visibility timeout, or is gone)",
                len(acks) - len(settled),
            )
        throttle = delivered.limits.get(queue)
        if throttle is None:
            if qty:
                self.limited.discard(queue)
            return delivered
        self.limited.add(queue)
        if throttle.state == KEY_LIMITED:
            self.keyed.add(queue)
            return None
        return delivered

    def _read_queue_settled(
        self,
        queue: str,
        vt_seconds: int,
        qty: int,
        acks: Sequence[Receipt],
        *,
        durable_acks: bool,
    ) -> tuple[Reads, list[int]]:
        """Statement ``read_queue``: (rows delivered, msg_ids of the acks applied).
        ``Reads.limits`` has the marker of a limited queue."""
        durable = bool(acks) and durable_acks  # else a crash may forget it: redelivered
        params = {
            "vt_seconds": vt_seconds,
            "qty": qty,
            **self._ack_params(acks),
            # the commit mode of the statement's own transaction (no session SET)
            "commit": None if durable else "off",
            **(self.positions.params(queue) if qty else _NO_SCAN),
        }
        try:
            rows = self.queue_functions.fetch(
                "read_queue", queue, params, ReadRow, synchronous=True if durable else None
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
                self.positions.advance(queue, ReadPosition.of(r))
            elif r.msg_id is None:
                delivered.limits[queue] = Throttle(r.read_ct, r.age_seconds)
        return delivered, [int(r.msg_id) for r in rows if r.acked]

    def pop(self, queue: str, qty: int) -> list[Row]:
        """Deliver and delete up to ``qty`` visible messages (no ack will follow)."""
        return self.db.fetch("pop", {"queue": queue, "qty": qty}, Row)

    def ack(self, receipts: Sequence[Receipt], *, durable: bool = True) -> set[tuple[str, int]]:
        """Archive the messages these deliveries still hold; return the ``(queue, msg_id)``
        settled (a stale receipt is left out, nothing is applied for it).
        ``durable=False`` commits asynchronously (a server crash may forget the ack)."""
        if receipts and all(r.queue == receipts[0].queue for r in receipts):
            queue = receipts[0].queue
            params = {**self._ack_params(receipts), "commit": None if durable else "off"}
            try:
                rows = self.queue_functions.fetch(
                    "ack_queue", queue, params, synchronous=True if durable else None
                )
            except QueueNotFound:
                return set()
            return {(queue, int(r[0])) for r in rows}
        holds = slot_holds(receipts)
        rows = self.db.fetch(
            "ack" if durable else "ack_async",
            {**receipt_handles(receipts), **holds},
            Renewed,
            synchronous=True if durable else None,  # ack_async sets it off itself
        )
        return {(r.queue, int(r.msg_id)) for r in rows}

    def ack_in_transaction(self, held: Receipt, *, commit: bool = False) -> None:
        """Archive the message ``held`` (a receipt) in this connector's open transaction
        (an application's connection: :class:`~kombu_pgmq._db.external.ExternalConnector`),
        counted as settled in a transaction; it commits or rolls back with that
        transaction. ``commit``: then commit the transaction, in the same round trip (on
        a connection kombu_pgmq began the transaction of itself, with ``BEGIN``).

        Raises:
            StaleDelivery: the receipt is no longer held; the server has aborted the
                transaction (with ``commit``: it stays open, aborted; roll it back).
            TransactionError: the statement, or the commit, failed on that connection.
        """
        values = {
            "queue": held.queue,
            "msg_id": held.msg_id,
            "read_ct": held.read_ct,
            "enqueued": held.enqueued_at,
        }
        if commit:
            self.db.execute_literals("ack_in_transaction_commit", **values)
        else:
            self.db.execute("ack_in_transaction", values)

    def ack_nowait(
        self,
        receipts: Sequence[Receipt],
        *,
        durable: bool,
        on_settled: Callable[[set[tuple[str, int]]], None],
        on_error: Callable[[KombuPgmqError], None],
    ) -> bool:
        """Send the acks of one queue (receipts) without waiting for the result: the
        server archives them as soon as the statement arrives (statement ``ack_queue``
        through the queue's ack function, prepared on this connection). ``on_settled``
        gets the ``(queue, msg_id)`` settled (a stale receipt is left out) and
        ``on_error`` a failure, when the result is read: before the next statement on
        this connection. Returns False, sending nothing, where this path does not apply
        (receipts of several queues, an application's connection, a queue whose
        functions this connection has not called yet): the caller archives them with
        :meth:`ack`.

        Raises:
            BrokerConnectionError: the statement could not be sent.
        """
        if not receipts or isinstance(self.db, ExternalConnector):
            return False
        queue = receipts[0].queue
        if any(r.queue != queue for r in receipts):
            return False

        def settled(rows: list[tuple[str | None, ...]]) -> None:
            on_settled({(queue, int(r[0])) for r in rows if r[0] is not None})

        holds = slot_holds(receipts)
        params = {
            "ack_ids": text_array(r.msg_id for r in receipts),
            "ack_cts": text_array(r.read_ct for r in receipts),
            "ack_enqueued": text_array(r.enqueued_at for r in receipts),
            "holds": text_array(holds["holds"]),
            "hold_seconds": str(holds["hold_seconds"]).encode(),
            "commit": b"on" if durable else b"off",
        }
        return self.queue_functions.send_nowait(
            "ack_queue", queue, params, on_result=settled, on_error=on_error
        )

    @staticmethod
    def _ack_params(receipts: Sequence[Receipt]) -> dict[str, Any]:
        """The receipts and slot holds of statements ``read_queue``, ``ack_queue`` and
        ``archive_expired``."""
        holds = slot_holds(receipts)
        return {
            "ack_ids": [a.msg_id for a in receipts],
            "ack_cts": [a.read_ct for a in receipts],
            "ack_enqueued": [a.enqueued_at for a in receipts],
            "holds": holds["holds"],
            "hold_seconds": holds["hold_seconds"],
        }

    def requeue(
        self, receipts: Sequence[Receipt], vt_seconds: int = 0, *, uncount: bool = False
    ) -> set[tuple[str, int]]:
        """Make messages these deliveries still hold visible in ``vt_seconds`` (0: now);
        ``uncount``: count the delivery as a restore (header ``x-kombu-restored``; the
        application never ran it, so it does not count toward ``max_deliveries``;
        ``read_ct`` is left alone: it only grows). Returns the ``(queue, msg_id)``
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
        ``archive_expired``); return the ids archived.
        ``receipts`` are of one queue; a queue that is gone archives nothing."""
        if not receipts:
            return []
        params = self._ack_params(receipts)
        try:
            rows = self.queue_functions.fetch("archive_expired", receipts[0].queue, params)
        except QueueNotFound:
            return []
        return sorted(int(r[0]) for r in rows)

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
        written by the queue's send function guarded by the version (statement
        ``send_queue``, plan-cached), else by ``kombu_pgmq.publish_routed``.

        Raises:
            QueueNotFound: one of the queues is gone (nothing was sent).
        """
        if not deduplicated and len(queues) == 1 and not isinstance(self.db, ExternalConnector):
            rows = self._send_queue(
                queues[0], message, headers, max(delay_seconds, 0), flush, version
            )
            return (version, [int(rows[0].msg_id)]) if rows else (None, [])
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


def _ignore(rows: list[tuple[str | None, ...]]) -> None:
    """A publish's result: its msg_id (and whether consumers were woken); nothing to do."""
