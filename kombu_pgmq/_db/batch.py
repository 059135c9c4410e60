"""Publishes gathered and sent in one statement (statement ``send_many``), inside an
application's transaction: what a beat tick of many entries publishes
(:meth:`kombu_pgmq.transactional.Binding.batched`).

A :class:`BatchedPublisher` stands in for the :class:`~kombu_pgmq._db.broker.Broker` of a
bound connection: ``send`` and ``send_routed`` record the message and answer as if it were
sent (a msg_id of 0: deduplication is decided at :meth:`BatchedPublisher.flush`, so a
duplicate is dropped there without a log line); :meth:`~BatchedPublisher.flush` sends
every recorded message in order, each through ``kombu_pgmq.send_to`` as the one-by-one
statements do (deduplication, NOTIFY of waiting consumers, delays).

Errors: :meth:`~BatchedPublisher.flush` raises what the statements raise
(:func:`kombu_pgmq.errors.translate`) and :class:`~kombu_pgmq.errors.StatementError` when
the routing table changed after a routed publish was recorded (nothing was sent: the
transaction is to be rolled back and repeated, as any failed statement in it).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import StatementError
from .broker import Broker

__all__ = ["BatchedPublisher"]


class BatchedPublisher(Broker):
    """Records publishes; :meth:`flush` sends them in one statement."""

    def __init__(self, broker: Broker) -> None:
        super().__init__(broker.db)
        self.direct_writes = False
        self._queues: list[str] = []
        self._messages: list[str] = []
        self._headers: list[str] = []
        self._delays: list[int] = []
        self._windows: list[float] = []
        self._version: int | None = None

    def __len__(self) -> int:
        return len(self._messages)

    def _record(
        self, queues: Sequence[str], message: str, headers: str, delay: int, window: float
    ) -> None:
        self._queues.append(",".join(queues))
        self._messages.append(message)
        self._headers.append(headers)
        self._delays.append(max(int(delay), 0))
        self._windows.append(float(window))

    def send(
        self,
        queue: str,
        message: str,
        headers: str,
        delay_seconds: int = 0,
        *,
        deduplication_window: float = 300.0,
        deduplicated: bool = True,
    ) -> int | None:
        self._record([queue], message, headers, delay_seconds, deduplication_window)
        return 0

    def send_routed(
        self,
        queues: Sequence[str],
        message: str,
        headers: str,
        *,
        version: int,
        delay_seconds: int = 0,
        deduplication_window: float = 300.0,
    ) -> tuple[int, list[int | None]]:
        if self._version is not None and version != self._version:
            self.flush()  # routes of another version: what was recorded goes first
        self._version = version
        self._record(queues, message, headers, delay_seconds, deduplication_window)
        return version, [0] * len(queues)

    def flush(self) -> int:
        """Send what was recorded (in order, one statement); how many messages.

        Raises:
            StatementError: the routing table moved since a routed publish was recorded
                (nothing was sent).
        """
        n = len(self._messages)
        if not n:
            return 0
        params = {
            "queues": self._queues,
            "messages": self._messages,
            "headers": self._headers,
            "delay_seconds": self._delays,
            "windows": self._windows,
            "version": self._version,
        }
        sent = self.db.scalar("send_many", params)
        self._queues, self._messages, self._headers = [], [], []
        self._delays, self._windows, self._version = [], [], None
        if not sent:
            raise StatementError(
                "the routing table changed during a batched publish: nothing was sent; roll "
                "the transaction back and publish again"
            )
        return n
