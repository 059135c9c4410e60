"""Consumers and their housekeeping: who consumes what (heartbeats, the reaper of
auto_delete/x-expires queues), who sleeps on which queue until a publish notifies it
(wake-ups, table ``kombu_pgmq.waiting``), LISTEN, and VACUUM of consumed tables. One typed
method per named statement of ``sql/queries/consumers.sql``, sent through a
:class:`~kombu_pgmq._db.connector.Connector`; errors as in :mod:`kombu_pgmq._db.broker`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from psycopg import sql

from ..errors import KombuPgmqError
from .connector import Connector, numbered

__all__ = ["Consumers", "HandoffSlot", "Waiting"]


class Waiting(NamedTuple):
    """What :meth:`Consumers.wait_for` learned (see there)."""

    unsettled: list[str]
    due: dict[str, float]
    clock_offset: float


class HandoffSlot(NamedTuple):
    """A hand-off slot offered with :meth:`Consumers.wait_for`
    (``kombu_pgmq.wait_for_handoff``): the LISTEN connection's NOTIFY ``channel`` and the
    session advisory lock ``lock_key`` it holds while listening
    (:func:`kombu_pgmq._db.handoff.new_slot`), the visibility timeout of a handed message
    (``vt_seconds``), the PGMQ ``queues`` offered, and the number of the sequence the slot
    is claimed on (``seq``: :meth:`Consumers.hold_handoff_lock`)."""

    channel: str
    lock_key: int
    vt_seconds: int
    queues: Sequence[str]
    seq: int


class _Wait(NamedTuple):
    queue: str
    unsettled: bool
    due_in_seconds: float | None
    server_epoch: float


class _DeadTuples(NamedTuple):
    relname: str
    n_dead_tup: int


@functools.lru_cache(maxsize=64)
def _visible_probe(branch: str, queues: tuple[str, ...], below: tuple[str, ...]) -> bytes:
    """Statement ``visible_probe`` (text ``branch``) for PGMQ queues ``queues``, and a look
    below the positions of ``below``: a branch per queue and look, UNION ALL, with two
    placeholders each (composed once per set of queues: the fallback poll's probe goes
    out every ``polling_interval`` with the same set)."""
    looks = [(q, False) for q in queues] + [(q, True) for q in below]
    return (
        sql.SQL(" UNION ALL ")
        .join(
            sql.SQL(branch).format(
                queue_name=sql.Literal(q),
                queue_table=sql.Identifier("pgmq", f"q_{q}"),
                below=sql.Literal(is_below),
                scan_from=sql.SQL(f"${2 * i - 1}"),
                scan_to=sql.SQL(f"${2 * i}"),
            )
            for i, (q, is_below) in enumerate(looks, 1)
        )
        .as_bytes(None)
    )


class Consumers:
    """Consumer registry, wake-ups and maintenance over one connector."""

    def __init__(self, db: Connector) -> None:
        self.db = db

    # -- wake-ups (kombu_pgmq.waiting) -------------------------------------------------

    def wait_for(
        self, owner: str, queues: Sequence[str], handoff: HandoffSlot | None = None
    ) -> Waiting:
        """Record that ``owner`` sleeps until notified on ``queues`` (publishers then
        NOTIFY); returns once publishers that missed the record have committed, so a
        read of the queues after this call sees their messages (``kombu_pgmq.wait_for``
        takes the queue's advisory lock exclusive after the record; a publisher holds it
        shared until it commits).

        A publisher still in its transaction after a short wait (an application that
        enqueued inside a long transaction) is not waited for: the queues it holds are
        ``unsettled``, to be polled. ``due``: seconds until each queue's next delayed
        message becomes visible (queues without one are left out;
        ``kombu_pgmq.wait_for_due``); ``clock_offset``: the server's clock minus this
        host's (``time.time()``), to read the due times NOTIFY payloads carry.

        ``handoff``: also offer one hand-off slot on ``handoff.queues``
        (``kombu_pgmq.wait_for_handoff``): a publish then hands its message to this
        connection in its NOTIFY instead of waking it to read."""
        sent = time.time()
        params: dict[str, object] = {"owner": owner, "queues": list(queues)}
        if handoff is None or not handoff.queues:
            rows = self.db.fetch("wait_for", params, _Wait)
        else:
            params.update(
                handoff_queues=list(handoff.queues),
                channel=handoff.channel,
                lock_key=handoff.lock_key,
                vt_seconds=handoff.vt_seconds,
                seq=handoff.seq,
            )
            rows = self.db.fetch("wait_for_handoff", params, _Wait)
        now = (sent + time.time()) / 2.0
        return Waiting(
            [str(r.queue) for r in rows if r.unsettled],
            {str(r.queue): float(r.due_in_seconds) for r in rows if r.due_in_seconds is not None},
            float(rows[0].server_epoch) - now if rows else 0.0,
        )

    def rearm_handoff(self, owner: str, queues: Sequence[str]) -> set[str]:
        """Offer one hand-off slot again on ``queues`` (``owner`` took what it was
        handed there and has room); returns those it still waits on (the others were
        given up: a backlog, the reaper)."""
        return {
            str(q)
            for q in self.db.column("rearm_handoff", {"owner": owner, "queues": list(queues)})
        }

    def rearm_handoff_nowait(
        self,
        owner: str,
        queues: Sequence[str],
        *,
        on_offered: Callable[[set[str]], None],
        on_error: Callable[[KombuPgmqError], None],
    ) -> None:
        """:meth:`rearm_handoff` sent without waiting for its result (read before this
        connection's next statement: ``on_offered`` gets the queues still waited on,
        ``on_error`` a failure), so a consumer that was just handed a message is not
        held up by it (Celery's event loop writes the task to its pool afterwards).

        Raises:
            BrokerConnectionError: the statement could not be sent.
        """
        statement = self.db.statement("rearm_handoff").encode()
        self.db.send_nowait(
            "kombu_pgmq_rearm_handoff",
            numbered(statement, ("owner", "queues")),
            # PGMQ names are [a-z0-9_]: nothing to escape in the array literal
            [owner.encode(), ("{" + ",".join(f'"{q}"' for q in queues) + "}").encode()],
            on_result=lambda rows: on_offered({str(r[0]) for r in rows}),
            on_error=on_error,
        )

    def visible_nowait(
        self,
        queues: Sequence[str],
        scan_from: Sequence[float],
        *,
        on_visible: Callable[[set[str]], None],
        on_error: Callable[[KombuPgmqError], None],
    ) -> None:
        """Ask which of PGMQ queues ``queues`` hold a visible message with a ``vt`` at or
        after ``scan_from`` (aligned with ``queues``: epoch seconds, ``-inf`` for any)
        (statement ``visible_probe``, a branch per queue), without waiting for the answer:
        it is read before this connection's next statement or by
        :meth:`Connector.free`; ``on_visible(queues)`` gets the queues that do,
        ``on_error`` a failure (e.g. :class:`~kombu_pgmq.errors.PermissionDenied`: a role
        without rights on PGMQ's tables). Sent unnamed (once a fallback poll: a plan
        cached for each set of queues would only pile up on the session).

        Raises:
            BrokerConnectionError: the statement could not be sent.
        """
        params = [repr(float(x)).encode() for f in scan_from for x in (f, float("inf"))]
        self.db.send_nowait(
            None,
            _visible_probe(self.db.statement("visible_probe"), tuple(queues), ()),
            params,
            on_result=lambda rows: on_visible({str(r[0]) for r in rows}),
            on_error=on_error,
        )

    def visible_below(self, below: Mapping[str, float]) -> set[str]:
        """Which of ``below`` ({PGMQ queue: its read position, epoch seconds}) hold a
        visible message with a ``vt`` before that position (statement ``visible_probe``,
        a look below per queue; it walks every dead row version there). Waits for the
        answer.

        Raises:
            PermissionDenied: the role may not read PGMQ's tables.
            BrokerConnectionError: the connection was lost.
        """
        if not below:
            return set()
        params = [repr(float(x)).encode() for b in below.values() for x in (float("-inf"), b)]
        found: set[str] = set()
        failure: list[KombuPgmqError] = []
        self.db.send_nowait(
            None,
            _visible_probe(self.db.statement("visible_probe"), (), tuple(below)),
            params,
            on_result=lambda rows: found.update(str(r[0]) for r in rows),
            on_error=failure.append,
        )
        self.db.collect()
        if failure:
            raise failure[0]
        return found

    def hold_handoff_lock(self, lock_key: int) -> int:
        """Take the session advisory lock a LISTEN connection holds while it listens for
        hand-offs (see :class:`HandoffSlot`), and lease the sequence its slot is claimed
        on for the life of the session; returns that sequence's number."""
        return int(self.db.column("handoff_lock", {"lock_key": lock_key})[0])

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
        skipped this round instead of waited for."""
        return [str(q) for q in self.db.column("reap")]

    def dead_tuples(
        self, queues: Sequence[str], min_interval_seconds: float = 0.0
    ) -> dict[str, int]:
        """Dead row versions of each queue's table ``pgmq.q_<queue>`` (from the server's
        cumulative statistics; queues without statistics yet are left out, and those
        VACUUMed less than ``min_interval_seconds`` ago)."""
        params = {
            "tables": [f"q_{q}" for q in queues],
            "min_interval_seconds": min_interval_seconds,
        }
        rows = self.db.fetch("dead_tuples", params, _DeadTuples)
        return {str(r.relname)[2:]: int(r.n_dead_tup) for r in rows}

    def vacuum(self, queue: str) -> None:
        """``VACUUM`` the queue's table (skipped if another VACUUM holds it).

        Raises:
            StatementError: e.g. the role does not own the table.
        """
        self.db.execute(self.db.compose("vacuum", queue_table=("pgmq", f"q_{queue}")))
