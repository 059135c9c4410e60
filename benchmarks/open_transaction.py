"""An application's transaction that enqueued stays open while a consumer starts,
consumes and renews leases (issue 13: one connection per concern).

Timeline, all against one database:

1. the "application" opens a transaction and enqueues one message to the queue through
   ``kombu_pgmq.using(conn)`` (it stays uncommitted for ``--hold`` seconds, 60 by
   default);
2. a Kombu consumer connects and starts consuming that queue (time to ready measured);
3. a producer publishes ``--messages`` messages one by one, every ``--gap-ms``; the
   consumer acks each (publish -> delivery latency measured);
4. the consumer also holds one message unacked the whole time with a visibility timeout
   of ``--vt`` seconds: it must never be delivered again (its read_ct in the archive is
   1; lease renewal rounds counted);
5. the application commits: its message arrives (woken by the NOTIFY delivered at the
   commit when the consumer waited at publish time, else by the fallback poll).

    python benchmarks/open_transaction.py --url postgresql://postgres@127.0.0.1/kpb_ours \
        --hold 60 --json benchmarks/results/open_transaction.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from typing import Any

import psycopg
from brokers import ensure_database
from kombu import Connection, Consumer, Producer, Queue

import kombu_pgmq

QUEUE = "kpb_open_tx"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_ours")
    parser.add_argument(
        "--hold", type=float, default=60.0, help="seconds the transaction stays open"
    )
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--vt", type=float, default=5.0, help="visibility timeout, seconds")
    parser.add_argument("--json")
    args = parser.parse_args()
    ensure_database(args.url)
    queue = Queue(QUEUE, routing_key=QUEUE)
    with Connection(args.url) as setup:
        queue(setup.default_channel).declare()
        setup.default_channel.queue_purge(QUEUE)

    app = psycopg.connect(args.url)
    # the application enqueues in its own transaction (kombu_pgmq.using, issue 15)
    Producer(kombu_pgmq.using(app)).publish({"from": "app"}, routing_key=QUEUE)
    opened = time.monotonic()

    latencies: list[float] = []
    held: list[Any] = []
    app_message: list[float] = []
    options = {"visibility_timeout": args.vt}

    def on_message(message: Any) -> None:
        body = message.payload
        if body == {"from": "app"}:
            app_message.append(time.monotonic())
            message.ack()
        elif body == {"hold": True}:
            held.append(message)  # never acked until the end: its lease must be renewed
        else:
            latencies.append(time.time() - body["sent"])
            message.ack()

    worker = Connection(args.url, transport_options=options)
    started = time.monotonic()
    consumer = Consumer(worker.default_channel, [queue], on_message=on_message, prefetch_count=10)
    consumer.consume()
    ready_seconds = time.monotonic() - started

    def produce() -> None:
        with Connection(args.url) as producer_conn:
            producer = Producer(producer_conn.default_channel)
            producer.publish({"hold": True}, routing_key=QUEUE)
            time.sleep(0.5)  # the hold message is delivered first
            for _ in range(args.messages):
                producer.publish({"sent": time.time()}, routing_key=QUEUE)
                time.sleep(args.gap_ms / 1000.0)

    producer_thread = threading.Thread(target=produce)
    producer_thread.start()
    while time.monotonic() - opened < args.hold:
        with contextlib.suppress(TimeoutError):
            worker.drain_events(timeout=0.5)
    producer_thread.join()
    committed = time.monotonic()
    app.commit()
    app.close()
    deadline = time.monotonic() + 10
    while not app_message and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            worker.drain_events(timeout=0.5)
    renewals = worker.transport.leases.rounds
    for message in held:
        message.ack()
    consumer.cancel()
    worker.release()
    with psycopg.connect(args.url) as db:
        reads = db.execute(f"SELECT read_ct FROM pgmq.a_{QUEUE} WHERE message ? 'hold'").fetchall()

    lat_ms = sorted(x * 1000 for x in latencies)
    result = {
        "hold_seconds": args.hold,
        "consumer_ready_seconds": round(ready_seconds, 3),
        "messages": args.messages,
        "delivered": len(latencies),
        "latency_ms_p50": round(statistics.median(lat_ms), 2) if lat_ms else None,
        "latency_ms_p99": round(lat_ms[int(len(lat_ms) * 0.99) - 1], 2) if lat_ms else None,
        "held_message_read_ct": [r[0] for r in reads],  # [1]: never delivered again
        "lease_renewal_rounds": renewals,
        "visibility_timeout_seconds": args.vt,
        "app_message_after_commit_seconds": round(app_message[0] - committed, 3)
        if app_message
        else None,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
