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
``~/.local/share/kombu_pgmq/spark-connect-<port>``, a directory of mode 0700 owned by the
user): ``server.pid``, ``server.log`` (the JVM's log4j output, INFO: cancelled jobs are
logged there), ``server.python`` (the interpreter of its Python workers), ``server.token``
(its authentication token, mode 0600), ``server.properties`` (its Spark settings, mode
0600), ``server.lock``.

Security: the server runs jobs (Python UDFs and data sources included) as the user who
started it, and jobs carry secrets (broker URLs in ``pgmq`` options), so

* it listens on 127.0.0.1 only and requires a token: :func:`ensure_running` generates one
  for every start (``secrets.token_urlsafe``), gives it to the JVM in its environment
  (``SPARK_CONNECT_AUTHENTICATE_TOKEN``, as pyspark's own local server does) and keeps it
  in ``server.token``; the URL it returns carries it (``sc://localhost:15002/;token=...``;
  pyspark sends a token in clear text only to the host ``localhost``). Print URLs through
  :func:`redact_url`;
* before the URL is returned (each call, also when the server already runs), every socket
  listening on the port on a loopback or wildcard address (IPv4 and IPv6) must belong to
  the user and be held by the pid in ``server.pid`` (the JVM: spark-submit execs it); else
  :class:`~kombu_pgmq.errors.SparkServerError` names the port and the other process, and
  nothing is sent to it. The server also holds ``[::1]:<port>`` (bound, not listening), as
  a client of ``localhost`` may try ``::1`` first: no other process can listen there while
  it runs. The sockets are listed through psutil (``psutil.net_connections``). Cost
  (measured on 2 cores under gVisor, ~300 sockets): the first check in a process lists
  every process's sockets (~50 ms); later calls (Linux) read the pid file and readlink the
  listening socket's fd (~60 us per call), and check everything again when either
  changed. Where listing other processes' sockets is refused (macOS without root: a
  warning, once), only the server's own sockets are checked, on every call;
* no secret on a command line (``ps`` shows those to every user): the token goes through
  the environment, ``spark_local_conf`` and the defaults through ``--properties-file``
  (``--load-spark-defaults`` keeps ``spark-defaults.conf`` underneath). The port and
  ``--master`` stay on the command line; ``spark.driver.extraJavaOptions`` becomes JVM
  arguments, so keep secrets out of it.

A server left by an older version (no ``server.token``: no authentication) is restarted.

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
``spark_local_conf``      --                               extra Spark settings of the
                                                           local server (dict; not the
                                                           port, address or token)
========================  ===============================  ================================
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import ConfigurationError, SparkServerError
from . import _sockets, _state

__all__ = [
    "DEFAULT_PORT",
    "ensure_running",
    "redact_url",
    "remote_url",
    "running_master",
    "running_url",
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
ENV_DIR = _state.ENV_DIR
#: Environment variable of the Connect server's (and pyspark client's) token.
ENV_TOKEN = "SPARK_CONNECT_AUTHENTICATE_TOKEN"
#: Seconds a starting server gets to accept connections (JVM start: ~5-7 s on 2 cores).
START_TIMEOUT_SECONDS = 120.0
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
#: Host of the local server's URL: pyspark uses gRPC local credentials (which may carry a
#: token in clear text) only for the host name ``localhost``.
LOCAL_HOST = "localhost"
#: Address the local server binds to.
BIND_ADDRESS = "127.0.0.1"
#: Configuration of the local server; ``spark_local_conf`` adds to / overrides it.
DEFAULT_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    # Small jobs on a few cores: 200 shuffle partitions (Spark's default) cost more than
    # they compute. Adaptive execution still coalesces/splits as needed.
    "spark.sql.shuffle.partitions": "8",
    "spark.driver.memory": "1g",
    # Stage progress to clients (SparkTask's PROGRESS state) twice a second (default 2 s).
    "spark.connect.progress.reportInterval": "500ms",
}
#: Settings of the local server that ``spark_local_conf`` cannot change.
_RESERVED_CONF = (
    "spark.connect.grpc.binding.address",
    "spark.connect.grpc.binding.port",
    "spark.connect.authenticate.token",
)
_TOKEN_FILE = "server.token"
_PROPERTIES_FILE = "server.properties"
_TOKEN_PARAM = re.compile(r"(;token=)[^;]*")
_FIX = (
    "Stop that process, or give the local server another port (Celery setting "
    f"spark_connect_port or ${ENV_PORT})"
)

#: Servers started by this process, by port.
_children: dict[int, subprocess.Popen[bytes]] = {}


class _Verified(NamedTuple):
    """A server checked to be ours: its pid, its listening sockets as ``(fd path,
    "socket:[inode]")``, its token."""

    pid: int
    sockets: tuple[tuple[str, str], ...]
    token: str


#: Servers checked to be ours in this process, by (port, state directory).
_verified: dict[tuple[int, Path], _Verified] = {}


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
            f"'sc://host:15002' (or 'local'), not {redact_url(value)!r}"
        )
    return value


def redact_url(url: str) -> str:
    """``url`` with its token hidden, for logs and output.

    Shapes: ``"sc://localhost:15002/;token=abc;x=1" -> "sc://localhost:15002/;token=***;x=1"``.
    """
    return _TOKEN_PARAM.sub(r"\1***", url)


def state_dir(port: int = DEFAULT_PORT) -> Path:
    """Directory of the local server's pid file, log, token and lock (created on demand,
    mode 0700)."""
    override = os.environ.get(ENV_DIR, "").strip()
    if override:
        return Path(override).expanduser().absolute()
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local/share")
    return Path(base) / "kombu_pgmq" / f"spark-connect-{port}"


def _read_token(directory: Path) -> str | None:
    try:
        return (directory / _TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def _url(port: int, token: str) -> str:
    return f"sc://{LOCAL_HOST}:{port}/;token={token}"


def accepting(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _recorded_pid(directory: Path) -> int | None:
    try:
        return int((directory / "server.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _foreign(
    port: int, directory: Path, pid: int | None, others: Iterable[_sockets.ListeningSocket]
) -> str:
    owners = "; ".join(f"{_sockets.owner(o.pid)} on {o.address}" for o in others)
    ours = f"pid {pid}" if pid is not None else "no server.pid"
    return (
        f"port {port} on this host is listened on by another process ({owners}), "
        f"not by the kombu_pgmq Spark Connect server ({ours} in {directory}): no Spark job "
        f"or token is sent to it. {_FIX}"
    )


def _still(verified: _Verified, directory: Path) -> bool:
    """Whether the checked server still holds its listening sockets (one readlink each):
    while it does, no other process can listen on 127.0.0.1:<port>, nor on [::1]:<port>
    (the server holds that address too, see
    :func:`~kombu_pgmq.spark._sockets.hold_ipv6_loopback`). False without ``/proc`` (no
    sockets recorded): checked again."""
    if not verified.sockets or _recorded_pid(directory) != verified.pid:
        return False
    for path, link in verified.sockets:
        try:
            if os.readlink(path) != link:
                return False
        except OSError:
            return False
    return True


def _ours(port: int, directory: Path) -> str | None:
    """URL (token included) of our server on ``port``, or None if nothing listens there or
    it has no token (an older version's).

    Every socket listening on the port where a client of ``localhost`` may connect must be
    held by the pid in ``server.pid`` (a process of this user); then, in this process (on
    Linux), only that the pid file is the same and the pid still holds those sockets.
    Where the system's sockets cannot be listed (macOS without root): the server's own
    sockets must listen on the port, and whatever else may listen on other addresses is
    not seen (a warning says so, once); the token protects the server.

    Raises:
        SparkServerError: another process listens on the port.
    """
    key = (port, directory)
    cached = _verified.pop(key, None)
    if cached is not None and _still(cached, directory):
        _verified[key] = cached
        return _url(port, cached.token)
    pid = _recorded_pid(directory)
    listeners = _sockets.listeners(port)
    if listeners is None:  # not allowed to list every process's sockets
        _warn_partial_check()
        held = _sockets.held_by(pid, port) if pid is not None else None
        if held is None:  # not ours (or not inspectable): the token alone protects it
            token = _read_token(directory)
            return _url(port, token) if token is not None and accepting(port) else None
        if not held:
            if accepting(port):
                raise SparkServerError(_foreign(port, directory, pid, []))
            return None
        listeners = held
    if not listeners:
        return None
    others = [found for found in listeners if pid is None or found.pid != pid]
    if others:
        raise SparkServerError(_foreign(port, directory, pid, others))
    assert pid is not None  # it holds the listeners
    token = _read_token(directory)
    if token is None:  # started by an older version, without authentication
        return None
    links = [_sockets.fd_link(pid, found.fd) for found in listeners]
    sockets = tuple(link for link in links if link is not None)
    if len(sockets) != len(links):
        sockets = ()  # not all recorded: check everything again next time
    _verified[key] = _Verified(pid, sockets, token)
    return _url(port, token)


@functools.cache
def _warn_partial_check() -> None:
    _logger.warning(
        "cannot list other processes' sockets (psutil.AccessDenied; macOS needs root): "
        "the local Spark Connect server is checked to listen on its port, but another "
        "process listening there on another address would not be seen; its token still "
        "protects it"
    )


def _listening(port: int) -> bool:
    listeners = _sockets.listeners(port)
    return bool(listeners) if listeners is not None else accepting(port)


def _command(port: int, master: str, properties: Path) -> list[str]:
    """``spark-submit`` command line: nothing secret (``ps`` shows it to every user)."""
    spark_home = _state.spark_home()
    return [
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
        "--properties-file",
        str(properties),
        "--load-spark-defaults",  # spark-defaults.conf too, under these settings
    ]


def _extra_conf(conf: Mapping[str, Any] | None) -> Mapping[str, Any]:
    extra = (conf.get("spark_local_conf") if conf is not None else None) or {}
    if not isinstance(extra, Mapping):
        raise ConfigurationError(
            f"spark_local_conf must be a dict of Spark settings, not {type(extra).__name__}"
        )
    reserved = sorted(key for key in extra if key in _RESERVED_CONF)
    if reserved:
        raise ConfigurationError(
            f"spark_local_conf cannot set {', '.join(reserved)}: the local server listens on "
            f"{BIND_ADDRESS}, on spark_connect_port / ${ENV_PORT}, with a token of its own"
        )
    return extra


def running_url(conf: Mapping[str, Any] | None = None) -> str:
    """URL of the local server if it runs and is ours (see :func:`ensure_running`); never
    starts it.

    Raises:
        SparkServerError: no server of ours runs on the port, or another process listens
            there.
    """
    port = local_port(conf)
    url = _ours(port, state_dir(port))
    if url is None:
        raise SparkServerError(f"no kombu_pgmq Spark Connect server runs on port {port}")
    return url


def ensure_running(conf: Mapping[str, Any] | None = None) -> str:
    """Start the local Connect server unless it runs; check it is ours; return its URL.

    Shapes: ``(app.conf or None) -> "sc://localhost:15002/;token=..."`` (the token is a
    secret: log :func:`redact_url` of it). Fast path (our server runs, checked earlier in
    this process): the pid file, one readlink, the interpreter file, ~60 us. Otherwise
    checks who listens on the port, and starts the server if nothing does (up to 120 s).

    Raises:
        SparkServerError: the server exited or did not accept connections in time (the
            message has the tail of ``server.log``), or another process listens on the
            port (see the module docstring).
        ConfigurationError: pyspark is missing or a setting is invalid.
    """
    port = local_port(conf)
    directory = state_dir(port)
    url = _ours(port, directory)
    if url is not None and _python_ok(directory):
        return url
    extra = _extra_conf(conf)
    master = str(_setting(conf, "spark_local_master", ENV_MASTER) or "local[*]")
    with _state.locked(directory):
        url = _ours(port, directory)
        if url is not None and _python_ok(directory):
            return url  # another process started it while we waited
        if url is not None:
            # Its Python workers would run an interpreter that is gone (the virtualenv
            # that started it was deleted or recreated): the pgmq data source would fail.
            _logger.warning(
                "the Spark Connect server on port %s runs Python workers of a deleted "
                "interpreter; restarting it with %s",
                port,
                sys.executable,
            )
        elif _listening(port):  # ours (Linux: checked) but without a token
            _logger.warning(
                "the Spark Connect server on port %s has no authentication token (started "
                "by an older kombu_pgmq); restarting it",
                port,
            )
        return _start(directory, port, master, extra)


def _start(directory: Path, port: int, master: str, extra: Mapping[str, Any]) -> str:
    stale = _state.read_pid(directory / "server.pid", SERVER_CLASS)
    if stale is not None:  # to restart (see the caller), or alive but not listening: hung
        _logger.warning("stopping the Spark Connect server of port %s (pid %s)", port, stale)
        _state.terminate(stale, children=_children.values())
    token = secrets.token_urlsafe(32)
    _state.write_private(directory / _TOKEN_FILE, token)
    properties = directory / _PROPERTIES_FILE
    _state.write_private(
        properties,
        _state.properties_text(
            {**DEFAULT_CONF, **extra, "spark.connect.grpc.binding.address": BIND_ADDRESS}
        ),
    )
    env = dict(os.environ)
    # The server's Python workers (Data Sources, UDFs) run our interpreter and venv.
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("SPARK_LOCAL_IP", BIND_ADDRESS)
    env.pop("SPARK_REMOTE", None)
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    env[ENV_TOKEN] = token  # the environment of a process is readable by its user only
    log_path = directory / "server.log"
    t0 = time.monotonic()
    _logger.info("starting the local Spark Connect server on port %s (log: %s)", port, log_path)
    ipv6 = _sockets.hold_ipv6_loopback(port, _FIX)
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                _command(port, master, properties),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=directory,
                start_new_session=True,  # outlives the worker child that started it
                pass_fds=() if ipv6 is None else (ipv6.fileno(),),  # the JVM keeps it
            )
    finally:
        if ipv6 is not None:
            ipv6.close()
    previous = _children.get(port)
    if previous is not None:
        previous.poll()  # a server of ours that died: reap it
    _children[port] = proc  # reaped by stop(); never "deleted while running"
    # spark-submit execs the launcher's java command: this pid is the JVM's.
    _state.write_private(directory / "server.pid", str(proc.pid))
    _state.write_private(directory / "server.python", env["PYSPARK_PYTHON"])
    deadline = t0 + START_TIMEOUT_SECONDS
    while not accepting(port, timeout=0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                _state.terminate(proc.pid, children=_children.values())
            raise SparkServerError(
                f"the local Spark Connect server did not start on port {port} "
                f"(exit status {proc.poll()}); last lines of {log_path}:\n{_state.tail(log_path)}"
            )
        time.sleep(0.1)
    try:
        url = _ours(port, directory)
    except SparkServerError:  # someone else took the port (or ::1 on it) meanwhile
        if proc.poll() is None:
            _state.terminate(proc.pid, children=_children.values())
        raise
    if url is None:  # cannot happen: it accepts and the token was written first
        raise SparkServerError(f"the local Spark Connect server on port {port} has no token")
    _logger.info(
        "local Spark Connect server ready on port %s in %.1f s (pid %s)",
        port,
        time.monotonic() - t0,
        proc.pid,
    )
    return url


def _python_ok(directory: Path) -> bool:
    """False if the server we started runs Python workers of an interpreter that is gone."""
    try:
        python = (directory / "server.python").read_text().strip()
    except OSError:
        return True  # not started by us (or by an older version): nothing to check
    return not python or os.path.exists(python)


def status(port: int = DEFAULT_PORT) -> dict[str, Any]:
    """Shapes: ``{"port": int, "accepting": bool, "pid": int | None, "log": Path,
    "problem": str | None}`` (``problem``: another process listens on the port)."""
    directory = state_dir(port)
    problem = None
    try:
        _ours(port, directory)
    except SparkServerError as exc:
        problem = str(exc)
    return {
        "port": port,
        "accepting": accepting(port),
        "pid": _state.read_pid(directory / "server.pid", SERVER_CLASS),
        "log": directory / "server.log",
        "problem": problem,
    }


def running_master(port: int = DEFAULT_PORT) -> str | None:
    """``--master`` of the local server running on ``port`` (Linux: read from its command
    line), or None if none of ours runs there (or not Linux)."""
    pid = _state.read_pid(state_dir(port) / "server.pid", SERVER_CLASS)
    if pid is None:
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for flag, value in itertools.pairwise(argv):
        if flag == b"--master":
            return value.decode()
    return None


def stop(port: int = DEFAULT_PORT) -> bool:
    """Stop the local server this module started on ``port``; False if none was running.

    Running Spark jobs are cancelled with it.
    """
    directory = state_dir(port)
    with _state.locked(directory):
        pid = _state.read_pid(directory / "server.pid", SERVER_CLASS)
        if pid is not None:
            _state.terminate(pid, children=_children.values())
        for name in ("server.pid", _TOKEN_FILE):
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()
        _verified.pop((port, directory), None)
        proc = _children.pop(port, None)  # ours: reap it (stopped now or by someone else)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        return pid is not None
