"""Which consumed PGMQ queues one connection reads next, and which it sleeps on: the
decisions of the poller's rounds, kept apart from its I/O (no database, no clock of its
own, no event loop), so that they are tested without PostgreSQL.

A queue is

* *ready* when it may hold a visible message: the next round reads it (as the prefetch
  window allows). A NOTIFY, a fallback poll, a due delayed message, a requeue, a read
  that filled its request and the final read after going to sleep make it ready; a read
  that found it empty makes it not ready.
* *waiting* when this connection's row is in ``kombu_pgmq.waiting`` for it (the
  ``kombu_pgmq.wait_for_due`` function): publishers notify us. A queue found empty, not
  waited on yet, is to be waited on (:meth:`Wakeups.after_round`); a queue whose reads
  filled their request :data:`BUSY_AFTER_FULL_READS` times in a row stops being waited
  on (a backlog: publishers stop notifying until it is drained again).
* *due* at a monotonic deadline when a delayed message in it becomes visible then (the
  earliest known wins): learned from ``wait_for_due``, from NOTIFY payloads and from a
  rate limit that allows more reads later.

The owner, :class:`~kombu_pgmq.transport.poller.Poller`, sends the statements these
decisions call for and reports back what the server said.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

__all__ = ["BUSY_AFTER_FULL_READS", "Wakeups"]

#: Consecutive full reads of a queue after which this connection stops waiting on it (a
#: backlog: publishers stop notifying until it is drained again). Three: leaving and
#: joining ``kombu_pgmq.waiting`` again costs two statements (``stop_waiting`` now,
#: ``wait_for`` once a read finds the queue drained), not worth it for a burst that one or
#: two reads drain; a queue whose reads keep filling is a backlog, where every publish's
#: NOTIFY would go to a consumer that reads anyway (a NOTIFY takes a database-wide lock
#: at commit). Not measured against other values.
BUSY_AFTER_FULL_READS = 3


class Wakeups:
    """The wake-up state of one connection's consumed PGMQ queues (see the module
    docstring). Used from the poller's thread, except :meth:`found_below` (any thread)."""

    def __init__(self) -> None:
        #: PGMQ queues that may hold visible messages: read when the prefetch allows.
        self.ready: set[str] = set()
        #: PGMQ queues whose ``kombu_pgmq.waiting`` row is ours: publishers notify us.
        self.waiting: set[str] = set()
        #: PGMQ queue -> ``monotonic()`` when its next delayed message becomes visible.
        self.due: dict[str, float] = {}
        #: ``monotonic()`` of the next fallback poll of every consumed queue.
        self.next_fallback = 0.0
        #: The server's clock minus ours (``time.time()``), from the last ``wait_for``.
        self.clock_offset = 0.0
        self._full_reads: dict[str, int] = {}  # consecutive reads that filled the request
        self._found_below: set[str] = set()
        self._found_below_lock = threading.Lock()

    # -- inputs from other threads -------------------------------------------------------

    def found_below(self, queues: Iterable[str]) -> None:
        """From any thread: ``queues`` hold a visible row below where their reads start
        (the heartbeat thread's look); :meth:`take_found_below` hands them over."""
        with self._found_below_lock:
            self._found_below.update(queues)

    def take_found_below(self) -> set[str]:
        """The queues :meth:`found_below` reported since the last call, made ready."""
        with self._found_below_lock:
            found, self._found_below = self._found_below, set()
        self.ready |= found
        return found

    # -- delayed messages -----------------------------------------------------------------

    def due_at(self, name: str, deadline: float) -> None:
        """Read queue ``name`` at ``deadline`` (monotonic; the earliest one wins)."""
        current = self.due.get(name)
        if current is None or deadline < current:
            self.due[name] = deadline

    def earliest_due(self) -> float | None:
        """The earliest deadline of :meth:`due_at` (None: nothing is due)."""
        return min(self.due.values(), default=None)

    def take_due(self, now: float) -> set[str]:
        """Queues due at ``now`` or before: made ready and no longer counted as waited on
        (found empty, the final read's ``wait_for`` says when the next one is due)."""
        names = {name for name, deadline in self.due.items() if deadline <= now}
        for name in names:
            del self.due[name]
        self.ready |= names
        self.waiting -= names
        return names

    # -- wake-ups -------------------------------------------------------------------------

    def notified(
        self, names: Iterable[str], due: dict[str, float], *, now: float, wall_now: float
    ) -> None:
        """The LISTEN connection heard of ``names`` (made ready) and of delayed messages
        becoming due in ``due`` (PGMQ queue -> the server's epoch seconds), at ``now``
        (monotonic) and ``wall_now`` (``time.time()``)."""
        self.ready.update(names)
        for name, epoch in due.items():
            self.due_at(name, now + epoch - self.clock_offset - wall_now)

    def fallback_due(self, now: float, interval: float, *, force: bool = False) -> bool:
        """Whether the fallback poll of every consumed queue is due at ``now`` (or
        ``force``: notifications may have been missed); if so, the next one is due
        ``interval`` seconds later."""
        if not force and now < self.next_fallback:
            return False
        self.next_fallback = now + interval
        return True

    # -- rounds ---------------------------------------------------------------------------

    def after_round(
        self, drained: set[str], full: set[str], *, listening: bool
    ) -> tuple[set[str], list[str]]:
        """Record what a round's reads found: ``drained`` queues were found empty,
        ``full`` ones filled the read. Returns ``(to_wait, to_busy)``: the queues to start
        waiting on (none without LISTEN: nobody would hear a NOTIFY) and the waited-on
        queues to stop waiting on (:data:`BUSY_AFTER_FULL_READS` full reads in a row),
        sorted. The caller reports the statements' outcome with :meth:`stopped_waiting`
        and :meth:`now_waiting`."""
        self.ready -= drained
        self.ready |= full
        to_wait = drained - self.waiting if listening else set()
        for name in drained:
            self._full_reads.pop(name, None)
        to_busy = []
        for name in full:
            streak = self._full_reads[name] = self._full_reads.get(name, 0) + 1
            if streak >= BUSY_AFTER_FULL_READS and name in self.waiting:
                to_busy.append(name)
        return to_wait, sorted(to_busy)

    def stopped_waiting(self, names: Iterable[str]) -> None:
        """Our ``waiting`` rows of ``names`` are gone (or were never made)."""
        self.waiting.difference_update(names)

    def now_waiting(self, names: Iterable[str]) -> None:
        """``wait_for`` committed our rows for ``names``: publishers notify us from now
        on. Each gets a final read (a publish committed just before our row was seen by
        nobody)."""
        names = set(names)
        self.waiting |= names
        self.ready |= names

    # -- consumers and connections ------------------------------------------------------

    def forget(self, name: str) -> bool:
        """No consumer is left for queue ``name``: drop it. Returns whether it was waited
        on (the caller removes its ``waiting`` row)."""
        self.ready.discard(name)
        self._full_reads.pop(name, None)
        self.due.pop(name, None)
        if name in self.waiting:
            self.waiting.discard(name)
            return True
        return False

    def connection_lost(self, consumed: Iterable[str]) -> None:
        """The statement connection was lost: our ``waiting`` rows may be gone with the
        server (recorded again as queues are found empty), and every consumed queue is read
        again once reconnected."""
        self.waiting.clear()
        self.ready.update(consumed)

    def clear(self) -> None:
        """Forget everything (a closed connection, a forked child)."""
        self.ready.clear()
        self.waiting.clear()
        self.due.clear()
        self._full_reads.clear()
        with self._found_below_lock:
            self._found_below.clear()
