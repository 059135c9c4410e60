"""What one read-and-ack round trip costs on each path to the queue's read function: called
directly (statement ``read_queue``: ``kombu_pgmq.read_q_<queue>``, static SQL plan-cached
by PL/pgSQL, what every single-queue read runs, for the owner and least-privilege roles
alike), and through ``kombu_pgmq.read`` (reads of several queues or priority bands, queues
with key limits: one function for every queue, which calls the queue's function with
``EXECUTE``).

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
import statistics
import sys
import time
from pathlib import Path

from brokers import ensure_database
from kombu import Connection

from kombu_pgmq._db.broker import Broker
from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.rows import Receipt

QUEUE = "hot_path"


def step(broker: Broker, design: str, acks: list[Receipt]) -> tuple[float, list[Receipt]]:
    """One timed round trip of ``design``: ack ``acks``, read one message."""
    if design == "kombu_pgmq.read":
        broker.keyed.add(QUEUE)  # read as a queue with key limits is
    else:
        broker.keyed.discard(QUEUE)
    t0 = time.perf_counter()
    rows = broker.read_many([QUEUE], 30, 1, acks, durable_acks=False)
    elapsed = time.perf_counter() - t0
    return elapsed, [Receipt(QUEUE, r.msg_id, r.read_ct, r.enqueued_at) for r in rows]


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
    broker = Broker(db)
    designs = ["queue function", "kombu_pgmq.read"]
    results = []
    for rnd in range(args.rounds):
        for design in designs:
            acks: list[Receipt] = []
            times = []
            for i in range(args.messages):
                broker.send(QUEUE, json.dumps({"n": i}), "{}", deduplicated=False)
                elapsed, acks = step(broker, design, acks)
                times.append(elapsed * 1000)
            broker.ack(acks)
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
