"""Do queues of dead Celery workers pile up? Start/stop cycles of real workers.

Usage::

    python benchmarks/worker_cycles.py [URL] [--cycles 20] [--heartbeat 1] [--stale-after 3]

URL (or ``$KOMBU_PGMQ_URL``): ``postgresql://`` URL of a scratch database (the schema is
installed if missing; queue ``celery`` and the Celery result tables are created there).
Each cycle starts ``celery worker`` (tests/e2e/celery_app.py, prefork, 2 processes,
queue ``celery``), waits until it answers a remote-control ping, then stops it: odd
cycles with SIGTERM (warm shutdown), even ones with SIGKILL of its process group. Every
worker has one auto_delete queue, its pidbox ``<node>.celery.pidbox``; a clean shutdown
drops it at once, a killed worker's stays until its consumers are stale (``--stale-after``
seconds without heartbeat) and a reaper runs: the next worker's connect or heartbeat
thread, or finally our own connect.

Prints the number of PGMQ queues (``pgmq.meta``) before, after each cycle and after the
final reap, with the names of the queues left.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from kombu import Connection, Exchange, Queue

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import kombu_pgmq  # noqa: E402,F401  (registers postgresql://)
from kombu_pgmq._conninfo import redact  # noqa: E402
from tests.e2e import celery_app  # noqa: E402
from tests.e2e.helpers import Worker  # noqa: E402


def queues(url: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT queue_name FROM pgmq.meta ORDER BY queue_name").fetchall()
    return [row[0] for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", nargs="?", default=os.environ.get("KOMBU_PGMQ_URL"))
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat interval (s)")
    parser.add_argument("--stale-after", type=float, default=3.0, help="consumer_stale_after")
    args = parser.parse_args()
    if not args.url:
        parser.error("give a URL or set KOMBU_PGMQ_URL")
    # Readiness pings are broadcast before a starting worker has bound its pidbox queue:
    # the transport warns for each such unroutable message. Not what we measure.
    logging.getLogger("kombu_pgmq.transport").setLevel(logging.ERROR)
    url: str = args.url
    options = {
        "consumer_heartbeat_interval": args.heartbeat,
        "consumer_stale_after": args.stale_after,
    }

    env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_")}
    env.update(
        KPT_BROKER_URL=url,
        KPT_CONSUMER_HEARTBEAT_INTERVAL=str(args.heartbeat),
        KPT_CONSUMER_STALE_AFTER=str(args.stale_after),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    with Connection(url, transport_options=options) as conn:
        # Installs the schema if missing and reaps; the durable queue every worker consumes.
        Queue("celery", Exchange("celery"), "celery")(conn.default_channel).declare()
    app = celery_app.create_app(env)
    app.backend.ResultSession().close()  # result tables, before the workers race to

    print(
        f"{redact(url)}: {args.cycles} cycles, heartbeat {args.heartbeat} s, "
        f"stale after {args.stale_after} s"
    )
    before = queues(url)
    print(f"before:        {len(before):3d} PGMQ queues {before}")
    logs = Path(tempfile.mkdtemp(prefix="worker_cycles_"))
    for cycle in range(1, args.cycles + 1):
        name = f"cycle{cycle}_{uuid.uuid4().hex[:6]}"
        worker = Worker(name, env, logs / f"{name}.log", own_queue=False)
        started = time.monotonic()
        worker.start()
        worker.wait_ready(app)
        ready = time.monotonic()
        if cycle % 2:
            how, code = "SIGTERM", worker.stop()
        else:
            how, code = "SIGKILL", None
            worker.kill()
        stopped = time.monotonic()
        now = queues(url)
        print(
            f"cycle {cycle:2d} {how}: {len(now):3d} PGMQ queues"
            f"  (ready in {ready - started:.1f} s, exited in {stopped - ready:.1f} s"
            f"{'' if code is None else f', code {code}'})"
        )
    wait = args.stale_after + args.heartbeat
    time.sleep(wait)
    reap_start = time.perf_counter()
    with Connection(url, transport_options=options) as conn:
        conn.connect()  # reaps on connect
        dropped = conn.transport.reap()  # (nothing left by now)
    reap_s = time.perf_counter() - reap_start
    after = queues(url)
    print(
        f"after reaper:  {len(after):3d} PGMQ queues {after}"
        f"  (connect {wait:.0f} s after the last cycle, {reap_s * 1000:.0f} ms; "
        f"second reap dropped {len(dropped)})"
    )
    print(f"worker logs: {logs}")
    app.close()


if __name__ == "__main__":
    main()
