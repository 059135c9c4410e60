"""What a Prometheus scrape costs with many queues (issue 16): ``kombu-pgmq metrics
serve``'s one statement (``kombu_pgmq.queue_stats()``) and a whole HTTP scrape.

Usage::

    python benchmarks/metrics_scrape.py [--url URL] [--queues 1000] [--messages 10] \
        [--scrapes 20] [--json benchmarks/results/metrics_scrape.json]

Declares ``--queues`` Kombu queues (``bench_metrics_<i>``), each with ``--messages``
ready messages and as many archived, then times ``--scrapes`` scrapes of an exporter
serving the database (HTTP GET /metrics, parse nothing) and as many calls of the
statement alone. Reports median, p90 and max in ms, the exposition size and the number of
samples. The database is created if missing and left in place (drop it by hand).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import ensure_database

import kombu_pgmq  # noqa: F401
from kombu_pgmq import schema
from kombu_pgmq.management import Management
from kombu_pgmq.metrics import serve

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/kombu_pgmq_bench_metrics"


def prepare(url: str, queues: int, messages: int) -> None:
    schema.bootstrap(url)
    with psycopg.connect(url, autocommit=True) as conn:
        have = conn.execute(
            "SELECT count(*) FROM kombu_pgmq.queues WHERE queue LIKE 'bench_metrics_%'"
        ).fetchone()[0]
        for i in range(have, queues):
            name = f"bench_metrics_{i}"
            with conn.transaction():
                conn.execute(
                    "SELECT kombu_pgmq.declare_queue(%s, %s, true, false, NULL, NULL, NULL, "
                    "NULL, NULL, false, false)",
                    (name, name),
                )
                for _ in range(messages * 2):
                    conn.execute(
                        "SELECT pgmq.send(%s, %s::jsonb, %s::jsonb)",
                        (name, '{"n": 1}', '{"task": "bench.noop"}'),
                    )
                conn.execute(
                    "SELECT pgmq.archive(%s, msg_id) FROM pgmq.read(%s, 0, %s)",
                    (name, name, messages),
                )
            if i % 100 == 99:
                print(f"  declared {i + 1} queues", flush=True)
        conn.execute("ANALYZE")


def timings(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_ms": round(statistics.median(ordered) * 1000, 1),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--queues", type=int, default=1000)
    parser.add_argument("--messages", type=int, default=10)
    parser.add_argument("--scrapes", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    ensure_database(args.url)
    prepare(args.url, args.queues, args.messages)

    statement = []
    with Management(args.url) as management:
        management.queues()  # warm: connection, plans, catalog caches
        for _ in range(args.scrapes):
            started = time.perf_counter()
            stats = management.queues()
            statement.append(time.perf_counter() - started)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, _thread, _registry = serve(args.url, port=port, addr="127.0.0.1")
    scrape, size = [], 0
    try:
        for i in range(args.scrapes + 1):
            started = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
                body = r.read()
            if i:  # the first one connects
                scrape.append(time.perf_counter() - started)
            size = len(body)
    finally:
        server.shutdown()
    samples = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    result = {
        "queues": len(stats),
        "messages_per_queue": args.messages,
        "statement": timings(statement),
        "http_scrape": timings(scrape),
        "exposition_bytes": size,
        "samples": samples,
        "scrapes": args.scrapes,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
