"""Statements sent without waiting for their result (the part of
:class:`~kombu_pgmq._db.broker.Broker` that pipelines): the result is read before the
connection's next statement (:meth:`~kombu_pgmq._db.connector.Connector.send_nowait`).
Errors as in :mod:`kombu_pgmq._db.broker`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from psycopg import errors as pg_errors
from psycopg import sql

from ..errors import KombuPgmqError, QueueNotFound, StatementError
from . import handoff
from .connector import Connector
from .external import ExternalConnector
from .rows import Receipt, slot_holds, text_array

__all__ = ["Nowait"]


class Nowait:
    """Statements sent without waiting (a base of :class:`Broker`)."""

    db: Connector
    #: (statement, PGMQ queue) -> the statement composed for that queue's tables
    _statements: dict[tuple[str, str], bytes]
    _functions: set[str]

    def _queue_statement(self, name: str, queue: str) -> bytes:
        raise NotImplementedError

    def _compose_send_queue(self, queue: str, *, routed: bool = False) -> sql.Composed:
        raise NotImplementedError

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
        if queue not in self._functions or any(r.queue != queue for r in receipts):
            return False
        key = ("ack_queue_nowait", queue)
        statement = self._statements.get(key)
        if statement is None:
            composed = self._queue_statement("ack_queue", queue)
            statement = self._statements[key] = numbered(composed, _ACK_PARAMS)
        name = f"kombu_pgmq_ack_{queue}"  # PGMQ names: at most 47 of [a-z0-9_]

        def settled(rows: list[tuple[str | None, ...]]) -> None:
            on_settled({(queue, int(r[0])) for r in rows if r[0] is not None})

        def failed(error: KombuPgmqError) -> None:
            if isinstance(error, QueueNotFound) or _undefined_function(error):
                self._functions.discard(queue)
                self._statements.pop(key, None)
                self.db.forget_prepared(name)
            on_error(error)

        holds = slot_holds(receipts)
        params = [
            text_array(r.msg_id for r in receipts),
            text_array(r.read_ct for r in receipts),
            text_array(r.enqueued_at for r in receipts),
            text_array(holds["holds"]),
            str(holds["hold_seconds"]).encode(),
            b"on" if durable else b"off",
        ]
        try:
            self.db.send_nowait(name, statement, params, on_result=settled, on_error=failed)
        except StatementError as exc:
            if not (isinstance(exc, QueueNotFound) or _undefined_function(exc)):
                raise
            self._functions.discard(queue)  # gone: the caller's ack says so
            self._statements.pop(key, None)
            return False
        return True

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
        if queue not in self._functions or isinstance(self.db, ExternalConnector):
            return False
        key = ("send_queue_nowait", queue)
        statement = self._statements.get(key)
        if statement is None:
            composed = self._queue_statement("send_queue", queue)
            statement = self._statements[key] = numbered(composed, _SEND_PARAMS)
        name = f"kombu_pgmq_send_{queue}"  # PGMQ names: at most 47 of [a-z0-9_]
        handed = handoff.tail(message, headers, delay_seconds)

        def failed(error: KombuPgmqError) -> None:
            if isinstance(error, QueueNotFound) or _undefined_function(error):
                self._functions.discard(queue)
                self._statements.pop(key, None)
                self.db.forget_prepared(name)
            on_error(error)

        try:
            self.db.send_nowait(
                name,
                statement,
                [
                    message.encode("utf-8", "surrogatepass"),
                    headers.encode("utf-8", "surrogatepass"),
                    str(delay_seconds).encode(),
                    None if handed is None else handed.encode("utf-8", "surrogatepass"),
                    b"async",  # commit: without waiting for the WAL flush
                    None,  # version: a publish to the queue, not routed
                ],
                on_result=_ignore,
                on_error=failed,
            )
        except StatementError as exc:
            if not (isinstance(exc, QueueNotFound) or _undefined_function(exc)):
                raise
            self._functions.discard(queue)  # gone: the caller's send says so
            self._statements.pop(key, None)
            return False
        return True


#: The parameters of statement ``ack_queue``, in the order :meth:`Nowait.ack_nowait`
#: sends them ($1...).
_ACK_PARAMS = ("ack_ids", "ack_cts", "ack_enqueued", "holds", "hold_seconds", "commit")


def _undefined_function(error: BaseException) -> bool:
    """Whether ``error`` says a function does not exist (a queue's own functions,
    dropped with the queue)."""
    return isinstance(error.__cause__, pg_errors.UndefinedFunction)


#: The parameters of statement ``send_queue``, in the order :meth:`Nowait.send_nowait`
#: sends them ($1...).
_SEND_PARAMS = ("message", "headers", "delay_seconds", "handoff", "commit", "version")


def numbered(statement: bytes, names: Sequence[str]) -> bytes:
    """``statement`` with psycopg's named placeholders (``%(name)s``) as PostgreSQL's
    ``$1``... in the order of ``names`` (and ``%%`` as ``%``): the form a statement sent
    by :meth:`~kombu_pgmq._db.connector.Connector.send_nowait` takes.

    Raises:
        ValueError: the statement has a placeholder not in ``names``.
    """
    for number, param in enumerate(names, 1):
        statement = statement.replace(b"%(" + param.encode() + b")s", b"$%d" % number)
    if b"%(" in statement:
        raise ValueError(f"statement has placeholders not in {names}: {statement[:200]!r}")
    return statement.replace(b"%%", b"%")


def _ignore(rows: list[tuple[str | None, ...]]) -> None:
    """A publish's result: its msg_id (and whether consumers were woken); nothing to do."""
