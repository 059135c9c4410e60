"""What priority bands cost: Kombu publish and consume+ack with and without x-max-priority.

Usage::

    python benchmarks/priority_cost.py [--url postgresql://...] [--messages 3000] \
        [--rounds 3] [--json benchmarks/results/priority_cost.json]

Cases (rounds interleaved, median reported), one connection, prefetch 10:

* ``plain``: a queue without x-max-priority (one PGMQ queue);
* ``10 bands, all priority 0``: x-max-priority 9, every message in band 0, so each read
  passes 9 empty bands first (the worst case of the model);
* ``10 bands, priorities 0-9``: x-max-priority 9, priorities spread evenly;
* ``4 bands (priority_steps 0,3,6,9), priorities 0-9``.

Plus the round trip of one read of an empty queue (what an idle fallback poll pays):
1 PGMQ queue vs 10 empty bands.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from kombu import Connection, Consumer, Producer, Queue

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from brokers import DEFAULT_BROKERS, ensure_database

import kombu_pgmq  # noqa: F401

CASES: dict[str, tuple[int | None, list[int] | None, bool]] = {
    # name: (x-max-priority, priority_steps, spread priorities 0-9)
    "plain": (None, None, False),
    "10 bands, all priority 0": (9, None, False),
    "10 bands, priorities 0-9": (9, None, True),
    "4 bands (steps 0,3,6,9), priorities 0-9": (9, [0, 3, 6, 9], True),
}


def measure(url: str, case: str, messages: int) -> dict[str, float]:
    max_priority, steps, spread = CASES[case]
    queue = Queue(f"prio_cost_{uuid.uuid4().hex[:8]}", max_priority=max_priority)
    body = {"task": "noop", "args": [1, 2], "kwargs": {}}
    options: dict[str, Any] = {"priority_steps": steps} if steps else {}
    with Connection(url, transport_options=options) as conn:
        channel = conn.channel()
        producer = Producer(channel)
        queue(channel).declare()
        start = time.perf_counter()
        for i in range(messages):
            producer.publish(body, routing_key=queue.name, priority=i % 10 if spread else 0)
        publish = messages / (time.perf_counter() - start)
        received = 0

        def on_message(_body: object, message: Any) -> None:
            nonlocal received
            received += 1
            message.ack()

        start = time.perf_counter()
        with Consumer(channel, [queue], callbacks=[on_message], prefetch_count=10):
            while received < messages:
                conn.drain_events(timeout=10)
        consume = messages / (time.perf_counter() - start)
        idle = idle_read_ms(conn, queue.name)
        queue(channel).delete()
    return {"publish_per_s": publish, "consume_ack_per_s": consume, "empty_read_ms": idle}


def idle_read_ms(conn: Connection, queue: str, calls: int = 200) -> float:
    transport = conn.transport
    names = list(transport.topology.bands(queue).read_order)
    client = transport.broker()
    start = time.perf_counter()
    for _ in range(calls):
        assert client.read_many(names, 30, 10) == []
    return (time.perf_counter() - start) * 1000 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=DEFAULT_BROKERS["kombu_pgmq"])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ensure_database(args.url)
    samples: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}
    for r in range(args.rounds):
        for case in CASES:
            samples[case].append(measure(args.url, case, args.messages))
            print(f"round {r + 1} {case}: {samples[case][-1]}", flush=True)
    results = {
        case: {
            key: round(statistics.median(s[key] for s in runs), 2)
            for key in ("publish_per_s", "consume_ack_per_s", "empty_read_ms")
        }
        for case, runs in samples.items()
    }
    print("| case | publish/s | consume+ack/s | read of an empty queue, ms |")
    print("|---|---|---|---|")
    for case, r in results.items():
        print(
            f"| {case} | {r['publish_per_s']:,.0f} | {r['consume_ack_per_s']:,.0f} "
            f"| {r['empty_read_ms']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            meta = {"messages": args.messages, "rounds": args.rounds, "host_cpus": os.cpu_count()}
            json.dump({**meta, "results": results}, fh, indent=2)
            fh.write("\n")


if __name__ == "__main__":
    main()
