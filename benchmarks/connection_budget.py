"""Connection budget (issue 30, item 2): how many PostgreSQL backends a Celery worker and a
producer process hold, per pool type and feature, idle and busy, counted per role.

Usage::

    python benchmarks/connection_budget.py [--url postgresql://postgres@127.0.0.1:5432/kpb_conn]
        [--pools prefork threads solo gevent] [--variants plain results beat events]
        [--concurrency 2] [--tasks 400] [--json PATH]

For each pool type and variant (``plain``: Celery's defaults, no result backend;
``results``: ``result_backend = "postgresql://"``; ``beat``: ``-B`` with
``kombu_pgmq.beat:Scheduler``; ``events``: ``-E``): a fresh database, one ``celery -A
celery_bench_app worker -P <pool> -c <concurrency>`` (worker heartbeat events on, as
Celery's default), transport options ``consumer_heartbeat_interval=1`` and
``lease_renewal_interval=1`` so the background services show within the samples; warmed
up by one task; then ``pg_stat_activity`` of that database is sampled every 0.1 s for
``--idle-seconds`` (idle) and while ``--tasks`` noop tasks run (busy). Each backend is
counted by its role (``application_name`` ``kombu_pgmq:<role>``, see
``docs/connections.md``). Producers: a Kombu producer after one publish, and a Celery
producer after ``get()`` with the result backend.
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
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import celery_bench  # noqa: E402
import celery_bench_app  # noqa: E402

VARIANTS = ("plain", "results", "beat", "events")
GREEN_BEAT = "Celery refuses -B with gevent/eventlet pools: run `celery beat` beside it"
#: Background services on short intervals, so their connections show within the samples.
SERVICE_OPTIONS = {"consumer_heartbeat_interval": 1.0, "lease_renewal_interval": 1.0}


def role(application_name: str) -> str:
    """``kombu_pgmq:listener`` -> ``listener``; another name is kept whole."""
    return application_name.removeprefix("kombu_pgmq:") or "(unnamed)"


def sample(dsn: str, seconds: float) -> dict[str, Any]:
    """Most backends seen at once on the database of ``dsn`` over ``seconds`` (the
    benchmark's own, ``kpb_bench*``, left out), with the roles of that busiest sample."""
    most: list[str] = []
    end = time.monotonic() + seconds
    with psycopg.connect(dsn, autocommit=True, application_name="kpb_bench") as conn:
        while True:
            rows = conn.execute(
                "SELECT application_name FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend' AND application_name NOT LIKE 'kpb\\_bench%%'"
            ).fetchall()
            if len(rows) > len(most):
                most = [str(name) for (name,) in rows]
            if time.monotonic() >= end:
                break
            time.sleep(0.1)
    roles = collections.Counter(role(name) for name in most)
    return {"backends": len(most), "by_role": dict(sorted(roles.items()))}


def _database(url: str, suffix: str) -> str:
    """``url`` with its database name + ``_<suffix>``, created empty (dropped first)."""
    parts = urlsplit(url)
    name = f"{parts.path.lstrip('/') or 'kpb_conn'}_{suffix}"
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return urlunsplit(parts._replace(path=f"/{name}"))


def _drop(url: str) -> None:
    parts = urlsplit(url)
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        name = sql.Identifier(parts.path.lstrip("/"))
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))


def _tagged(url: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name=kpb_bench"


class PoolWorker(celery_bench.Worker):
    """celery_bench's worker with another pool, Celery's default flags and more."""

    def __init__(self, pool: str, concurrency: int, flags: list[str], *args: Any) -> None:
        super().__init__(*args)
        self.pool = pool
        self.concurrency = concurrency
        self.flags = tuple(flags)
        self.node_prefix = "budget"
        self.name = pool


def measure_pool(
    base: str, pool: str, variant: str, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    url = _database(base, f"{pool}_{variant}")
    log = workdir / f"{pool}-{variant}.log"
    log.write_text("")
    app = celery_bench_app.create_app(_tagged(url), {})
    flags = {"beat": ["-B"], "events": ["-E"]}.get(variant, [])
    out = workdir / f"{pool}-{variant}.out"
    worker = PoolWorker(pool, args.concurrency, flags, pool, url, SERVICE_OPTIONS, log, out)
    if variant == "results":
        worker.env["CELERY_BENCH_RESULT_BACKEND"] = "postgresql://"
    if variant == "beat":
        worker.env["CELERY_BENCH_BEAT"] = "1"
    worker.start()
    try:
        app.tasks["bench.ping"].apply_async()
        celery_bench.wait_log(log, worker, lambda rows: celery_bench.count("ping", rows) >= 1, 60)
        time.sleep(2)  # background services settle
        idle = sample(url, args.idle_seconds)
        for i in range(args.tasks):
            app.tasks["bench.noop"].apply_async((i,), ignore_result=variant != "results")
        busy = sample(url, 1.5)
        celery_bench.wait_log(
            log, worker, lambda rows: celery_bench.count("noop", rows) >= args.tasks, 120
        )
        after = sample(url, args.idle_seconds)
    finally:
        worker.stop()
        app.close()
        _drop(url)
    return {
        "pool": pool,
        "variant": variant,
        "concurrency": args.concurrency,
        "idle": idle,
        "busy": busy,
        "after": after,
    }


KOMBU_PRODUCER = (
    "import sys, kombu, kombu_pgmq\n"
    "with kombu.Connection(sys.argv[1]) as c:\n"
    "    kombu.Producer(c).publish({'x': 1}, routing_key='budget_producer',"
    " declare=[kombu.Queue('budget_producer')])\n"
    "    print('ready', flush=True)\n"
    "    sys.stdin.read()\n"
)
CELERY_PRODUCER = (
    "import sys, celery_bench_app\n"
    "app = celery_bench_app.create_app(sys.argv[1])\n"
    "app.conf.result_backend = 'postgresql://'\n"
    "app.conf.task_ignore_result = False\n"
    "app.tasks['bench.ping'].apply_async(ignore_result=False).get(timeout=60)\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


def measure_producers(base: str, workdir: Path) -> list[dict[str, Any]]:
    """A Kombu producer after one publish; a Celery producer after one ``get()`` (the
    result backend on; a solo worker without events answers it, its connections left
    out of the count by a name of their own)."""
    url = _database(base, "producer")
    found = []
    log = workdir / "producer.log"
    log.write_text("")
    worker = PoolWorker(
        "solo",
        1,
        ["--without-heartbeat", "--without-gossip", "--without-mingle"],
        "p",
        url,
        {},
        log,
        workdir / "producer.out",
    )
    worker.env["CELERY_BENCH_BROKER"] = url + "?application_name=kpb_bench_worker"
    worker.env["CELERY_BENCH_RESULT_BACKEND"] = "postgresql://"
    worker.start()
    env = {**worker.env, "CELERY_BENCH_RESULT_BACKEND": ""}
    try:
        for name, code in (
            ("kombu producer", KOMBU_PRODUCER),
            ("celery producer, get()", CELERY_PRODUCER),
        ):
            proc = subprocess.Popen(
                [sys.executable, "-c", code, url],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=HERE,
                env=env,
                text=True,
            )
            try:
                assert proc.stdout is not None
                proc.stdout.readline()
                found.append({"producer": name, "idle": sample(url, 2.0)})
            finally:
                proc.kill()
                proc.communicate()
            print(json.dumps(found[-1]), flush=True)
    finally:
        worker.stop()
        _drop(url)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_conn")
    parser.add_argument("--pools", nargs="*", default=["prefork", "threads", "solo", "gevent"])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="connection_budget-"))
    results: list[dict[str, Any]] = []
    for pool in args.pools:
        for variant in args.variants:
            if pool in ("gevent", "eventlet") and variant == "beat":
                results.append({"pool": pool, "variant": variant, "skipped": GREEN_BEAT})
                continue
            try:
                results.append(measure_pool(args.url, pool, variant, args, workdir))
            except Exception as exc:  # one case failing must not hide the others
                results.append(
                    {"pool": pool, "variant": variant, "error": f"{type(exc).__name__}: {exc}"}
                )
            print(json.dumps(results[-1]), flush=True)
    results.extend(measure_producers(args.url, workdir))
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
