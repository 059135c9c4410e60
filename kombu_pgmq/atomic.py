"""Exactly-once effects: a task's database writes, the ack of its message, its result and
the tasks it sends commit in one transaction (:class:`AtomicTask`)::

    from kombu_pgmq import AtomicTask

    @app.task(base=AtomicTask, bind=True)
    def add_one(self, counter_id):
        self.db.execute("UPDATE counters SET n = n + 1 WHERE id = %s", (counter_id,))
        notify.delay(counter_id)    # sent if, and when, the transaction commits
        return counter_id           # stored in the same transaction

The task body runs in a transaction on the application's database (``self.db``: a
psycopg connection by default). When the body returns, the same transaction gets the
tasks it sent (``delay``, ``apply_async``, chords, and the task's own link callbacks and
chain), its result and chord count (when the result backend is kombu_pgmq's in that
database), and the ack of its message, archived by the receipt of this delivery; then it
commits. A worker killed before the commit leaves nothing behind, and the message is
delivered again; one killed after it leaves everything, and the message is gone. Either
way the effects in this database happen once. Mirrors River's ``JobCompleteTx`` ("marks
the job as completed as part of transaction tx").

Fencing: if the delivery no longer holds its message when the transaction acks it (its
visibility timeout passed and another worker received it, it was revoked with
``kombu-pgmq task cancel``, it was acked already), the ack raises inside the transaction,
nothing of it commits, and the task ends IGNORED on this worker (no result stored, no
retry, a warning logged): the other delivery's run applies the effects.

Celery's semantics hold around it. An exception in the body rolls the transaction back,
then Celery's failure handling runs as for any ``acks_late`` task (``autoretry_for``,
``max_retries``, ``link_error``, the FAILURE result, dead-lettering by
``max_deliveries``); ``self.retry()`` rolls back first, then sends the retry. A lost
database connection (a server restart) rolls back too, and the message is requeued
(Celery's ``Reject(requeue=True)``): the task runs again, and if the commit had reached
the server, the message is already archived and nothing runs twice. The ack is always
late (``acks_late=False`` is refused); prefork, threads and solo pools; time limits and
revocations as for any task (a killed pool process's transaction is rolled back by the
server).

What is exactly once: effects in this database, made through the transaction's
connection. What is not: anything outside it (an e-mail, an HTTP call, a write through
another connection or database); those still happen at least once. A result backend
that is not kombu_pgmq's in this database stores the result after the commit, as Celery
does for any task.

Task options (class attributes; ``@app.task(base=AtomicTask, atomic_db=...)``):

* ``atomic_db`` -- where the transaction runs (default None: the broker's database,
  one psycopg connection per pool process or thread, reconnected after a loss):
  a libpq URL; a SQLAlchemy ``Engine`` or ``sessionmaker`` (a ``Session`` per task,
  closed after it); ``django.db.connection`` (the transaction is
  ``transaction.atomic(using=...)``, so the ORM's writes are in it); a psycopg 3
  ``Connection``, SQLAlchemy ``Session`` or ``Connection``; or a callable returning any
  of these, called per task. It must be the broker's database (checked once per
  connection: :class:`~kombu_pgmq.errors.ConfigurationError` otherwise). The role needs
  kombu_pgmq's worker grants (``kombu-pgmq schema grant worker ROLE``).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import logging
import os
import threading
from typing import Any

import psycopg
from celery import Task
from celery.exceptions import Ignore, Reject
from celery.worker.request import Request

from . import errors
from ._conninfo import to_dsn
from ._db.rows import Receipt
from .transactional import BoundConnection, _celery_broker_url, driver_connection, using
from .transport._binding import CURRENT_TRANSACTION
from .transport.acks import SETTLED, SETTLES_ITSELF

__all__ = ["AtomicRequest", "AtomicTask", "Fenced"]

logger = logging.getLogger(__name__)

_OPEN: contextvars.ContextVar[_Transaction | None] = contextvars.ContextVar(
    "kombu_pgmq_atomic", default=None
)
# Default connections: one per process, thread and libpq string.
_CONNECTIONS = threading.local()


class Fenced(Ignore):
    """Raised in the pool process when an :class:`AtomicTask`'s delivery no longer held
    its message at commit (a :class:`~kombu_pgmq.errors.StaleDelivery`): the task ends
    IGNORED here, the other delivery's run applies the effects."""


class _RolledBack(Exception):
    """Given to a driver's transaction manager to make it roll back."""


class _Transaction:
    """One task's transaction on the application's connection.

    Arguments:
        handle: what ``self.db`` returns (a psycopg ``Connection``, a SQLAlchemy
            ``Session``/``Connection``, a Django connection).
        manager: the driver's transaction context manager (commits on a clean exit, rolls
            back on one with an exception); None: ``handle`` is a connection of
            kombu_pgmq's own, in autocommit, whose transaction is begun with ``BEGIN`` and
            committed in the same round trip as the ack.
        close: called once the transaction ended (a Session made for the task), or None.
    """

    def __init__(self, handle: Any, manager: Any = None, close: Any = None) -> None:
        self.handle = handle
        self.manager = manager
        self.close = close
        self.bound: BoundConnection | None = None
        self.open = False
        self._tokens: list[tuple[contextvars.ContextVar[Any], contextvars.Token[Any]]] = []

    @property
    def own(self) -> bool:
        """Whether the connection is kombu_pgmq's own (see ``manager``)."""
        return self.manager is None

    def begin(self, broker_url: str) -> None:
        """Begin, and bind this context's kombu_pgmq publishes and result writes to it.

        Raises:
            ConfigurationError: the connection is not to the broker's database.
        """
        if self.own:
            self._bind(broker_url)
            assert self.bound is not None
            self.bound.binding.external.execute("begin")
            self.open = True
        else:
            self.manager.__enter__()
            self.open = True
            self._bind(broker_url)

    def _bind(self, broker_url: str) -> None:
        self.bound = using(driver_connection(self.handle), broker_url=broker_url)
        self.bound.binding.check_broker(_dsn(broker_url), "the Celery app's broker_url")
        self.bound.__enter__()
        self._tokens = [
            (CURRENT_TRANSACTION, CURRENT_TRANSACTION.set(self.bound.binding)),
            (_OPEN, _OPEN.set(self)),
        ]

    def unbind(self) -> None:
        """Publishes and result writes of this context go where they went before."""
        if self.bound is not None and self._tokens:
            for var, token in reversed(self._tokens):
                var.reset(token)
            self._tokens = []
            self.bound.__exit__(None, None, None)

    def settle(self, held: Receipt) -> None:
        """Ack ``held`` in the transaction; on kombu_pgmq's own connection, commit it in
        the same round trip.

        Raises:
            StaleDelivery: the receipt is no longer held (the transaction is aborted).
            ConfigurationError: the task body committed or rolled back the transaction
                itself.
        """
        assert self.bound is not None
        broker = self.bound.binding.broker
        if not self.own:
            broker.ack_in_transaction(held)
            return
        if self.handle.info.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
            raise errors.ConfigurationError(
                "an AtomicTask's body ended its transaction itself (commit() or "
                "rollback() on self.db): its writes were not applied with the ack; let "
                "the task commit"
            )
        broker.ack_in_transaction(held, commit=True)
        self.open = False

    def commit(self) -> None:
        if not self.open:
            return
        self.open = False
        if self.own:
            assert self.bound is not None
            self.bound.binding.external.execute("commit")
        else:
            self.manager.__exit__(None, None, None)

    def rollback(self) -> None:
        """Roll back (a failure to, on a lost connection, is logged: the server rolls
        back a transaction whose session ended)."""
        if not self.open:
            return
        self.open = False
        if self.own:
            try:
                assert self.bound is not None
                self.bound.binding.external.execute("rollback")
            except errors.KombuPgmqError as failure:
                logger.debug("rollback failed (the server rolls it back): %r", failure)
            return
        exc = _RolledBack()
        try:
            self.manager.__exit__(_RolledBack, exc, None)
        except _RolledBack:
            pass
        except Exception as failure:  # the connection is gone
            logger.debug("rollback failed (the server rolls it back): %r", failure)

    def end(self) -> None:
        self.unbind()
        if self.close is not None:
            self.close()


class AtomicTask(Task):
    """A Celery task whose database writes, ack, result and sent tasks commit in one
    transaction (see the module docstring).

    Attributes:
        atomic_db: where the transaction runs (see the module docstring; None: the
            broker's database).
        db: inside the task body, the connection (or Session) the transaction is open
            on; :class:`~kombu_pgmq.errors.ConfigurationError` outside it.

    Raises (at task creation):
        ConfigurationError: ``acks_late=False`` (the ack is part of the transaction).
    """

    acks_late = True
    atomic_db: Any = None
    Request = "kombu_pgmq.atomic:AtomicRequest"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("acks_late", True) is not True:
            raise errors.ConfigurationError(
                f"task {cls.__dict__.get('name') or cls.__name__}: an AtomicTask acks its "
                "message in the task's transaction, after the body ran: acks_late=False "
                "cannot apply; remove it (or use a plain task for an early ack)"
            )

    @property
    def db(self) -> Any:
        tx = _OPEN.get()
        if tx is None or not tx.open:
            raise errors.ConfigurationError(
                f"task {self.name}: self.db is the transaction of a running AtomicTask "
                "body: use it inside the task body (not after self.retry())"
            )
        return tx.handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        eager = bool(request.called_directly or request.is_eager)
        held = None if eager else self._receipt(request)
        broker_url = self._broker_url()
        tx: _Transaction | None = None
        try:
            tx = _begin(self._atomic_db(), broker_url)
            retval = self.run(*args, **kwargs)
            if held is not None:
                self._complete(tx, held, retval, request)
            tx.commit()
        except BaseException as exc:
            if tx is not None:
                tx.rollback()
            if isinstance(exc, errors.StaleDelivery):
                logger.warning(
                    "task %s[%s]: rolled back, its message went to another delivery (%s)",
                    self.name,
                    request.id,
                    exc,
                )
                raise Fenced(str(exc)) from None
            if held is not None and _connection_lost(exc):
                # Nothing was applied (or the commit reached the server, and the message
                # is archived: its requeue then does nothing): deliver it again.
                raise Reject(exc, requeue=True) from exc
            raise
        finally:
            if tx is not None:
                tx.end()
                _forget_broken(tx)
        return retval

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``Task.retry``, after this task's transaction was rolled back (its
        writes are undone; the retry is sent outside it)."""
        tx = _OPEN.get()
        if tx is not None:
            tx.rollback()
            tx.unbind()
        return super().retry(*args, **kwargs)

    def _complete(self, tx: _Transaction, held: Receipt, retval: Any, request: Any) -> None:
        """In the open transaction: the link callbacks and chain (as Celery's tracer sends
        them), the result and chord count (if stored here), then the ack."""
        _send_callbacks(self, request, retval)
        assert tx.bound is not None
        backend = self.backend
        in_database = getattr(backend, "stores_in_transaction", None)
        if in_database is not None and in_database(tx.bound.binding):
            ignored = bool(self.ignore_result or request.ignore_result)
            backend.mark_as_done(request.id, retval, request, not ignored)
            # Celery's tracer calls mark_as_done again after the body: nothing left to do
            request.ignore_result = True
            request.chord = None
        tx.settle(held)

    def _atomic_db(self) -> Any:
        """``atomic_db`` as given: a function set on the class is not bound as a method."""
        target = inspect.getattr_static(type(self), "atomic_db", None)
        if isinstance(target, classmethod):
            return type(self).atomic_db
        return target.__func__ if isinstance(target, staticmethod) else target

    def _receipt(self, request: Any) -> Receipt:
        info = (request.properties or {}).get("delivery_info") or {}
        if "pgmq_msg_id" not in info:
            raise errors.ConfigurationError(
                f"task {self.name}: an AtomicTask's message carries no kombu_pgmq receipt "
                "(pgmq_queue, pgmq_msg_id, pgmq_read_ct): its broker must be kombu_pgmq's "
                "(broker_url postgresql://...)"
            )
        return Receipt(
            info["pgmq_queue"],
            info["pgmq_msg_id"],
            info["pgmq_read_ct"],
            info.get("pgmq_enqueued_at"),
        )

    def _broker_url(self) -> str:
        url = _celery_broker_url(self.app.conf)
        if url is None:
            raise errors.ConfigurationError(
                f"task {self.name}: an AtomicTask needs broker_url (kombu_pgmq's, postgresql://...)"
            )
        return url


class AtomicRequest(Request):
    """The worker's request of an :class:`AtomicTask`: when the task's transaction
    settled its message (the task succeeded, or was fenced), the worker's own ack of it
    sends nothing (no statement, no stale-ack warning)."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        info = getattr(message, "delivery_info", None)
        if isinstance(info, dict):
            info[SETTLES_ITSELF] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Celery makes a subclass per task with its own on_success (create_request_cls)
        made = cls.__dict__.get("on_success")
        if made is not None:
            cls.on_success = _marking_success(made)  # type: ignore[method-assign]

    def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        return _marking_success(Request.on_success)(self, failed__retval__runtime, **kwargs)

    def on_failure(self, exc_info: Any, *args: Any, **kwargs: Any) -> Any:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
        if isinstance(exc, Fenced):
            self._settled()
        return super().on_failure(exc_info, *args, **kwargs)

    def _settled(self) -> None:
        info = getattr(self._message, "delivery_info", None)
        if isinstance(info, dict):
            info[SETTLED] = True


def _marking_success(on_success: Any) -> Any:
    def marked(self: AtomicRequest, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        if not failed__retval__runtime[0]:
            self._settled()  # the body returned: its transaction committed the ack
        return on_success(self, failed__retval__runtime, **kwargs)

    return marked


def _send_callbacks(task: Task, request: Any, retval: Any) -> None:
    """Send the request's link callbacks and the next step of its chain, then clear them
    so Celery's tracer does not send them again; mirrors ``celery.app.trace``."""
    from celery import group
    from celery.canvas import maybe_signature

    app = task.app
    callbacks, chain = request.callbacks, request.chain
    if not callbacks and not chain:
        return
    parent_id, root_id = request.id, request.root_id or request.id
    priority = None
    if app.conf.task_inherit_parent_priority:
        priority = (request.delivery_info or {}).get("priority")
    options = {"parent_id": parent_id, "root_id": root_id, "priority": priority}
    if callbacks:
        signatures = [maybe_signature(s, app=app) for s in callbacks]
        groups = [s for s in signatures if isinstance(s, group)]
        others = [s for s in signatures if not isinstance(s, group)]
        for each in groups:
            each.apply_async((retval,), **options)
        if len(others) == 1:
            others[0].apply_async((retval,), **options)
        elif others:
            group(others, app=app).apply_async((retval,), **options)
    if chain:
        step = maybe_signature(chain[-1], app=app)
        step.apply_async((retval,), chain=chain[:-1], **options)
    request.callbacks = None
    request.chain = None


def _begin(target: Any, broker_url: str) -> _Transaction:
    """The transaction a task runs in, begun and bound (see :func:`_open`). A default
    connection lost while idle (a server restart) is made again once.

    Raises:
        ConfigurationError: ``target`` is none of the accepted kinds, or not the
            broker's database.
    """
    for attempt in (1, 2):
        tx = _open(target, broker_url)
        try:
            tx.begin(broker_url)
        except Exception as exc:
            tx.rollback()
            tx.end()
            _forget_broken(tx)
            if attempt == 2 or not _own(target) or not _connection_lost(exc):
                raise
            continue
        return tx
    raise AssertionError("unreachable")


def _own(target: Any) -> bool:
    """Whether transactions on ``target`` use a connection of kombu_pgmq's own."""
    return target is None or isinstance(target, str)


def _open(target: Any, broker_url: str, *, made: bool = False) -> _Transaction:
    """The transaction a task runs in, on ``target`` (an ``atomic_db``; ``made``: it was
    returned by the task's factory, so a Session of it is closed after the task).

    Raises:
        ConfigurationError: ``target`` is none of the accepted kinds.
    """
    if target is None:
        target = broker_url
    if isinstance(target, str):
        return _Transaction(_connection(_dsn(target)))
    if isinstance(target, psycopg.Connection):
        return _Transaction(target, target.transaction())
    module = type(target).__module__
    if module.startswith("sqlalchemy."):
        if hasattr(target, "dispose"):  # an Engine: a Session per task
            session = _application_module("sqlalchemy.orm").Session(target)
            return _Transaction(session, session.begin(), session.close)
        if hasattr(target, "get_bind"):  # a Session
            return _Transaction(target, target.begin(), target.close if made else None)
        if hasattr(target, "in_transaction") and not callable(target):  # a Connection
            return _Transaction(target, target.begin())
    elif getattr(target, "vendor", None) is not None and hasattr(target, "ensure_connection"):
        transaction = _application_module("django.db.transaction")
        return _Transaction(target, transaction.atomic(using=target.alias))
    if not made and _is_factory(target, module):
        return _open(target(), broker_url, made=True)
    raise errors.ConfigurationError(
        f"AtomicTask.atomic_db: {module}.{type(target).__name__} is not a libpq URL, a "
        "psycopg 3 Connection, a SQLAlchemy Engine, sessionmaker, Session or Connection, "
        "a Django connection, or a function returning one of those"
    )


def _is_factory(target: Any, module: str) -> bool:
    """Whether ``target`` is meant to be called for a connection: a function, method or
    partial, or SQLAlchemy's ``sessionmaker``/``scoped_session`` (not any object with a
    ``__call__``, such as a DB-API connection of another driver)."""
    if inspect.isroutine(target) or isinstance(target, functools.partial):
        return True
    return module.startswith("sqlalchemy.") and callable(target)


@functools.lru_cache(maxsize=64)
def _dsn(url: str) -> str:
    """The libpq string of a broker URL (parsed once per URL and process)."""
    return to_dsn(url)


def _application_module(name: str) -> Any:
    """A module of the application's database library (SQLAlchemy, Django): not a
    dependency of kombu_pgmq; imported already, since the application gave its object."""
    return importlib.import_module(name)


def _connection(dsn: str) -> psycopg.Connection[Any]:
    """This process's and thread's connection to ``dsn`` (made again if it was lost)."""
    pool: dict[tuple[int, str], psycopg.Connection[Any]] = _CONNECTIONS.__dict__.setdefault(
        "by_dsn", {}
    )
    key = (os.getpid(), dsn)
    conn = pool.get(key)
    if conn is None or conn.closed or conn.broken:
        if conn is not None:
            conn.close()
        try:
            conn = pool[key] = psycopg.connect(dsn, autocommit=True)
        except psycopg.Error as exc:
            raise errors.translate(exc) from exc
    return conn


def _forget_broken(tx: _Transaction) -> None:
    """Close a default connection that was lost (the next task makes a new one)."""
    conn = tx.handle
    if isinstance(conn, psycopg.Connection) and conn.broken:
        conn.close()


def _connection_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it wraps: SQLAlchemy's ``orig``, Django's and
    kombu_pgmq's causes) is a lost database connection."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, errors.BrokerConnectionError):
            return True
        if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)) and isinstance(
            errors.translate(exc), errors.BrokerConnectionError
        ):
            return True
        exc = getattr(exc, "orig", None) or exc.__cause__ or exc.__context__
    return False
