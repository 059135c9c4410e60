"""What one read-and-ack round trip costs in each design that could be the one
implementation of the hot path: the plan-cached statement on PGMQ's tables (statement
``read_queue``, what a role with rights on the tables runs), the same static SQL inside a
per-queue plpgsql ``SECURITY DEFINER`` function (plan-cached by PL/pgSQL, callable by a
least-privilege role), and ``kombu_pgmq.read`` (one function for every queue: the read is
built with ``format`` and planned by ``EXECUTE`` on every call).

Usage (from the repository root)::

    python benchmarks/hot_path_designs.py [--url postgresql://...] [--messages 2000] \
        [--rounds 3] [--json benchmarks/results/hot_path_designs.json]

One database (created if missing, the kombu_pgmq schema installed), one queue. Each
step publishes one message (not timed), then times one round trip that acks the message
delivered by the previous step and reads the new one (reads by position, asynchronous
commit, as a Celery worker's read with its acks riding along). The designs take turns
within each round (paired), so drift on the machine hits each alike. Prints p50, p99 and
mean in ms per design and round.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from brokers import ensure_database
from kombu import Connection

from kombu_pgmq._db.broker import Broker
from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.positions import ReadPosition
from kombu_pgmq._db.rows import ReadRow, Receipt

QUEUE = "hot_path"

#: parameters of statement read_queue, as the function's arguments
_TYPES = {
    "queue": "text",
    "vt_seconds": "integer",
    "qty": "integer",
    "ack_ids": "bigint[]",
    "ack_cts": "integer[]",
    "ack_enqueued": "timestamptz[]",
    "commit": "text",
    "scan_from": "float8",
    "watch_xids": "text[]",
    "watch_bounds": "float8[]",
    "stamp": "boolean",
}
_COLUMNS = (
    "msg_id bigint, read_ct integer, enqueued_at timestamptz, message text, headers text, "
    "age_seconds float8, acked boolean, commit_mode text, snapshot text, read_xid text, "
    "read_at float8, scan_from float8, scanned_to float8"
)


def per_queue_function(pgmq: Broker) -> bytes:
    """Create ``kombu_pgmq.bench_read_<queue>``: statement read_queue's text as a
    SECURITY DEFINER function; return the statement that calls it."""
    composed = pgmq._compose_read_queue(QUEUE, "read_queue").as_string(pgmq.db.connection)
    names = sorted(set(re.findall(r"%\((\w+)\)s", composed)))
    body = re.sub(r"%\((\w+)\)s", lambda m: "p_" + m.group(1), composed)
    arguments = ", ".join(f"p_{n} {_TYPES[n]}" for n in names)
    pgmq.db.connection.execute(
        f"CREATE OR REPLACE FUNCTION kombu_pgmq.bench_read_{QUEUE}({arguments}) "
        f"RETURNS TABLE ({_COLUMNS}) LANGUAGE plpgsql SECURITY DEFINER "
        "SET search_path = pg_catalog, pg_temp AS $f$ #variable_conflict use_column\n"
        f"BEGIN RETURN QUERY {body}; END $f$"
    )
    places = ", ".join(f"%({n})s" for n in names)
    return f"SELECT * FROM kombu_pgmq.bench_read_{QUEUE}({places})".encode()


def step(
    pgmq: Broker, design: str, call: bytes, acks: list[Receipt]
) -> tuple[float, list[Receipt]]:
    """One timed round trip of ``design``: ack ``acks``, read one message."""
    if design == "kombu_pgmq.read":
        pgmq.direct_reads = False
        t0 = time.perf_counter()
        rows = pgmq.read_many([QUEUE], 30, 1, acks, durable_acks=False)
        elapsed = time.perf_counter() - t0
        return elapsed, [Receipt(QUEUE, r.msg_id, r.read_ct, r.enqueued_at) for r in rows]
    params: dict[str, Any] = {
        "queue": QUEUE,
        "vt_seconds": 30,
        "qty": 1,
        "ack_ids": [a.msg_id for a in acks],
        "ack_cts": [a.read_ct for a in acks],
        "ack_enqueued": [a.enqueued_at for a in acks],
        "commit": "off",
        **pgmq.positions.params(QUEUE),
    }
    t0 = time.perf_counter()
    if design == "statement":
        compose = lambda: pgmq._compose_read_queue(QUEUE, "read_queue")  # noqa: E731
        rows = pgmq._fetch_direct("read_queue", QUEUE, compose, params, ReadRow, synchronous=None)
    else:
        rows = pgmq.db.fetch(call, params, ReadRow, synchronous=None)
    elapsed = time.perf_counter() - t0
    for r in rows:
        if r.snapshot is not None:
            pgmq.positions.advance(QUEUE, ReadPosition.of(r))
    delivered = [r for r in rows if r.acked is False and r.msg_id is not None]
    return elapsed, [Receipt(QUEUE, r.msg_id, r.read_ct, r.enqueued_at) for r in delivered]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_hot_path")
    parser.add_argument(
        "--messages", type=int, default=2000, help="round trips per design and round"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ensure_database(args.url)
    with Connection(args.url, transport_options={}) as conn:
        conn.channel().queue_declare(QUEUE)
    db = Connector(args.url)
    pgmq = Broker(db)
    call = per_queue_function(pgmq)
    designs = ["statement", "per-queue function", "kombu_pgmq.read"]
    results = []
    for rnd in range(args.rounds):
        for design in designs:
            acks: list[Receipt] = []
            times = []
            for i in range(args.messages):
                pgmq.send(QUEUE, json.dumps({"n": i}), "{}", deduplicated=False)
                elapsed, acks = step(pgmq, design, call, acks)
                times.append(elapsed * 1000)
            pgmq.ack(acks)
            pgmq.direct_reads = True
            times.sort()
            row = {
                "round": rnd,
                "design": design,
                "p50_ms": round(times[len(times) // 2], 3),
                "p99_ms": round(times[int(len(times) * 0.99)], 3),
                "mean_ms": round(statistics.fmean(times), 3),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    db.connection.execute(f"DROP FUNCTION kombu_pgmq.bench_read_{QUEUE}")
    db.close()
    summary = {
        d: round(statistics.median(r["p50_ms"] for r in results if r["design"] == d), 3)
        for d in designs
    }
    print("median p50 (ms):", json.dumps(summary), file=sys.stderr)
    if args.json:
        env = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        payload = {
            "environment": env | vars(args) | {"json": None},
            "results": results,
            "summary": summary,
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
