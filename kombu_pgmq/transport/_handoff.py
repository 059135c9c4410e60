"""Hand-off at publish, the consumer's side (``kombu_pgmq.wait_for_handoff``; see
:mod:`kombu_pgmq._db.handoff` for the payload).

A consuming connection going to sleep on queues offers one hand-off slot on those it
takes with acks (:meth:`Handoff.slot`, sent with ``wait_for``): a publish to such a queue
then writes the row as delivered to this connection and sends it in the NOTIFY to the
LISTEN connection's own channel, instead of waking every waiting consumer to read. The
poller hands those rows to the channels consuming their queues (:meth:`Handoff.deliver`)
as a read would, and offers the slot again once the channel has room
(``kombu_pgmq.rearm_handoff``; in Celery's event loop a moment later, with
:meth:`Handoff.rearm_now`, once the tasks are written to the pool), so a channel gets at
most one message past its prefetch window this way. A row whose queue no channel consumes
any more is made visible again (not counted as a delivery); rows still arriving when the
connection closes are given back the same way (:meth:`Handoff.give_back`).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterable

from .. import errors
from .._db.broker import Broker, Receipt
from .._db.consumers import HandoffSlot
from .._db.rows import Row
from .._stats import STATS
from ._listener import Listener
from .reader import Reader

__all__ = ["ConsumerOf", "Handoff"]

#: ``consumer_of(name)``: ``(reader, kombu queue)`` of the first channel consuming PGMQ
#: queue ``name`` (a band of the kombu queue), or None.
ConsumerOf = Callable[[str], "tuple[Reader, str] | None"]


class Handoff:
    """Hand-off slots and handed rows of one connection's poller.

    Arguments:
        vt_seconds: the visibility timeout (seconds) of a row handed off to a slot.
        consumer_of: finds the channel's reader consuming a PGMQ queue (see
            :data:`ConsumerOf`).
        owner: this connection's consumer identity (``kombu_pgmq.consumers.owner``;
            a forked child gets a new one).

    The statements go through the :class:`~kombu_pgmq._db.broker.Broker` each call is
    given.
    """

    def __init__(self, vt_seconds: int, consumer_of: ConsumerOf, owner: Callable[[], str]) -> None:
        self.vt_seconds = vt_seconds
        self._consumer_of = consumer_of
        self._owner = owner
        #: PGMQ queues whose waiting row offers a slot now (as far as we know).
        self.armed: set[str] = set()
        #: Rows handed off, not delivered yet (from the listener).
        self.handed: list[Row] = []
        #: Queues whose slot is offered again by :meth:`rearm_now` (``defer_rearm``).
        self.rearm_pending: set[str] = set()

    def slot(self, listener: Listener, names: Iterable[str]) -> HandoffSlot | None:
        """The slot of ``listener``'s connection to offer with ``wait_for`` on PGMQ queues
        ``names``: those of them consumed with acks (``no_ack`` consumers pop instead).
        None without a LISTEN connection (or before it leased its sequence)."""
        slot, seq = listener.slot, listener.slot_seq
        if slot is None or seq is None:
            return None
        queues = sorted(n for n in names if self._consumer(n, acks=True) is not None)
        return HandoffSlot(slot[0], slot[1], self.vt_seconds, queues, seq)

    def _consumer(self, name: str, *, acks: bool = False) -> tuple[Reader, str] | None:
        """``(reader, kombu queue)`` consuming PGMQ queue ``name`` (a band of it), or
        None; ``acks``: only a consumer that takes messages with acks."""
        found = self._consumer_of(name)
        if found is not None and acks and found[0].is_no_ack(found[1]):
            return None
        return found

    def deliver(
        self, waiting: set[str], broker: Broker, defer_rearm: bool = False
    ) -> tuple[int, set[str]]:
        """Deliver the handed rows to their consumers. Returns ``(delivered, to_read)``:
        queues whose slot could not be offered again yet (the channel has no room, or
        the statement failed): read them when the window allows, and offer the slot
        again when one is found empty. Slots of queues in ``waiting`` are offered again
        at once where the channel has room."""
        rows, self.handed = self.handed, []
        if not rows:
            return 0, set()
        by_name: dict[str, list[Row]] = defaultdict(list)
        for row in rows:
            by_name[row.queue].append(row)
        delivered = 0
        # the claim took this connection's offers on every queue (one slot per connection)
        self.armed.clear()
        for name, batch in by_name.items():
            found = self._consumer(name)
            if found is None:  # cancelled since: visible again, not counted
                self.give_back(batch, broker)
                continue
            reader, queue = found
            delivered += reader.deliver_rows(queue, name, batch)
            STATS.handoffs += len(batch)
        rearm, to_read = self._with_room(sorted(waiting))
        if rearm and defer_rearm:
            self.rearm_pending.update(rearm)
        elif rearm:
            self._rearm(rearm, waiting, to_read, broker)
        return delivered, to_read

    def rearm_now(self, waiting: set[str], broker: Broker) -> set[str]:
        """Offer the slots :meth:`deliver` left pending (``defer_rearm``) on the queues
        still waited on, not offered since, whose channel still has room. Returns the
        queues to read instead (no room now, or the statement could not be sent)."""
        pending, self.rearm_pending = self.rearm_pending, set()
        names, to_read = self._with_room(sorted((pending & waiting) - self.armed))
        if names:
            self._rearm(names, waiting, to_read, broker)
        return to_read

    def _with_room(self, names: list[str]) -> tuple[list[str], set[str]]:
        """``(offer, to_read)`` of PGMQ queues ``names`` consumed with acks: those whose
        channel has room, and those whose slot is offered again once a read with room
        finds them empty."""
        offer: list[str] = []
        to_read: set[str] = set()
        for name in names:
            found = self._consumer(name, acks=True)
            if found is None:
                continue
            if found[0].can_consume():
                offer.append(name)
            else:
                to_read.add(name)
        return offer, to_read

    def _rearm(
        self, names: list[str], waiting: set[str], to_read: set[str], broker: Broker
    ) -> None:
        """Offer the slots of ``names`` again, without waiting for the answer (taken as
        given until it is read; a queue no longer waited on then leaves ``waiting``, to
        be waited on again when next found empty)."""

        # the slot is one per connection: every queue it is to be offered on is named
        offer = sorted(set(names) | self.armed)

        def offered(still: set[str]) -> None:
            gone = set(offer) - still
            self.armed.difference_update(gone)
            waiting.difference_update(gone)

        def failed(_exc: errors.KombuPgmqError) -> None:
            offered(set())

        try:
            broker.consumers.rearm_handoff_nowait(
                self._owner(), offer, on_offered=offered, on_error=failed
            )
        except errors.KombuPgmqError:
            to_read.update(names)  # read and wait again the usual way
        else:
            self.armed.update(names)

    def settle(self, listener: Listener, broker: Broker | None) -> None:
        """After giving up slots (``stop_waiting`` committed): collect what was handed
        over before, and give back the rows of queues no channel consumes any more, on
        ``broker`` (the others are delivered by the next poll). A lost LISTEN connection
        loses what it had not read: those rows come back after their visibility timeout."""
        with contextlib.suppress(errors.KombuPgmqError):
            self.handed += listener.settle()
        consumed = {row.queue for row in self.handed if self._consumer(row.queue) is not None}
        gone = [row for row in self.handed if row.queue not in consumed]
        self.handed = [row for row in self.handed if row.queue in consumed]
        self.give_back(gone, broker)

    def give_back(self, rows: list[Row], broker: Broker | None) -> None:
        """Make handed rows nobody here will take visible again (uncounted: the
        application never saw them), on ``broker`` (None: not connected, nothing is
        sent); on failure they come back after their visibility timeout."""
        if not rows or broker is None:
            return
        receipts = [Receipt(r.queue, r.msg_id, r.read_ct, r.enqueued_at) for r in rows]
        with contextlib.suppress(errors.KombuPgmqError):
            broker.requeue(receipts, 0, uncount=True)

    def clear(self) -> None:
        """Forget the slots (the waiting rows are gone or not ours) and handed rows."""
        self.armed.clear()
        self.handed.clear()
        self.rearm_pending.clear()
