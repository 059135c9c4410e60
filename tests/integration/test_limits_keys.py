"""Per-key limits against a real PostgreSQL: a
message's key is its ``x-limit-key`` header (or the Celery task name, ``limit_key="task"``;
FIFO queues key by ``x-group-id``); no key goes over ``key_concurrency`` or ``key_rate``,
a saturated key never holds back other keys, messages without a key are not key-limited,
10,000 keys work."""

from __future__ import annotations

import time

import psycopg
import pytest
from kombu import Producer, Queue

from .helpers import connect, sql
from .limit_helpers import (
    Holder,
    declare,
    in_flight,
    insert,
    limits_info,
    set_limits,
    sql_ack,
    sql_read,
)


def _publish_keyed(conn, queue: str, keys: list[str | None], header: str = "x-limit-key"):
    q = Queue(queue, routing_key=queue)
    producer = Producer(conn)
    for n, key in enumerate(keys):
        headers = {header: key} if key is not None else {}
        producer.publish({"n": n, "key": key}, routing_key=queue, declare=[q], headers=headers)


def test_no_key_goes_over_its_concurrency_across_connections(db_dsn):
    """5 keys x 6 messages, key_concurrency 2, two consumers with a large prefetch: at
    every point no key has more than 2 delivered and unacked; all 30 get through."""
    keys = [f"k{n % 5}" for n in range(30)]
    options = {"polling_interval": 0.2}
    with connect(db_dsn, **options) as one, connect(db_dsn, **options) as two:
        _publish_keyed(one, "keyed", keys)
        assert set_limits(db_dsn, "keyed", {"key_concurrency": 2})
        queue = [Queue("keyed", routing_key="keyed")]
        with Holder(one, queue) as a, Holder(two, queue) as b:
            worst = 0
            deadline = time.monotonic() + 30
            while len(a.got) + len(b.got) < 30 and time.monotonic() < deadline:
                a.drain(0.1)
                b.drain(0.1)
                held = [m.payload["key"] for m in a.held + b.held]
                worst = max([worst] + [held.count(k) for k in set(held)])
                assert worst <= 2, held
                for holder in (a, b):  # settle the oldest two, keep the rest
                    for message in holder.held[:2]:
                        message.ack()
            assert len(a.got) + len(b.got) == 30
            assert worst == 2  # the limit was reached, not only respected
            for message in a.held + b.held:
                message.ack()
            a.drain(0.2)
            b.drain(0.2)
    assert sql(db_dsn, "SELECT count(*) FROM pgmq.a_keyed") == [(30,)]


def test_a_saturated_key_first_in_the_queue_does_not_hold_back_other_keys(db_dsn):
    """500 messages of key A, then 5 of key B, key_concurrency 1: the first read hands
    out A's head and B's head; a Kombu consumer gets both at once (it does not wait for A
    to settle, nor for its polling interval), and B's next once B's head is acked."""
    with connect(db_dsn, polling_interval=5) as conn:
        for queue in ("hog", "hogkombu"):
            declare(conn, queue)
            insert(db_dsn, queue, "jsonb_build_object('x-limit-key', 'A')", 500)
            insert(db_dsn, queue, "jsonb_build_object('x-limit-key', 'B')", 5)
            set_limits(db_dsn, queue, {"key_concurrency": 1})
        first = sql_read(db_dsn, ["hog"], 10)
        assert sorted(first.keyed()) == ["A", "B"]
        with Holder(conn, [Queue("hogkombu", routing_key="hogkombu")], prefetch=10) as holder:
            started = time.monotonic()
            holder.drain_until(2, timeout=3)
            assert sorted(m.headers["x-limit-key"] for m in holder.messages()) == ["A", "B"]
            assert holder.got[-1][0] - started < 1.0
            b_head = next(m for m in holder.held if m.headers["x-limit-key"] == "B")
            acked = time.monotonic()
            b_head.ack()
            holder.drain_until(3, timeout=3)
            assert len(holder.got) == 3 and holder.got[-1][1].headers["x-limit-key"] == "B"
            assert holder.got[-1][0] - acked < 1.0
            for message in holder.held:
                message.ack()


def test_a_rate_limited_key_first_in_the_queue_does_not_hold_back_other_keys(db_dsn):
    """500 messages of key A, then 3 of key B, key_rate 1/s (burst 1): each read hands
    out what the buckets allow: A's one token and B's, not A's alone (and then nothing
    of A while its bucket is empty, B still not starved by A's backlog)."""
    with connect(db_dsn) as conn:
        declare(conn, "slowkey")
    insert(db_dsn, "slowkey", "jsonb_build_object('x-limit-key', 'A')", 500)
    insert(db_dsn, "slowkey", "jsonb_build_object('x-limit-key', 'B')", 3)
    set_limits(db_dsn, "slowkey", {"key_rate": "1/s"})
    assert sorted(sql_read(db_dsn, ["slowkey"], 10).keyed()) == ["A", "B"]
    assert sql_read(db_dsn, ["slowkey"], 10).messages == []  # both buckets empty


def test_key_limits_hold_across_priority_bands_in_one_read(db_dsn):
    """A key's messages in two priority bands: one read delivers no more of the key than
    its rate bucket and its concurrency allow, whichever bands they are in."""
    prio = Queue("kprio", routing_key="kprio", max_priority=9)
    with connect(db_dsn) as conn:
        producer = Producer(conn)
        for priority in (9, 9, 0, 0):
            producer.publish(
                {"p": priority},
                routing_key="kprio",
                declare=[prio],
                priority=priority,
                headers={"x-limit-key": "K"},
            )
    bands = [
        b
        for (b,) in sql(
            db_dsn, "SELECT unnest(band_queues) FROM kombu_pgmq.queues WHERE queue = 'kprio'"
        )
    ]
    order = bands[::-1]  # band_queues: lowest band first; a read: highest first
    set_limits(db_dsn, "kprio", {"key_rate": "1/s"})
    assert len(sql_read(db_dsn, order, 10).messages) == 1
    set_limits(db_dsn, "kprio", {"key_rate": None, "key_concurrency": 1})
    sql(db_dsn, "UPDATE pgmq.q_kprio SET vt = clock_timestamp()")
    for band in bands:
        sql(db_dsn, f"UPDATE pgmq.q_{band} SET vt = clock_timestamp()")
    assert len(sql_read(db_dsn, order, 10).messages) == 1


def test_limit_key_task_keys_by_celery_task_name(db_dsn):
    with connect(db_dsn) as conn:
        names = ["tasks.a", "tasks.b", "tasks.a", "tasks.c", "tasks.b", "tasks.a"]
        _publish_keyed(conn, "tasks", names, header="task")
        _publish_keyed(conn, "tasks", ["ignored", "ignored"])  # x-limit-key: not the key
        set_limits(db_dsn, "tasks", {"key_concurrency": 1, "limit_key": "task"})
        first = sql_read(db_dsn, ["tasks"], 20)
        assert sorted(k for k in first.keyed("task") if k) == ["tasks.a", "tasks.b", "tasks.c"]
        assert first.keyed("x-limit-key").count("ignored") == 2  # no task header: no key
        assert sql_read(db_dsn, ["tasks"], 20).messages == []
        info = limits_info(db_dsn, "tasks")
        assert info is not None and info.limit_key == "task"
        assert (info.keys_in_flight, info.keys_at_limit, info.in_flight) == (3, 3, 5)
        assert info.throttled_keys == 2 and info.throttled_concurrency == 0


def test_key_rate_holds_per_key_and_leaves_other_keys_alone(db_dsn):
    """key_rate 10/s with key_burst 2: each key gets its burst at once, then about 10 a
    second; three keys side by side each get that."""
    with connect(db_dsn) as conn:
        declare(conn, "krate")
    for key in ("x", "y", "z"):
        insert(db_dsn, "krate", f"jsonb_build_object('x-limit-key', '{key}')", 40)
    set_limits(db_dsn, "krate", {"key_rate": "10/s", "key_burst": 2})
    first = sql_read(db_dsn, ["krate"], 100)
    assert sorted(first.keyed()) == ["x", "x", "y", "y", "z", "z"]
    state, retry = first.markers["krate"]
    assert state == 2 and retry is not None and 0 < retry <= 0.1 + 1e-9  # 1 token: 0.1 s
    started = time.monotonic()
    counts = {"x": 2, "y": 2, "z": 2}
    while time.monotonic() - started < 1.5:
        time.sleep(0.05)
        for key in sql_read(db_dsn, ["krate"], 100).keyed():
            counts[key] += 1
    elapsed = time.monotonic() - started
    for key, count in counts.items():
        assert count <= 2 + 10 * elapsed + 1, (key, count, elapsed)
        assert count >= 2 + 10 * 1.5 - 3, (key, count, elapsed)
    # refused reads did not count: nothing left behind was read
    assert sql(db_dsn, "SELECT max(read_ct) FROM pgmq.q_krate WHERE vt <= clock_timestamp()") == [
        (0,)
    ]


def test_messages_without_a_key_are_not_key_limited(db_dsn):
    with connect(db_dsn) as conn:
        _publish_keyed(conn, "mixed", ["k", None, "k", None, None, "k", None, None])
        set_limits(db_dsn, "mixed", {"key_concurrency": 1})
        got = sql_read(db_dsn, ["mixed"], 20)
        keys = got.keyed()
        assert (keys.count("k"), keys.count(None), len(keys)) == (1, 5, 6)


def test_a_fifo_queue_has_its_group_limit_and_refuses_key_limits(db_dsn):
    fifo = Queue("ordered", queue_arguments={"x-fifo-groups": True})
    with connect(db_dsn) as conn:
        producer = Producer(conn)
        for group, n in [("a", 1), ("b", 1), ("a", 2), ("c", 1), ("b", 2)]:
            producer.publish(
                {"g": group, "n": n},
                routing_key="ordered",
                declare=[fifo],
                headers={"x-group-id": group},
            )
    info = limits_info(db_dsn, "ordered")
    assert info is not None
    assert (info.limit_key, info.key_concurrency, info.ordered_keys) == ("x-group-id", 1, True)
    assert info.concurrency is None and info.rate is None
    for limits in ({"key_concurrency": 2}, {"key_rate": "1/s"}, {"limit_key": "task"}):
        with pytest.raises(psycopg.errors.InvalidParameterValue) as error:
            set_limits(db_dsn, "ordered", limits)
        assert "'ordered' is a FIFO queue" in str(error.value)
        assert "key limits belong on a queue without x-fifo-groups" in str(error.value)
    # queue-level concurrency works beside the groups: 2 of the 3 heads
    assert set_limits(db_dsn, "ordered", {"concurrency": 2})
    first = sql_read(db_dsn, ["ordered"], 10)
    heads = sorted(h["x-group-id"] for _, _, _, h in first.messages)
    assert len(heads) == 2 and len(set(heads)) == 2
    assert sql_read(db_dsn, ["ordered"], 10).messages == []
    info = limits_info(db_dsn, "ordered")
    assert info is not None and info.concurrency == 2 and info.key_concurrency == 1
    # cleared: the group limit stays (a FIFO queue is always limited)
    assert set_limits(db_dsn, "ordered", {"concurrency": None})
    sql_ack(db_dsn, "ordered", [m for _, m, _, _ in first.messages])
    after = sql_read(db_dsn, ["ordered"], 10)
    assert len(after.messages) == 3  # one per group: a2 or b2 after their heads, and c1


def test_ten_thousand_keys(db_dsn):
    """20,000 messages of 10,000 keys (two each), key_concurrency 1: reads deliver one
    message per key, never two of a key in flight; once settled, the second of each."""
    with connect(db_dsn) as conn:
        declare(conn, "many")
    insert(db_dsn, "many", "jsonb_build_object('x-limit-key', 'k' || (g % 10000))", 20000)
    set_limits(db_dsn, "many", {"key_concurrency": 1})
    started = time.monotonic()
    seen: list[str] = []
    ids: list[int] = []
    for _ in range(30):
        got = sql_read(db_dsn, ["many"], 1000, vt=120)
        if not got.messages:
            break
        seen += got.keyed()
        ids += [m for _, m, _, _ in got.messages]
    assert len(seen) == 10000 and len(set(seen)) == 10000
    assert in_flight(db_dsn, "pgmq.q_many") == 10000
    info = limits_info(db_dsn, "many")
    assert info is not None and (info.keys_in_flight, info.keys_at_limit) == (10000, 10000)
    assert sql_ack(db_dsn, "many", ids) == 10000
    second: list[str] = []
    for _ in range(30):
        got = sql_read(db_dsn, ["many"], 1000, vt=120)
        if not got.messages:
            break
        second += got.keyed()
    assert sorted(second) == sorted(seen)
    assert time.monotonic() - started < 20
