"""Redelivery delay after kill -9: how long a task of a killed Celery worker waits
before another worker runs it again (lease renewal on, the default interval VT / 3).

Usage::

    python benchmarks/redelivery.py [--url postgresql://...] [--vt 3 --vt 30] [--kills 5] \
        [--json benchmarks/results/redelivery.json]

Two real ``celery worker`` subprocesses (the end-to-end tests' app and harness,
``tests/e2e``) consume ``celery``. Each round publishes a task that sleeps 10 minutes,
waits until it runs, lets it run a random 1-2 visibility timeouts more (so the kill falls
anywhere in the renewal cycle), SIGKILLs the holding worker's process group, and measures
from the kill to the start of the second run (``e2e_runs.started_at``, server clock). A
fresh worker replaces the killed one. Expected: between VT - interval and VT, plus up to
one ``polling_interval`` (1 s) for the survivor's fallback poll to find it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from brokers import ensure_database  # noqa: E402

from tests.e2e import celery_app  # noqa: E402
from tests.e2e.helpers import Worker, runs, wait_for  # noqa: E402


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def measure(url: str, vt: float, kills: int, workdir: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_")}
    env.update(
        KPT_BROKER_URL=url,
        KPT_VISIBILITY_TIMEOUT=str(vt),
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
    )
    app = celery_app.create_app(env)
    app.backend.ResultSession().close()
    db = psycopg.connect(url, autocommit=True)
    db.execute(celery_app.RUNS_DDL)
    workers: list[Worker] = []

    def new_worker() -> Worker:
        worker = Worker(f"r{len(workers)}", env, workdir / f"worker_{len(workers)}.log")
        workers.append(worker)
        worker.start()
        worker.wait_ready(app)
        return worker

    delays = []
    try:
        live = [new_worker(), new_worker()]
        for i in range(kills):
            result = app.tasks["e2e.record_and_sleep"].delay(600, 0.1)
            [first] = wait_for(lambda r=result: runs(db, r.id), 60, "the first run")
            time.sleep(vt * random.uniform(1.0, 2.0))
            holder = next(w for w in live if w.pid == parent_pid(first["pid"]))
            holder.kill()
            (killed_at,) = db.execute("SELECT clock_timestamp()").fetchone() or ()
            attempts = wait_for(
                lambda r=result: len(runs(db, r.id)) >= 2 and runs(db, r.id),
                vt + 60,
                "the second run",
            )
            delay = (attempts[1]["started_at"] - killed_at).total_seconds()
            delays.append(round(delay, 3))
            print(f"vt {vt:g} s, kill {i + 1}: run again {delay:.2f} s after kill -9", flush=True)
            result.get(timeout=60)
            live = [w for w in live if w is not holder] + [new_worker()]
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.stop()
        db.close()
        app.close()
    return {
        "visibility_timeout_s": vt,
        "lease_renewal_interval_s": round(vt / 3, 3),
        "delays_s": delays,
        "median_s": round(statistics.median(delays), 2),
        "max_s": max(delays),
        "min_s": min(delays),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_redelivery")
    parser.add_argument("--vt", type=float, action="append")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ensure_database(args.url)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for vt in args.vt or [3.0, 30.0]:
            results.append(measure(args.url, vt, args.kills, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"host_cpus": os.cpu_count(), "results": results}, fh, indent=2)
            fh.write("\n")


if __name__ == "__main__":
    main()
