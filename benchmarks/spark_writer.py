"""Rows/s of the ``pgmq`` data source: ``df.write.format("pgmq")`` and the snapshot reader.

Usage::

    python benchmarks/spark_writer.py [--url postgresql://...] [--rows 200000] \
        [--partitions 2] [--json benchmarks/results/spark_writer.json]

On the local Spark Connect server (started if needed, ``local[*]``), into a fresh database:

* rows as Kombu messages (4 columns), ``batch_size`` 1000 and 5000 (default);
* rows as Celery task messages (one task per row);
* reading them back: ``spark.read.format("pgmq")`` of the queue, ``count()`` (every row
  goes through the Python reader; no pushdown).

Each write is timed from ``save()`` to its return (planning, staging in ``--partitions``
Spark tasks, the driver's commit that makes them visible). For scale: a Kombu producer
publishes ~600 messages/s on one connection here (``benchmarks/kombu_throughput.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from brokers import DEFAULT_BROKERS, ensure_database

from kombu_pgmq import schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_url = DEFAULT_BROKERS["kombu_pgmq"].replace("kpb_ours", "kpb_spark")
    parser.add_argument("--url", default=default_url)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    from kombu_pgmq.spark import register, server

    ensure_database(args.url)
    schema.bootstrap(args.url)
    url = server.ensure_running()
    spark = SparkSession.builder.remote(url).create()
    register(spark)
    df = spark.range(0, args.rows, 1, args.partitions).selectExpr(
        "id", "concat('flight-', id) AS name", "id % 24 AS hour", "rand() * 60 AS delay"
    )
    results: dict[str, Any] = {"rows": args.rows, "partitions": args.partitions, "runs": []}

    def timed(label: str, queue: str, **options: str) -> None:
        with psycopg.connect(args.url, autocommit=True) as conn:  # start from an empty queue
            conn.execute(
                "SELECT pgmq.drop_queue(queue_name) FROM pgmq.meta WHERE queue_name = %s",
                (queue,),
            )
        t0 = time.perf_counter()
        df.write.format("pgmq").options(url=args.url, queue=queue, **options).mode("append").save()
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = spark.read.format("pgmq").options(url=args.url, queue=queue).load().count()
        read_s = time.perf_counter() - t0
        assert n == args.rows, (n, args.rows)
        run = {
            "label": label,
            "write_s": round(write_s, 2),
            "write_rows_per_s": round(args.rows / write_s),
            "read_s": round(read_s, 2),
            "read_rows_per_s": round(args.rows / read_s),
        }
        results["runs"].append(run)
        print(
            f"{label:<34} write {run['write_rows_per_s']:>8,} rows/s ({write_s:.1f} s)"
            f"   read {run['read_rows_per_s']:>8,} rows/s ({read_s:.1f} s)"
        )

    timed("rows as messages, batch 1000", "bench_rows", batch_size="1000")
    timed("rows as messages, batch 5000", "bench_rows", batch_size="5000")
    timed("one Celery task per row", "bench_tasks", task="bench.process")
    spark.stop()
    if args.json:
        results["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
