"""Error hierarchy of kombu_pgmq, and the one place psycopg errors are translated.

Every error derives from :class:`KombuPgmqError`. Errors are picklable (they cross
process boundaries in Celery's prefork pool), keep their message as ``args[0]`` and
name the thing that is wrong and how to fix it.

:func:`translate` maps a :class:`psycopg.Error` to one of these; callers use
``raise translate(exc) from exc`` so the original error stays in ``__cause__``.
"""

from __future__ import annotations

import psycopg
from psycopg import errors as pg_errors

__all__ = [
    "BootstrapError",
    "BrokerConnectionError",
    "ConfigurationError",
    "InvalidJsonBody",
    "InvalidQueueName",
    "KombuPgmqError",
    "PermissionDenied",
    "QueueNotFound",
    "SparkError",
    "SparkServerError",
    "StatementCanceled",
    "StatementError",
    "TransactionError",
    "Unroutable",
    "UnsupportedPgmqVersion",
    "translate",
]


class KombuPgmqError(Exception):
    """Base class of every error raised by kombu_pgmq."""


class ConfigurationError(KombuPgmqError, ValueError):
    """A broker URL or transport option is invalid (the message names it and the fix)."""


class InvalidQueueName(KombuPgmqError, ValueError):
    """A Kombu queue name cannot be used (e.g. empty, or not a ``str``)."""


class UnsupportedPgmqVersion(KombuPgmqError):
    """The installed PGMQ is older than :data:`kombu_pgmq.schema.MIN_PGMQ_VERSION`."""


class BootstrapError(KombuPgmqError):
    """Installing PGMQ or applying kombu_pgmq's migrations failed."""


class BrokerConnectionError(KombuPgmqError, ConnectionError):
    """The database is unreachable or the connection was lost.

    Listed in ``Transport.connection_errors``: kombu's ``ensure``/retry logic and
    Celery's consumer reconnect on it.
    """


class StatementError(KombuPgmqError):
    """A statement failed on the server (a constraint, a lock timeout, a missing
    privilege...) while the connection stays usable.

    Not a lost connection: that is :class:`BrokerConnectionError` (psycopg's
    ``OperationalError``). Before 0.2 this class was called ``OperationalError``, the
    opposite of psycopg's meaning; that name remains as a deprecated alias.
    """


class StatementCanceled(StatementError):
    """The server cancelled a statement (SQLSTATE ``57014``): ``statement_timeout`` ran
    out (e.g. the statement waited for a lock an open transaction holds), or someone
    called ``pg_cancel_backend``. The statement had no effect and the connection stays
    usable: it is not a lost connection, and kombu does not retry it."""


class QueueNotFound(StatementError):
    """The PGMQ queue table does not exist (deleted by another process?)."""


class TransactionError(StatementError):
    """Publishing inside the application's transaction (:func:`kombu_pgmq.using`)
    failed: the statement failed on the application's connection, which PostgreSQL has
    then aborted, or that connection is closed. Not retried by kombu (the transaction is
    the application's to roll back and repeat)."""


class PermissionDenied(StatementError):
    """The role lacks a privilege for the statement (SQLSTATE ``42501``): e.g. a role
    granted as a producer tried to consume, or a worker to delete a queue. The schema
    owner grants roles with ``kombu-pgmq schema grant producer|worker ROLE`` (see
    :mod:`kombu_pgmq.schema`, "Least privilege")."""


class Unroutable(StatementError):
    """A message published with ``mandatory=True`` matched no binding (AMQP returns it
    with ``basic.return``; this transport raises instead of dropping it)."""


class InvalidJsonBody(StatementError):
    """PostgreSQL rejected a body declared as JSON (e.g. invalid JSON, ``\\u0000``)."""


class SparkError(KombuPgmqError):
    """A Spark integration failure (:mod:`kombu_pgmq.spark`) not raised by Spark itself."""


class SparkServerError(SparkError):
    """The local Spark Connect server could not be started or reached (see its log), or
    the port is held by a process that is not the server kombu_pgmq started (the message
    names it and the fix: stop it, or set ``spark_connect_port``)."""


_CONNECTION_SQLSTATE_CLASSES = ("08", "57")  # connection exception, operator intervention
_QUERY_CANCELED = "57014"  # class 57 too, but the connection survives it


def translate(exc: psycopg.Error) -> KombuPgmqError:
    """Return the kombu_pgmq error for a psycopg error (does not raise).

    Shapes: ``psycopg.Error -> KombuPgmqError``. Connection loss, admin or crash
    shutdown (``57P01``-``57P03``), ``pg_terminate_backend`` and a read-only server
    (``25006``: a standby after a failover) become :class:`BrokerConnectionError`; a
    cancelled statement (``57014``: ``statement_timeout``, ``pg_cancel_backend``)
    :class:`StatementCanceled`, the connection kept; a missing privilege (``42501``)
    :class:`PermissionDenied`; a missing queue table :class:`QueueNotFound`; a JSON body
    PostgreSQL cannot store :class:`InvalidJsonBody`; anything else
    :class:`StatementError`. The message keeps the server's text.
    """
    sqlstate = getattr(exc, "sqlstate", None) or ""
    text = str(exc).strip() or type(exc).__name__
    if sqlstate == _QUERY_CANCELED:
        return StatementCanceled(
            f"{sqlstate}: {text}: the server cancelled the statement (statement_timeout, or "
            "pg_cancel_backend); nothing was applied and the connection is kept: raise "
            "statement_timeout, or end the transaction that holds its locks (pg_locks)"
        )
    if isinstance(exc, psycopg.OperationalError) and (
        not sqlstate or sqlstate[:2] in _CONNECTION_SQLSTATE_CLASSES
    ):
        return BrokerConnectionError(f"PostgreSQL connection failed or was lost: {text}")
    if sqlstate == "25006":  # read_only_sql_transaction: a standby (after a failover)
        return BrokerConnectionError(
            f"PostgreSQL is read-only (a standby, e.g. after a failover): {text}; "
            "reconnecting (list every host in the URL, host=a,b: kombu_pgmq then picks the "
            "primary with target_session_attrs=read-write)"
        )
    if isinstance(exc, psycopg.InterfaceError):
        return BrokerConnectionError(f"PostgreSQL connection is not usable: {text}")
    if sqlstate == "42501":  # insufficient_privilege
        return PermissionDenied(
            f"{text}: this role lacks the privilege; the schema owner grants it with "
            "'kombu-pgmq schema grant worker <role>' (consume, ack, declare queues) or "
            "'kombu-pgmq schema grant producer <role>' (publish only)"
        )
    if isinstance(exc, pg_errors.UndefinedTable):
        return QueueNotFound(f"queue table does not exist: {text}")
    if isinstance(exc, (pg_errors.InvalidTextRepresentation, pg_errors.UntranslatableCharacter)):
        return InvalidJsonBody(f"PostgreSQL rejected the JSON body: {text}")
    return StatementError(f"{sqlstate or 'error'}: {text}")


def __getattr__(name: str) -> object:
    if name == "OperationalError":
        import warnings

        warnings.warn(
            "kombu_pgmq.errors.OperationalError is deprecated: use StatementError (a failed "
            "statement; a lost connection is BrokerConnectionError)",
            DeprecationWarning,
            stacklevel=2,
        )
        return StatementError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
