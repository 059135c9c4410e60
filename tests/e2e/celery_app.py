"""Celery app of the end-to-end tests, configured entirely from environment variables.

The worker subprocess loads it with ``celery -A tests.e2e.celery_app worker``; the test
process builds its own instance with :func:`create_app` and the same settings.

Environment
    ``KPT_BROKER_URL`` (required to do anything): ``postgresql://`` URL of the test database
    (TCP or unix socket: ``postgresql://postgres@/db?host=/socket/dir``). It is also the
    result backend (Celery's SQLAlchemy backend through psycopg 3) and where tasks record
    their executions (table ``e2e_runs``).
    ``KPT_VISIBILITY_TIMEOUT`` (seconds, optional): transport option ``visibility_timeout``.
    ``KPT_POLLING_INTERVAL`` (seconds, optional): transport option ``polling_interval``.
    ``KPT_CONSUMER_HEARTBEAT_INTERVAL`` (seconds, optional): transport option
    ``consumer_heartbeat_interval``.
    ``KPT_CONSUMER_STALE_AFTER`` (seconds, optional): transport option
    ``consumer_stale_after``.
    ``KPT_LEASE_RENEWAL_INTERVAL``, ``KPT_ETA_LEAD_SECONDS`` (seconds, optional) and
    ``KPT_MAX_DELIVERIES`` (int, optional): the transport options of those names.
    ``KPT_TRANSPORT_OPTIONS`` (JSON object, optional): more ``broker_transport_options``,
    given as is (e.g. a misspelt or invalid one).
    ``KPT_MAX_PRIORITY`` (int, optional): queue ``celery`` is declared with
    ``x-max-priority``. ``KPT_FIFO_QUEUE`` (optional): a queue ``fifo`` with
    ``x-fifo-groups`` besides ``celery``. ``KPT_PREFETCH_MULTIPLIER`` (int, optional):
    ``worker_prefetch_multiplier``.
    ``KPT_RESULT_BACKEND`` (optional): ``postgresql`` selects kombu_pgmq's own result
    backend (``result_backend = "postgresql://"``: the broker's database) instead of
    Celery's SQLAlchemy backend; ``none``: no result backend. ``KPT_RESULT_OPTIONS``
    (JSON object, optional): its ``result_backend_transport_options``.
    ``KPT_TRACK_STARTED`` (optional): ``task_track_started``.
    ``KPT_BEAT`` (optional): beat runs kombu_pgmq's scheduler (``beat_scheduler =
    "kombu_pgmq.beat:Scheduler"``) with ``beat_schedule`` :data:`BEAT_SCHEDULE`: task
    ``e2e.beat_tick`` every second and every minute (crontab), each run recorded in table
    ``e2e_beat_runs`` (:data:`BEAT_RUNS_DDL`, created by the tests).
    ``KPT_BEAT_TAKEOVER_SECONDS`` (seconds, optional, default 6): ``beat_takeover_seconds``.
    ``KPT_QUEUE_LIMITS`` (JSON object ``{queue: {limit: value}}``, optional): transport
    option ``queue_limits`` (fleet-wide limits, set when a worker declares the queue).
    ``KPT_ACCEPT_PICKLE`` (optional): ``accept_content`` also takes pickle (a task sent
    with ``serializer="pickle"`` runs; its result is JSON as every other).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import psycopg
from celery import Celery, chord
from celery.schedules import crontab
from kombu import Exchange, Queue

import kombu_pgmq  # noqa: F401  (registers postgresql:// with kombu)
from kombu_pgmq.atomic import AtomicTask
from kombu_pgmq.spark import SparkTask  # does not import pyspark

#: DDL of the table where tasks record each execution (created by the test fixtures).
RUNS_DDL = """
CREATE TABLE IF NOT EXISTS e2e_runs (
    id bigserial PRIMARY KEY,
    task_id text NOT NULL,
    name text NOT NULL,
    pid int NOT NULL,
    redelivered boolean,
    retries int NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


#: DDL of the table where ``e2e.limited_run`` records each run (created by the tests):
#: wall-clock start and end of the task body (``finished_at`` NULL while it runs, or if its
#: process was killed), the label the test gave it (e.g. its limit key), the pool process.
LIMIT_RUNS_DDL = """
CREATE TABLE IF NOT EXISTS e2e_limit_runs (
    id bigserial PRIMARY KEY,
    task_id text NOT NULL,
    label text NOT NULL,
    pid int NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz
)
"""


#: DDL of the table where ``e2e.beat_tick`` records each execution (created by the tests).
BEAT_RUNS_DDL = """
CREATE TABLE IF NOT EXISTS e2e_beat_runs (
    id bigserial PRIMARY KEY,
    task_id text NOT NULL,
    entry text NOT NULL,
    pid int NOT NULL,
    ran_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""
#: Entry names of :data:`BEAT_SCHEDULE`.
BEAT_EVERY_SECOND = "e2e-every-second"
BEAT_EVERY_MINUTE = "e2e-every-minute"
#: ``beat_schedule`` with ``KPT_BEAT``: each entry passes its own name to ``e2e.beat_tick``.
BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    BEAT_EVERY_SECOND: {"task": "e2e.beat_tick", "schedule": 1.0, "args": [BEAT_EVERY_SECOND]},
    BEAT_EVERY_MINUTE: {
        "task": "e2e.beat_tick",
        "schedule": crontab(),
        "args": [BEAT_EVERY_MINUTE],
    },
}


def result_backend_url(broker_url: str) -> str:
    """``postgresql://u@h/db?host=/s`` -> ``db+postgresql+psycopg://u@h/db?host=/s``.

    SQLAlchemy hands the query string (``host=/socket/dir``) to psycopg unchanged, so TCP
    and unix-socket URLs both work; ``postgres://`` is accepted too.
    """
    scheme = urlsplit(broker_url).scheme
    if scheme not in ("postgresql", "postgres"):
        raise ValueError(f"not a PostgreSQL URL: scheme {scheme!r}")
    return "db+postgresql+psycopg" + broker_url[len(scheme) :]


def record_run(db_url: str, task: Any) -> int:
    """Insert one ``e2e_runs`` row for the running *task*; return the task id's row count."""
    req = task.request
    with psycopg.connect(db_url, autocommit=True, application_name="kpt_e2e_task") as conn:
        conn.execute(
            "INSERT INTO e2e_runs (task_id, name, pid, redelivered, retries)"
            " VALUES (%s, %s, %s, %s, %s)",
            (
                req.id,
                task.name,
                os.getpid(),
                (req.delivery_info or {}).get("redelivered"),
                req.retries,
            ),
        )
        row = conn.execute("SELECT count(*) FROM e2e_runs WHERE task_id = %s", (req.id,)).fetchone()
    assert row is not None
    return int(row[0])


def create_app(env: Mapping[str, str] = os.environ) -> Celery:
    """Return a Celery app configured from *env* (see the module docstring)."""
    broker_url = env.get("KPT_BROKER_URL", "")
    transport_options: dict[str, Any] = {}
    if env.get("KPT_VISIBILITY_TIMEOUT"):
        transport_options["visibility_timeout"] = float(env["KPT_VISIBILITY_TIMEOUT"])
    for var, option in (
        ("KPT_POLLING_INTERVAL", "polling_interval"),
        ("KPT_CONSUMER_HEARTBEAT_INTERVAL", "consumer_heartbeat_interval"),
        ("KPT_CONSUMER_STALE_AFTER", "consumer_stale_after"),
        ("KPT_LEASE_RENEWAL_INTERVAL", "lease_renewal_interval"),
        ("KPT_ETA_LEAD_SECONDS", "eta_lead_seconds"),
    ):
        if env.get(var):
            transport_options[option] = float(env[var])
    if env.get("KPT_MAX_DELIVERIES"):
        transport_options["max_deliveries"] = int(env["KPT_MAX_DELIVERIES"])
    if env.get("KPT_QUEUE_LIMITS"):
        transport_options["queue_limits"] = json.loads(env["KPT_QUEUE_LIMITS"])
    if env.get("KPT_TRANSPORT_OPTIONS"):
        transport_options.update(json.loads(env["KPT_TRANSPORT_OPTIONS"]))

    app = Celery("kpt_e2e", set_as_current=False)
    app.conf.update(
        broker_url=broker_url or None,
        broker_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        result_backend=result_backend_url(broker_url) if broker_url else None,
        result_extended=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        worker_hijack_root_logger=True,
        worker_redirect_stdouts=True,
    )
    if env.get("KPT_RESULT_BACKEND") == "postgresql":
        app.conf.result_backend = "postgresql://"
        app.conf.result_backend_transport_options = json.loads(
            env.get("KPT_RESULT_OPTIONS") or "{}"
        )
    elif env.get("KPT_RESULT_BACKEND") == "none":
        app.conf.result_backend = None
    elif env.get("KPT_RESULT_BACKEND"):
        raise ValueError(
            f"KPT_RESULT_BACKEND={env['KPT_RESULT_BACKEND']!r}: only 'postgresql' or 'none'"
        )
    if env.get("KPT_TRACK_STARTED"):
        app.conf.task_track_started = True
    if env.get("KPT_ACCEPT_PICKLE"):
        app.conf.accept_content = ["json", "pickle"]
    if env.get("KPT_MAX_PRIORITY"):
        arguments = {"x-max-priority": int(env["KPT_MAX_PRIORITY"])}
        app.conf.task_queues = [
            Queue("celery", Exchange("celery"), routing_key="celery", queue_arguments=arguments)
        ]
    if env.get("KPT_FIFO_QUEUE"):  # a FIFO queue (x-fifo-groups) besides celery
        app.conf.task_queues = [
            Queue("celery", Exchange("celery"), routing_key="celery"),
            Queue(
                "fifo",
                Exchange("fifo"),
                routing_key="fifo",
                queue_arguments={"x-fifo-groups": True},
            ),
        ]
    if env.get("KPT_PREFETCH_MULTIPLIER"):
        app.conf.worker_prefetch_multiplier = int(env["KPT_PREFETCH_MULTIPLIER"])
    if env.get("KPT_BEAT"):
        app.conf.beat_scheduler = "kombu_pgmq.beat:Scheduler"
        app.conf.beat_takeover_seconds = float(env.get("KPT_BEAT_TAKEOVER_SECONDS") or 6)
        app.conf.beat_schedule = BEAT_SCHEDULE

    @app.task(shared=False, name="e2e.ping")
    def ping() -> str:
        return "pong"

    @app.task(shared=False, name="e2e.add")
    def add(x: float, y: float) -> float:
        return x + y

    @app.task(shared=False, name="e2e.echo")
    def echo(value: Any) -> Any:
        return value

    @app.task(shared=False, name="e2e.record", bind=True)
    def record(self: Any, label: str) -> str:
        """Record the execution (``e2e_runs``, name ``e2e.record``); return the label."""
        record_run(broker_url, self)
        return label

    @app.task(shared=False, name="e2e.beat_tick", bind=True, ignore_result=True)
    def beat_tick(self: Any, entry: str) -> None:
        """Record the execution of a periodic task (``e2e_beat_runs``: task id, entry)."""
        with psycopg.connect(broker_url, autocommit=True, application_name="kpt_e2e_task") as c:
            c.execute(
                "INSERT INTO e2e_beat_runs (task_id, entry, pid) VALUES (%s, %s, %s)",
                (self.request.id, entry, os.getpid()),
            )

    def record_fifo_step(group: str, seq: int, seconds: float) -> None:
        """Record (group, seq) with its start and end (table ``e2e_fifo``): the test checks
        that a group's steps never overlap and run in order."""
        with psycopg.connect(broker_url, autocommit=True, application_name="kpt_e2e_task") as c:
            started = c.execute("SELECT clock_timestamp()").fetchone()[0]
            time.sleep(seconds)
            c.execute(
                "INSERT INTO e2e_fifo (grp, seq, pid, started_at, finished_at)"
                " VALUES (%s, %s, %s, %s, clock_timestamp())",
                (group, seq, os.getpid(), started),
            )

    @app.task(shared=False, name="e2e.fifo_step", bind=True, acks_late=True)
    def fifo_step(self: Any, group: str, seq: int, seconds: float = 0.03) -> None:
        """:func:`record_fifo_step`, acked once it ended."""
        record_fifo_step(group, seq, seconds)

    @app.task(shared=False, name="e2e.fifo_step_early", bind=True)
    def fifo_step_early(self: Any, group: str, seq: int, seconds: float = 0.03) -> None:
        """:func:`record_fifo_step` with Celery's default early ack."""
        record_fifo_step(group, seq, seconds)

    def record_limited_run(
        task_id: str, label: str, seconds: float, rerun_seconds: float | None
    ) -> None:
        """Record the run in ``e2e_limit_runs`` (start: the wall clock when the body
        starts), sleep *seconds* (a redelivered task id's later runs: *rerun_seconds* if
        given), record its end."""
        started = time.time()
        with psycopg.connect(broker_url, autocommit=True, application_name="kpt_e2e_task") as c:
            row = c.execute(
                "INSERT INTO e2e_limit_runs (task_id, label, pid, started_at)"
                " VALUES (%s, %s, %s, to_timestamp(%s))"
                " RETURNING id, (SELECT count(*) FROM e2e_limit_runs WHERE task_id = %s)",
                (task_id, label, os.getpid(), started, task_id),
            ).fetchone()
            assert row is not None
            rerun = int(row[1]) > 0
            time.sleep(seconds if not rerun or rerun_seconds is None else rerun_seconds)
            c.execute(
                "UPDATE e2e_limit_runs SET finished_at = to_timestamp(%s) WHERE id = %s",
                (time.time(), row[0]),
            )

    @app.task(shared=False, name="e2e.limited_run", bind=True, acks_late=True, ignore_result=True)
    def limited_run(
        self: Any, label: str, seconds: float = 0.0, rerun_seconds: float | None = None
    ) -> None:
        """:func:`record_limited_run` with ``acks_late``: the message stays in flight (and
        counts toward its queue's limits) until the body has ended."""
        record_limited_run(self.request.id, label, seconds, rerun_seconds)

    @app.task(shared=False, name="e2e.limited_run_early", bind=True, ignore_result=True)
    def limited_run_early(
        self: Any, label: str, seconds: float = 0.0, rerun_seconds: float | None = None
    ) -> None:
        """:func:`record_limited_run` with Celery's default early ack: the message is
        acked when the task starts (its concurrency slot is held until it finishes)."""
        record_limited_run(self.request.id, label, seconds, rerun_seconds)

    @app.task(shared=False, name="e2e.xsum")
    def xsum(numbers: list[float]) -> float:
        return sum(numbers)

    @app.task(shared=False, name="e2e.fail")
    def fail(message: str) -> None:
        raise ValueError(message)

    @app.task(shared=False, name="e2e.big")
    def big(size: int) -> str:
        return "x" * size

    @app.task(
        shared=False, name="e2e.chord_part", bind=True, acks_late=True, reject_on_worker_lost=True
    )
    def chord_part(self: Any, value: int, seconds: float = 0.0) -> int:
        """Record the execution, sleep *seconds*, return *value* (a chord's header task)."""
        record_run(broker_url, self)
        time.sleep(seconds)
        return value

    @app.task(shared=False, name="e2e.record_sum", bind=True, acks_late=True)
    def record_sum(self: Any, values: list[Any]) -> dict[str, Any]:
        """A chord callback: record the execution, return the values it got."""
        runs = record_run(broker_url, self)
        return {"values": values, "runs": runs}

    @app.task(shared=False, name="e2e.on_chord_error")
    def on_chord_error(request: Any, exc: BaseException, traceback: Any) -> None:
        """An errback (Celery's new-style signature): record one ``e2e_runs`` row with the
        failed task's id, named ``e2e.on_chord_error:<exception class>``."""
        with psycopg.connect(broker_url, autocommit=True, application_name="kpt_e2e_task") as c:
            c.execute(
                "INSERT INTO e2e_runs (task_id, name, pid, retries) VALUES (%s, %s, %s, 0)",
                (str(request.id), f"e2e.on_chord_error:{type(exc).__name__}", os.getpid()),
            )

    @app.task(shared=False, name="e2e.record_and_sleep", bind=True, acks_late=True)
    def record_and_sleep(self: Any, seconds: float, rerun_seconds: float = 0.0) -> dict[str, Any]:
        """Record the execution, then sleep *seconds* (first run) or *rerun_seconds* (later
        runs of the same task id: after a redelivery)."""
        runs = record_run(broker_url, self)
        time.sleep(seconds if runs == 1 else rerun_seconds)
        return {"runs": runs, "pid": os.getpid()}

    @app.task(shared=False, name="e2e.crash", bind=True, acks_late=True, reject_on_worker_lost=True)
    def crash(self: Any) -> None:
        """Record the execution, then SIGKILL the pool process running it (a segfault or
        an OOM kill); Celery requeues the message (reject_on_worker_lost)."""
        record_run(broker_url, self)
        os.kill(os.getpid(), signal.SIGKILL)

    @app.task(shared=False, name="e2e.retry_once", bind=True, max_retries=3)
    def retry_once(self: Any, value: Any) -> dict[str, Any]:
        """Record the execution; the first attempt retries itself (countdown 1 s)."""
        record_run(broker_url, self)
        if self.request.retries == 0:
            raise self.retry(countdown=1)
        return {"value": value, "retries": self.request.retries}

    @app.task(shared=False, name="e2e.spark_sleep", base=SparkTask, bind=True, acks_late=True)
    def spark_sleep(self: Any, tasks: int, ms: int) -> dict[str, Any]:
        """Record the execution, then a Spark job of *tasks* Spark tasks that each sleep
        *ms* milliseconds on the executor (cancellable: Spark interrupts the thread)."""
        runs = record_run(broker_url, self)
        rows = (
            self.spark.range(0, tasks, 1, tasks)
            .selectExpr(f"reflect('java.lang.Thread', 'sleep', cast({int(ms)} as bigint))")
            .collect()
        )
        return {"runs": runs, "rows": len(rows), "pid": os.getpid()}

    @app.task(shared=False, name="e2e.spark_sum", base=SparkTask, bind=True)
    def spark_sum(self: Any, n: int) -> int:
        """sum(0..n-1) computed by Spark."""
        return int(self.spark.range(n).selectExpr("sum(id) AS s").collect()[0]["s"])

    @app.task(shared=False, name="e2e.atomic_add", base=AtomicTask, bind=True)
    def atomic_add(
        self: Any,
        key: str,
        amount: int = 1,
        *,
        sleep_seconds: float = 0.0,
        rerun_sleep_seconds: float = 0.0,
        fail: str | None = None,
        chord_size: int = 0,
    ) -> dict[str, Any]:
        """Record the execution (``e2e_runs``, its own connection: every run counts), then
        in the task's transaction (:class:`kombu_pgmq.AtomicTask`): add *amount* to row
        *key* of ``e2e_counters`` (:data:`COUNTERS_DDL`), send a chord of *chord_size*
        ``e2e.add`` tasks with callback ``e2e.record_sum`` (0: none), sleep
        *sleep_seconds* (first run) or *rerun_sleep_seconds* (later runs). *fail*:
        ``"always"`` raises after the write, ``"retry_once"`` calls ``self.retry()``
        (countdown 0) on the first run."""
        runs = record_run(broker_url, self)
        self.db.execute(
            "INSERT INTO e2e_counters (key, n) VALUES (%s, %s) "
            "ON CONFLICT (key) DO UPDATE SET n = e2e_counters.n + excluded.n",
            (key, amount),
        )
        if chord_size:
            chord([add.s(i, i) for i in range(chord_size)])(record_sum.s())
        time.sleep(sleep_seconds if runs == 1 else rerun_sleep_seconds)
        if fail == "always":
            raise ValueError(f"atomic_add {key} fails")
        if fail == "retry_once" and self.request.retries == 0:
            raise self.retry(countdown=0)
        return {"key": key, "runs": runs, "pid": os.getpid()}

    return app


#: DDL of the counters ``e2e.atomic_add`` adds to in its transaction (created by the tests).
COUNTERS_DDL = """
CREATE TABLE IF NOT EXISTS e2e_counters (key text PRIMARY KEY, n bigint NOT NULL)
"""

app = create_app()
