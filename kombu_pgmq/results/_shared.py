"""The result backend's statement connection: one per process, Celery app and database,
shared by the app's backend instances.

Celery makes one result backend instance per thread (``app.backend`` is thread-local
unless ``result_backend_thread_safe``), and under gevent or eventlet ``threading.local``
is per greenlet: a connection per instance would be a connection per pool thread, or per
task greenlet (``-P gevent -c 100`` ran up to a hundred, each open until its instance was
collected). Instead every backend instance of a Celery app in a process uses one
:class:`SharedConnector` for a database: each statement, and each transaction as a whole
(a chord's count and its callback's publish), holds a lock, so two threads or greenlets
never interleave on the session. Waiting on results (LISTEN) keeps a connection of its own
(:mod:`kombu_pgmq.results.consumer`). See ``docs/connections.md``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._db.connector import Connector
from ..schema import ensure_schema, verify

__all__ = ["SharedConnector", "shared_connector"]

#: Celery app -> {(pid, dsn): connector} (another app gets a connection of its own).
_SHARED: weakref.WeakKeyDictionary[Any, dict[tuple[int, str], SharedConnector]] = (
    weakref.WeakKeyDictionary()
)
_SHARED_LOCK = threading.Lock()


class SharedConnector(Connector):
    """A :class:`~kombu_pgmq._db.connector.Connector` whose statements and transactions
    are serialized by a re-entrant lock (safe to share between threads and greenlets)."""

    def __init__(self, dsn: str, **kwargs: Any) -> None:
        super().__init__(dsn, **kwargs)
        self._serial = threading.RLock()

    @property
    def closed(self) -> bool:
        """True after :meth:`close` (a new one is made for the next backend)."""
        return self._closed

    def _abandon(self) -> None:
        forked = self._pid != os.getpid()
        super()._abandon()
        if forked:
            self._serial = threading.RLock()  # may have been held at fork time

    def fetch(self, *args: Any, **kwargs: Any) -> Any:
        with self._serial:
            return super().fetch(*args, **kwargs)

    def script(self, text: str) -> None:
        with self._serial:
            super().script(text)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._serial, super().transaction():
            yield

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with self._serial:
            yield from super().stream(*args, **kwargs)


def shared_connector(app: Any, dsn: str, install_schema: bool) -> SharedConnector:
    """The result connection of Celery app ``app`` to ``dsn`` in this process (the schema
    installed, or checked, before it is first handed out; connects now).

    Raises:
        BrokerConnectionError: the server cannot be reached.
        BootstrapError: the schema is missing and ``install_schema`` is off.
    """
    key = (os.getpid(), dsn)
    db = _SHARED.get(app, {}).get(key)
    if db is not None and not db.closed:
        return db
    with _SHARED_LOCK:
        db = _SHARED.get(app, {}).get(key)
        if db is None or db.closed:
            db = SharedConnector(dsn, role="results", lz4=True)
            try:
                if install_schema:
                    ensure_schema(db, dsn)
                else:
                    verify(db)
            except BaseException:
                db.close()
                raise
            _SHARED.setdefault(app, {})[key] = db
    return db
