"""The poller: the event-loop I/O of one Kombu connection (after kombu's Redis
``MultiChannelPoller``).

It drives the wake-up state (:class:`~kombu_pgmq.transport.wakeups.Wakeups`: which PGMQ
queues may hold messages, *ready*; which ones this connection sleeps on, *waiting*; when
delayed ones become *due*) and sends what it decides; it owns the LISTEN connection and
wake pipe
(:class:`~kombu_pgmq.transport._listener.Listener`), the hub callbacks of Celery's event
loop, the blocking :meth:`Poller.drain_events`, and the :class:`AckBatch`. A round reads
the ready queues of every channel (pending acks ride along in the same round trip) and
delivers; queues found empty go to sleep on LISTEN (``kombu_pgmq.wait_for_due``), queues
that filled their read stay ready. A queue with a delayed message is read when it becomes
due (*due*: learned from ``wait_for_due`` and from NOTIFY payloads; a
timer of Celery's event loop, or the wait of ``drain_events``). A fallback poll every
``polling_interval`` seconds marks every consumed queue ready (messages that become
visible without a publish: a lapsed visibility timeout); in Celery's event loop it first
asks the server, on the LISTEN connection and without waiting, which of them hold a
visible message (:meth:`Listener.probe`), and reads only those when the answer comes.
In Celery's event loop, a round that delivers messages handed off at publish reads
nothing more until the loop's next turn has written those tasks to the pool
(:data:`READ_AFTER_HANDOFF_SECONDS`).

Statements go through the transport's statement connection only (the channels'), never
the lease or heartbeat connections.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from time import monotonic, sleep
from typing import Any

from .. import errors
from .._db.broker import Broker, Receipt
from .._db.pooling import warn_polling_once
from ._handoff import Handoff
from ._listener import Listener
from ._slots import Slots
from .acks import AckBatch
from .options import TransportOptions
from .reader import Reader
from .topology import Topology
from .wakeups import Wakeups

__all__ = ["RECONNECT_SECONDS", "Poller"]

logger = logging.getLogger(__name__)

#: Seconds between reconnection attempts of a consumer in Celery's event loop.
RECONNECT_SECONDS = 1.0

#: Seconds after which the fallback poll in Celery's event loop reads a queue instead of
#: probing it, when no read has moved the queue's position since (its messages all
#: handed off): reads and probes walk the dead row versions left since the position,
#: which a long transaction elsewhere keeps (kombu_pgmq._db.positions).
REFRESH_SECONDS = 2.0

#: Seconds, in Celery's event loop, that reads and slot offers wait after a round that
#: delivered handed-off messages: Celery writes those tasks to its pool on the loop's
#: next turn, and a read now (say the fallback poll) would hold that write. 1 ms puts
#: the reads after that turn; 3 ms and 5 ms measured no better (benchmarks/README.md:
#: "Celery's write to its pool no longer waits for a read", ``kombu_pgmq_3ms``).
READ_AFTER_HANDOFF_SECONDS = 0.001


class Poller:
    """Wake-ups, polling rounds and event-loop registration of one transport.

    Arguments:
        options: the transport's options.
        topology: the transport's priority bands (a queue's PGMQ queues).
        listen_dsn: libpq string of the LISTEN connection (None: no LISTEN, consumers
            poll).
        readers: the read paths of the transport's channels now.
        broker: the statement connection's broker (connects if needed).
        broker_if_connected: the same without connecting (None when closed).
        owner: this connection's consumer identity (a forked child gets a new one).
        slots: the concurrency slots of early-acked tasks, released at each turn of
            Celery's event loop.
    """

    def __init__(
        self,
        options: TransportOptions,
        topology: Topology,
        *,
        listen_dsn: str | None,
        readers: Callable[[], Sequence[Reader]],
        broker: Callable[[], Broker],
        broker_if_connected: Callable[[], Broker | None],
        owner: Callable[[], str],
        slots: Slots,
    ) -> None:
        self.options = options
        self.topology = topology
        self.listen_dsn = listen_dsn
        self.readers = readers
        self.broker = broker
        self.broker_if_connected = broker_if_connected
        self.owner = owner
        self.slots = slots
        self.acks = AckBatch(durable=options.durable_acks)
        #: Hand-off slots offered and rows handed off.
        self.handoff = Handoff(options.vt_seconds, self.consumer_of, owner)
        #: Which consumed queues to read next, which ones we sleep on, when delayed
        #: messages become due.
        self.wakeups = Wakeups()
        self._listener: Listener | None = None
        self._due_timer: Any = None  # (deadline, hub timer entry) of the next due read
        self._draining = 0
        self._hub: Any = None
        self._hub_fds: list[int] = []
        self._hub_listener = (-1, -1)  # (fd, generation) of the LISTEN socket watched
        self._hub_timer: Any = None
        self._hub_thread = 0  # the event loop's thread (acks from others wait for it)
        self._polling = False  # inside poll(): an ack made by a callback waits for its end
        self._connection_lost_at: float | None = None
        self._canceled_at: float | None = None  # a read was cancelled (statement_timeout)
        self._retry_pending = False  # a reconnection attempt is scheduled in the event loop
        self._reads_deferred = False  # a timer of the loop reads after a hand-off's round
        self._reading_deferred = False  # in that timer's round

    def found_below(self, queues: set[str]) -> None:
        """From any thread (the heartbeat thread's look below the positions): ``queues``
        hold a visible row below where their reads start; the next round reads them
        from the start."""
        self.wakeups.found_below(queues)
        listener = self._listener
        if listener is not None:
            listener.wake()

    @property
    def polling_interval(self) -> float:
        """Seconds between fallback polls of every consumed queue."""
        return self.options.polling_interval

    # -- listening -------------------------------------------------------------------

    def listener(self) -> Listener:
        listener = self._listener
        if listener is None:
            dsn = self.listen_dsn
            if dsn is None:
                warn_polling_once(
                    "broker_transport_options",
                    "the broker is behind a transaction pooler (pooler="
                    "'transaction') without direct_url: no LISTEN, consumers poll every "
                    f"polling_interval ({self.polling_interval:g} s); set the transport "
                    "option direct_url to a direct PostgreSQL URL for prompt wake-ups",
                )
            listener = self._listener = Listener(dsn)
        return listener

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def on_consume(self, names: Sequence[str]) -> None:
        """A channel consumes PGMQ queues ``names`` (a queue's priority bands): LISTEN for
        them and read them now."""
        listener = self.listener()
        listener.listen(names)
        listener.fileno()  # connected and LISTENing from now on
        self.wakeups.ready.update(names)
        listener.wake()

    def on_cancel(self, names: Sequence[str]) -> None:
        """A consumer of PGMQ queues ``names`` was cancelled: stop listening to those no
        consumer is left for."""
        consumed = self.consumed()
        given_up = False
        for name in names:
            if name in consumed:
                continue
            was_waiting = self.wakeups.forget(name)
            self.handoff.armed.discard(name)
            if self._listener is not None:
                self._listener.unlisten([name])
            if was_waiting:
                broker = self.broker_if_connected()
                if broker is not None:
                    # the reaper removes the row with our consumers
                    with contextlib.suppress(errors.KombuPgmqError):
                        broker.consumers.stop_waiting(self.owner(), [name])
                        given_up = True
        if given_up and self._listener is not None:
            # handed off before that: given back
            self.handoff.settle(self._listener, self.broker_if_connected())

    def consumed(self) -> set[str]:
        """PGMQ queues (every priority band) of the queues consumed now."""
        bands = self.topology.bands
        return {name for r in self.readers() for q in r.consumed_queues for name in bands(q).queues}

    def consumer_of(self, name: str) -> tuple[Reader, str] | None:
        """``(reader, kombu queue)`` of the first channel consuming PGMQ queue ``name``
        (a band of the kombu queue), or None."""
        bands = self.topology.bands
        for reader in self.readers():
            for queue in reader.consumed_queues:
                if name in bands(queue).queues:
                    return reader, queue
        return None

    def wake(self, requeued: str | None = None) -> None:
        """End the current wait of :meth:`drain_events` (or run a poll in Celery's event
        loop) now; safe from any thread.

        Called when an ack or reject frees a prefetch slot (often from another thread,
        e.g. Celery's pool result handler), so the next read does not wait for a poll.
        ``requeued``: a PGMQ queue a message was just made visible in (read it too).
        """
        if requeued is not None:
            self.wakeups.ready.add(requeued)
        listener = self._listener
        if listener is not None:
            listener.wake()

    # -- acks ------------------------------------------------------------------------

    @property
    def in_event_loop(self) -> bool:
        """True once registered with Celery's event loop (kombu's hub)."""
        return self._hub is not None

    @property
    def defers_acks(self) -> bool:
        """True while acks go through :meth:`defer_ack`: inside :meth:`drain_events`
        (archived before it returns) and once registered with Celery's event loop (sent
        at once, or batched for :data:`~kombu_pgmq.transport.acks.ACK_BATCH_SECONDS`)."""
        return self._draining > 0 or self._hub is not None

    def defer_ack(self, held: Receipt) -> None:
        """Queue an ack for the next read or flush (one statement for many). In Celery's
        event loop, on the loop's thread, it is sent at once instead, without waiting
        for its result, as kombu's AMQP and Redis transports write an ack in ``ack()``
        (a worker killed right after its task finished then has its ack on the server):
        unless the last acks went less than
        :data:`~kombu_pgmq.transport.acks.ACK_BATCH_SECONDS` ago or the statement
        connection is busy, then with the next read or at a timer, together."""
        self.acks.add(held)
        if (
            self._hub is not None
            and not self._polling
            and threading.get_ident() == self._hub_thread
        ):
            self._send_acks_soon()
        self.wake()  # a prefetch slot is free: the loop's next turn reads if it may

    def _send_acks_soon(self) -> None:
        """In Celery's event loop: send the batched acks now if the last ones went at
        least :data:`~kombu_pgmq.transport.acks.ACK_BATCH_SECONDS` ago and the statement
        connection is free, else at a timer (one at a time) or with the next read,
        whichever comes first (:meth:`AckBatch.send_soon
        <kombu_pgmq.transport.acks.AckBatch.send_soon>`)."""
        wait = self.acks.send_soon(self.broker_if_connected(), monotonic(), self._acks_failed)
        if wait is not None and self._hub is not None:
            self._hub.call_later(wait, self._on_ack_timer)

    def _on_ack_timer(self) -> None:
        self.acks.timer_pending = False
        if self.acks and self._hub is not None:
            self._send_acks_soon()

    def _acks_failed(self, exc: errors.KombuPgmqError) -> None:
        """Acks sent in the event loop failed (they were put back): recover as a read."""
        if isinstance(exc, errors.StatementCanceled):
            self._statement_canceled(exc)
        else:
            self._connection_lost(exc)

    def flush_acks(self) -> None:
        """Archive the batched acks now (one ``pgmq.archive`` per queue)."""
        if self.acks:
            self.acks.flush(self.broker())

    # -- rounds ----------------------------------------------------------------------

    def _note_wakeups(self, listener: Listener) -> None:
        """Mark notified queues ready, and those whose delayed message is due; every
        consumed queue when the fallback poll is due or notifications may have been
        missed."""
        collected = listener.collect()
        self.handoff.handed += listener.take_handed()
        now = monotonic()
        wakeups = self.wakeups
        broker = self.broker_if_connected()
        found_below = wakeups.take_found_below()
        if broker is not None:
            # rows requeued to their place, or found by the heartbeat thread's look, lie
            # below where the reads start
            for name in listener.take_rewound() | found_below:
                broker.positions.forget(name)
        if collected is None:
            # A new LISTEN connection: the database may have restarted and forgotten our
            # waiting rows; record them again as queues are found empty. A rewind may
            # have been missed too: read every queue from the start.
            wakeups.waiting.clear()
            self.handoff.armed.clear()
            if broker is not None:
                broker.positions.forget()
        else:
            # notified queues, and the queues a fallback probe found visible
            notified, due = collected
            wakeups.notified(notified, due, now=now, wall_now=time.time())
        if wakeups.fallback_due(now, self.polling_interval, force=collected is None):
            # In Celery's event loop the fallback asks first, without waiting, which
            # queues hold a visible message, and reads those when the answer comes: a
            # read of every consumed queue here would hold up a hand-off arriving
            # meanwhile (a slow p99).
            in_loop = collected is not None and self._hub is not None
            consumed = self.consumed()
            positions = broker.positions if broker is not None else None
            probe_from = positions.probe_from if positions is not None else None
            if positions is not None and in_loop:
                # A queue whose messages are all handed off is never read: read it now
                # and then, so that its position stays fresh (a read, and this probe,
                # walk the dead row versions left since the position).
                stale = {n for n in consumed if (positions.age(n) or 0.0) >= REFRESH_SECONDS}
                wakeups.ready |= stale
                consumed -= stale
            probed = in_loop and listener.probe(consumed, probe_from)
            if not probed:
                wakeups.ready |= consumed
            else:
                if broker is not None:
                    # No read now: collect a result sent without waiting instead (never
                    # blocks), so acks whose statement failed are kept and sent again.
                    broker.db.free()
        wakeups.take_due(now)
        self._schedule_due()

    def poll(self) -> tuple[int, bool]:
        """One round: read the ready queues of every channel (batched acks ride along)
        and deliver. Returns ``(delivered, again)``; ``again`` asks for another round at
        once (queues that just went to sleep get their final read: it finds what publishers
        that missed their waiting row sent, see ``kombu_pgmq.wait_for``).
        """
        wakeups = self.wakeups
        since = self.acks.since
        acks = self.acks.take()
        taken = bool(acks)
        drained: set[str] = set()
        full: set[str] = set()
        retry: dict[str, float] = {}
        self._polling = True
        try:
            # READ_AFTER_HANDOFF_SECONDS: in Celery's event loop, not at a deferred round
            defer = self._hub is not None and bool(self.handoff.handed)
            defer = defer and not self._reading_deferred
            broker = self.broker()
            delivered, to_read = self.handoff.deliver(wakeups.waiting, broker, defer_rearm=defer)
            wakeups.ready |= to_read
            if defer and delivered and (wakeups.ready or self.handoff.rearm_pending):
                self._defer_reads()
                ready: set[str] = set()
            else:
                if self.handoff.rearm_pending:
                    wakeups.ready |= self.handoff.rearm_now(wakeups.waiting, broker)
                ready = set(wakeups.ready)
            for reader in list(self.readers()):
                if not reader.consumed_queues or not ready:
                    continue
                consumed = reader.consume(ready, acks)
                if consumed.acks_sent:
                    acks = []
                delivered += consumed.delivered
                drained |= consumed.drained
                full |= consumed.full
                retry.update(consumed.retry)
        finally:
            self._polling = False
            if taken and not acks:
                self.acks.sent_at = monotonic()  # they rode with the read
            if self._hub is not None:
                # Acks no read took (it was put off until half the prefetch window is
                # free) or made while delivering: sent on their own soon, without
                # waiting for the result, so a finished task's ack is on the server
                # before its worker can die.
                self.acks.put_back(acks, since)
                if self.acks:
                    self._send_acks_soon()
            elif acks:
                self.acks.send(self.broker(), acks, since)  # drain_events: before it returns
        listener = self.listener()
        # Without LISTEN (polling) nobody hears a NOTIFY: publishers are not asked for one.
        to_wait, to_busy = wakeups.after_round(drained, full, listening=not listener.polling)
        if to_busy:
            # A backlog: publishers stop notifying (their commits would serialize).
            self.broker().consumers.stop_waiting(self.owner(), to_busy)
            wakeups.stopped_waiting(to_busy)
            self.handoff.armed.difference_update(to_busy)
        rearm = self.handoff.slot(listener, (drained & wakeups.waiting) - self.handoff.armed)
        if rearm is not None and rearm.queues:  # took a handed message, found empty now
            consumers = self.broker().consumers
            # the slot is one per connection: every queue it is to be offered on is named
            offer = set(rearm.queues) | self.handoff.armed
            offered = consumers.rearm_handoff(self.owner(), sorted(offer))
            self.handoff.armed = offered
            wakeups.stopped_waiting(offer - offered)  # not waited on: wait_for again
        if to_wait:
            listener.fileno()  # LISTEN before publishers can see us waiting
            slot = self.handoff.slot(listener, to_wait)
            waiting = self.broker().consumers.wait_for(self.owner(), sorted(to_wait), slot)
            if slot is not None:
                self.handoff.armed |= set(slot.queues)
            if waiting.unsettled:
                logger.debug(
                    "a publisher to %s is still in its transaction: its message is found by "
                    "the fallback poll",
                    ", ".join(waiting.unsettled),
                )
            wakeups.clock_offset = waiting.clock_offset
            now = monotonic()
            for name, seconds in waiting.due.items():
                wakeups.due_at(name, now + seconds)
            self._schedule_due()
            wakeups.now_waiting(to_wait)  # and their final read, after wait_for committed
        if retry:  # a rate limit allows more then (nothing notifies it)
            now = monotonic()
            for name, seconds in retry.items():
                wakeups.due_at(name, now + seconds)
            self._schedule_due()
        if full and self._hub is not None:
            self.wake()  # more may wait: read again after the loop's other work
        return delivered, bool(to_wait)

    def _defer_reads(self) -> None:
        """In Celery's event loop: read the ready queues at a timer of the loop, after
        its next turn (see :data:`READ_AFTER_HANDOFF_SECONDS`)."""
        if not self._reads_deferred and self._hub is not None:
            self._reads_deferred = True
            self._hub.call_later(READ_AFTER_HANDOFF_SECONDS, self._on_deferred_reads)

    def _on_deferred_reads(self) -> None:
        self._reads_deferred = False
        self._reading_deferred = True  # this round reads, hand-off or not (no starving)
        try:
            self._on_hub_event()
        finally:
            self._reading_deferred = False

    def drain_events(self, timeout: float | None = None) -> None:
        """See :meth:`kombu_pgmq.transport.Transport.drain_events`."""
        start = monotonic()
        listener = self._listener
        if listener is None:  # nothing consumed
            if timeout is None:
                raise errors.ConfigurationError(
                    "drain_events() without a consumer would wait forever: "
                    "start a Consumer first, or give a timeout"
                )
            sleep(timeout)
            raise TimeoutError()
        self._draining += 1
        retried = False
        try:
            while True:
                canceled = False
                try:
                    self._note_wakeups(listener)
                    if self.wakeups.ready or self.acks or self.handoff.handed:
                        delivered, again = self.poll()
                        self._connection_ok()
                        if delivered:
                            return
                        if again:
                            continue
                except errors.BrokerConnectionError as exc:
                    # A dropped connection (server restart, pg_terminate_backend): the
                    # next statement reconnects. Retry once; raise if that fails too.
                    if retried:
                        raise
                    retried = True
                    self._connection_lost(exc)
                    continue
                except errors.StatementCanceled as exc:
                    self._statement_canceled(exc)  # acks too wait for the next poll
                    canceled = True
                now = monotonic()
                if timeout is not None and now - start >= timeout:
                    raise TimeoutError()
                wait = self.wakeups.next_fallback - now
                earliest = self.wakeups.earliest_due()
                if earliest is not None:  # a delayed message becomes visible
                    wait = min(wait, earliest - now)
                if self.acks and not canceled:
                    wait = 0  # put back by a failed round: archived at the next one
                if timeout is not None:
                    wait = min(wait, timeout - (now - start))
                if wait > 0:
                    listener.wait(wait)
        finally:
            self._draining -= 1
            if not self._draining and self._hub is None:
                try:
                    self.flush_acks()
                except errors.StatementCanceled as exc:
                    self._statement_canceled(exc)  # kept for the next flush or read

    # -- delayed messages becoming due ------------------------------------------------

    def _schedule_due(self) -> None:
        """In Celery's event loop: one timer, at the earliest due time."""
        if self._hub is None:
            return
        earliest = self.wakeups.earliest_due()
        timer = self._due_timer
        if timer is not None:
            if earliest is not None and timer[0] <= earliest:
                return  # an earlier (or the same) read is scheduled already
            with contextlib.suppress(Exception):
                timer[1].cancel()
            self._due_timer = None
        if earliest is not None:
            entry = self._hub.call_later(max(0.0, earliest - monotonic()), self._on_hub_due)
            self._due_timer = (earliest, entry)

    def _on_hub_due(self) -> None:
        self._due_timer = None
        self._on_hub_event()

    # -- recovery: a lost statement connection or a cancelled statement -----------------

    def _connection_lost(self, exc: BaseException) -> None:
        """The statement connection was lost in the event loop: keep every held message
        (leases renew once reconnected) and retry soon, instead of making Celery restart
        its consumer (which would requeue the running tasks)."""
        if self._connection_lost_at is None:
            self._connection_lost_at = monotonic()
            logger.warning(
                "database connection lost (%s); reconnecting every %.1f s, held messages are kept",
                exc,
                self.polling_interval,
            )
        try:
            consumed = self.consumed()
        except errors.KombuPgmqError:
            consumed = set()
        # waiting rows recorded again as queues are found empty
        self.wakeups.connection_lost(consumed)
        self.handoff.armed.clear()
        if self._hub is not None and not self._retry_pending:
            # retry soon, not at the next fallback poll only; one timer at a time
            self._retry_pending = True
            self._hub.call_later(RECONNECT_SECONDS, self._on_hub_retry)

    def _on_hub_retry(self) -> None:
        self._retry_pending = False
        self._on_hub_fallback()

    def _connection_ok(self) -> None:
        if self._connection_lost_at is not None:
            logger.warning(
                "database connection re-established after %.1f s",
                monotonic() - self._connection_lost_at,
            )
            self._connection_lost_at = None
        if self._canceled_at is not None:
            logger.warning("reads work again after %.1f s", monotonic() - self._canceled_at)
            self._canceled_at = None

    def _statement_canceled(self, exc: errors.StatementCanceled) -> None:
        """A read or ack was cancelled (``statement_timeout`` ran out, e.g. behind a lock
        an open transaction holds on a queue table, or ``pg_cancel_backend``): nothing was
        applied (the acks are kept) and the connection is fine. Not a lost connection:
        keep it and every held message, try again at the next fallback poll."""
        if self._canceled_at is None:
            self._canceled_at = monotonic()
            logger.warning(
                "reading the consumed queues failed: %s; trying again every %.1f s, held "
                "messages are kept",
                exc,
                self.polling_interval,
            )
        self.wakeups.next_fallback = monotonic() + self.polling_interval

    # -- Celery's event loop (asynloop) ---------------------------------------------------

    def register_with_event_loop(self, loop: Any) -> None:
        """Readers on the LISTEN socket and the wake pipe, a fallback poll every
        ``polling_interval`` seconds. Acks are batched from here on."""
        self.unregister_from_event_loop()  # registered twice: the last loop wins
        self._hub = loop
        self._hub_thread = threading.get_ident()
        listener = self.listener()
        self._hub_fds = [listener.wake_fileno]
        self._hub_listener = (-1, -1)
        loop.add_reader(listener.wake_fileno, self._on_hub_event)
        self._watch_listener(listener)
        self._hub_timer = loop.call_repeatedly(self.polling_interval, self._on_hub_fallback)
        # the pool's results (prefork, solo) are handled in the loop: a task that finished
        # frees its concurrency slot at the loop's next turn
        loop.on_tick.add(self.slots.release_finished)
        loop.call_soon(self._on_hub_event)

    def _watch_listener(self, listener: Listener) -> None:
        fd = listener.fileno()  # connects (and LISTENs) after a lost connection
        if fd >= 0 and (fd, listener.generation) != self._hub_listener:
            for old in self._hub_fds[1:]:
                with contextlib.suppress(Exception):  # closed with the lost connection
                    self._hub.remove_reader(old)
            self._hub_fds[1:] = [fd]
            self._hub_listener = (fd, listener.generation)
            self._hub.add_reader(fd, self._on_hub_event)

    def _on_hub_fallback(self) -> None:
        self.wakeups.next_fallback = 0.0
        self._on_hub_event()

    def _on_hub_event(self) -> None:
        listener = self._listener
        if listener is None or self._hub is None:
            return
        try:
            self._note_wakeups(listener)
            self._watch_listener(listener)
            for _ in range(2):  # a round, and the final read of queues that went to sleep
                handoff = self.handoff
                ready = self.wakeups.ready
                if not (ready or self.acks or handoff.handed or handoff.rearm_pending):
                    break
                _, again = self.poll()
                if not again:
                    break
        except errors.BrokerConnectionError as exc:
            self._connection_lost(exc)  # the fallback poll retries
        except errors.StatementCanceled as exc:
            self._statement_canceled(exc)  # so does it here
        else:
            self._connection_ok()

    def unregister_from_event_loop(self) -> None:
        hub, self._hub = self._hub, None
        self._reads_deferred = False  # its timer goes with the loop
        if hub is None:
            return
        for fd in self._hub_fds:
            with contextlib.suppress(Exception):  # the loop may be closing too
                hub.remove_reader(fd)
        self._hub_fds = []
        hub.on_tick.discard(self.slots.release_finished)
        if self._hub_timer is not None:
            self._hub_timer.cancel()
            self._hub_timer = None
        timer, self._due_timer = self._due_timer, None
        if timer is not None:
            with contextlib.suppress(Exception):
                timer[1].cancel()

    # -- closing ---------------------------------------------------------------------

    def close(self, broker: Broker | None) -> None:
        """Archive the batched acks and forget our waiting rows on ``broker`` (the
        statement connection, still open), then close the LISTEN connection. Acks sent
        without waiting are settled first (their result read), so every ack given before
        the close is archived when it returns."""
        self.unregister_from_event_loop()
        try:
            if broker is not None:
                broker.db.collect()
                if self.acks:
                    self.acks.flush(broker)
                if self.wakeups.waiting:
                    broker.consumers.stop_waiting(self.owner())
                    if self._listener is not None:  # handed off before that: give back
                        self.handoff.handed += self._listener.settle()
                self.handoff.give_back(self.handoff.handed, broker)
        except errors.KombuPgmqError as exc:
            logger.warning("closing: %s (unarchived acks are delivered again)", exc)
        finally:
            self.wakeups.waiting.clear()
            self.wakeups.due.clear()
            self.acks.clear()
            self.handoff.clear()
            listener, self._listener = self._listener, None
            if listener is not None:
                listener.close()

    def after_fork(self) -> None:
        """In a forked child: the parent's state is not ours (no flush, no cleanup)."""
        self.acks.clear()
        self.handoff.clear()
        self.wakeups.clear()
        self._due_timer = None
        self._hub = None
        self._hub_fds = []
        self._hub_timer = None
        self.acks.timer_pending = False
        self._draining = 0
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.abandon()  # a new one is made if this process consumes
