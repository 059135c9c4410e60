"""Error hierarchy of kombu_pgmq, and the one place psycopg errors are translated.

Every error derives from :class:`KombuPgmqError`. Errors are picklable (they cross
process boundaries in Celery's prefork pool), keep their message as ``args[0]`` and
name the thing that is wrong and how to fix it.

:func:`translate` maps a :class:`psycopg.Error` to one of these; callers use
``raise translate(exc) from exc`` so the original error stays in ``__cause__``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable

import psycopg
from psycopg import errors as pg_errors

__all__ = [
    "BootstrapError",
    "BrokerConnectionError",
    "ConfigurationError",
    "ConnectionRejected",
    "InvalidJsonBody",
    "InvalidQueueName",
    "KombuPgmqError",
    "PermissionDenied",
    "QueueNotFound",
    "SparkError",
    "SparkServerError",
    "StaleDelivery",
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


class ConnectionRejected(BrokerConnectionError):
    """The server answered and turned the connection down: the database does not exist,
    the role does not exist or may not log in, the password is wrong or missing, or
    ``pg_hba.conf`` has no entry for this client. The message names the database or the
    role and the fix (``createdb``, ``createuser``, the password's places).

    A :class:`BrokerConnectionError`: kombu and Celery retry it as any connection error
    (the database may be created meanwhile), and it stays the same until fixed.
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


class StaleDelivery(TransactionError):
    """The delivery an application's transaction settles no longer holds its message
    (SQLSTATE ``KP001`` from ``kombu_pgmq.ack_in_transaction``): its visibility timeout
    passed and another consumer received it, or it was acked, cancelled or removed. The
    server has aborted the transaction: nothing of it is applied (the other delivery's
    run applies its effects). See :class:`kombu_pgmq.AtomicTask`."""


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


def _where(exc: psycopg.Error) -> tuple[str, list[str]]:
    """The server a failed connection attempt tried (``127.0.0.1:5432``, a socket
    directory ``/run/postgresql:5432``) and the ``-h``/``-p``/``-U`` options of
    ``createdb``/``createuser`` reaching it as that attempt did (empty: unknown)."""
    pgconn = getattr(exc, "pgconn", None)
    fields = {}
    for name, flag in (("host", "-h"), ("port", "-p"), ("user", "-U")):
        value = getattr(pgconn, name, None) if pgconn is not None else None
        if isinstance(value, bytes) and value:
            fields[flag] = value.decode(errors="replace")
    server = ":".join(fields[f] for f in ("-h", "-p") if f in fields)
    return server or "the server", [part for item in fields.items() for part in item]


def _missing_database(m: re.Match[str], exc: psycopg.Error) -> str:
    server, options = _where(exc)
    command = shlex.join(["createdb", *options, m["database"]])
    return (
        f'database "{m["database"]}" does not exist on {server}: create it ({command}), or '
        "correct the database name in the URL"
    )


def _missing_role(m: re.Match[str], exc: psycopg.Error) -> str:
    server, options = _where(exc)
    options = [part for part in options if part not in ("-U", m["role"])]  # not this role
    command = shlex.join(["createuser", *options, "--pwprompt", m["role"]])
    return (
        f'role "{m["role"]}" does not exist on {server}: correct the user name in the URL, '
        f"or create the role as one that may create roles ({command}) and grant it the "
        f"schema (kombu-pgmq schema grant worker {m['role']}, or producer)"
    )


def _bad_password(m: re.Match[str], exc: psycopg.Error) -> str:
    server, _ = _where(exc)
    return (
        f'{server} refused the password of role "{m["role"]}": correct it in the URL '
        f"(postgresql://{m['role']}:PASSWORD@host/db, special characters percent-encoded), "
        f"$PGPASSWORD or ~/.pgpass; or set it: ALTER ROLE \"{m['role']}\" PASSWORD '...'"
    )


def _no_password(m: re.Match[str], exc: psycopg.Error) -> str:
    server, options = _where(exc)
    role = options[options.index("-U") + 1] if "-U" in options else "the URL's user"
    return (
        f"{server} asks {role} for a password and none was given: put it in the URL "
        "(postgresql://user:PASSWORD@host/db), $PGPASSWORD or ~/.pgpass"
    )


def _no_hba_entry(m: re.Match[str], exc: psycopg.Error) -> str:
    server, _ = _where(exc)
    database, role, client = m["database"], m["role"], m["client"]
    if client == "[local]":  # a unix socket
        line, source = f"local {database} {role} scram-sha-256", "a local socket"
    else:
        line, source = f"host {database} {role} {client}/32 scram-sha-256", client
    return (
        f'{server} has no pg_hba.conf entry letting role "{role}" connect to database '
        f'"{database}" from {source}: add one to the server\'s pg_hba.conf (e.g. "{line}") '
        "and reload it (SELECT pg_reload_conf()), or connect as a role it lets in"
    )


def _no_login(m: re.Match[str], exc: psycopg.Error) -> str:
    return (
        f'role "{m["role"]}" may not log in: ALTER ROLE "{m["role"]}" LOGIN (as a role '
        "that may alter it), or put a login role in the URL"
    )


def _closed_database(m: re.Match[str], exc: psycopg.Error) -> str:
    return (
        f'database "{m["database"]}" does not accept connections now (a template, or '
        "being dropped or created): connect to another, or let it accept them: ALTER "
        f'DATABASE "{m["database"]}" ALLOW_CONNECTIONS true'
    )


def _no_connect(m: re.Match[str], exc: psycopg.Error) -> str:
    _, options = _where(exc)
    role = options[options.index("-U") + 1] if "-U" in options else "this role"
    return (
        f'{role} may not connect to database "{m["database"]}" (no CONNECT privilege): '
        f'GRANT CONNECT ON DATABASE "{m["database"]}" TO "{role}" (as its owner)'
    )


#: What a server's refusal of a connection says (libpq's text of the server's FATAL
#: message, in English: a server with another ``lc_messages`` keeps its own words), and
#: the message naming the fix. No SQLSTATE: libpq does not expose it for a failed
#: connection attempt.
_REFUSALS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str], psycopg.Error], str]], ...] = (
    (re.compile(r'database "(?P<database>[^"]*)" does not exist'), _missing_database),
    (re.compile(r'role "(?P<role>[^"]*)" does not exist'), _missing_role),
    (re.compile(r'password authentication failed for user "(?P<role>[^"]*)"'), _bad_password),
    (re.compile(r"fe_sendauth: no password supplied"), _no_password),
    (
        re.compile(
            r'no pg_hba\.conf entry for host "(?P<client>[^"]*)", user "(?P<role>[^"]*)", '
            r'database "(?P<database>[^"]*)"'
        ),
        _no_hba_entry,
    ),
    (re.compile(r'role "(?P<role>[^"]*)" is not permitted to log in'), _no_login),
    (re.compile(r'permission denied for database "(?P<database>[^"]*)"'), _no_connect),
    (
        re.compile(r'database "(?P<database>[^"]*)" is not currently accepting connections'),
        _closed_database,
    ),
)


def _rejected(exc: psycopg.Error, text: str) -> ConnectionRejected | None:
    """The :class:`ConnectionRejected` of a connection attempt the server turned down
    (None: another failure, e.g. no server listening)."""
    for pattern, explain in _REFUSALS:
        match = pattern.search(text)
        if match is not None:
            return ConnectionRejected(f"PostgreSQL refused the connection: {explain(match, exc)}")
    return None


def translate(exc: psycopg.Error) -> KombuPgmqError:
    """Return the kombu_pgmq error for a psycopg error (does not raise).

    Shapes: ``psycopg.Error -> KombuPgmqError``. A connection attempt the server turned
    down (a missing database or role, a wrong or missing password, no ``pg_hba.conf``
    entry, a role that may not log in or connect) becomes :class:`ConnectionRejected`,
    naming the database or role and the fix. Connection loss, admin or crash
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
        rejected = None if sqlstate else _rejected(exc, text)
        if rejected is not None:
            return rejected
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
