"""Issue 15's costs, in one run: a publish inside the application's transaction
(``kombu_pgmq.using``) against a normal publish, the deduplication check, and the consume
rate of a FIFO-groups queue against a plain queue.

Usage (from the repository root)::

    python benchmarks/outbox.py [--url postgresql://postgres@127.0.0.1:5432/kpb_outbox]
        [--messages 2000] [--rounds 3] [--json benchmarks/results/outbox.json]

Publish cases (one Kombu ``Producer``, ``--messages`` small messages, msgs/s):

* ``publish``: a normal publish (its own transaction, committed synchronously);
* ``publish, deduplication id``: the same with a unique ``x-deduplication-id`` each;
* ``in app transaction``: ``BEGIN; publish through using(conn); COMMIT`` per message,
  the application's commit included;
* ``app INSERT alone``: ``BEGIN; INSERT INTO orders; COMMIT`` (the application's own
  work, the floor of the next case);
* ``app INSERT + publish, one transaction``: ``BEGIN; INSERT; publish; COMMIT``;
* ``app INSERT, then a normal publish``: what an application does without a
  transactional broker (two commits; the message may be lost between them).

Consume cases (``--messages`` queued first, then one Kombu consumer, prefetch 10, ack each):
a plain queue; an ``x-fifo-groups`` queue with 100 groups, and with 10 groups.

Medians and ranges over ``--rounds`` rounds, cases interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import psycopg  # noqa: E402
from brokers import ensure_database  # noqa: E402
from kombu import Connection, Consumer, Producer, Queue  # noqa: E402

import kombu_pgmq  # noqa: E402

BODY = {"task": "noop", "args": [1, 2], "kwargs": {}}


def publish_cases(url: str, n: int) -> dict[str, float]:
    queue = Queue(f"outbox_{uuid.uuid4().hex[:8]}")
    rates: dict[str, float] = {}
    with Connection(url) as conn, psycopg.connect(url) as pg:
        producer = Producer(conn)
        producer.publish(BODY, routing_key=queue.name, declare=[queue])
        pg.execute("CREATE TABLE IF NOT EXISTS bench_orders (id bigserial PRIMARY KEY, t text)")
        pg.commit()
        bound = Producer(kombu_pgmq.using(pg))
        bound.publish(BODY, routing_key=queue.name)  # warm: declarations cached
        pg.commit()

        def timed(name: str, step: Any) -> None:
            start = time.perf_counter()
            for i in range(n):
                step(i)
            rates[name] = n / (time.perf_counter() - start)

        timed("publish", lambda i: producer.publish(BODY, routing_key=queue.name))
        timed(
            "publish, deduplication id",
            lambda i: producer.publish(
                BODY, routing_key=queue.name, headers={"x-deduplication-id": uuid.uuid4().hex}
            ),
        )

        def in_tx(i: int) -> None:
            with pg.transaction():
                bound.publish(BODY, routing_key=queue.name)

        def insert_alone(i: int) -> None:
            with pg.transaction():
                pg.execute("INSERT INTO bench_orders (t) VALUES ('x')")

        def insert_and_publish(i: int) -> None:
            with pg.transaction():
                pg.execute("INSERT INTO bench_orders (t) VALUES ('x')")
                bound.publish(BODY, routing_key=queue.name)

        def insert_then_publish(i: int) -> None:
            with pg.transaction():
                pg.execute("INSERT INTO bench_orders (t) VALUES ('x')")
            producer.publish(BODY, routing_key=queue.name)

        timed("in app transaction", in_tx)
        timed("app INSERT alone", insert_alone)
        timed("app INSERT + publish, one transaction", insert_and_publish)
        timed("app INSERT, then a normal publish", insert_then_publish)
        queue(conn.default_channel).delete()
    return rates


def consume_rate(url: str, n: int, groups: int | None) -> float:
    arguments = {"x-fifo-groups": True} if groups else {}
    queue = Queue(f"fifo_{uuid.uuid4().hex[:8]}", queue_arguments=arguments)
    with Connection(url) as conn:
        producer = Producer(conn)
        producer.publish(BODY, routing_key=queue.name, declare=[queue])
        for i in range(n - 1):
            headers = {"x-group-id": f"g{i % groups}"} if groups else {}
            producer.publish(BODY, routing_key=queue.name, headers=headers)
        received = 0

        def on_message(_body: Any, message: Any) -> None:
            nonlocal received
            received += 1
            message.ack()

        start = time.perf_counter()
        with Consumer(conn, [queue], callbacks=[on_message], prefetch_count=10):
            while received < n:
                conn.drain_events(timeout=10)
        rate = n / (time.perf_counter() - start)
        queue(conn.default_channel).delete()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_outbox")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ensure_database(args.url)
    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, rate in publish_cases(args.url, args.messages).items():
            samples.setdefault(name, []).append(rate)
        for label, groups in (
            ("consume, plain queue", None),
            ("consume, FIFO 100 groups", 100),
            ("consume, FIFO 10 groups", 10),
        ):
            samples.setdefault(label, []).append(consume_rate(args.url, args.messages, groups))
    print("| case | msgs/s (median) | range |")
    print("|---|---|---|")
    rows = {}
    for name, values in samples.items():
        rows[name] = {
            "median": round(statistics.median(values)),
            "runs": [round(v) for v in values],
        }
        print(f"| {name} | {rows[name]['median']:,} | {min(values):,.0f}-{max(values):,.0f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"messages": args.messages, "rounds": args.rounds}
        args.json.write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
