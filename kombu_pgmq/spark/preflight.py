"""What a Spark job needs from the executors of a cluster, checked before it runs there.

On ``local[*]`` the executors are threads of the driver: they see its files, its Python and
its network. On a cluster (``spark://``, YARN, Kubernetes) they run on other machines, and
three things that worked locally break there, usually as a stack trace from deep inside an
executor:

* **paths**: a ``file://`` (or plain) path is read on every executor, so it must exist at
  the same path on each of them (a shared mount), or be ``hdfs://`` / ``s3a://``;
* **Python**: the ``pgmq`` data source runs in the executors' Python: that Python needs
  ``kombu-pgmq-transport`` installed (``pip install kombu-pgmq-transport``);
* **the broker**: the data source connects from the executors, so the broker URL must be
  reachable from there; a Unix-socket URL (the embedded PostgreSQL's, ``host=/dir``) only
  works on the database's own machine.

:func:`require` checks them from the driver's session with one small Spark job (16 Spark
tasks of a UDF that uses the standard library only, so it runs where ``kombu_pgmq`` is
missing) and raises :class:`~kombu_pgmq.errors.SparkError` naming each problem, the
executor hosts that have it and the fix. On a local master it runs no job and returns at
once; a successful check is remembered in the process (same master, same question).

:func:`explain` turns an error Spark raised for a missing ``kombu_pgmq`` on the executors
into the same message (:class:`~kombu_pgmq.spark.SparkTask` applies it to what its tasks
raise).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .. import _conninfo as conninfo
from ..errors import SparkError
from ._pgurl import params as _params
from ._pgurl import unix_socket

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "ExecutorReport",
    "check",
    "check_remote",
    "explain",
    "is_cluster",
    "require",
    "unix_socket",
]

#: Spark tasks of the check job (spread over the executors by the scheduler).
PROBE_TASKS = 16
#: Seconds an executor waits for a TCP connection to the broker.
CONNECT_TIMEOUT_SECONDS = 3.0
PACKAGE = "kombu-pgmq-transport"
_MISSING_MODULE = "No module named 'kombu_pgmq"
_checked: set[tuple[Any, ...]] = set()


@dataclass
class ExecutorReport:
    """What one executor process saw. ``missing_paths``: of the paths asked about;
    ``module_error``: why ``kombu_pgmq.spark.datasource`` did not import (None: it did);
    ``broker_error``: why the broker's socket did not connect (None: it did, or not
    asked)."""

    host: str
    pid: int
    python: str
    missing_paths: list[str] = field(default_factory=list)
    module_error: str | None = None
    broker_error: str | None = None


def is_cluster(spark: SparkSession) -> bool:
    """Whether ``spark``'s master is a cluster (``spark.master`` not ``local...``)."""
    master = str(spark.conf.get("spark.master", "local") or "local")
    return not master.startswith("local")


def _tcp_target(url: str) -> tuple[str, int]:
    params = _params(url)
    host = str(params.get("host") or "localhost").split(",")[0]
    port = int(str(params.get("port") or conninfo.DEFAULT_PORT).split(",")[0])
    return host, port


def _local_path(path: str) -> str | None:
    """The file system path of ``path`` if executors read it from their local disk
    (``file://`` or no scheme), else None (``hdfs://``, ``s3a://``: not checked)."""
    text = str(path)
    scheme = urlsplit(text).scheme
    if scheme == "file":
        return urlsplit(text).path
    if scheme in ("", None) or len(scheme) == 1:  # plain path (or a Windows drive)
        return text
    return None


def _probe_function(
    paths: Sequence[str], socket_path: str | None, tcp: tuple[str, int] | None, module: bool
) -> Callable[[Any], str]:
    """The UDF body run on executors. Defined in a function so that cloudpickle ships it
    by value: it must run where ``kombu_pgmq`` cannot be imported. Standard library only."""
    timeout = CONNECT_TIMEOUT_SECONDS

    def probe(_: Any) -> str:
        import importlib
        import json
        import os
        import socket
        import sys

        out: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "python": sys.executable,
            "missing_paths": [p for p in paths if not os.path.exists(p)],
            "module_error": None,
            "broker_error": None,
        }
        if module:
            try:
                importlib.import_module("kombu_pgmq.spark.datasource")
            except Exception as exc:  # ImportError, or a broken install
                out["module_error"] = f"{type(exc).__name__}: {exc}"
        try:
            if socket_path is not None:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(timeout)
                    sock.connect(socket_path)
            elif tcp is not None:
                with socket.create_connection(tcp, timeout=timeout):
                    pass
        except OSError as exc:
            out["broker_error"] = f"{type(exc).__name__}: {exc}"
        return json.dumps(out)

    return probe


def check(
    spark: SparkSession,
    *,
    paths: Iterable[str] = (),
    broker_url: str | None = None,
    datasource: bool = False,
) -> list[ExecutorReport]:
    """Run the check job on ``spark``'s executors (also on a local master); one report per
    executor process that ran one of its Spark tasks (best effort: the scheduler decides
    which executors get the 16 tasks; on an idle cluster every executor gets some).

    ``paths``: files or directories the job will read (``hdfs://``/``s3a://`` ones are
    skipped). ``broker_url``: PostgreSQL URL (or DSN) the executors must reach (TCP connect,
    or the Unix socket's connect). ``datasource``: whether executors must import the
    ``pgmq`` data source.
    """
    from pyspark.sql import functions as F

    local = [p for p in (_local_path(str(p)) for p in paths) if p is not None]
    socket_path = tcp = None
    if broker_url is not None:
        socket_path = unix_socket(broker_url)
        tcp = None if socket_path is not None else _tcp_target(broker_url)
    # Plain (pickled) Python UDF: no pandas or pyarrow needed on the executors.
    probe = F.udf(_probe_function(local, socket_path, tcp, datasource), "string", useArrow=False)
    rows = spark.range(0, PROBE_TASKS, 1, PROBE_TASKS).select(probe("id").alias("r")).collect()
    seen: dict[tuple[str, int], ExecutorReport] = {}
    for row in rows:
        data = json.loads(row["r"])
        seen.setdefault((data["host"], data["pid"]), ExecutorReport(**data))
    return list(seen.values())


def check_remote(
    url: str,
    *,
    paths: Iterable[str] = (),
    broker_url: str | None = None,
    datasource: bool = False,
) -> list[ExecutorReport]:
    """:func:`check` in a session of its own on the Connect server at ``url``
    (``sc://host:15002/;token=...``), released afterwards."""
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.remote(url).create()
    try:
        return check(spark, paths=paths, broker_url=broker_url, datasource=datasource)
    finally:
        spark.stop()


def problems(reports: Sequence[ExecutorReport], *, broker_url: str | None = None) -> list[str]:
    """The sentences :func:`require` raises for ``reports`` (empty: all good)."""
    out: list[str] = []

    def hosts(selected: Iterable[ExecutorReport]) -> str:
        return ", ".join(sorted({f"{r.host} (pid {r.pid})" for r in selected}))

    missing = sorted({p for r in reports for p in r.missing_paths})
    for path in missing:
        where = hosts(r for r in reports if path in r.missing_paths)
        out.append(
            f"path {path} is not visible to the Spark executor(s) on {where}: on a cluster "
            "every executor reads it, so put it on storage they all mount at the same path "
            "(NFS), or use hdfs:// or s3a:// (the example pipeline: set PIPELINE_DIR)"
        )
    broken = [r for r in reports if r.module_error]
    if broken:
        pythons = ", ".join(sorted({r.python for r in broken}))
        out.append(
            f"the Python of the Spark executor(s) on {hosts(broken)} ({pythons}) cannot import "
            f"kombu_pgmq ({broken[0].module_error}): the pgmq data source runs there; "
            f"pip install {PACKAGE} into that Python on every worker host"
        )
    unreachable = [r for r in reports if r.broker_error]
    if unreachable and broker_url is not None:
        shown = conninfo.redact(broker_url)
        sock = unix_socket(broker_url)
        if sock is not None:
            out.append(
                f"the broker URL {shown} is a Unix socket ({sock}), which the Spark "
                f"executor(s) on {hosts(unreachable)} cannot reach "
                f"({unreachable[0].broker_error}): executors on other machines need a TCP "
                "URL of a PostgreSQL they can reach, e.g. "
                "postgresql://user:password@db.example.com:5432/dbname (Celery's broker_url, "
                "or the pgmq data source's url option); the embedded PostgreSQL listens on a "
                "Unix socket only, for one machine"
            )
        else:
            host, port = _tcp_target(broker_url)
            out.append(
                f"the Spark executor(s) on {hosts(unreachable)} cannot connect to the broker "
                f"at {host}:{port} ({unreachable[0].broker_error}): use a host name they can "
                "resolve and reach (not localhost), and allow them in pg_hba.conf"
            )
    return out


def require(
    spark: SparkSession,
    *,
    paths: Iterable[str] = (),
    broker_url: str | None = None,
    datasource: bool = False,
) -> None:
    """:func:`check` on a cluster, raising on any problem; nothing on a local master.

    Cost: one Spark job of 16 tiny tasks (~0.3 s), once per process for the same master and
    arguments.

    Raises:
        SparkError: executors cannot see a path, import ``kombu_pgmq`` or reach the broker
            (the message names the hosts and the fix).
    """
    if not is_cluster(spark):
        return
    paths = tuple(str(p) for p in paths)
    key = (str(spark.conf.get("spark.master")), paths, broker_url, datasource)
    if key in _checked:
        return
    reports = check(spark, paths=paths, broker_url=broker_url, datasource=datasource)
    found = problems(reports, broker_url=broker_url)
    if found:
        raise SparkError("; ".join(found))
    _checked.add(key)


def explain(exc: BaseException) -> SparkError | None:
    """A :class:`SparkError` with the fix if ``exc`` says the executors (or the server's
    Python workers) cannot import ``kombu_pgmq``; else None."""
    text = str(exc)
    if _MISSING_MODULE not in text:
        return None
    return SparkError(
        "Spark's Python workers cannot import kombu_pgmq (the pgmq data source runs in "
        f"them, on every executor): pip install {PACKAGE} into the Python of every Spark "
        "worker host (the interpreter of spark.pyspark.python / PYSPARK_PYTHON); "
        f"Spark said: {text.splitlines()[0] if text else type(exc).__name__}"
    )
