"""Concurrent producers: total Kombu publish rate with 1, 4, 16 publishing processes.

Usage::

    python benchmarks/producers.py [--broker NAME=URL ...] [--producers 1,4,16]
        [--seconds 5] [--rounds 3] [--async-commit] [--json PATH]

Default brokers: kombu_pgmq, Redis and RabbitMQ of :mod:`brokers` (kombu 5.7's ``pgmq``
with ``--broker``). For each round, broker and producer count ``k`` (brokers and counts
interleaved), ``k`` processes each open their own Kombu connection, declare the queue,
wait for a shared start signal, then call ``Producer.publish`` with a small JSON body
for ``--seconds`` seconds. Rate = messages published by all / the longest producer's
publishing time. The queue is purged before each cell. Median (min-max) over
``--rounds``. ``--async-commit`` adds kombu_pgmq with ``synchronous_commit=off``
publishes (``connection_options``): a server crash may lose the last ~600 ms of them.

kombu_pgmq publishes commit with fsync: concurrent commits share WAL flushes
(PostgreSQL's group commit), so the total should rise with producers; RabbitMQ publishes
without confirms (kombu's default) and Redis keeps nothing on disk here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import DEFAULT_BROKERS, DEFAULT_OPTIONS, git_describe, prepare
from kombu import Connection, Producer, Queue

import kombu_pgmq  # noqa: F401  (registers postgresql://)
from kombu_pgmq._conninfo import redact

QUEUE = "bench_producers"
BODY = {"task": "noop", "args": [1, 2], "kwargs": {}}


def _producer(
    url: str, options: dict[str, Any], seconds: float, start: Any, out: Any, ready: Any
) -> None:
    queue = Queue(QUEUE, routing_key=QUEUE)
    with Connection(url, transport_options=options) as conn:
        channel = conn.channel()
        queue(channel).declare()
        producer = Producer(channel)
        producer.publish(BODY, routing_key=QUEUE)  # connected and warm
        ready.release()
        start.wait()
        n = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        while True:
            producer.publish(BODY, routing_key=QUEUE)
            n += 1
            if n % 16 == 0 and time.perf_counter() >= deadline:
                break
        out.put((n, time.perf_counter() - t0))


def purge(url: str, options: dict[str, Any]) -> None:
    with Connection(url, transport_options=options) as conn:
        channel = conn.channel()
        queue = Queue(QUEUE, routing_key=QUEUE)(channel)
        queue.declare()
        queue.purge()


def cell(url: str, options: dict[str, Any], producers: int, seconds: float) -> float:
    purge(url, options)
    ctx = mp.get_context("spawn")
    start, ready, out = ctx.Event(), ctx.Semaphore(0), ctx.Queue()
    procs = [
        ctx.Process(target=_producer, args=(url, options, seconds, start, out, ready))
        for _ in range(producers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=120):
            raise RuntimeError("a producer did not get ready in 120 s")
    start.set()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    total = sum(n for n, _ in results)
    return total / max(s for _, s in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--broker", action="append", metavar="NAME=URL")
    parser.add_argument("--producers", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--async-commit", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.broker:
        brokers = dict(b.split("=", 1) for b in args.broker)
    else:
        brokers = {k: v for k, v in DEFAULT_BROKERS.items() if k != "kombu57_pgmq"}
    cases: dict[str, tuple[str, dict[str, Any]]] = {
        name: (url, DEFAULT_OPTIONS.get(name, {})) for name, url in brokers.items()
    }
    if args.async_commit and "kombu_pgmq" in brokers:
        cases["kombu_pgmq async-commit"] = (
            brokers["kombu_pgmq"],
            {"connection_options": {"options": "-c synchronous_commit=off"}},
        )
    counts = [int(c) for c in args.producers.split(",")]
    for url, options in cases.values():
        prepare(url, options)
    rates: dict[str, dict[int, list[float]]] = {n: {k: [] for k in counts} for n in cases}
    errors: dict[str, str] = {}
    for r in range(args.rounds):
        for name, (url, options) in cases.items():
            for k in counts:
                if name in errors:
                    continue
                print(f"round {r + 1}: {name}, {k} producers", file=sys.stderr, flush=True)
                try:
                    rates[name][k].append(cell(url, options, k, args.seconds))
                except Exception as exc:  # one broker failing must not hide the others
                    errors[name] = f"{type(exc).__name__}: {exc}"
    header = "| broker | " + " | ".join(f"{k} producers msgs/s" for k in counts) + " |"
    print(header)
    print("|---" * (len(counts) + 1) + "|")
    summary: dict[str, Any] = {}
    for name, by_count in rates.items():
        if name in errors:
            print(f"| {name} | error: {errors[name]} |")
            continue
        row = {}
        for k, values in by_count.items():
            row[k] = {
                "median": round(statistics.median(values)),
                "min": round(min(values)),
                "max": round(max(values)),
                "rounds": [round(v) for v in values],
            }
        summary[name] = row
        cells = " | ".join(
            f"{row[k]['median']:,} ({row[k]['min']:,}-{row[k]['max']:,})" for k in counts
        )
        print(f"| {name} | {cells} |")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "benchmark": "producers",
                    "git": git_describe(),
                    "seconds": args.seconds,
                    "rounds": args.rounds,
                    "brokers": {n: redact(u) for n, (u, _) in cases.items()},
                    "results": summary,
                    "errors": errors,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
