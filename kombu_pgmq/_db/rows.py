"""Rows and receipts of the broker's statements (:mod:`kombu_pgmq._db.broker`): what a
read returns, a delivery's receipt handle, a queue's stored arguments, the routing table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

__all__ = [
    "KEY_LIMITED",
    "THROTTLED_RATE",
    "THROTTLED_SETTLE",
    "QueueArgs",
    "QueueInfo",
    "ReadRow",
    "Reads",
    "Receipt",
    "Renewed",
    "RoutingRow",
    "RoutingTable",
    "Row",
    "SentRow",
    "Throttle",
    "VersionRow",
    "receipt_handles",
    "slot_holds",
    "text_array",
    "to_queue_info",
]


class Row(NamedTuple):
    """One delivered message: ``message`` and ``headers`` are JSON text (headers may be
    None); ``age_seconds`` is the time since it was sent, by the server's clock; ``queue``
    the PGMQ queue it was read from; ``enqueued_at`` its send time (with ``msg_id`` and
    ``read_ct``, the receipt of this delivery)."""

    msg_id: int
    read_ct: int
    message: str
    headers: str | None
    age_seconds: float
    queue: str = ""
    enqueued_at: datetime | None = None


#: :attr:`Throttle.state` of a read a limit held back until a message settles (an ack
#: wakes waiting consumers).
THROTTLED_SETTLE = 1
#: :attr:`Throttle.state` of a read a rate limit held back until its tokens refill.
THROTTLED_RATE = 2
#: :attr:`Throttle.state` of statement ``read_limited_queue`` on a queue with key limits:
#: nothing read, read it through ``kombu_pgmq.read``.
KEY_LIMITED = 3


class Throttle(NamedTuple):
    """What the limits of a limited queue did to one read of one of its PGMQ queues
    (the marker rows of ``kombu_pgmq.read_limited``): ``state`` 0 (not
    throttled), :data:`THROTTLED_SETTLE` or :data:`THROTTLED_RATE`; ``retry_seconds``:
    when the rate allows the next delivery (seconds from the read; None: not rate
    throttled)."""

    state: int
    retry_seconds: float | None = None


class Reads(list[Row]):
    """The rows a read delivered, and :attr:`limits`: ``{PGMQ queue: Throttle}`` for
    every limited queue read (a queue left out is not limited)."""

    limits: dict[str, Throttle]

    def __init__(self, rows: Iterable[Row] = (), limits: dict[str, Throttle] | None = None):
        super().__init__(rows)
        self.limits = limits or {}

    @classmethod
    def of(cls, rows: Iterable[Row]) -> Reads:
        """Split a read's result: message rows, and marker rows (``msg_id`` NULL)."""
        reads = cls()
        for row in rows:
            if row.msg_id is None:
                reads.limits[row.queue] = Throttle(int(row.read_ct or 0), row.age_seconds)
            else:
                reads.append(row)
        return reads


class Receipt(NamedTuple):
    """A receipt handle (SQS's model): one delivery of one message. Settling it (ack,
    requeue, dead-letter, lease renewal) touches the row only while this delivery still
    holds it: same ``msg_id``, same ``read_ct`` (not read again since) and same
    ``enqueued_at`` (not a new message that reused the id of an UNLOGGED queue emptied by
    a crash). ``hold_seconds`` (acks only): the delivery's task runs on
    after this ack (Celery's early ack), so the ack holds its concurrency slot that long
    (renewed while the task runs); 0: nothing is held."""

    queue: str
    msg_id: int
    read_ct: int
    enqueued_at: datetime | None
    hold_seconds: int = 0


def receipt_handles(receipts: Sequence[Receipt]) -> dict[str, list[Any]]:
    return {
        "queues": [r.queue for r in receipts],
        "msg_ids": [r.msg_id for r in receipts],
        "read_cts": [r.read_ct for r in receipts],
        "enqueued": [r.enqueued_at for r in receipts],
    }


def slot_holds(acks: Sequence[Receipt]) -> dict[str, Any]:
    """The slot holds of ``acks`` as the ack statements take them: ``holds`` aligned with
    the acks, ``hold_ids`` (the msg_ids that hold, for a statement of one queue),
    ``freed_ids`` (those that free their slot) and ``hold_seconds`` (the longest asked)."""
    return {
        "holds": [a.hold_seconds > 0 for a in acks],
        "hold_ids": [a.msg_id for a in acks if a.hold_seconds > 0],
        "freed_ids": [a.msg_id for a in acks if not a.hold_seconds],
        "hold_seconds": max((a.hold_seconds for a in acks), default=0),
    }


def text_array(values: Iterable[Any]) -> bytes:
    """A PostgreSQL array literal of ints or datetimes (text format, for
    :meth:`Connector.send_nowait`)."""
    items = (
        "NULL" if v is None else f'"{v.isoformat()}"' if isinstance(v, datetime) else str(int(v))
        for v in values
    )
    return ("{" + ",".join(items) + "}").encode()


class RoutingTable(NamedTuple):
    """Exchanges and bindings as of ``version`` (see :mod:`kombu_pgmq.transport._routing`).

    ``exchanges``: ``{exchange: type}``; ``bindings``: ``[(exchange, routing_key, queue,
    pgmq_queue)]`` where ``queue`` is the Kombu name.
    """

    version: int
    exchanges: dict[str, str]
    bindings: list[tuple[str, str, str, str]]
    #: ``{queue: (priority_floors, band_pgmq_queues)}`` of bound queues with priorities.
    bands: dict[str, tuple[list[int], list[str]]] = {}
    #: Bound queues declared with ``x-deduplicate-task-id`` (fixed at the first
    #: declaration: it changes only through a delete, which moves the version).
    deduplicated: frozenset[str] = frozenset()


class QueueInfo(NamedTuple):
    """A queue's arguments in force (as first declared): ``message_ttl_ms`` (None:
    unlimited), ``max_priority`` (None: no priorities), the priority band ``floors`` and
    the PGMQ queue of each band (None, None without priorities), ``expires_ms``
    (x-expires; None: never), ``fifo_groups`` (x-fifo-groups) and
    ``deduplicate_task_id`` (x-deduplicate-task-id)."""

    message_ttl_ms: int | None
    max_priority: int | None
    floors: list[int] | None
    band_queues: list[str] | None
    expires_ms: int | None = None
    fifo_groups: bool = False
    deduplicate_task_id: bool = False


class QueueArgs(NamedTuple):
    message_ttl_ms: int | None = None
    expires_ms: int | None = None
    max_priority: int | None = None
    priority_bands: list[int] | None = None
    band_queues: list[str] | None = None
    fifo_groups: bool = False
    deduplicate_task_id: bool = False


class RoutingRow(NamedTuple):
    version: int
    exchanges: dict[str, str]
    bindings: list[dict[str, Any]]


class SentRow(NamedTuple):
    """A row of statement ``send_queue``: the message's ``msg_id``; ``notified``, what
    the NOTIFY returned (unused); ``flush``: committed without waiting for the WAL flush
    (``visible_before_flush``: a waiting consumer got it), to be flushed before
    returning."""

    msg_id: int
    notified: str | None
    flush: bool


class VersionRow(NamedTuple):
    version: int
    msg_ids: list[int | None]


class ReadRow(NamedTuple):
    msg_id: int
    read_ct: int
    enqueued_at: datetime
    message: str | None
    headers: str | None
    age_seconds: float | None
    acked: bool | None
    #: the position row's (acked NULL): see kombu_pgmq._db.positions.ReadPosition
    snapshot: str | None = None
    read_xid: str | None = None
    read_at: float | None = None
    scan_from: float | None = None
    scanned_to: float | None = None


class PositionedRow(NamedTuple):
    """A row of ``kombu_pgmq.read``: a delivered message (see :class:`Row`), a limited
    queue's marker (``msg_id`` None, ``snapshot`` None: see :class:`Throttle`), or a
    queue's position row (``snapshot`` set: see
    :class:`kombu_pgmq._db.positions.ReadPosition`)."""

    queue: str
    msg_id: int | None
    read_ct: int | None
    enqueued_at: datetime | None
    message: str | None
    headers: str | None
    age_seconds: float | None
    snapshot: str | None = None
    read_xid: str | None = None
    read_at: float | None = None
    scan_from: float | None = None
    scanned_to: float | None = None


#: Columns pgmq.archive moves to the archive (those the tables have: PGMQ < 1.11 has no
#: last_read_at; archived_at takes its default).
class Renewed(NamedTuple):
    queue: str
    msg_id: int


def to_queue_info(args: QueueArgs) -> QueueInfo:
    return QueueInfo(
        None if args.message_ttl_ms is None else int(args.message_ttl_ms),
        None if args.max_priority is None else int(args.max_priority),
        None if args.priority_bands is None else [int(f) for f in args.priority_bands],
        None if args.band_queues is None else [str(q) for q in args.band_queues],
        None if args.expires_ms is None else int(args.expires_ms),
        bool(args.fifo_groups),
        bool(args.deduplicate_task_id),
    )
