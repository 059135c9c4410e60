"""A local Spark standalone cluster: one master and N workers on 127.0.0.1, as processes.

For users who outgrow ``local[*]`` before they have a real cluster, and for the tests that
prove task code runs unchanged on one. The processes are Spark's own (``spark-class
org.apache.spark.deploy.master.Master`` / ``...deploy.worker.Worker`` from the installed
``pyspark``; the pip wheel ships no ``sbin/start-master.sh``), each in its own session, so
they outlive the command that started them::

    kombu-pgmq spark cluster start --workers 2 --cores 1 --memory 1g
    kombu-pgmq spark cluster status
    kombu-pgmq spark cluster stop

``start`` also starts the local Spark Connect server (:mod:`kombu_pgmq.spark.server`) with
``--master spark://127.0.0.1:7077``: Celery workers on this host then run their
:class:`~kombu_pgmq.spark.SparkTask` jobs on the cluster with no setting changed (they find
the running server). Other hosts set ``spark_remote`` to a Connect server of their own.

Files (:func:`cluster_dir`: ``$KOMBU_PGMQ_SPARK_CLUSTER_DIR`` or
``~/.local/share/kombu_pgmq/spark-cluster-<master port>``, mode 0700): ``master.pid``,
``master.log``, ``worker-<n>.pid``, ``worker-<n>.log``, ``work/worker-<n>/`` (executor
logs and scratch), ``cluster.properties`` (mode 0600: the shared secret).

Security: the master and workers listen on 127.0.0.1 only and require Spark's shared
secret (``spark.authenticate``, a ``secrets.token_urlsafe`` made at each start, given to
every process in a 0600 properties file, never on a command line): another local user
cannot submit an application to the cluster. The Connect server started with it gets the
same secret in its own 0600 properties file.

REST: the master's web UI serves ``/json/`` (workers, cores used, applications) on
``webui_port`` (default 8080); each worker's web UI (a free port, ``webuiaddress`` in the
master's JSON) lists its executors per application: :func:`executors_by_worker`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError, SparkServerError
from . import _state, server

__all__ = [
    "DEFAULT_MASTER_PORT",
    "DEFAULT_WEBUI_PORT",
    "add_worker",
    "cluster_dir",
    "executors_by_worker",
    "master_json",
    "master_url",
    "start",
    "status",
    "stop",
    "stop_worker",
]

#: Spark standalone defaults.
DEFAULT_MASTER_PORT = 7077
DEFAULT_WEBUI_PORT = 8080
ENV_DIR = "KOMBU_PGMQ_SPARK_CLUSTER_DIR"
HOST = "127.0.0.1"
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
#: Seconds the master gets to serve its web UI, and the workers to register (each JVM
#: starts in ~6 s on 2 cores).
START_TIMEOUT_SECONDS = 120.0
_PROPERTIES = "cluster.properties"
#: Processes started by this process, by pid (reaped when stopped: no zombies).
_children: dict[int, subprocess.Popen[bytes]] = {}


def cluster_dir(port: int = DEFAULT_MASTER_PORT) -> Path:
    """Directory of the cluster's pid files, logs and secret (not created here)."""
    override = os.environ.get(ENV_DIR, "").strip()
    if override:
        return Path(override).expanduser().absolute()
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local/share")
    return Path(base) / "kombu_pgmq" / f"spark-cluster-{port}"


def master_url(port: int = DEFAULT_MASTER_PORT) -> str:
    """``spark://127.0.0.1:<port>``: the ``--master`` of applications on this cluster."""
    return f"spark://{HOST}:{port}"


def _running(path: Path, marker: str) -> int | None:
    """The pid in pid file ``path`` if it runs a JVM of class ``marker``."""
    return _state.read_pid(path, marker)


def _spawn(
    argv: Sequence[str],
    log: Path,
    directory: Path,
    *,
    prefix: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> int:
    spark_home = _state.spark_home()
    full_env = {**os.environ, "SPARK_HOME": str(spark_home), "SPARK_LOCAL_IP": HOST}
    for key in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", server.ENV_TOKEN):
        full_env.pop(key, None)
    full_env.update(env or {})
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*prefix, "bash", str(spark_home / "bin" / "spark-class"), *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=directory,
            start_new_session=True,  # outlives this process; stopped by process group
        )
    _children[proc.pid] = proc
    return proc.pid


def master_json(webui_port: int = DEFAULT_WEBUI_PORT, timeout: float = 2.0) -> dict[str, Any]:
    """The master's ``/json/`` (shape: ``{"url", "workers": [{"id", "host", "webuiaddress",
    "cores", "coresused", "state", ...}], "aliveworkers", "activeapps": [{"id", "name",
    "cores", ...}], "status"}``).

    Raises:
        SparkServerError: the master's web UI does not answer.
    """
    return _get_json(f"http://{HOST}:{webui_port}/json/", timeout)


def _get_json(url: str, timeout: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data: dict[str, Any] = json.load(response)
            return data
    except (OSError, ValueError) as exc:
        raise SparkServerError(f"no Spark web UI answers at {url}: {exc}") from exc


def executors_by_worker(
    webui_port: int = DEFAULT_WEBUI_PORT, app_id: str | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Executors per alive worker id, read from each worker's web UI ``/json/``; only those
    of application ``app_id`` if given. Shape: ``{worker id: [{"id": int, "appid": str,
    "cores": int, "memory": int (MiB), ...}]}``.

    Raises:
        SparkServerError: the master's or a worker's web UI does not answer.
    """
    out: dict[str, list[dict[str, Any]]] = {}
    for worker in master_json(webui_port)["workers"]:
        if worker.get("state") != "ALIVE":
            continue
        info = _get_json(worker["webuiaddress"].rstrip("/") + "/json/", 2.0)
        out[worker["id"]] = [
            e for e in info.get("executors", []) if app_id is None or e.get("appid") == app_id
        ]
    return out


def _wait(what: str, ready: Any, logs: Sequence[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready():
                return
        except SparkServerError:
            pass
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {log}\n{_state.tail(log)}" for log in logs)
            raise SparkServerError(
                f"the Spark cluster did not get ready ({what}) in time:\n{tails}"
            )
        time.sleep(0.25)


def _worker_pids(directory: Path) -> dict[int, int | None]:
    pids = {}
    for path in directory.glob("worker-*.pid"):
        number = path.stem.removeprefix("worker-")
        if number.isdigit():
            pids[int(number)] = _running(path, WORKER_CLASS)
    return pids


def add_worker(
    port: int = DEFAULT_MASTER_PORT,
    *,
    cores: int = 1,
    memory: str = "1g",
    prefix: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> int:
    """Start one more worker of the cluster on ``port``; returns its number (its files are
    ``worker-<n>.*``). It registers with the master within seconds (not waited for here).

    ``prefix`` runs the JVM under another command (the tests use ``unshare -m ... --`` to
    give a worker its own view of the file system, like a worker on another machine).

    Raises:
        SparkServerError: no master of kombu_pgmq runs on ``port``.
    """
    directory = cluster_dir(port)
    if _running(directory / "master.pid", MASTER_CLASS) is None:
        raise SparkServerError(
            f"no kombu_pgmq Spark master runs on port {port}: kombu-pgmq spark cluster start"
        )
    number = max(_worker_pids(directory), default=0) + 1
    work = directory / "work" / f"worker-{number}"
    work.mkdir(parents=True, exist_ok=True)
    pid = _spawn(
        [
            WORKER_CLASS,
            master_url(port),
            "--host",
            HOST,
            "--port",
            "0",
            "--webui-port",
            "0",
            "--cores",
            str(cores),
            "--memory",
            memory,
            "--work-dir",
            str(work),
            "--properties-file",
            str(directory / _PROPERTIES),
        ],
        directory / f"worker-{number}.log",
        directory,
        prefix=prefix,
        env=env,
    )
    _state.write_private(directory / f"worker-{number}.pid", str(pid))
    return number


def start(
    *,
    workers: int = 2,
    cores: int = 1,
    memory: str = "1g",
    port: int = DEFAULT_MASTER_PORT,
    webui_port: int = DEFAULT_WEBUI_PORT,
    conf: Mapping[str, str] | None = None,
    timeout: float = START_TIMEOUT_SECONDS,
) -> dict[str, Any]:
    """Start a master and ``workers`` workers (``cores`` cores and ``memory`` each) on
    127.0.0.1 unless this cluster runs; wait until every worker registered (0 workers: a
    master alone, for :func:`add_worker`).

    ``conf``: extra Spark settings of the master and workers. Returns :func:`status`.

    Raises:
        ConfigurationError: a count is not positive.
        SparkServerError: a process did not start in time (the message has the logs'
            tails), or another process holds the port.
    """
    if workers < 0 or cores < 1:
        raise ConfigurationError(
            f"--workers must be 0 or more and --cores 1 or more, not {workers}/{cores}"
        )
    directory = _state.private_dir(cluster_dir(port), ENV_DIR)
    with _state.locked(directory, ENV_DIR):
        if _running(directory / "master.pid", MASTER_CLASS) is not None:
            return status(port, webui_port)
        if server.accepting(port) or server.accepting(webui_port):
            raise SparkServerError(
                f"port {port} or {webui_port} on {HOST} is taken by another process: stop it, "
                "or choose --port / --webui-port"
            )
        for stale in directory.glob("worker-*.pid"):
            stale.unlink()
        secret = secrets.token_urlsafe(32)
        settings = {
            **(conf or {}),
            "spark.authenticate": "true",
            "spark.authenticate.secret": secret,
        }
        _state.write_private(directory / _PROPERTIES, _state.properties_text(settings))
        t0 = time.monotonic()
        pid = _spawn(
            [
                MASTER_CLASS,
                "--host",
                HOST,
                "--port",
                str(port),
                "--webui-port",
                str(webui_port),
                "--properties-file",
                str(directory / _PROPERTIES),
            ],
            directory / "master.log",
            directory,
        )
        _state.write_private(directory / "master.pid", str(pid))
        _wait(
            "master",
            lambda: master_json(webui_port)["status"] == "ALIVE",
            [directory / "master.log"],
            timeout,
        )
        for _ in range(workers):
            add_worker(port, cores=cores, memory=memory)
        logs = [directory / "master.log", *sorted(directory.glob("worker-*.log"))]
        _wait(
            f"{workers} workers",
            lambda: master_json(webui_port)["aliveworkers"] >= workers,
            logs,
            max(1.0, timeout - (time.monotonic() - t0)),
        )
        return status(port, webui_port)


def secret(port: int = DEFAULT_MASTER_PORT) -> str:
    """The running cluster's shared secret (for applications: ``spark.authenticate.secret``).

    Raises:
        SparkServerError: the cluster is not running.
    """
    props = cluster_dir(port) / _PROPERTIES
    try:
        for line in props.read_text().splitlines():
            key, _, value = line.partition("=")
            if key == "spark.authenticate.secret":
                return value
    except OSError:
        pass
    raise SparkServerError(f"no kombu_pgmq Spark cluster runs on port {port}")


def application_conf(port: int = DEFAULT_MASTER_PORT) -> dict[str, str]:
    """Settings an application (the Connect server) needs to join the cluster: its secret."""
    return {"spark.authenticate": "true", "spark.authenticate.secret": secret(port)}


def status(port: int = DEFAULT_MASTER_PORT, webui_port: int = DEFAULT_WEBUI_PORT) -> dict[str, Any]:
    """Shape: ``{"master": "spark://127.0.0.1:7077", "running": bool, "pid": int | None,
    "webui": "http://127.0.0.1:8080", "workers": [{"id", "webuiaddress", "cores",
    "coresused", "state"}], "apps": [{"id", "name", "cores"}], "dir": Path}``."""
    directory = cluster_dir(port)
    pid = _running(directory / "master.pid", MASTER_CLASS)
    running = pid is not None
    info: dict[str, Any] = {
        "master": master_url(port),
        "running": running,
        "pid": pid,
        "webui": f"http://{HOST}:{webui_port}",
        "workers": [],
        "apps": [],
        "dir": directory,
    }
    if running:
        with contextlib.suppress(SparkServerError):
            data = master_json(webui_port)
            info["workers"] = [
                {k: w.get(k) for k in ("id", "webuiaddress", "cores", "coresused", "state")}
                for w in data.get("workers", [])
            ]
            info["apps"] = [
                {k: a.get(k) for k in ("id", "name", "cores")} for a in data.get("activeapps", [])
            ]
    return info


def stop_worker(number: int, port: int = DEFAULT_MASTER_PORT, sig: int = signal.SIGTERM) -> bool:
    """Stop worker ``number`` and its executors (its process group) with ``sig``; False if
    it was not running."""
    path = cluster_dir(port) / f"worker-{number}.pid"
    pid = _running(path, WORKER_CLASS)
    if pid is None:
        return False
    _stop_group(pid, sig)
    return True


def _stop_group(pid: int, sig: int, timeout: float = 15.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        child = _children.get(pid)
        if child is not None and child.poll() is not None:  # ours: reaped
            del _children[pid]
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def stop(port: int = DEFAULT_MASTER_PORT) -> bool:
    """Stop the cluster's workers (their executors with them) and master; False if no
    master of ours was running. Applications on it (the Connect server) lose their
    executors: stop them first (``kombu-pgmq spark cluster stop`` does)."""
    directory = cluster_dir(port)
    if not directory.exists():
        return False
    with _state.locked(directory, ENV_DIR):
        for number, pid in _worker_pids(directory).items():
            if pid is not None:
                _stop_group(pid, signal.SIGTERM)
            (directory / f"worker-{number}.pid").unlink(missing_ok=True)
        pid = _running(directory / "master.pid", MASTER_CLASS)
        if pid is not None:
            _stop_group(pid, signal.SIGTERM)
        (directory / "master.pid").unlink(missing_ok=True)
        return pid is not None
