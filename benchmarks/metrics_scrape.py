"""What a Prometheus scrape costs with many queues (issues 16 and 25): ``kombu-pgmq
metrics serve``'s one statement (``kombu_pgmq.queue_stats()``), a whole HTTP scrape
without the snapshot cache and with it, and simultaneous scrapers.

Usage::

    python benchmarks/metrics_scrape.py [--url URL] [--queues 1000] [--messages 10] \
        [--scrapes 20] [--scrapers 8] [--json benchmarks/results/metrics_scrape.json]

Declares ``--queues`` Kombu queues (``bench_metrics_<i>``), each with ``--messages``
ready messages and as many archived, then times ``--scrapes`` calls of the statement
alone, as many scrapes (HTTP GET /metrics, parse nothing) of an exporter without cache
(``cache_seconds=0``: one statement each) and of one with the default cache (the scrapes
after the first within its window), and ``--scrapers`` simultaneous scrapes without
cache, ``--scrapes`` times (their wall time, and how many statements they ran: distinct
``kombu_pgmq_scrape_duration_seconds`` values). Reports median, p90 and max in ms, the
exposition size and the number of samples. The database is created if missing and left
in place (drop it by hand).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import ensure_database

import kombu_pgmq  # noqa: F401
from kombu_pgmq import schema
from kombu_pgmq.management import Management
from kombu_pgmq.metrics import DEFAULT_CACHE_SECONDS, serve

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        return bytes(r.read())


def time_scrapes(url: str, scrapes: int, *, cache_seconds: float) -> tuple[list[float], int, bytes]:
    """``scrapes`` timed scrapes after a first one (it connects and reads): with the
    default cache they all fall within its window (the script checks)."""
    port = _free_port()
    server, _thread, _registry = serve(url, port=port, cache_seconds=cache_seconds)
    times: list[float] = []
    try:
        body = _get(port)
        first = time.monotonic()
        for _ in range(scrapes):
            started = time.perf_counter()
            body = _get(port)
            times.append(time.perf_counter() - started)
        if cache_seconds:
            assert time.monotonic() - first < cache_seconds, "scrapes outlasted the cache"
    finally:
        server.shutdown()
        server.server_close()
    return times, len(body), body


def time_scrapers(url: str, rounds: int, scrapers: int) -> tuple[list[float], float]:
    """``rounds`` times ``scrapers`` simultaneous scrapes without cache: the wall time of
    each round, and the mean number of statistics reads (distinct
    kombu_pgmq_scrape_duration_seconds values) per round."""
    port = _free_port()
    server, _thread, _registry = serve(url, port=port, cache_seconds=0)
    walls: list[float] = []
    reads = 0
    try:
        _get(port)
        for _ in range(rounds):
            barrier = threading.Barrier(scrapers + 1)
            bodies: list[bytes] = []

            def scrape(barrier: threading.Barrier, bodies: list[bytes]) -> None:
                barrier.wait()
                bodies.append(_get(port))

            threads = [
                threading.Thread(target=scrape, args=(barrier, bodies)) for _ in range(scrapers)
            ]
            for t in threads:
                t.start()
            barrier.wait()
            started = time.perf_counter()
            for t in threads:
                t.join()
            walls.append(time.perf_counter() - started)
            reads += len({_duration(b) for b in bodies})
    finally:
        server.shutdown()
        server.server_close()
    return walls, reads / rounds


def _duration(body: bytes) -> str:
    for line in body.decode().splitlines():
        if line.startswith("kombu_pgmq_scrape_duration_seconds "):
            return line
    raise AssertionError("no kombu_pgmq_scrape_duration_seconds in the exposition")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--queues", type=int, default=1000)
    parser.add_argument("--messages", type=int, default=10)
    parser.add_argument("--scrapes", type=int, default=20)
    parser.add_argument("--scrapers", type=int, default=8)
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
    scrape, size, body = time_scrapes(args.url, args.scrapes, cache_seconds=0)
    cached, _, _ = time_scrapes(args.url, args.scrapes, cache_seconds=DEFAULT_CACHE_SECONDS)
    together, reads = time_scrapers(args.url, args.scrapes, args.scrapers)
    samples = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    result = {
        "queues": len(stats),
        "messages_per_queue": args.messages,
        "statement": timings(statement),
        "http_scrape": timings(scrape),
        "http_scrape_cached": timings(cached),
        "cache_seconds": DEFAULT_CACHE_SECONDS,
        "simultaneous_scrapers": args.scrapers,
        "simultaneous_scrapes_wall": timings(together),
        "simultaneous_scrapes_statements": reads,
        "exposition_bytes": size,
        "samples": samples,
        "scrapes": args.scrapes,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
