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
from collections.abc import Iterable
from typing import Any

from .. import errors
from .._db.broker import Broker, Receipt
from .._db.consumers import HandoffSlot
from .._db.rows import Row
from .._stats import STATS
from ._interfaces import TransportView
from ._listener import Listener

__all__ = ["Handoff"]


class Handoff:
    """Hand-off slots and handed rows of one connection's poller."""

    def __init__(self, transport: TransportView) -> None:
        self.transport = transport
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
        vt = self.transport.options.vt_seconds
        return HandoffSlot(slot[0], slot[1], vt, queues, seq)

    def _consumer(self, name: str, *, acks: bool = False) -> tuple[Any, str] | None:
        """``(channel, kombu queue)`` consuming PGMQ queue ``name`` (a band of it), or
        None; ``acks``: only a consumer that takes messages with acks."""
        bands = self.transport.topology.bands
        for channel in self.transport.channels:
            for queue in channel.consumed_queues:
                if name in bands(queue).queues:
                    if acks and channel.reader.is_no_ack(queue):
                        return None
                    return channel, queue
        return None

    def deliver(self, waiting: set[str], defer_rearm: bool = False) -> tuple[int, set[str]]:
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
                self.give_back(batch)
                continue
            channel, queue = found
            delivered += channel.reader.deliver_rows(queue, name, batch)
            STATS.handoffs += len(batch)
        rearm, to_read = self._with_room(sorted(waiting))
        if rearm and defer_rearm:
            self.rearm_pending.update(rearm)
        elif rearm:
            self._rearm(rearm, waiting, to_read)
        return delivered, to_read

    def rearm_now(self, waiting: set[str]) -> set[str]:
        """Offer the slots :meth:`deliver` left pending (``defer_rearm``) on the queues
        still waited on, not offered since, whose channel still has room. Returns the
        queues to read instead (no room now, or the statement could not be sent)."""
        pending, self.rearm_pending = self.rearm_pending, set()
        names, to_read = self._with_room(sorted((pending & waiting) - self.armed))
        if names:
            self._rearm(names, waiting, to_read)
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
            if found[0].qos.can_consume():
                offer.append(name)
            else:
                to_read.add(name)
        return offer, to_read

    def _rearm(self, names: list[str], waiting: set[str], to_read: set[str]) -> None:
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

        consumers = self.transport.broker().consumers
        try:
            consumers.rearm_handoff_nowait(
                self.transport.owner, offer, on_offered=offered, on_error=failed
            )
        except errors.KombuPgmqError:
            to_read.update(names)  # read and wait again the usual way
        else:
            self.armed.update(names)

    def settle(self, listener: Listener) -> None:
        """After giving up slots (``stop_waiting`` committed): collect what was handed
        over before, and give back the rows of queues no channel consumes any more (the
        others are delivered by the next poll). A lost LISTEN connection loses what it had
        not read: those rows come back after their visibility timeout."""
        with contextlib.suppress(errors.KombuPgmqError):
            self.handed += listener.settle()
        consumed = {row.queue for row in self.handed if self._consumer(row.queue) is not None}
        gone = [row for row in self.handed if row.queue not in consumed]
        self.handed = [row for row in self.handed if row.queue in consumed]
        self.give_back(gone)

    def give_back(self, rows: list[Row], broker: Broker | None = None) -> None:
        """Make handed rows nobody here will take visible again (uncounted: the
        application never saw them), on ``broker`` (default: the transport's, if
        connected); on failure they come back after their visibility timeout."""
        if not rows:
            return
        broker = broker or self.transport.broker_if_connected()
        if broker is None:
            return
        receipts = [Receipt(r.queue, r.msg_id, r.read_ct, r.enqueued_at) for r in rows]
        with contextlib.suppress(errors.KombuPgmqError):
            broker.requeue(receipts, 0, uncount=True)

    def clear(self) -> None:
        """Forget the slots (the waiting rows are gone or not ours) and handed rows."""
        self.armed.clear()
        self.handed.clear()
        self.rearm_pending.clear()
