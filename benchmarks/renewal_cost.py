"""What lease renewal costs: one connection holding 1,000 unacked messages.

Usage::

    python benchmarks/renewal_cost.py [--url postgresql://...] [--held 1000] [--rounds 20] \
        [--seconds 20] [--json benchmarks/results/renewal_cost.json]

Measures, on one Kombu connection holding ``--held`` messages (``basic_get``, never
acked), spread over 1 queue and over 10 queues:

* one renewal round (``LeaseKeeper.renew``: one ``kombu_pgmq.renew`` statement for every
  held message), median and p95 of ``--rounds`` rounds;
* for comparison, the same leases extended with ``pgmq.set_vt`` one statement per queue
  (what PGMQ offers, no read_ct check) and one statement per message (naive);
* the renewal thread itself, at the default interval of a 30 s visibility timeout (10 s)
  and at 1 s, for ``--seconds``: statements/s and rows updated/s it sends.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kombu import Connection, Producer, Queue

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from brokers import DEFAULT_BROKERS, ensure_database

import kombu_pgmq  # noqa: F401


def hold(url: str, queues: list[str], held: int, **options: Any) -> tuple[Connection, list[Any]]:
    conn = Connection(url, transport_options={"visibility_timeout": 30, **options})
    channel = conn.channel()
    for name in queues:
        channel.queue_declare(name)
        channel.queue_purge(name)
    per_queue = held // len(queues)
    with conn.channel() as ch:
        producer = Producer(ch)
        for name in queues:
            for i in range(per_queue):
                producer.publish({"i": i}, routing_key=name, declare=[Queue(name)])
    messages = []
    for name in queues:
        for _ in range(per_queue):
            message = channel.basic_get(name)
            assert message is not None
            messages.append(message)
    return conn, messages


def drop(url: str, conn: Connection, queues: list[str]) -> None:
    conn.release()  # requeues the held messages first
    with Connection(url) as admin:
        channel = admin.channel()
        for name in queues:
            channel.queue_delete(name)


def timed(fn: Any, rounds: int) -> dict[str, float]:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return {
        "p50_ms": round(statistics.median(samples), 2),
        "p95_ms": round(samples[int(0.95 * (len(samples) - 1))], 2),
    }


def measure(url: str, n_queues: int, held: int, rounds: int) -> dict[str, Any]:
    queues = [f"renewal_cost_{i}" for i in range(n_queues)]
    conn, messages = hold(url, queues, held, lease_renewal_interval=0)
    try:
        keeper = conn.transport.leases
        result = keeper.renew()
        assert result.renewed == held and result.statements == 1, result
        ours = timed(keeper.renew, rounds)
        client = conn.transport.broker()
        by_queue: dict[str, list[int]] = {}
        for m in messages:
            by_queue.setdefault(m.delivery_info["pgmq_queue"], []).append(
                m.delivery_info["pgmq_msg_id"]
            )

        def per_queue() -> None:
            for name, ids in by_queue.items():
                client.set_vt(name, ids, 30)

        def per_message() -> None:
            for name, ids in by_queue.items():
                for msg_id in ids:
                    client.set_vt(name, [msg_id], 30)

        return {
            "queues": n_queues,
            "held": held,
            "kombu_pgmq.renew (1 statement)": ours,
            f"pgmq.set_vt per queue ({n_queues} statements)": timed(per_queue, rounds),
            f"pgmq.set_vt per message ({held} statements)": timed(per_message, max(3, rounds // 5)),
        }
    finally:
        drop(url, conn, queues)


def thread_rate(url: str, held: int, interval: float, seconds: float) -> dict[str, Any]:
    queues = ["renewal_rate"]
    conn, _ = hold(url, queues, held, lease_renewal_interval=interval)
    try:
        keeper = conn.transport.leases
        keeper.start()
        rounds0, statements0 = keeper.rounds, keeper.statements
        time.sleep(seconds)
        rounds, statements = keeper.rounds - rounds0, keeper.statements - statements0
        return {
            "interval_s": interval,
            "held": held,
            "seconds": seconds,
            "rounds": rounds,
            "statements_per_s": round(statements / seconds, 3),
            "rows_updated_per_s": round(rounds * held / seconds, 1),
        }
    finally:
        drop(url, conn, queues)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=DEFAULT_BROKERS["kombu_pgmq"])
    parser.add_argument("--held", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ensure_database(args.url)
    results: dict[str, Any] = {"rounds": [], "thread": []}
    for n_queues in (1, 10):
        entry = measure(args.url, n_queues, args.held, args.rounds)
        print(json.dumps(entry), flush=True)
        results["rounds"].append(entry)
    for interval in (10.0, 1.0):
        entry = thread_rate(args.url, args.held, interval, args.seconds)
        print(json.dumps(entry), flush=True)
        results["thread"].append(entry)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"host_cpus": os.cpu_count(), **results}, fh, indent=2)
            fh.write("\n")


if __name__ == "__main__":
    main()
