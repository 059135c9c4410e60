"""Task-start overhead of Spark: Spark Connect (what SparkTask does) vs a classic session.

Usage::

    python benchmarks/spark_task_start.py [--cold 3] [--warm 20] \
        [--json benchmarks/results/spark_task_start.json]

What a Celery task pays before and around its Spark work, each followed by the same tiny
job (``spark.range(10).count()``, so the time includes one round trip of real work):

* **classic, cold**: a fresh Python process creates ``SparkSession.builder.master(
  "local[2]")`` (its own JVM, as the examples did before) and runs the job. A prefork pool
  process pays this on its first Spark task (~500 MB of JVM per pool process).
* **classic, warm**: the next tasks in that process reuse the session: the job only.
* **connect, cold**: a fresh Python process opens a task session on the running local
  Connect server (:func:`kombu_pgmq.spark.open_session`: deterministic session id, interrupt
  of leftovers, ``pgmq`` data source registration, progress handler), runs the job, releases
  the session. A pool process pays this on its first Spark task.
* **connect, warm**: the same per task in a process that already did it once (each task
  gets a session of its own; nothing is shared between tasks).
* **connect server start**: once per host (or never, with a cluster).

Cold numbers are wall times of a subprocess from the first import to the job's result
(interpreter start excluded); medians and ranges of ``--cold`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CLASSIC = """
import time, os
t0 = time.perf_counter()
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "8").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
assert spark.range(10).count() == 10
t1 = time.perf_counter()
warm = []
for _ in range(WARM):
    a = time.perf_counter()
    assert spark.range(10).count() == 10
    warm.append(time.perf_counter() - a)
import json; print(json.dumps({"cold": t1 - t0, "warm": warm}))
spark.stop()
"""

CONNECT = """
import os, time, uuid
t0 = time.perf_counter()
from kombu_pgmq.spark import open_session, register

def task():
    spark, _ = open_session(os.environ["SPARK_BENCH_URL"], str(uuid.uuid4()))
    register(spark)
    spark.registerProgressHandler(lambda *a, **k: None)
    assert spark.range(10).count() == 10
    spark.stop()

task()
t1 = time.perf_counter()
warm = []
for _ in range(WARM):
    a = time.perf_counter()
    task()
    warm.append(time.perf_counter() - a)
import json; print(json.dumps({"cold": t1 - t0, "warm": warm}))
"""


def run(code: str, warm: int, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", code.replace("WARM", str(warm))],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {
        "median_ms": round(statistics.median(ms), 1),
        "min_ms": round(ms[0], 1),
        "max_ms": round(ms[-1], 1),
        "n": len(ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", type=int, default=3, help="fresh processes per mode")
    parser.add_argument("--warm", type=int, default=20, help="tasks per process after the first")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from kombu_pgmq.spark import server

    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    port = server.local_port()
    was_running = server.accepting(port)
    server.stop(port)
    t0 = time.perf_counter()
    url = server.ensure_running()
    server_start = time.perf_counter() - t0

    # The URL carries the server's token: through the environment, not the command line.
    env["SPARK_BENCH_URL"] = url
    results: dict[str, Any] = {"connect_server_start_s": round(server_start, 2)}
    for mode, code in (("classic", CLASSIC), ("connect", CONNECT)):
        cold, warm = [], []
        for _ in range(args.cold):
            got = run(code, args.warm, env)
            cold.append(got["cold"])
            warm.extend(got["warm"])
        results[mode] = {"cold": summary(cold), "warm": summary(warm)}
    if not was_running:
        server.stop(port)

    print(f"Spark Connect server start (once per host): {results['connect_server_start_s']} s")
    print(f"{'':10}{'first task in a process':>28}{'each later task':>22}")
    for mode in ("classic", "connect"):
        c, w = results[mode]["cold"], results[mode]["warm"]
        print(
            f"{mode:10}{c['median_ms']:>12,.0f} ms ({c['min_ms']:,.0f}-{c['max_ms']:,.0f})"
            f"{w['median_ms']:>12,.1f} ms ({w['min_ms']:,.0f}-{w['max_ms']:,.0f})"
        )
    if args.json:
        results["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
        results["run_id"] = uuid.uuid4().hex[:8]
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
