"""A cancelled statement (SQLSTATE 57014: ``statement_timeout``, ``pg_cancel_backend``)
is a :class:`~kombu_pgmq.errors.StatementCanceled`, not a lost connection: the
connection is kept (same backend pid), kombu does not reconnect, and a consumer whose
read is cancelled keeps its connection and reads again later. 57014 is in the "operator
intervention" class 57, whose other states are connection errors: taken as one, it would
make the connector drop the connection and the consumer log "database connection lost".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kombu import Consumer, Producer, Queue
from psycopg import sql as pgsql

from kombu_pgmq import errors
from kombu_pgmq._db.connector import Connector

from .helpers import FakeHub, connect, publish, table

TIMEOUT = {"connection_options": {"options": "-c statement_timeout=300"}}  # ms
#: A deduplicated message is never handed off to a waiting consumer: it wakes it, and
#: the consumer reads it (the read these tests cancel).
NOT_HANDED_OVER = {"x-deduplication-id": "second"}


@contextlib.contextmanager
def _locked(dsn: str, queue: str) -> Iterator[None]:
    """Another session holds an ACCESS EXCLUSIVE lock on ``queue``'s table (as a
    migration or a ``VACUUM FULL`` would) until the block ends."""
    with psycopg.connect(dsn) as other, other.transaction():
        other.execute(f"LOCK TABLE {table(queue)} IN ACCESS EXCLUSIVE MODE")
        yield


def test_pg_cancel_backend_is_a_statement_error_and_the_connection_is_kept(db_dsn):
    connector = Connector(db_dsn)
    pid = connector.backend_pid

    def cancel() -> None:
        with psycopg.connect(db_dsn, autocommit=True) as admin:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                state = admin.execute(
                    "SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()
                if state == ("active",):
                    admin.execute("SELECT pg_cancel_backend(%s)", (pid,))
                    return
                time.sleep(0.02)

    canceller = threading.Thread(target=cancel)
    canceller.start()
    try:
        with pytest.raises(errors.StatementCanceled) as info:
            connector.fetch(pgsql.SQL("SELECT pg_sleep(30)"))
    finally:
        canceller.join()
        assert connector.connected  # not dropped
        assert connector.backend_pid == pid
        assert connector.scalar(pgsql.SQL("SELECT 1")) == 1
        connector.close()
    err = info.value
    assert isinstance(err, errors.StatementError)
    assert not isinstance(err, errors.BrokerConnectionError)
    assert isinstance(err.__cause__, psycopg.errors.QueryCanceled)  # the real server error
    assert str(err).startswith("57014: canceling statement due to user request")


def test_a_publish_past_statement_timeout_fails_and_the_connection_stays(db_dsn):
    with connect(db_dsn, **TIMEOUT) as conn:
        queue = Queue("slow")
        producer = Producer(conn)
        producer.publish({"n": 1}, routing_key="slow", declare=[queue])
        pid = conn.transport.broker().db.backend_pid
        with _locked(db_dsn, "slow"):
            started = time.monotonic()
            with pytest.raises(errors.StatementCanceled, match="statement_timeout"):
                producer.publish({"n": 2}, routing_key="slow")
            assert time.monotonic() - started < 5  # the timeout, not kombu's retries
        producer.publish({"n": 3}, routing_key="slow")
        assert conn.transport.broker().db.backend_pid == pid  # the same session
        assert conn.transport.broker().db.connected
        got: list[Any] = []
        with Consumer(conn, [queue], on_message=lambda m: (got.append(m.decode()), m.ack())):
            deadline = time.monotonic() + 10
            while len(got) < 2 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.5)
    assert got == [{"n": 1}, {"n": 3}]


def test_a_consumer_whose_read_is_cancelled_keeps_its_connection(db_dsn, caplog):
    caplog.set_level(logging.WARNING, logger="kombu_pgmq")
    with connect(db_dsn, polling_interval=0.5, **TIMEOUT) as conn:
        publish(conn, "blocked", ["first"])
        got: list[Any] = []
        with Consumer(conn, [Queue("blocked")], on_message=lambda m: (got.append(m), m.ack())):
            conn.drain_events(timeout=5)
            assert len(got) == 1
            pid = conn.transport.broker().db.backend_pid
            publish(conn, "blocked", ["second"], headers=NOT_HANDED_OVER)
            with _locked(db_dsn, "blocked"):
                conn.transport.poller.wake("blocked")  # read it now: blocked, cancelled
                with pytest.raises(TimeoutError):
                    conn.drain_events(timeout=1.5)
            assert len(got) == 1
            conn.drain_events(timeout=5)  # read again once the lock is gone
            assert len(got) == 2
            assert conn.transport.broker().db.backend_pid == pid
    assert "database connection lost" not in caplog.text
    assert "reading the consumed queues failed: 57014" in caplog.text
    assert "reads work again" in caplog.text


def test_in_the_event_loop_a_cancelled_read_reaches_neither_celery_nor_the_connection(
    db_dsn, caplog
):
    """In Celery's event loop the read runs in a reader callback of the hub: an error
    escaping it would end the worker ("Unrecoverable error"); a lost connection would be
    reported and the connection dropped. A cancelled read is neither: logged, retried."""
    caplog.set_level(logging.WARNING, logger="kombu_pgmq")
    loop = FakeHub()
    with connect(db_dsn, **TIMEOUT) as conn:
        publish(conn, "hubslow", ["first"])
        got: list[Any] = []
        conn.transport.register_with_event_loop(conn.connection, loop)
        with Consumer(
            conn.default_channel, [Queue("hubslow")], on_message=lambda m: (got.append(m), m.ack())
        ):
            for _ in range(5):
                loop.run_once()
            assert len(got) == 1
            pid = conn.transport.broker().db.backend_pid
            publish(conn, "hubslow", ["second"], headers=NOT_HANDED_OVER)
            with _locked(db_dsn, "hubslow"):
                conn.transport.poller.wake("hubslow")
                for _ in range(3):
                    loop.run_once()  # raises nothing
            assert len(got) == 1
            conn.transport.poller._on_hub_fallback()  # the fallback poll's timer
            assert len(got) == 2
            assert conn.transport.broker().db.backend_pid == pid
        conn.transport.poller.unregister_from_event_loop()
    assert "database connection lost" not in caplog.text
    assert "reading the consumed queues failed: 57014" in caplog.text
