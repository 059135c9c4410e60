"""The ``pgmq`` Python Data Source through a real Spark Connect server (``local[2]``):
atomic writes (rows and Celery task messages), snapshot reads of queue and archive, and a
stream that crashes in its sink and restarts."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kombu_pgmq.spark import register
from kombu_pgmq.spark.messages import WRITE_HEADER
from tests.integration.helpers import connect, drain, publish


@pytest.fixture(scope="module")
def spark(spark_server: dict[str, Any]) -> Iterator[Any]:
    from pyspark.sql import SparkSession

    session = SparkSession.builder.remote(spark_server["url"]).create()
    register(session)
    yield session
    session.stop()


def _count(db_dsn: str, table: str, where: str = "true") -> int:
    with psycopg.connect(db_dsn) as conn:
        return int(conn.execute(f"SELECT count(*) FROM pgmq.{table} WHERE {where}").fetchone()[0])


def test_rows_become_kombu_messages_after_the_job_commits(spark, db_dsn) -> None:
    df = spark.range(0, 500, 1, 3).selectExpr(
        "id", "concat('name-', id) AS name", "date_add(date'2013-01-01', cast(id AS int)) AS day"
    )
    df.write.format("pgmq").options(url=db_dsn, queue="rows").mode("append").save()
    assert _count(db_dsn, "q_rows") == 500
    assert _count(db_dsn, "q_rows", f"headers ? '{WRITE_HEADER}' OR vt > now()") == 0
    with connect(db_dsn) as conn:
        bodies = [m.decode() for m in drain(conn, "rows", expect=500)]
    assert sorted(b["id"] for b in bodies) == list(range(500))
    first = min(bodies, key=lambda b: b["id"])
    assert first["name"] == "name-0"
    assert str(first["day"]).startswith("2013-01-01")


def test_a_failed_job_leaves_no_message(spark, db_dsn) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "rows", ["published before"])
    # The last of 4 partitions fails after the others staged their rows.
    df = spark.range(0, 1000, 1, 4).selectExpr(
        "id", "if(id = 999, raise_error('injected failure'), id) AS v"
    )
    with pytest.raises(Exception, match="injected failure"):
        df.write.format("pgmq").options(url=db_dsn, queue="rows").mode("append").save()
    assert _count(db_dsn, "q_rows") == 1  # only the message published before
    with connect(db_dsn) as conn:
        assert [m.decode() for m in drain(conn, "rows", expect=1)] == ["published before"]


def test_a_retried_spark_task_sends_its_rows_once(spark, db_dsn) -> None:
    """The first attempt of one Spark task stages 100 rows, then fails; the retry
    succeeds. The commit publishes the retry's rows and deletes the failed attempt's."""
    from pyspark.sql.functions import udf

    @udf("long")
    def fail_first_attempt(value):  # no type hints: they would make it a pandas UDF
        from pyspark import TaskContext

        if value == 950 and TaskContext.get().attemptNumber() == 0:
            raise RuntimeError("injected failure of attempt 0")
        return value

    df = spark.range(0, 1000, 1, 2).select(fail_first_attempt("id").alias("id"))
    df.write.format("pgmq").options(url=db_dsn, queue="rows", batch_size="50").mode("append").save()
    with psycopg.connect(db_dsn) as conn:
        ids = [r[0] for r in conn.execute("SELECT (message->>'id')::int FROM pgmq.q_rows")]
    assert sorted(ids) == list(range(1000))  # each row once: attempt 0's 450 rows deleted
    assert _count(db_dsn, "q_rows", f"headers ? '{WRITE_HEADER}' OR vt > now()") == 0


def test_rows_become_celery_task_messages_per_row_and_per_partition(spark, db_dsn) -> None:
    df = spark.range(0, 10, 1, 2).selectExpr("id AS x", "id * 10 AS y")
    opts = {"url": db_dsn, "queue": "celery", "task": "e2e.add"}
    df.write.format("pgmq").options(**opts).mode("append").save()
    df.write.format("pgmq").options(**opts, task_per="partition").mode("append").save()
    with psycopg.connect(db_dsn) as conn:
        rows = conn.execute(
            "SELECT headers->>'task', headers->>'id', message FROM pgmq.q_celery ORDER BY msg_id"
        ).fetchall()
    assert len(rows) == 12  # 10 tasks (one per row) + 2 (one per partition)
    assert {task for task, _, _ in rows} == {"e2e.add"}
    assert len({task_id for _, task_id, _ in rows}) == 12
    per_row = sorted((m[1]["x"], m[1]["y"]) for _, _, m in rows[:10])
    assert per_row == [(i, i * 10) for i in range(10)]
    batches = [m[0][0] for _, _, m in rows[10:]]  # args = [rows]
    assert sorted(r["x"] for b in batches for r in b) == list(range(10))


def test_snapshot_reads_queue_and_archive_without_consuming(spark, db_dsn) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "snap", [{"n": i} for i in range(20)])
        acked = len(drain(conn, "snap", expect=8))  # archived (a few more may be prefetched)

    def state() -> list[tuple]:
        with psycopg.connect(db_dsn) as conn:
            return conn.execute("SELECT msg_id, read_ct, vt FROM pgmq.q_snap ORDER BY 1").fetchall()

    before = state()
    read = spark.read.format("pgmq").options(url=db_dsn, queue="snap", partitions="3")
    queue = read.load().orderBy("msg_id").collect()
    archive = read.option("source", "archive").load().orderBy("msg_id").collect()
    assert len(queue) == 20 - acked and len(archive) == acked
    assert [r.msg_id for r in queue] == [m for m, _, _ in before]
    assert len({r.msg_id for r in queue} | {r.msg_id for r in archive}) == 20
    assert all(r.archived_at is not None and r.read_ct >= 1 for r in archive)
    assert all(r.archived_at is None for r in queue)
    assert sorted(json.loads(r.message)["n"] for r in queue + archive) == list(range(20))
    assert state() == before  # nothing consumed, read_ct and vt untouched


def test_opening_a_task_session_interrupts_what_an_earlier_delivery_left_running(
    spark_server, spark
) -> None:
    """A pool process died (kill -9) while its Spark job ran; the next delivery of the same
    task opens the same deterministic session and interrupts the orphan first."""
    import threading

    from kombu_pgmq.spark import open_session, session_id

    task_id = str(uuid.uuid4())
    orphan, leftovers = open_session(spark_server["url"], task_id)
    assert leftovers == []
    assert orphan.session_id == session_id(task_id)
    failed: list[BaseException] = []
    running = threading.Event()

    def on_progress(stages: Any, inflight_tasks: int, *args: Any, **kwargs: Any) -> None:
        if inflight_tasks > 0:
            running.set()  # the server runs the job's Spark tasks

    orphan.registerProgressHandler(on_progress)

    def run() -> None:
        try:
            orphan.range(0, 2, 1, 2).selectExpr(
                "reflect('java.lang.Thread', 'sleep', cast(120000 as bigint))"
            ).collect()
        except BaseException as exc:
            failed.append(exc)

    job = threading.Thread(target=run, daemon=True)
    job.start()
    assert running.wait(60), f"the job did not start within 60 s: {failed}"
    again, interrupted = open_session(spark_server["url"], task_id)
    assert len(interrupted) == 1
    job.join(10)
    assert not job.is_alive()
    assert failed and "OPERATION_CANCELED" in str(failed[0]), failed
    again.stop()


def _sink(db_dsn: str, crash_flag: Path):
    """foreachBatch sink (runs in the server's Python process): upsert by msg_id, log every
    batch; crash the process after writing batch 1 if the flag file exists (once)."""

    def write(batch: Any, batch_id: int) -> None:
        rows = [(r.msg_id, r.message) for r in batch.select("msg_id", "message").collect()]
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            with conn.transaction():
                for msg_id, message in rows:
                    conn.execute(
                        "INSERT INTO sink (msg_id, message) VALUES (%s, %s)"
                        " ON CONFLICT (msg_id) DO NOTHING",
                        (msg_id, message),
                    )
            conn.execute("INSERT INTO sink_batches VALUES (%s, %s)", (batch_id, len(rows)))
        if batch_id == 1 and crash_flag.exists():
            crash_flag.unlink()
            os._exit(1)  # the sink wrote; Spark never records the batch as committed

    return write


def _run_stream(spark: Any, db_dsn: str, checkpoint: Path, crash_flag: Path) -> None:
    stream = spark.readStream.format("pgmq").options(url=db_dsn, queue="events", max_messages="40")
    query = (
        stream.load()
        .writeStream.foreachBatch(_sink(db_dsn, crash_flag))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


@pytest.mark.slow
def test_stream_crash_and_restart_is_exactly_once_into_an_idempotent_sink(
    spark, db_dsn, tmp_path: Path
) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE sink (msg_id bigint PRIMARY KEY, message text)")
        conn.execute("CREATE TABLE sink_batches (batch_id int, rows int)")
    with connect(db_dsn) as conn:
        publish(conn, "events", [{"n": i} for i in range(100)])
    checkpoint = tmp_path / f"checkpoint-{uuid.uuid4().hex}"
    crash_flag = tmp_path / "crash"
    crash_flag.touch()
    with pytest.raises(Exception):  # noqa: B017  (the sink's process died: any error)
        _run_stream(spark, db_dsn, checkpoint, crash_flag)
    assert not crash_flag.exists(), "the sink did not crash"
    with psycopg.connect(db_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM sink").fetchone()[0] == 80  # batches 0, 1
    assert _count(db_dsn, "q_events") == 100 - 40  # batch 0 archived; batch 1 not committed

    _run_stream(spark, db_dsn, checkpoint, crash_flag)  # restart from the checkpoint
    with psycopg.connect(db_dsn) as conn:
        batches = conn.execute("SELECT batch_id, rows FROM sink_batches ORDER BY 1").fetchall()
        sunk = conn.execute("SELECT message FROM sink ORDER BY msg_id").fetchall()
    assert batches == [(0, 40), (1, 40), (1, 40), (2, 20)]  # batch 1 replayed: at least once
    assert sorted(json.loads(m)["n"] for (m,) in sunk) == list(range(100))  # exactly once
    # The last batch is archived when the stream next plans a batch (next run).
    _run_stream(spark, db_dsn, checkpoint, crash_flag)
    assert _count(db_dsn, "q_events") == 0
    assert _count(db_dsn, "a_events") == 100
