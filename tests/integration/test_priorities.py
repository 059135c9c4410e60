"""Priorities (x-max-priority) as PGMQ queues per band, against a real PostgreSQL."""

from __future__ import annotations

import pytest
from kombu import Consumer, Exchange, Producer, Queue
from kombu.exceptions import ChannelError

from kombu_pgmq._priorities import band_queue_name

from .helpers import connect, drain, sql


def _pgmq_queues(dsn: str) -> set[str]:
    return {r[0] for r in sql(dsn, "SELECT queue_name FROM pgmq.meta")}


def _publish(conn, queue: Queue, items: list[tuple[int, str]], **kwargs) -> None:
    with conn.channel() as channel:
        producer = Producer(channel)
        for priority, body in items:
            producer.publish(
                body, routing_key=queue.routing_key, declare=[queue], priority=priority, **kwargs
            )


def _consume_in_order(conn, queue: Queue, n: int) -> list[str]:
    got: list[str] = []

    def on_message(message):
        got.append(message.payload)
        message.ack()

    with Consumer(conn.channel(), [queue], on_message=on_message, prefetch_count=1):
        while len(got) < n:
            conn.drain_events(timeout=5)
    return got


def test_higher_priority_first_fifo_within_a_priority(db_dsn):
    queue = Queue("prio", routing_key="prio", max_priority=9)
    items = [(0, "a0"), (5, "b5"), (9, "c9"), (5, "d5"), (1, "e1"), (9, "f9"), (0, "g0")]
    with connect(db_dsn) as conn:
        _publish(conn, queue, items)
        assert _consume_in_order(conn, queue, len(items)) == [
            "c9", "f9", "b5", "d5", "e1", "a0", "g0"
        ]  # fmt: skip


def test_bands_are_pgmq_queues_counted_purged_and_dropped_together(db_dsn):
    queue = Queue("banded", routing_key="banded", max_priority=3)
    with connect(db_dsn) as conn:
        _publish(conn, queue, [(0, "x"), (2, "y"), (3, "z"), (7, "over")])
        bands = {band_queue_name("banded", f) for f in range(4)}
        assert bands <= _pgmq_queues(db_dsn)
        assert "banded" in bands  # band 0 is the queue's own PGMQ queue
        # a priority above x-max-priority counts as the maximum
        assert sql(db_dsn, f"SELECT count(*) FROM pgmq.q_{band_queue_name('banded', 3)}") == [(2,)]
        channel = conn.channel()
        assert channel.queue_declare("banded", passive=True).message_count == 4
        assert channel.queue_purge("banded") == 4
        _publish(conn, queue, [(1, "again")])
        channel.queue_delete("banded")
        assert not bands & _pgmq_queues(db_dsn)


def test_priority_steps_coarsen_the_bands(db_dsn):
    queue = Queue("coarse", routing_key="coarse", max_priority=9)
    with connect(db_dsn, priority_steps=[0, 5]) as conn:
        _publish(conn, queue, [(7, "p7"), (9, "p9"), (2, "p2"), (5, "p5")])
        assert band_queue_name("coarse", 9) not in _pgmq_queues(db_dsn)
        # 5..9 share a band (FIFO inside), above 0..4
        assert _consume_in_order(conn, queue, 4) == ["p7", "p9", "p5", "p2"]


def test_every_process_uses_the_stored_band_layout(db_dsn):
    """The first declaration fixes the bands; a process with other settings follows it."""
    queue = Queue("shared.prio", routing_key="shared.prio", max_priority=9)
    with connect(db_dsn, priority_steps=[0, 5]) as first:
        first.channel().queue_declare(
            "shared.prio", arguments={"x-max-priority": 9}, durable=True, auto_delete=False
        )
    with connect(db_dsn) as producer:  # default: a band per level, but the queue exists
        _publish(producer, queue, [(3, "low"), (8, "high")])
    with connect(db_dsn) as consumer:
        assert _consume_in_order(consumer, queue, 2) == ["high", "low"]


def test_routed_publish_goes_to_the_priority_band(db_dsn):
    exchange = Exchange("prio.ex", type="topic")
    queue = Queue("prio.routed", exchange, routing_key="job.#", max_priority=9)
    with connect(db_dsn) as conn:
        with conn.channel() as channel:
            producer = Producer(channel, exchange)
            queue(channel).declare()
            for priority, body in [(1, "slow"), (9, "urgent"), (4, "mid")]:
                producer.publish(body, routing_key="job.x", priority=priority)
        assert sql(db_dsn, f"SELECT count(*) FROM pgmq.q_{band_queue_name('prio.routed', 9)}") == [
            (1,)
        ]
        assert _consume_in_order(conn, queue, 3) == ["urgent", "mid", "slow"]


def test_redeclare_with_another_max_priority_is_refused(db_dsn):
    with connect(db_dsn) as conn:
        channel = conn.channel()
        Queue("fixed", max_priority=5)(channel).declare()
        Queue("fixed")(channel).declare()  # without arguments: fine (plain consumers)
    with connect(db_dsn) as conn, pytest.raises(ChannelError, match="x-max-priority"):
        Queue("fixed", max_priority=9)(conn.channel()).declare()


def test_bad_priority_arguments_name_the_fix(db_dsn):
    from kombu_pgmq.errors import ConfigurationError

    with connect(db_dsn) as conn, pytest.raises(ConfigurationError, match="x-max-priority"):
        conn.channel().queue_declare("bad.prio", arguments={"x-max-priority": 0})
    conn = connect(db_dsn, priority_steps=[0, 12])
    with pytest.raises(ConfigurationError, match="priority_steps"), conn:
        conn.channel()


def test_queue_without_priority_ignores_message_priority(db_dsn):
    with connect(db_dsn) as conn:
        _publish(conn, Queue("plainq", routing_key="plainq"), [(9, "a"), (0, "b"), (5, "c")])
        got = drain(conn, "plainq", expect=3)
        assert [m.payload for m in got] == ["a", "b", "c"]


def test_basic_get_takes_the_highest_priority_first(db_dsn):
    queue = Queue("getprio", routing_key="getprio", max_priority=9)
    with connect(db_dsn) as conn:
        _publish(conn, queue, [(2, "two"), (8, "eight"), (0, "zero")])
        channel = conn.channel()
        got = [channel.basic_get("getprio", no_ack=True).payload for _ in range(3)]
        assert got == ["eight", "two", "zero"]
        assert channel.basic_get("getprio") is None
