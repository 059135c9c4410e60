"""A long transaction elsewhere in the database while messages flow: what happens to
consumed/s, published/s, latency, dead tuples and backlog.

Usage (from the repository root)::

    python benchmarks/held_snapshot.py [--target kombu_pgmq] [--rate 500] \
        [--before 30] [--hold 600] [--after 300] [--interval 10] \
        [--json benchmarks/results/held_snapshot_kombu_pgmq.json]

One producer process publishes small messages at ``--rate`` per second (paced: a
publish due while the previous one still runs goes out late, and the producer's lag is
reported), one consumer process consumes them (prefetch 10, one ack per message). After
``--before`` seconds a third session in the same database opens a ``REPEATABLE READ``
transaction, runs one ``SELECT`` and stays open for ``--hold`` seconds (what an
analytics query, ``pg_dump`` or a session idle in transaction does to the xmin
horizon), then commits; the run goes on ``--after`` seconds. Every ``--interval``
seconds a line: published/s, consumed/s, publish-to-consume latency p50 / p99 (ms, from
the timestamp in the message), the queue table's dead tuples and size (``table_bytes``
with its indexes, ``heap_bytes`` without), the backlog (published - consumed) and
``horizon_s``, the age of the oldest snapshot open in the database (the holder's).

``--consumer celery``: a Celery worker (solo pool, late acks, prefetch 10) runs a task per
message (sent with ``send_task``) instead of the Kombu consumer; ``--no-hold``: the same
phases with nothing held (the pair of a held run). ``--holder spark``: the snapshot is
held by a Spark job instead (PySpark ``local[1]``, PostgreSQL's JDBC driver from Debian's
``libpostgresql-jdbc-java``, started before the run so the JVM is warm): its JDBC read of
the same database streams one slow query (10 rows a second, fetch size 50) for the whole
hold, one statement and so one snapshot, as a pipeline reading a large table holds it;
cancelled at the release. With ``--private-server`` that server then also listens on
127.0.0.2 (JDBC has no Unix sockets).

Targets (``--target``, repeatable; each runs on its own, one after the other):

* ``kombu_pgmq``: this transport (``--url``, a database created if missing);
* ``pgmq``: raw ``pgmq.send`` / ``pgmq.read`` (vt 30 s, 10 a read, polling every 10 ms
  when empty) / ``pgmq.archive`` on the same kind of database (PGMQ's SQL from the
  ``pgmq`` package if the extension is not installed);
* ``redis``, ``rabbitmq``: the same Kombu producer and consumer on those brokers (the
  held snapshot is still taken in the PostgreSQL database: it changes nothing there).

The local server's ``autovacuum`` setting is reported with the results: with it off, only
the transport's maintenance VACUUM cleans the queue table. ``--private-server`` runs the
PostgreSQL targets on a throwaway PostgreSQL 15 with ``pg_stat_statements`` instead
(:mod:`limits`'s, autovacuum on) and reports, per phase (before, held, after), each
statement's calls and mean server time: where the time goes while the snapshot is held.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import psycopg  # noqa: E402
from brokers import ensure_database, ensure_sql_pgmq  # noqa: E402

QUEUE = "kpb_held"
JDBC_JAR = "/usr/share/java/postgresql.jar"
#: application_name of the Spark job's JDBC session (cancelled at the release)
SPARK_APP = "held_snapshot_spark"
URLS = {
    "kombu_pgmq": "postgresql://postgres@127.0.0.1:5432/kpb_held_snapshot",
    "pgmq": "postgresql://postgres@127.0.0.1:5432/kpb_held_snapshot_raw",
    "redis": "redis://127.0.0.1:6379/5",
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672//",
}


# -- producer and consumer processes ---------------------------------------------------


def _celery_app(url: str) -> Any:
    """The Celery app of ``--consumer celery``: one task, ``held.seen(t)``, on queue
    QUEUE; no result backend (the latency is measured where the task runs)."""
    from celery import Celery

    import kombu_pgmq  # noqa: F401

    app = Celery("held", broker=url)
    app.conf.update(
        task_default_queue=QUEUE,
        task_acks_late=True,
        worker_prefetch_multiplier=10,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        worker_send_task_events=False,
        task_ignore_result=True,
    )
    return app


def _producer(
    target: str, url: str, rate: float, stop: Any, published: Any, lag: Any, celery: bool
) -> None:
    """Publish ``{"t": time.time()}`` at ``rate`` per second until ``stop`` is set
    (``celery``: a task ``held.seen(t)`` sent with ``send_task``)."""
    with contextlib.ExitStack() as stack:
        if celery:
            app = _celery_app(url)

            def send() -> None:
                app.send_task("held.seen", args=[time.time()], queue=QUEUE)

        elif target == "pgmq":
            conn = stack.enter_context(psycopg.connect(url, autocommit=True))

            def send() -> None:
                body = json.dumps({"t": time.time()})
                conn.execute("SELECT pgmq.send(%s, %s::jsonb)", (QUEUE, body))

        else:
            from kombu import Connection, Producer, Queue

            import kombu_pgmq  # noqa: F401

            connection = stack.enter_context(Connection(url))
            producer = Producer(connection.channel(), routing_key=QUEUE)
            Queue(QUEUE, routing_key=QUEUE)(connection.default_channel).declare()

            def send() -> None:
                producer.publish({"t": time.time()}, routing_key=QUEUE, serializer="json")

        gap = 1.0 / rate
        start = time.monotonic()
        n = 0
        while not stop.is_set():
            due = start + n * gap
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            else:
                lag.value = now - due  # behind schedule: published late
            send()
            n += 1
            published.value = n


def _consumer(
    target: str, url: str, stop: Any, consumed: Any, latencies: Any, celery: bool
) -> None:
    """Consume and ack until ``stop`` is set; latencies (ms) go to ``latencies`` in
    batches (``celery``: a Celery worker, solo pool, late acks, prefetch 10, runs
    ``held.seen`` in this process)."""
    batch: list[float] = []
    last_flush = time.monotonic()

    def seen(sent: float) -> None:
        nonlocal last_flush
        batch.append((time.time() - sent) * 1000)
        consumed.value += 1
        if time.monotonic() - last_flush > 0.5:
            latencies.put(list(batch))
            batch.clear()
            last_flush = time.monotonic()

    if celery:
        import threading

        app = _celery_app(url)
        app.task(name="held.seen")(seen)
        worker = app.Worker(pool="solo", concurrency=1, loglevel="WARNING", quiet=True)

        def stopper() -> None:
            stop.wait()
            os.kill(os.getpid(), signal.SIGTERM)  # the worker's warm shutdown

        threading.Thread(target=stopper, daemon=True).start()
        worker.start()
        latencies.put(list(batch))
        return
    if target == "pgmq":
        with psycopg.connect(url, autocommit=True) as conn:
            while not stop.is_set():
                rows = conn.execute(
                    "SELECT msg_id, message FROM pgmq.read(%s, 30, 10)", (QUEUE,)
                ).fetchall()
                if not rows:
                    time.sleep(0.01)
                for msg_id, message in rows:
                    conn.execute("SELECT pgmq.archive(%s, %s::bigint)", (QUEUE, msg_id))
                    seen(message["t"])
        latencies.put(list(batch))
        return
    from kombu import Connection, Consumer, Queue

    import kombu_pgmq  # noqa: F401

    def on_message(body: Any, message: Any) -> None:
        message.ack()
        seen(body["t"])

    with (
        Connection(url) as conn,
        Consumer(
            conn.channel(), [Queue(QUEUE, routing_key=QUEUE)], callbacks=[on_message]
        ) as consumer,
    ):
        consumer.qos(prefetch_count=10)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)
    latencies.put(list(batch))


# -- the run -----------------------------------------------------------------------------


def _spark_holder(jdbc_url: str, seconds: float, go: Any, stop: Any) -> None:
    """The Spark job of ``--holder spark``: a warm session waits for ``go``, then one JDBC
    read of a query lasting ``seconds`` (10 rows a second), cancelled at the release."""
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[1]")
        .appName("held_snapshot")
        .config("spark.jars", JDBC_JAR)
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    try:
        rows = int(seconds * 10) + 100
        df = (
            spark.read.format("jdbc")
            .option("url", jdbc_url)
            .option("driver", "org.postgresql.Driver")
            .option(
                "query",
                f"SELECT g, pg_sleep(0.1)::text AS slept FROM generate_series(1, {rows}) AS g",
            )
            .option("fetchsize", "50")
            .load()
        )
        go.wait()
        if not stop.is_set():
            with contextlib.suppress(Exception):  # cancelled at the release
                df.count()
    finally:
        spark.stop()


def _jdbc_url(pg: str) -> str:
    """The JDBC URL of libpq URL ``pg`` (TCP: a socket-only URL means the private server,
    listening on 127.0.0.2 for this)."""
    info = psycopg.conninfo.conninfo_to_dict(pg)
    host = str(info.get("host", "127.0.0.1"))
    host = "127.0.0.2" if host.startswith("/") else host
    port = info.get("port", 5432)
    return (
        f"jdbc:postgresql://{host}:{port}/{info['dbname']}?user={info.get('user', 'postgres')}"
        f"&ApplicationName={SPARK_APP}"
    )


def _statements(dsn: str) -> dict[str, tuple[int, float, str]]:
    """``{queryid: (calls, total ms, query)}`` of pg_stat_statements (empty without it)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if not conn.execute(
            "SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'"
        ).fetchone():
            return {}
        rows = conn.execute(
            "SELECT queryid, calls, total_exec_time,"
            " left(regexp_replace(query, '\\s+', ' ', 'g'), 90)"
            " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
            " WHERE d.datname = current_database()"
        ).fetchall()
    return {str(q): (int(c), float(t), str(text)) for q, c, t, text in rows}


def _phase_statements(
    start: dict[str, tuple[int, float, str]], end: dict[str, tuple[int, float, str]]
) -> list[dict[str, Any]]:
    """The statements run between two snapshots, most server time first (top 12)."""
    out = []
    for qid, (calls, total, text) in end.items():
        c0, t0, _ = start.get(qid, (0, 0.0, text))
        if calls > c0:
            out.append(
                {
                    "query": text,
                    "calls": calls - c0,
                    "total_ms": round(total - t0, 1),
                    "mean_ms": round((total - t0) / (calls - c0), 3),
                }
            )
    out.sort(key=lambda r: -r["total_ms"])
    return out[:12]


def _table_stats(dsn: str) -> dict[str, Any]:
    """The queue table's tuples and sizes, and ``horizon_s``: how long the oldest snapshot
    of another session of this database has been open (seconds; what holds the dead
    tuples)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT n_dead_tup, n_live_tup, pg_total_relation_size(relid),"
            " pg_relation_size(relid)"
            " FROM pg_stat_user_tables WHERE schemaname = 'pgmq' AND relname = %s",
            (f"q_{QUEUE}",),
        ).fetchone()
        (horizon,) = conn.execute(
            "SELECT extract(epoch FROM max(clock_timestamp() - coalesce(xact_start, query_start)))"
            " FROM pg_stat_activity WHERE datname = current_database()"
            " AND backend_xmin IS NOT NULL AND pid <> pg_backend_pid()"
        ).fetchone()
    horizon_s = None if horizon is None else round(float(horizon), 1)
    if row is None:
        return {
            "dead_tuples": None,
            "live_tuples": None,
            "table_bytes": None,
            "heap_bytes": None,
            "horizon_s": horizon_s,
        }
    return {
        "dead_tuples": row[0],
        "live_tuples": row[1],
        "table_bytes": row[2],
        "heap_bytes": row[3],
        "horizon_s": horizon_s,
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def _prepare(target: str, url: str, pg: str) -> None:
    ensure_database(pg)
    if target == "pgmq":
        with psycopg.connect(pg, autocommit=True) as conn:
            ext = conn.execute(
                "SELECT 1 FROM pg_available_extensions WHERE name = 'pgmq'"
            ).fetchone()
            if ext:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pgmq")
        ensure_sql_pgmq(pg)
        with psycopg.connect(pg, autocommit=True) as conn:
            conn.execute("SELECT pgmq.create(%s)", (QUEUE,))
            conn.execute("SELECT pgmq.purge_queue(%s)", (QUEUE,))
        return
    from kombu import Connection, Queue

    import kombu_pgmq  # noqa: F401

    with Connection(url) as conn:
        queue = Queue(QUEUE, routing_key=QUEUE)(conn.default_channel)
        queue.declare()
        queue.purge()


def run(target: str, url: str, pg: str, args: argparse.Namespace) -> dict[str, Any]:
    _prepare(target, url, pg)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    published = ctx.Value("q", 0)
    consumed = ctx.Value("q", 0)
    lag = ctx.Value("d", 0.0)
    latencies: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_consumer, args=(target, url, stop, consumed, latencies, args.celery)),
        ctx.Process(
            target=_producer, args=(target, url, args.rate, stop, published, lag, args.celery)
        ),
    ]
    go = ctx.Event()
    if args.holder == "spark" and not args.no_hold:
        procs.append(ctx.Process(target=_spark_holder, args=(_jdbc_url(pg), args.hold, go, stop)))
    for p in procs:
        p.start()
    holder: psycopg.Connection | None = None
    timeline: list[dict[str, Any]] = []
    start = time.monotonic()
    total = args.before + args.hold + args.after
    last = (0, 0)
    window: list[float] = []
    phase = "before"
    pg_stats = target in ("kombu_pgmq", "pgmq")
    marks = {"start": _statements(pg) if pg_stats else {}}
    try:
        next_at = start + args.interval
        while time.monotonic() - start < total:
            elapsed = time.monotonic() - start
            if phase == "before" and elapsed >= args.before:
                if pg_stats:
                    marks["before"] = _statements(pg)
                if args.holder == "spark":
                    go.set()
                elif not args.no_hold:  # --no-hold: the same phases, nothing held
                    holder = psycopg.connect(pg, application_name="held_snapshot")
                    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                    holder.execute("SELECT count(*) FROM pg_class")
                phase = "held"
            elif phase == "held" and elapsed >= args.before + args.hold:
                if pg_stats:
                    marks["held"] = _statements(pg)
                if holder is not None:
                    holder.commit()
                    holder.close()
                    holder = None
                if args.holder == "spark":
                    _cancel_spark(pg)
                phase = "after"
            time.sleep(max(0.0, min(next_at, start + total) - time.monotonic()))
            while not latencies.empty():
                window.extend(latencies.get())
            if time.monotonic() < next_at:
                continue
            now = (published.value, consumed.value)
            row = {
                "t": round(time.monotonic() - start, 1),
                "phase": phase,
                "published_per_s": round((now[0] - last[0]) / args.interval, 1),
                "consumed_per_s": round((now[1] - last[1]) / args.interval, 1),
                "p50_ms": _percentile(window, 0.50),
                "p99_ms": _percentile(window, 0.99),
                "backlog": now[0] - now[1],
                "producer_lag_s": round(lag.value, 3),
                **(_table_stats(pg) if target in ("kombu_pgmq", "pgmq") else {}),
            }
            timeline.append(row)
            print(json.dumps(row), flush=True)
            last = now
            window = []
            next_at += args.interval
    finally:
        if holder is not None:
            holder.rollback()
            holder.close()
        stop.set()
        go.set()
        if args.holder == "spark":
            _cancel_spark(pg)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    statements = {}
    if pg_stats and "held" in marks:
        marks["after"] = _statements(pg)
        spans = {
            "before": ("start", "before"),
            "held": ("before", "held"),
            "after": ("held", "after"),
        }
        statements = {
            phase: _phase_statements(marks[a], marks[b]) for phase, (a, b) in spans.items()
        }
    return {
        "target": target,
        "url": url,
        "timeline": timeline,
        "summary": _summary(timeline),
        "statements": statements,
    }


def _cancel_spark(pg: str) -> None:
    """End the Spark job's JDBC read (the release of ``--holder spark``)."""
    with psycopg.connect(pg, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (SPARK_APP,),
        )


def _summary(timeline: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the rows before the hold and of the last third of the held rows."""

    def med(rows: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.median(values), 2) if values else None

    before = [r for r in timeline if r["phase"] == "before"][1:]  # the first: warm-up
    held = [r for r in timeline if r["phase"] == "held"]
    late = held[len(held) * 2 // 3 :]
    keys = ("published_per_s", "consumed_per_s", "p50_ms", "p99_ms", "dead_tuples", "backlog")
    return {
        "before": {k: med(before, k) for k in keys},
        "held_last_third": {k: med(late, k) for k in keys},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=list(URLS))
    parser.add_argument("--url", action="append", default=[], metavar="TARGET=URL")
    parser.add_argument("--rate", type=float, default=500.0, help="publishes per second")
    parser.add_argument("--before", type=float, default=30.0, help="seconds before the hold")
    parser.add_argument("--hold", type=float, default=600.0, help="seconds the snapshot is held")
    parser.add_argument("--after", type=float, default=300.0, help="seconds after the release")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds per line")
    parser.add_argument("--private-server", action="store_true")
    parser.add_argument(
        "--consumer",
        choices=["kombu", "celery"],
        default="kombu",
        help="celery: a Celery worker (solo pool, late acks, prefetch 10) and send_task",
    )
    parser.add_argument(
        "--no-hold", action="store_true", help="the same run without the held snapshot"
    )
    parser.add_argument(
        "--holder",
        choices=["session", "spark"],
        default="session",
        help="what holds the snapshot: a REPEATABLE READ session, or a Spark job's JDBC read",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.celery = args.consumer == "celery"
    if args.celery and "pgmq" in (args.target or []):
        parser.error("--consumer celery runs on Kombu brokers: not with --target pgmq")
    urls = dict(URLS) | dict(u.split("=", 1) for u in args.url)
    server = None
    if args.private_server:
        import limits

        tcp = {"listen_addresses": "'127.0.0.2'"} if args.holder == "spark" else {}
        server = limits._start_server(**tcp)
        socket_dir = server.dsn.split("host=", 1)[1]
        for target, db in (("kombu_pgmq", "kpb_held_snapshot"), ("pgmq", "kpb_held_raw")):
            urls[target] = f"postgresql://postgres@/{db}?host={socket_dir}"
            ensure_database(urls[target])
            with psycopg.connect(urls[target], autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    try:
        _main(args, urls)
    finally:
        if server is not None:
            server.stop()


def _main(args: argparse.Namespace, urls: dict[str, str]) -> None:
    pg_default = urls["kombu_pgmq"]
    results = []
    for target in args.target or ["kombu_pgmq"]:
        url = urls[target]
        pg = url if target in ("kombu_pgmq", "pgmq") else pg_default
        print(f"== {target} ({url})", file=sys.stderr, flush=True)
        results.append(run(target, url, pg, args))
    with psycopg.connect(pg_default, autocommit=True) as conn:
        server = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]
            for name in ("server_version", "autovacuum", "shared_buffers")
        }
    for res in results:
        print(res["target"], json.dumps(res["summary"]))
    if args.json:
        env = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        payload = {"environment": env | server | vars(args) | {"json": None}, "results": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
