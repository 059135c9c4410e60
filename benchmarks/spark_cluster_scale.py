"""DataFrame <-> queue at scale on a real Spark standalone cluster (issue 18).

Usage::

    apt-get install libpostgresql-jdbc-java     # the JDBC baseline's driver
    python benchmarks/spark_cluster_scale.py [--url postgresql://...:5432/kpb_spark_scale] \
        [--rows 5000000] [--stream-rows 1000000] [--partitions 8] \
        [--json benchmarks/results/spark_cluster_scale.json]

Starts a cluster of its own (:mod:`kombu_pgmq.spark.cluster`: master + 2 workers of 1 core
and 1 GiB executors on 127.0.0.1, free ports) and a Connect server on it with the
PostgreSQL JDBC driver on its class path (``spark.jars``), then measures:

1. ``df.write.format("pgmq")`` of ``--rows`` rows (4 columns) into a queue: rows/s, peak
   RSS of the driver (the Connect server's JVM) and peak private memory (RssAnon) of the
   PostgreSQL backends, sampled every 0.25 s;
2. the same DataFrame with ``df.write.jdbc`` into a plain table (Spark's default batch of
   1000 rows), and with ``reWriteBatchedInserts=true`` (multi-row INSERTs);
3. ``spark.readStream.format("pgmq")`` of ``--stream-rows`` messages into a Parquet sink
   (checkpointed): once 40 % of the messages are archived, the driver (Connect server JVM)
   is killed with SIGKILL, restarted, and the query restarted from its checkpoint with
   ``trigger(availableNow=True)``. Exactly once = the sink holds every msg_id once.

The URL must be TCP: the executors connect to it themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from brokers import ensure_database

from kombu_pgmq import schema

JDBC_JAR = "/usr/share/java/postgresql.jar"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Sampler:
    """Peak RSS of the driver JVM and peak RssAnon of the database's backends (MiB)."""

    def __init__(self, url: str, driver_pid: int) -> None:
        self.url, self.driver_pid = url, driver_pid
        self.driver_peak = self.backend_peak = self.backends_sum_peak = 0
        self.backends_max = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        dbname = self.url.rsplit("/", 1)[-1].split("?")[0]
        with psycopg.connect(self.url, autocommit=True) as conn:
            me = conn.info.backend_pid
            while not self._stop.wait(0.25):
                pids = [
                    r[0]
                    for r in conn.execute(
                        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> %s",
                        (dbname, me),
                    )
                ]
                anon = [_status_kib(p, "RssAnon") for p in pids]
                self.backend_peak = max(self.backend_peak, max(anon, default=0))
                self.backends_sum_peak = max(self.backends_sum_peak, sum(anon))
                self.backends_max = max(self.backends_max, len(pids))
                self.driver_peak = max(self.driver_peak, _status_kib(self.driver_pid, "VmRSS"))

    def result(self) -> dict[str, Any]:
        return {
            "driver_rss_peak_mib": round(self.driver_peak / 1024),
            "backend_rss_anon_peak_mib": round(self.backend_peak / 1024, 1),
            "backends_rss_anon_sum_peak_mib": round(self.backends_sum_peak / 1024, 1),
            "backends_max": self.backends_max,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_spark_scale")
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--stream-rows", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not Path(JDBC_JAR).exists():
        sys.exit(f"{JDBC_JAR} is missing: apt-get install libpostgresql-jdbc-java")

    work = Path(tempfile.mkdtemp(prefix="kpb-spark-scale-"))
    os.environ["KOMBU_PGMQ_SPARK_CLUSTER_DIR"] = str(work / "cluster")
    os.environ["KOMBU_PGMQ_SPARK_DIR"] = str(work / "connect")
    from pyspark.sql import SparkSession

    from kombu_pgmq.spark import cluster, register, server

    ensure_database(args.url)
    schema.bootstrap(args.url)
    ports = {k: _free_port() for k in ("master", "webui", "connect")}
    t0 = time.perf_counter()
    cluster.start(workers=2, cores=1, port=ports["master"], webui_port=ports["webui"])
    conf = {
        "spark_connect_port": ports["connect"],
        "spark_local_master": cluster.master_url(ports["master"]),
        "spark_local_conf": {**cluster.application_conf(ports["master"]), "spark.jars": JDBC_JAR},
    }
    url = server.ensure_running(conf)
    print(f"cluster + Connect server up in {time.perf_counter() - t0:.1f} s ({work})")
    results: dict[str, Any] = {
        "rows": args.rows,
        "stream_rows": args.stream_rows,
        "partitions": args.partitions,
        "cluster": "standalone, 2 workers x 1 core, executors 1 GiB, 127.0.0.1",
        "runs": {},
    }

    def session() -> Any:
        spark = SparkSession.builder.remote(url).create()
        register(spark)
        return spark

    def frame(spark: Any, rows: int) -> Any:
        return spark.range(0, rows, 1, args.partitions).selectExpr(
            "id", "concat('flight-', id) AS name", "id % 24 AS hour", "rand() * 60 AS delay"
        )

    def drop(queue: str) -> None:
        with psycopg.connect(args.url, autocommit=True) as conn:
            conn.execute(
                "SELECT pgmq.drop_queue(queue_name) FROM pgmq.meta WHERE queue_name = %s",
                (queue,),
            )
            conn.execute("DROP TABLE IF EXISTS jdbc_rows")

    def timed(label: str, write: Any, spark: Any) -> None:
        pid = server.status(ports["connect"])["pid"]
        with Sampler(args.url, pid) as sampler:
            t = time.perf_counter()
            write()
            seconds = time.perf_counter() - t
        run = {"seconds": round(seconds, 1), "rows_per_s": round(args.rows / seconds)}
        run.update(sampler.result())
        results["runs"][label] = run
        print(f"{label:<38} {run['rows_per_s']:>8,} rows/s ({seconds:.1f} s)  {sampler.result()}")

    spark = session()
    df = frame(spark, args.rows)
    drop("scale_rows")
    timed(
        "pgmq data source",
        lambda: (
            df.write.format("pgmq").options(url=args.url, queue="scale_rows").mode("append").save()
        ),
        spark,
    )
    with psycopg.connect(args.url, autocommit=True) as conn:
        n = conn.execute("SELECT count(*) FROM pgmq.q_scale_rows WHERE vt <= now()").fetchone()
        assert n is not None and n[0] == args.rows, n
    drop("scale_rows")  # free the disk before the next write
    jdbc = "jdbc:postgresql://" + args.url.split("@", 1)[1]
    user = args.url.split("://", 1)[1].split("@", 1)[0]
    for label, extra in (
        ("df.write.jdbc (batch 1000)", ""),
        ("df.write.jdbc, reWriteBatchedInserts", "?reWriteBatchedInserts=true"),
    ):
        drop("none")
        timed(
            label,
            lambda extra=extra: df.write.jdbc(
                jdbc + extra,
                "jdbc_rows",
                mode="overwrite",
                properties={"user": user, "driver": "org.postgresql.Driver"},
            ),
            spark,
        )
    drop("none")

    # -- stream: 1M messages into a Parquet sink, the driver killed mid-way --------------
    queue, sink, checkpoint = "scale_stream", work / "sink", work / "checkpoint"
    drop(queue)
    frame(spark, args.stream_rows).write.format("pgmq").options(url=args.url, queue=queue).mode(
        "append"
    ).save()
    spark.stop()

    def start_query(spark: Any, available_now: bool) -> Any:
        stream = (
            spark.readStream.format("pgmq")
            .options(url=args.url, queue=queue, max_messages="20000")
            .load()
            .select("msg_id", "message")
            .writeStream.format("parquet")
            .option("path", str(sink))
            .option("checkpointLocation", str(checkpoint))
        )
        if available_now:
            return stream.trigger(availableNow=True).start()
        return stream.trigger(processingTime="0 seconds").start()

    def archived() -> int:
        with psycopg.connect(args.url, autocommit=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM pgmq.a_{queue}").fetchone()
            return int(row[0]) if row else 0

    spark = session()
    t = time.perf_counter()
    start_query(spark, available_now=False)
    while archived() < 0.4 * args.stream_rows:
        time.sleep(0.2)
    before_kill = archived()
    first_s = time.perf_counter() - t
    pid = server.status(ports["connect"])["pid"]
    os.kill(pid, signal.SIGKILL)
    print(f"stream: {before_kill:,} archived in {first_s:.1f} s; driver pid {pid} killed -9")
    t = time.perf_counter()
    # The kernel closes the dead JVM's listening socket a moment after SIGKILL: until then
    # ensure_running() sees a listener that is not the recorded server and refuses it.
    while server.accepting(ports["connect"]) and time.perf_counter() - t < 30:
        time.sleep(0.1)
    url = server.ensure_running(conf)
    restart_s = time.perf_counter() - t
    spark = session()
    t = time.perf_counter()
    query = start_query(spark, available_now=True)
    query.awaitTermination()
    second_s = time.perf_counter() - t
    written = spark.read.parquet(str(sink))
    total = written.count()
    distinct = written.select("msg_id").distinct().count()
    left = args.stream_rows - archived()
    spark.stop()
    stream = {
        "first_run_archived": before_kill,
        "first_run_s": round(first_s, 1),
        "first_run_rows_per_s": round(before_kill / first_s),
        "driver_restart_s": round(restart_s, 1),
        "restart_run_s": round(second_s, 1),
        "restart_run_rows_per_s": round((args.stream_rows - before_kill) / second_s),
        "sink_rows": total,
        "sink_distinct_msg_ids": distinct,
        "exactly_once": total == distinct == args.stream_rows,
        "left_in_queue_until_next_run": left,
    }
    results["stream"] = stream
    print(f"stream: {stream}")
    server.stop(ports["connect"])
    cluster.stop(ports["master"])
    if args.json:
        results["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
