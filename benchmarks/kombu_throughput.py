"""Kombu Producer/Consumer throughput: publish N messages, then consume + ack them.

Usage::

    python benchmarks/kombu_throughput.py [--messages 2000] [--prefetch 10] [--repeat 5] \
        [--broker NAME=URL ...] [--exchange] [--durability-modes] [--json out.json]

Brokers (default: all of :mod:`brokers`: kombu_pgmq, redis, rabbitmq, kombu57_pgmq) are
measured in the same run, ``--repeat`` times in turn (median reported). Prints msgs/s
for publish and for consume+ack (one ack per message, as Celery does). For kombu_pgmq it
also measures the floor a publish stands on: a raw ``SELECT pgmq.send(...)`` loop on one
psycopg connection, same payload.

``--exchange`` also measures publishes through a direct exchange named ``celery`` (what
Kombu's ``Producer(exchange=Exchange("celery"))`` and Celery with an explicit exchange
send; each round, before the default-exchange publishes): column ``publish_exchange_per_s``
and its ratio to the default exchange's.

``--second-channel`` also measures default-exchange publishes on a second channel of the
same connection, one that did not declare the queue (kombu's ``maybe_declare`` declares a
queue once per connection: Celery's producer pool and any application with more than one
channel publish this way): column ``publish_second_channel_per_s``.

``--durability-modes`` adds kombu_pgmq variants: ``durable_acks=True``; publishes with
``synchronous_commit=off`` (libpq ``options``); a non-durable queue (UNLOGGED tables).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from kombu import Connection, Consumer, Exchange, Producer, Queue

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import DEFAULT_BROKERS, DEFAULT_OPTIONS, pg_dsn, prepare

import kombu_pgmq  # noqa: F401  (registers postgresql://)
from kombu_pgmq._conninfo import redact

MODES: dict[str, tuple[dict[str, Any], bool]] = {
    # name: (transport options, durable queue)
    "durable_acks": ({"durable_acks": True}, True),
    "async_commit": ({"connection_options": {"options": "-c synchronous_commit=off"}}, True),
    "unlogged_queue": ({}, False),
}


#: --exchange: also publish through this direct exchange (Celery's default exchange name).
EXCHANGE = False
SECOND_CHANNEL = False


def measure(
    url: str, options: dict[str, Any], messages: int, prefetch: int, durable: bool = True
) -> dict[str, float | str]:
    # durable=False: an UNLOGGED PGMQ queue with kombu_pgmq (no WAL; emptied by a crash).
    name = f"bench_{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange("celery", type="direct"), routing_key=name, durable=durable)
    body = {"task": "noop", "args": [1, 2], "kwargs": {}, "id": str(uuid.uuid4())}
    extra: dict[str, float | str] = {}
    with Connection(url, transport_options=options) as conn:
        channel = conn.channel()
        producer = Producer(channel)
        queue(channel).declare()
        channel.queue_purge(queue.name)
        if EXCHANGE:
            try:
                routed = Producer(channel, exchange=queue.exchange)
                start = time.perf_counter()
                for _ in range(messages):
                    routed.publish(body, routing_key=queue.name)
                extra["publish_exchange_per_s"] = round(messages / (time.perf_counter() - start))
            except Exception as exc:  # a transport without exchanges: say so, go on
                extra["publish_exchange_error"] = f"{type(exc).__name__}: {exc}"
            channel.queue_purge(queue.name)
        if SECOND_CHANNEL:
            with conn.channel() as second:
                other = Producer(second)
                start = time.perf_counter()
                for _ in range(messages):
                    other.publish(body, routing_key=queue.name)
                rate = messages / (time.perf_counter() - start)
                extra["publish_second_channel_per_s"] = round(rate)
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
        **extra,
    }


def raw_send_rate(url: str, messages: int) -> float:
    """msgs/s of a plain ``SELECT pgmq.send`` loop (autocommit, one connection)."""
    body = json.dumps({"task": "noop", "args": [1, 2], "kwargs": {}, "id": str(uuid.uuid4())})
    with psycopg.connect(pg_dsn(url) or url, autocommit=True) as conn:
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
    parser.add_argument("--broker", action="append", metavar="NAME=URL")
    parser.add_argument("--repeat", type=int, default=3, help="runs per broker (median)")
    parser.add_argument("--exchange", action="store_true", help="also through exchange celery")
    parser.add_argument(
        "--second-channel", action="store_true", help="also on a channel that did not declare"
    )
    parser.add_argument("--durability-modes", action="store_true")
    parser.add_argument("--json", help="write results to this file")
    args = parser.parse_args()
    global EXCHANGE, SECOND_CHANNEL
    EXCHANGE = args.exchange
    SECOND_CHANNEL = args.second_channel
    brokers = dict(b.split("=", 1) for b in args.broker) if args.broker else dict(DEFAULT_BROKERS)
    # case name -> (url, transport options, durable queue)
    cases: dict[str, tuple[str, dict[str, Any], bool]] = {
        name: (url, DEFAULT_OPTIONS.get(name, {}), True) for name, url in brokers.items()
    }
    if args.durability_modes and "kombu_pgmq" in brokers:
        for mode, (options, durable) in MODES.items():
            cases[f"kombu_pgmq {mode}"] = (brokers["kombu_pgmq"], options, durable)
    for url, options, _ in cases.values():
        prepare(url, options)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    errors: dict[str, str] = {}
    raw: list[float] = []
    for _ in range(args.repeat):
        for name, (url, options, durable) in cases.items():
            if name in errors:
                continue
            try:
                runs[name].append(measure(url, options, args.messages, args.prefetch, durable))
            except Exception as exc:  # one broker failing must not hide the others
                errors[name] = f"{type(exc).__name__}: {exc}"
            if name == "kombu_pgmq":
                raw.append(raw_send_rate(url, args.messages))
    results = []
    for name, (url, options, durable) in cases.items():
        row: dict[str, Any] = {"broker": name, "url": redact(url), "options": options}
        row["durable_queue"] = durable
        if runs[name]:
            row["publish_per_s"] = statistics.median(r["publish_per_s"] for r in runs[name])
            row["consume_ack_per_s"] = statistics.median(r["consume_ack_per_s"] for r in runs[name])
            routed = [
                r["publish_exchange_per_s"] for r in runs[name] if "publish_exchange_per_s" in r
            ]
            if routed:
                row["publish_exchange_per_s"] = statistics.median(routed)
                row["exchange_to_default"] = round(
                    statistics.median(
                        r["publish_exchange_per_s"] / r["publish_per_s"]
                        for r in runs[name]
                        if "publish_exchange_per_s" in r
                    ),
                    3,
                )
            second = [
                r["publish_second_channel_per_s"]
                for r in runs[name]
                if "publish_second_channel_per_s" in r
            ]
            if second:
                row["publish_second_channel_per_s"] = statistics.median(second)
            row["runs"] = runs[name]
        if name in errors:
            row["error"] = errors[name]
        if name == "kombu_pgmq" and raw:
            row["raw_pgmq_send_per_s"] = round(statistics.median(raw))
        results.append(row)
    print(
        f"{'broker':30} {'publish/s':>10} {'consume+ack/s':>14} {'raw pgmq.send/s':>16}"
        f" {'exchange publish/s':>19} {'ratio':>6} {'2nd channel publish/s':>22}"
    )
    for r in results:
        if "error" in r:
            print(f"{r['broker']:30} error: {r['error']}")
            continue
        print(
            f"{r['broker']:30} {r['publish_per_s']:>10.0f} {r['consume_ack_per_s']:>14.0f} "
            f"{r.get('raw_pgmq_send_per_s', '-')!s:>16} "
            f"{r.get('publish_exchange_per_s', '-')!s:>19} {r.get('exchange_to_default', '-')!s:>6}"
            f" {r.get('publish_second_channel_per_s', '-')!s:>22}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            meta = {
                "messages": args.messages,
                "prefetch": args.prefetch,
                "repeat": args.repeat,
                "exchange": args.exchange,
                "second_channel": args.second_channel,
            }
            json.dump({**meta, "host_cpus": os.cpu_count(), "results": results}, fh, indent=2)
            fh.write("\n")


if __name__ == "__main__":
    main()
