"""Acks sent at once, without waiting for their result: the connector's
``send_nowait`` (a prepared statement sent, its result read before the next statement),
and what the transport does with an ack whose result says it failed."""

from __future__ import annotations

import select
import time
from typing import Any

import pytest
from kombu import Consumer, Queue

from kombu_pgmq import errors
from kombu_pgmq._db.broker import Broker, Receipt
from kombu_pgmq._db.connector import Connector

from .helpers import connect, publish, sql


class Outcome:
    """What a statement sent by ``send_nowait`` came to (its callbacks record it)."""

    def __init__(self, connector: Connector) -> None:
        self.connector = connector
        self.rows: list[Any] | None = None
        self.error: errors.KombuPgmqError | None = None

    def result(self, rows: list[Any]) -> None:
        self.rows = rows

    def failed(self, error: errors.KombuPgmqError) -> None:
        self.error = error

    def send(self, name: str, statement: bytes, *params: bytes) -> None:
        self.connector.send_nowait(
            name, statement, list(params), on_result=self.result, on_error=self.failed
        )


def test_a_statement_sent_without_waiting_is_read_before_the_next_one(db_dsn):
    connector = Connector(db_dsn)
    outcome = Outcome(connector)
    try:
        outcome.send("t_sleep", b"SELECT 7 AS n, pg_sleep($1::float8)", b"0.4")
        assert not connector.free()  # still running on the server: nothing read yet
        assert outcome.rows is None
        start = time.monotonic()
        assert connector.scalar("database_identity") is not None  # reads it first
        assert time.monotonic() - start >= 0.2
        assert outcome.rows == [("7", "")]
        assert connector.free()
        # prepared once per connection: the second send skips the PREPARE
        outcome.send("t_sleep", b"unused", b"0")
        readable, _, _ = select.select([connector.fileno()], [], [], 30)  # the result came
        assert readable
        assert connector.free()  # the result had arrived: read without waiting
        assert outcome.rows == [("7", "")] and outcome.error is None
    finally:
        connector.close()


def test_a_failed_statement_reaches_on_error_and_the_connection_stays(db_dsn):
    connector = Connector(db_dsn)
    outcome = Outcome(connector)
    try:
        pid = connector.backend_pid
        outcome.send("t_fails", b"SELECT 1 / $1::integer", b"0")
        connector.collect()
        assert isinstance(outcome.error, errors.StatementError)
        assert "division by zero" in str(outcome.error)
        assert connector.backend_pid == pid
        # a statement that cannot even be prepared fails at once
        with pytest.raises(errors.QueueNotFound):
            outcome.send(
                "t_missing", b"SELECT * FROM pgmq.q_nowhere WHERE msg_id = $1::bigint", b"1"
            )
        assert connector.free() and connector.backend_pid == pid
    finally:
        connector.close()


def test_a_connection_lost_with_a_statement_pending_reports_it_and_reconnects(db_dsn):
    connector = Connector(db_dsn)
    outcome = Outcome(connector)
    try:
        pid = connector.backend_pid
        outcome.send("t_slow", b"SELECT pg_sleep($1::float8)", b"5")
        sql(db_dsn, "SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(errors.BrokerConnectionError):
            connector.collect()
        assert isinstance(outcome.error, errors.BrokerConnectionError)
        assert connector.scalar("database_identity") is not None  # a new connection
        assert connector.backend_pid != pid
    finally:
        connector.close()


def _held(db_dsn: str, queue: str, count: int) -> tuple[Broker, list[Receipt]]:
    """A broker on its own connection holding ``count`` deliveries of ``queue``."""
    with connect(db_dsn) as conn:
        publish(conn, queue, list(range(count)))
    broker = Broker(Connector(db_dsn))
    rows = broker.read_many([queue], 30, count)
    return broker, [Receipt(queue, r.msg_id, r.read_ct, r.enqueued_at) for r in rows]


def test_ack_nowait_archives_and_reports_stale_receipts(db_dsn):
    broker, receipts = _held(db_dsn, "nowait", 3)
    connector = broker.db
    settled: list[set[tuple[str, int]]] = []
    try:
        # a queue whose functions this connection has not called: not this path (the
        # caller's ack creates them if missing)
        assert not Broker(connector).ack_nowait(
            receipts, durable=False, on_settled=pytest.fail, on_error=pytest.fail
        )
        stale = Receipt("nowait", receipts[0].msg_id, 99, receipts[0].enqueued_at)
        sent = broker.ack_nowait(
            [*receipts[1:], stale],
            durable=False,
            on_settled=settled.append,
            on_error=pytest.fail,
        )
        assert sent
        deadline = time.monotonic() + 5  # archived by the server, whatever we do meanwhile
        while sql(db_dsn, "SELECT count(*) FROM pgmq.a_nowait") != [(2,)]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        connector.collect()
        assert settled == [{("nowait", r.msg_id) for r in receipts[1:]}]
        # several queues: not this path
        other = Receipt("elsewhere", 1, 1, None)
        assert not broker.ack_nowait(
            [receipts[0], other], durable=False, on_settled=pytest.fail, on_error=pytest.fail
        )
    finally:
        connector.close()


def test_acks_whose_statement_failed_are_archived_by_a_later_round(db_dsn):
    """In Celery's event loop (a hub run by hand), acks are sent at once; another session
    holds their rows locked, so that statement is cancelled by statement_timeout: the
    transport keeps the acks and archives them once the lock is gone; nothing is lost
    or archived twice."""
    import psycopg

    from .helpers import FakeHub

    got: list[Any] = []
    options = {"connection_options": {"options": "-c statement_timeout=300"}}
    with connect(db_dsn, **options) as conn:
        publish(conn, "locked_acks", list(range(3)))
        hub = FakeHub()
        conn.transport.register_with_event_loop(conn.connection, hub)
        with Consumer(conn, [Queue("locked_acks")], on_message=got.append, prefetch_count=8):
            deadline = time.monotonic() + 10
            while len(got) < 3:
                assert time.monotonic() < deadline
                hub.run_once()
            with psycopg.connect(db_dsn) as locker:
                locker.execute("SELECT * FROM pgmq.q_locked_acks FOR UPDATE")
                for message in got:
                    message.ack()  # sent at once: waits for the lock, cancelled
                for _ in range(5):
                    hub.run_once()
                    time.sleep(0.1)
                assert sql(db_dsn, "SELECT count(*) FROM pgmq.a_locked_acks") == [(0,)]
            deadline = time.monotonic() + 10  # the lock is gone
            while sql(db_dsn, "SELECT count(*) FROM pgmq.a_locked_acks") != [(3,)]:
                assert time.monotonic() < deadline, "the acks were not archived again"
                hub.soon.append((conn.transport.poller._on_hub_fallback, ()))
                hub.run_once()
    assert sql(db_dsn, "SELECT count(*) FROM pgmq.q_locked_acks") == [(0,)]
