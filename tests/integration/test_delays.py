"""Native delayed delivery (kombu_pgmq.transport._delays): ETA headers and x-delay become PGMQ
visibility in the future, not messages held in a consumer's memory."""

from __future__ import annotations

import contextlib
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from kombu import Consumer, Exchange, Producer, Queue

from .helpers import connect, drain, publish, sql, table


def _seconds_until_visible(dsn: str, queue: str) -> list[float]:
    return [
        r[0]
        for r in sql(
            dsn,
            f"SELECT extract(epoch FROM vt - clock_timestamp())::float8 FROM {table(queue)} "
            "ORDER BY msg_id",
        )
    ]


def test_eta_header_sends_with_a_future_visibility(db_dsn):
    eta = datetime.now(timezone.utc) + timedelta(seconds=6)
    with connect(db_dsn, eta_lead_seconds=2) as conn:
        publish(conn, "eta.q", ["later"], headers={"eta": eta.isoformat()})
        [left] = _seconds_until_visible(db_dsn, "eta.q")
        assert 2.5 < left <= 4.0  # 6 s - 2 s lead, rounded down to whole seconds
        assert conn.channel().basic_get("eta.q") is None
        got = drain(conn, "eta.q", expect=1, timeout=8)
        assert [m.payload for m in got] == ["later"]
        assert datetime.now(timezone.utc) < eta  # delivered before the ETA (Celery waits)


def test_x_delay_header_in_milliseconds(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "xdelay", ["a"], headers={"x-delay": 1500})
        [left] = _seconds_until_visible(db_dsn, "xdelay")
        assert 1.0 < left <= 2.0  # rounded up: never earlier than asked
        start = time.monotonic()
        got = drain(conn, "xdelay", expect=1, timeout=6)
        assert got and time.monotonic() - start >= 0.9


def test_naive_or_past_eta_is_delivered_at_once(db_dsn):
    naive = (datetime.now() + timedelta(seconds=30)).isoformat()
    past = (datetime.now(timezone.utc) - timedelta(seconds=30)).isoformat()
    with connect(db_dsn) as conn:
        publish(conn, "eta.now", ["naive"], headers={"eta": naive})
        publish(conn, "eta.now", ["past"], headers={"eta": past})
        assert all(left <= 0 for left in _seconds_until_visible(db_dsn, "eta.now"))


def test_routed_publish_is_delayed_too(db_dsn):
    exchange = Exchange("delay.ex", type="direct")
    queue = Queue("delay.routed", exchange, routing_key="k")
    with connect(db_dsn) as conn:
        with conn.channel() as channel:
            queue(channel).declare()
            Producer(channel, exchange).publish("x", routing_key="k", headers={"x-delay": 3000})
        [left] = _seconds_until_visible(db_dsn, "delay.routed")
        assert 2.0 < left <= 3.0


# -- due messages wake consumers -------------------------------------------------------

#: A queue whose messages expire 0.6 s after they become visible; the consumer's
#: fallback poll (30 s) would find a delayed message long after that.
SHORT_TTL = Queue("due.ttl", routing_key="due.ttl", message_ttl=0.6)


def _publish_delayed(url: str, how: str) -> None:
    headers = {"x-delay": 1000}
    with connect(url) as conn:
        producer = Producer(conn)
        if how == "direct":
            producer.publish({"n": 1}, routing_key="due.ttl", declare=[SHORT_TTL], headers=headers)
        elif how == "deduplicated":  # kombu_pgmq.publish
            headers["x-deduplication-id"] = "due-1"
            producer.publish({"n": 1}, routing_key="due.ttl", declare=[SHORT_TTL], headers=headers)
        elif how == "routed":  # kombu_pgmq.publish_routed -> send_to
            exchange = Exchange("due.ex", type="direct")
            bound = Queue("due.ttl", exchange, routing_key="due.ttl", message_ttl=0.6)
            producer.publish(
                {"n": 1}, exchange=exchange, routing_key="due.ttl", declare=[bound], headers=headers
            )
        else:  # in the application's transaction: the wake-up waits for its commit
            import psycopg

            import kombu_pgmq

            with psycopg.connect(url) as app_conn, app_conn.transaction():
                Producer(kombu_pgmq.using(app_conn)).publish(
                    {"n": 1}, routing_key="due.ttl", headers=headers
                )
                time.sleep(0.3)  # a consumer waiting meanwhile learns it at commit


@pytest.mark.parametrize("how", ["direct", "deduplicated", "routed", "transaction"])
def test_a_due_message_wakes_its_waiting_consumer_before_its_ttl_ends(db_dsn, how):
    """A delayed message with a TTL shorter than the fallback poll's lag is delivered:
    the publish tells waiting consumers its due time and they read it then (left to the
    fallback poll, it would be deleted unseen)."""
    got: list[Any] = []
    with connect(db_dsn, polling_interval=30) as conn:
        SHORT_TTL(conn.channel()).declare()
        if how == "routed":
            Exchange("due.ex", type="direct")(conn.channel()).declare()
            conn.channel().queue_bind("due.ttl", "due.ex", "due.ttl")
        with Consumer(conn, [SHORT_TTL], on_message=got.append):
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)  # empty: the consumer now waits (LISTEN)
            start = time.monotonic()
            _publish_delayed(db_dsn, how)
            deadline = time.monotonic() + 6
            while not got and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=deadline - time.monotonic())
            elapsed = time.monotonic() - start
            assert [m.payload for m in got] == [{"n": 1}], f"nothing after {elapsed:.1f} s"
            assert 0.9 <= elapsed < 3.5
            got[0].ack()


def test_a_consumer_that_starts_waiting_learns_when_a_delayed_message_is_due(db_dsn):
    """Published before the consumer went to sleep: wait_for tells it the due time."""
    got: list[Any] = []
    with connect(db_dsn, polling_interval=30) as conn:
        SHORT_TTL(conn.channel()).declare()
        _publish_delayed(db_dsn, "direct")
        start = time.monotonic()
        with Consumer(conn, [SHORT_TTL], on_message=got.append):
            deadline = time.monotonic() + 6
            while not got and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=deadline - time.monotonic())
        assert [m.payload for m in got] == [{"n": 1}]
        assert time.monotonic() - start < 3.5
