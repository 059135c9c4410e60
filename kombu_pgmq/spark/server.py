"""The local Spark Connect server: one JVM per host, started on demand, shared by processes.

:func:`ensure_running` is what the task launcher calls before it opens a session: if no
server answers on the port it starts one from the installed ``pyspark`` (``spark-submit
--class org.apache.spark.sql.connect.service.SparkConnectServer``, ~5-7 s), in its own
session (it outlives the worker that started it, like the embedded PostgreSQL), and waits
until it accepts connections. A file lock serializes concurrent callers (every prefork child
may ask at once); a server that died is started again by the next caller (supervision on
demand). Its Python workers (Python Data Sources, UDFs) run ``sys.executable`` of the
process that started it, so they import the same ``kombu_pgmq``; a server whose
interpreter was deleted since (a recreated virtualenv) is restarted.

Files (:func:`state_dir`, ``$KOMBU_PGMQ_SPARK_DIR`` or
``~/.local/share/kombu_pgmq/spark-connect-<port>``): ``server.pid``, ``server.log`` (the
JVM's log4j output, INFO: cancelled jobs are logged there), ``server.python`` (the
interpreter of its Python workers), ``server.lock``.

Shell::

    kombu-pgmq spark server start|stop|status [--port 15002]

Settings (Celery ``app.conf`` key, else environment variable):

========================  ===============================  ================================
Celery setting            environment                      meaning
========================  ===============================  ================================
``spark_remote``          ``SPARK_REMOTE``                 Connect URL of a real cluster
                                                           (``sc://host:15002``); when set,
                                                           no local server is started
``spark_connect_port``    ``KOMBU_PGMQ_SPARK_CONNECT_PORT``  port of the local server
                                                           (default 15002, 127.0.0.1 only)
``spark_local_master``    ``KOMBU_PGMQ_SPARK_MASTER``      ``--master`` of the local server
                                                           (default ``local[*]``)
``spark_local_conf``      --                               extra ``--conf`` of the local
                                                           server (dict)
========================  ===============================  ================================
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError, SparkServerError

__all__ = [
    "DEFAULT_PORT",
    "ensure_running",
    "remote_url",
    "state_dir",
    "status",
    "stop",
]

_logger = logging.getLogger(__name__)

#: Port of the local Connect server (Spark's default Connect port).
DEFAULT_PORT = 15002
ENV_REMOTE = "SPARK_REMOTE"
ENV_PORT = "KOMBU_PGMQ_SPARK_CONNECT_PORT"
ENV_MASTER = "KOMBU_PGMQ_SPARK_MASTER"
ENV_DIR = "KOMBU_PGMQ_SPARK_DIR"
#: Seconds a starting server gets to accept connections (JVM start: ~5-7 s on 2 cores).
START_TIMEOUT_SECONDS = 120.0
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
#: Configuration of the local server; ``spark_local_conf`` adds to / overrides it.
DEFAULT_CONF: dict[str, str] = {
    "spark.connect.grpc.binding.address": "127.0.0.1",
    "spark.ui.enabled": "false",
    # Small jobs on a few cores: 200 shuffle partitions (Spark's default) cost more than
    # they compute. Adaptive execution still coalesces/splits as needed.
    "spark.sql.shuffle.partitions": "8",
    "spark.driver.memory": "1g",
    # Stage progress to clients (SparkTask's PROGRESS state) twice a second (default 2 s).
    "spark.connect.progress.reportInterval": "500ms",
}


#: Servers started by this process, by port.
_children: dict[int, subprocess.Popen[bytes]] = {}


def _setting(conf: Mapping[str, Any] | None, key: str, env: str | None) -> Any:
    if conf is not None:
        value = conf.get(key)
        if value not in (None, ""):
            return value
    if env:
        value = os.environ.get(env, "").strip()
        if value:
            return value
    return None


def local_port(conf: Mapping[str, Any] | None = None) -> int:
    """Port of the local server: ``spark_connect_port``, ``$KOMBU_PGMQ_SPARK_CONNECT_PORT``
    or 15002.

    Raises:
        ConfigurationError: the value is not a port number.
    """
    value = _setting(conf, "spark_connect_port", ENV_PORT)
    if value is None:
        return DEFAULT_PORT
    try:
        port = int(value)
    except (TypeError, ValueError):
        port = -1
    if not 0 < port < 65536:
        raise ConfigurationError(
            f"spark_connect_port / ${ENV_PORT} must be a TCP port number, not {value!r}"
        )
    return port


def remote_url(conf: Mapping[str, Any] | None = None) -> str | None:
    """The configured Connect URL of a real cluster, or None for the local server.

    Order: Celery setting ``spark_remote``, then ``$SPARK_REMOTE``. Shapes:
    ``"sc://spark.example.com:15002/;token=..."``, or ``"local"`` (pyspark's private
    server per process: one JVM per worker child, for experiments only).

    Raises:
        ConfigurationError: the value is neither ``sc://...`` nor ``local``.
    """
    value = _setting(conf, "spark_remote", ENV_REMOTE)
    if value is None:
        return None
    value = str(value)
    if value != "local" and not value.startswith("sc://"):
        raise ConfigurationError(
            f"spark_remote / ${ENV_REMOTE} must be a Spark Connect URL such as "
            f"'sc://host:15002' (or 'local'), not {value!r}"
        )
    return value


def state_dir(port: int = DEFAULT_PORT) -> Path:
    """Directory of the local server's pid file, log and lock (created on demand)."""
    override = os.environ.get(ENV_DIR, "").strip()
    if override:
        return Path(override).expanduser().absolute()
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local/share")
    return Path(base) / "kombu_pgmq" / f"spark-connect-{port}"


def accepting(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _read_pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "server.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _spark_home() -> Path:
    try:
        import pyspark
    except ImportError as exc:
        raise ConfigurationError(
            "pyspark is not installed: pip install 'kombu-pgmq-transport[spark]'"
        ) from exc
    return Path(pyspark.__file__).resolve().parent


def _command(port: int, master: str, conf: Mapping[str, Any]) -> list[str]:
    spark_home = _spark_home()
    cmd = [
        "bash",
        str(spark_home / "bin" / "spark-submit"),
        "--class",
        SERVER_CLASS,
        "--name",
        "kombu_pgmq Spark Connect server",
        "--master",
        master,
        "--conf",
        f"spark.connect.grpc.binding.port={port}",
    ]
    for key, value in {**DEFAULT_CONF, **conf}.items():
        cmd += ["--conf", f"{key}={value}"]
    return cmd


def ensure_running(conf: Mapping[str, Any] | None = None) -> str:
    """Start the local Connect server unless one answers; return its URL.

    Shapes: ``(app.conf or None) -> "sc://127.0.0.1:15002"``. Fast path (a server answers):
    one TCP connect, ~0.2 ms. Otherwise starts it and waits up to 120 s.

    Raises:
        SparkServerError: the server exited or did not accept connections in time (the
            message has the tail of ``server.log``).
        ConfigurationError: pyspark is missing or a setting is invalid.
    """
    port = local_port(conf)
    url = f"sc://127.0.0.1:{port}"
    directory = state_dir(port)
    if accepting(port) and _python_ok(directory):
        return url
    with _locked(directory):
        if accepting(port):
            if _python_ok(directory):  # another process started it while we waited
                return url
            # Its Python workers would run an interpreter that is gone (the virtualenv
            # that started it was deleted or recreated): the pgmq data source would fail.
            _logger.warning(
                "the Spark Connect server on port %s runs Python workers of a deleted "
                "interpreter; restarting it with %s",
                port,
                sys.executable,
            )
            stale = _read_pid(directory / "server.pid")
            if stale is not None:
                _terminate(stale)
        master = str(_setting(conf, "spark_local_master", ENV_MASTER) or "local[*]")
        extra = (conf.get("spark_local_conf") if conf is not None else None) or {}
        if not isinstance(extra, Mapping):
            raise ConfigurationError(
                f"spark_local_conf must be a dict of Spark settings, not {extra!r}"
            )
        _start(directory, port, master, extra)
    return url


def _start(directory: Path, port: int, master: str, extra: Mapping[str, Any]) -> None:
    stale = _read_pid(directory / "server.pid")
    if stale is not None:  # alive but not accepting: hung; replace it
        _logger.warning(
            "Spark Connect server pid %s does not answer on %s: stopping it", stale, port
        )
        _terminate(stale)
    env = dict(os.environ)
    # The server's Python workers (Data Sources, UDFs) run our interpreter and venv.
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.pop("SPARK_REMOTE", None)
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    log_path = directory / "server.log"
    t0 = time.monotonic()
    _logger.info("starting the local Spark Connect server on port %s (log: %s)", port, log_path)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            _command(port, master, extra),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=directory,
            start_new_session=True,  # outlives the worker child that started it
        )
    previous = _children.get(port)
    if previous is not None:
        previous.poll()  # a server of ours that died: reap it
    _children[port] = proc  # reaped by stop(); never "deleted while running"
    (directory / "server.pid").write_text(str(proc.pid))
    (directory / "server.python").write_text(env["PYSPARK_PYTHON"])
    deadline = t0 + START_TIMEOUT_SECONDS
    while not accepting(port, timeout=0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                _terminate(proc.pid)
            raise SparkServerError(
                f"the local Spark Connect server did not start on port {port} "
                f"(exit status {proc.poll()}); last lines of {log_path}:\n{_tail(log_path)}"
            )
        time.sleep(0.1)
    _logger.info(
        "local Spark Connect server ready on port %s in %.1f s (pid %s)",
        port,
        time.monotonic() - t0,
        proc.pid,
    )


def _python_ok(directory: Path) -> bool:
    """False if the server we started runs Python workers of an interpreter that is gone."""
    try:
        python = (directory / "server.python").read_text().strip()
    except OSError:
        return True  # not started by us (or by an older version): nothing to check
    return not python or os.path.exists(python)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _terminate(pid: int, timeout: float = 15.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        for child in _children.values():
            if child.pid == pid:
                child.poll()  # reap our own child, or it stays a zombie "alive"
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def status(port: int = DEFAULT_PORT) -> dict[str, Any]:
    """Shapes: ``{"port": int, "accepting": bool, "pid": int | None, "log": Path}``."""
    directory = state_dir(port)
    return {
        "port": port,
        "accepting": accepting(port),
        "pid": _read_pid(directory / "server.pid"),
        "log": directory / "server.log",
    }


def stop(port: int = DEFAULT_PORT) -> bool:
    """Stop the local server this module started on ``port``; False if none was running.

    Running Spark jobs are cancelled with it.
    """
    directory = state_dir(port)
    with _locked(directory):
        pid = _read_pid(directory / "server.pid")
        if pid is not None:
            _terminate(pid)
            with contextlib.suppress(FileNotFoundError):
                (directory / "server.pid").unlink()
        proc = _children.pop(port, None)  # ours: reap it (stopped now or by someone else)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        return pid is not None
