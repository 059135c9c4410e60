"""Celery's result backend in PostgreSQL: ``result_backend = "postgresql://..."``.

Installing kombu_pgmq registers the schemes ``postgresql`` and ``postgres`` in Celery's
``celery.result_backends`` entry point group, so no import is needed::

    app.conf.broker_url = "postgresql://app@db/app"
    app.conf.result_backend = "postgresql://app@db/app"   # or "postgresql://": the broker's

What it gives over Celery's SQLAlchemy ``db+`` backend:

* **No polling.** ``AsyncResult.get()``, ``ResultSet.get()/join_native()/iter_native()``
  and ``backend.get_many()`` wake on LISTEN/NOTIFY when a result is written
  (:mod:`kombu_pgmq.results.consumer`), as Celery's Redis backend does with pub/sub.
* **Chords without ``chord_unlock``.** A chord completes by an atomic counter in SQL
  (:mod:`kombu_pgmq.results.chords`), counted **per header task id**: a header task that
  runs twice (its worker was killed after the result was written, the message delivered
  again) counts once, and the callback is published exactly once, in the transaction that
  counted the last part when the broker is kombu_pgmq in the same database.
* **Durable revocations** (``kombu-pgmq task cancel``, ``AsyncResult.revoke()``): a
  revoked task with no result reads as REVOKED, and workers started later refuse it.
* Results expire without Celery beat (``result_expires``; a worker deletes expired rows
  in batches every ``expire_interval_seconds``), and by ``celery.backend_cleanup``.

URL: as the broker's (:mod:`kombu_pgmq._conninfo`): ``postgresql://`` or
``postgres://``, libpq parameters in the query string (``sslmode``...), several hosts
(``postgresql://u@a,b/db``: the primary is found on every connect). ``postgresql://``
with nothing after it means the broker's database when the broker is kombu_pgmq's, else
:func:`kombu_pgmq.default_broker_url` (``$KOMBU_PGMQ_URL``, ``$DATABASE_URL``, or an
embedded PostgreSQL). Passwords never appear in logs or in ``as_uri()``.

Storage: table ``kombu_pgmq.results``, one row per Celery key with the
meta as Celery encodes it (``result_serializer``, ``result_compression``), its state and
its expiry. The tables are installed by the broker's migrations under the same advisory
lock; least-privilege roles reach them only through functions (``kombu-pgmq schema
grant``: a worker writes results and counts chords; a producer reads results, saves
groups (no other key: :class:`~kombu_pgmq.errors.PermissionDenied`), starts chords and
forgets results; neither may read all results, truncate or
drop them).

Transport Options
=================
``result_backend_transport_options``, checked when the backend is made: a name that is
not one of these is refused with the closest known one, a bad value names the option and
the value. The list below is made from
:class:`~kombu_pgmq.results.options.ResultBackendOptions`, whose fields document
themselves, when this module is imported.

<!-- result-backend-options -->
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from celery import states
from celery.backends.asynchronous import AsyncBackendMixin
from celery.backends.base import BaseKeyValueStoreBackend
from celery.exceptions import BackendStoreError, TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeoutError
from kombu.utils.encoding import bytes_to_str
from psycopg.conninfo import conninfo_to_dict

from .. import _conninfo as conninfo
from .. import errors
from .._db.connector import Connector
from .._db.pooling import mark_pooled, warn_polling_once
from .._db.results import ResultStore
from ..transport._binding import current_binding, current_transaction
from . import chords
from ._shared import SharedConnector, shared_connector
from .consumer import ResultConsumer
from .options import DEFAULT_MAX_BYTES, OPTIONS_MARKER, ResultBackendOptions, options_rst

if __doc__:  # None under python -OO
    __doc__ = __doc__.replace(OPTIONS_MARKER, options_rst())

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BYTES", "ResultBackend", "resolve_url"]


def resolve_url(url: str | None, app: Any) -> str:
    """The libpq connection string for a result backend URL.

    Shapes: ``"postgresql://u:p@h/db?sslmode=require" -> "user=u password=p host=h
    dbname=db sslmode=require application_name=kombu_pgmq"``; ``"postgresql://"`` (nothing
    more) -> the broker's database when ``app``'s broker is kombu_pgmq's, else
    :func:`kombu_pgmq.default_broker_url`; kombu's ``url1;url2`` failover form -> one
    multi-host string.

    Raises:
        ConfigurationError: not a PostgreSQL URL, or unparseable (password masked).
    """
    text = (url or "").strip()
    if text.partition("://")[2] in ("", "/"):
        broker = app.conf.broker_write_url or app.conf.broker_url
        if isinstance(broker, (list, tuple)):
            broker = ";".join(broker)
        if broker and conninfo.is_ours(broker, app.conf.broker_transport):
            text = broker
        else:
            from ..embedded import default_broker_url

            text = default_broker_url()
    urls = [u for u in text.split(";") if u.strip()]
    if len(urls) > 1:
        return conninfo.make_dsn(conninfo.failover_params(urls))
    return conninfo.to_dsn(urls[0])


class ResultBackend(AsyncBackendMixin, BaseKeyValueStoreBackend):
    """Celery result backend storing results in ``kombu_pgmq.results`` (see the module
    docstring). Made by Celery from ``result_backend = "postgresql://..."``."""

    ResultConsumer = ResultConsumer
    supports_native_join = True
    supports_autoexpire = True
    supports_result_compression = True
    supports_failure_expires = True
    #: Chords are counted by :mod:`kombu_pgmq.results.chords`, not Celery's ``incr``.
    implements_incr = False
    key_t = staticmethod(bytes_to_str)

    def __init__(self, app: Any, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(app=app, url=url, **kwargs)
        #: ``result_backend_transport_options``, validated (:class:`ResultBackendOptions`).
        self.options = ResultBackendOptions.parse(
            app.conf.get("result_backend_transport_options"), self._broker_options()
        )
        self.max_bytes = self.options.result_max_bytes
        self.install_schema = self.options.install_schema
        self.durable_states: frozenset[str] = {
            "ready": states.READY_STATES,
            "all": frozenset(states.ALL_STATES) | {"*"},
            "none": frozenset(),
        }[self.options.durable_states]
        self.expire_interval_seconds = self.options.expire_interval_seconds
        self.expire_batch = self.options.expire_batch
        failure_expires = app.conf.get("result_failure_expires")
        self.failure_expires = (
            self.expires if failure_expires is None else self.prepare_expires(failure_expires)
        )
        self.pooler = self.options.pooler
        self.direct_url = self.options.direct_url
        self.pooler_prepared = self.options.pooler_prepared_statements
        self.polling_interval = self.options.polling_interval
        self._dsn_cache: str | None = None
        self._db: SharedConnector | None = None
        self._same_database: bool | None = None
        self.result_consumer = self.ResultConsumer(
            self, self.app, self.accept, self._pending_results, self._pending_messages
        )

    # -- connection ------------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        """libpq connection string (holds the password: never log it)."""
        if self._dsn_cache is None:
            dsn = resolve_url(self.url, self.app)
            extra = self.options.connection_options
            if extra:
                params = conninfo_to_dict(dsn)
                params.update(extra)
                dsn = conninfo.make_dsn(params)
            if self.pooler == "transaction":
                # every connector to it: no session state
                mark_pooled(dsn, prepared=self.pooler_prepared)
            self._dsn_cache = dsn
        return self._dsn_cache

    def _broker_options(self) -> Mapping[str, Any] | None:
        """The broker's transport options when this backend's database is the broker's
        (``postgresql://`` with a kombu_pgmq broker), whose ``pooler``, ``direct_url`` and
        ``pooler_prepared_statements`` apply unless given here; else None."""
        if (self.url or "").strip().partition("://")[2] not in ("", "/"):
            return None
        broker = self.app.conf.broker_write_url or self.app.conf.broker_url
        if isinstance(broker, (list, tuple)):
            broker = ";".join(broker)
        if broker and conninfo.is_ours(broker, self.app.conf.broker_transport):
            return self.app.conf.broker_transport_options or {}
        return None

    @property
    def listen_dsn(self) -> str | None:
        """libpq string waiting for results LISTENs on (None: behind a transaction pooler
        without ``direct_url``: waiting polls, and says so once)."""
        if self.pooler != "transaction":
            return self.dsn
        if self.direct_url is None:
            warn_polling_once(
                "result_backend_transport_options",
                "the result backend is behind a transaction pooler without "
                "direct_url: waiting for results polls every polling_interval "
                f"({self.polling_interval:g} s); set result_backend_transport_options "
                "direct_url (or broker_transport_options direct_url for "
                "result_backend='postgresql://') for prompt wake-ups",
            )
            return None
        params = conninfo.url_to_params(self.direct_url)
        params.update(self.options.connection_options)
        return conninfo.make_dsn(params)

    @property
    def publish_store(self) -> ResultStore:
        """The store of what a publish writes here (a chord's row and size, a saved group):
        inside ``with kombu_pgmq.using(conn):`` with ``conn`` on this backend's database,
        the application's connection, so it commits or rolls back with the publish's
        messages; else :attr:`store`.

        Raises:
            BrokerConnectionError: the server cannot be reached.
        """
        binding = current_binding()
        if binding is None or not binding.in_database_of(self.dsn):
            return self.store
        return ResultStore(binding.external)

    @property
    def store(self) -> ResultStore:
        """The statements' store: inside an :class:`~kombu_pgmq.AtomicTask`'s transaction
        on this backend's database, that transaction's connection (the task's result and
        chord count commit with it); else the app's one result connection to the
        database in this process, shared by its backend instances, one per thread or
        greenlet (:mod:`kombu_pgmq.results._shared`; connecting, and checking the schema
        once per process).

        Raises:
            BrokerConnectionError: the server cannot be reached.
            BootstrapError: the schema is missing and ``install_schema`` is off.
        """
        binding = current_transaction()
        if binding is not None and self.stores_in_transaction(binding):
            return ResultStore(binding.external)
        db = self._db
        if db is None or db.closed:
            db = self._db = shared_connector(self.app, self.dsn, self.install_schema)
        return ResultStore(db)

    def listen_connector(self, on_notify: Callable[[str, str], None]) -> Connector | None:
        """A connection of its own for LISTEN (the schema checked first); None when
        :attr:`listen_dsn` is None (waiting polls)."""
        self.store  # noqa: B018 - the schema is there before anything listens
        dsn = self.listen_dsn
        return None if dsn is None else Connector(dsn, on_notify=on_notify, role="results-listener")

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        """A lost connection (a server restart, a failover): with Celery's
        ``result_backend_always_retry`` the store is tried again after a reconnect."""
        return isinstance(exc, errors.BrokerConnectionError)

    def as_uri(self, include_password: bool = False) -> str:
        url = self.url or "postgresql://"
        return url if include_password else conninfo.redact(url)

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        return super().__reduce__(args, dict(kwargs or {}, url=self.url))

    # -- key/value store -------------------------------------------------------------------

    def task_id_of(self, key: str) -> str | None:
        """The task id of a task key, None for other keys."""
        prefix = self.task_keyprefix
        return key[len(prefix) :] if key.startswith(prefix) else None

    def _encoded(self, value: Any) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        if len(data) > self.max_bytes:
            raise BackendStoreError(
                f"result of {len(data)} bytes is over result_max_bytes={self.max_bytes} "
                "(result_backend_transport_options): return a reference (a table row, a "
                "file) instead, or raise the limit"
            )
        return data

    def _write(self, key: str, value: Any, state: str, keep_success: bool = False) -> bool:
        expires = self.failure_expires if state == states.FAILURE else self.expires
        durable = state in self.durable_states or "*" in self.durable_states
        return self.store.store(
            key, state, self._encoded(value), expires or None, keep_success, synchronous=durable
        )

    def get(self, key: str) -> bytes | None:
        return self.mget([key])[0]

    def mget(self, keys: Iterable[str]) -> list[bytes | None]:
        keys = list(keys)
        ids = [self.task_id_of(k) for k in keys]
        found = self.store.get(keys, ids)
        out: list[bytes | None] = []
        for key, task_id in zip(keys, ids, strict=True):
            value = found.get(key)
            if key in found and value is None and task_id is not None:
                value = self.encode(self._revoked_meta(task_id))
            out.append(value)
        return out

    def set(self, key: str, value: Any) -> None:
        self._write(key, value, states.SUCCESS)

    def _set_with_state(self, key: str, value: Any, state: str) -> None:
        self._write(key, value, state)

    def delete(self, key: str) -> None:
        self.store.delete([key])

    def expire(self, key: str, value: Any) -> None:
        self.store.expire_at([key], float(value) if value else None)

    def _store_result(
        self,
        task_id: str,
        result: Any,
        state: str,
        traceback: Any = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        # Celery's rule (a stored SUCCESS is never replaced) is kept by the statement
        # itself: no read before each write.
        meta = self._get_result_meta(
            result=result, state=state, traceback=traceback, request=request
        )
        meta["task_id"] = bytes_to_str(task_id)
        try:
            self._write(self.get_key_for_task(task_id), self.encode(meta), state, True)
        except BackendStoreError as exc:
            raise BackendStoreError(str(exc), state=state, task_id=task_id) from exc
        return result

    def _save_group(self, group_id: str, result: Any) -> Any:
        # Its own function: a producer role (the client applying a chord) may store
        # saved groups, not task results.
        meta = self._encoded(self.encode({"result": result.as_tuple()}))
        self.publish_store.save_group(self.get_key_for_group(group_id), meta, self.expires or None)
        return result

    def _revoked_meta(self, task_id: str) -> dict[str, Any]:
        """The meta of a durably revoked task that has no result (yet)."""
        return {
            "status": states.REVOKED,
            "result": self.prepare_exception(TaskRevokedError("revoked")),
            "traceback": None,
            "children": [],
            "date_done": None,
            "task_id": task_id,
        }

    def read_metas(self, task_ids: Iterable[str]) -> list[dict[str, Any]]:
        """The decoded metas of the tasks that have one (a revoked task without a result:
        REVOKED), in no particular order."""
        ids = list(task_ids)
        keys = [self.get_key_for_task(t) for t in ids]
        found = self.store.get(keys, ids)
        metas = []
        for key, task_id in zip(keys, ids, strict=True):
            if key not in found:
                continue
            raw = found[key]
            meta = self._revoked_meta(task_id) if raw is None else self.decode(raw)
            metas.append(self.meta_from_decoded(meta))
        return metas

    def get_many(
        self,
        task_ids: Iterable[str],
        timeout: float | None = None,
        interval: float = 0.5,
        no_ack: bool = True,
        on_message: Callable[[dict[str, Any]], None] | None = None,
        on_interval: Callable[[], None] | None = None,
        max_iterations: int | None = None,
        READY_STATES: frozenset[str] = states.READY_STATES,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield ``(task_id, meta)`` as each task becomes ready. The ids are read once,
        then it waits for their notifications (no polling: ``interval`` is ignored);
        ``max_iterations=1``: one read, no waiting.

        Raises:
            celery.exceptions.TimeoutError: ``timeout`` seconds passed first.
        """
        ids = {bytes_to_str(t) for t in task_ids}
        for task_id in list(ids):
            cached = self._cache.get(task_id)
            if cached is not None and cached["status"] in READY_STATES:
                ids.discard(task_id)
                yield task_id, cached
        if not ids:
            return
        got: dict[str, dict[str, Any]] = {}

        def collect(meta: dict[str, Any]) -> None:
            if meta["status"] in READY_STATES and meta["task_id"] in ids:
                got[meta["task_id"]] = meta

        consumer = self.result_consumer
        waits = max_iterations != 1
        added = consumer.watch(ids, collect) if waits else set()
        deadline = None if timeout is None else time.monotonic() + timeout
        iterations = 0
        try:
            for meta in self.read_metas(ids):
                collect(meta)
            while True:
                for task_id in list(got):
                    meta = got.pop(task_id)
                    ids.discard(task_id)
                    self._cache[task_id] = meta
                    if on_message is not None:
                        on_message(meta)
                    yield task_id, meta
                iterations += 1
                if not ids or not waits or (max_iterations and iterations >= max_iterations):
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CeleryTimeoutError(f"Operation timed out ({timeout})")
                consumer.drain_events(timeout=1.0 if left is None else min(left, 1.0))
                if on_interval:
                    on_interval()
        finally:
            if waits:
                consumer.unwatch(added, collect)

    def _forget(self, task_id: str) -> None:
        self.store.delete([self.get_key_for_task(task_id)])

    def forget(self, task_id: str) -> None:
        super().forget(task_id)
        self.result_consumer.cancel_for(task_id)

    def cleanup(self) -> None:
        """Delete every expired result now (``celery.backend_cleanup``)."""
        while self.store.expire(self.expire_batch) >= self.expire_batch:
            pass

    # -- revocations -----------------------------------------------------------------------

    def revoke(self, task_ids: Iterable[str], expires_seconds: float | None = None) -> int:
        """Record durable revocations of ``task_ids`` (kept ``expires_seconds``, default
        ``result_expires``); a waiting ``get()`` of one raises TaskRevokedError. Returns how
        many were new."""
        expires = self.expires if expires_seconds is None else expires_seconds
        return self.store.revoke(list(task_ids), expires or None)

    # -- chords ----------------------------------------------------------------------------

    @property
    def chord_expires(self) -> float | None:
        """Seconds a chord's counter row is kept (0 or None: forever): Celery's
        ``result_chord_expires`` (seconds or a ``timedelta``) when set, else
        ``result_expires``, as Celery 5.7 reads it. Celery 5.5 and 5.6 have no such
        setting and expire chord keys with ``result_expires``: the same rule gives that."""
        value = self.app.conf.get("result_chord_expires")
        if value is None:
            return self.expires
        return self.prepare_expires(value, type=int)

    def apply_chord(self, header_result_args: Any, body: Any, **kwargs: Any) -> None:
        chords.apply_chord(self, header_result_args)

    def set_chord_size(self, group_id: str, chord_size: int) -> None:
        self.publish_store.chord_size(group_id, chord_size, 0, self.chord_expires or None)

    def add_to_chord(self, group_id: str, result: Any) -> None:
        self.publish_store.chord_size(group_id, None, 1, self.chord_expires or None)

    def on_chord_part_return(self, request: Any, state: str, result: Any, **kwargs: Any) -> None:
        chords.on_chord_part_return(self, request, state, result)

    def stores_in_transaction(self, binding: Any) -> bool:
        """Whether this backend's database is that of ``binding`` (an application's
        connection), so writes can go into its transaction (looked up once per binding).

        Raises:
            BrokerConnectionError: this backend's database cannot be reached.
        """
        return bool(binding.in_database_of(self.dsn))

    def same_database_as_broker(self) -> bool:
        """True when the app's broker is kombu_pgmq's in this database (a chord's callback
        is then published in the transaction that counts its last part). Looked up once."""
        if self._same_database is None:
            self._same_database = chords.broker_is_here(self)
        return self._same_database
