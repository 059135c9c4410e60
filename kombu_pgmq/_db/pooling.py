"""Connections through a transaction pooler (PgBouncer ``pool_mode = transaction``).

Through such a pooler each *transaction* of a client runs on whichever server connection
is free, so nothing may outlive a transaction on the server side of it:

* no protocol-level prepared statements (PgBouncer < 1.21 has none; psycopg's are turned
  off with ``prepare_threshold=None``, :meth:`Connector.send_nowait
  <kombu_pgmq._db.connector.Connector.send_nowait>` sends the unnamed statement), unless
  the pooler keeps them (``pooler_prepared_statements``: PgBouncer >= 1.21 with
  ``max_prepared_statements`` > 0, the default from 1.22): then statements are prepared
  as on a direct connection (and closed at the protocol level, which such a pooler
  tracks, not with ``DEALLOCATE``);
* no session settings: a :class:`~kombu_pgmq._db.connector.Connector`'s ``settings``
  are set with ``set_config(name, value, true)`` inside each transaction instead of once
  per session (:func:`local_settings`), and ``synchronous_commit`` is never toggled per
  session (reads and acks set it for their own transaction in the statement, directly
  and pooled alike; other statements asking for no WAL flush commit durably here);
* no LISTEN and no session advisory locks: those take a direct connection
  (``direct_url``) or are not used (polling; the beat refuses to start).

A libpq string is marked pooled once (:func:`mark_pooled`, by the transport and the
result backend from their ``pooler`` option); every connector made from it in this
process then runs in pooled mode (its services, VACUUM, schema checks alike). Marking is
safe either way: pooled mode works on a direct connection too, only without prepared
statements.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..errors import ConfigurationError

__all__ = [
    "POOLERS",
    "check_prepared_kept",
    "is_pooled",
    "local_settings",
    "mark_pooled",
    "pooler_prepares",
    "warn_polling_once",
]

logger = logging.getLogger("kombu_pgmq")

#: Values of the ``pooler`` option: None/"session" (nothing special: every statement of a
#: session runs on one server connection), "transaction" (see the module docstring).
POOLERS = (None, "session", "transaction")

#: Pooled mode, statements that ask for no WAL flush (``synchronous=False``; not reads
#: and acks, which set it themselves): False, they commit durably (one
#: statement); True, each runs in a transaction of its own
#: with ``set_config('synchronous_commit', 'off', true)`` (BEGIN, set_config, the
#: statement, COMMIT: three more round trips). Measured in ``benchmarks/README.md``
#: (``pgbouncer_throughput.py``); a switch for that benchmark, not an option.
ASYNC_COMMIT_PER_TRANSACTION = False

_pooled: set[str] = set()
_prepares: set[str] = set()
_warned: set[str] = set()
_lock = threading.Lock()


def mark_pooled(dsn: str, *, prepared: bool = False) -> None:
    """Connectors made from libpq string ``dsn`` (in this process) run in pooled mode;
    ``prepared``: the pooler keeps prepared statements (see the module docstring)."""
    with _lock:
        _pooled.add(dsn)
        if prepared:
            _prepares.add(dsn)
        else:
            _prepares.discard(dsn)


def pooler_prepares(dsn: str) -> bool:
    """True when ``dsn`` reaches a transaction pooler that keeps prepared statements."""
    return dsn in _prepares


#: Where psycopg's names for its prepared statements start (``_pg3_0``, ``_pg3_1``...).
PSYCOPG_PREPARED_PREFIX = "_pg3_"

#: What a pooler that does not keep prepared statements is told (the connector's error
#: translation says the same for a statement that fails that way later).
NOT_KEPT_FIX = (
    "statements are prepared through the pooler (transport option "
    "pooler_prepared_statements=True), but it does not keep them: set "
    "max_prepared_statements > 0 in pgbouncer.ini (PgBouncer >= 1.21), or "
    "pooler_prepared_statements=False"
)


def check_prepared_kept(conn: psycopg.Connection[Any], probe: str) -> None:
    """Check, on a new connection, that the pooler keeps each client's prepared statements.

    ``probe`` (query ``pooler_keeps_prepared``) is sent prepared and lists the names its
    own text is prepared under on the server connection. PgBouncer >= 1.21 with
    ``max_prepared_statements`` > 0 renames a client's statements (``PGBOUNCER_<n>``);
    a pooler that passes psycopg's names through (``_pg3_<n>``, numbered per client)
    may later run another client's statement of the same name instead of ours, with
    nothing to tell (same parameters) or fail mid-stream. One round trip.

    Raises:
        ConfigurationError: the names came through unchanged (or another client's
            statement of the same name was already there), naming the option and the fix.
        psycopg.Error: the probe failed otherwise (the caller translates it).
    """
    try:
        with conn.cursor(row_factory=dict_row) as cur:
            names = [row["name"] for row in cur.execute(probe, prepare=True)]
    except psycopg.errors.DuplicatePreparedStatement as exc:  # 42P05: another client's
        raise ConfigurationError(f"{exc}: {NOT_KEPT_FIX}") from exc
    passed = [name for name in names if name.startswith(PSYCOPG_PREPARED_PREFIX)]
    if passed:
        raise ConfigurationError(
            f"the server saw psycopg's own prepared statement name {passed[0]!r} (a pooler "
            "that keeps prepared statements renames them, PgBouncer to PGBOUNCER_<n>; or "
            f"this is no pooler at all): {NOT_KEPT_FIX}"
        )


def is_pooled(dsn: str) -> bool:
    """True when ``dsn`` reaches a transaction pooler (see :func:`mark_pooled`)."""
    return dsn in _pooled


def local_settings(settings: Mapping[str, str]) -> tuple[bytes, list[Any]]:
    """One statement setting ``settings`` for the current transaction only:
    ``(b"SELECT set_config($1, $2, true), ...", [name, value, ...])`` shapes, in psycopg's
    ``%s`` placeholders."""
    calls = ", ".join("set_config(%s, %s, true)" for _ in settings)
    params: list[Any] = []
    for name, value in settings.items():
        params += [name, value]
    return f"SELECT {calls}".encode(), params


def warn_polling_once(key: str, message: str) -> bool:
    """Log ``message`` as a WARNING once per process for ``key`` (e.g.
    ``"broker_transport_options"``); True when it was logged now."""
    with _lock:
        if key in _warned:
            return False
        _warned.add(key)
    logger.warning("%s", message)
    return True
