"""Read positions: where a read of a queue starts its walk of PGMQ's vt index.

A read takes the visible rows with the oldest ``vt`` (``vt <= now``, PGMQ's
``q_<name>_vt_idx``). Every delivery and ack leaves a dead row version whose index entry
keeps its old ``vt``; while any snapshot older than them is open (a long transaction
anywhere in the database), VACUUM can remove none of them, and a read that starts at the
oldest ``vt`` walks them all: its cost grows with the length of the open transaction.

So each read of a queue starts at a position (``vt >= scan_from``), the oldest ``vt`` a
row it has not yet seen can have. After a read that took every visible row it found, the
position is the time up to which it looked; after a read that filled its batch, the ``vt``
of the last row it took. What the read's snapshot could not see (transactions still in
progress, which may commit later rows with an older ``vt``) keeps the position back, as
PgQ's ticks keep a txid snapshot so that a late commit is never skipped:

* a row's ``vt`` is computed when it is written (``clock_timestamp()`` + a delay or a
  visibility timeout: ``pgmq.send``, ``pgmq.set_vt``, kombu_pgmq's publish, read and
  requeue), at most ``MARGIN_SECONDS`` before its transaction's id is assigned, or later;
* transaction ids are assigned in increasing order, so a transaction whose id is above the
  id of one of our reads was assigned its id after that read's transaction began
  (``transaction_timestamp()``): its rows have ``vt`` at or after that time, less the
  margin; so was every id at or above the ``xmax`` of a read's snapshot (the snapshot is
  taken after its transaction began);
* each read returns its snapshot (``pg_current_snapshot()``), its own transaction id and
  its transaction's start; the ids our reads had, with those starts, bound when any later
  id was assigned.

The next read of the queue then starts at the oldest of: where this one got to; this
read's start less the margin (ids at or above its snapshot's ``xmax``, not yet known to
it); and, for each id in
progress at this snapshot (its ``xip``) that has committed by the next read's snapshot
(``pg_visible_in_snapshot``, checked by the statement itself), that id's bound. A long
transaction that has written keeps no read back while it runs; its commit costs one read
that starts at its bound.

A message requeued to its place (``vt`` = its ``enqueued_at``: Kombu's reject with requeue,
unacked messages of a closed channel) lies below every position: ``kombu_pgmq.requeue``
sends NOTIFY payload ``rewind`` on the queue's channel, and each consuming connection's
next read of the queue starts at the beginning (:meth:`ReadPositions.forget`), as does
every read after its LISTEN connection was lost (a rewind may have been missed). Rows
outside every rule (a ``pgmq.send`` or ``pgmq.set_vt`` given a ``vt`` in the past, a row a
rolled-back read had locked, a clock stepped back) are found by the first read of each
queue and by a look below the positions every ``LOOK_SECONDS``: the heartbeat thread of a
consuming connection asks, on its own connection, which queues hold a visible row below
their positions (:meth:`ReadPositions.looks_due`; it walks every dead row version there,
holding up no read or hand-off meanwhile), and a row found rewinds the queue. Where no
look came for ``FULL_SCAN_SECONDS`` (no consumer, a role that may not read PGMQ's tables),
the read itself starts from the beginning. The fallback poll's everyday probe for
visible rows starts at :meth:`ReadPositions.probe_from`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

__all__ = ["FULL_SCAN_SECONDS", "LOOK_SECONDS", "MARGIN_SECONDS", "ReadPosition", "ReadPositions"]

#: Seconds after which a read of a queue starts from the beginning of its vt index when
#: nothing looked below its position meanwhile (what the bounded reads cannot see: see
#: the module docstring). Such a read costs as much as every read did without positions
#: (a walk of every dead row version the horizon keeps).
FULL_SCAN_SECONDS = 60.0
#: Seconds after which the heartbeat thread looks below a queue's position (before the
#: read would start from the beginning).
LOOK_SECONDS = 30.0
#: Seconds a row's ``vt`` may be computed before its transaction's id is assigned (the
#: write's own statement: BEFORE triggers, a wait for the relation extension lock).
MARGIN_SECONDS = 0.25
#: A read with nothing to write has no transaction id; one is asked for
#: (``pg_current_xact_id()``) when the newest id known is older than this many seconds, so
#: that the bound of an id in progress at a read (one that commits later) stays this
#: fresh on a queue whose reads find nothing.
STAMP_SECONDS = 0.25
#: Read ids kept (one per ``STAMP_SECONDS`` at most, about 30 minutes' worth); an id in
#: progress older than all of them is bounded by the start of the index.
HISTORY = 8192

_UNBOUNDED = float("-inf")


def _finite(bound: object) -> float | None:
    """A bound for JSON (no infinities): None for the start of the index."""
    return None if bound == _UNBOUNDED else bound  # type: ignore[return-value]


class ReadPosition(NamedTuple):
    """What a read of one queue returns about its scan (the statement's position row):
    ``snapshot``: ``pg_current_snapshot()`` as text (``xmin:xmax:xip,...``);
    ``read_xid``: the read's own transaction id, None if it had none; ``read_at``: its
    transaction's start (epoch seconds, server clock); ``scan_from``: where its scan of the
    vt index started (epoch seconds, ``-inf``: at the start); ``scanned_to``: the ``vt``
    up to which it saw every visible row (epoch seconds)."""

    snapshot: str
    read_xid: str | None
    read_at: float
    scan_from: float
    scanned_to: float | None

    @classmethod
    def of(cls, row: Any) -> ReadPosition:
        """The position of a read's position row (a row with these fields set: the
        ``ReadRow`` of statement ``read_queue``, the ``PositionedRow`` of
        ``kombu_pgmq.read``)."""
        return cls(row.snapshot, row.read_xid, row.read_at, row.scan_from, row.scanned_to)


class _Queue:
    __slots__ = ("advanced_at", "full_at", "scan_from", "watch_bounds", "watch_xids")

    def __init__(self) -> None:
        self.advanced_at = 0.0  # time.monotonic() of the last read
        self.full_at = 0.0  # time.monotonic() of the last read from the start
        self.scan_from = _UNBOUNDED
        self.watch_xids: list[str] = []
        self.watch_bounds: list[float] = []


class ReadPositions:
    """The positions of the queues one connection reads, and the transaction ids of its
    reads (see the module docstring). Not thread-safe: one per connection, as the
    connection."""

    def __init__(self) -> None:
        self._queues: dict[str, _Queue] = {}
        #: the transaction ids of our reads, ascending, and their statements' start times
        self._xids: list[int] = []
        self._times: list[float] = []
        self._stamped = 0.0  # time.monotonic() when the newest id was recorded

    def params(self, queue: str) -> dict[str, object]:
        """The read statement's parameters for ``queue``: ``scan_from`` (epoch seconds,
        ``-inf`` for a read from the start), ``watch_xids``/``watch_bounds`` (ids in
        progress at the last read and their bounds), ``stamp`` (ask for a transaction
        id)."""
        now = time.monotonic()
        state = self._queues.get(queue)
        stamp = now - self._stamped >= STAMP_SECONDS
        if state is None or now - state.full_at >= FULL_SCAN_SECONDS:
            return {"scan_from": _UNBOUNDED, "watch_xids": [], "watch_bounds": [], "stamp": stamp}
        return {
            "scan_from": state.scan_from,
            "watch_xids": state.watch_xids,
            "watch_bounds": state.watch_bounds,
            "stamp": stamp,
        }

    def positions(self, queues: Iterable[str]) -> tuple[dict[str, dict[str, object]], bool]:
        """``kombu_pgmq.read``'s ``positions`` (``{queue: {scan_from, watch_xids,
        watch_bounds}}``, JSON: ``null`` for the start of the index) and ``stamp``, for a
        read of ``queues``."""
        result: dict[str, dict[str, object]] = {}
        stamp = False
        for queue in queues:
            params = self.params(queue)
            stamp = stamp or bool(params["stamp"])
            result[queue] = {
                "scan_from": _finite(params["scan_from"]),
                "watch_xids": params["watch_xids"],
                "watch_bounds": [_finite(b) for b in params["watch_bounds"]],  # type: ignore[attr-defined]
            }
        return result, stamp

    def probe_from(self, queue: str) -> float:
        """The oldest ``vt`` a visible row the next read of ``queue`` takes can have
        (epoch seconds; ``-inf`` when that read starts at the beginning of the index): what
        a probe for visible rows (the fallback poll) need look at. It counts every id in
        progress at the last read as committed since."""
        state = self._queues.get(queue)
        if state is None:
            return _UNBOUNDED
        return min([state.scan_from, *state.watch_bounds])

    def looks_due(self) -> dict[str, float]:
        """``{queue: its position}`` (epoch seconds) of the queues it is time to look below
        for visible rows (nothing looked there for ``LOOK_SECONDS``). Safe to call from
        another thread (the heartbeat thread's); the caller that looked calls
        :meth:`looked_below`, one that finds a row there has the queue :meth:`forget`."""
        now = time.monotonic()
        return {
            queue: min([state.scan_from, *state.watch_bounds])
            for queue, state in list(self._queues.items())  # a copy: another thread's
            if now - state.full_at >= LOOK_SECONDS
        }

    def looked_below(self, queues: Iterable[str], started: float) -> None:
        """A look below the positions of ``queues`` was made, sent at ``started``
        (``time.monotonic()``): reads need not start from the beginning for another
        ``FULL_SCAN_SECONDS``. Safe to call from another thread."""
        for queue in queues:
            state = self._queues.get(queue)
            if state is not None:
                state.full_at = max(state.full_at, started)

    def advance(self, queue: str, position: ReadPosition) -> None:
        """Record what a read of ``queue`` returned; the next read starts from it."""
        if position.read_xid is not None:
            self._record(int(position.read_xid), position.read_at)
        state = self._queues.get(queue)
        if state is None:
            state = self._queues[queue] = _Queue()
        state.advanced_at = time.monotonic()
        if position.scan_from == _UNBOUNDED:
            state.full_at = state.advanced_at
        xmin, xmax, xip = position.snapshot.split(":")
        del xmin, xmax  # below xmin: settled (seen, or never to commit); at or above
        # xmax: assigned after this read's transaction began (bounded by read_at)
        reached = position.scanned_to if position.scanned_to is not None else position.scan_from
        state.scan_from = min(reached, position.read_at - MARGIN_SECONDS)
        state.watch_xids = xip.split(",") if xip else []
        state.watch_bounds = [self._bound(int(x)) for x in state.watch_xids]

    def age(self, queue: str) -> float | None:
        """Seconds since the last read of ``queue`` moved its position; None if it has
        none (never read by position, or forgotten). The dead row versions a read walks
        are those left since the position: a queue whose messages are all handed off
        is read now and then so that it stays fresh."""
        state = self._queues.get(queue)
        return None if state is None else time.monotonic() - state.advanced_at

    def forget(self, queue: str | None = None) -> None:
        """Read ``queue`` (None: every queue) from the start next time."""
        if queue is None:
            self._queues.clear()
        else:
            self._queues.pop(queue, None)

    def _record(self, xid: int, started: float) -> None:
        xids = self._xids
        if xids and xid == xids[-1]:
            return  # another queue of the same read
        if xids and xid < xids[-1]:  # a server with other ids (restored, a failover)
            self._xids, self._times = [], []
            self._queues.clear()
        elif xids and started - self._times[-1] < STAMP_SECONDS:
            self._stamped = time.monotonic()
            return  # the newer start bounds less well; the older id is kept
        self._xids.append(xid)
        self._times.append(started)
        self._stamped = time.monotonic()
        if len(self._xids) > 2 * HISTORY:
            del self._xids[:HISTORY], self._times[:HISTORY]

    def _bound(self, xid: int) -> float:
        """The oldest ``vt`` a row written by transaction ``xid`` can have (epoch
        seconds): the start of the newest of our reads whose id is below it, less
        ``MARGIN_SECONDS``; ``-inf`` if we know none."""
        i = bisect.bisect_left(self._xids, xid)
        return self._times[i - 1] - MARGIN_SECONDS if i else _UNBOUNDED
