"""Unconfirmed publishes (transport option ``confirm_publish=False``): a publish
returns once its statement is sent, without waiting for the server; a publish the server
then refuses is published again (confirmed), and nothing a returned publish sent is lost
when its process exits at once."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import psycopg
from kombu import Connection, Producer, Queue

from kombu_pgmq._naming import pgmq_queue_name

from .helpers import connect, drain, sql, table


def _bodies(url: str, queue: str) -> list[Any]:
    return [r[0]["body"] for r in sql(url, f"SELECT message FROM {table(queue)} ORDER BY msg_id")]


def _producer(conn: Connection, queue: str) -> Producer:
    producer = Producer(conn.channel())
    producer.declare = [Queue(queue, routing_key=queue)]
    producer.maybe_declare(producer.declare[0])
    return producer


def test_a_publish_returns_before_the_server_has_written_it(db_dsn):
    conn = connect(db_dsn, confirm_publish=False)
    producer = _producer(conn, "unconfirmed_lock")
    producer.publish({"n": 0}, routing_key="unconfirmed_lock")  # prepares the statement
    conn.default_channel.broker.db.collect()
    with psycopg.connect(db_dsn) as locker:
        # the INSERT waits for this lock on the server
        locker.execute(f"LOCK TABLE {table('unconfirmed_lock')} IN EXCLUSIVE MODE")
        start = time.monotonic()
        producer.publish({"n": 1}, routing_key="unconfirmed_lock")
        assert time.monotonic() - start < 2.0  # did not wait for the lock
        time.sleep(0.3)
        locker.rollback()  # the statement sent runs now
    closing = time.monotonic()
    conn.release()  # waits for the last result
    assert time.monotonic() - closing < 10
    got = drain(connect(db_dsn), "unconfirmed_lock", expect=2)
    assert [m.payload for m in got] == [{"n": 0}, {"n": 1}]


def test_confirmed_publishes_wait_for_the_server(db_dsn):
    """The default, for contrast: the same publish blocks until the lock is released."""
    conn = connect(db_dsn)
    producer = _producer(conn, "confirmed_lock")
    with psycopg.connect(db_dsn) as locker:
        locker.execute(f"LOCK TABLE {table('confirmed_lock')} IN EXCLUSIVE MODE")
        done = threading.Event()
        publisher = threading.Thread(
            target=lambda: (producer.publish({"n": 1}, routing_key="confirmed_lock"), done.set())
        )
        publisher.start()
        assert not done.wait(1.0)
        locker.rollback()
    publisher.join(10)
    assert done.is_set()
    conn.release()


def test_every_returned_publish_arrives_though_the_process_exits_at_once(db_dsn):
    """A producer process publishes 300 messages unconfirmed and exits with ``os._exit``
    right after the last publish returns (no close, no flush): all 300 are in the queue."""
    script = textwrap.dedent(
        """
        import os, sys
        from kombu import Connection, Producer, Queue
        import kombu_pgmq
        conn = Connection(sys.argv[1], transport_options={"confirm_publish": False})
        producer = Producer(conn.channel())
        queue = Queue("unconfirmed_exit", routing_key="unconfirmed_exit")
        for n in range(300):
            producer.publish({"body": n}, routing_key="unconfirmed_exit", declare=[queue])
        os._exit(0)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, db_dsn], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    deadline = time.monotonic() + 10
    while len(_bodies(db_dsn, "unconfirmed_exit")) < 300 and time.monotonic() < deadline:
        time.sleep(0.05)  # the last statement may still be running on the server
    assert _bodies(db_dsn, "unconfirmed_exit") == list(range(300))


def _drop_behind_its_back(url: str, queue: str) -> None:
    sql(url, "SELECT pgmq.drop_queue(%s)", [pgmq_queue_name(queue)])


def test_a_publish_the_server_refuses_is_published_again(db_dsn, caplog):
    conn = connect(db_dsn, confirm_publish=False)
    producer = _producer(conn, "unconfirmed_refused")
    producer.publish({"body": 1}, routing_key="unconfirmed_refused")
    conn.default_channel.broker.db.collect()  # 1 is written
    _drop_behind_its_back(db_dsn, "unconfirmed_refused")  # 1 goes with the table
    with caplog.at_level(logging.WARNING, logger="kombu_pgmq.transport.publisher"):
        producer.publish({"body": 2}, routing_key="unconfirmed_refused")  # refused, unseen
        producer.publish({"body": 3}, routing_key="unconfirmed_refused")  # reads 2's failure
    assert "an unconfirmed publish to 'unconfirmed_refused' failed" in caplog.text
    conn.release()
    assert sorted(_bodies(db_dsn, "unconfirmed_refused")) == [2, 3]


def test_a_refused_publish_is_published_again_when_the_channel_closes(db_dsn):
    conn = connect(db_dsn, confirm_publish=False)
    producer = _producer(conn, "unconfirmed_close")
    producer.publish({"body": 1}, routing_key="unconfirmed_close")
    conn.default_channel.broker.db.collect()
    _drop_behind_its_back(db_dsn, "unconfirmed_close")
    producer.publish({"body": 2}, routing_key="unconfirmed_close")  # the last one: refused
    producer.channel.close()
    conn.release()
    assert _bodies(db_dsn, "unconfirmed_close") == [2]


def test_nothing_is_lost_when_the_server_ends_the_connection_between_publishes(db_dsn):
    conn = connect(db_dsn, confirm_publish=False)
    producer = _producer(conn, "unconfirmed_killed")
    for n in range(100):
        if n in (30, 70):
            pid = conn.default_channel.broker.db.backend_pid
            sql(db_dsn, "SELECT pg_terminate_backend(%s)", [pid])
        producer.publish(
            {"body": n},
            routing_key="unconfirmed_killed",
            retry=True,
            retry_policy={"max_retries": 5},
        )
    conn.release()
    bodies = _bodies(db_dsn, "unconfirmed_killed")
    assert set(bodies) == set(range(100))  # at least once: a lost result is published again
