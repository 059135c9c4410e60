"""Which modules and classes of kombu_pgmq one publish and one delivery go through.

A Kombu producer publishes one message and a consumer on another connection receives and
acks it (``drain_events``, then the ack's flush), each traced with ``sys.setprofile``:
every kombu_pgmq function called is counted by module and by class (the class of
``self``/``cls`` where there is one). Run it on two commits to compare the paths a reader
must follow::

    python benchmarks/call_paths.py [--url postgresql://postgres@127.0.0.1:5432/kpb_paths]
        [--json benchmarks/results/call_paths.json]

Prints, for the publish and for the delivery, the number of modules, classes and calls,
and the modules in the order first entered.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from kombu import Connection, Consumer, Exchange, Producer, Queue

import kombu_pgmq  # noqa: F401  (registers the postgresql:// transport)


def _trace(fn: Any) -> dict[str, Any]:
    modules: dict[str, int] = {}
    classes: Counter[str] = Counter()
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("kombu_pgmq"):
            return
        calls += 1
        modules.setdefault(module, len(modules))
        names = frame.f_code.co_varnames
        if frame.f_code.co_argcount and names and names[0] in ("self", "cls"):
            owner = frame.f_locals.get(names[0])
            if owner is not None:
                cls = owner if isinstance(owner, type) else type(owner)
                if cls.__module__.startswith("kombu_pgmq"):
                    classes[f"{cls.__module__}.{cls.__qualname__}"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {
        "modules": len(modules),
        "classes": len(classes),
        "calls": calls,
        "module_order": sorted(modules, key=modules.__getitem__),
        "class_calls": dict(classes.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_paths")
    parser.add_argument("--json")
    args = parser.parse_args()
    exchange = Exchange("paths", type="direct")
    queue = Queue("paths", exchange, routing_key="paths")
    got: list[Any] = []
    with Connection(args.url) as producer_conn, Connection(args.url) as consumer_conn:
        producer = Producer(producer_conn.channel(), exchange=exchange, routing_key="paths")
        channel = consumer_conn.channel()
        with Consumer(channel, [queue], callbacks=[lambda body, m: got.append(m)]):
            # warm up: declarations, schema checks, prepared statements, first connection
            for i in range(3):
                producer.publish({"warm": i}, declare=[queue])
                while len(got) <= i:
                    consumer_conn.drain_events(timeout=10)
                got[-1].ack()
            got.clear()

            def publish() -> None:
                producer.publish({"traced": True})

            def deliver() -> None:
                while not got:
                    consumer_conn.drain_events(timeout=10)
                got[0].ack()

            result = {"publish": _trace(publish), "delivery": _trace(deliver)}
        queue(producer_conn.channel()).delete()
    for name, r in result.items():
        print(f"{name}: {r['modules']} modules, {r['classes']} classes, {r['calls']} calls")
        print("   ", " -> ".join(m.removeprefix("kombu_pgmq.") for m in r["module_order"]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
