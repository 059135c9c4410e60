"""Declarations: queues, exchanges and bindings declared, bound, sized and purged, one
typed method per named statement of ``sql/queries/queues.sql`` and
``sql/queries/routing.sql``, sent through a :class:`~kombu_pgmq._db.connector.Connector` (a
:class:`~kombu_pgmq._db.broker.Broker` has one on its connector:
``broker.declarations``). Errors as in :mod:`kombu_pgmq._db.broker`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import StatementError
from .connector import Connector
from .rows import QueueArgs, QueueInfo, RoutingRow, RoutingTable, to_queue_info

__all__ = ["Declarations"]


class Declarations:
    """Queue, exchange and binding statements over one connector."""

    def __init__(self, db: Connector) -> None:
        self.db = db

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
        fifo_groups: bool = False,
        deduplicate_task_id: bool = False,
    ) -> QueueInfo:
        """Create the PGMQ queue (idempotent; UNLOGGED if not durable) and record its Kombu
        name and arguments in ``kombu_pgmq.queues`` (the first declaration's arguments
        stay), then the PGMQ queues of its priority bands as stored. Returns the
        arguments in force."""
        params = {
            "queue": queue,
            "kombu_queue": kombu_queue,
            "durable": durable,
            "auto_delete": auto_delete,
            "expires_ms": expires_ms,
            "message_ttl_ms": message_ttl_ms,
            "max_priority": max_priority,
            "priority_bands": list(floors) if max_priority is not None and floors else None,
            "band_queues": list(band_queues) if max_priority is not None and band_queues else None,
            "fifo_groups": fifo_groups,
            "deduplicate_task_id": deduplicate_task_id,
        }
        return to_queue_info(self.db.fetch("declare_queue", params, QueueArgs)[0])

    def queue_info(self, kombu_queue: str) -> QueueInfo | None:
        """Priority arguments of a Kombu queue as stored (None: no such queue recorded)."""
        rows = self.db.fetch("queue_bands", {"kombu_queue": kombu_queue}, QueueArgs)
        return to_queue_info(rows[0])._replace(message_ttl_ms=None) if rows else None

    def drop_queue(self, queue: str, kombu_queue: str) -> bool:
        """Drop the queue, its archive, bindings and consumers; False if it did not exist."""
        return bool(self.db.scalar("drop_queue", {"queue": queue, "kombu_queue": kombu_queue}))

    def drop_transient_queue(self, kombu_queue: str) -> bool:
        """Drop the queue if it is non-durable, auto_delete or has x-expires (a worker
        role may); False if there is no such queue."""
        return bool(self.db.scalar("drop_transient_queue", {"kombu_queue": kombu_queue}))

    def lifetime(self, kombu_queue: str) -> tuple[int | None, int | None]:
        """``(x-message-ttl, x-expires)`` of a Kombu queue in milliseconds (None: not set,
        or unknown queue)."""
        rows = self.db.fetch("message_ttl", {"kombu_queue": kombu_queue}, QueueArgs)
        if not rows:
            return None, None
        info = to_queue_info(rows[0])
        return info.message_ttl_ms, info.expires_ms

    def touch_queue(self, kombu_queue: str) -> None:
        """Mark an x-expires queue used now (basic_get counts as use, as in AMQP)."""
        self.db.execute("touch_queue", {"kombu_queue": kombu_queue})

    def queue_exists(self, queue: str) -> bool:
        return bool(self.db.scalar("queue_exists", {"queue": queue}))

    def size(self, queue: str) -> int:
        """Number of ready (visible) messages."""
        return int(self.db.scalar("size", {"queue": queue}))

    def purge(self, queue: str) -> int:
        """Delete the ready messages (not the unacked ones); return how many."""
        return int(self.db.scalar("purge", {"queue": queue}))

    def binding_exists(self, exchange: str, routing_key: str, kombu_queue: str) -> bool:
        params = {"exchange": exchange, "routing_key": routing_key, "kombu_queue": kombu_queue}
        return bool(self.db.scalar("binding_exists", params))

    # -- exchanges and bindings --------------------------------------------------------

    def declare_exchange(
        self, exchange: str, type: str, *, durable: bool = True, auto_delete: bool = False
    ) -> str:
        """Declare an exchange (idempotent); return its type as stored (first one wins).

        Processes that declare a new exchange at the same moment (workers starting
        together) are safe: the one whose insert waited for another's commit finds
        nothing in its statement's snapshot and reads the row again.

        Raises:
            StatementError: it kept being deleted while declared.
        """
        params = {
            "exchange": exchange,
            "type": type,
            "durable": durable,
            "auto_delete": auto_delete,
        }
        for _ in range(3):
            stored = self.db.scalar("declare_exchange", params)
            if stored is None:  # inserted and committed by another session meanwhile
                stored = self.db.scalar("exchange_type", {"exchange": exchange})
            if stored is not None:
                return str(stored)
        raise StatementError(
            f"exchange {exchange!r} was deleted each time it was declared: declare it again"
        )

    def exchange_type(self, exchange: str) -> str | None:
        value = self.db.scalar("exchange_type", {"exchange": exchange})
        return None if value is None else str(value)

    def delete_exchange(self, exchange: str) -> None:
        """Delete an exchange and its bindings."""
        self.db.execute("delete_exchange", {"exchange": exchange})

    def bind(self, exchange: str, routing_key: str, kombu_queue: str) -> None:
        params = {"exchange": exchange, "routing_key": routing_key, "kombu_queue": kombu_queue}
        self.db.execute("bind", params)

    def unbind(self, exchange: str, routing_key: str, kombu_queue: str) -> None:
        params = {"exchange": exchange, "routing_key": routing_key, "kombu_queue": kombu_queue}
        self.db.execute("unbind", params)

    def routing_table(self) -> RoutingTable:
        """Every exchange and binding, with the routing version, from one snapshot."""
        table = self.db.fetch("routing_table", None, RoutingRow)[0]
        bindings = table.bindings
        return RoutingTable(
            int(table.version),
            dict(table.exchanges),
            [(b["exchange"], b["routing_key"], b["queue"], b["pgmq_queue"]) for b in bindings],
            {
                b["queue"]: (list(b["priority_bands"]), list(b["band_queues"]))
                for b in bindings
                if b["priority_bands"] and b["band_queues"]
            },
            frozenset(b["queue"] for b in bindings if b.get("deduplicate_task_id")),
        )

    def routing_version(self) -> int:
        """Current routing version (bumped by every exchange or binding change)."""
        return int(self.db.scalar("routing_version"))
