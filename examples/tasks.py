"""Example tasks: arithmetic, pandas on real data, a retrying task, and a Spark job."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from celery.signals import worker_process_shutdown

from . import spark_flights
from .celeryapp import app


@app.task
def add(x: float, y: float) -> float:
    return x + y


@app.task
def mul(x: float, y: float) -> float:
    return x * y


@app.task
def xsum(numbers: list[float]) -> float:
    return sum(numbers)


class TransientError(Exception):
    """Stands for a failure that goes away on its own (a timeout, a 503, a lock)."""


@app.task(bind=True, max_retries=5)
def flaky(self, fail_times: int = 2) -> dict[str, int]:
    """Fail the first *fail_times* attempts, then succeed: retried by Celery, 1 s apart.

    Deterministic: the attempt number is ``self.request.retries``, carried in the message.
    """
    attempt = self.request.retries + 1
    if self.request.retries < fail_times:
        raise self.retry(
            exc=TransientError(f"attempt {attempt} of {fail_times + 1} fails on purpose"),
            countdown=1,
        )
    return {"attempts": attempt, "retries": self.request.retries}


@functools.lru_cache(maxsize=1)
def _flights() -> Any:
    """The flights table (pandas), read once per worker process (~0.5 s)."""
    import pandas as pd

    return pd.read_csv(
        spark_flights.data_dir() / "flights.csv.zip",
        usecols=["month", "origin", "dest", "carrier", "dep_delay", "distance"],
    )


@app.task
def flights_in_month(month: int) -> int:
    """Number of flights that left NYC in *month* (1-12) of 2013."""
    if not 1 <= month <= 12:
        raise ValueError(f"month must be 1..12, not {month!r}")
    flights = _flights()
    return int((flights["month"] == month).sum())


@app.task
def busiest_routes(n: int = 3) -> list[dict[str, Any]]:
    """The *n* routes with the most flights, with distance and share delayed > 15 min."""
    flights = _flights()
    routes = (
        flights.assign(late=flights["dep_delay"] > 15)
        .groupby(["origin", "dest"])
        .agg(flights=("late", "size"), late=("late", "mean"), miles=("distance", "first"))
        .sort_values(["flights", "origin", "dest"], ascending=[False, True, True])
        .head(n)
    )
    return [
        {
            "origin": origin,
            "dest": dest,
            "flights": int(row.flights),
            "miles": int(row.miles),
            "late_pct": round(100 * float(row.late), 1),
        }
        for (origin, dest), row in routes.iterrows()
    ]


@app.task(time_limit=600)
def spark_delay_by_carrier() -> dict[str, Any]:
    """Mean departure delay by carrier, computed by Spark (local[2]) in this worker process.

    The first call in a process starts the Spark session (JVM); later calls reuse it.
    """
    t0 = time.perf_counter()
    cold = not spark_flights.has_spark()
    spark = spark_flights.get_spark()
    t1 = time.perf_counter()
    rows = spark_flights.delay_by_carrier(spark)
    t2 = time.perf_counter()
    return {
        "carriers": rows,
        "flights": sum(r["flights"] for r in rows),
        "session_start_s": round(t1 - t0, 2),
        "session_was_cold": cold,
        "job_s": round(t2 - t1, 2),
        "pid": os.getpid(),
    }


@worker_process_shutdown.connect
def _stop_spark(**_: Any) -> None:
    spark_flights.stop_spark()
