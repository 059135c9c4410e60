"""Publishes gathered and sent in one statement (statement ``send_many``), inside an
application's transaction: what a beat tick of many entries publishes
(:meth:`kombu_pgmq.transactional.Binding.batched`).

A :class:`BatchedPublisher` stands in for the :class:`~kombu_pgmq._db.broker.Broker` of a
bound connection: ``send`` and ``send_routed`` record the message and answer as if it were
sent (a msg_id of 0: deduplication is decided at :meth:`BatchedPublisher.flush`, so a
duplicate is dropped there without a log line); :meth:`~BatchedPublisher.flush` sends
every recorded message in order, in ``kombu_pgmq.publish_many``: as
the one-by-one statements do (the queues' shared locks, deduplication, delays), waking
waiting consumers once per queue. A publish recorded while
:attr:`BatchedPublisher.visible_at` is set stays invisible until that instant.

Errors: :meth:`~BatchedPublisher.flush` raises what the statements raise
(:func:`kombu_pgmq.errors.translate`) and :class:`~kombu_pgmq.errors.StatementError` when
the routing table changed after a routed publish was recorded (nothing was sent: the
transaction is to be rolled back and repeated, as any failed statement in it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from ..errors import StatementError
from .broker import Broker

__all__ = ["BatchedPublisher"]


class BatchedPublisher(Broker):
    """Records publishes; :meth:`flush` sends them in one statement."""

    def __init__(self, broker: Broker) -> None:
        super().__init__(broker.db)
        #: One JSON object per message, composed as text (message and headers are JSON
        #: text already: they are not parsed again).
        self._items: list[str] = []
        self._version: int | None = None
        #: When set, the next publishes stay invisible until this instant (sub-second:
        #: ``pgmq.send``'s timestamptz delay), e.g. a beat tick published ahead of its due
        #: time. None: visible at commit (or after their ``delay_seconds``).
        self.visible_at: datetime | None = None

    def __len__(self) -> int:
        return len(self._items)

    def _record(
        self, queues: Sequence[str], message: str, headers: str, delay: int, window: float
    ) -> None:
        at = self.visible_at
        visible = "" if at is None else f', "visible_at": "{at.isoformat()}"'
        self._items.append(
            f'{{"queues": {json.dumps(list(queues))}, "message": {message}, '
            f'"headers": {headers}, "delay_seconds": {max(int(delay), 0)}, '
            f'"deduplication_window": {float(window)!r}{visible}}}'
        )

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
        deduplicated: bool = True,
        flush: bool = True,
    ) -> tuple[int | None, list[int | None]]:
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
        n = len(self._items)
        if not n:
            return 0
        params = {"batch": "[" + ",".join(self._items) + "]", "version": self._version}
        self._items, self._version = [], None
        sent = self.db.scalar("send_many", params)
        if not sent:
            raise StatementError(
                "the routing table changed during a batched publish: nothing was sent; roll "
                "the transaction back and publish again"
            )
        return n
