"""In-memory stand-ins for what the transport's decision code is given: a broker whose
PGMQ queues are lists of rows, a channel with its QoS, a listener, an event loop's timers.
No PostgreSQL: the unit tests of the ack batch, the hand-off and the reader use these, as
procrastinate's tests use its in-memory connector.

:class:`FakeBroker` answers the :class:`~kombu_pgmq._db.broker.Broker` methods those
objects call, as the statements do: a read delivers visible rows in order (``read_ct``
one higher each time) and holds them; an ack, requeue, discard, dead-letter or archive
applies to a receipt only while its delivery still holds the row (same ``read_ct``), else
it is stale. Every call is recorded in :attr:`FakeBroker.calls`.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from itertools import count
from typing import Any

from kombu.transport.virtual import Message

from kombu_pgmq import errors
from kombu_pgmq._db.rows import Reads, Receipt, Row, Throttle


class FakeDb:
    """The broker's connector: :meth:`free` says whether a statement could go now."""

    def __init__(self) -> None:
        self.busy = False

    def free(self) -> bool:
        return not self.busy


class FakeConsumers:
    """The hand-off statements of ``broker.consumers``: offers sent without waiting are
    answered with :meth:`answer`."""

    def __init__(self) -> None:
        self.rearmed: list[tuple[str, list[str]]] = []
        self.pending: list[tuple[list[str], Callable[..., None], Callable[..., None]]] = []
        #: Raised by the next :meth:`rearm_handoff_nowait` (the statement not sent).
        self.fail: errors.KombuPgmqError | None = None

    def rearm_handoff_nowait(
        self,
        owner: str,
        queues: Sequence[str],
        *,
        on_offered: Callable[[set[str]], None],
        on_error: Callable[[errors.KombuPgmqError], None],
    ) -> None:
        if self.fail is not None:
            raise self.fail
        self.rearmed.append((owner, list(queues)))
        self.pending.append((list(queues), on_offered, on_error))

    def answer(
        self, still: Iterable[str] | None = None, error: errors.KombuPgmqError | None = None
    ) -> None:
        """The server's answer to every offer sent: the queues still waited on (default:
        all offered), or an error."""
        pending, self.pending = self.pending, []
        for queues, on_offered, on_error in pending:
            if error is not None:
                on_error(error)
            else:
                on_offered(set(queues if still is None else still))


class FakeDeclarations:
    def __init__(self) -> None:
        #: Kombu queue -> (x-message-ttl, x-expires) in ms.
        self.lifetimes: dict[str, tuple[int | None, int | None]] = {}

    def lifetime(self, queue: str) -> tuple[int | None, int | None]:
        return self.lifetimes.get(queue, (None, None))


class FakeBroker:
    """An in-memory broker (see the module docstring)."""

    def __init__(self) -> None:
        self.db = FakeDb()
        self.consumers = FakeConsumers()
        self.declarations = FakeDeclarations()
        self.limited: set[str] = set()
        #: PGMQ queue -> its visible rows, in read order.
        self.queues: dict[str, list[Row]] = defaultdict(list)
        #: (PGMQ queue, msg_id) -> the row as its current delivery holds it.
        self.held: dict[tuple[str, int], Row] = {}
        #: (PGMQ queue, msg_id, reason) of the rows moved to the dead-letter queue.
        self.dead: list[tuple[str, int, str]] = []
        #: (method, arguments) of every call.
        self.calls: list[tuple[str, Any]] = []
        #: PGMQ queues whose table is gone (QueueNotFound).
        self.gone: set[str] = set()
        #: Limits of limited queues a read reports (``Reads.limits``).
        self.throttles: dict[str, Throttle] = {}
        #: False: acks of this broker cannot go without waiting (ack_nowait refuses).
        self.nowait = True
        #: Raised by the next ack statements (then cleared).
        self.ack_error: errors.KombuPgmqError | None = None
        #: Answers of acks sent without waiting: call :meth:`settle_nowait`.
        self.nowait_pending: list[tuple[list[Receipt], Callable[..., None]]] = []
        self._ids = count(1)

    # -- test set-up ----------------------------------------------------------------------

    def send(
        self, name: str, message: str = '{"n": 1}', headers: str | None = None, age: float = 0.0
    ) -> int:
        """Put a visible message in PGMQ queue ``name``; returns its msg_id."""
        msg_id = next(self._ids)
        self.queues[name].append(Row(msg_id, 0, message, headers, age, name, None))
        return msg_id

    def names(self, method: str) -> list[Any]:
        """The arguments of every call of ``method``."""
        return [args for called, args in self.calls if called == method]

    # -- reads ----------------------------------------------------------------------------

    def _check(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self.gone:
                raise errors.QueueNotFound(f"queue {name!r} does not exist")

    def _take(self, name: str, qty: int) -> list[Row]:
        rows, self.queues[name] = self.queues[name][:qty], self.queues[name][qty:]
        taken = [row._replace(read_ct=row.read_ct + 1) for row in rows]
        for row in taken:
            self.held[(name, row.msg_id)] = row
        return taken

    def read(self, name: str, vt_seconds: int, qty: int) -> Reads:
        self.calls.append(("read", (name, qty)))
        self._check([name])
        return Reads(self._take(name, qty), self._limits([name]))

    def read_many(
        self,
        names: Sequence[str],
        vt_seconds: int,
        qty: int,
        acks: Sequence[Receipt] = (),
        *,
        durable_acks: bool = True,
    ) -> Reads:
        self.calls.append(("read_many", (list(names), qty, list(acks))))
        self._check(names)
        self._settle(acks)
        rows: list[Row] = []
        for name in names:
            rows += self._take(name, qty - len(rows))
        return Reads(rows, self._limits(names))

    def _limits(self, names: Iterable[str]) -> dict[str, Throttle]:
        return {n: self.throttles[n] for n in names if n in self.throttles}

    def pop(self, name: str, qty: int) -> list[Row]:
        self.calls.append(("pop", (name, qty)))
        self._check([name])
        rows = self._take(name, qty)
        for row in rows:
            del self.held[(name, row.msg_id)]
        return rows

    # -- settling -------------------------------------------------------------------------

    def _settle(self, receipts: Iterable[Receipt]) -> set[tuple[str, int]]:
        """Remove the rows these receipts still hold; returns their (queue, msg_id)."""
        done = set()
        for r in receipts:
            row = self.held.get((r.queue, r.msg_id))
            if row is not None and row.read_ct == r.read_ct:
                del self.held[(r.queue, r.msg_id)]
                done.add((r.queue, r.msg_id))
        return done

    def ack(self, receipts: Sequence[Receipt], *, durable: bool = True) -> set[tuple[str, int]]:
        self.calls.append(("ack", list(receipts)))
        if self.ack_error is not None:
            error, self.ack_error = self.ack_error, None
            raise error
        return self._settle(receipts)

    def ack_nowait(
        self,
        receipts: Sequence[Receipt],
        *,
        durable: bool,
        on_settled: Callable[[set[tuple[str, int]]], None],
        on_error: Callable[[errors.KombuPgmqError], None],
    ) -> bool:
        if not self.nowait:
            return False
        self.calls.append(("ack_nowait", list(receipts)))
        if isinstance(self.ack_error, errors.BrokerConnectionError):
            error, self.ack_error = self.ack_error, None
            raise error
        self.nowait_pending.append((list(receipts), lambda: on_settled(self._settle(receipts))))
        return True

    def settle_nowait(self) -> None:
        """The results of the acks sent without waiting arrive."""
        pending, self.nowait_pending = self.nowait_pending, []
        for _, settle in pending:
            settle()

    def requeue(
        self, receipts: Sequence[Receipt], vt_seconds: int = 0, *, uncount: bool = False
    ) -> set[tuple[str, int]]:
        self.calls.append(("requeue", (list(receipts), uncount)))
        done = set()
        for r in receipts:
            row = self.held.get((r.queue, r.msg_id))
            if row is not None and row.read_ct == r.read_ct:
                del self.held[(r.queue, r.msg_id)]
                self.queues[r.queue].insert(0, row)
                done.add((r.queue, r.msg_id))
        return done

    def discard(self, receipts: Sequence[Receipt]) -> list[int]:
        self.calls.append(("discard", list(receipts)))
        return [r.msg_id for r in receipts]

    def archive_expired(self, receipts: Sequence[Receipt]) -> list[int]:
        self.calls.append(("archive_expired", list(receipts)))
        return [msg_id for _, msg_id in self._settle(receipts)]

    def dead_letter(
        self,
        name: str,
        receipts: Sequence[Receipt],
        *,
        dead_letter_queue: str,
        reason: str,
        kombu_queue: str,
        errors: Sequence[str | None] | None = None,
    ) -> list[int]:
        self.calls.append(("dead_letter", (name, [r.msg_id for r in receipts], reason, errors)))
        self._check([dead_letter_queue])
        moved = self._settle(receipts)
        self.dead += [(q, msg_id, reason) for q, msg_id in sorted(moved)]
        return [msg_id for _, msg_id in sorted(moved)]


class FakeQoS:
    """A channel's QoS: its prefetch window and the deliveries it holds."""

    def __init__(self, prefetch_count: int = 0) -> None:
        self.prefetch_count = prefetch_count
        self.held: dict[Any, Any] = {}

    def can_consume(self) -> bool:
        return not self.prefetch_count or len(self.held) < self.prefetch_count

    def can_consume_max_estimate(self) -> int | None:
        if not self.prefetch_count:
            return None
        return max(0, self.prefetch_count - len(self.held))

    def append(self, message: Any, delivery_tag: Any) -> None:
        self.held[delivery_tag] = message

    def holds(self, delivery_tag: Any) -> bool:
        return delivery_tag in self.held

    def forget(self, delivery_tag: Any) -> None:
        self.held.pop(delivery_tag, None)


class FakeChannel:
    """What a reader uses of its channel: consumed queues, QoS, messages; the queues it
    declares and recreates are recorded."""

    def __init__(self, prefetch_count: int = 0) -> None:
        self.consumed_queues: list[str] = []
        self.qos = FakeQoS(prefetch_count)
        self.declared_queues: list[str] = []
        self.recreated: list[str] = []

    def Message(self, payload: Any, channel: Any = None, **kwargs: Any) -> Any:
        return Message(payload, channel=self, **kwargs)

    def decode_body(self, body: Any, encoding: str | None = None) -> Any:
        assert encoding is None
        return body

    def declare_queue(self, queue: str) -> None:
        self.declared_queues.append(queue)

    def recreate(self, queue: str) -> None:
        self.recreated.append(queue)


class FakeLeases:
    """The lease keeper, as a reader uses it: its lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


class FakeListener:
    """The LISTEN connection, as the hand-off uses it: its slot, and the rows handed
    over it has not given yet."""

    def __init__(self, slot: tuple[str, int] | None = ("kombu_pgmq_slot_1", 1)) -> None:
        self.slot = slot
        self.slot_seq: int | None = 7 if slot is not None else None
        self.unsettled: list[Row] = []

    def settle(self) -> list[Row]:
        rows, self.unsettled = self.unsettled, []
        return rows
