"""Scale: consume rate by number of consumer processes, small backlog vs 1,000,000 messages.

Usage::

    python benchmarks/scale.py [--broker NAME=URL ...] [--backlog 1000000] \
        [--consume 10000] [--consumers 1,2,4,8] [--max-seconds 30] [--json PATH]

For each broker (default: all of :mod:`brokers`) and each backlog (``--consume``
messages only, then ``--backlog`` messages), the queue is filled directly (kombu_pgmq and
kombu 5.7's pgmq: one Kombu-published row copied with ``INSERT ... SELECT`` from
``generate_series``; Redis: pipelined ``LPUSH`` of the Kombu payload; RabbitMQ: py-amqp
``basic_publish`` of the Kombu message), then for each consumer count ``k`` in
``--consumers``, ``k`` processes (Kombu ``Consumer``, prefetch 10, one ack per message)
consume ``--consume`` messages between them (or what they get in ``--max-seconds``).
Rate = messages acked / seconds from the start signal until the ``--consume``-th ack.
Each cell also records the machine's CPU busy share (``/proc/stat``) and, for PostgreSQL
brokers whose server loads ``pg_stat_statements``, the top statement by total time
(calls, mean ms, rows per call): where it bends, and why.
The small backlog is topped up to ``--consume`` before each count; the large one just
loses what was consumed (at most 4 x ``--consume`` of a million).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from kombu import Connection, Consumer, Producer, Queue

sys.path.insert(0, str(Path(__file__).resolve().parent))

import contextlib

from brokers import (
    DEFAULT_BROKERS,
    DEFAULT_OPTIONS,
    pg_dsn,
    prepare,
    reset_statement_stats,
    top_statements,
)

import kombu_pgmq  # noqa: F401  (registers postgresql://)
from kombu_pgmq._conninfo import redact

BODY = {"task": "noop", "args": [1, 2], "kwargs": {}}


# -- filling a queue fast ----------------------------------------------------------------


def _pg_table(dsn: str, queue: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as db:
        rows = db.execute(
            "SELECT queue_name FROM pgmq.meta WHERE queue_name LIKE %s", (f"%{queue}%",)
        ).fetchall()
    if len(rows) != 1:
        raise RuntimeError(f"cannot find the PGMQ table of {queue!r}: {rows}")
    return f"q_{rows[0][0]}"


def fill(url: str, options: dict[str, Any], queue: str, n: int) -> float:
    """Add ``n`` copies of one Kombu-published message to ``queue``; return seconds."""
    start = time.monotonic()
    with Connection(url, transport_options=options) as conn:
        channel = conn.channel()
        q = Queue(queue, routing_key=queue)
        q(channel).declare()
        scheme = url.split("://", 1)[0]
        if scheme in ("postgresql", "postgres", "pgmq"):
            Producer(channel).publish(BODY, routing_key=queue)
            dsn = pg_dsn(url)
            assert dsn is not None
            table = _pg_table(dsn, queue)
            with psycopg.connect(dsn, autocommit=True) as db:
                db.execute(
                    f"INSERT INTO pgmq.{table} (vt, message, headers) "
                    f"SELECT clock_timestamp(), message, headers "
                    f"FROM (SELECT message, headers FROM pgmq.{table} LIMIT 1) one, "
                    f"generate_series(1, %s)",
                    (n - 1,),
                )
                db.execute(f"ANALYZE pgmq.{table}")
        elif scheme == "redis":
            Producer(channel).publish(BODY, routing_key=queue)
            client = channel.client
            raw = client.rpop(queue)
            payload = json.loads(raw)
            tag = payload["properties"]["delivery_tag"]
            text = raw.decode() if isinstance(raw, bytes) else raw
            pipe = client.pipeline(transaction=False)
            for i in range(n):
                pipe.lpush(queue, text.replace(tag, str(uuid.uuid4())))
                if i % 10_000 == 9_999:
                    pipe.execute()
            pipe.execute()
        elif scheme in ("amqp", "pyamqp"):
            raw_channel = conn.connection.channel()
            message = raw_channel.prepare_message(
                json.dumps(BODY),
                content_type="application/json",
                content_encoding="utf-8",
                properties={"delivery_mode": 2},
            )
            for _ in range(n):
                raw_channel.basic_publish(message, exchange="", routing_key=queue)
            raw_channel.close()
        else:
            raise ValueError(f"no fast fill for {url!r}")
    return time.monotonic() - start


def delete(url: str, options: dict[str, Any], queue: str) -> None:
    with Connection(url, transport_options=options) as conn:
        channel = conn.channel()
        Queue(queue, routing_key=queue)(channel).delete()


# -- consumers -----------------------------------------------------------------------------


def consume(
    url: str,
    options: dict[str, Any],
    queue: str,
    total: int,
    max_seconds: float,
    go: Any,
    acked: Any,
    ready: Any = None,
) -> None:
    """Consume and ack until the processes together acked ``total`` (or time is up);
    ``ready`` (a shared counter, optional) is counted up once connected and declared.
    ``acked`` is counted up once per ``drain_events`` call (not per message: a lock
    shared by every consumer process, taken per message, costs futex round trips that
    grow with the number of processes and are no part of the broker)."""
    mine = 0

    def on_message(_body: object, message: Any) -> None:
        nonlocal mine
        message.ack()
        mine += 1

    with Connection(url, transport_options=options) as conn:
        consumer = Consumer(
            conn.channel(), [Queue(queue, routing_key=queue)], callbacks=[on_message]
        )
        consumer.qos(prefetch_count=10)
        if ready is not None:
            with ready.get_lock():
                ready.value += 1
        go.wait()
        consumer.consume()
        deadline = time.monotonic() + max_seconds
        while acked.value < total and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError, OSError):
                conn.drain_events(timeout=0.2)
            if mine:
                with acked.get_lock():
                    acked.value += mine
                mine = 0
        consumer.cancel()


def cpu_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def statements(url: str, reset: bool) -> dict[str, Any] | None:
    """The top statement of the cell by total time (pg_stat_statements, if the server
    loads it): where the server spends its time as consumers are added."""
    dsn = pg_dsn(url)
    if dsn is None:
        return None
    try:
        if reset:
            reset_statement_stats(dsn)
            return None
        top = top_statements(dsn, 1)
    except psycopg.Error:
        return None
    if not top:
        return None
    return {key: top[0][key] for key in ("calls", "mean_ms", "rows_per_call", "query")}


def run_consumers(
    url: str, options: dict[str, Any], queue: str, k: int, total: int, max_seconds: float
) -> dict[str, Any]:
    go = mp.Event()
    acked = mp.Value("q", 0)
    procs = [
        mp.Process(target=consume, args=(url, options, queue, total, max_seconds, go, acked))
        for _ in range(k)
    ]
    for p in procs:
        p.start()
    time.sleep(1.0 + 0.25 * k)  # connections and declarations done before the signal
    statements(url, reset=True)
    busy0, total0 = cpu_busy()
    start = time.monotonic()
    go.set()
    while acked.value < total and time.monotonic() - start < max_seconds:
        time.sleep(0.005)
    seconds = time.monotonic() - start
    count = acked.value
    busy1, total1 = cpu_busy()
    top = statements(url, reset=False)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return {
        "consumers": k,
        "acked": count,
        "seconds": round(seconds, 2),
        "per_s": round(count / seconds),
        "cpu_busy": round((busy1 - busy0) / max(1, total1 - total0), 2),
        **({"top_statement": top} if top else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", action="append", metavar="NAME=URL")
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--consume", type=int, default=10_000)
    parser.add_argument("--consumers", default="1,2,4,8")
    parser.add_argument("--max-seconds", type=float, default=30.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    brokers = dict(b.split("=", 1) for b in args.broker) if args.broker else dict(DEFAULT_BROKERS)
    counts = [int(c) for c in args.consumers.split(",")]
    results: dict[str, Any] = {}
    for name, url in brokers.items():
        options = DEFAULT_OPTIONS.get(name, {})
        entry: dict[str, Any] = {"url": redact(url), "options": options}
        results[name] = entry
        try:
            prepare(url, options)
            for label, backlog in (("small", args.consume), ("large", args.backlog)):
                queue = f"scale_{label}_{uuid.uuid4().hex[:6]}"
                runs = []
                fill_s = fill(url, options, queue, backlog)
                print(f"[{name}] {label}: filled {backlog:,} in {fill_s:.1f} s", flush=True)
                for k in counts:
                    if label == "small" and runs:
                        fill(url, options, queue, args.consume)
                    run = run_consumers(url, options, queue, k, args.consume, args.max_seconds)
                    print(f"[{name}] {label} backlog, {k} consumers: {run}", flush=True)
                    runs.append(run)
                delete(url, options, queue)
                entry[label] = {"backlog": backlog, "fill_s": round(fill_s, 1), "runs": runs}
        except Exception as exc:  # one broker failing must not hide the others
            entry["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[{name}] error: {entry['error']}", flush=True)
    print()
    print("| broker | backlog | " + " | ".join(f"{k} consumers" for k in counts) + " |")
    print("|---|---|" + "---|" * len(counts))
    for name, entry in results.items():
        for label in ("small", "large"):
            if label in entry:
                rates = " | ".join(f"{r['per_s']:,}" for r in entry[label]["runs"])
                print(f"| {name} | {entry[label]['backlog']:,} | {rates} |")
    if args.json:
        meta = {"consume": args.consume, "backlog": args.backlog, "host_cpus": os.cpu_count()}
        with open(args.json, "w") as fh:
            json.dump({**meta, "results": results}, fh, indent=2)
            fh.write("\n")


if __name__ == "__main__":
    main()
