"""Kombu Producer/Consumer throughput: publish N messages, then consume + ack them.

Usage::

    python benchmarks/kombu_throughput.py [--messages 2000] [--prefetch 10] \
        [--url postgresql://...] [--url redis://127.0.0.1:6379/0] [--json out.json]

Each URL is measured in the same run, ``--repeat`` times in turn (median reported).
Default: our transport on ``KOMBU_PGMQ_URL`` (else the embedded server) and Redis on
localhost. Prints msgs/s for publish and for consume+ack (one ack per message, as
Celery does). For PostgreSQL URLs it also measures the floor a publish stands on: a raw
``SELECT pgmq.send(...)`` loop on one psycopg connection, same payload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid

import psycopg
from kombu import Connection, Consumer, Producer, Queue

import kombu_pgmq
from kombu_pgmq.conninfo import redact


def measure(url: str, messages: int, prefetch: int, durable: bool = True) -> dict[str, float | str]:
    # durable=False: an UNLOGGED PGMQ queue with kombu_pgmq (no WAL; emptied by a crash).
    queue = Queue(f"bench_{uuid.uuid4().hex[:8]}", routing_key="bench", durable=durable)
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


def raw_send_rate(url: str, messages: int) -> float:
    """msgs/s of a plain ``SELECT pgmq.send`` loop (autocommit, one connection)."""
    from kombu_pgmq.conninfo import make_dsn, url_to_params

    body = json.dumps({"task": "noop", "args": [1, 2], "kwargs": {}, "id": str(uuid.uuid4())})
    with psycopg.connect(make_dsn(url_to_params(url)), autocommit=True) as conn:
        conn.execute("SELECT pgmq.create('bench_raw')")
        start = time.perf_counter()
        for _ in range(messages):
            conn.execute("SELECT pgmq.send('bench_raw', %s::jsonb)", (body,))
        rate = messages / (time.perf_counter() - start)
        conn.execute("SELECT pgmq.drop_queue('bench_raw')")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--prefetch", type=int, default=10)
    parser.add_argument("--url", action="append")
    parser.add_argument("--repeat", type=int, default=3, help="runs per broker (median)")
    parser.add_argument(
        "--transient",
        action="store_true",
        help="also measure non-durable queues (UNLOGGED tables with kombu_pgmq)",
    )
    parser.add_argument("--json", help="write results to this file")
    args = parser.parse_args()
    urls = args.url or [kombu_pgmq.default_broker_url(), "redis://127.0.0.1:6379/0"]
    cases = [(url, True) for url in urls]
    if args.transient:
        cases += [(url, False) for url in urls if url.startswith("postgres")]
    runs: dict[tuple[str, bool], list[dict[str, float | str]]] = {case: [] for case in cases}
    raw: dict[str, list[float]] = {url: [] for url in urls if url.startswith("postgres")}
    for _ in range(args.repeat):
        for url, durable in cases:
            runs[url, durable].append(measure(url, args.messages, args.prefetch, durable))
            if url in raw and durable:
                raw[url].append(raw_send_rate(url, args.messages))
    results = []
    for case in cases:
        url, durable = case
        row: dict[str, object] = {
            "url": redact(url) + ("" if durable else " (non-durable: UNLOGGED)"),
            "durable": durable,
            "publish_per_s": statistics.median(float(r["publish_per_s"]) for r in runs[case]),
            "consume_ack_per_s": statistics.median(
                float(r["consume_ack_per_s"]) for r in runs[case]
            ),
            "runs": runs[case],
        }
        if url in raw and durable:
            row["raw_pgmq_send_per_s"] = round(statistics.median(raw[url]))
        results.append(row)
    print(f"{'broker':72} {'publish/s':>10} {'consume+ack/s':>14} {'raw pgmq.send/s':>16}")
    for r in results:
        print(
            f"{r['url']!s:72} {r['publish_per_s']:>10.0f} {r['consume_ack_per_s']:>14.0f} "
            f"{r.get('raw_pgmq_send_per_s', '-')!s:>16}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            meta = {"messages": args.messages, "prefetch": args.prefetch, "repeat": args.repeat}
            json.dump({**meta, "host_cpus": os.cpu_count(), "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
