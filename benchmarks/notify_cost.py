"""What wake-ups cost publishers: 1 and 4 concurrent publishing processes, SQL level.

Usage::

    python benchmarks/notify_cost.py [--url postgresql://...] [--seconds 5] [--rounds 3] \
        [--json benchmarks/results/notify_cost.json]

Each publisher process runs one statement in a loop on its own autocommit connection
for ``--seconds``; sends/s are summed over processes; the median of ``--rounds`` rounds
(cases interleaved) is reported. Cases:

* ``pgmq.send``: the floor, no wake-up at all.
* ``pgmq.send with headers``: the same with a headers argument and a delay of 0, the
  call ``kombu_pgmq.publish`` makes inside (like for like).
* ``pgmq.send + pg_notify``: a NOTIFY on every publish (what pgmq's
  ``enable_notify_insert`` trigger does, minus its throttle row).
* ``kombu_pgmq.publish, no waiter``: ours while consumers are busy (a backlog): shared
  advisory lock, send, waiting check, no NOTIFY.
* ``kombu_pgmq.publish, waiter``: ours while a consumer sleeps on the queue: it NOTIFYs.

A LISTEN connection is open on the queue's channel throughout (notifications are queued
to it, as to a sleeping consumer).
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

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import ensure_database

QUEUE = "notify_cost"
BODY = '{"task": "noop", "args": [1, 2], "kwargs": {}}'
CASES = {
    "pgmq.send": "SELECT pgmq.send(%(q)s, %(m)s::jsonb)",
    "pgmq.send with headers": "SELECT pgmq.send(%(q)s, %(m)s::jsonb, '{}'::jsonb, 0)",
    "pgmq.send + pg_notify": (
        "SELECT pgmq.send(%(q)s, %(m)s::jsonb), pg_notify('kombu_pgmq.' || %(q)s, '')"
    ),
    "kombu_pgmq.publish, no waiter": "SELECT kombu_pgmq.publish(%(q)s, %(m)s::jsonb, '{}')",
    "kombu_pgmq.publish, waiter": "SELECT kombu_pgmq.publish(%(q)s, %(m)s::jsonb, '{}')",
}


def publisher(dsn: str, statement: str, seconds: float, go: Any, out: Any) -> None:
    params = {"q": QUEUE, "m": BODY}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(20):
            conn.execute(statement, params)
        go.wait()
        n = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.execute(statement, params)
            n += 1
    out.put(n / seconds)


def run(dsn: str, case: str, procs: int, seconds: float) -> float:
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute("DELETE FROM kombu_pgmq.waiting WHERE owner = 'notify_cost'")
        if case.endswith(", waiter"):
            db.execute("SELECT kombu_pgmq.wait_for('notify_cost', ARRAY[%s])", (QUEUE,))
        db.execute("SELECT pgmq.purge_queue(%s)", (QUEUE,))
    go, out = mp.Event(), mp.Queue()
    workers = [
        mp.Process(target=publisher, args=(dsn, CASES[case], seconds, go, out))
        for _ in range(procs)
    ]
    for w in workers:
        w.start()
    time.sleep(0.5)
    go.set()
    rate = sum(out.get() for _ in workers)
    for w in workers:
        w.join()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_ours")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ensure_database(args.url)
    from kombu import Connection

    import kombu_pgmq  # noqa: F401  (bootstraps the schema on connect)

    with Connection(args.url) as conn:
        conn.channel().queue_declare(QUEUE)
    rates: dict[str, dict[int, list[float]]] = {c: {1: [], 4: []} for c in CASES}
    with psycopg.connect(args.url, autocommit=True) as listener:
        listener.execute(f'LISTEN "kombu_pgmq.{QUEUE}"')
        for _ in range(args.rounds):
            for procs in (1, 4):
                for case in CASES:
                    rates[case][procs].append(run(args.url, case, procs, args.seconds))
                    for _ in listener.notifies(timeout=0.01):
                        pass
    with psycopg.connect(args.url, autocommit=True) as db:
        db.execute("DELETE FROM kombu_pgmq.waiting WHERE owner = 'notify_cost'")
    result = {
        case: {str(p): round(statistics.median(v)) for p, v in by_procs.items()}
        for case, by_procs in rates.items()
    }
    floor = result["pgmq.send"]
    print("| statement | 1 publisher sends/s | vs floor | 4 publishers sends/s | vs floor |")
    print("|---|---|---|---|---|")
    for case, by_procs in result.items():
        print(
            f"| {case} | {by_procs['1']:,} | {by_procs['1'] / floor['1']:.2f} | "
            f"{by_procs['4']:,} | {by_procs['4'] / floor['4']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"seconds": args.seconds, "rounds": args.rounds, "results": result}, fh, indent=2
            )
            fh.write("\n")


if __name__ == "__main__":
    main()
