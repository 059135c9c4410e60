"""LISTEN/NOTIFY wake-ups, the waiting protocol, batched acks and multi-queue reads."""

from __future__ import annotations

import contextlib
import select
import threading
import time
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from kombu_pgmq._db.broker import Broker
from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.consumers import Consumers
from kombu_pgmq._naming import pgmq_queue_name
from kombu_pgmq.errors import ConfigurationError

from .helpers import FakeHub, connect, publish, sql, table

# Long enough that a test passing within it cannot be explained by the fallback poll.
NO_FALLBACK = 60.0


def waiting_rows(db_dsn: str, queue: str) -> int:
    return sql(
        db_dsn,
        "SELECT count(*) FROM kombu_pgmq.waiting WHERE pgmq_queue = %s",
        (pgmq_queue_name(queue),),
    )[0][0]


def run_until_asleep(db_dsn: str, hub: FakeHub, queues: list[str], deadline: float) -> None:
    """Run ``hub`` until the consumer sleeps on each of ``queues`` (one waiting row
    each) and nothing is due soon; fail at ``deadline`` (monotonic seconds)."""
    while any(waiting_rows(db_dsn, q) != 1 for q in queues) or hub.soon:
        assert time.monotonic() < deadline, "the consumer never went to sleep"
        hub.run_once()


def drain_until(conn: Connection, got: list[Any], n: int, timeout: float) -> float:
    """drain_events until ``got`` holds ``n`` messages; return the seconds it took."""
    start = time.monotonic()
    while len(got) < n and time.monotonic() - start < timeout:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=timeout - (time.monotonic() - start))
    return time.monotonic() - start


@pytest.mark.parametrize("via_exchange", [False, True], ids=["default_exchange", "direct"])
def test_publish_from_another_process_wakes_a_sleeping_consumer(db_dsn, via_exchange):
    exchange = Exchange("wake_x", type="direct")
    queue = Queue("wakeq", exchange if via_exchange else None, routing_key="wakeq")
    got: list[Any] = []
    with connect(db_dsn, polling_interval=NO_FALLBACK) as conn, conn.channel() as channel:
        consumer = Consumer(channel, [queue], on_message=lambda m: (got.append(m), m.ack()))
        with consumer:
            # The queue is empty: the consumer records that it waits, then sleeps.
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.5)
            assert waiting_rows(db_dsn, "wakeq") == 1

            def publish_later() -> None:
                time.sleep(0.3)
                with connect(db_dsn) as other, other.channel() as ch:
                    Producer(ch).publish(
                        {"n": 1},
                        exchange=exchange if via_exchange else "",
                        routing_key="wakeq",
                    )

            publisher = threading.Thread(target=publish_later)
            publisher.start()
            took = drain_until(conn, got, 1, timeout=20)
            publisher.join()
    assert [m.decode() for m in got] == [{"n": 1}]
    assert took < 10  # the fallback poll would have taken 60 s


def test_wait_for_waits_for_publishers_that_missed_the_waiting_row(db_dsn):
    """The wake-up protocol of ``kombu_pgmq.wait_for`` (the queue's advisory lock): no
    wake-up is lost to a race (here with the longest wait the server allows,
    max_wait_ms=1 s: the publisher commits after 0.5 s)."""
    with connect(db_dsn) as conn:
        conn.channel().queue_declare("race")
    consumer = Connector(db_dsn)
    notified: list[str] = []
    listener = Connector(db_dsn, on_notify=lambda channel, _payload: notified.append(channel))
    try:
        Consumers(listener).listen(["kombu_pgmq.race"])
        with psycopg.connect(db_dsn) as publisher:  # a transaction left open on purpose
            publisher.execute("SELECT kombu_pgmq.publish('race', '{\"n\": 1}', '{}')")
            # It checked kombu_pgmq.waiting before the consumer's row existed: it will
            # not notify. wait_for must therefore wait for its commit.
            result: list[list[str]] = []
            waiter = threading.Thread(
                target=lambda: result.append(consumer.column(sql_wait_for("me", "race", 1_000)))
            )
            waiter.start()
            time.sleep(0.5)
            assert not result, "wait_for returned while a publisher was in flight"
            publisher.commit()
        waiter.join(10)
        assert result == [[]]  # the publisher committed within the wait: settled
        # ... so the consumer's read after wait_for sees the message.
        assert [row.message for row in Broker(consumer).read("race", 30, 10)] == ['{"n": 1}']
        listener.poll_notifies()
        assert notified == []  # it did not notify (the row came later)
        # A publish after wait_for notifies.
        publisher_db = Connector(db_dsn)
        Broker(publisher_db).send("race", '{"n": 2}', "{}")
        publisher_db.close()
        deadline = time.monotonic() + 10
        while not notified and time.monotonic() < deadline:
            time.sleep(0.05)
            listener.poll_notifies()
        assert notified == ["kombu_pgmq.race"]
    finally:
        consumer.close()
        listener.close()


def sql_wait_for(owner: str, queue: str, max_wait_ms: int) -> Any:
    from psycopg import sql as pgsql

    return pgsql.SQL("SELECT queue FROM kombu_pgmq.wait_for({}, ARRAY[{}], {}) AS queue").format(
        pgsql.Literal(owner), pgsql.Literal(queue), pgsql.Literal(max_wait_ms)
    )


def test_wait_for_does_not_wait_for_a_long_open_enqueue_transaction(db_dsn):
    """An application that enqueued inside its own open transaction
    does not stop a consumer going to sleep; the queue is returned as unsettled (its
    message is found by the fallback poll once committed)."""
    with connect(db_dsn) as conn:
        conn.channel().queue_declare("longtx")
    consumer = Connector(db_dsn)
    try:
        with psycopg.connect(db_dsn) as app:
            app.execute("SELECT kombu_pgmq.publish('longtx', '{\"n\": 1}', '{}')")
            start = time.monotonic()
            assert Consumers(consumer).wait_for("me", ["longtx"]).unsettled == ["longtx"]
            assert time.monotonic() - start < 2.0
            assert Broker(consumer).read("longtx", 30, 10) == []  # not committed yet
            app.commit()
        assert [r.message for r in Broker(consumer).read("longtx", 30, 10)] == ['{"n": 1}']
    finally:
        consumer.close()


def test_publishers_stop_notifying_while_a_consumer_has_a_backlog(db_dsn):
    got: list[Any] = []
    with connect(db_dsn, polling_interval=NO_FALLBACK) as conn, conn.channel() as channel:
        consumer = Consumer(
            channel, [Queue("backlog")], on_message=lambda m: (got.append(m), m.ack())
        )
        consumer.qos(prefetch_count=5)
        with consumer:
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.5)
            assert waiting_rows(db_dsn, "backlog") == 1
            with connect(db_dsn) as other:
                publish(other, "backlog", list(range(60)))
            drain_until(conn, got, 25, timeout=20)
            # Several full reads in a row: a backlog, so no more notifications.
            assert waiting_rows(db_dsn, "backlog") == 0
            drain_until(conn, got, 60, timeout=20)
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.5)
            # Drained: waiting again, so the next publish wakes it.
            assert waiting_rows(db_dsn, "backlog") == 1
    assert sorted(m.decode() for m in got) == list(range(60))
    # The connection closed: its waiting row is gone.
    assert waiting_rows(db_dsn, "backlog") == 0


def test_acks_made_in_callbacks_are_batched_and_archived_before_drain_events_returns(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "batched", list(range(20)))
        client = conn.default_channel.broker
        single_archives: list[int] = []
        acked_in_reads: list[int] = []
        ack, read_many = client.ack, client.read_many

        def spy_ack(receipts, **kwargs):
            single_archives.append(len(receipts))
            return ack(receipts, **kwargs)

        def spy_read_many(queues, vt_seconds, qty, acks=(), **kwargs):
            acked_in_reads.append(len(acks))
            return read_many(queues, vt_seconds, qty, acks, **kwargs)

        client.ack, client.read_many = spy_ack, spy_read_many
        got: list[Any] = []
        with Consumer(
            conn.default_channel,
            [Queue("batched")],
            on_message=lambda m: (got.append(m), m.ack()),
            prefetch_count=10,
        ):
            conn.drain_events(timeout=5)
            # 10 delivered and acked in the callback: archived in one statement already.
            assert len(got) == 10
            assert single_archives == [10]
            assert sql(db_dsn, f"SELECT count(*) FROM {table('batched', 'a')}") == [(10,)]
            conn.drain_events(timeout=5)
    assert len(got) == 20
    assert single_archives == [10, 10]
    assert sum(acked_in_reads) == 0  # outside the event loop acks never wait for a read
    assert sql(db_dsn, f"SELECT count(*) FROM {table('batched')}") == [(0,)]
    assert sql(db_dsn, f"SELECT count(*) FROM {table('batched', 'a')}") == [(20,)]


def test_an_ack_outside_drain_events_is_archived_at_once(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "single", ["x"])
        message = conn.SimpleQueue("single").get(timeout=5)
        message.ack()
        assert sql(db_dsn, f"SELECT count(*) FROM {table('single', 'a')}") == [(1,)]
        assert sql(db_dsn, f"SELECT count(*) FROM {table('single')}") == [(0,)]


def test_acks_in_the_event_loop_are_sent_at_once_not_held_for_the_next_read(db_dsn):
    """Registered with an event loop, acks go to the server on their own right after the
    read that delivered them, without waiting for the result, not with the next read."""
    with connect(db_dsn) as conn:
        publish(conn, "hubacks", list(range(6)))
        transport = conn.transport
        client = conn.default_channel.broker
        acked_in_reads: list[int] = []
        sent_alone: list[int] = []
        read_many, ack_nowait = client.read_many, client.ack_nowait

        def spy_read_many(queues, vt_seconds, qty, acks=(), **kwargs):
            acked_in_reads.append(len(acks))
            return read_many(queues, vt_seconds, qty, acks, **kwargs)

        def spy_ack_nowait(receipts, **kwargs):
            sent_alone.append(len(receipts))
            return ack_nowait(receipts, **kwargs)

        client.read_many, client.ack_nowait = spy_read_many, spy_ack_nowait
        loop = FakeHub()
        conn.transport.register_with_event_loop(conn.connection, loop)
        got: list[Any] = []
        with Consumer(
            conn.default_channel,
            [Queue("hubacks")],
            on_message=lambda m: (got.append(m), m.ack()),
            prefetch_count=3,
        ):
            for _ in range(10):
                loop.run_once()
            assert len(got) == 6
            assert acked_in_reads[:2] == [0, 0]  # the second read carried no ack...
            assert sent_alone[0] == 3  # ...the first 3 had gone on their own
            assert sum(acked_in_reads) + sum(sent_alone) == 6
            assert sql(db_dsn, f"SELECT count(*) FROM {table('hubacks', 'a')}") == [(6,)]
        transport.poller.unregister_from_event_loop()
    assert loop.readers == {}


def spy_reads(client: Any) -> list[list[str]]:
    """The PGMQ queues of each ``read_many`` round trip of ``client`` (a channel's
    broker) from now on, in the order asked."""
    calls: list[list[str]] = []
    read_many = client.read_many

    def spy_read_many(queues, vt_seconds, qty, acks=(), **kwargs):
        calls.append(list(queues))
        return read_many(queues, vt_seconds, qty, acks, **kwargs)

    client.read_many = spy_read_many
    return calls


def test_one_round_trip_reads_several_queues_in_turn(db_dsn):
    names = ["multi_a", "multi_b", "multi_c"]
    with connect(db_dsn) as conn:
        for name in names:
            publish(conn, name, [f"{name}-{i}" for i in range(20)])
        calls = spy_reads(conn.default_channel.broker)
        got: list[Any] = []
        with Consumer(
            conn.default_channel,
            [Queue(n) for n in names],
            on_message=lambda m: (got.append(m), m.ack()),
            prefetch_count=6,
        ):
            for _ in range(5):
                conn.drain_events(timeout=5)
    assert len(got) == 30
    assert all(sorted(c) == names for c in calls[:5])  # every queue in each round trip
    assert len({c[0] for c in calls[:5]}) == 3  # ... starting with each in turn
    per_queue = {n: sum(1 for m in got if m.delivery_info["kombu_queue"] == n) for n in names}
    assert min(per_queue.values()) >= 6, per_queue


def test_fallback_poll_finds_messages_that_become_visible_without_a_publish(db_dsn):
    got: list[Any] = []
    with connect(db_dsn, polling_interval=0.5) as conn, conn.channel() as channel:
        consumer = Consumer(
            channel, [Queue("later")], on_message=lambda m: (got.append(m), m.ack())
        )
        with consumer:
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.3)
            # A delayed send (PGMQ's native delay): visible in 1 s, no notification then.
            sender = Connector(db_dsn)
            Broker(sender).send("later", '{"late": true}', "{}", delay_seconds=1)
            sender.close()
            took = drain_until(conn, got, 1, timeout=10)
    assert [m.decode() for m in got] == [{"late": True}]
    assert took < 5


def test_in_the_event_loop_the_fallback_poll_probes_without_waiting_then_reads_what_it_found(
    db_dsn,
):
    """In Celery's event loop (a hub run by hand) the fallback poll reads nothing itself:
    it sends a probe on the LISTEN connection without waiting and returns, so a
    hand-off arriving meanwhile is not held up behind reads (a slow p99). The
    probe's answer, when the loop sees it, makes only the queue holding a visible message
    (one no publish notified: a lapsed visibility timeout looks the same) be read. Fails
    on a fallback that reads every consumed queue in its own round."""
    names = ["probe_a", "probe_b"]
    got: list[Any] = []
    with connect(db_dsn, polling_interval=NO_FALLBACK) as conn, conn.channel() as channel:
        reads = spy_reads(channel.broker)
        hub = FakeHub()
        conn.transport.register_with_event_loop(conn.connection, hub)
        poller = conn.transport.poller
        consumer = Consumer(
            channel, [Queue(n) for n in names], on_message=lambda m: (got.append(m), m.ack())
        )
        with consumer:
            deadline = time.monotonic() + 10
            run_until_asleep(db_dsn, hub, names, deadline)
            sql(db_dsn, "SELECT pgmq.send('probe_b', '{\"found\": true}'::jsonb)")  # no NOTIFY
            reads.clear()
            poller._on_hub_fallback()  # what the loop's repeating timer calls
            assert reads == [], "the fallback round read the queues itself"
            while not got:
                assert time.monotonic() < deadline, "the probe's queue was never read"
                hub.run_once()
            assert [m.decode() for m in got] == [{"found": True}]
            assert reads and all(r == [pgmq_queue_name("probe_b")] for r in reads), reads
        conn.transport.poller.unregister_from_event_loop()


def test_the_fallback_probe_gives_up_on_a_table_locked_exclusively(db_dsn):
    """The probe runs on the LISTEN connection, which must not sit behind a lock (its
    hand-off notifications would wait): with a consumed queue's table held by an ACCESS
    EXCLUSIVE lock (DROP, TRUNCATE, ALTER in an open transaction), its answer is the
    lock timeout well before the lock goes, and every probed queue is marked to be read
    (as the fallback did before the probe). Fails without the connection's
    lock_timeout: the answer comes only when the lock is released."""
    hold_seconds = 3.0  # the LISTEN connection's lock_timeout: 0.1 s
    with connect(db_dsn, polling_interval=NO_FALLBACK) as conn, conn.channel() as channel:
        hub = FakeHub()
        conn.transport.register_with_event_loop(conn.connection, hub)
        poller = conn.transport.poller
        with Consumer(channel, [Queue("probe_locked")], on_message=lambda m: m.ack()):
            deadline = time.monotonic() + 10
            run_until_asleep(db_dsn, hub, ["probe_locked"], deadline)
            locked = threading.Event()

            def hold_lock() -> None:
                with psycopg.connect(db_dsn) as locker:
                    locker.execute(f"LOCK TABLE {table('probe_locked')} IN ACCESS EXCLUSIVE MODE")
                    locked.set()
                    time.sleep(hold_seconds)

            holder = threading.Thread(target=hold_lock)
            holder.start()
            try:
                assert locked.wait(10)
                listener = poller.listener()
                started = time.monotonic()
                assert listener.probe(poller.consumed())
                readable = select.select([listener.fileno()], [], [], hold_seconds)[0]
                answered = time.monotonic() - started
                ready, _ = listener.collect()
            finally:
                holder.join()
            assert readable, "no answer while the lock was held"
            assert answered < hold_seconds / 2, answered
            assert ready == {pgmq_queue_name("probe_locked")}  # read, as without a probe
        poller.unregister_from_event_loop()


def test_a_listen_connection_killed_with_its_probe_in_flight_loses_nothing(db_dsn):
    """The fallback probe is in flight on the LISTEN connection (waiting for a lock on
    the queue's table) when its server process is terminated: the loop connects again
    and reads every consumed queue, so the visible message nobody notified is delivered
    once, and the new connection hears the next publish. Fails if a probe lost with its
    connection left the queues unread (the next fallback is a minute away)."""
    got: list[Any] = []
    with connect(db_dsn, polling_interval=NO_FALLBACK) as conn, conn.channel() as channel:
        hub = FakeHub()
        conn.transport.register_with_event_loop(conn.connection, hub)
        poller = conn.transport.poller
        consumer = Consumer(
            channel, [Queue("probe_killed")], on_message=lambda m: (got.append(m), m.ack())
        )
        with consumer:
            deadline = time.monotonic() + 20
            run_until_asleep(db_dsn, hub, ["probe_killed"], deadline)
            sql(db_dsn, "SELECT pgmq.send('probe_killed', '{\"n\": 1}'::jsonb)")  # no NOTIFY
            listener = poller.listener()
            pid = listener._connector.backend_pid
            with psycopg.connect(db_dsn) as locker:  # the probe waits for this lock
                locker.execute(f"LOCK TABLE {table('probe_killed')} IN ACCESS EXCLUSIVE MODE")
                poller._on_hub_fallback()  # sends the probe, does not wait for it
                # well within the probe's lock_timeout (0.1 s): no answer was sent
                locker.execute("SELECT pg_terminate_backend(%s)", (pid,))
            while not got:
                assert time.monotonic() < deadline, "the visible message was never read"
                hub.run_once(timeout=0.2)
            with connect(db_dsn) as producer:
                publish(producer, "probe_killed", [{"n": 2}])
            while len(got) < 2:
                assert time.monotonic() < deadline, "the new LISTEN connection heard nothing"
                hub.run_once(timeout=0.2)
            for _ in range(5):  # nothing more arrives: each message once
                hub.run_once(timeout=0.1)
            assert poller.listener()._connector.backend_pid != pid  # connected again
        poller.unregister_from_event_loop()
    assert [m.decode() for m in got] == [{"n": 1}, {"n": 2}]


def test_durable_acks_must_be_a_bool(db_dsn):
    with pytest.raises(ConfigurationError, match=r"durable_acks='yes'.*True or False"):
        connect(db_dsn, durable_acks="yes").connect()


@pytest.mark.parametrize("durable", [None, True])
def test_acks_commit_asynchronously_unless_durable_acks(db_dsn, durable):
    options = {} if durable is None else {"durable_acks": durable}
    with connect(db_dsn, **options) as conn:
        publish(conn, "durable_acks", [1, 2, 3])
        client = conn.default_channel.broker
        seen: list[bool] = []
        ack = client.ack

        def spy_ack(receipts, *, durable=True):
            seen.append(durable)
            return ack(receipts, durable=durable)

        client.ack = spy_ack
        got: list[Any] = []
        with Consumer(
            conn.default_channel,
            [Queue("durable_acks")],
            on_message=lambda m: (got.append(m), m.ack()),
        ):
            drain_until(conn, got, 3, timeout=10)
    assert seen and set(seen) == {bool(durable)}
    assert sql(db_dsn, f"SELECT count(*) FROM {table('durable_acks', 'a')}") == [(3,)]


def test_a_consumer_vacuums_its_busy_queue_table(db_dsn):
    options = {"vacuum_threshold": 100, "consumer_heartbeat_interval": 0.5}
    got: list[Any] = []
    with connect(db_dsn, **options) as conn:
        publish(conn, "churned", list(range(300)))
        # only the consumer vacuums it (the suite's embedded server runs autovacuum, and a
        # table autovacuum just did is left alone, as it should be)
        sql(db_dsn, f"ALTER TABLE {table('churned')} SET (autovacuum_enabled = false)")
        with Consumer(
            conn.default_channel,
            [Queue("churned")],
            on_message=lambda m: (got.append(m), m.ack()),
            prefetch_count=50,
        ):
            drain_until(conn, got, 300, timeout=30)
            # 300 deliveries and acks leave ~600 dead row versions: the heartbeat thread
            # VACUUMs the table (statistics reach it within a few seconds).
            deadline = time.monotonic() + 30
            vacuums = 0
            while vacuums == 0 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.5)
                vacuums = sql(
                    db_dsn,
                    "SELECT vacuum_count FROM pg_stat_user_tables "
                    "WHERE schemaname = 'pgmq' AND relname = %s",
                    (f"q_{pgmq_queue_name('churned')}",),
                )[0][0]
    assert len(got) == 300
    assert vacuums >= 1


@pytest.mark.parametrize("value", [-1, "many", 1.5, True])
def test_vacuum_threshold_must_be_a_count(db_dsn, value):
    with pytest.raises(ConfigurationError, match=r"vacuum_threshold=.*dead tuples >= 0"):
        connect(db_dsn, vacuum_threshold=value).connect()


def test_reaper_forgets_waiting_rows_of_connections_without_consumers(db_dsn):
    with connect(db_dsn) as conn:
        conn.channel().queue_declare("orphan")
        sql(db_dsn, "SELECT kombu_pgmq.wait_for('gone-host:1:abc', ARRAY['orphan'])")
        assert waiting_rows(db_dsn, "orphan") == 1
        conn.transport.reap()
    assert waiting_rows(db_dsn, "orphan") == 0


def test_drain_events_without_a_consumer_and_without_timeout_is_an_error(db_dsn):
    with connect(db_dsn) as conn:
        conn.connect()
        with pytest.raises(ConfigurationError, match="start a Consumer first, or give a timeout"):
            conn.drain_events()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.1)


def test_a_table_vacuumed_a_moment_ago_is_not_due_again(db_dsn):
    """Every consumer of a table checks its dead tuples; the statistics lag, so a table
    another process just VACUUMed is left alone for a second (measured: 64 consumers of
    one table ran 2.6 VACUUMs a second, back to back)."""
    with connect(db_dsn) as conn:
        publish(conn, "vacuumed", list(range(50)))
    name = pgmq_queue_name("vacuumed")
    sql(db_dsn, f"DELETE FROM pgmq.q_{name}")  # 50 dead row versions
    connector = Connector(db_dsn)
    consumers = Consumers(connector)

    def dead(min_interval: float) -> dict[str, int]:
        deadline = time.monotonic() + 10  # the statistics reach the view within seconds
        found: dict[str, int] = {}
        while time.monotonic() < deadline:
            found = consumers.dead_tuples([name], min_interval)
            if found.get(name, 0) >= 50:
                break
            time.sleep(0.2)
        return found

    try:
        assert dead(1.0).get(name, 0) >= 50  # never vacuumed: due
        sql(db_dsn, f"VACUUM pgmq.q_{name}")
        assert name not in consumers.dead_tuples([name], 1.0)  # just vacuumed
        assert name in consumers.dead_tuples([name], 0.0)
        time.sleep(1.2)
        assert name in consumers.dead_tuples([name], 1.0)
    finally:
        connector.close()
