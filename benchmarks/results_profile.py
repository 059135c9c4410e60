"""Where a result backend's share of a ``get()`` round trip goes, backend by backend.

Usage::

    python benchmarks/results_profile.py [--broker postgresql://postgres@127.0.0.1:5432/kpb_results]
        [--backend NAME=URL ...] [-n 300] [--json PATH]

No worker and no broker traffic: the three steps a result backend adds to a task's round
trip, each timed ``-n`` times in this process (p50/p90/p99 ms), backends interleaved:

1. ``store``: ``backend.store_result(id, i, "SUCCESS")`` (what the worker's pool process
   does after the task body).
2. ``read``: ``backend._get_task_meta_for(id)`` of a stored result (what ``get()`` does
   once before waiting: Celery's ``on_wait_for_pending``, with every backend).
3. ``wake``: a thread of this process waits in ``AsyncResult(id).get()`` on a second app
   instance (its own connection, subscribed and past its first read), then the main
   thread stores the result: from ``store_result`` called to ``get()`` returned (the
   write, the push: NOTIFY or Redis PUBLISH, and the waiter's decode).

Default backends as ``results_backend.py``'s: ours, Redis, Celery's SQLAlchemy.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import results_backend_app  # noqa: E402
from brokers import ensure_database, pg_dsn  # noqa: E402
from results_backend import DEFAULT_BROKER, default_backends, percentiles  # noqa: E402


def steps(broker: str, backend: str, n: int) -> dict[str, list[float]]:
    writer = results_backend_app.create_app(broker, backend)
    waiter = results_backend_app.create_app(broker, backend)
    be = writer.backend
    ids = [str(uuid.uuid4()) for _ in range(n)]
    be.store_result(str(uuid.uuid4()), 0, "SUCCESS")  # connect
    out: dict[str, list[float]] = {"store": [], "read": [], "wake": []}
    for i, task_id in enumerate(ids):
        t0 = time.perf_counter()
        be.store_result(task_id, i, "SUCCESS")
        out["store"].append((time.perf_counter() - t0) * 1000)
    for task_id in ids:
        t0 = time.perf_counter()
        meta = be._get_task_meta_for(task_id)
        out["read"].append((time.perf_counter() - t0) * 1000)
        assert meta["status"] == "SUCCESS", meta
    for i in range(n):
        task_id = str(uuid.uuid4())
        result = waiter.AsyncResult(task_id)
        waiter.backend.add_pending_result(result)  # subscribe, as apply_async does
        done: list[float] = []
        ready = threading.Event()

        def wait(
            result: Any = result, done: list[float] = done, ready: threading.Event = ready
        ) -> None:
            ready.set()
            result.get(timeout=30)
            done.append(time.perf_counter())

        thread = threading.Thread(target=wait)
        thread.start()
        ready.wait()
        time.sleep(0.02)  # the waiter is past its first read, in select()
        t0 = time.perf_counter()
        be.store_result(task_id, i, "SUCCESS")
        thread.join(timeout=30)
        out["wake"].append((done[0] - t0) * 1000)
    writer.close()
    waiter.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default=DEFAULT_BROKER)
    parser.add_argument("--backend", action="append", default=[], metavar="NAME=URL")
    parser.add_argument("-n", type=int, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    backends = (
        dict(b.split("=", 1) for b in args.backend)
        if args.backend
        else default_backends(args.broker)
    )
    dsn = pg_dsn(args.broker)
    assert dsn
    ensure_database(dsn)
    results: dict[str, Any] = {}
    for name, url in backends.items():
        samples = steps(args.broker, url, args.n)
        results[name] = {step: percentiles(values) for step, values in samples.items()}
        print(name, json.dumps(results[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"n": args.n, "results": results}, indent=1) + "\n")
    print("| backend | store p50 / p99 ms | read p50 / p99 ms | store → get() woken p50 / p99 ms |")
    print("|---|---|---|---|")
    for name, r in results.items():
        cells = [f"{r[s]['p50_ms']} / {r[s]['p99_ms']}" for s in ("store", "read", "wake")]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
