"""Least privilege: an owner role that is no superuser installs the schema; a
producer role may only publish (and read the statistics); a worker role may consume,
ack (also inside its own transaction, as an AtomicTask does), reject and declare its
own queues, nothing else (``install_schema=False``). Each refusal is checked on a real
server, as the role itself, through Kombu and in plain SQL.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.exceptions import OperationalError

import kombu_pgmq  # noqa: F401
from kombu_pgmq import errors, schema
from kombu_pgmq.dlq import DeadLetterQueue
from kombu_pgmq.management import Management
from tests.conftest import LeastPrivilegeDb

from .helpers import WaitingConsumer, sql

EXCHANGE = Exchange("orders_x", type="direct")
QUEUE = Queue("orders", EXCHANGE, routing_key="orders")
OPTIONS = {"install_schema": False, "polling_interval": 0.2}


def _connection(url: str, **options: Any) -> Connection:
    return Connection(url, transport_options={**OPTIONS, **options})


def _drain(conn: Connection, queue: Queue, count: int, on_message: Any) -> None:
    """Consume until ``on_message`` ran ``count`` times (at most ``count`` x 4 s), then
    one more second: a delivery beyond ``count`` reaches ``on_message`` too."""
    calls: list[None] = []

    def counted(message: Any) -> None:
        calls.append(None)
        on_message(message)

    with Consumer(conn, [queue], on_message=counted, prefetch_count=10):
        deadline = time.monotonic() + count * 4
        while len(calls) < count and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=1)
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=1)


def _sql_refused(url: str, statement: str) -> str:
    """Run ``statement`` as the URL's role; return the server's refusal (fails if none)."""
    with (
        psycopg.connect(url, autocommit=True) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege) as info,
    ):
        conn.execute(statement)
    return str(info.value)


def _owner_count(db: LeastPrivilegeDb, table: str) -> int:
    with psycopg.connect(db.owner_url, autocommit=True) as conn:
        return conn.execute(f"SELECT count(*) FROM pgmq.{table}").fetchone()[0]


def _declare_as_worker(db: LeastPrivilegeDb) -> None:
    with _connection(db.worker_url) as conn:
        QUEUE(conn.default_channel).declare()


def test_grants_are_recorded_and_the_owner_is_no_superuser(least_privilege_db):
    db = least_privilege_db
    assert sorted(schema.grants(db.owner_url)) == sorted(
        [(db.producer, "producer"), (db.worker, "worker")]
    )
    with psycopg.connect(db.owner_url, autocommit=True) as conn:
        assert conn.execute(
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
        ).fetchone() == (False,)
    with pytest.raises(errors.StatementError):
        schema.grant(db.worker_url, db.producer, "worker")  # only the owner grants
    with pytest.raises(errors.ConfigurationError, match="producer or worker"):
        schema.grant(db.owner_url, db.producer, "admin")


def test_producer_publishes_to_existing_queues_and_nothing_else(least_privilege_db):
    db = least_privilege_db
    _declare_as_worker(db)
    with _connection(db.producer_url) as conn:
        producer = Producer(conn.default_channel)
        # Celery declares the queue (and its exchange and binding) before a first
        # publish: for a producer that is a passive declaration of what exists.
        producer.publish({"n": 1}, exchange=EXCHANGE, routing_key="orders", declare=[QUEUE])
        producer.publish({"n": 2}, routing_key="orders")  # default exchange
        assert QUEUE(conn.default_channel).queue_declare(passive=True).message_count == 2

        channel = conn.default_channel
        with pytest.raises(errors.PermissionDenied, match="may not create queues"):
            Queue("new_queue")(channel).declare()
        with pytest.raises(errors.PermissionDenied, match="may not declare exchanges"):
            Exchange("new_x", type="fanout")(channel).declare()
        with pytest.raises(errors.PermissionDenied, match="may not bind"):
            QUEUE(channel).bind_to(EXCHANGE, routing_key="other")
        with pytest.raises(errors.PermissionDenied, match="schema grant worker"):
            channel.basic_get("orders")  # consuming is the worker's
        with pytest.raises(errors.PermissionDenied):
            channel.queue_purge("orders")
        with pytest.raises(errors.PermissionDenied):
            channel.queue_delete("orders")
    assert _owner_count(db, "q_orders") == 2  # published, untouched

    # In SQL: no privilege on PGMQ's tables, not even through PGMQ's own functions.
    _sql_refused(db.producer_url, "SELECT * FROM pgmq.q_orders")
    _sql_refused(db.producer_url, "SELECT * FROM pgmq.read('orders', 30, 1)")
    _sql_refused(db.producer_url, "SELECT pgmq.send('orders', '{}'::jsonb)")
    _sql_refused(db.producer_url, "SELECT * FROM kombu_pgmq.read(ARRAY['orders'], 30, 1)")
    _sql_refused(db.producer_url, "DELETE FROM kombu_pgmq.queues")
    _sql_refused(db.producer_url, "SELECT kombu_pgmq.purge('orders')")


def test_an_unconfirmed_producer_without_table_rights_loses_nothing(least_privilege_db):
    """confirm_publish=False: the producer's first statement on PGMQ's table is refused
    after the publish returned; that message is published again through
    kombu_pgmq.publish, and so are the next ones."""
    db = least_privilege_db
    _declare_as_worker(db)
    with _connection(db.producer_url, confirm_publish=False) as conn:
        producer = Producer(conn.default_channel)
        for n in range(5):
            producer.publish({"n": n}, routing_key="orders", declare=[QUEUE])
    assert _owner_count(db, "q_orders") == 5


def test_worker_consumes_acks_rejects_and_declares_its_queues_nothing_else(least_privilege_db):
    db = least_privilege_db
    _declare_as_worker(db)
    with _connection(db.producer_url) as conn:
        producer = Producer(conn.default_channel)
        for n in range(3):
            producer.publish({"n": n}, exchange=EXCHANGE, routing_key="orders")

    seen: list[int] = []

    def settle(message: Any) -> None:
        n = message.payload["n"]
        seen.append(n)
        if n == 1:
            message.reject()  # dead-lettered
        elif n == 2 and seen.count(2) == 1:
            message.requeue()  # delivered again
        else:
            message.ack()

    with _connection(db.worker_url, max_deliveries=5) as conn:
        _drain(conn, QUEUE, 4, settle)
        assert sorted(seen) == [0, 1, 2, 2]
        # A reply queue as Celery's pidbox makes them: non-durable, auto-delete, created
        # through kombu_pgmq.declare_queue (so owned by the schema owner, not the worker).
        reply = Queue(
            "reply.w1",
            Exchange("reply_x", type="direct"),
            routing_key="w1",
            durable=False,
            auto_delete=True,
        )
        Producer(conn.default_channel).publish(
            {"n": 9}, exchange="reply_x", routing_key="w1", declare=[reply]
        )
        replies: list[int] = []
        _drain(conn, reply, 1, lambda m: (replies.append(m.payload["n"]), m.ack()))
        assert replies == [9]

        channel = conn.default_channel
        with pytest.raises(errors.PermissionDenied, match="durable"):
            channel.queue_delete("orders")  # a durable queue: the owner's decision
        Queue("events.w1", durable=False)(channel).declare()
        channel.queue_delete("events.w1")  # its own transient queue (as kombu's pidbox)
        assert channel.queue_purge("orders") == 0  # purging ready messages is a consumer's

    assert _owner_count(db, "a_orders") == 2  # acked: 0 and 2 (after its requeue)
    assert _owner_count(db, "q_kombu_pgmq_dlq") == 1  # 1, rejected
    assert _owner_count(db, "q_orders") == 0
    with psycopg.connect(db.owner_url, autocommit=True) as conn:
        owners = conn.execute(
            "SELECT DISTINCT pg_get_userbyid(c.relowner) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'pgmq' AND c.relname ~ '^[qa]_'"
        ).fetchall()
        assert owners == [(db.owner,)]  # the worker created no table of its own
        assert conn.execute(
            "SELECT count(*) FROM kombu_pgmq.queues WHERE queue IN ('reply.w1', 'events.w1')"
        ).fetchone() == (0,)  # auto-deleted with its consumer; deleted

    _sql_refused(db.worker_url, "SELECT * FROM pgmq.a_orders")  # the audit trail
    _sql_refused(db.worker_url, "SELECT * FROM pgmq.q_kombu_pgmq_dlq")
    _sql_refused(db.worker_url, "DROP TABLE pgmq.q_orders")
    _sql_refused(db.worker_url, "SELECT kombu_pgmq.drop_queue('orders')")
    _sql_refused(db.worker_url, "CREATE TABLE pgmq.mine (id int)")
    _sql_refused(db.worker_url, "DELETE FROM kombu_pgmq.exchanges")
    with DeadLetterQueue(db.worker_url) as dlq, pytest.raises(errors.PermissionDenied):
        dlq.list()  # dead-letter admin is the owner's


def _sql_invalid(url: str, statement: str) -> str:
    """Run ``statement`` as the URL's role; return the server's refusal of a value."""
    with (
        psycopg.connect(url, autocommit=True) as conn,
        pytest.raises(
            (psycopg.errors.InvalidParameterValue, psycopg.errors.CheckViolation)
        ) as info,
    ):
        conn.execute(statement)
    return str(info.value)


def test_a_worker_may_not_read_drain_or_purge_the_dead_letter_queue(least_privilege_db):
    """The dead-letter queue is the owner's: the generic functions (kombu_pgmq.read,
    pop, purge) do not serve it to a worker role."""
    db = least_privilege_db
    _declare_as_worker(db)
    with _connection(db.worker_url) as conn:
        Producer(conn.default_channel).publish({"n": 1}, exchange=EXCHANGE, routing_key="orders")
        conn.default_channel.basic_get("orders").reject()  # dead-lettered by the worker
    assert _owner_count(db, "q_kombu_pgmq_dlq") == 1
    for statement in (
        "SELECT * FROM kombu_pgmq.read(ARRAY['kombu_pgmq_dlq'], 30, 10)",
        "SELECT * FROM kombu_pgmq.read(ARRAY['orders', 'kombu_pgmq_dlq'], 30, 10)",
        "SELECT * FROM kombu_pgmq.pop('kombu_pgmq_dlq', 10)",
        "SELECT kombu_pgmq.purge('kombu_pgmq_dlq')",
    ):
        assert "dead-letter queue" in _sql_refused(db.worker_url, statement)
    with _connection(db.worker_url) as conn:
        channel = conn.default_channel
        with pytest.raises(errors.PermissionDenied, match="dead-letter queue"):
            channel.queue_purge("kombu_pgmq_dlq")
        with pytest.raises(errors.PermissionDenied, match="dead-letter queue"):
            channel.basic_get("kombu_pgmq_dlq", no_ack=True)
        with pytest.raises(errors.PermissionDenied, match="dead-letter queue"):
            _drain(conn, Queue("kombu_pgmq_dlq"), 1, lambda m: m.ack())
    assert _owner_count(db, "q_kombu_pgmq_dlq") == 1  # still there, unread
    with _connection(db.owner_url) as conn:  # the owner reads it through the same functions
        message = conn.default_channel.basic_get("kombu_pgmq_dlq")
        assert message is not None and message.payload == {"n": 1}
        message.ack()
    # the counting a worker or producer may do still works
    with psycopg.connect(db.producer_url, autocommit=True) as conn:
        assert conn.execute("SELECT kombu_pgmq.size('kombu_pgmq_dlq')").fetchone() == (0,)


def test_a_producer_may_not_create_queues_through_send_task(least_privilege_db):
    """kombu_pgmq.send_task creates a plain-named queue it does not find only for a worker
    or the owner: creating queues is theirs, not a producer's."""
    db = least_privilege_db
    refusal = _sql_refused(
        db.producer_url, "SELECT kombu_pgmq.send_task('tasks.t', '[]', '{}', 'brand_new')"
    )
    assert "may not create queues" in refusal
    with psycopg.connect(db.owner_url, autocommit=True) as conn:
        assert conn.execute(
            "SELECT count(*) FROM kombu_pgmq.queues WHERE queue = 'brand_new'"
        ).fetchone() == (0,)
    with psycopg.connect(db.worker_url, autocommit=True) as conn:  # a worker may
        conn.execute("SELECT kombu_pgmq.send_task('tasks.t', '[]', '{}', 'brand_new')")
    with psycopg.connect(db.producer_url, autocommit=True) as conn:  # and then a producer
        conn.execute("SELECT kombu_pgmq.send_task('tasks.t', '[]', '{}', 'brand_new')")
    assert _owner_count(db, "q_brand_new") == 2


def test_every_window_a_caller_sets_is_capped(least_privilege_db):
    """Refused on the server: a producer's deduplication claim until the year 33715
    (publish(..., 1e12)), a worker hiding a message for 68 years, holding every
    publisher of a queue behind an endless lock wait, or keeping a consumer alive forever."""
    db = least_privilege_db
    _declare_as_worker(db)
    for statement in (
        "SELECT kombu_pgmq.publish('orders', '{}', '{\"x-deduplication-id\": \"a\"}', 0, 1e12)",
        "SELECT kombu_pgmq.publish('orders', '{}', '{\"x-deduplication-id\": \"a\"}', 0, 'NaN')",
        "SELECT kombu_pgmq.send_task('tasks.t', '[]', '{}', 'orders',"
        ' \'{"deduplication_id": "b", "deduplication_window": 1e9}\')',
    ):
        assert "deduplication_window" in _sql_invalid(db.producer_url, statement)
    for statement in (
        "SELECT * FROM kombu_pgmq.read(ARRAY['orders'], 2147483647, 1)",
        "SELECT * FROM kombu_pgmq.requeue(ARRAY['orders'], ARRAY[1::bigint], ARRAY[1],"
        " ARRAY[now()], 2147483647, false)",
        "SELECT * FROM kombu_pgmq.renew(ARRAY['orders'], ARRAY[1::bigint], ARRAY[1],"
        " ARRAY[now()], -5)",
    ):
        assert "visibility timeout" in _sql_invalid(db.worker_url, statement)
    assert "max_wait_ms" in _sql_invalid(
        db.worker_url, "SELECT * FROM kombu_pgmq.wait_for('me', ARRAY['orders'], 3600000)"
    )
    assert "stale_after" in _sql_invalid(
        db.worker_url,
        "INSERT INTO kombu_pgmq.consumers (queue, owner, consumer_tag, stale_after_seconds)"
        " VALUES ('orders', 'me', 't', 1e12)",
    )
    with psycopg.connect(db.owner_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM kombu_pgmq.deduplication").fetchone() == (0,)
    # the transport's own options stop at the same caps, before anything is sent
    for option, value in (
        ("visibility_timeout", 43_201),
        ("deduplication_window", 1e12),
        ("consumer_stale_after", 86_401),
    ):
        with pytest.raises(errors.ConfigurationError, match=option):
            _connection(db.worker_url, **{option: value}).connect()


def test_a_role_revoked_or_made_producer_loses_the_worker_privileges(least_privilege_db):
    db = least_privilege_db
    _declare_as_worker(db)
    schema.grant(db.owner_url, db.worker, "producer")  # demoted
    with _connection(db.worker_url) as conn, pytest.raises(errors.PermissionDenied):
        conn.default_channel.basic_get("orders")
    assert schema.revoke(db.owner_url, db.worker)
    # refused at connect (kombu wraps the error of its first channel)
    with (
        pytest.raises((errors.PermissionDenied, OperationalError), match="schema grant"),
        _connection(db.worker_url) as conn,
    ):
        Producer(conn.default_channel).publish({"n": 1}, routing_key="orders")
    assert (db.worker, "worker") not in schema.grants(db.owner_url)


def test_an_owner_without_the_grant_option_on_pgmq_gets_the_fix(extension_server):
    """The pgmq extension created by a superuser owns schema pgmq: an owner role that may
    create queues there but not pass USAGE on is told which GRANT to run (PostgreSQL
    itself would only warn, and the roles would fail later)."""
    from tests.support import pgserver

    owner, password = pgserver.create_role(extension_server, "owner")
    producer, _ = pgserver.create_role(extension_server, "producer")
    name = pgserver.create_database(extension_server, "nogrant", "template0", owner=owner)
    try:
        with psycopg.connect(
            pgserver.database_url(extension_server, name), autocommit=True
        ) as conn:
            conn.execute("CREATE EXTENSION pgmq")
            conn.execute(f'GRANT USAGE, CREATE ON SCHEMA pgmq TO "{owner}"')
            conn.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE ON pgmq.meta TO "{owner}"')
        url = pgserver.database_url(extension_server, name, user=owner, password=password)
        schema.bootstrap(url)
        with pytest.raises(errors.StatementError, match="WITH GRANT OPTION") as info:
            schema.grant(url, producer, "producer")
        assert f"GRANT USAGE ON SCHEMA pgmq TO {owner} WITH GRANT OPTION" in str(info.value)
        assert schema.grants(url) == []  # nothing half-granted
    finally:
        pgserver.drop_database(extension_server, name)
        pgserver.drop_role(extension_server, owner)
        pgserver.drop_role(extension_server, producer)


def test_a_worker_archives_expired_messages(least_privilege_db):
    """A worker role (no rights on PGMQ's tables) archives an expired message too, with
    its reason (through kombu_pgmq.archive_expired),
    never deletes it."""
    db = least_privilege_db
    _declare_as_worker(db)
    with _connection(db.producer_url) as conn:
        producer = Producer(conn.default_channel)
        producer.publish({"n": 0}, exchange=EXCHANGE, routing_key="orders", expiration=0.1)
        producer.publish({"n": 1}, exchange=EXCHANGE, routing_key="orders")
    time.sleep(0.3)
    seen: list[int] = []
    with _connection(db.worker_url) as conn:
        _drain(conn, QUEUE, 1, lambda m: (seen.append(m.payload["n"]), m.ack()))
    assert seen == [1]
    assert _owner_count(db, "q_orders") == 0
    assert _owner_count(db, "a_orders") == 2
    with psycopg.connect(db.owner_url, autocommit=True) as conn:
        reasons = conn.execute(
            "SELECT message->>'n', headers->>'x-archive-reason' FROM pgmq.a_orders ORDER BY msg_id"
        ).fetchall()
    assert reasons == [("0", "expired"), ("1", None)]


def test_a_role_that_may_not_write_wal_messages_still_publishes(least_privilege_db, caplog):
    """A server that revoked ``pg_logical_emit_message`` from PUBLIC: the owner's publish
    a consumer waits for (committed before its WAL flush; statement ``flush_commits``
    then refused) succeeds and is delivered, and the connection turns
    ``visible_before_flush`` off with a warning naming the grant; later publishes commit
    synchronously, once."""
    db = least_privilege_db
    sql(
        db.admin_url,
        "DO $$ DECLARE f regprocedure; BEGIN"
        " FOR f IN SELECT oid::regprocedure FROM pg_proc"
        "  WHERE proname = 'pg_logical_emit_message' LOOP"
        "  EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);"
        " END LOOP; END $$",
    )
    queue = Queue("no_wal_messages", routing_key="no_wal_messages")
    with _connection(db.owner_url) as conn:
        producer = Producer(conn.channel())
        producer.publish({"i": -1}, routing_key="no_wal_messages", declare=[queue])
        consumer = WaitingConsumer(db.owner_url, queue, **OPTIONS)
        try:
            consumer.wait_for(1)
            time.sleep(0.3)  # the consumer waits again
            with caplog.at_level("WARNING", logger="kombu_pgmq"):
                for i in range(3):
                    producer.publish({"i": i}, routing_key="no_wal_messages", declare=[queue])
            consumer.wait_for(4)
        finally:
            consumer.stop()
        assert not conn.transport.broker().visible_before_flush
    warned = [r.getMessage() for r in caplog.records if "visible_before_flush" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "GRANT EXECUTE ON FUNCTION" in warned[0]
    assert sorted(b["i"] for b in consumer.got) == [-1, 0, 1, 2]


def test_in_the_event_loop_a_worker_without_table_rights_polls_by_reading(least_privilege_db):
    """The fallback poll's probe (Celery's event loop) reads PGMQ's tables, which a worker
    role may not: its answer is the refusal, every consumed queue is read as without a probe (a
    message no publish notified is still delivered), and the LISTEN connection probes no
    more."""
    from .helpers import FakeHub

    db = least_privilege_db
    _declare_as_worker(db)
    got: list[Any] = []
    with _connection(db.worker_url, polling_interval=60) as conn:
        hub = FakeHub()
        conn.transport.register_with_event_loop(conn.connection, hub)
        poller = conn.transport.poller
        with Consumer(conn, [QUEUE], on_message=lambda m: (got.append(m), m.ack())):
            for _ in range(3):
                hub.run_once()
            with psycopg.connect(db.owner_url, autocommit=True) as owner:
                owner.execute("SELECT pgmq.send('orders', '{\"n\": 7}'::jsonb)")  # no NOTIFY
            poller._on_hub_fallback()  # what the loop's repeating timer calls
            deadline = time.monotonic() + 10
            while not got:
                assert time.monotonic() < deadline, "the fallback poll did not read the queue"
                hub.run_once()
            assert poller.listener().probes is False  # refused once: no probe from now on
        poller.unregister_from_event_loop()
    assert [m.decode() for m in got] == [{"n": 7}]
    assert _owner_count(db, "q_orders") == 0


def _ack_in_transaction(message: Any) -> str:
    """The statement an AtomicTask's transaction runs to ack ``message`` (its receipt)."""
    info = message.delivery_info
    enqueued = info["pgmq_enqueued_at"].isoformat()
    return (
        f"SELECT kombu_pgmq.ack_in_transaction('{info['pgmq_queue']}', {info['pgmq_msg_id']},"
        f" {info['pgmq_read_ct']}, '{enqueued}')"
    )


def test_a_worker_acks_in_its_transaction_a_producer_may_not_and_reads_the_count(
    least_privilege_db,
):
    db = least_privilege_db
    _declare_as_worker(db)
    with _connection(db.producer_url) as conn:
        producer = Producer(conn.default_channel)
        for n in range(2):
            producer.publish({"n": n}, exchange=EXCHANGE, routing_key="orders")
    with _connection(db.worker_url) as conn:
        channel = conn.channel()
        held = [channel.basic_get("orders", no_ack=False) for _ in range(2)]
        assert all(message is not None for message in held)
        first, second = (_ack_in_transaction(message) for message in held)
        assert "function ack_in_transaction" in _sql_refused(db.producer_url, first)
        with psycopg.connect(db.worker_url) as pg:  # the application's transaction
            pg.execute(first)
            pg.commit()
            pg.execute(second)
            pg.rollback()  # rolled back: the message stays held, nothing counted
            with pytest.raises(psycopg.Error) as stale:
                pg.execute(first)  # the fence: that delivery's message is archived
            assert stale.value.sqlstate == "KP001"
    assert _owner_count(db, "a_orders") == 1
    with psycopg.connect(db.producer_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pgmq_queue, settled FROM kombu_pgmq.settled_in_transaction()"
        ).fetchall()
    assert rows == [(held[0].delivery_info["pgmq_queue"], 1)]
    with Management(db.producer_url) as management:
        stats = {q.name: q for q in management.queues()}
    assert stats["orders"].settled_in_transaction == 1
