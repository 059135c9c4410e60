"""Hand-off at publish: a publish to a queue an idle
consumer waits on writes the row as delivered to that consumer and sends it in the
consumer's NOTIFY. Every test counts the messages: a hand-off that goes wrong must leave
the message visible, or visible again after its visibility timeout, never lost."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
from kombu import Connection, Consumer, Producer, Queue

from kombu_pgmq._naming import pgmq_queue_name
from kombu_pgmq._stats import STATS

from .helpers import connect, sql, table, wait_for
from .limit_helpers import set_limits

# Long enough that a test passing within it cannot be explained by the fallback poll.
NO_FALLBACK = 60.0


def rows(db_dsn: str, queue: str) -> list[tuple[Any, ...]]:
    """(msg_id, read_ct, vt in the future) of the queue's rows, by msg_id."""
    return sql(db_dsn, f"SELECT msg_id, read_ct, vt > now() FROM {table(queue)} ORDER BY msg_id")


def slots(db_dsn: str, queue: str) -> list[int]:
    """Hand-off slots offered on the queue, one entry per waiting connection."""
    found = sql(
        db_dsn,
        "SELECT (o.owner IS NOT NULL)::int FROM kombu_pgmq.waiting w "
        "LEFT JOIN kombu_pgmq.handoff_offers o USING (pgmq_queue, owner) "
        "WHERE w.pgmq_queue = %s ORDER BY w.since",
        (pgmq_queue_name(queue),),
    )
    return [r[0] for r in found]


def drain_until(conn: Connection, got: list[Any], n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=max(0.01, deadline - time.monotonic()))


class Sender:
    """Publishes on one channel that declared the queue (so the plain direct publish,
    statement send_queue, is the one used: see ``Channel.plain``)."""

    def __init__(self, conn: Connection, queue: str) -> None:
        self.queue = Queue(queue, routing_key=queue)
        self.producer = Producer(conn.channel())
        self.queue(self.producer.channel).declare()

    def __call__(self, body: Any, **kwargs: Any) -> None:
        self.producer.publish(body, routing_key=self.queue.name, **kwargs)


def consume_acked(db_dsn: str, queue: str, count: int = 1, **options: Any) -> list[Any]:
    """Messages another connection consumes (and acks) from ``queue``: ``count`` of them,
    or what came within 10 s."""
    got: list[Any] = []
    with (
        connect(db_dsn, **options) as conn,
        Consumer(
            conn.channel(),
            [Queue(queue, routing_key=queue)],
            on_message=lambda m: (got.append(m), m.ack()),
        ),
    ):
        drain_until(conn, got, count, timeout=10)
    return got


def wait_until_offered(conn: Connection, db_dsn: str, queue: str, count: int = 1) -> None:
    """Run the consumer's events until ``count`` connections offer a slot on ``queue``."""
    deadline = time.monotonic() + 10
    while slots(db_dsn, queue).count(1) < count and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)
    assert slots(db_dsn, queue).count(1) >= count, slots(db_dsn, queue)


def test_claims_and_offers_write_no_waiting_row(db_dsn):
    """A claim (nextval) and the offer that follows (setval) change the consumer's
    sequence, not its kombu_pgmq.waiting row: the row keeps its version (ctid, xmin)
    through 30 hand-offs, so no dead versions pile up for publishes to walk while a long
    transaction holds the xmin horizon."""
    got: list[Any] = []
    with (
        connect(db_dsn, polling_interval=NO_FALLBACK) as conn,
        connect(db_dsn) as producer,
        Consumer(
            conn.channel(),
            [Queue("ho_rows", routing_key="ho_rows")],
            on_message=lambda m: (got.append(m), m.ack()),
        ),
    ):
        wait_until_offered(conn, db_dsn, "ho_rows")
        version = "SELECT ctid::text, xmin::text FROM kombu_pgmq.waiting WHERE pgmq_queue = %s"
        (before_version,) = sql(db_dsn, version, (pgmq_queue_name("ho_rows"),))
        before = STATS.handoffs
        send = Sender(producer, "ho_rows")
        for n in range(30):
            send({"n": n})
            drain_until(conn, got, n + 1, timeout=5)
            wait_until_offered(conn, db_dsn, "ho_rows")
        assert [m.decode() for m in got] == [{"n": n} for n in range(30)]
        assert STATS.handoffs == before + 30
        assert sql(db_dsn, version, (pgmq_queue_name("ho_rows"),)) == [before_version]


def test_a_waiting_consumer_is_handed_the_message_and_offers_its_slot_again(db_dsn):
    got: list[Any] = []
    with (
        connect(db_dsn, polling_interval=NO_FALLBACK) as conn,
        connect(db_dsn) as producer,
        Consumer(conn.channel(), [Queue("ho", routing_key="ho")], on_message=got.append),
    ):
        wait_until_offered(conn, db_dsn, "ho")
        before = STATS.handoffs
        Sender(producer, "ho")({"n": 1}, headers={"task": "t", "id": "1"})
        # written as delivered (read_ct 1, invisible) by the publish itself, slot taken
        assert [(r[1], r[2]) for r in rows(db_dsn, "ho")] == [(1, True)]
        drain_until(conn, got, 1, timeout=5)
        assert [m.decode() for m in got] == [{"n": 1}]
        assert got[0].headers == {"task": "t", "id": "1"}
        assert got[0].delivery_info["pgmq_read_ct"] == 1
        assert got[0].delivery_info["redelivered"] is False
        assert STATS.handoffs == before + 1
        # offered again (it has room), by a statement the consumer did not wait for
        wait_for(lambda: slots(db_dsn, "ho") == [1], 5, "the slot offered again")
        got[0].ack()
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.3)  # the ack goes out
        # the handed delivery's receipt settles it like a read one
        assert rows(db_dsn, "ho") == []
        assert sql(db_dsn, f"SELECT read_ct FROM {table('ho', 'a')}") == [(1,)]
        # the next publish is handed off too
        Sender(producer, "ho")({"n": 2})
        drain_until(conn, got, 2, timeout=5)
        assert [m.decode() for m in got] == [{"n": 1}, {"n": 2}]
        assert STATS.handoffs == before + 2
        got[1].ack()


def test_no_message_past_the_prefetch_window_beyond_one(db_dsn):
    """A consumer with prefetch 1 holding its handed message offers no slot: the next
    publish stays visible and is read once the first is acked."""
    got: list[Any] = []
    with (
        connect(db_dsn, polling_interval=NO_FALLBACK) as conn,
        connect(db_dsn) as producer,
        Consumer(
            conn.channel(),
            [Queue("ho_pf", routing_key="ho_pf")],
            on_message=got.append,
            prefetch_count=1,
        ),
    ):
        wait_until_offered(conn, db_dsn, "ho_pf")
        Sender(producer, "ho_pf")("a")
        drain_until(conn, got, 1, timeout=5)
        assert slots(db_dsn, "ho_pf") == [0]  # no room: not offered again
        Sender(producer, "ho_pf")("b")
        assert [r[1] for r in rows(db_dsn, "ho_pf")] == [1, 0]  # b: published, not handed
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.5)
        assert len(got) == 1  # the window is full
        got[0].ack()
        drain_until(conn, got, 2, timeout=5)
        assert [m.decode() for m in got] == ["a", "b"]
        got[1].ack()


def test_large_delayed_and_limited_messages_are_woken_for_not_handed(db_dsn):
    got: list[Any] = []
    with (
        connect(db_dsn, polling_interval=NO_FALLBACK) as conn,
        connect(db_dsn) as producer,
        Consumer(
            conn.channel(),
            [Queue("ho_no", routing_key="ho_no")],
            on_message=lambda m: (got.append(m), m.ack()),
        ),
    ):
        wait_until_offered(conn, db_dsn, "ho_no")
        Sender(producer, "ho_no")("x" * 9000)  # over a NOTIFY payload
        assert [r[1] for r in rows(db_dsn, "ho_no")] == [0]
        drain_until(conn, got, 1, timeout=5)
        wait_until_offered(conn, db_dsn, "ho_no")
        Sender(producer, "ho_no")("later", headers={"x-delay": 500})
        assert [(r[1], r[2]) for r in rows(db_dsn, "ho_no")] == [(0, True)]  # delayed, unread
        drain_until(conn, got, 2, timeout=5)
        wait_until_offered(conn, db_dsn, "ho_no")
        assert set_limits(db_dsn, "ho_no", {"concurrency": 5})
        Sender(producer, "ho_no")("limited")
        assert [r[1] for r in rows(db_dsn, "ho_no")] == [0]  # limited queues are read
        drain_until(conn, got, 3, timeout=5)
    bodies = [m.decode() for m in got]
    assert ["x" * 9000 if b == "x" * 9000 else b for b in bodies] == [
        "x" * 9000,
        "later",
        "limited",
    ]


def _consume_in_child(dsn: str, queue: str, offered: Any, got: Any) -> None:
    """A consumer process: waits on ``queue`` (sets ``offered`` once its slot is
    offered) and counts what it is delivered in ``got``, never acking."""
    with (
        Connection(
            dsn,
            transport_options={
                "polling_interval": NO_FALLBACK,
                "visibility_timeout": 2,
                "lease_renewal_interval": 0,
            },
        ) as conn,
        Consumer(
            conn.channel(),
            [Queue(queue, routing_key=queue)],
            on_message=lambda m: setattr(got, "value", got.value + 1),
        ),
    ):
        while True:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.1)
            if slots(dsn, queue) == [1]:
                offered.set()


def _child(db_dsn: str, queue: str) -> tuple[mp.Process, Any, Any]:
    ctx = mp.get_context("spawn")
    offered, got = ctx.Event(), ctx.Value("i", 0)
    child = ctx.Process(target=_consume_in_child, args=(db_dsn, queue, offered, got))
    child.start()
    assert offered.wait(30), "the child never offered a slot"
    return child, offered, got


def test_a_killed_consumer_s_slot_is_skipped_and_the_message_read_at_once(db_dsn):
    """kill -9 of an idle consumer leaves its waiting row (until the reaper), but not its
    LISTEN connection's lock: publishers skip its slot, the message stays visible."""
    with connect(db_dsn) as producer:
        producer.channel().queue_declare("ho_kill")
        child, _, _ = _child(db_dsn, "ho_kill")
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        deadline = time.monotonic() + 10  # its server session ends soon after
        while (
            time.monotonic() < deadline
            and sql(
                db_dsn,
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
                ("%:listener",),
            )[0][0]
        ):
            time.sleep(0.05)
        assert slots(db_dsn, "ho_kill") == [1]  # the stale row is still there
        Sender(producer, "ho_kill")("m")
        assert [(r[1], r[2]) for r in rows(db_dsn, "ho_kill")] == [(0, False)]
        got = consume_acked(db_dsn, "ho_kill")
        assert [m.decode() for m in got] == ["m"]


def test_a_message_handed_to_a_consumer_that_dies_comes_back_after_its_visibility_timeout(
    db_dsn,
):
    """The consumer is frozen (SIGSTOP: its LISTEN connection and lock stay) when the
    message is handed to it, then killed before it reads the notification: the row is a
    delivery whose lease lapses, delivered again after the visibility timeout (2 s)."""
    with connect(db_dsn) as producer:
        producer.channel().queue_declare("ho_die")
        child, _, got = _child(db_dsn, "ho_die")
        os.kill(child.pid, signal.SIGSTOP)
        try:
            Sender(producer, "ho_die")("m")
            assert [(r[1], r[2]) for r in rows(db_dsn, "ho_die")] == [(1, True)]  # handed
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.join()
        assert got.value == 0
        handed_at = time.monotonic()
        again = consume_acked(db_dsn, "ho_die", polling_interval=0.2)
        assert [m.decode() for m in again] == ["m"]
        assert again[0].delivery_info["pgmq_read_ct"] == 2
        assert time.monotonic() - handed_at > 1.0  # not before its lease lapsed


def test_messages_handed_off_while_closing_are_given_back(db_dsn):
    """A hand-off whose notification the consumer has not read when it closes is made
    visible again at the close (not counted as a delivery), not left to its visibility
    timeout."""
    conn = connect(db_dsn, polling_interval=NO_FALLBACK, visibility_timeout=600)
    got: list[Any] = []
    consumer = Consumer(
        conn.channel(), [Queue("ho_close", routing_key="ho_close")], on_message=got.append
    )
    consumer.consume()
    try:
        wait_until_offered(conn, db_dsn, "ho_close")
        with connect(db_dsn) as producer:
            Sender(producer, "ho_close")("m")
        assert [r[1] for r in rows(db_dsn, "ho_close")] == [1]
    finally:
        conn.release()  # never drained: the hand-off is unread
    assert got == []
    assert [(r[1], r[2]) for r in rows(db_dsn, "ho_close")] == [(1, False)]  # visible again
    again = consume_acked(db_dsn, "ho_close")
    assert [m.decode() for m in again] == ["m"]
    assert again[0].delivery_info["pgmq_deliveries"] == 1  # the give-back did not count


@pytest.mark.parametrize("consumers", [2])
def test_one_publish_is_handed_to_one_of_several_waiting_consumers(db_dsn, consumers):
    """Two connections wait on the queue: each publish goes to one of them (the longest
    waiting), every message exactly once."""
    got: list[list[Any]] = [[] for _ in range(consumers)]
    conns = [connect(db_dsn, polling_interval=NO_FALLBACK) for _ in range(consumers)]
    with contextlib.ExitStack() as stack:
        for index, conn in enumerate(conns):
            stack.enter_context(conn)
            stack.enter_context(
                Consumer(
                    conn.channel(),
                    [Queue("ho_two", routing_key="ho_two")],
                    on_message=lambda m, i=index: (got[i].append(m), m.ack()),
                )
            )
            wait_until_offered(conn, db_dsn, "ho_two", count=index + 1)
        with connect(db_dsn) as producer:
            for n in range(6):
                Sender(producer, "ho_two")(n)
                deadline = time.monotonic() + 5
                while sum(map(len, got)) < n + 1 and time.monotonic() < deadline:
                    for conn in conns:
                        with contextlib.suppress(TimeoutError):
                            conn.drain_events(timeout=0.05)
    bodies = sorted(m.decode() for each in got for m in each)
    assert bodies == list(range(6))
    assert all(each for each in got)  # both were handed messages


def test_one_slot_per_connection_across_priority_bands(db_dsn):
    """The consumer offers a slot on every priority band of its queue; a hand-off on one
    band takes the offers on all of them, so a higher priority published next is not
    handed past a full prefetch window: it waits and is read first."""
    queue = Queue("ho_prio", routing_key="ho_prio", max_priority=9)
    got: list[Any] = []
    with (
        connect(db_dsn, polling_interval=NO_FALLBACK, priority_steps=[0, 5, 9]) as conn,
        connect(db_dsn, priority_steps=[0, 5, 9]) as producer,
        Consumer(conn.channel(), [queue], on_message=got.append, prefetch_count=1),
    ):
        deadline = time.monotonic() + 10
        bands = sql(
            db_dsn,
            "SELECT count(*) FROM kombu_pgmq.handoff_offers WHERE pgmq_queue LIKE %s",
            (pgmq_queue_name("ho_prio") + "%",),
        )
        while bands[0][0] < 3 and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.2)
            bands = sql(
                db_dsn,
                "SELECT count(*) FROM kombu_pgmq.handoff_offers WHERE pgmq_queue LIKE %s",
                (pgmq_queue_name("ho_prio") + "%",),
            )
        assert bands == [(3,)]  # a slot offered on each of the three bands
        channel = producer.channel()
        queue(channel).declare()
        send = Producer(channel)
        send.publish("low", routing_key="ho_prio", priority=0)
        drain_until(conn, got, 1, timeout=5)  # handed off; the window (1) is full now
        send.publish("mid", routing_key="ho_prio", priority=5)
        send.publish("high", routing_key="ho_prio", priority=9)
        handed = sql(
            db_dsn,
            "SELECT count(*) FROM kombu_pgmq.handoff_offers WHERE pgmq_queue LIKE %s",
            (pgmq_queue_name("ho_prio") + "%",),
        )
        assert handed == [(0,)]  # the one slot went with the first hand-off
        got[0].ack()
        drain_until(conn, got, 2, timeout=5)
        got[1].ack()
        drain_until(conn, got, 3, timeout=5)
        got[2].ack()
    assert [m.decode() for m in got] == ["low", "high", "mid"]


def test_in_the_event_loop_a_handoff_round_reads_nothing_more_until_the_next_turn(db_dsn):
    """In Celery's event loop (a hub run by hand), the round that delivers a handed-off
    message neither reads another queue (here the fallback poll falls due in it, and
    queue b has a message no publish notified) nor offers the slot again: the slot waits
    for a timer after the loop's next turn, where Celery writes the task to its pool, and
    the fallback only sends its probe. Then b is read (when the probe's answer comes)
    and the slot offered again; both messages are acked, none lost."""
    import select

    from .helpers import FakeHub

    got: list[Any] = []
    with (
        connect(db_dsn, polling_interval=NO_FALLBACK) as conn,
        connect(db_dsn) as producer,
    ):
        sender = Sender(producer, "ho_turn_a")
        Queue("ho_turn_b", routing_key="ho_turn_b")(producer.channel()).declare()
        hub = FakeHub()
        conn.transport.register_with_event_loop(conn.connection, hub)
        poller = conn.transport.poller
        queues = [Queue(q, routing_key=q) for q in ("ho_turn_a", "ho_turn_b")]
        with Consumer(conn.channel(), queues, on_message=got.append):
            deadline = time.monotonic() + 10
            while slots(db_dsn, "ho_turn_a") != [1] or hub.soon:
                assert time.monotonic() < deadline, slots(db_dsn, "ho_turn_a")
                hub.run_once()
            sender("a")  # handed off
            assert [r[1] for r in rows(db_dsn, "ho_turn_a")] == [1]
            sql(db_dsn, "SELECT pgmq.send('ho_turn_b', '{}'::jsonb)")  # nobody notified
            listener = poller.listener().fileno()
            assert select.select([listener], [], [], 10)[0], "the hand-off never arrived"
            poller.wakeups.next_fallback = 0.0  # the fallback poll is due at the next event
            while not got:
                assert time.monotonic() < deadline, "the handed message was not delivered"
                hub.run_once()
            assert [m.delivery_info["routing_key"] for m in got] == ["ho_turn_a"]
            assert [r[1] for r in rows(db_dsn, "ho_turn_b")] == [0]  # not read yet
            assert slots(db_dsn, "ho_turn_a") == [0]  # not offered again yet
            assert hub.soon, "no timer for the deferred reads"
            hub.run_once()  # the loop's next turn: the timer's round, then the probe's answer
            while len(got) < 2:
                assert time.monotonic() < deadline, "b, found by the probe, was not read"
                hub.run_once()
            assert [m.delivery_info["routing_key"] for m in got] == ["ho_turn_a", "ho_turn_b"]
            wait_for(lambda: slots(db_dsn, "ho_turn_a") == [1], 5, "the slot offered again")
            for message in got:
                message.ack()
            while sql(db_dsn, "SELECT count(*) FROM pgmq.a_ho_turn_a, pgmq.a_ho_turn_b") != [(1,)]:
                assert time.monotonic() < deadline, "the acks were not archived"
                hub.run_once()
    assert rows(db_dsn, "ho_turn_a") == rows(db_dsn, "ho_turn_b") == []
