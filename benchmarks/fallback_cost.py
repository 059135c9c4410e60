"""What the fallback poll costs an idle worker's event loop (issue 30, seventh session).

Usage::

    python benchmarks/fallback_cost.py [--url postgresql://postgres@127.0.0.1:5432/kpb_fallback]
        [--channels 2] [--queues 1] [--polls 500] [--json PATH]

One Kombu connection registered with an event loop run by hand (the part of kombu's Hub
the transport uses), ``--channels`` channels consuming ``--queues`` empty queues each (a
Celery worker: its task queue and its remote-control queue, on two channels). Each poll
is what the loop's repeating ``polling_interval`` timer does, timed in the loop's thread;
the two ways alternate, ``--polls`` each:

* ``read``: the fallback reads every consumed queue itself (one round trip per channel),
  as before the seventh session, and still where the role may not read PGMQ's tables
  (``Listener.probes`` False);
* ``probe``: the fallback sends ``visible_probe`` on the LISTEN connection without waiting
  and returns; ``answer`` is how long until the loop has the answer (the loop is free
  meanwhile: nothing was visible, so nothing is read).

Prints p50 / p99 ms of the time the loop was held by the timer's callback, per way.
"""

from __future__ import annotations

import argparse
import json
import select
import statistics
import sys
import time
from pathlib import Path

from kombu import Connection, Consumer, Queue

import kombu_pgmq  # noqa: F401  (registers the postgresql:// transport)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests.integration.helpers: the hub run by hand

from brokers import ensure_database, pg_dsn  # noqa: E402

from tests.integration.helpers import FakeHub  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_fallback")
    parser.add_argument("--channels", type=int, default=2)
    parser.add_argument("--queues", type=int, default=1)
    parser.add_argument("--polls", type=int, default=500)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ensure_database(pg_dsn(args.url) or args.url)
    times: dict[str, list[float]] = {"read": [], "probe": [], "answer": []}
    with Connection(args.url, transport_options={"polling_interval": 3600}) as conn:
        hub = FakeHub()
        conn.transport.register_with_event_loop(conn.connection, hub)
        poller = conn.transport.poller
        consumers = []
        for c in range(args.channels):
            queues = [Queue(f"fallback_{c}_{q}") for q in range(args.queues)]
            consumer = Consumer(conn.channel(), queues, on_message=lambda m: m.ack())
            consumer.consume()
            consumers.append(consumer)
        for _ in range(20):  # the queues found empty, waited on, slots offered
            hub.run_once(0.05)
        listener = poller.listener()
        for n in range(2 * args.polls):
            way = "read" if n % 2 else "probe"
            listener.probes = way == "probe"
            t0 = time.perf_counter()
            poller._on_hub_fallback()  # what the loop's repeating timer calls
            t1 = time.perf_counter()
            times[way].append((t1 - t0) * 1000)
            if way == "probe":
                connector = listener._connector  # its pending statement: the probe
                while connector is not None and connector._pending is not None:
                    if select.select([listener.fileno()], [], [], 5)[0]:
                        poller._on_hub_event()  # what the loop does when the socket is readable
                times["answer"].append((time.perf_counter() - t0) * 1000)
            while hub.soon:
                hub.run_once(0)
            time.sleep(0.002)
        for consumer in consumers:
            consumer.cancel()
        poller.unregister_from_event_loop()
    report = {
        "url": args.url,
        "channels": args.channels,
        "queues_per_channel": args.queues,
        "polls": args.polls,
        **{
            way: {
                "p50_ms": round(statistics.median(v), 3),
                "p99_ms": round(pct(v, 99), 3),
                "mean_ms": round(statistics.fmean(v), 3),
            }
            for way, v in times.items()
        },
    }
    for way in ("read", "probe", "answer"):
        r = report[way]
        held = "until the answer" if way == "answer" else "loop held"
        print(f"{way:>6}: {held} p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
