"""The limits store: fleet-wide concurrency and rate limits of queues
(:mod:`kombu_pgmq.limits`) and the concurrency slots of tasks running after their ack, as
named statements of ``sql/queries/limits.sql`` sent through a
:class:`~kombu_pgmq._db.connector.Connector`."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from ..errors import KombuPgmqError
from .connector import Connector, numbered
from .rows import text_array

__all__ = ["LimitInfo", "LimitStore"]


class LimitInfo(NamedTuple):
    """One limited queue: its limits (None: not limited that way; rates as given and in
    messages per second, bursts in tokens with the default filled in) and their use now:
    ``in_flight`` messages (all priority bands), ``tokens`` left in its bucket,
    ``keys_in_flight`` distinct keys with a message in flight, ``keys_at_limit`` of them at
    ``key_concurrency``; ``throttled_*``: reads a limit held back, since it was set."""

    queue: str
    concurrency: int | None
    rate: str | None
    rate_per_second: float | None
    burst: float | None
    limit_key: str
    key_concurrency: int | None
    key_rate: str | None
    key_rate_per_second: float | None
    key_burst: float | None
    ordered_keys: bool
    in_flight: int
    tokens: float | None
    keys_in_flight: int
    keys_at_limit: int
    throttled_concurrency: int
    throttled_rate: int
    throttled_keys: int
    updated_at: datetime
    updated_by: str

    def as_dict(self, *, queue: bool = True) -> dict[str, Any]:
        """JSON-ready (``updated_at`` ISO 8601; ``queue=False``: without the queue name)."""
        out = self._asdict()
        out["updated_at"] = self.updated_at.isoformat()
        if not queue:
            del out["queue"]
        return out


class LimitStore:
    """Typed limit operations over one connector."""

    def __init__(self, db: Connector) -> None:
        self.db = db

    def set(self, queue: str, limits: Mapping[str, Any], *, replace: bool = False) -> bool:
        """Set Kombu queue ``queue``'s ``limits`` (validated by
        :func:`kombu_pgmq.limits.validate_limits`; None removes one; ``replace``: the
        limits not given are removed). Returns whether the queue is limited afterwards.

        Raises:
            StatementError: the queue does not exist, or a limit the server refuses (the
                message says which and why).
        """
        rows: list[Any] = self.db.fetch(
            "set_queue_limits",
            {"queue": queue, "limits": json.dumps(dict(limits)), "replace": replace},
        )
        return bool(rows)

    def info(self, queue: str | None = None) -> list[LimitInfo]:
        """Every limited queue (or only ``queue``) with its limits and their use now."""
        return self.db.fetch("limits_info", {"queue": queue}, LimitInfo)

    # -- slots held by tasks running after their ack --------------------------------------

    def renew_slots(
        self, slots: Sequence[tuple[str, int]], hold_seconds: int
    ) -> frozenset[tuple[str, int]]:
        """Push held slots ``(PGMQ queue, msg_id)`` to now + ``hold_seconds``; returns those
        still held (the others were released, or their queue dropped)."""
        params = {
            "queues": [q for q, _ in slots],
            "msg_ids": [m for _, m in slots],
            "hold_seconds": hold_seconds,
        }
        rows: list[Any] = self.db.fetch("renew_slots", params, synchronous=False)
        return frozenset((r[0], int(r[1])) for r in rows)

    def release_slots(self, slots: Sequence[tuple[str, int]]) -> int:
        """Release held slots ``(PGMQ queue, msg_id)`` (their tasks finished) and wake the
        consumers waiting on their queues; returns how many were still held (a slot not
        held yet, its ack still on its way, is released ahead: its hold will hold
        nothing)."""
        params = {"queues": [q for q, _ in slots], "msg_ids": [m for _, m in slots]}
        rows: list[Any] = self.db.fetch("release_slots", params)
        return int(rows[0][0]) if rows else 0

    def release_slots_nowait(
        self,
        slots: Sequence[tuple[str, int]],
        *,
        on_error: Callable[[KombuPgmqError], None],
    ) -> None:
        """:meth:`release_slots` sent without waiting for its result (read before this
        connection's next statement; ``on_error`` gets a failure then), so the event loop
        that saw a task finish is not held up by it.

        Raises:
            BrokerConnectionError: the statement could not be sent.
        """
        statement = self.db.statement("release_slots").encode()
        self.db.send_nowait(
            "kombu_pgmq_release_slots",
            numbered(statement, ("queues", "msg_ids")),
            # PGMQ names are [a-z0-9_]: nothing to escape in the array literal
            [
                ("{" + ",".join(f'"{q}"' for q, _ in slots) + "}").encode(),
                text_array(m for _, m in slots),
            ],
            on_result=lambda rows: None,
            on_error=on_error,
        )
