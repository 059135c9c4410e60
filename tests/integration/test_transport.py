"""Every transport primitive against a real PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import threading
import time

import pytest
from kombu import Connection, Consumer, Producer, Queue
from kombu.exceptions import ChannelError
from kombu.exceptions import OperationalError as KombuOperationalError

from kombu_pgmq.errors import ConfigurationError

from .helpers import connect, drain, publish, sql, table

CELERY_NAMES = [
    "celery",
    "Mixed.Case@host-1",
    "0d6c9a0e-9b1f-4a49-9f39-2d4a1c8b7e42.reply.celery.pidbox",
]


@pytest.mark.parametrize("queue", CELERY_NAMES)
def test_publish_consume_ack_archives(db_dsn, queue):
    with connect(db_dsn) as conn:
        publish(conn, queue, [{"n": 1}, {"n": 2}], headers={"task": "tasks.add"})
        got = drain(conn, queue, expect=2)
    assert [m.decode() for m in got] == [{"n": 1}, {"n": 2}]
    assert got[0].headers == {"task": "tasks.add"}
    assert got[0].delivery_info["redelivered"] is False
    assert sql(db_dsn, f"SELECT count(*) FROM {table(queue)}") == [(0,)]
    archived = sql(
        db_dsn, f"SELECT message, headers->>'task' FROM {table(queue, 'a')} ORDER BY msg_id"
    )
    assert archived == [({"n": 1}, "tasks.add"), ({"n": 2}, "tasks.add")]


def test_json_body_is_readable_in_sql(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "readable", [{"args": [2, 3], "kwargs": {"x": "ü"}}])
    rows = sql(db_dsn, f"SELECT message, jsonb_typeof(message) FROM {table('readable')}")
    assert rows == [({"args": [2, 3], "kwargs": {"x": "ü"}}, "object")]


@pytest.mark.parametrize(
    ("body", "kwargs"),
    [
        (
            pickle.dumps({"a": {1, 2}}),
            {"content_type": "application/x-python-serialize", "content_encoding": "binary"},
        ),
        (
            b"\x00\x01\xfe\xff",
            {"content_type": "application/octet-stream", "content_encoding": "binary"},
        ),
        ("not json", {"content_type": "application/json", "content_encoding": "utf-8"}),
        ('{"nul": "a\\u0000b"}', {"content_type": "application/json", "content_encoding": "utf-8"}),
    ],
)
def test_opaque_bodies_roundtrip_exactly(db_dsn, body, kwargs):
    with connect(db_dsn) as conn:
        publish(conn, "opaque", [body], **kwargs)
        (message,) = drain(conn, "opaque", expect=1)
    expected = body if isinstance(body, bytes) else body.encode()
    assert message.body == expected


def test_pickle_serializer_roundtrip(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "pickled", [{"a": {1, 2}}], serializer="pickle")
        (message,) = drain(conn, "pickled", expect=1)
        assert message.content_type == "application/x-python-serialize"
        assert pickle.loads(message.body) == {"a": {1, 2}}


def test_reads_up_to_free_prefetch_in_one_round_trip(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "batch", list(range(25)))
        client = conn.default_channel.broker
        reads: list[int] = []
        original = client.read_many

        def counting_read(queues, vt_seconds, qty, acks=(), **kwargs):
            rows = original(queues, vt_seconds, qty, acks, **kwargs)
            reads.append(len(rows))
            return rows

        client.read_many = counting_read
        got = drain(conn, "batch", expect=25, prefetch=10)
    assert len(got) == 25
    assert reads[:3] == [10, 10, 5]


def test_unacked_message_is_redelivered_after_visibility_timeout(db_dsn):
    # lease renewal off: this holder behaves like a crashed one
    with connect(db_dsn, visibility_timeout=1, lease_renewal_interval=0) as conn:
        publish(conn, "vt", ["x"])
        channel = conn.channel()
        first = channel.basic_get("vt")
        assert first is not None
        assert channel.basic_get("vt") is None  # invisible while the lease lasts
        time.sleep(1.3)
        again = channel.basic_get("vt")
        assert again is not None
        assert again.delivery_info["pgmq_msg_id"] == first.delivery_info["pgmq_msg_id"]
        assert again.delivery_info["redelivered"] is True
        again.ack()
    assert sql(db_dsn, f"SELECT read_ct FROM {table('vt', 'a')}") == [(2,)]


def test_reject_with_requeue_is_visible_at_once(db_dsn):
    with connect(db_dsn, visibility_timeout=600) as conn:
        publish(conn, "requeue", ["x"])
        channel = conn.channel()
        message = channel.basic_get("requeue")
        message.reject(requeue=True)
        again = channel.basic_get("requeue")
        assert again is not None and again.body == message.body
        assert again.delivery_info["redelivered"] is True


def test_a_requeued_message_goes_back_to_its_place(db_dsn):
    """Consumers read oldest visibility first; a message requeued at once keeps its
    place in the queue (vt = its enqueued_at), as AMQP's requeue does,
    instead of going behind every message visible meanwhile."""
    with connect(db_dsn, visibility_timeout=600) as conn:
        publish(conn, "place", ["a", "b", "c"])
        order: list[str] = []

        def on_message(message):
            order.append(message.decode())
            if len(order) == 1:
                message.reject(requeue=True)
            else:
                message.ack()

        with Consumer(
            conn.channel(),
            [Queue("place", routing_key="place")],
            on_message=on_message,
            prefetch_count=1,
        ):
            deadline = time.monotonic() + 10
            while len(order) < 4 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.5)
    assert order == ["a", "a", "b", "c"]


def test_reject_without_requeue_dead_letters(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "poison", [{"bad": True}], headers={"task": "t"})
        channel = conn.channel()
        channel.basic_get("poison").reject(requeue=False)
        assert channel.basic_get("poison") is None
    rows = sql(db_dsn, f"SELECT message, headers FROM {table('kombu_pgmq_dlq')}")
    assert len(rows) == 1
    message, headers = rows[0]
    assert message == {"bad": True}
    assert headers["task"] == "t"
    dead = headers["x-dead-letter"]
    assert dead["queue"] == "poison" and dead["reason"] == "rejected" and dead["read_ct"] == 1
    assert sql(db_dsn, f"SELECT count(*) FROM {table('poison')}") == [(0,)]


def test_dead_letter_after_max_deliveries(db_dsn):
    with connect(
        db_dsn,
        visibility_timeout=1,
        max_deliveries=2,
        dead_letter_queue="Custom.DLQ",
        lease_renewal_interval=0,  # the holder "crashes": no renewals
    ) as conn:
        publish(conn, "flaky", ["x"])
        channel = conn.channel()
        deliveries = 0
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            if channel.basic_get("flaky") is not None:
                deliveries += 1  # never acked: the worker "crashed"
            elif sql(db_dsn, f"SELECT count(*) FROM {table('flaky')}") == [(0,)]:
                break
            time.sleep(0.2)
        assert deliveries == 2
        dlq = channel.basic_get("Custom.DLQ")
        assert dlq is not None and dlq.body == b"x"
        assert dlq.headers["x-dead-letter"]["reason"] == "max_deliveries"
        assert dlq.headers["x-dead-letter"]["read_ct"] == 3
        assert dlq.headers["x-dead-letter"]["queue"] == "flaky"


def test_closing_channel_restores_unacked_without_copies(db_dsn):
    with connect(db_dsn, visibility_timeout=600) as conn:
        publish(conn, "restore", list(range(5)))
        channel = conn.channel()
        got = []
        with Consumer(
            channel, [Queue("restore")], callbacks=[lambda b, m: got.append(m)], prefetch_count=5
        ):
            conn.drain_events(timeout=2)
        assert len(got) == 5
        channel.close()
    rows = sql(db_dsn, f"SELECT msg_id, vt <= clock_timestamp() FROM {table('restore')}")
    assert len(rows) == 5  # no copies published
    assert all(visible for _, visible in rows)
    with connect(db_dsn) as conn:
        again = drain(conn, "restore", expect=5)
        assert sorted(m.decode() for m in again) == list(range(5))


def test_no_ack_consumer_pops(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "noack", ["a", "b"])
        channel = conn.channel()
        got = []
        with Consumer(
            channel, [Queue("noack")], callbacks=[lambda b, m: got.append(b)], no_ack=True
        ):
            conn.drain_events(timeout=2)
    assert got == ["a", "b"]
    assert sql(db_dsn, f"SELECT count(*) FROM {table('noack')}") == [(0,)]
    assert sql(db_dsn, f"SELECT count(*) FROM {table('noack', 'a')}") == [(0,)]


def test_purge_size_delete_and_passive_declare(db_dsn):
    with connect(db_dsn, visibility_timeout=600) as conn:
        publish(conn, "admin.q", list(range(4)))
        channel = conn.channel()
        held = channel.basic_get("admin.q")
        assert channel._size("admin.q") == 3  # unacked message is not "ready"
        declared = channel.queue_declare("admin.q", passive=True)
        assert declared.message_count == 3
        assert channel.queue_purge("admin.q") == 3
        held.ack()  # the unacked message survived the purge: its ack still works
        assert sql(db_dsn, f"SELECT count(*) FROM {table('admin.q', 'a')}") == [(1,)]
        channel.queue_delete("admin.q")
        with pytest.raises(ChannelError, match="NOT_FOUND"):
            channel.queue_declare("admin.q", passive=True)
        assert channel.queue_purge("admin.q") == 0
        assert channel._size("admin.q") == 0


def test_publish_recreates_queue_dropped_by_another_process(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "dropped", ["one"])
        sql(db_dsn, "SELECT pgmq.drop_queue(%s)", [table("dropped").split("q_", 1)[1]])
        publish(conn, "dropped", ["two"])
        assert [m.decode() for m in drain(conn, "dropped", expect=1)] == ["two"]


def test_kombu_names_are_recorded(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "Mixed.Case@host-1", ["x"])
    rows = sql(db_dsn, "SELECT queue, pgmq_queue FROM kombu_pgmq.queues")
    assert ("Mixed.Case@host-1", table("Mixed.Case@host-1").split("q_", 1)[1]) in rows


def test_foreign_sql_message_is_consumable(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "fromsql", [])
        conn.channel().queue_declare("fromsql")
    sql(db_dsn, "SELECT pgmq.send('fromsql', '{\"order\": 42}'::jsonb)")
    with connect(db_dsn) as conn:
        (message,) = drain(conn, "fromsql", expect=1)
        assert message.decode() == {"order": 42}


def test_url_parameters_reach_the_server(db_dsn):
    url = db_dsn + ("&" if "?" in db_dsn else "?") + "application_name=kpgmq-app-test"
    with Connection(url) as conn:
        channel = conn.channel()
        pid = channel.broker.db.backend_pid
        rows = sql(db_dsn, "SELECT application_name FROM pg_stat_activity WHERE pid = %s", [pid])
    assert rows == [("kpgmq-app-test:statements",)]  # + the role (docs/connections.md)


def test_password_never_in_repr_or_logs(db_dsn, caplog):
    url = db_dsn.replace("postgresql://postgres", "postgresql://postgres:s3cr%40t-pw", 1)
    if "s3cr" not in url:
        pytest.skip(f"test DSN has no user part to add a password to: {db_dsn}")
    caplog.set_level(logging.DEBUG)
    with Connection(url) as conn:
        channel = conn.channel()  # trust auth: the password is sent but not checked
        texts = [repr(conn.transport), conn.as_uri(), repr(channel.broker), caplog.text]
    for text in texts:
        assert "s3cr" not in text


def test_unreachable_server_is_a_connection_error(tmp_path):
    url = f"postgresql://u:hunter2@/db?host={tmp_path}&connect_timeout=2"
    conn = Connection(url, connect_timeout=2)
    # kombu wraps the transport's connection errors in its own OperationalError.
    with pytest.raises((KombuOperationalError, *conn.connection_errors)) as info:
        conn.ensure_connection(max_retries=1)
    assert isinstance(info.value.__cause__ or info.value, conn.connection_errors)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("visibility_timeout", 0),
        ("visibility_timeout", "soon"),
        ("max_deliveries", 0),
        ("read_batch_size", 0),
        ("dead_letter_queue", ""),
    ],
)
def test_invalid_transport_options_are_named(db_dsn, option, value):
    with (
        connect(db_dsn, **{option: value}) as conn,
        pytest.raises(ConfigurationError, match=option),
    ):
        conn.channel()


def test_install_schema_off_on_empty_database_says_how_to_fix(empty_db_dsn):
    from kombu_pgmq.errors import BootstrapError

    with (
        connect(empty_db_dsn, install_schema=False) as conn,
        pytest.raises(BootstrapError, match=r"kombu-pgmq schema install"),
    ):
        conn.channel()


def test_headers_column_carries_envelope(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "env", [{"a": 1}], headers={"task": "t", "x-pgmq-group": "g1"}, priority=5)
    (headers,) = sql(db_dsn, f"SELECT headers FROM {table('env')}")[0]
    assert headers["task"] == "t" and headers["x-pgmq-group"] == "g1"
    assert headers["x-kombu"]["properties"]["priority"] == 5
    json.dumps(headers)


def test_producer_on_default_exchange_with_unknown_queue_creates_nothing_lost(db_dsn):
    with connect(db_dsn) as conn:
        Producer(conn.channel()).publish({"x": 1}, routing_key="never.declared")
        (message,) = drain(conn, "never.declared", expect=1)
        assert message.decode() == {"x": 1}


def test_failing_callback_releases_the_rest_of_the_batch(db_dsn):
    with connect(db_dsn, visibility_timeout=600) as conn:
        publish(conn, "batchfail", [1, 2, 3])
        channel = conn.channel()
        seen = []

        def on_message(message):
            seen.append(message)
            raise RuntimeError("consumer callback failed")

        consumer = Consumer(channel, [Queue("batchfail")], on_message=on_message, prefetch_count=10)
        with consumer, pytest.raises(RuntimeError, match="callback failed"):
            conn.drain_events(timeout=2)
        assert len(seen) == 1
        # 2 and 3 were read in the same round trip but never delivered: visible now;
        # 1 was delivered (unacked) and stays invisible until the channel closes.
        visible = sql(db_dsn, f"SELECT count(*) FROM {table('batchfail')} WHERE vt <= now()")
        assert visible == [(2,)]


def test_ack_wakes_a_consumer_whose_prefetch_was_full(db_dsn):
    # polling_interval is long: without the wake-up the second message would wait 60 s
    # (the bound below leaves a loaded machine 10 s).
    with connect(db_dsn, polling_interval=60) as conn:
        publish(conn, "wake", ["first", "second"])
        channel = conn.channel()
        got: list[tuple[float, object]] = []

        def on_message(message):
            got.append((time.monotonic(), message))
            if len(got) == 1:  # ack the first one from another thread, 0.3 s later
                threading.Timer(0.3, message.ack).start()
            else:
                message.ack()

        with Consumer(channel, [Queue("wake")], on_message=on_message, prefetch_count=1):
            start = time.monotonic()
            while len(got) < 2 and time.monotonic() - start < 15:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=15)
        assert [m.body for _, m in got] == [b"first", b"second"]
        assert got[1][0] - got[0][0] < 10.0


def test_declare_and_publish_do_not_wait_for_an_open_transaction_that_enqueued(db_dsn):
    """An application enqueues inside its own transaction and keeps it open: other
    connections must still declare the queue and publish to it (pgmq.create on an
    existing queue would wait for that transaction's lock)."""
    import psycopg

    with connect(db_dsn) as conn:
        publish(conn, "orders", ["before"])
    with psycopg.connect(db_dsn) as app_tx:
        app_tx.execute("SELECT pgmq.send('orders', '\"in the app transaction\"'::jsonb)")
        done = threading.Event()

        def declare_and_publish():
            with connect(db_dsn) as conn:  # a new connection declares the queue again
                publish(conn, "orders", ["while it is open"])
            done.set()

        threading.Thread(target=declare_and_publish, daemon=True).start()
        assert done.wait(5), "declare/publish waited for the open transaction"
        app_tx.rollback()
    with connect(db_dsn) as conn:
        bodies = [m.decode() for m in drain(conn, "orders", expect=2)]
    assert bodies == ["before", "while it is open"]


def test_headers_postgresql_cannot_store_round_trip(db_dsn):
    """A NUL, NaN or a lone surrogate in a header (Celery's argsrepr) does not fail the
    publish; the message comes back with its headers as sent."""
    headers = {"task": "t", "argsrepr": "('a\x00b',)", "ratio": float("inf"), "s": "\ud800"}
    with connect(db_dsn) as conn:
        publish(conn, "oddheaders", [{"n": 1}], headers=headers)
        (message,) = drain(conn, "oddheaders", expect=1)
    assert message.headers == headers
    assert message.decode() == {"n": 1}
    assert sql(db_dsn, f"SELECT headers->>'task' FROM {table('oddheaders', 'a')}") == [("t",)]


def test_message_over_max_message_bytes_is_refused_before_sending(db_dsn):
    with connect(db_dsn, max_message_bytes=4096) as conn:
        publish(conn, "small", [{"ok": "x" * 100}])
        with pytest.raises(ConfigurationError, match="max_message_bytes=4096"):
            publish(conn, "small", [{"big": "x" * 5000}])
    assert sql(db_dsn, f"SELECT count(*) FROM {table('small')}") == [(1,)]


def test_unknown_publish_property_is_ignored_and_the_message_consumed(db_dsn):
    """Unknown properties (Celery's test_chord_header_id_duplicated_on_rabbitmq_msg_duplication
    passes a signal object through apply_async's keyword arguments into the properties):
    AMQP transports ignore properties they do not know; known ones round-trip."""
    with connect(db_dsn) as conn:
        Producer(conn.channel()).publish(
            {"n": 1},
            routing_key="props.q",
            declare=[Queue("props.q")],
            correlation_id="c-1",
            message_id="m-1",
            app_id="app",
            signal=object(),  # not JSON
        )
        (got,) = drain(conn, "props.q", expect=1, timeout=3)
    assert got.decode() == {"n": 1}
    assert (got.properties["correlation_id"], got.properties["message_id"]) == ("c-1", "m-1")
    assert got.properties["app_id"] == "app" and "signal" not in got.properties
