"""Durable revocations of Celery tasks (table ``kombu_pgmq.revoked``).

Celery keeps revoked task ids in each worker's memory (and its ``--statedb`` file): a
worker started after ``AsyncResult.revoke()`` runs the task anyway, and the task's result
stays PENDING until some worker receives it. With kombu_pgmq a revocation is a row:

* **Recorded** by ``kombu-pgmq task cancel`` and by every ``revoke`` broadcast published
  through a kombu_pgmq broker (``AsyncResult.revoke()``, ``app.control.revoke()``,
  ``celery control revoke``): the transport's publisher sees Celery's remote-control
  message to ``<control_exchange>.pidbox`` and records its task ids in the same
  database, before it is sent. Kept :data:`REVOKE_EXPIRES_SECONDS`.
* **Loaded** by every ``celery worker`` on a kombu_pgmq broker when it starts
  (``worker_init``, before it consumes; when the database cannot be reached then, at
  ``worker_ready``, once Celery's consumer has connected and before it handles a
  message): the ids go into Celery's own revoked set (``celery.worker.state.revoked``),
  so the worker refuses those tasks as Celery does (the task ends REVOKED in the result
  backend, its message is acked).
* **Read** by kombu_pgmq's result backend: a revoked task that has no result reads as
  REVOKED, and a ``get()`` waiting for it raises ``TaskRevokedError``.
"""

from __future__ import annotations

import base64
import importlib
import json
import logging
from typing import Any

from ._conninfo import is_ours, to_dsn
from ._db.connector import Connector
from ._db.results import ResultStore
from .errors import KombuPgmqError, StatementError

logger = logging.getLogger(__name__)

__all__ = [
    "REVOKE_EXPIRES_SECONDS",
    "load_into_worker",
    "load_when_ready",
    "record",
    "revoked_ids",
]

#: How long a recorded revocation is kept (seconds): 7 days.
REVOKE_EXPIRES_SECONDS = 7 * 86400.0
#: The most revocations a starting worker loads (newest first), as Celery's own limit
#: (``celery.worker.state.REVOKES_MAX``).
LOAD_MAX = 50_000


def revoked_ids(message: dict[str, Any]) -> list[str]:
    """The task ids a Kombu message revokes: a Celery remote-control ``revoke``
    (JSON body ``{"method": "revoke", "arguments": {"task_id": id | [ids]}}``); ``[]``
    for anything else (never raises)."""
    try:
        if "json" not in str(message.get("content-type") or ""):
            return []
        body: Any = message.get("body") or ""
        if (message.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        data = json.loads(body)
        if not isinstance(data, dict) or data.get("method") != "revoke":
            return []
        task_id = (data.get("arguments") or {}).get("task_id")
    except Exception:  # not a control message we understand: nothing to record
        return []
    ids = task_id if isinstance(task_id, (list, tuple)) else [task_id]
    return [str(t) for t in ids if t]


def record(db: Connector, task_ids: list[str]) -> None:
    """Record durable revocations of ``task_ids`` on ``db`` (kept
    :data:`REVOKE_EXPIRES_SECONDS`); waiting ``get()`` calls are notified.

    Raises:
        KombuPgmqError: the statement failed (e.g. PermissionDenied for a role that may
            not revoke).
    """
    ResultStore(db).revoke(task_ids, REVOKE_EXPIRES_SECONDS)


def _broker_dsn(app: Any) -> str | None:
    """The libpq DSN of ``app``'s broker when it is kombu_pgmq's (None: another broker)."""
    conf = app.conf
    url = conf.broker_read_url or conf.broker_url
    if isinstance(url, (list, tuple)):
        url = url[0] if url else None
    if not url or not is_ours(url, conf.broker_transport) or "://" not in str(url):
        return None
    return to_dsn(str(url).split(";", 1)[0])


def _load(dsn: str) -> list[Any]:
    """The revocations in force in ``dsn``'s database, newest first.

    Raises:
        KombuPgmqError: the database cannot be reached, or the statement failed.
    """
    db = Connector(dsn, role="revocations")
    try:
        return ResultStore(db).revoked(LOAD_MAX)
    finally:
        db.close()


def _add(rows: list[Any]) -> None:
    # Only ever called in a Celery worker (Celery is an extra: imported by name).
    state = importlib.import_module("celery.worker.state")
    for row in rows:
        state.revoked.add(row.task_id)
    if rows:
        logger.info("kombu_pgmq: %d revoked task ids loaded", len(rows))


#: Broker DSN whose revocations ``worker_init`` could not load (this process).
_deferred: str | None = None


def load_into_worker(sender: Any = None, **_: Any) -> None:
    """``worker_init`` receiver: add the revocations in force to Celery's revoked set,
    when the worker's broker is kombu_pgmq's.

    Never raises, and says nothing when it fails: it runs before the worker's logging is
    set up (a message would be a bare stderr line ahead of Celery's banner), and Celery's
    consumer reports an unreachable or refused database itself, with the fix, as it
    retries. The load is tried again at ``worker_ready`` (:func:`load_when_ready`), once
    the consumer is connected and before it handles a message."""
    global _deferred
    app = getattr(sender, "app", None)
    dsn = _broker_dsn(app) if app is not None else None
    if dsn is None:
        return
    try:
        rows = _load(dsn)
    except KombuPgmqError as exc:
        logger.debug("kombu_pgmq: durable revocations not loaded yet: %s", exc)
        _deferred = dsn
        return
    _deferred = None
    _add(rows)


def load_when_ready(sender: Any = None, **_: Any) -> None:
    """``worker_ready`` receiver (``sender``: the worker's consumer, connected): load the
    revocations :func:`load_into_worker` could not. Failures are logged, never raised
    (the worker runs with its in-memory set, as Celery's own)."""
    global _deferred
    dsn, _deferred = _deferred, None
    if dsn is None:
        return
    try:
        rows = _load(dsn)
    except StatementError as exc:  # a database the workers have not installed yet
        logger.info("kombu_pgmq: no durable revocations loaded: %s", exc)
        return
    except KombuPgmqError as exc:
        logger.warning("kombu_pgmq: could not load the durable revocations: %s", exc)
        return
    _add(rows)
