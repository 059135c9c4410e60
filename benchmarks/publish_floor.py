"""What one durable publish costs, piece by piece: the floor under Kombu publish.

Usage::

    python benchmarks/publish_floor.py [--url postgresql://...] [--messages 2000]
        [--rounds 5] [--json PATH]

One process, one connection each, autocommit, the same small JSON body; rounds
interleave the cases so drifts of the machine hit all alike (median and range, msgs/s):

* ``select 1``: a round trip that writes nothing (no WAL flush at commit);
* ``raw pgmq.send``: ``SELECT pgmq.send(queue, body)`` (the issue's floor);
* ``raw INSERT``: the row ``pgmq.send`` writes, as a prepared ``INSERT`` into the same
  queue table: a round trip plus the commit's WAL flush, nothing else;
* ``kombu_pgmq publish``: Kombu ``Producer.publish`` on this transport;
* the last three again with ``synchronous_commit = off`` (no WAL flush wait).

With fsync on, every commit of one producer waits for its own WAL flush: nothing a
single producer does can go below ``raw INSERT``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from kombu import Connection, Producer, Queue

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import ensure_database, git_describe, pg_dsn

import kombu_pgmq  # noqa: F401  (registers postgresql://)

BODY = {"task": "noop", "args": [1, 2], "kwargs": {}}
QUEUE = "bench_floor"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_ours")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dsn = pg_dsn(args.url)
    assert dsn is not None, "a postgresql:// URL"
    ensure_database(dsn)
    body = json.dumps(BODY)
    n = args.messages
    cases: dict[str, Callable[[], None]] = {}
    conns = {}
    kombu_conns = {}
    for mode, options in (("durable", ""), ("async commit", "-c synchronous_commit=off")):
        conn = psycopg.connect(dsn, autocommit=True, options=options or None)
        conns[mode] = conn
        kombu_conn = Connection(
            args.url, transport_options={"connection_options": {"options": options}}
        )
        channel = kombu_conn.channel()
        Queue(QUEUE, routing_key=QUEUE)(channel).declare()
        producer = Producer(channel)
        kombu_conns[mode] = kombu_conn

        def select1(conn: psycopg.Connection = conn) -> None:
            for _ in range(n):
                conn.execute("SELECT 1")

        def raw_send(conn: psycopg.Connection = conn) -> None:
            for _ in range(n):
                conn.execute("SELECT pgmq.send(%s, %s::jsonb)", (QUEUE, body))

        def raw_insert(conn: psycopg.Connection = conn) -> None:
            for _ in range(n):
                conn.execute(
                    f"INSERT INTO pgmq.q_{QUEUE} (vt, message) VALUES (clock_timestamp(), %s)",
                    (body,),
                )

        def publish(producer: Producer = producer) -> None:
            for _ in range(n):
                producer.publish(BODY, routing_key=QUEUE)

        if mode == "durable":
            cases["select 1"] = select1
        suffix = "" if mode == "durable" else f" ({mode})"
        cases[f"raw pgmq.send{suffix}"] = raw_send
        cases[f"raw INSERT{suffix}"] = raw_insert
        cases[f"kombu_pgmq publish{suffix}"] = publish
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for name, run in cases.items():
            t0 = time.perf_counter()
            run()
            rates[name].append(n / (time.perf_counter() - t0))
        conns["durable"].execute("SELECT pgmq.purge_queue(%s)", (QUEUE,))
    summary = {
        name: {
            "median": round(statistics.median(v)),
            "min": round(min(v)),
            "max": round(max(v)),
            "us_per_message": round(1e6 / statistics.median(v)),
        }
        for name, v in rates.items()
    }
    print("| case | msgs/s median (range) | µs per message |")
    print("|---|---|---|")
    for name, row in summary.items():
        print(
            f"| {name} | {row['median']:,} ({row['min']:,}-{row['max']:,}) | "
            f"{row['us_per_message']:,} |"
        )
    for conn in conns.values():
        conn.close()
    for kombu_conn in kombu_conns.values():
        kombu_conn.release()
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "benchmark": "publish_floor",
                    "git": git_describe(),
                    "messages": n,
                    "rounds": args.rounds,
                    "results": summary,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
