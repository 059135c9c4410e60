"""Native delayed delivery (kombu_pgmq.transport._delays): ETA headers and x-delay become PGMQ
visibility in the future, not messages held in a consumer's memory."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

from kombu import Exchange, Producer, Queue

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
