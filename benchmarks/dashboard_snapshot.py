"""The Grafana dashboard's main panels (docs/grafana-dashboard.json), drawn from a live
run scraped every second: docs/dashboard.png (README "Operating it").

Usage::

    python benchmarks/dashboard_snapshot.py [--url URL] [--seconds 60] [--out docs/dashboard.png]

A producer thread publishes to ``orders`` and ``emails`` (some with a 10 s ``x-delay``),
a consumer thread consumes both (about 2 ms a message, 1 % rejected to the dead-letter
queue); ``emails`` is paused from 35 % to 60 % of the run. The same collectors as
``kombu-pgmq metrics serve`` (queues) and a worker's ProcessCollector (counters) are
read every second; the panels use the dashboard's queries, computed here. (Grafana
itself is not installable on the machine this ran on: no PyPI or Debian package.)
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
from kombu import Connection, Consumer, Producer, Queue
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from brokers import ensure_database

import kombu_pgmq  # noqa: F401
from kombu_pgmq.management import Management
from kombu_pgmq.metrics import ProcessCollector, QueueCollector

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/kombu_pgmq_bench_dashboard"
QUEUES = ("orders", "emails")


def reset(url: str) -> None:
    ensure_database(url)
    with psycopg.connect(url, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('kombu_pgmq.queues')").fetchone()[0]
        if exists:
            for (name,) in conn.execute("SELECT queue FROM kombu_pgmq.queues").fetchall():
                conn.execute("SELECT kombu_pgmq.drop_queue(%s)", (name,))


def produce(url: str, stop: threading.Event, started: float, seconds: float) -> None:
    with Connection(url) as conn:
        producer = Producer(conn.channel())
        declared = [Queue(q, routing_key=q) for q in QUEUES]
        n = 0
        while not stop.is_set():
            phase = (time.monotonic() - started) / seconds
            burst = 40 if 0.15 < phase < 0.3 else 12  # a burst: the backlog grows
            for _ in range(burst):
                queue = "orders" if n % 3 else "emails"
                headers = {"task": f"shop.{queue}", "id": f"t{n}"}
                if n % 25 == 0:
                    headers["x-delay"] = 10_000
                producer.publish({"n": n}, routing_key=queue, declare=declared, headers=headers)
                n += 1
            time.sleep(0.1)


def consume(url: str, stop: threading.Event) -> None:
    rng = random.Random(7)

    def on_message(message: Any) -> None:
        time.sleep(0.002)
        if rng.random() < 0.01:
            message.reject(requeue=False)
        else:
            message.ack()

    with (
        Connection(url, transport_options={"polling_interval": 0.5}) as conn,
        Consumer(
            conn.channel(),
            [Queue(q, routing_key=q) for q in QUEUES],
            on_message=on_message,
            prefetch_count=10,
        ),
    ):
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = parser.parse_args()
    reset(args.url)

    registry = CollectorRegistry()
    registry.register(QueueCollector(args.url))
    registry.register(ProcessCollector())
    stop = threading.Event()
    started = time.monotonic()
    threads = [
        threading.Thread(target=produce, args=(args.url, stop, started, args.seconds)),
        threading.Thread(target=consume, args=(args.url, stop)),
    ]
    for t in threads:
        t.start()
    series: list[tuple[float, dict]] = []
    paused = resumed = False
    with Management(args.url) as management:
        while (elapsed := time.monotonic() - started) < args.seconds:
            if not paused and elapsed > 0.35 * args.seconds:
                management.pause("emails")
                paused = True
            if paused and not resumed and elapsed > 0.6 * args.seconds:
                management.resume("emails")
                resumed = True
            series.append((elapsed, scrape(registry)))
            time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    draw(series, args.out)
    print(f"wrote {args.out} ({len(series)} scrapes)")


def draw(series: list[tuple[float, dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s for s, _ in series]

    def values(name: str, **labels: str) -> list[float]:
        key = (name, tuple(sorted(labels.items())))
        return [sample.get(key, 0.0) for _, sample in series]

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    fig.suptitle("kombu_pgmq: queues and workers (docs/grafana-dashboard.json panels, live run)")
    ax = axes[0][0]
    for q in QUEUES:
        for state, style in (("ready", "-"), ("in_flight", ":"), ("delayed", "--")):
            ax.plot(
                t,
                values("kombu_pgmq_queue_messages", queue=q, state=state),
                style,
                label=f"{q} {state}",
            )
    ax.set_title("Messages by queue and state")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    for q in QUEUES:
        ax.plot(t, values("kombu_pgmq_queue_oldest_message_age_seconds", queue=q), label=q)
    ax.set_title("Oldest message age (s)")
    ax.legend(fontsize=7)
    ax = axes[0][2]
    for q in QUEUES:
        ax.plot(t, values("kombu_pgmq_queue_paused", queue=q), label=q)
    ax.set_title("Paused (kombu-pgmq queue pause)")
    ax.set_ylim(-0.1, 1.1)
    ax.legend(fontsize=7)
    ax = axes[1][0]
    rates: dict[str, list[float]] = defaultdict(list)
    for name in ("deliveries", "acks", "rejects", "publishes"):
        counter = values(f"kombu_pgmq_{name}_total")
        rates[name] = [0.0] + [
            (b - a) / max(t2 - t1, 1e-9)
            for a, b, t1, t2 in zip(counter, counter[1:], t, t[1:], strict=False)
        ]
        ax.plot(t, rates[name], label=name)
    ax.set_title("Transport per second (process counters)")
    ax.legend(fontsize=7)
    ax = axes[1][1]
    for q in QUEUES:
        ax.plot(t, values("kombu_pgmq_archive_messages", queue=q), label=q)
    ax.set_title("Archive size (acked)")
    ax.legend(fontsize=7)
    ax = axes[1][2]
    for q in QUEUES:
        ax.plot(t, values("kombu_pgmq_dead_letters", queue=q), label=f"dead letters {q}")
        ax.plot(t, values("kombu_pgmq_consumers", queue=q), ":", label=f"consumers {q}")
    ax.set_title("Dead letters and consumers")
    ax.legend(fontsize=7)
    for row in axes:
        for ax in row:
            ax.set_xlabel("seconds")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


if __name__ == "__main__":
    main()
