"""What seeing a publish before its WAL flush costs a publisher (issue 30, fourth session).

Usage::

    python benchmarks/publish_flush_cost.py [--dsn postgresql://postgres@127.0.0.1:5432/kpb_latency]
        [--statements 2000]

Raw psycopg on one connection, back to back, each shape ``--statements`` times (twice,
interleaved): ms per publish and the client's CPU per publish.

* ``sync``: one INSERT committed synchronously (what a publish nobody waits for does);
* ``async + flush``: the INSERT with ``set_config('synchronous_commit', 'off', true)``,
  then statement ``flush_commits`` (``pg_logical_emit_message(true, ...)``) in a second
  transaction: what a publish a consumer waits for does (``visible_before_flush``);
* ``pipelined``: the same two in one round trip (psycopg pipeline mode, a Sync after
  each): not used, its client CPU is the reason.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import ensure_database, pg_dsn

INSERT = "INSERT INTO kpb_flush_cost (m) VALUES (%s::jsonb) RETURNING id"
ASYNC_INSERT = (
    "INSERT INTO kpb_flush_cost (m) SELECT %s::jsonb"
    " FROM (SELECT set_config('synchronous_commit', 'off', true)) s RETURNING id"
)
FLUSH = "SELECT pg_logical_emit_message(true, 'kombu_pgmq.flush', '')"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/kpb_latency")
    parser.add_argument("--statements", type=int, default=2000)
    args = parser.parse_args()
    dsn = pg_dsn(args.dsn) or args.dsn
    ensure_database(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS kpb_flush_cost (id bigserial, m jsonb)")

        def sync() -> None:
            conn.execute(INSERT, ('{"a": 1}',)).fetchall()

        def async_flush() -> None:
            conn.execute(ASYNC_INSERT, ('{"a": 1}',)).fetchall()
            conn.execute(FLUSH)

        def pipelined() -> None:
            cur = conn.cursor()
            with conn.pipeline() as pipeline:
                cur.execute(ASYNC_INSERT, ('{"a": 1}',))
                pipeline.sync()
                conn.execute(FLUSH)
            cur.fetchall()

        shapes = [("sync", sync), ("async + flush", async_flush), ("pipelined", pipelined)]
        for name, shape in shapes * 2:
            for _ in range(50):
                shape()
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(args.statements):
                shape()
            t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
            print(
                f"{name:14s} {(t1 - t0) / args.statements * 1000:.3f} ms/publish, "
                f"client CPU {cpu / args.statements * 1e6:.0f} us/publish"
            )
        conn.execute("DROP TABLE kpb_flush_cost")


if __name__ == "__main__":
    main()
