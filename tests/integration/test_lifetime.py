"""Queue lifetime across processes: auto_delete, x-expires, x-message-ttl, UNLOGGED."""

from __future__ import annotations

import contextlib
import time
from datetime import datetime, timedelta, timezone

import pytest
from kombu import Connection, Consumer, Producer, Queue

from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.consumers import Consumers

from .helpers import connect, drain, publish, sql, table


def exists(url: str, queue: str) -> bool:
    in_pgmq = sql(url, "SELECT to_regclass(%s)", [table(queue)]) != [(None,)]
    in_ours = sql(url, "SELECT count(*) FROM kombu_pgmq.queues WHERE queue = %s", [queue])
    assert in_pgmq == (in_ours == [(1,)]), "PGMQ table and kombu_pgmq.queues disagree"
    return in_pgmq


def test_message_ttl_expired_messages_are_not_delivered(db_dsn):
    with connect(db_dsn) as conn:
        queue = Queue("ttl.q", message_ttl=0.5)
        queue(conn.channel()).declare()
        Producer(conn.channel()).publish({"old": True}, routing_key="ttl.q")
        time.sleep(0.8)
        Producer(conn.channel()).publish({"old": False}, routing_key="ttl.q")
        got = drain(conn, "ttl.q", expect=2, timeout=2)
    assert [m.decode() for m in got] == [{"old": False}]
    assert sql(db_dsn, f"SELECT count(*) FROM {table('ttl.q')}") == [(0,)]
    # both archived: the expired one unseen, with its reason (never deleted unseen)
    assert sql(
        db_dsn,
        f"SELECT message->>'old', headers->>'x-archive-reason', headers ? 'x-expired-at' "
        f"FROM {table('ttl.q', 'a')} ORDER BY msg_id",
    ) == [("true", "expired", True), ("false", None, False)]


def test_ttl_declared_by_another_process_applies(db_dsn):
    with connect(db_dsn) as declarer:
        Queue("ttl.shared", message_ttl=0.3)(declarer.channel()).declare()
        publish(declarer, "ttl.shared", ["stale"])
    time.sleep(0.6)
    with connect(db_dsn) as consumer:
        assert drain(consumer, "ttl.shared", expect=1, timeout=1.5) == []


def test_per_message_expiration(db_dsn):
    with connect(db_dsn) as conn:
        producer = Producer(conn.channel())
        producer.publish("short", routing_key="exp.q", expiration=0.3, declare=[Queue("exp.q")])
        producer.publish("long", routing_key="exp.q", expiration=60)
        time.sleep(0.6)
        got = drain(conn, "exp.q", expect=2, timeout=2)
    assert [m.body for m in got] == [b"long"]
    assert sql(db_dsn, f"SELECT count(*) FROM {table('exp.q')}") == [(0,)]
    archived = sql(
        db_dsn,
        f"SELECT headers->>'x-archive-reason', headers->'x-kombu'->'properties'->>'expiration' "
        f"FROM {table('exp.q', 'a')} ORDER BY msg_id",
    )
    assert archived == [("expired", "300"), (None, "60000")]


def test_expired_message_of_a_no_ack_consumer_is_archived(db_dsn):
    with connect(db_dsn) as conn:
        producer = Producer(conn.channel())
        producer.publish(
            "short", routing_key="exp.noack", expiration=0.2, declare=[Queue("exp.noack")]
        )
        producer.publish("long", routing_key="exp.noack", expiration=60)
        time.sleep(0.4)
        got: list = []
        with Consumer(conn.channel(), [Queue("exp.noack")], on_message=got.append, no_ack=True):
            deadline = time.monotonic() + 3
            while not got and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.5)
    assert [m.body for m in got] == [b"long"]
    assert sql(db_dsn, f"SELECT count(*) FROM {table('exp.noack')}") == [(0,)]
    assert sql(
        db_dsn, f"SELECT message, headers->>'x-archive-reason' FROM {table('exp.noack', 'a')}"
    ) == [("c2hvcnQ=", "expired")]  # base64 of b"short"


def test_expired_celery_task_is_delivered_for_the_worker_to_revoke(db_dsn):
    """A Celery task message (``task`` and ``id`` headers) is never dropped by a TTL: its
    ``expiration`` (Celery's copy of ``expires``) is left to the worker; past the queue's
    x-message-ttl it is delivered with ``expires`` set to when that TTL passed."""
    expires = "2000-01-01T00:00:00+00:00"
    with connect(db_dsn) as conn:
        Queue("exp.celery.ttl", message_ttl=0.3)(conn.channel()).declare()
        producer = Producer(conn.channel())
        producer.publish(  # Celery's expires=: an expiration and an expires header
            [[1, 2], {}, {}],
            routing_key="exp.celery",
            expiration=0.1,
            headers={"task": "t.add", "id": "own-expires", "expires": expires},
            declare=[Queue("exp.celery")],
        )
        producer.publish(  # no expires of its own: the queue's TTL passes
            [[1, 2], {}, {}],
            routing_key="exp.celery.ttl",
            headers={"task": "t.add", "id": "queue-ttl", "expires": None},
        )
        time.sleep(0.5)
        own = drain(conn, "exp.celery", expect=1, timeout=3)
        by_queue = drain(conn, "exp.celery.ttl", expect=1, timeout=3)
    assert [m.headers["expires"] for m in own] == [expires]
    assert [m.headers["id"] for m in by_queue] == ["queue-ttl"]
    passed = datetime.fromisoformat(by_queue[0].headers["expires"])
    assert timedelta(0) < datetime.now(timezone.utc) - passed < timedelta(seconds=5)


def test_auto_delete_queue_goes_with_its_last_consumer(db_dsn):
    with connect(db_dsn) as a, connect(db_dsn) as b:
        q = Queue("auto.q", auto_delete=True, durable=False)
        consumer_a = Consumer(a.channel(), [q], on_message=lambda m: None)
        consumer_b = Consumer(b.channel(), [q], on_message=lambda m: None)
        consumer_a.consume()
        consumer_b.consume()
        consumer_a.cancel()
        assert exists(db_dsn, "auto.q")  # b still consumes
        consumer_b.cancel()
        assert not exists(db_dsn, "auto.q")


def test_auto_delete_queue_without_consumers_yet_stays(db_dsn):
    with connect(db_dsn) as conn:
        Queue("auto.waiting", auto_delete=True)(conn.channel()).declare()
        conn.transport.reap()
        assert exists(db_dsn, "auto.waiting")


def test_dead_consumers_queue_is_reaped(db_dsn):
    with (
        connect(db_dsn, consumer_stale_after=0.5) as dead,
        connect(db_dsn, consumer_stale_after=0.5) as survivor,
    ):
        survivor.channel()  # connected (and reaped once) before the consumer dies
        q = Queue("dead.worker.pidbox", auto_delete=True, durable=False)
        Consumer(dead.channel(), [q], on_message=lambda m: None).consume()
        # The "dead" process stops heartbeating (as after kill -9): no cancel ever comes.
        dead.transport.maintainer.stop()
        dead.transport._consumers.clear()
        time.sleep(0.8)
        assert survivor.transport.reap() == ["dead.worker.pidbox"]
        assert not exists(db_dsn, "dead.worker.pidbox")


def test_live_consumer_keeps_queue_alive_through_heartbeats(db_dsn):
    opts = {"consumer_stale_after": 1.0, "consumer_heartbeat_interval": 0.2}
    with connect(db_dsn, **opts) as live, connect(db_dsn, **opts) as other:
        other.connect()
        q = Queue("alive.q", auto_delete=True, durable=False, expires=0.5)
        Consumer(live.channel(), [q], on_message=lambda m: None).consume()
        time.sleep(1.5)
        assert other.transport.reap() == []
        assert exists(db_dsn, "alive.q")


def test_heartbeats_of_many_consumers_update_their_queue_once_a_second(db_dsn):
    """Consumers of one queue in many processes mark it used at most once a second
    between them (its row is not a hot spot): a second heartbeat right after the first
    leaves the row as it was (same xmin), one a second later updates it."""
    with connect(db_dsn) as first, connect(db_dsn) as second:
        q = Queue("hot.q")
        Consumer(first.channel(), [q], on_message=lambda m: None).consume()
        Consumer(second.channel(), [q], on_message=lambda m: None).consume()

        def version() -> object:
            return sql(db_dsn, "SELECT xmin::text FROM kombu_pgmq.queues WHERE queue = 'hot.q'")

        sql(db_dsn, "UPDATE kombu_pgmq.queues SET last_used_at = now() - interval '1 hour'")

        def beat(conn: Connection) -> None:
            db = Connector(db_dsn)
            try:
                Consumers(db).heartbeat(conn.transport.owner)
            finally:
                db.close()

        beat(first)
        after_first = version()
        beat(second)
        assert version() == after_first
        time.sleep(1.1)
        beat(second)
        assert version() != after_first


def test_x_expires_drops_unused_queue(db_dsn):
    with connect(db_dsn) as conn:
        Queue("expiring.q", expires=0.5)(conn.channel()).declare()
        Queue("kept.q")(conn.channel()).declare()
        assert conn.transport.reap() == []
        time.sleep(0.8)
        assert conn.transport.reap() == ["expiring.q"]
    assert not exists(db_dsn, "expiring.q") and exists(db_dsn, "kept.q")


def test_non_durable_queues_are_unlogged(db_dsn):
    with connect(db_dsn) as conn:
        Queue("transient.q", durable=False)(conn.channel()).declare()
        Queue("durable.q", durable=True)(conn.channel()).declare()
    rows = dict(
        sql(
            db_dsn,
            "SELECT relname, relpersistence FROM pg_class WHERE relname = ANY(%s)",
            [[table("transient.q").split(".", 1)[1], table("durable.q").split(".", 1)[1]]],
        )
    )
    assert rows == {
        table("transient.q").split(".", 1)[1]: "u",
        table("durable.q").split(".", 1)[1]: "p",
    }


def test_invalid_queue_arguments_are_named(db_dsn):
    import pytest

    from kombu_pgmq.errors import ConfigurationError

    with connect(db_dsn) as conn, pytest.raises(ConfigurationError, match="x-expires"):
        Queue("bad.q", queue_arguments={"x-expires": "soon"})(conn.channel()).declare()


def test_consumed_queue_dropped_underneath_is_recreated_with_its_bindings(db_dsn):
    from kombu import Exchange

    fanout = Exchange("control.ex", type="fanout")
    with connect(db_dsn) as worker, connect(db_dsn) as operator:
        got = []
        q = Queue("node.pidbox", fanout, auto_delete=True, durable=False)
        consumer = Consumer(worker.channel(), [q], on_message=got.append, no_ack=True)
        consumer.consume()
        operator.channel().queue_delete("node.pidbox")  # e.g. reaped during an outage
        with contextlib.suppress(TimeoutError):
            worker.drain_events(timeout=0.5)  # notices, recreates, rebinds
        assert exists(db_dsn, "node.pidbox")
        Producer(operator.channel(), exchange=fanout).publish({"ping": 1})
        worker.drain_events(timeout=3)
        assert [m.decode() for m in got] == [{"ping": 1}]


def test_message_ttl_counts_from_when_a_delayed_message_becomes_visible(db_dsn):
    """x-message-ttl 2 s and a 3 s delay (a countdown): delivered, not
    deleted undelivered (the TTL starts when the message becomes visible)."""
    with connect(db_dsn, polling_interval=0.2) as conn:
        q = Queue("ttl.delayed", message_ttl=2)
        q(conn.channel()).declare()
        publish(conn, "ttl.delayed", [{"n": 1}], headers={"x-delay": 3000})
        got = drain(conn, "ttl.delayed", expect=1, timeout=8)
    assert [m.payload for m in got] == [{"n": 1}]


def test_basic_get_and_publishes_count_as_use_of_an_x_expires_queue(db_dsn):
    """A queue polled with basic_get only, and one that keeps receiving
    messages, are not dropped by x-expires."""
    with connect(db_dsn) as conn:
        Queue("polled.q", expires=1)(conn.channel()).declare()
        Queue("fed.q", expires=1)(conn.channel()).declare()
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            conn.channel().basic_get("polled.q")
            publish(conn, "fed.q", [{"n": 1}])
            time.sleep(0.3)
        assert conn.transport.reap() == []
        assert exists(db_dsn, "polled.q") and exists(db_dsn, "fed.q")
        time.sleep(1.5)  # now unused (no get, no new message) for longer than x-expires
        assert sorted(conn.transport.reap()) == ["fed.q", "polled.q"]


def test_mandatory_publish_without_a_binding_raises(db_dsn):
    from kombu import Exchange

    from kombu_pgmq.errors import Unroutable

    with connect(db_dsn) as conn:
        exchange = Exchange("nowhere", type="direct")
        producer = Producer(conn.channel(), exchange=exchange)
        exchange(conn.channel()).declare()
        producer.publish({"n": 1}, routing_key="nobody")  # dropped, as AMQP
        with pytest.raises(Unroutable, match="mandatory=True"):
            producer.publish({"n": 1}, routing_key="nobody", mandatory=True)


def test_consumers_get_a_full_stale_after_from_a_database_restart(db_dsn):
    """Heartbeats could not be sent while the server was down; a
    consumer whose last heartbeat is older than stale_after, but from before the server
    started, is not judged until stale_after has passed since the start."""
    with connect(db_dsn) as conn:
        q = Queue("survivor.pidbox", auto_delete=True, durable=False)
        Consumer(conn.channel(), [q], on_message=lambda m: None).consume()
        conn.transport.maintainer.stop()  # no heartbeats from here on
        uptime = sql(db_dsn, "SELECT extract(epoch FROM now() - pg_postmaster_start_time())")
        stale_after = float(uptime[0][0]) + 60
        sql(
            db_dsn,
            "UPDATE kombu_pgmq.consumers SET stale_after_seconds = %s, heartbeat_at ="
            " pg_postmaster_start_time() - make_interval(secs => %s)",
            (stale_after, stale_after + 10),
        )
        with connect(db_dsn) as other:
            other.connect()  # reap() runs on an established connection
            assert other.transport.reap() == []
        assert exists(db_dsn, "survivor.pidbox")
