"""Kombu Producer/Consumer throughput: publish N messages, then consume + ack them.

Usage::

    python benchmarks/kombu_throughput.py [--messages 2000] [--prefetch 10] \
        [--url postgresql://...] [--url redis://127.0.0.1:6379/0] [--json out.json]

Each URL is measured in the same run (its queue is purged first). Default: our
transport on ``KOMBU_PGMQ_URL`` (else the embedded server) and Redis on localhost.
Prints msgs/s for publish and for consume+ack (one ack per message, as Celery does).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid

from kombu import Connection, Consumer, Producer, Queue

import kombu_pgmq
from kombu_pgmq.conninfo import redact


def measure(url: str, messages: int, prefetch: int) -> dict[str, float | str]:
    queue = Queue(f"bench_{uuid.uuid4().hex[:8]}", routing_key="bench")
    body = {"task": "noop", "args": [1, 2], "kwargs": {}, "id": str(uuid.uuid4())}
    with Connection(url) as conn:
        channel = conn.channel()
        producer = Producer(channel)
        queue(channel).declare()
        channel.queue_purge(queue.name)
        start = time.perf_counter()
        for _ in range(messages):
            producer.publish(body, routing_key=queue.name)
        publish_rate = messages / (time.perf_counter() - start)

        received = 0

        def on_message(_body: object, message: object) -> None:
            nonlocal received
            received += 1
            message.ack()  # type: ignore[attr-defined]

        start = time.perf_counter()
        with Consumer(channel, [queue], callbacks=[on_message], prefetch_count=prefetch):
            while received < messages:
                conn.drain_events(timeout=10)
        consume_rate = messages / (time.perf_counter() - start)
        queue(channel).delete()
    return {
        "url": redact(url),
        "publish_per_s": round(publish_rate),
        "consume_ack_per_s": round(consume_rate),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--prefetch", type=int, default=10)
    parser.add_argument("--url", action="append")
    parser.add_argument("--json", help="write results to this file")
    args = parser.parse_args()
    urls = args.url or [kombu_pgmq.default_broker_url(), "redis://127.0.0.1:6379/0"]
    results = [measure(url, args.messages, args.prefetch) for url in urls]
    print(f"{'broker':60} {'publish/s':>10} {'consume+ack/s':>14}")
    for r in results:
        print(f"{r['url']:60} {r['publish_per_s']:>10} {r['consume_ack_per_s']:>14}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "messages": args.messages,
                    "prefetch": args.prefetch,
                    "host_cpus": os.cpu_count(),
                    "results": results,
                },
                fh,
                indent=2,
            )


if __name__ == "__main__":
    main()
