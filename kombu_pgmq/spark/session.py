"""Spark Connect sessions of Celery tasks: deterministic ids, open, interrupt.

A task's session id is ``uuid5(SESSION_NAMESPACE, "<task id>/<retries>/<attempt>")``:
any process that knows the task id (the worker's main process after its child was
killed, the next delivery of the same message) can reattach to the session and interrupt
what it still runs. ``attempt`` starts at 0; Spark Connect refuses to reopen a session
that was released (``INVALID_HANDLE.SESSION_CLOSED``), so the next attempt number is used
then (e.g. a message delivered again after its task finished but before its ack landed).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import SparkError
from . import server

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["SESSION_NAMESPACE", "connect_url", "interrupt_task", "open_session", "session_id"]

_logger = logging.getLogger(__name__)

#: Namespace of task session ids (uuid5 of "kombu_pgmq.spark").
SESSION_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "kombu_pgmq.spark")
#: Released sessions skipped before giving up (see module docstring).
MAX_ATTEMPTS = 5


def session_id(task_id: str, retries: int = 0, attempt: int = 0) -> str:
    """Deterministic Spark Connect session id of a task execution (a UUID string)."""
    return str(uuid.uuid5(SESSION_NAMESPACE, f"{task_id}/{retries}/{attempt}"))


def connect_url(conf: Mapping[str, Any] | None = None, *, start: bool = True) -> str:
    """Connect URL for task sessions: the configured cluster, else the local server.

    The local server's URL carries its token (``sc://localhost:15002/;token=...``): pass
    it to pyspark, never to a log or a command line (:func:`kombu_pgmq.spark.server.
    redact_url`). It is returned only once the server is checked to be ours. With
    ``start=True`` the local server is started if it is not running
    (:func:`kombu_pgmq.spark.server.ensure_running`).

    Raises:
        SparkServerError: the local server did not start, or (``start=False``) does not
            run, or another process listens on its port.
    """
    remote = server.remote_url(conf)
    if remote is not None:
        return remote
    if start:
        return server.ensure_running(conf)
    return server.running_url(conf)


def _with_session_id(url: str, sid: str) -> str:
    # sc://host:port/;param=value;... (Spark Connect client connection string)
    if "/;" in url:
        return f"{url};session_id={sid}"
    return f"{url.rstrip('/')}/;session_id={sid}"


def _is_closed(exc: BaseException) -> bool:
    return "SESSION_CLOSED" in str(exc)


def open_session(url: str, task_id: str, retries: int = 0) -> tuple[SparkSession, list[str]]:
    """Open (or reattach to) the task's session; interrupt what it still runs.

    Returns ``(session, interrupted operation ids)``: the ids are operations of an earlier
    delivery of the same task whose process died (kill -9) before it could cancel them.
    ``url == "local"`` gives pyspark's per-process private server and a plain session.

    Raises:
        pyspark.errors.PySparkException: the server refused the session.
        SparkError: every attempt id of the task was already released.
    """
    from pyspark.sql import SparkSession

    if url == "local":
        return SparkSession.builder.remote("local").getOrCreate(), []
    last: BaseException | None = None
    for attempt in range(MAX_ATTEMPTS):
        spark = SparkSession.builder.remote(
            _with_session_id(url, session_id(task_id, retries, attempt))
        ).create()
        try:
            return spark, list(spark.interruptAll())
        except Exception as exc:
            if not _is_closed(exc):
                raise
            last = exc
            close_quietly(spark)
    raise SparkError(
        f"Spark Connect refused {MAX_ATTEMPTS} session ids of task {task_id} as closed: "
        f"{last}; retry the task (its retry count is part of the id)"
    ) from last


def close_quietly(spark: SparkSession) -> None:
    """Stop ``spark``'s session, ignoring a session already released or a server gone
    (logged at debug level)."""
    try:
        spark.stop()
    except Exception:  # released already, or the server is gone: nothing to free
        _logger.debug("closing a Spark session failed", exc_info=True)


def interrupt_task(url: str, task_id: str, retries: int = 0) -> list[str]:
    """Interrupt every operation of the task's session(s); return the interrupted ids.

    Used from another process than the task's (its child was killed). Walks the attempt
    ids like :func:`open_session`; an id unknown to the server creates and releases an
    empty session, which is harmless (the task then uses the next attempt id).
    """
    from pyspark.sql import SparkSession

    interrupted: list[str] = []
    t0 = time.monotonic()
    for attempt in range(MAX_ATTEMPTS):
        spark = SparkSession.builder.remote(
            _with_session_id(url, session_id(task_id, retries, attempt))
        ).create()
        try:
            interrupted += spark.interruptAll()
        except Exception as exc:
            if _is_closed(exc):
                continue
            raise
        finally:
            close_quietly(spark)
        break
    _logger.info(
        "interrupted %d Spark operation(s) of task %s in %.3f s",
        len(interrupted),
        task_id,
        time.monotonic() - t0,
    )
    return interrupted
