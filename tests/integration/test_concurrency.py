"""Concurrent consumers in separate processes: every message delivered exactly once."""

from __future__ import annotations

import multiprocessing
from collections import Counter

import psycopg

from .helpers import connect, table

MESSAGES = 2000
CONSUMERS = 4


def consume_until_empty(
    url: str, queue: str, start: multiprocessing.synchronize.Barrier, results: multiprocessing.Queue
) -> None:
    from kombu import Consumer, Queue

    seen: list[int] = []

    def on_message(body, message):
        seen.append(body["n"])
        message.ack()

    with connect(url, visibility_timeout=300) as conn:
        channel = conn.channel()
        start.wait(timeout=60)
        with Consumer(channel, [Queue(queue)], callbacks=[on_message], prefetch_count=10):
            while True:
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    with psycopg.connect(url, autocommit=True) as c:
                        left = c.execute(f"SELECT count(*) FROM {table(queue)}").fetchone()[0]
                    if left == 0:
                        break
    results.put(seen)


def test_four_consumers_2000_messages_exactly_once(db_dsn):
    queue = "concurrent.work"
    with connect(db_dsn) as conn:
        channel = conn.channel()
        channel.queue_declare(queue)
        from kombu import Producer

        producer = Producer(channel)
        for n in range(MESSAGES):
            producer.publish({"n": n}, routing_key=queue)

    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(CONSUMERS)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=consume_until_empty, args=(db_dsn, queue, start, results))
        for _ in range(CONSUMERS)
    ]
    for p in procs:
        p.start()
    per_consumer = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    counts = Counter(n for seen in per_consumer for n in seen)
    assert sorted(counts) == list(range(MESSAGES))  # nothing lost
    assert max(counts.values()) == 1  # nothing delivered twice
    assert sum(1 for seen in per_consumer if seen) >= 2  # really concurrent
    with psycopg.connect(db_dsn, autocommit=True) as c:
        archived = c.execute(f"SELECT count(*), max(read_ct) FROM {table(queue, 'a')}").fetchone()
    assert archived == (MESSAGES, 1)
