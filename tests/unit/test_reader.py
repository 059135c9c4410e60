"""The reader's consume decisions (kombu_pgmq.transport.reader) without PostgreSQL, on an
in-memory broker: how much a read asks for and when it is put off, which queues a round
found drained or full, poison rows, TTL, no_ack consumers, a callback that raises."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kombu_pgmq import errors
from kombu_pgmq._db.rows import THROTTLED_RATE, Receipt, Throttle
from kombu_pgmq._priorities import single
from kombu_pgmq.transport.options import TransportOptions
from kombu_pgmq.transport.reader import Reader, read_size, smallest_read
from kombu_pgmq.transport.topology import Topology
from tests.unit.fakes import FakeBroker, FakeChannel, FakeLeases


class Setup:
    """A reader of a fake channel on an in-memory broker, consuming ``queues``."""

    def __init__(
        self,
        *queues: str,
        prefetch: int = 0,
        in_loop: bool = False,
        no_ack: tuple[str, ...] = (),
        **options: Any,
    ) -> None:
        self.broker = FakeBroker()
        self.channel = FakeChannel(prefetch)
        self.loop = in_loop
        topology = Topology(lambda: self.broker)  # type: ignore[arg-type, return-value]
        self.reader = Reader(
            self.channel,  # type: ignore[arg-type]
            TransportOptions.parse(options),
            topology,
            lambda: self.broker,  # type: ignore[arg-type, return-value]
            in_event_loop=lambda: self.loop,
            leases=FakeLeases(),  # type: ignore[arg-type]
            propagate=(errors.BrokerConnectionError,),
        )
        self.reader.set_prefetch(prefetch)
        self.got: list[Any] = []
        for queue in queues:
            topology.set_bands(queue, single(queue))
            self.channel.consumed_queues.append(queue)
            self.reader.add_consumer(queue, self.got.append, queue in no_ack)

    def consume(self, only: set[str] | None = None, acks: list[Receipt] | None = None) -> Any:
        return self.reader.consume(only, acks or [])

    def ids(self) -> list[int]:
        return [m.delivery_info["pgmq_msg_id"] for m in self.got]


# -- the window ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "prefetch", "batch", "floor", "size"),
    [
        (None, 0, 100, 1, 100),  # unlimited: the batch size
        (10, 10, 100, 5, 10),  # nothing held: the whole window, however small
        (3, 10, 100, 5, None),  # held, less than half free: put off
        (5, 10, 100, 5, 5),  # half free: read
        (0, 10, 100, 5, 0),  # full
        (50, 50, 20, 10, 20),  # capped by the batch size
        (1, 1, 100, 1, 1),
    ],
)
def test_read_size(free: int | None, prefetch: int, batch: int, floor: int, size: int) -> None:
    assert read_size(free, prefetch, batch, floor) == size


def test_the_smallest_read_is_half_the_first_window() -> None:
    assert smallest_read(None, 0, 100) == 1  # unlimited
    assert smallest_read(8, 8, 100) == 4
    assert smallest_read(8, 40, 100) == 4  # Celery widened it for ETA tasks: not counted
    assert smallest_read(8, 2, 100) == 1  # narrowed since: the smaller one
    assert smallest_read(300, 300, 100) == 50  # at most half the batch size
    assert smallest_read(1, 1, 100) == 1


def test_a_read_waits_until_half_the_window_is_free() -> None:
    s = Setup("q", prefetch=4)
    for _ in range(6):
        s.broker.send("q")
    assert s.consume().delivered == 4
    s.channel.qos.held.popitem()  # one acked: 1 of 4 free
    consumed = s.consume()
    assert consumed.deferred and consumed.delivered == 0
    assert s.reader.deferred_reads == 1 and len(s.broker.names("read_many")) == 1
    s.channel.qos.held.popitem()  # 2 of 4 free: read
    assert s.consume().delivered == 2


def test_nothing_is_read_while_the_window_is_full_or_nothing_is_consumed() -> None:
    s = Setup("q", prefetch=1)
    s.broker.send("q")
    s.broker.send("q")
    assert s.consume().delivered == 1
    full = s.consume()
    assert (full.delivered, full.deferred) == (0, False)
    s.channel.consumed_queues.clear()
    assert s.consume().delivered == 0
    assert len(s.broker.names("read_many")) == 1


# -- drained and full ---------------------------------------------------------------------


def test_queues_found_empty_are_drained_and_those_that_filled_the_read_full() -> None:
    s = Setup("a", "b", "c", prefetch=3)
    for queue in ("a", "a", "a", "a", "b"):
        s.broker.send(queue)
    consumed = s.consume()
    # one read of all three, up to the free window, in consumption order
    ((names, qty, _),) = s.broker.names("read_many")
    assert (names, qty) == (["a", "b", "c"], 3)
    assert consumed.delivered == 3 and consumed.acks_sent
    assert consumed.full == {"a"}  # it filled what was left: may hold more
    assert consumed.drained == set()  # nothing was left to read b and c with
    s.channel.qos.held.clear()
    consumed = s.consume()
    assert consumed.delivered == 2  # b's, then a's last one (b is read first now)
    assert consumed.drained == {"a", "b", "c"}


def test_only_the_ready_queues_are_read_and_the_first_one_rotates() -> None:
    s = Setup("a", "b")
    s.broker.send("a")
    s.broker.send("b")
    s.consume(only={"b"})
    s.consume()
    s.consume()
    orders = [names for names, _, _ in s.broker.names("read_many")]
    assert orders == [["b"], ["b", "a"], ["a", "b"]]


def test_acks_ride_with_the_read() -> None:
    s = Setup("q")
    s.broker.send("q")
    (row,) = s.broker.read("q", 30, 1)
    ack = Receipt("q", row.msg_id, row.read_ct, None)
    assert s.consume(acks=[ack]).acks_sent
    assert s.broker.names("read_many")[0][2] == [ack] and not s.broker.held


def test_a_rate_limited_queue_is_read_again_when_its_tokens_are_due() -> None:
    s = Setup("q")
    s.broker.throttles["q"] = Throttle(THROTTLED_RATE, 0.25)
    assert dict(s.consume().retry) == {"q": 0.25}


def test_a_dropped_queue_is_read_queue_by_queue_and_recreated() -> None:
    s = Setup("a", "b")
    s.broker.send("b")
    s.broker.gone.add("a")
    consumed = s.consume()
    assert s.channel.recreated == ["a"]
    assert consumed.delivered == 1 and not consumed.acks_sent  # the caller archives them
    assert [c for c, _ in s.broker.calls] == ["read_many", "read", "read"]


# -- poison rows and TTL --------------------------------------------------------------------


def test_an_undecodable_row_is_dead_lettered_alone() -> None:
    s = Setup("q")
    # a base64 body must be a JSON string
    s.broker.send("q", headers=json.dumps({"x-kombu": {"body-encoding": "base64"}}))
    good = s.broker.send("q")
    consumed = s.consume()
    assert consumed.delivered == 1 and s.ids() == [good]
    ((_, moved, reason, error_texts),) = s.broker.names("dead_letter")
    assert (moved, reason) == ([good - 1], "undecodable")
    assert error_texts is not None and len(error_texts) == 1


def test_a_message_delivered_more_than_max_deliveries_times_is_dead_lettered() -> None:
    s = Setup("q", max_deliveries=2)
    msg_id = s.broker.send("q")
    for _ in range(2):  # delivered twice, never acked: visible again each time
        s.consume()
        s.broker.queues["q"].append(s.broker.held.pop(("q", msg_id)))
        s.channel.qos.held.clear()
    consumed = s.consume()
    assert consumed.delivered == 0 and len(s.got) == 2
    assert s.broker.dead == [("q", msg_id, "max_deliveries")]


def test_the_dead_letter_queue_is_declared_when_missing() -> None:
    s = Setup("q", max_deliveries=1)
    msg_id = s.broker.send("q")
    s.broker.queues["q"][0] = s.broker.queues["q"][0]._replace(read_ct=1)  # delivered once
    s.broker.gone.add("kombu_pgmq_dlq")

    def declare(queue: str) -> None:
        s.channel.declared_queues.append(queue)
        s.broker.gone.discard(queue)

    s.channel.declare_queue = declare  # type: ignore[method-assign]
    s.consume()
    assert s.channel.declared_queues == ["kombu_pgmq_dlq"]
    assert s.broker.dead == [("q", msg_id, "max_deliveries")]


def test_an_expired_message_is_archived_not_delivered() -> None:
    s = Setup("q")
    s.broker.declarations.lifetimes["q"] = (1000, None)  # x-message-ttl 1 s
    old = s.broker.send("q", age=2.0)
    fresh = s.broker.send("q", age=0.5)
    assert s.consume().delivered == 1 and s.ids() == [fresh]
    ((receipt,),) = s.broker.names("archive_expired")
    assert receipt.msg_id == old


def test_a_delayed_message_expires_counting_from_when_it_became_visible() -> None:
    s = Setup("q")
    s.broker.declarations.lifetimes["q"] = (1000, None)
    headers = json.dumps({"x-kombu": {"properties": {"pgmq_delay_seconds": 5}}})
    s.broker.send("q", headers=headers, age=5.5)  # visible for 0.5 s
    assert s.consume().delivered == 1


def test_an_expired_celery_task_is_delivered_for_the_worker_to_revoke() -> None:
    s = Setup("q")
    s.broker.declarations.lifetimes["q"] = (1000, None)
    headers = json.dumps({"task": "t", "id": "1"})
    s.broker.send("q", headers=headers, age=3.0)
    assert s.consume().delivered == 1
    (message,) = s.got
    assert message.headers["expires"]  # when the TTL passed: the worker revokes it
    assert not s.broker.names("archive_expired")


# -- no_ack consumers and failing callbacks -----------------------------------------------------


def test_what_a_no_ack_consumer_was_handed_is_deleted_once_delivered() -> None:
    s = Setup("q", no_ack=("q",))
    first = s.broker.send("q")
    second = s.broker.send("q")
    consumed = s.consume()
    assert consumed.delivered == 2 and s.channel.qos.held == {}
    (receipts,) = s.broker.names("discard")
    assert [r.msg_id for r in receipts] == [first, second]


def test_a_callback_that_raises_outside_the_event_loop_releases_the_rest() -> None:
    s = Setup("q")
    for _ in range(3):
        s.broker.send("q")

    def boom(message: Any) -> None:
        raise RuntimeError("bug")

    s.reader.add_consumer("q", boom, False)
    with pytest.raises(RuntimeError):
        s.consume()
    ((receipts, uncount),) = s.broker.names("requeue")
    assert [r.msg_id for r in receipts] == [2, 3] and uncount


def test_a_callback_that_raises_in_the_event_loop_dead_letters_its_message() -> None:
    s = Setup("q", in_loop=True)
    for _ in range(2):
        s.broker.send("q")
    calls: list[int] = []

    def first_fails(message: Any) -> None:
        calls.append(message.delivery_info["pgmq_msg_id"])
        if len(calls) == 1:
            raise RuntimeError("bug")

    s.reader.add_consumer("q", first_fails, False)
    assert s.consume().delivered == 2 and calls == [1, 2]
    assert s.broker.dead == [("q", 1, "consumer_error")]
    held = [m.delivery_info["pgmq_msg_id"] for m in s.channel.qos.held.values()]
    assert held == [2]  # the one that failed is settled


def test_a_connection_error_of_a_callback_propagates_in_the_event_loop() -> None:
    s = Setup("q", in_loop=True)
    s.broker.send("q")

    def lost(message: Any) -> None:
        raise errors.BrokerConnectionError("lost")

    s.reader.add_consumer("q", lost, False)
    with pytest.raises(errors.BrokerConnectionError):
        s.consume()
    assert not s.broker.dead


def test_rows_of_a_cancelled_consumer_are_made_visible_again() -> None:
    s = Setup("q")
    msg_id = s.broker.send("q")
    s.broker.send("q")
    (row,) = s.broker.read("q", 30, 1)
    s.reader.remove_consumer("q")
    assert s.reader.deliver_rows("q", "q", [row]) == 1  # handed over, nobody to take it
    ((receipts, uncount),) = s.broker.names("requeue")
    assert [r.msg_id for r in receipts] == [msg_id] and uncount
    assert not s.got
