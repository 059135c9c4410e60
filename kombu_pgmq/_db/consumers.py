"""Consumers and their housekeeping: who consumes what (heartbeats, the reaper of
auto_delete/x-expires queues), who sleeps on which queue until a publish notifies it
(wake-ups, migration 0003), LISTEN, and VACUUM of consumed tables. One typed method per
named statement of ``sql/queries.sql``, sent through a
:class:`~kombu_pgmq._db.connector.Connector`; errors as in :mod:`kombu_pgmq._db.broker`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .connector import Connector

__all__ = ["Consumers", "Waiting"]


class Waiting(NamedTuple):
    """What :meth:`Broker.wait_for` learned (see there)."""

    unsettled: list[str]
    due: dict[str, float]
    clock_offset: float


class _Wait(NamedTuple):
    queue: str
    unsettled: bool
    due_in_seconds: float | None
    server_epoch: float


class _DeadTuples(NamedTuple):
    relname: str
    n_dead_tup: int


class Consumers:
    """Consumer registry, wake-ups and maintenance over one connector."""

    def __init__(self, db: Connector) -> None:
        self.db = db

    # -- wake-ups (migration 0003) ----------------------------------------------------

    def wait_for(self, owner: str, queues: Sequence[str]) -> Waiting:
        """Record that ``owner`` sleeps until notified on ``queues`` (publishers then
        NOTIFY); returns once publishers that missed the record have committed, so a
        read of the queues after this call sees their messages (see migration 0003).

        A publisher still in its transaction after a short wait (an application that
        enqueued inside a long transaction) is not waited for: the queues it holds are
        ``unsettled``, to be polled (migration 0006). ``due``: seconds until each queue's
        next delayed message becomes visible (queues without one are left out; migration
        0016); ``clock_offset``: the server's clock minus this host's (``time.time()``),
        to read the due times NOTIFY payloads carry."""
        sent = time.time()
        rows = self.db.fetch("wait_for", {"owner": owner, "queues": list(queues)}, _Wait)
        now = (sent + time.time()) / 2.0
        return Waiting(
            [str(r.queue) for r in rows if r.unsettled],
            {str(r.queue): float(r.due_in_seconds) for r in rows if r.due_in_seconds is not None},
            float(rows[0].server_epoch) - now if rows else 0.0,
        )

    def stop_waiting(self, owner: str, queues: Sequence[str] | None = None) -> None:
        """Publishers need not notify ``owner`` for ``queues`` (None: any queue) any more."""
        if queues is None:
            self.db.execute("stop_waiting_all", {"owner": owner})
        else:
            self.db.execute("stop_waiting", {"owner": owner, "queues": list(queues)})

    def listen(self, channels: Iterable[str]) -> None:
        """``LISTEN`` on each channel (names are quoted identifiers, case kept)."""
        for channel in channels:
            self.db.execute(self.db.compose("listen", channel=channel))

    def unlisten(self, channels: Iterable[str]) -> None:
        """``UNLISTEN`` each channel."""
        for channel in channels:
            self.db.execute(self.db.compose("unlisten", channel=channel))

    # -- consumers and queue lifetime ----------------------------------------------------

    def register_consumer(
        self, kombu_queue: str, owner: str, consumer_tag: str, *, stale_after_seconds: float
    ) -> None:
        """Record a live consumer; it counts as gone ``stale_after_seconds`` after its last
        heartbeat (the owner's setting, not the reaper's)."""
        params = {
            "kombu_queue": kombu_queue,
            "owner": owner,
            "consumer_tag": consumer_tag,
            "stale_after_seconds": stale_after_seconds,
        }
        self.db.execute("register_consumer", params)

    def release_consumer(self, kombu_queue: str, owner: str, consumer_tag: str) -> bool:
        """Forget a consumer; True if its queue was auto-deleted as a result."""
        params = {"kombu_queue": kombu_queue, "owner": owner, "consumer_tag": consumer_tag}
        return bool(self.db.scalar("release_consumer", params))

    def heartbeat(self, owner: str) -> None:
        """Mark ``owner``'s consumers live and their queues used, now."""
        self.db.execute("heartbeat", {"owner": owner})

    def reap(self) -> list[str]:
        """Drop queues AMQP would have deleted (see ``kombu_pgmq.reap``); return their
        Kombu names. A queue whose table is locked (a reader's open transaction) is
        skipped this round instead of waited for (migration 0006)."""
        return [str(q) for q in self.db.column("reap")]

    def dead_tuples(self, queues: Sequence[str]) -> dict[str, int]:
        """Dead row versions of each queue's table ``pgmq.q_<queue>`` (from the server's
        cumulative statistics; queues without statistics yet are left out)."""
        rows = self.db.fetch("dead_tuples", {"tables": [f"q_{q}" for q in queues]}, _DeadTuples)
        return {str(r.relname)[2:]: int(r.n_dead_tup) for r in rows}

    def vacuum(self, queue: str) -> None:
        """``VACUUM`` the queue's table (skipped if another VACUUM holds it).

        Raises:
            StatementError: e.g. the role does not own the table.
        """
        self.db.execute(self.db.compose("vacuum", queue_table=("pgmq", f"q_{queue}")))
