"""Fleet-wide queue limits against a real PostgreSQL, through
Kombu connections and SQL: a queue's concurrency holds across connections and an ack
hands the freed slot to a waiting consumer at once; slots come back when leases expire;
a rate is a token bucket; a refused delivery is not a delivery; priorities, other queues
and live changes; errors; ``limits_info``; least privilege. Per-key limits:
test_limits_keys.py."""

from __future__ import annotations

import contextlib
import threading
import time

import psycopg
import pytest
from kombu import Connection, Queue

from kombu_pgmq import errors
from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.limits import LimitStore
from kombu_pgmq._priorities import band_queue_name
from tests.conftest import LeastPrivilegeDb

from .helpers import connect, publish, sql, table
from .limit_helpers import Holder, declare, in_flight, limits_info, set_limits, sql_read

CAPPED = Queue("capped", routing_key="capped")


def test_concurrency_holds_across_connections_and_an_ack_wakes_a_waiting_consumer(db_dsn):
    """3 connections with prefetch 50, concurrency 3: never more than 3 unacked between
    them; an ack's freed slot reaches a consumer waiting on the queue in well under its
    polling interval (5 s): the ack wakes it."""
    options = {"polling_interval": 5}
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(connect(db_dsn, **options)) for _ in range(3)]
        publish(conns[0], "capped", list(range(20)))
        assert set_limits(db_dsn, "capped", {"concurrency": 3})
        holders = [stack.enter_context(Holder(c, [CAPPED], prefetch=50)) for c in conns]
        for holder in holders:
            holder.drain(0.3)
        assert sum(len(h.held) for h in holders) == 3
        assert in_flight(db_dsn, table("capped")) == 3
        busy = next(h for h in holders if h.held)
        idle = next(h for h in holders if not h.held)
        waiter = threading.Thread(target=idle.drain_until, args=(1, 4))
        waiter.start()
        time.sleep(0.5)  # the idle consumer read (nothing) and waits on the queue
        acked = time.monotonic()
        busy.held[0].ack()
        waiter.join()
        assert len(idle.got) == 1
        assert idle.got[0][0] - acked < 1.0
        # the rest, acked as they come: at no point more than 3 held
        deadline = time.monotonic() + 30
        while sum(len(h.got) for h in holders) < 20 and time.monotonic() < deadline:
            for holder in holders:
                holder.drain(0.1)
                assert sum(len(h.held) for h in holders) <= 3
                assert in_flight(db_dsn, table("capped")) <= 3
                for message in holder.held[:1]:
                    message.ack()
        for holder in holders:
            for message in holder.held:
                message.ack()
            holder.drain(0.1)
    assert sorted(int(m.body) for h in holders for m in h.messages()) == list(range(20))


def test_slots_come_back_when_an_abandoned_consumers_leases_expire(db_dsn):
    """A consumer holds the 3 slots and goes silent (no acks, no lease renewal): another
    consumer gets the messages again once the visibility timeout (2 s) passes."""
    with (
        connect(db_dsn, visibility_timeout=2, lease_renewal_interval=0) as gone,
        connect(db_dsn, polling_interval=0.2) as other,
    ):
        publish(gone, "capped", list(range(6)))
        set_limits(db_dsn, "capped", {"concurrency": 3})
        with Holder(gone, [CAPPED]) as silent, Holder(other, [CAPPED]) as next_one:
            silent.drain_until(3, timeout=3)
            taken = time.monotonic()
            assert len(silent.got) == 3
            next_one.drain(0.5)
            assert next_one.got == []  # the slots are held
            next_one.drain_until(3, timeout=5)
            assert len(next_one.got) == 3
            back = next_one.got[-1][0] - taken
            assert 1.5 < back < 2 + 1.5, back
            # the oldest visible first (the read's vt order): the three never
            # delivered, then the three whose lease ran out, delivered a second time
            assert sorted(int(m.body) for m in next_one.messages()) == [3, 4, 5]
            for message in next_one.held:
                message.ack()
            next_one.drain_until(6, timeout=5)
            again = list(next_one.messages())[3:]
            assert sorted(int(m.body) for m in again) == [0, 1, 2]
            assert {m.delivery_info["pgmq_read_ct"] for m in again} == {2}
            for message in next_one.held:
                message.ack()
            next_one.drain(0.2)


def test_slots_come_back_at_once_when_a_consumer_closes_without_acking(db_dsn):
    """A connection closed with messages unacked gives them back (visibility timeout 30 s
    not waited for): a consumer waiting on the queue gets them."""
    with connect(db_dsn, polling_interval=5) as other:
        publish(other, "capped", list(range(6)))
        set_limits(db_dsn, "capped", {"concurrency": 3})
        with Holder(other, [CAPPED]) as waiting:
            closing = connect(db_dsn, visibility_timeout=30)
            with Holder(closing, [CAPPED]) as leaving:
                leaving.drain_until(3, timeout=3)
                assert len(leaving.got) == 3
                waiting.drain(0.3)
                assert waiting.got == []
            closed = time.monotonic()
            closing.release()
            waiting.drain_until(3, timeout=4)
            assert len(waiting.got) == 3 and waiting.got[-1][0] - closed < 2.0
            for message in waiting.held:
                message.ack()
            waiting.drain(0.2)


@pytest.mark.parametrize("settle", ["requeue", "reject"])
def test_a_requeue_or_a_dead_letter_frees_the_slot_for_a_waiting_consumer(db_dsn, settle):
    """Not only acks free a slot: a message requeued (visible again) or dead-lettered
    (rejected) does too, and the consumer waiting on the queue (polling interval 5 s)
    gets the next message at once."""
    with (
        connect(db_dsn, polling_interval=5, max_deliveries=5) as one,
        connect(db_dsn, polling_interval=5) as two,
    ):
        publish(one, "capped", ["first", "second"])
        set_limits(db_dsn, "capped", {"concurrency": 1})
        with Holder(one, [CAPPED]) as holder, Holder(two, [CAPPED]) as waiting:
            holder.drain_until(1, timeout=3)
            assert [m.payload for m in holder.messages()] == ["first"]
            waiter = threading.Thread(target=waiting.drain_until, args=(1, 4))
            waiter.start()
            time.sleep(0.5)  # it read nothing and waits on the queue
            settled = time.monotonic()
            getattr(holder.held[0], settle)()
            waiter.join()
            assert len(waiting.got) == 1 and waiting.got[0][0] - settled < 1.0
            for message in waiting.held:
                message.ack()
            waiting.drain(0.1)


def test_rate_is_a_token_bucket_over_sql_reads(db_dsn):
    """rate 20/s, burst 5: the burst at once, then a marker row saying when the next token
    comes (1/20 s), then about 20 a second, never more than the bucket allows."""
    with connect(db_dsn) as conn:
        publish(conn, "rated", list(range(120)))
    # the bucket refills from when the limit is set (tokens that come before the first
    # read count too), at most from here
    before = time.monotonic()
    set_limits(db_dsn, "rated", {"rate": "20/s", "burst": 5})
    first = sql_read(db_dsn, ["rated"], 50)
    started = time.monotonic()
    assert len(first.messages) == 5
    second = sql_read(db_dsn, ["rated"], 50)
    state, retry = second.markers["rated"]
    assert len(second.messages) <= 1
    if not second.messages:
        assert state == 2 and retry is not None and 0 < retry <= 0.05 + 1e-9
    delivered = [(time.monotonic(), len(second.messages))]
    while time.monotonic() - started < 2:
        time.sleep(0.02)
        delivered.append((time.monotonic(), len(sql_read(db_dsn, ["rated"], 50).messages)))
    elapsed, longest = delivered[-1][0] - started, delivered[-1][0] - before
    total = sum(n for _, n in delivered)
    assert 20 * elapsed - 3 <= total <= 20 * longest + 1, (total, elapsed, longest)
    for at, _ in delivered:  # no 1 s window over rate + burst
        window = sum(n for t, n in delivered if at <= t < at + 1)
        assert window <= 20 + 5
    time.sleep(0.5)  # idle: 10 tokens' worth, the bucket holds 5
    assert len(sql_read(db_dsn, ["rated"], 50).messages) == 5
    info = limits_info(db_dsn, "rated")
    assert info is not None and info.throttled_rate > 0
    assert info.rate_per_second == 20 and info.burst == 5 and info.tokens is not None


def test_rate_holds_for_a_kombu_consumer_that_polls_rarely(db_dsn):
    """rate 10/s (burst 1, the default): a consumer with polling_interval 5 gets about 10
    messages a second: it reads again when the marker says the next token comes."""
    with connect(db_dsn, polling_interval=5) as conn:
        publish(conn, "paced", list(range(100)))
        set_limits(db_dsn, "paced", {"rate": "10/s"})
        assert limits_info(db_dsn, "paced").burst == 1  # type: ignore[union-attr]
        with Holder(conn, [Queue("paced", routing_key="paced")]) as holder:
            started = time.monotonic()
            while time.monotonic() - started < 2:
                holder.drain(0.1)
                for message in holder.held:
                    message.ack()
            times = [t - started for t, _ in holder.got]
    assert 1 + 10 * 2 - 4 <= len(times) <= 1 + 10 * 2.1 + 1, times
    for at in times:
        assert sum(1 for t in times if at <= t < at + 1) <= 10 + 1


def test_a_refused_delivery_is_not_a_delivery(db_dsn):
    """Reads a limit holds back leave read_ct alone: with max_deliveries=1 (a second
    delivery is dead-lettered) nothing is dead-lettered by throttling."""
    with connect(db_dsn, max_deliveries=1, polling_interval=0.1) as conn:
        publish(conn, "held", list(range(8)))
        set_limits(db_dsn, "held", {"concurrency": 2, "rate": "5/s"})
        for _ in range(20):  # throttled reads, by rate then by concurrency
            sql_read(db_dsn, ["held"], 10, vt=30)
            time.sleep(0.03)
        assert sql(db_dsn, f"SELECT count(*) FROM {table('held')} WHERE read_ct > 1") == [(0,)]
        assert sql(db_dsn, f"SELECT count(*) FROM {table('held')} WHERE read_ct = 0") == [(6,)]
        # the two delivered: as if never read
        sql(db_dsn, f"UPDATE {table('held')} SET read_ct = 0, vt = clock_timestamp()")
        with Holder(conn, [Queue("held", routing_key="held")], prefetch=10) as holder:
            deadline = time.monotonic() + 10
            while len(holder.got) < 8 and time.monotonic() < deadline:
                holder.drain(0.1)
                for message in holder.held:
                    message.ack()
            holder.drain(0.1)
        assert len(holder.got) == 8
    assert {m.delivery_info["pgmq_read_ct"] for m in holder.messages()} == {1}
    dlq = sql(db_dsn, "SELECT to_regclass('pgmq.q_kombu_pgmq_dlq') IS NOT NULL")[0][0]
    assert not dlq or sql(db_dsn, "SELECT count(*) FROM pgmq.q_kombu_pgmq_dlq") == [(0,)]
    assert sql(db_dsn, f"SELECT count(*), max(read_ct) FROM {table('held', 'a')}") == [(8, 1)]
    info = limits_info(db_dsn, "held")
    assert info is not None and info.throttled_concurrency > 0 and info.throttled_rate > 0


def test_concurrency_counts_every_priority_band_and_priorities_still_order(db_dsn):
    prio = Queue("prio", routing_key="prio", max_priority=9)
    with connect(db_dsn, polling_interval=0.1) as conn:
        with conn.channel() as channel:
            from kombu import Producer

            producer = Producer(channel)
            for n in range(4):
                producer.publish(f"low{n}", routing_key="prio", declare=[prio], priority=0)
            for n in range(2):
                producer.publish(f"mid{n}", routing_key="prio", declare=[prio], priority=5)
            for n in range(2):
                producer.publish(f"high{n}", routing_key="prio", declare=[prio], priority=9)
        set_limits(db_dsn, "prio", {"concurrency": 3})
        with Holder(conn, [prio], prefetch=20) as holder:
            holder.drain_until(3, timeout=3)
            holder.drain(0.3)
            assert [m.payload for m in holder.messages()] == ["high0", "high1", "mid0"]
            bands = sql(db_dsn, "SELECT pgmq_queue FROM kombu_pgmq.limited WHERE queue = 'prio'")
            assert len(bands) > 1
            assert sum(in_flight(db_dsn, f"pgmq.q_{b}") for (b,) in bands) == 3
            holder.held[0].ack()
            holder.drain_until(4, timeout=3)
            holder.drain(0.3)
            assert [m.payload for m in holder.messages()][3:] == ["mid1"]
            for message in holder.held:
                message.ack()
            holder.drain_until(7, timeout=3)
            holder.drain(0.3)
            assert [m.payload for m in holder.messages()][4:] == ["low0", "low1", "low2"]
            for message in holder.held:
                message.ack()
            holder.drain(0.2)
    assert band_queue_name("prio", 0) == "prio"


def test_a_limited_queue_does_not_hold_back_another_queue_of_the_same_consumer(db_dsn):
    with connect(db_dsn, polling_interval=5) as conn:
        publish(conn, "capped", list(range(10)))
        publish(conn, "free", list(range(10)))
        set_limits(db_dsn, "capped", {"concurrency": 1})
        queues = [CAPPED, Queue("free", routing_key="free")]
        with Holder(conn, queues, prefetch=50) as holder:
            holder.drain_until(11, timeout=3)
            holder.drain(0.3)
            by_queue = [m.delivery_info["routing_key"] for m in holder.messages()]
            assert (by_queue.count("capped"), by_queue.count("free")) == (1, 10)
            for message in holder.held:
                message.ack()
            holder.drain(0.2)
    # in one read of both, the limited queue first: the other queue fills the read
    with connect(db_dsn) as conn:
        publish(conn, "free", list(range(5)))
    got = sql_read(db_dsn, ["capped", "free"], 10)
    assert [q for q, *_ in got.messages] == ["capped"] + ["free"] * 5
    assert got.markers == {"capped": (1, None)}  # held back until a message settles


def test_limits_changed_while_a_consumer_runs_take_effect_at_its_next_read(db_dsn):
    queue = Queue("live", routing_key="live")
    with connect(db_dsn, polling_interval=5) as conn:
        publish(conn, "live", list(range(12)))
        set_limits(db_dsn, "live", {"concurrency": 1})
        with Holder(conn, [queue], prefetch=50) as holder:
            holder.drain_until(1, timeout=3)
            holder.drain(0.3)
            assert len(holder.got) == 1
            assert "live" in conn.transport.broker().limited
            loosened = time.monotonic()
            set_limits(db_dsn, "live", {"concurrency": 4})  # wakes the waiting consumer
            holder.drain_until(4, timeout=3)
            assert len(holder.got) == 4 and holder.got[-1][0] - loosened < 1.0
            set_limits(db_dsn, "live", {"concurrency": 2})  # tighter than held
            holder.held[0].ack()
            holder.drain(0.5)
            assert len(holder.got) == 4  # 3 held, over the new limit: none more
            for message in holder.held[:2]:
                message.ack()
            holder.drain(0.5)
            assert len(holder.got) == 5 and len(holder.held) == 2  # 1 held + 1 new
            cleared = time.monotonic()
            assert not set_limits(db_dsn, "live", {"concurrency": None})
            holder.drain_until(12, timeout=3)
            assert len(holder.got) == 12 and holder.got[-1][0] - cleared < 1.0
            assert limits_info(db_dsn, "live") is None
            assert "live" not in conn.transport.broker().limited  # fast path again
            for message in holder.held:
                message.ack()
            holder.drain(0.2)


def test_queue_limits_option_replaces_the_stored_limits_at_declaration(db_dsn):
    with connect(db_dsn) as conn:
        declare(conn, "configured")
    set_limits(db_dsn, "configured", {"concurrency": 7, "rate": "5/s", "key_concurrency": 2})
    limits = {"configured": {"concurrency": 2, "limit_key": "task"}}
    with connect(db_dsn, queue_limits=limits) as conn:
        declare(conn, "configured")
    info = limits_info(db_dsn, "configured")
    assert info is not None
    assert (info.concurrency, info.rate, info.key_concurrency, info.limit_key) == (
        2,
        None,
        None,
        "task",
    )
    # a queue declared first by such a worker is limited from its first message
    with connect(db_dsn, queue_limits={"fresh": {"rate": "1/h"}}) as conn:
        publish(conn, "fresh", ["a", "b"])
    assert len(sql_read(db_dsn, ["fresh"], 10).messages) == 1


def test_set_queue_limits_errors_say_what_is_wrong(db_dsn):
    with connect(db_dsn) as conn:
        declare(conn, "known")
    cases = [
        ("nowhere", {"concurrency": 1}, "queue 'nowhere' does not exist: declare it first"),
        ("known", {"concurency": 1}, "unknown limit(s) concurency for queue 'known'"),
        ("known", {"rate": "10/d"}, "rate '10/d' is not a rate: write it as 100/s"),
        ("known", {"rate": "0/s"}, "must be above 0 (clear the limit instead)"),
        ("known", {"burst": 5}, "a burst of queue 'known' needs its rate"),
        ("known", {"key_burst": 5}, "key_burst with key_rate"),
        ("known", {"rate": "1/s", "burst": 0.5}, "must be at least 1 token"),
        ("known", {"concurrency": -1}, "must be a positive number (0 removes it)"),
    ]
    for queue, limits, expected in cases:
        with pytest.raises(psycopg.Error) as info:
            set_limits(db_dsn, queue, limits)
        assert expected in str(info.value), (limits, str(info.value))
    with pytest.raises(psycopg.Error, match="must be a JSON object"):
        sql(db_dsn, "SELECT kombu_pgmq.set_queue_limits('known', '[1]'::jsonb)")
    assert limits_info(db_dsn, "known") is None  # nothing was set
    with (
        contextlib.closing(Connector(db_dsn)) as db,
        pytest.raises(errors.StatementError, match="does not exist"),
    ):
        LimitStore(db).set("nowhere", {"concurrency": 1})
    with contextlib.closing(Connector(db_dsn)) as db:
        assert LimitStore(db).set("known", {"rate": "2/s"})
        assert LimitStore(db).set("known", {"burst": 4})  # a change: the stored rate stays
        assert not LimitStore(db).set("known", {"rate": None, "burst": None})


def test_limits_info_counts_use_and_throttled_reads(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "watched", list(range(10)))
    set_limits(db_dsn, "watched", {"concurrency": 3, "rate": "10/s", "burst": 100})
    before = limits_info(db_dsn, "watched")
    assert before is not None and before.in_flight == 0
    assert (before.throttled_concurrency, before.throttled_rate, before.throttled_keys) == (
        0,
        0,
        0,
    )
    assert before.tokens == pytest.approx(100)
    assert len(sql_read(db_dsn, ["watched"], 10).messages) == 3
    after = limits_info(db_dsn, "watched")
    assert after is not None and after.in_flight == 3 and after.throttled_concurrency == 1
    assert after.tokens is not None and 97 <= after.tokens <= 98
    sql_read(db_dsn, ["watched"], 10)
    assert limits_info(db_dsn, "watched").throttled_concurrency == 2  # type: ignore[union-attr]
    assert after.updated_by == "postgres"


# -- least privilege --------------------------------------------------------------------


def _as(url: str, **options: object) -> Connection:
    return Connection(url, transport_options={"install_schema": False, **options})


def test_a_worker_role_consumes_a_limited_queue_and_sets_limits(least_privilege_db):
    db: LeastPrivilegeDb = least_privilege_db
    limited = {"lp": {"concurrency": 2}}
    with _as(db.worker_url, queue_limits=limited, polling_interval=5) as conn:
        declare(conn, "lp")  # the worker sets the limits it is configured with
    with _as(db.producer_url, queue_limits=limited) as conn:
        publish(conn, "lp", list(range(5)))  # a producer publishes (its limits: logged)
    with (
        _as(db.worker_url, queue_limits=limited, polling_interval=5) as conn,
        Holder(conn, [Queue("lp", routing_key="lp")]) as holder,
    ):
        holder.drain_until(2, timeout=3)
        holder.drain(0.3)
        assert len(holder.got) == 2
        acked = time.monotonic()
        holder.held[0].ack()  # wakes the consumer: a slot is free
        holder.drain_until(3, timeout=3)
        assert len(holder.got) == 3 and holder.got[-1][0] - acked < 1.0
        for message in holder.held:
            message.ack()
        holder.drain(0.2)
    with psycopg.connect(db.worker_url, autocommit=True) as worker:
        worker.execute("SELECT kombu_pgmq.set_queue_limits('lp', '{\"rate\": \"5/s\"}')")
        row = worker.execute(
            "SELECT concurrency, rate, in_flight FROM kombu_pgmq.limits_info('lp')"
        ).fetchone()
        assert row == (2, "5/s", 0)
    with (
        psycopg.connect(db.producer_url, autocommit=True) as producer,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        producer.execute("SELECT kombu_pgmq.set_queue_limits('lp', '{}')")
    with psycopg.connect(db.owner_url, autocommit=True) as owner:
        assert owner.execute("SELECT count(*) FROM pgmq.a_lp").fetchone() == (3,)
