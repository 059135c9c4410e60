"""Sustained churn: publish and consume continuously, watch throughput and dead tuples.

Usage::

    python benchmarks/churn.py --url postgresql://postgres@127.0.0.1/kpb_churn \
        --minutes 10 --vacuum-threshold 20000 --json benchmarks/results/churn_vacuum.json

One producer process publishes as fast as it can (Kombu ``Producer.publish``), two
consumer processes consume with prefetch 10 and ack each message, for ``--minutes``.
Every ``--sample-seconds`` the main process records messages published and consumed
(counted by the processes themselves), the queue depth, and the queue table's dead and
live tuples, size (with indexes) and vacuum counts from ``pg_stat_user_tables``.

``--vacuum-threshold`` is the consumers' transport option of that name (0: kombu_pgmq
never vacuums; then only autovacuum, if the server runs it, removes dead tuples).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
import uuid
from contextlib import suppress
from typing import Any

import psycopg
from kombu import Connection, Consumer, Producer, Queue

import kombu_pgmq
from kombu_pgmq._conninfo import redact
from kombu_pgmq._naming import pgmq_queue_name


def producer(url: str, queue: str, stop: Any, count: Any) -> None:
    body = {"task": "noop", "args": [1, 2], "kwargs": {}, "id": str(uuid.uuid4())}
    with Connection(url) as conn:
        producer = Producer(conn.channel())
        n = 0
        while not stop.is_set():
            producer.publish(body, routing_key=queue)
            n += 1
            if n % 50 == 0:
                with count.get_lock():
                    count.value += 50
                n = 0


def consumer(url: str, queue: str, options: dict[str, Any], stop: Any, count: Any) -> None:
    done = 0

    def on_message(_body: object, message: Any) -> None:
        nonlocal done
        message.ack()
        done += 1
        if done == 50:
            with count.get_lock():
                count.value += done
            done = 0

    with (
        Connection(url, transport_options=options) as conn,
        Consumer(conn.channel(), [Queue(queue)], callbacks=[on_message], prefetch_count=10),
    ):
        while not stop.is_set():
            with suppress(TimeoutError):
                conn.drain_events(timeout=1)


STATS = """
SELECT n_dead_tup, n_live_tup, pg_total_relation_size(relid),
       coalesce(vacuum_count, 0), coalesce(autovacuum_count, 0)
FROM pg_stat_user_tables WHERE schemaname = 'pgmq' AND relname = %s
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=kombu_pgmq.default_broker_url())
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--vacuum-threshold", type=int, default=20_000)
    parser.add_argument("--label", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    queue = f"churn_{uuid.uuid4().hex[:6]}"
    name = pgmq_queue_name(queue)
    with Connection(args.url) as conn:
        Queue(queue)(conn.channel()).declare()
    options = {"vacuum_threshold": args.vacuum_threshold}
    stop = mp.Event()
    published, consumed = mp.Value("q", 0), mp.Value("q", 0)
    procs = [mp.Process(target=producer, args=(args.url, queue, stop, published))]
    procs += [
        mp.Process(target=consumer, args=(args.url, queue, options, stop, consumed))
        for _ in range(args.consumers)
    ]
    dsn = kombu_pgmq.Transport(Connection(args.url)).dsn
    samples: list[dict[str, Any]] = []
    with psycopg.connect(dsn, autocommit=True) as db:
        settings = dict(
            db.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('autovacuum', 'autovacuum_naptime', 'server_version', 'fsync')"
            ).fetchall()
        )
        for p in procs:
            p.start()
        start = time.monotonic()
        last = (start, 0, 0)
        try:
            while (now := time.monotonic()) - start < args.minutes * 60:
                time.sleep(args.sample_seconds - ((now - start) % args.sample_seconds))
                now = time.monotonic()
                pub, con = published.value, consumed.value
                dead, live, size, vac, autovac = db.execute(STATS, (f"q_{name}",)).fetchone()
                depth = db.execute(f'SELECT count(*) FROM pgmq."q_{name}"').fetchone()[0]
                dt = now - last[0]
                sample = {
                    "t_s": round(now - start, 1),
                    "published_per_s": round((pub - last[1]) / dt),
                    "consumed_per_s": round((con - last[2]) / dt),
                    "depth": depth,
                    "dead_tuples": dead,
                    "live_tuples": live,
                    "table_bytes": size,
                    "vacuums": vac,
                    "autovacuums": autovac,
                }
                samples.append(sample)
                print(json.dumps(sample), flush=True)
                last = (now, pub, con)
        finally:
            stop.set()
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        with Connection(args.url) as conn:
            conn.channel().queue_delete(queue)
    result = {
        "label": args.label or f"vacuum_threshold={args.vacuum_threshold}",
        "url": redact(args.url),
        "minutes": args.minutes,
        "consumers": args.consumers,
        "vacuum_threshold": args.vacuum_threshold,
        "server": settings,
        "samples": samples,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
