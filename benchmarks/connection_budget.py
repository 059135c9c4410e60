"""Connection budget (issue 30, item 2, first measurement): how many PostgreSQL backends a
Celery worker host and a producer process hold, per pool type, idle and busy.

Usage::

    python benchmarks/connection_budget.py [--url postgresql://postgres@127.0.0.1:5432/kpb_conn]
        [--pools prefork threads solo] [--concurrency 2] [--tasks 400] [--json PATH]

For each pool type: a fresh database (created if missing, the queue purged), one
``celery -A celery_bench_app worker -P <pool> -c <concurrency>`` (Celery's defaults
otherwise: remote control and events as a user runs them), warmed up by one task; then
``pg_stat_activity`` of that database is sampled every 0.1 s for ``--idle-seconds``
(idle) and while ``--tasks`` noop tasks run (busy). Each backend is classed by the last
statement it ran (``LISTEN``: the wake-up listener; the heartbeat and consumer registry;
lease renewal; reads and acks; others by their first words). The producer: a process that
publishes one message with Kombu and keeps its connection open, sampled the same way.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import celery_bench  # noqa: E402
import celery_bench_app  # noqa: E402
from brokers import ensure_database, pg_dsn  # noqa: E402

CLASSES = (
    ("LISTEN", "listener (LISTEN)"),
    ("kombu_pgmq.heartbeat", "consumer heartbeat"),
    ("register_consumer", "consumer heartbeat"),
    ("kombu_pgmq.renew", "lease renewal"),
    ("kombu_pgmq.reap", "consumer heartbeat"),
    ("VACUUM", "maintenance (VACUUM)"),
    ("dead_tuples", "maintenance (VACUUM)"),
    ("WITH acked AS", "statements (reads, acks)"),
    ("kombu_pgmq.read", "statements (reads, acks)"),
    ("wait_for", "statements (reads, acks)"),
    ("WITH locked AS", "statements (publishes)"),
    ("kombu_pgmq.publish", "statements (publishes)"),
)


def classify(query: str) -> str:
    text = " ".join(query.split())
    for needle, name in CLASSES:
        if needle in text:
            return name
    return "other: " + text[:40]


def sample(dsn: str, seconds: float) -> dict[str, Any]:
    """Most backends seen at once on the database of ``dsn`` over ``seconds``, with the
    classes of that busiest sample."""
    most: list[tuple[str, str]] = []
    end = time.monotonic() + seconds
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            rows = conn.execute(
                "SELECT state, query FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend'"
            ).fetchall()
            if len(rows) > len(most):
                most = [(str(s), str(q)) for s, q in rows]
            if time.monotonic() >= end:
                break
            time.sleep(0.1)
    classes = collections.Counter(classify(q) for _, q in most)
    return {"backends": len(most), "by_class": dict(sorted(classes.items()))}


class PoolWorker(celery_bench.Worker):
    """celery_bench's worker with another pool and Celery's default flags."""

    def __init__(self, pool: str, concurrency: int, *args: Any) -> None:
        super().__init__(*args)
        self.pool = pool
        self.concurrency = concurrency

    def start(self) -> None:
        cmd = [sys.executable, "-m", "celery", "-A", "celery_bench_app", "worker"]
        cmd += ["-P", self.pool, "-c", str(self.concurrency), "-l", "warning"]
        cmd += ["-n", f"budget-{self.pool}@%h"]
        with self.out.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=HERE,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )


def measure_pool(url: str, pool: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    log = workdir / f"{pool}.log"
    log.write_text("")
    app = celery_bench_app.create_app(url, {})
    celery_bench.purge(app)
    worker = PoolWorker(pool, args.concurrency, pool, url, {}, log, workdir / f"{pool}.out")
    worker.start()
    try:
        app.tasks["bench.ping"].apply_async()
        celery_bench.wait_log(log, worker, lambda rows: celery_bench.count("ping", rows) >= 1, 60)
        time.sleep(2)  # background services settle
        idle = sample(pg_dsn(url) or url, args.idle_seconds)
        for i in range(args.tasks):
            app.tasks["bench.noop"].apply_async((i,))
        busy = sample(pg_dsn(url) or url, 1.5)
        celery_bench.wait_log(
            log, worker, lambda rows: celery_bench.count("noop", rows) >= args.tasks, 120
        )
    finally:
        worker.stop()
        app.close()
    return {"pool": pool, "concurrency": args.concurrency, "idle": idle, "busy": busy}


def measure_producer(url: str) -> dict[str, Any]:
    """A process that published one message and keeps its Kombu connection."""
    code = (
        "import sys, time, kombu, kombu_pgmq\n"
        "with kombu.Connection(sys.argv[1]) as c:\n"
        "    kombu.Producer(c).publish({'x': 1}, routing_key='budget_producer',"
        " declare=[kombu.Queue('budget_producer')])\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(30)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, url], stdout=subprocess.PIPE, cwd=HERE.parent, text=True
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        return {"producer": sample(pg_dsn(url) or url, 2.0)}
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_conn")
    parser.add_argument("--pools", nargs="*", default=["prefork", "threads", "solo"])
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ensure_database(args.url)
    workdir = Path(tempfile.mkdtemp(prefix="connection_budget-"))
    results: list[dict[str, Any]] = []
    for pool in args.pools:
        try:
            results.append(measure_pool(args.url, pool, args, workdir))
        except Exception as exc:  # one pool failing must not hide the others
            results.append({"pool": pool, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(results[-1]), flush=True)
    results.append(measure_producer(args.url))
    print(json.dumps(results[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"url": args.url, "results": results}, indent=2) + "\n")
    for path in workdir.iterdir():
        with contextlib.suppress(OSError):
            path.unlink()
    with contextlib.suppress(OSError):
        workdir.rmdir()
    os.environ.pop("CELERY_BENCH_LOG", None)


if __name__ == "__main__":
    main()
