"""One connection's statements through the queues' own functions
(``kombu_pgmq.read_q_<queue>``, ``ack_q_<queue>``, ``send_q_<queue>``: plan-cached, made by
``kombu_pgmq.queue_functions`` for each queue): each statement composed once per queue,
the queues whose functions this connection has called (statements through them may be
sent without waiting for their result, prepared on the connection), and a queue's
functions created when they are missing (a queue made by plain ``pgmq.create``).
Errors as in :mod:`kombu_pgmq._db.broker`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from psycopg import errors as pg_errors
from psycopg import sql

from ..errors import KombuPgmqError, QueueNotFound, StatementError
from .connector import Connector, numbered

__all__ = ["QueueFunctions"]

#: statement -> the per-queue function it calls (kombu_pgmq.<prefix>_q_<queue>)
_QUEUE_FUNCTIONS = {
    "read_queue": "read",
    "ack_queue": "ack",
    "archive_expired": "ack",
    "send_queue": "send",
}

#: The parameters of the statements :meth:`QueueFunctions.send_nowait` sends, in the
#: order they are sent ($1...).
_NOWAIT_PARAMS = {
    "ack_queue": ("ack_ids", "ack_cts", "ack_enqueued", "holds", "hold_seconds", "commit"),
    "send_queue": ("message", "headers", "delay_seconds", "handoff", "commit", "version"),
}


def _undefined_function(error: BaseException) -> bool:
    """Whether ``error`` says a function does not exist (a queue's own functions,
    dropped with the queue)."""
    return isinstance(error.__cause__, pg_errors.UndefinedFunction)


def _gone(error: BaseException) -> bool:
    """Whether ``error`` says the queue or its own function is gone."""
    return isinstance(error, QueueNotFound) or _undefined_function(error)


class QueueFunctions:
    """Statements through the queues' own functions on one connector (see the module
    docstring)."""

    def __init__(self, db: Connector) -> None:
        self.db = db
        #: (statement, PGMQ queue) -> the statement composed for that queue's function
        self._statements: dict[tuple[str, str], bytes] = {}
        #: PGMQ queues whose own functions answered a call on this connection:
        #: statements through them may be sent without waiting (:meth:`send_nowait`).
        self._called: set[str] = set()

    def statement(self, name: str, queue: str) -> bytes:
        """Statement ``name`` (``read_queue``, ``ack_queue``, ``archive_expired``,
        ``send_queue``) calling ``queue``'s own function (``kombu_pgmq.read_q_<queue>``,
        ``ack_q_<queue>`` or ``send_q_<queue>``), composed once per queue."""
        key = (name, queue)
        statement = self._statements.get(key)
        if statement is None:
            function = f"{_QUEUE_FUNCTIONS[name]}_q_{queue}"
            composed = sql.SQL(self.db.statement(name)).format(
                function=sql.Identifier("kombu_pgmq", function)
            )
            statement = self._statements[key] = composed.as_bytes(self.db.connection)
        return statement

    def fetch(
        self,
        name: str,
        queue: str,
        params: dict[str, Any],
        row: Any = None,
        *,
        synchronous: bool | None = True,
    ) -> list[Any]:
        """Run statement ``name`` through ``queue``'s own function (see
        :meth:`statement`); if the function is missing (a queue made by plain
        ``pgmq.create``), create the queue's functions and run it again.

        Raises:
            QueueNotFound: the queue does not exist.
        """
        statement = self.statement(name, queue)
        try:
            try:
                rows = self.db.fetch(statement, params, row, synchronous=synchronous)
            except StatementError as exc:
                if not _undefined_function(exc):
                    raise
                self._called.discard(queue)
                self.db.execute("queue_functions", {"queue": queue})
                rows = self.db.fetch(statement, params, row, synchronous=synchronous)
        except QueueNotFound:
            self._called.discard(queue)
            self._statements.pop((name, queue), None)  # composed again if it comes back
            raise
        self._called.add(queue)
        return rows

    def send_nowait(
        self,
        name: str,
        queue: str,
        params: Mapping[str, bytes | None],
        *,
        on_result: Callable[[list[tuple[str | None, ...]]], None],
        on_error: Callable[[KombuPgmqError], None],
    ) -> bool:
        """Send statement ``name`` (``ack_queue``, ``send_queue``) through ``queue``'s
        own function without waiting for its result
        (:meth:`~kombu_pgmq._db.connector.Connector.send_nowait`: prepared on this
        connection as ``kombu_pgmq_ack_<queue>`` or ``kombu_pgmq_send_<queue>``;
        ``params`` as text, by parameter name). ``on_result`` gets the rows and
        ``on_error`` a failure when the result is read, before the connection's next
        statement. Returns False, sending nothing, where this path does not apply (a
        queue whose functions this connection has not called yet, or that turned out to
        be gone as the statement was prepared): the caller runs the statement with
        :meth:`fetch`. A queue or function found gone is forgotten: it takes a
        :meth:`fetch` again before the next send.

        Raises:
            BrokerConnectionError: the statement could not be sent.
        """
        if queue not in self._called:
            return False
        key = (f"{name}_nowait", queue)
        order = _NOWAIT_PARAMS[name]
        statement = self._statements.get(key)
        if statement is None:
            statement = self._statements[key] = numbered(self.statement(name, queue), order)
        # PGMQ names: at most 47 of [a-z0-9_]
        prepared = f"kombu_pgmq_{_QUEUE_FUNCTIONS[name]}_{queue}"

        def failed(error: KombuPgmqError) -> None:
            if _gone(error):
                self._called.discard(queue)
                self._statements.pop(key, None)
                self.db.forget_prepared(prepared)
            on_error(error)

        try:
            self.db.send_nowait(
                prepared,
                statement,
                [params[p] for p in order],
                on_result=on_result,
                on_error=failed,
            )
        except StatementError as exc:
            if not _gone(exc):
                raise
            self._called.discard(queue)  # gone: the caller's statement says so
            self._statements.pop(key, None)
            return False
        return True
