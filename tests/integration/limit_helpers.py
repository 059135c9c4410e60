"""Helpers of the limits tests: limits set and read back through
SQL, reads through ``kombu_pgmq.read`` as a worker sends them, Kombu consumers that hold
what they get."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from kombu import Connection, Consumer, Queue

from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.limits import LimitInfo, LimitStore

from .helpers import sql


def set_limits(dsn: str, queue: str, limits: dict[str, Any], *, replace: bool = False) -> bool:
    """``kombu_pgmq.set_queue_limits``; whether the queue is limited afterwards."""
    rows = sql(
        dsn,
        "SELECT queue FROM kombu_pgmq.set_queue_limits(%s, %s::jsonb, %s)",
        (queue, json.dumps(limits), replace),
    )
    return bool(rows)


def limits_info(dsn: str, queue: str) -> LimitInfo | None:
    with contextlib.closing(Connector(dsn)) as db:
        found = LimitStore(db).info(queue)
    return found[0] if found else None


class Read(NamedTuple):
    """One ``kombu_pgmq.read``: ``messages`` as (queue, msg_id, read_ct, headers dict),
    ``markers`` {PGMQ queue: (state, retry seconds)}."""

    messages: list[tuple[str, int, int, dict[str, Any]]]
    markers: dict[str, tuple[int, float | None]]

    def keyed(self, header: str = "x-limit-key") -> list[Any]:
        return [h.get(header) for _, _, _, h in self.messages]


def sql_read(dsn: str, queues: list[str], qty: int, vt: int = 30) -> Read:
    rows = sql(
        dsn,
        "SELECT queue, msg_id, read_ct, headers, age_seconds FROM kombu_pgmq.read(%s, %s, %s)",
        (queues, vt, qty),
    )
    messages = [(q, m, ct, json.loads(h) if h else {}) for q, m, ct, h, _ in rows if m is not None]
    markers = {q: (ct, age) for q, m, ct, _, age in rows if m is None}
    return Read(messages, markers)


def sql_ack(dsn: str, queue: str, msg_ids: list[int]) -> int:
    """Settle ``msg_ids`` of PGMQ queue ``queue`` with ``kombu_pgmq.ack`` (as a worker
    does: receipts read back from the rows); how many were settled."""
    rows = sql(
        dsn,
        f"""SELECT count(*) FROM kombu_pgmq.ack(
                (SELECT array_agg(%s::text) FROM pgmq.q_{queue} WHERE msg_id = ANY(%s)),
                (SELECT array_agg(msg_id ORDER BY msg_id) FROM pgmq.q_{queue}
                 WHERE msg_id = ANY(%s)),
                (SELECT array_agg(read_ct ORDER BY msg_id) FROM pgmq.q_{queue}
                 WHERE msg_id = ANY(%s)),
                (SELECT array_agg(enqueued_at ORDER BY msg_id) FROM pgmq.q_{queue}
                 WHERE msg_id = ANY(%s)))""",
        (queue, msg_ids, msg_ids, msg_ids, msg_ids),
    )
    return int(rows[0][0])


def in_flight(dsn: str, table: str) -> int:
    """Messages of PGMQ table ``table`` delivered with a live lease."""
    return int(
        sql(dsn, f"SELECT count(*) FROM {table} WHERE vt > clock_timestamp() AND read_ct > 0")[0][0]
    )


def insert(dsn: str, queue: str, headers_sql: str, count: int) -> None:
    """``count`` messages straight into PGMQ queue ``queue``; ``headers_sql``: a jsonb
    expression of ``g`` (1..count), e.g. ``jsonb_build_object('x-limit-key', 'k' || g)``."""
    sql(
        dsn,
        f"INSERT INTO pgmq.q_{queue} (vt, message, headers) "
        f"SELECT clock_timestamp(), jsonb_build_object('n', g), {headers_sql} "
        f"FROM generate_series(1, {int(count)}) g",
    )


class Holder:
    """A Kombu consumer on one connection that keeps every message it gets until told to
    ack (``got``: in delivery order, each with the monotonic time it arrived)."""

    def __init__(self, conn: Connection, queues: list[Queue], prefetch: int = 100) -> None:
        self.conn = conn
        self.got: list[tuple[float, Any]] = []
        self.consumer = Consumer(
            conn.channel(),
            queues,
            on_message=lambda m: self.got.append((time.monotonic(), m)),
            prefetch_count=prefetch,
        )

    def __enter__(self) -> Holder:
        self.consumer.consume()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.consumer.cancel()

    def drain(self, seconds: float = 0.3) -> int:
        """Run the connection's events for about ``seconds``; how many arrived."""
        before = len(self.got)
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                self.conn.drain_events(timeout=left)
        return len(self.got) - before

    def drain_until(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.got) < count and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                self.conn.drain_events(timeout=0.2)

    @property
    def held(self) -> list[Any]:
        return [m for _, m in self.got if not m.acknowledged]

    def messages(self) -> Iterator[Any]:
        return (m for _, m in self.got)


def declare(conn: Connection, queue: str, **arguments: Any) -> None:
    """Declare Kombu queue ``queue`` (``queue_arguments``: ``arguments``)."""
    Queue(queue, routing_key=queue, queue_arguments=arguments or None)(
        conn.default_channel
    ).declare()
