"""Where a message's latency goes (issue 30, item 4): publish -> consumer callback, in parts.

Usage::

    python benchmarks/latency_breakdown.py [--broker NAME=URL ...] [--messages 300]
        [--interval-ms 20] [--rounds 2] [--json PATH]

A consumer subprocess (Kombu ``Consumer``, ``drain_events``, prefetch 10, ack each) waits
on one queue; this process publishes ``--messages`` messages ``--interval-ms`` apart, each
carrying its send time. Per message (p50 / p99 over the pooled rounds, ms):

* ``publish``: ``Producer.publish`` returned (for kombu_pgmq: the commit, WAL flushed);
* ``total``: publish start -> consumer callback;
* kombu_pgmq only, from timestamps taken inside the consumer (the transport's methods
  wrapped in the subprocess, nothing changed in the library): ``publish->wake`` (the
  NOTIFY read from the LISTEN connection), ``wake->callback``; when the consumer reads
  after the wake-up (no hand-off): ``wake->read`` (the read sent), ``read`` (the read's
  round trip), ``read->callback``.

Brokers: ``kombu_pgmq`` (default ``postgresql://postgres@127.0.0.1:5432/kpb_latency``;
the message handed off in the wake-up), the same with publishes seen only once flushed
(``kombu_pgmq strict``: the publisher's ``visible_before_flush=False``), the same with
``synchronous_commit=off`` publishes (``kombu_pgmq async``), and ``redis``.
It also measures one round trip (``SELECT 1``) on a connection used back to back and on
one idle for ``--interval-ms`` before each statement: what the read after a wake-up costs
when the server process serving it was asleep.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import ensure_database, pg_dsn

QUEUE = "latency_breakdown"
ASYNC = {"connection_options": {"options": "-c synchronous_commit=off"}}
STEPS = [
    ("t0", "wake", "publish->wake"),
    ("wake", "cb", "wake->callback"),
    ("wake", "read0", "wake->read"),
    ("read0", "read1", "read"),
    ("read1", "cb", "read->callback"),
]


def _consumer(url: str, n: int, ready: Any, out: Any, options: dict[str, Any]) -> None:
    from kombu import Connection, Consumer, Queue

    import kombu_pgmq  # noqa: F401

    marks: dict[str, float] = {}
    if pg_dsn(url):
        from kombu_pgmq._db import broker
        from kombu_pgmq.transport import _listener

        collect = _listener.Listener.collect
        read = broker.Broker._read_queue_settled

        def timed_collect(self: Any) -> Any:
            marks["wake"] = time.time()
            marks.pop("read0", None)  # a read before this wake-up is not this message's
            marks.pop("read1", None)
            return collect(self)

        def timed_read(self: Any, *args: Any, **kwargs: Any) -> Any:
            marks["read0"] = time.time()
            result = read(self, *args, **kwargs)
            marks["read1"] = time.time()
            return result

        _listener.Listener.collect = timed_collect  # type: ignore[method-assign]
        broker.Broker._read_queue_settled = timed_read  # type: ignore[method-assign]
    rows: list[tuple[float, float, dict[str, float]]] = []
    queue = Queue(QUEUE, routing_key=QUEUE)
    with Connection(url, transport_options=options) as conn:
        channel = conn.channel()
        queue(channel).declare()
        channel.queue_purge(QUEUE)

        def on_message(body: Any, message: Any) -> None:
            rows.append((body["t0"], time.time(), dict(marks)))
            message.ack()
            marks.clear()

        with Consumer(channel, [queue], callbacks=[on_message], prefetch_count=10):
            ready.set()
            while len(rows) < n:
                try:
                    conn.drain_events(timeout=1)
                except TimeoutError:
                    marks.clear()
    out.put(rows)


def run(
    url: str, options: dict[str, Any], n: int, interval: float, consumer: dict[str, Any]
) -> dict[str, list[float]]:
    from kombu import Connection, Producer, Queue

    import kombu_pgmq  # noqa: F401

    warm = 5
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_consumer, args=(url, n + warm, ready, out, consumer))
    child.start()
    ready.wait(60)
    time.sleep(0.5)
    publish: list[float] = []
    with Connection(url, transport_options=options) as conn:
        producer = Producer(conn.channel())
        # declared on the publishing channel, as Celery's producer does: kombu_pgmq then
        # knows the queue deduplicates nothing and takes its direct publish (send_queue)
        Queue(QUEUE, routing_key=QUEUE)(producer.channel).declare()
        for i in range(n + warm):
            t0 = time.time()
            producer.publish({"t0": t0, "i": i}, routing_key=QUEUE)
            if i >= warm:
                publish.append(time.time() - t0)
            time.sleep(interval)
    rows = out.get(timeout=120)[warm:]
    child.join(30)
    parts: dict[str, list[float]] = {"publish": publish, "total": [cb - t0 for t0, cb, _ in rows]}
    for start, end, label in STEPS:
        for t0, cb, marks in rows:
            at = {**marks, "t0": t0, "cb": cb}
            if start in at and end in at:
                parts.setdefault(label, []).append(at[end] - at[start])
    return parts


def round_trips(url: str, n: int, interval: float) -> dict[str, list[float]]:
    import psycopg

    times: dict[str, list[float]] = {"SELECT 1, back to back": [], "SELECT 1, after idle": []}
    with psycopg.connect(url, autocommit=True) as conn:
        for label, pause in (("SELECT 1, back to back", 0.0), ("SELECT 1, after idle", interval)):
            for _ in range(n):
                if pause:
                    time.sleep(pause)
                start = time.perf_counter()
                conn.execute("SELECT 1", prepare=True)
                times[label].append(time.perf_counter() - start)
    return times


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[int(q * (len(ordered) - 1))] * 1000, 3) if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--broker", action="append", metavar="NAME=URL")
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2, help="rounds, brokers interleaved")
    parser.add_argument("--json", help="write results as JSON here")
    args = parser.parse_args()
    if args.broker:
        brokers = dict(b.split("=", 1) for b in args.broker)
    else:
        brokers = {
            "kombu_pgmq": "postgresql://postgres@127.0.0.1:5432/kpb_latency",
            "redis": "redis://127.0.0.1:6379/0",
        }
    # name -> (url, publisher's transport options, consumer's)
    cases: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {}
    for name, url in brokers.items():
        cases[name] = (url, {}, {})
        if pg_dsn(url):
            ensure_database(pg_dsn(url) or url)
            # nothing visible before the publish's WAL flush
            cases[f"{name} strict"] = (url, {"visible_before_flush": False}, {})
            cases[f"{name} async"] = (url, ASYNC, {})
    interval = args.interval_ms / 1000
    pooled: dict[str, dict[str, list[float]]] = {name: {} for name in cases}
    for _ in range(args.rounds):
        for name, (url, options, consumer) in cases.items():
            for part, values in run(url, options, args.messages, interval, consumer).items():
                pooled[name].setdefault(part, []).extend(values)
            dsn = pg_dsn(url)
            if dsn and not options and not consumer:
                for part, values in round_trips(dsn, 200, interval).items():
                    pooled[name].setdefault(part, []).extend(values)
    results = {
        name: {
            part: {"p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99), "n": len(v)}
            for part, v in parts.items()
        }
        for name, parts in pooled.items()
    }
    for name, parts in results.items():
        print(name)
        for part, stats in parts.items():
            print(f"  {part:24} p50 {stats['p50_ms']:7.3f}  p99 {stats['p99_ms']:7.3f} ms")
    if args.json:
        meta = {"messages": args.messages, "interval_ms": args.interval_ms, "rounds": args.rounds}
        Path(args.json).write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
