"""Receipt handles: acks, requeues, restores and dead-letters settle a
delivery only while it still holds the message; restores do not count as deliveries;
an UNLOGGED queue that reuses ids after a crash never has a new message acked by an old
receipt, and an archive conflict never fails a read."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import psycopg
import pytest
from kombu import Consumer, Queue

from .helpers import connect, drain, publish, sql, table


def _count(db_dsn: str, queue: str, prefix: str = "q") -> int:
    return int(sql(db_dsn, f"SELECT count(*) FROM {table(queue, prefix)}")[0][0])


def test_stale_ack_does_not_settle_the_new_delivery(db_dsn, caplog):
    with connect(db_dsn, visibility_timeout=1, lease_renewal_interval=0) as a:
        publish(a, "stale", ["x"])
        old = a.channel().basic_get("stale")
        assert old is not None
        time.sleep(1.3)  # no renewals: the lease lapses
        with connect(db_dsn) as b:
            new = b.channel().basic_get("stale")
            assert new is not None and new.delivery_info["pgmq_read_ct"] == 2
            with caplog.at_level(logging.WARNING):
                old.ack()  # A's late ack
            assert "stale ack" in caplog.text
            assert _count(db_dsn, "stale") == 1 and _count(db_dsn, "stale", "a") == 0
            new.reject(requeue=True)  # B's requeue still finds its delivery
            again = b.channel().basic_get("stale")
            assert again is not None and again.delivery_info["pgmq_read_ct"] == 3
            again.ack()
    assert sql(db_dsn, f"SELECT read_ct FROM {table('stale', 'a')}") == [(3,)]


def test_a_stale_holders_restore_leaves_the_new_delivery_alone(db_dsn):
    with connect(db_dsn, visibility_timeout=1, lease_renewal_interval=0) as a:
        publish(a, "restored", ["x"])
        channel = a.channel()
        assert channel.basic_get("restored") is not None
        time.sleep(1.3)
        with connect(db_dsn, visibility_timeout=30) as b:
            held = b.channel().basic_get("restored")
            assert held is not None
            channel.close()  # A restores its unacked message: not B's delivery
            with connect(db_dsn) as c:
                assert c.channel().basic_get("restored") is None
            held.ack()
    assert _count(db_dsn, "restored", "a") == 1


def test_restores_do_not_count_toward_max_deliveries(db_dsn):
    """Prefetched messages returned on channel close (a deploy) were never run: three
    restores do not dead-letter a message with max_deliveries=2. read_ct counts every
    read (PGMQ's meaning); the restores are counted in x-kombu-restored, which the
    application never sees."""
    with connect(db_dsn, max_deliveries=2) as conn:
        publish(conn, "deploys", ["job"], headers={"h": 1})
        for _ in range(3):
            channel = conn.channel()
            assert channel.basic_get("deploys") is not None
            channel.close()
        assert sql(db_dsn, f"SELECT headers->'x-kombu-restored' FROM {table('deploys')}") == [(3,)]
        got = drain(conn, "deploys", expect=1, timeout=5)
    assert [m.payload for m in got] == ["job"]
    info = got[0].delivery_info
    assert (info["pgmq_read_ct"], info["pgmq_deliveries"], info["redelivered"]) == (4, 1, True)
    assert got[0].headers == {"h": 1}
    assert not _dlq_exists(db_dsn) or _count(db_dsn, "kombu_pgmq_dlq") == 0


def test_a_stale_receipt_never_matches_a_later_delivery_after_a_restore(db_dsn, caplog):
    """A's delivery lapses, B gets the message (read_ct 2) and closes its channel (a
    restore). read_ct stays 2: A's reject is stale, logged, not applied; the message is
    delivered again. Fails if a restore takes read_ct back to 1: A's stale receipt would
    match again and A's late reject dead-letter the message."""
    with connect(db_dsn, visibility_timeout=1, lease_renewal_interval=0) as a:
        publish(a, "restored_again", ["x"])
        old = a.channel().basic_get("restored_again")
        assert old is not None and old.delivery_info["pgmq_read_ct"] == 1
        time.sleep(1.3)  # A's lease lapses
        with connect(db_dsn) as b:
            channel = b.channel()
            new = channel.basic_get("restored_again")
            assert new is not None and new.delivery_info["pgmq_read_ct"] == 2
            channel.close()  # B restores it
            with caplog.at_level(logging.WARNING):
                old.reject(requeue=False)  # A's late reject
            assert "stale" in caplog.text
            again = b.channel().basic_get("restored_again")
            assert again is not None and again.delivery_info["pgmq_read_ct"] == 3
            again.ack()
    assert not _dlq_exists(db_dsn) or _count(db_dsn, "kombu_pgmq_dlq") == 0
    assert _count(db_dsn, "restored_again", "a") == 1


def _dlq_exists(db_dsn: str) -> bool:
    return bool(sql(db_dsn, "SELECT to_regclass('pgmq.q_kombu_pgmq_dlq') IS NOT NULL")[0][0])


def test_reused_ids_of_an_unlogged_queue_are_never_acked_by_an_old_receipt(db_dsn):
    """A crash empties an UNLOGGED queue and restarts its ids (simulated: TRUNCATE ...
    RESTART IDENTITY); a receipt of the old message never settles the new one."""
    queue = Queue("volatile", durable=False)
    with connect(db_dsn) as a, connect(db_dsn) as b:
        queue(a.channel()).declare()
        publish(a, "volatile", [{"m": "old"}])
        old = a.channel().basic_get("volatile")
        assert old is not None
        sql(db_dsn, f"TRUNCATE {table('volatile')} RESTART IDENTITY")
        publish(b, "volatile", [{"m": "new"}])
        new = b.channel().basic_get("volatile")
        assert new is not None
        assert new.delivery_info["pgmq_msg_id"] == old.delivery_info["pgmq_msg_id"]
        assert new.delivery_info["pgmq_read_ct"] == old.delivery_info["pgmq_read_ct"]
        old.ack()  # same msg_id and read_ct, another message: not applied
        assert _count(db_dsn, "volatile") == 1 and _count(db_dsn, "volatile", "a") == 0
        new.ack()
    assert sql(db_dsn, f"SELECT message->>'m' FROM {table('volatile', 'a')}") == [("new",)]


def _archive(db_dsn: str, queue: str) -> list[tuple[Any, ...]]:
    return sql(
        db_dsn,
        f"SELECT message->>'m', headers->>'x-queue-msg-id' FROM {table(queue, 'a')} "
        "ORDER BY msg_id",
    )


def test_an_ack_of_a_reused_id_is_archived_under_a_new_one(db_dsn):
    """After a crash emptied an UNLOGGED queue and restarted its ids (simulated:
    TRUNCATE ... RESTART IDENTITY), an ack of a new message whose id is already archived
    archives it under a fresh id (header x-queue-msg-id: the id it had), never drops it
    (neither queued nor archived); the queue's ids move past the archive's, and the
    reads go on."""
    with connect(db_dsn) as conn:
        Queue("reused", durable=False)(conn.channel()).declare()
        publish(conn, "reused", [{"m": "first"}])
        assert [m.payload["m"] for m in drain(conn, "reused", expect=1)] == ["first"]
        sql(db_dsn, f"TRUNCATE {table('reused')} RESTART IDENTITY")
        publish(conn, "reused", [{"m": "second"}, {"m": "third"}])
        got = drain(conn, "reused", expect=2, prefetch=1)  # acks ride with the next read
        assert [m.payload["m"] for m in got] == ["second", "third"]
        publish(conn, "reused", [{"m": "fourth"}])
        [fourth] = drain(conn, "reused", expect=1)
    assert _count(db_dsn, "reused") == 0
    assert _archive(db_dsn, "reused") == [
        ("first", None),
        ("third", None),  # id 2: free in the archive
        ("second", "1"),  # id 1 was taken: archived under the next id after the archive's
        ("fourth", None),
    ]
    assert fourth.delivery_info["pgmq_msg_id"] > 2  # the queue's ids moved past the archive's


def test_a_reused_id_is_archived_by_every_ack_path(db_dsn):
    """The same through kombu_pgmq.ack (acks of several queues in one statement, and
    least-privilege roles) and kombu_pgmq.cancel_task (a durable revoke)."""
    from kombu_pgmq._db.broker import Broker, Receipt
    from kombu_pgmq._db.connector import Connector
    from kombu_pgmq.management import Management

    with connect(db_dsn) as conn:
        for name in ("ra", "rb"):
            Queue(name, durable=False)(conn.channel()).declare()
            publish(conn, name, [{"m": f"{name}-old"}])
            drain(conn, name, expect=1)
            sql(db_dsn, f"TRUNCATE {table(name)} RESTART IDENTITY")
            publish(conn, name, [{"m": f"{name}-new"}], headers={"id": f"task-{name}"})
        info = conn.channel().basic_get("ra").delivery_info
        receipts = [
            Receipt(
                info["pgmq_queue"],
                info["pgmq_msg_id"],
                info["pgmq_read_ct"],
                info["pgmq_enqueued_at"],
            ),
            Receipt("rb", 999, 1, None),  # a second queue: the function path
        ]
        connector = Connector(db_dsn)
        try:
            settled = Broker(connector).ack(receipts)
        finally:
            connector.close()
    assert settled == {("ra", 1)}
    assert _archive(db_dsn, "ra") == [("ra-old", None), ("ra-new", "1")]
    with Management(db_dsn) as management:
        result = management.cancel_task("task-rb", revoke=False)
    assert result.cancelled == (("rb", 1),)
    rows = sql(
        db_dsn,
        f"SELECT message->>'m', headers->>'x-queue-msg-id', headers->>'x-archive-reason' "
        f"FROM {table('rb', 'a')} ORDER BY msg_id",
    )
    assert rows == [("rb-old", None, None), ("rb-new", "1", "cancelled")]


def test_acks_after_a_real_crash_of_an_unlogged_queue_lose_nothing():
    """A real crash (``pg_ctl stop -m immediate``) of a throwaway server: the UNLOGGED
    queue comes back empty with its ids restarted, its archive keeps ids 1-3; the new
    messages (ids 1-3 again) are all archived once acked, none dropped."""
    from kombu_pgmq import schema
    from tests.support import pgserver

    try:
        server = pgserver.start_server()
    except pgserver.EmbeddedPostgresMissing as exc:
        pytest.skip(str(exc))
    try:
        with psycopg.connect(server.dsn, autocommit=True) as admin:
            admin.execute("CREATE DATABASE broker")
        url = pgserver.socket_url(server)
        schema.bootstrap(url)
        with connect(url) as conn:
            Queue("volatile", durable=False)(conn.channel()).declare()
            publish(conn, "volatile", [{"m": f"before-{i}"} for i in range(3)])
            drain(conn, "volatile", expect=3)
        sql(url, "CHECKPOINT")  # the acks committed asynchronously: flushed before the crash
        server.crash()
        server.start_again()
        with connect(url) as conn:
            publish(conn, "volatile", [{"m": f"after-{i}"} for i in range(3)])
            got = drain(conn, "volatile", expect=3)
            assert sorted(m.delivery_info["pgmq_msg_id"] for m in got) == [1, 2, 3]
        archived = sorted(m for m, _ in _archive(url, "volatile"))
        assert archived == [*(f"after-{i}" for i in range(3)), *(f"before-{i}" for i in range(3))]
        assert _count(url, "volatile") == 0
    finally:
        server.stop()


def test_no_ack_consumer_loses_nothing_when_a_callback_raises(db_dsn):
    """A no_ack consumer is handed what it reads, deleted once delivered; a callback
    that raises leaves the rest of the batch in the queue (before: popped, then lost)."""
    got: list[int] = []

    def on_message(message: Any) -> None:
        got.append(message.payload["n"])
        message.ack()  # harmless on a no_ack message (before: KeyError)
        if len(got) == 1:
            raise RuntimeError("callback failed")

    with connect(db_dsn) as conn:
        publish(conn, "noack.fail", [{"n": n} for n in range(5)])
        channel = conn.channel()
        with Consumer(channel, [Queue("noack.fail")], on_message=on_message, no_ack=True):
            with pytest.raises(RuntimeError, match="callback failed"):
                conn.drain_events(timeout=5)
            deadline = time.monotonic() + 10
            while len(got) < 5 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert _count(db_dsn, "noack.fail") == 0 and _count(db_dsn, "noack.fail", "a") == 0


def test_an_undecodable_row_is_dead_lettered_and_the_batch_goes_on(db_dsn):
    """A row written by another producer that cannot be decoded goes to
    the dead-letter queue with reason undecodable and the error; the rest is delivered,
    nothing climbs in read_ct."""
    with connect(db_dsn, max_deliveries=2) as conn:
        publish(conn, "mixed", [{"n": 1}])
        sql(db_dsn, "SELECT pgmq.send('mixed', '{\"n\": 2}'::jsonb, '{\"x-kombu\": 42}'::jsonb)")
        publish(conn, "mixed", [{"n": 3}])
        got = drain(conn, "mixed", expect=2, timeout=5)
    assert [m.payload["n"] for m in got] == [1, 3]
    rows = sql(
        db_dsn,
        "SELECT message, headers->'x-dead-letter'->>'reason', headers->'x-dead-letter'->>'error'"
        " FROM pgmq.q_kombu_pgmq_dlq",
    )
    assert len(rows) == 1
    message, reason, error = rows[0]
    assert message == {"n": 2} and reason == "undecodable"
    assert "AttributeError" in error
    assert _count(db_dsn, "mixed") == 0
