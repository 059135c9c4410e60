"""The hand-off's decisions (kombu_pgmq.transport._handoff.Handoff) without PostgreSQL:
which slot is offered, where handed rows go, when the slot is offered again (at once,
later, or after a read), what is given back."""

from __future__ import annotations

from typing import Any

from kombu_pgmq import errors
from kombu_pgmq._db.rows import Row
from kombu_pgmq.transport._handoff import Handoff
from tests.unit.fakes import FakeBroker, FakeListener


class FakeReader:
    """A channel's reader, as the hand-off uses it."""

    def __init__(self, *, no_ack: bool = False, room: bool = True) -> None:
        self.no_ack = no_ack
        self.room = room
        self.delivered: list[tuple[str, str, list[int]]] = []

    def is_no_ack(self, queue: str) -> bool:
        return self.no_ack

    def can_consume(self) -> bool:
        return self.room

    def deliver_rows(self, queue: str, name: str, rows: list[Row]) -> int:
        self.delivered.append((queue, name, [r.msg_id for r in rows]))
        return len(rows)


def handoff(consumers: dict[str, Any]) -> Handoff:
    """A hand-off whose PGMQ queue ``name`` is consumed by ``consumers[name]`` (a
    FakeReader; the Kombu queue has the same name)."""

    def consumer_of(name: str) -> Any:
        reader = consumers.get(name)
        return None if reader is None else (reader, name)

    return Handoff(30, consumer_of, lambda: "host:1:owner")


def row(name: str, msg_id: int) -> Row:
    return Row(msg_id, 1, '{"n": 1}', None, 0.0, name, None)


def test_the_slot_is_offered_on_the_queues_consumed_with_acks_only() -> None:
    h = handoff({"a": FakeReader(), "b": FakeReader(no_ack=True)})
    slot = h.slot(FakeListener(), {"a", "b", "gone"})
    assert slot is not None
    assert (list(slot.queues), slot.vt_seconds, slot.seq) == (["a"], 30, 7)
    assert h.slot(FakeListener(slot=None), {"a"}) is None


def test_handed_rows_are_delivered_and_the_slot_offered_again_where_there_is_room() -> None:
    reader = FakeReader()
    h = handoff({"a": reader})
    broker = FakeBroker()
    h.armed = {"a"}
    h.handed = [row("a", 1), row("a", 2)]
    waiting = {"a"}
    delivered, to_read = h.deliver(waiting, broker)
    assert (delivered, to_read) == (2, set())
    assert reader.delivered == [("a", "a", [1, 2])]
    assert broker.consumers.rearmed == [("host:1:owner", ["a"])]
    assert h.armed == {"a"} and not h.handed  # taken as offered until the answer
    broker.consumers.answer(still=set())  # the queue is no longer waited on
    assert h.armed == set() and waiting == set()  # waited on again when found empty


def test_a_full_window_reads_instead_of_offering_the_slot() -> None:
    h = handoff({"a": FakeReader(room=False)})
    broker = FakeBroker()
    h.handed = [row("a", 1)]
    delivered, to_read = h.deliver({"a"}, broker)
    assert (delivered, to_read) == (1, {"a"})
    assert broker.consumers.rearmed == []


def test_rows_of_a_queue_no_longer_consumed_are_given_back_uncounted() -> None:
    reader = FakeReader()
    h = handoff({"a": reader})
    broker = FakeBroker()
    broker.send("gone")
    (taken,) = broker.read("gone", 30, 1)
    h.handed = [taken, row("a", 9)]
    delivered, _ = h.deliver(set(), broker)
    assert delivered == 1 and reader.delivered == [("a", "a", [9])]
    ((receipts, uncount),) = broker.names("requeue")
    assert [r.msg_id for r in receipts] == [taken.msg_id] and uncount
    assert [r.msg_id for r in broker.queues["gone"]] == [taken.msg_id]  # visible again


def test_a_deferred_offer_waits_for_rearm_now_and_skips_queues_offered_since() -> None:
    h = handoff({"a": FakeReader(), "b": FakeReader()})
    broker = FakeBroker()
    h.handed = [row("a", 1), row("b", 2)]
    waiting = {"a", "b"}
    assert h.deliver(waiting, broker, defer_rearm=True) == (2, set())
    assert h.rearm_pending == {"a", "b"} and broker.consumers.rearmed == []
    h.armed.add("b")  # offered by a read's wait_for meanwhile
    assert h.rearm_now(waiting, broker) == set()
    # one slot per connection: the offer names every queue it stands on
    assert broker.consumers.rearmed == [("host:1:owner", ["a", "b"])]
    assert h.rearm_pending == set() and h.armed == {"a", "b"}


def test_rearm_now_leaves_queues_no_longer_waited_on() -> None:
    h = handoff({"a": FakeReader()})
    broker = FakeBroker()
    h.rearm_pending = {"a"}
    assert h.rearm_now(set(), broker) == set()
    assert broker.consumers.rearmed == [] and h.rearm_pending == set()


def test_an_offer_that_cannot_be_sent_makes_the_queue_read_instead() -> None:
    h = handoff({"a": FakeReader()})
    broker = FakeBroker()
    broker.consumers.fail = errors.BrokerConnectionError("lost")
    h.handed = [row("a", 1)]
    assert h.deliver({"a"}, broker) == (1, {"a"})
    assert h.armed == set()


def test_an_offer_that_fails_on_the_server_is_forgotten() -> None:
    h = handoff({"a": FakeReader()})
    broker = FakeBroker()
    h.handed = [row("a", 1)]
    waiting = {"a"}
    h.deliver(waiting, broker)
    assert h.armed == {"a"}
    broker.consumers.answer(error=errors.StatementCanceled("statement_timeout"))
    assert h.armed == set() and waiting == set()


def test_settle_keeps_rows_of_consumed_queues_and_gives_back_the_others() -> None:
    h = handoff({"a": FakeReader()})
    broker = FakeBroker()
    broker.send("gone")
    (taken,) = broker.read("gone", 30, 1)
    listener = FakeListener()
    listener.unsettled = [row("a", 5), taken]
    h.settle(listener, broker)
    assert [r.msg_id for r in h.handed] == [5]  # delivered by the next poll
    assert [r.msg_id for r in broker.queues["gone"]] == [taken.msg_id]


def test_nothing_is_given_back_without_a_connection() -> None:
    h = handoff({})
    h.give_back([row("a", 1)], None)  # nothing to send it on: back after its VT
    h.armed, h.handed, h.rearm_pending = {"a"}, [row("a", 2)], {"a"}
    h.clear()
    assert (h.armed, h.handed, h.rearm_pending) == (set(), [], set())
