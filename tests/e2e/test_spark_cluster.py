"""End to end on a real Spark standalone cluster: a master and two workers as separate
processes on loopback (:mod:`kombu_pgmq.spark.cluster`), a Connect server with
``--master spark://127.0.0.1:<port>``, and Celery workers whose Spark tasks reach it through
``spark_remote`` (``$SPARK_REMOTE``) with no change to the task code.

A worker "on another machine" is a Spark worker in its own mount namespace (``unshare -m``)
where directories are hidden under an empty tmpfs: the executors it launches do not see
the driver's files, the Unix socket of the database, or the ``kombu_pgmq`` package.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

import kombu_pgmq
from kombu_pgmq.errors import SparkError
from kombu_pgmq.spark import preflight, session_id
from tests.e2e.helpers import REPO_ROOT, Worker, runs, wait_for
from tests.e2e.test_spark_tasks import _log_size, _wait_cancelled, _wait_progress
from tests.support import pgserver

pytestmark = pytest.mark.spark

RESULT_TIMEOUT_S = 180.0
CONNECT_NAME = "kombu_pgmq Spark Connect server"


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set, restored afterwards (the cluster's and the
    Connect server's directories are read from it)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_cluster(
    base: Path, *, workers: int, prefix: tuple[str, ...] = (), ui: bool = False
) -> dict[str, Any]:
    """Master + workers + a Connect server on the cluster, each on a free port, files
    under ``base``. ``prefix``: command every worker JVM runs under."""
    from kombu_pgmq.spark import cluster, server

    ports = {k: pgserver.free_port() for k in ("master", "webui", "connect", "ui")}
    env = {cluster.ENV_DIR: str(base / "cluster"), server.ENV_DIR: str(base / "connect")}
    with _environ(env):
        cluster.start(
            workers=0 if prefix else workers, port=ports["master"], webui_port=ports["webui"]
        )
        if prefix:  # workers under a command of their own
            for _ in range(workers):
                cluster.add_worker(ports["master"], prefix=prefix)
            wait_for(
                lambda: cluster.master_json(ports["webui"])["aliveworkers"] >= workers,
                120,
                "workers registered",
                interval=0.25,
            )
        conf = {**cluster.application_conf(ports["master"])}
        if ui:
            conf.update({"spark.ui.enabled": "true", "spark.ui.port": str(ports["ui"])})
        url = server.ensure_running(
            {
                "spark_connect_port": ports["connect"],
                "spark_local_master": cluster.master_url(ports["master"]),
                "spark_local_conf": conf,
            }
        )
        return {
            "url": url,
            "ports": ports,
            "log": server.status(ports["connect"])["log"],
            "env": env,
        }


def _stop_cluster(info: dict[str, Any]) -> None:
    from kombu_pgmq.spark import cluster, server

    with _environ(info["env"]):
        server.stop(info["ports"]["connect"])
        cluster.stop(info["ports"]["master"])


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Master + 2 workers (1 core, 1 GiB each) + Connect server (its UI on, for the REST
    API). Shape: ``{"url", "ports": {"master", "webui", "connect", "ui"}, "log", "env"}``;
    ``env`` holds the cluster's directories (for :mod:`kombu_pgmq.spark.cluster` calls)."""
    info = _start_cluster(tmp_path_factory.mktemp("spark-cluster"), workers=2, ui=True)
    try:
        yield info
    finally:
        _stop_cluster(info)


def _app_id(webui_port: int) -> str:
    from kombu_pgmq.spark import cluster

    apps = [a for a in cluster.master_json(webui_port)["activeapps"] if a["name"] == CONNECT_NAME]
    assert len(apps) == 1, apps
    return str(apps[0]["id"])


def _run_pipeline(tmp_path: Path, name: str, env: dict[str, str]) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.run_pipeline", str(tmp_path / f"{name}.log")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = (tmp_path / f"{name}.log").read_text(errors="replace")[-4000:]
    assert proc.returncode == 0, f"{name}: {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{log}"
    table: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])["table"]
    return table


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two pipeline runs (local: ~50 s, cluster: ~90 s on 2 cores)
def test_flights_pipeline_on_the_cluster_equals_the_local_run_with_executors_on_both_workers(
    spark_cluster: dict[str, Any],
    spark_server: dict[str, Any],
    db_dsn: str,
    tmp_path: Path,
) -> None:
    from kombu_pgmq.spark import cluster

    base = {k: v for k, v in os.environ.items() if k != "SPARK_REMOTE"}
    base.update(KOMBU_PGMQ_URL=db_dsn, PYTHONUNBUFFERED="1")
    base.pop("DATABASE_URL", None)
    t0 = time.monotonic()
    local = _run_pipeline(tmp_path, "local", {**base, "PIPELINE_DIR": str(tmp_path / "local")})
    t1 = time.monotonic()
    on_cluster = _run_pipeline(
        tmp_path,
        "cluster",
        {**base, "PIPELINE_DIR": str(tmp_path / "cluster"), "SPARK_REMOTE": spark_cluster["url"]},
    )
    print(f"pipeline: local {t1 - t0:.1f} s, cluster {time.monotonic() - t1:.1f} s")

    assert len(local) == 16
    # Same carriers in the same order, same counts; means rounded to 0.1 on both sides
    # (sums in another partition order may round a tie the other way: one step allowed).
    exact = ("carrier", "name", "flights", "worst_month")
    assert [{k: r[k] for k in exact} for r in on_cluster] == [
        {k: r[k] for k in exact} for r in local
    ]
    for mine, theirs in zip(on_cluster, local, strict=True):
        for key in ("mean_dep_delay_min", "late_pct", "worst_month_delay_min"):
            assert abs(mine[key] - theirs[key]) < 0.11, (key, mine, theirs)
    # The cluster wrote the Parquet (the executors did): month directories exist.
    assert len(list((tmp_path / "cluster" / "flights.parquet").glob("month=*"))) == 12
    # The Connect server's application has an executor on each of the two workers.
    ports = spark_cluster["ports"]
    app_id = _app_id(ports["webui"])
    executors = cluster.executors_by_worker(ports["webui"], app_id)
    assert len(executors) == 2, executors
    assert all(len(found) == 1 for found in executors.values()), executors


def _running_jobs(ui_port: int) -> list[dict[str, Any]]:
    base = f"http://127.0.0.1:{ui_port}/api/v1/applications"
    with urllib.request.urlopen(base, timeout=5) as response:
        app = json.load(response)[0]["id"]
    with urllib.request.urlopen(f"{base}/{app}/jobs?status=running", timeout=5) as response:
        jobs: list[dict[str, Any]] = json.load(response)
    return jobs


def test_revoke_cancels_the_job_on_the_cluster(
    spark_cluster: dict[str, Any],
    start_worker: Callable[..., Worker],
    app: Celery,
    db: psycopg.Connection,
) -> None:
    start_worker(SPARK_REMOTE=spark_cluster["url"])
    result = app.tasks["e2e.spark_sleep"].delay(2, 120_000)
    _wait_progress(result)
    ui_port = spark_cluster["ports"]["ui"]
    assert len(_running_jobs(ui_port)) == 1  # the 2-minute job, on the cluster
    offset = _log_size(spark_cluster["log"])
    app.control.revoke(result.id, terminate=True)
    # How fast: benchmarks/spark_cancel.py --remote.
    elapsed = _wait_cancelled(spark_cluster["log"], offset, session_id(result.id), timeout=30)
    print(f"revoke -> cluster job cancelled: {elapsed:.3f} s")
    wait_for(lambda: not _running_jobs(ui_port), 30, "no running job on the cluster")
    wait_for(lambda: result.state == "REVOKED", 30, "state REVOKED")
    assert len(runs(db, result.id)) == 1


@pytest.mark.slow
def test_spark_worker_killed_mid_job_is_survived_and_the_task_runs_once(
    spark_cluster: dict[str, Any],
    start_worker: Callable[..., Worker],
    app: Celery,
    db: psycopg.Connection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGKILL of a Spark worker and its executor (its process group) while both run a
    Spark task: Spark retries the lost task on the other worker, the Celery task succeeds
    once. The killed worker is replaced afterwards."""
    from kombu_pgmq.spark import cluster

    ports = spark_cluster["ports"]
    monkeypatch.setenv(cluster.ENV_DIR, spark_cluster["env"][cluster.ENV_DIR])
    start_worker(SPARK_REMOTE=spark_cluster["url"])
    result = app.tasks["e2e.spark_sleep"].delay(2, 8000)
    # Both Spark tasks running: one per executor (1 core each).
    wait_for(
        lambda: (
            (info := result.backend.get_task_meta(result.id)["result"])
            and isinstance(info, dict)
            and info.get("inflight_tasks") == 2
        ),
        RESULT_TIMEOUT_S,
        "2 Spark tasks in flight",
    )
    victim = min(n for n in cluster._worker_pids(cluster.cluster_dir(ports["master"])))
    assert cluster.stop_worker(victim, ports["master"], signal.SIGKILL)
    out = result.get(timeout=RESULT_TIMEOUT_S)
    assert out["rows"] == 2 and out["runs"] == 1
    assert len(runs(db, result.id)) == 1
    log = spark_cluster["log"].read_text(errors="replace")
    assert "Lost executor" in log or "lost executor" in log.lower(), log[-3000:]
    wait_for(
        lambda: cluster.master_json(ports["webui"])["aliveworkers"] == 1,
        120,
        "the master saw the worker die",
        interval=0.25,
    )
    cluster.add_worker(ports["master"])
    wait_for(
        lambda: cluster.master_json(ports["webui"])["aliveworkers"] == 2,
        120,
        "replacement worker registered",
        interval=0.25,
    )


# -- a worker "on another machine" ---------------------------------------------------------


def _namespaces_work() -> bool:
    try:
        probe = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs none /mnt"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.fixture(scope="module")
def remote_worker_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A cluster whose only worker hides ``hidden/`` (a data file and a listening Unix
    socket the test made) and the ``kombu_pgmq`` package from its executors."""
    if not _namespaces_work():
        pytest.skip("needs unshare -m and tmpfs mounts (root in a Linux sandbox)")
    base = tmp_path_factory.mktemp("remote-worker")
    hidden, visible = base / "hidden", base / "visible"
    hidden.mkdir()
    visible.mkdir()
    for directory in (hidden, visible):
        (directory / "data.csv").write_text("a,b\n1,2\n")
    sockets = []
    for directory in (hidden, visible):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(directory / ".s.PGSQL.5432"))
        sock.listen(16)
        sockets.append(sock)
    package = Path(kombu_pgmq.__file__).resolve().parent
    script = 'for d in "$1" "$2"; do mount -t tmpfs none "$d" || exit 1; done; shift 2; exec "$@"'
    prefix = (
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        str(hidden),
        str(package),
    )
    info = _start_cluster(base, workers=1, prefix=prefix)
    info.update(hidden=hidden, visible=visible)
    try:
        yield info
    finally:
        _stop_cluster(info)
        for sock in sockets:
            sock.close()


def _socket_url(directory: Path) -> str:
    return f"postgresql://postgres@/postgres?host={directory}&port=5432"


@pytest.mark.slow
def test_preflight_names_what_executors_on_another_machine_lack(
    remote_worker_cluster: dict[str, Any],
) -> None:
    from pyspark.sql import SparkSession

    info = remote_worker_cluster
    hidden, visible = info["hidden"], info["visible"]
    spark = SparkSession.builder.remote(info["url"]).create()
    try:
        assert preflight.is_cluster(spark)
        reports = preflight.check(
            spark,
            paths=[str(hidden / "data.csv"), f"file://{visible / 'data.csv'}", "s3a://b/k"],
            broker_url=_socket_url(hidden),
            datasource=True,
        )
        assert reports
        for r in reports:
            assert r.missing_paths == [str(hidden / "data.csv")]
            assert r.module_error is not None and "kombu_pgmq" in r.module_error
            assert r.broker_error is not None
        # The same executors reach a socket and see a file outside the hidden directory.
        ok = preflight.check(spark, paths=[str(visible)], broker_url=_socket_url(visible))
        assert ok and all(not r.missing_paths and r.broker_error is None for r in ok)
        with pytest.raises(SparkError) as raised:
            preflight.require(
                spark,
                paths=[str(hidden / "data.csv")],
                broker_url=_socket_url(hidden),
                datasource=True,
            )
        message = str(raised.value)
        print(message)
        assert f"path {hidden / 'data.csv'} is not visible to the Spark executor(s)" in message
        assert "pip install kombu-pgmq-transport" in message
        assert "is a Unix socket" in message and "TCP URL" in message
        preflight.require(spark, paths=[str(visible)], broker_url=_socket_url(visible))
    finally:
        spark.stop()


@pytest.mark.slow
def test_pgmq_write_on_executors_without_kombu_pgmq_is_explained(
    remote_worker_cluster: dict[str, Any], db_dsn: str
) -> None:
    from pyspark.sql import SparkSession

    from kombu_pgmq.spark import register

    spark = SparkSession.builder.remote(remote_worker_cluster["url"]).create()
    try:
        register(spark)
        df = spark.range(3).selectExpr("id AS n")
        with pytest.raises(Exception) as raised:
            df.write.format("pgmq").options(url=db_dsn, queue="rows").mode("append").save()
        explained = preflight.explain(raised.value)
        assert explained is not None, str(raised.value)[:2000]
        assert "pip install kombu-pgmq-transport" in str(explained)
    finally:
        spark.stop()
    with psycopg.connect(db_dsn) as conn:  # nothing became visible
        row = conn.execute("SELECT to_regclass('pgmq.q_rows')").fetchone()
        if row is not None and row[0] is not None:
            assert (
                conn.execute("SELECT count(*) FROM pgmq.q_rows WHERE vt <= now()").fetchone()[0]
                == 0
            )
