"""Schema bootstrap: PGMQ itself, then kombu_pgmq's own schema.

:func:`bootstrap` is idempotent and safe when many workers start at once: after a cheap
check (one query) it takes a transaction-level advisory lock and, in that one
transaction, installs what is missing:

1. PGMQ, the first way that works:

   * ``extension``: the ``pgmq`` extension is already installed;
   * ``sql``: a SQL-only PGMQ is already installed (schema ``pgmq`` without extension);
   * ``create_extension``: the server offers the extension, ``CREATE EXTENSION pgmq``;
   * ``install_sql``: the official SQL-only form bundled in the ``pgmq`` PyPI package
     (``pgmq.install``), for managed servers without the extension. Its version is
     recorded in ``kombu_pgmq.settings``.

2. kombu_pgmq's schema, recorded by migration version in ``kombu_pgmq.migrations``:

   * on a database without it (no ``kombu_pgmq.migrations``), ``sql/schema.sql``, the
     current schema in one script, and every migration recorded as applied;
   * on a database an earlier release installed, the migrations after its recorded
     version, ``sql/migrations/NNNN_name.sql``, each applied once and recorded.

   Both give the same schema (``tests/integration/test_schema_current.py`` compares the
   catalogs); ``docs/development.md`` says how to change it.

PGMQ must provide every function kombu_pgmq calls (headers, batch ``set_vt``, ``pop``
with a quantity) and be at least :data:`MIN_PGMQ_VERSION`; otherwise
:class:`~kombu_pgmq.errors.UnsupportedPgmqVersion` says what to upgrade.

Least privilege
===============

The role that runs :func:`bootstrap` (``kombu-pgmq schema install``) owns every table;
it needs no superuser (the SQL-only PGMQ installs as any role with ``CREATE`` on the
database). Other roles get only what :func:`grant` (``kombu-pgmq schema grant producer|
worker ROLE``) gives them, and never a privilege on PGMQ's tables: what they may do to
messages is what kombu_pgmq's ``SECURITY DEFINER`` functions do (``sql/schema.sql``).

* ``producer``: publish to queues and exchanges that exist (Celery's declaration before
  a first publish becomes a passive check), count ready messages.
* ``worker``: what a producer may, and consume (read, ack, reject, requeue, renew
  leases, dead-letter), purge ready messages, declare and bind queues (its pidbox, reply
  and event queues), delete transient queues (non-durable, ``auto_delete`` or
  ``x-expires``), record its consumers. ``celery inspect``/``control`` clients need it
  too (they consume replies).
* owner only: delete a durable queue, the dead-letter admin (``kombu-pgmq dlq``),
  archive pruning, schema installs and grants, the Spark data source (it reads and
  writes queue tables directly), ``VACUUM`` of queue tables (``vacuum_threshold``:
  roles that do not own the tables leave them to autovacuum).

Run least-privilege roles with the transport option ``install_schema=False``. Grants are
recorded (``kombu_pgmq.roles``) and applied again after every migration. A refusal is a
:class:`~kombu_pgmq.errors.PermissionDenied` naming the command that grants it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from . import errors
from ._db import lock_keys
from ._db.connector import Connector
from ._db.queries import current_schema, migrations
from ._db.schema_store import SchemaStore

logger = logging.getLogger(__name__)

#: Oldest PGMQ release kombu_pgmq runs on: ``pop(queue, qty)`` since 1.6.2, batch
#: ``set_vt(queue, msg_ids, vt)`` since 1.8.0 (both checked by signature as well; the
#: headers column since 1.5.0). Tested: 1.11.1 and 1.13.0 (docs/development.md).
MIN_PGMQ_VERSION = (1, 8, 0)

_done: set[str] = set()
_done_lock = threading.Lock()


@dataclass(frozen=True)
class SchemaInfo:
    """What :func:`bootstrap` found or did.

    Attributes:
        pgmq_version: PGMQ version string, e.g. ``"1.13.0"`` (``"unknown"`` for a SQL-only
            PGMQ installed by something else).
        method: ``"extension"``, ``"sql"``, ``"create_extension"`` or ``"install_sql"``.
        schema_version: kombu_pgmq migration version now applied.
        applied: migrations applied by this call (empty when already current; every
            version when it installed the schema, from ``sql/schema.sql``).
    """

    pgmq_version: str
    method: str
    schema_version: int
    applied: tuple[int, ...] = ()


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _bundled_pgmq_sql() -> tuple[str, str]:
    try:
        from pgmq.install import get_embedded_install_sql, get_embedded_sql_version
    except ImportError as exc:  # pragma: no cover - pgmq is a dependency
        raise errors.BootstrapError(
            "PGMQ is not installed in this database and the 'pgmq' Python package (which "
            "bundles its SQL) is missing: pip install pgmq, or CREATE EXTENSION pgmq"
        ) from exc
    return get_embedded_sql_version(), get_embedded_install_sql()


def _install_pgmq(store: SchemaStore) -> tuple[str, str]:
    version = store.pgmq_extension_version()
    if version:
        return version, "extension"
    if store.pgmq_schema_present():
        recorded = None
        if store.migrations_table_present():
            recorded = store.pgmq_sql_version()
        return str(recorded or "unknown"), "sql"
    if store.pgmq_extension_available():
        try:
            with store.transaction():  # savepoint: a refused CREATE EXTENSION is undone
                store.create_extension()
            return str(store.pgmq_extension_version()), "create_extension"
        except errors.StatementError as exc:
            logger.warning(
                "CREATE EXTENSION pgmq failed (%s); installing PGMQ's SQL-only form instead",
                exc,
            )
    version, script = _bundled_pgmq_sql()
    logger.info("installing PGMQ %s from the bundled SQL (no pgmq extension here)", version)
    store.run_script(script)
    return version, "install_sql"


def _check_pgmq(store: SchemaStore, version: str) -> None:
    missing = store.pgmq_missing_functions()
    if version != "unknown" and _parse_version(version) < MIN_PGMQ_VERSION:
        missing = missing or ["(version)"]
    if missing:
        minimum = ".".join(map(str, MIN_PGMQ_VERSION))
        raise errors.UnsupportedPgmqVersion(
            f"PGMQ {version} is too old for kombu_pgmq (needs >= {minimum}; missing "
            f"{', '.join(missing)}): upgrade it with ALTER EXTENSION pgmq UPDATE, or drop "
            "the SQL-only schema pgmq so kombu_pgmq installs the bundled release"
        )


def bootstrap(conninfo: str | Connector) -> SchemaInfo:
    """Install PGMQ (if needed), then kombu_pgmq's schema (``sql/schema.sql``) or the
    migrations it lacks; return what was found.

    Arguments:
        conninfo: libpq URL/DSN, or an open connector (not inside a transaction).

    Raises:
        UnsupportedPgmqVersion: PGMQ is older than :data:`MIN_PGMQ_VERSION`.
        BootstrapError: installing PGMQ, the schema or a migration failed (nothing is
            half-applied: it all runs in one transaction).
        BrokerConnectionError: the server cannot be reached.
    """
    own = not isinstance(conninfo, Connector)
    client = Connector(conninfo) if isinstance(conninfo, str) else conninfo
    try:
        return _bootstrap(SchemaStore(client))
    finally:
        if own:
            client.close()


def _bootstrap(store: SchemaStore) -> SchemaInfo:
    latest = len(migrations())
    try:
        with store.transaction():
            store.lock_bootstrap(lock_keys.BOOTSTRAP)
            version, method = _install_pgmq(store)
            _check_pgmq(store, version)
            if store.migrations_table_present():
                applied = _upgrade(store)
            else:
                applied = _install_current(store)
            if method == "install_sql":
                store.record_pgmq_install(version)
            if applied:  # functions added by these migrations reach the granted roles
                store.apply_grants()
    except (errors.UnsupportedPgmqVersion, errors.BrokerConnectionError):
        raise
    except errors.KombuPgmqError as exc:
        raise errors.BootstrapError(f"schema bootstrap failed: {exc}") from exc
    return SchemaInfo(version, method, latest, tuple(applied))


def _install_current(store: SchemaStore) -> list[int]:
    """Install the current schema (``sql/schema.sql``) and record every migration."""
    logger.info("installing the kombu_pgmq schema (version %d)", len(migrations()))
    store.install_current(current_schema(), [(m.version, m.name) for m in migrations()])
    return [m.version for m in migrations()]


def _upgrade(store: SchemaStore) -> list[int]:
    """Apply the migrations not recorded yet, in version order; return their versions."""
    applied_before = set(store.applied_migrations())
    applied = []
    for migration in migrations():
        if migration.version in applied_before:
            continue
        logger.info("applying kombu_pgmq migration %04d_%s", *migration[:2])
        store.apply_migration(migration.version, migration.name, migration.sql)
        applied.append(migration.version)
    return applied


def verify(client: Connector) -> None:
    """Check that PGMQ and every kombu_pgmq migration are installed (installs nothing).

    Used when the ``install_schema`` transport option is off.

    Raises:
        BootstrapError: something is missing (the message says how to install it).
        UnsupportedPgmqVersion: PGMQ is too old.
    """
    store = SchemaStore(client)
    if not store.pgmq_schema_present():
        raise errors.BootstrapError(
            "PGMQ is not installed in this database and install_schema is off: run "
            "'kombu-pgmq schema install --url <url>' once, or set install_schema=True"
        )
    version = store.pgmq_extension_version() or "unknown"
    _check_pgmq(store, str(version))
    applied = store.applied_if_any()
    if len(applied) < len(migrations()):
        raise errors.BootstrapError(
            f"kombu_pgmq schema is at version {len(applied)}, this release needs "
            f"{len(migrations())}, and install_schema is off: run "
            "'kombu-pgmq schema install --url <url>' once, or set install_schema=True"
        )


def ensure_schema(client: Connector, key: str) -> None:
    """Bootstrap once per process for ``key`` (e.g. the DSN); cheap when already done.

    Used by the transport on connect: a single query when the schema is current.
    """
    if key in _done:
        return
    with _done_lock:
        if key in _done:
            return
        store = SchemaStore(client)
        applied = store.applied_if_any()
        if len(applied) < len(migrations()) or not store.pgmq_schema_present():
            info = bootstrap(client)
            logger.info(
                "kombu_pgmq schema ready: PGMQ %s (%s), schema version %d",
                info.pgmq_version,
                info.method,
                info.schema_version,
            )
        _done.add(key)


@dataclass(frozen=True)
class SchemaStatus:
    """What :func:`status` found (read-only: nothing is installed or changed).

    Attributes:
        pgmq_version: PGMQ version (``"unknown"`` for a SQL-only PGMQ installed by
            something else), None when PGMQ is not installed.
        method: ``"extension"``, ``"sql"`` (SQL-only) or None (not installed).
        pgmq_available: version of the ``pgmq`` extension the server offers, else None.
        pgmq_problem: why the installed PGMQ cannot serve kombu_pgmq (the message names
            the fix), else None.
        schema_version: kombu_pgmq migrations applied (0: none).
        required_version: migrations this release needs (``len(migrations())``).
    """

    pgmq_version: str | None
    method: str | None
    pgmq_available: str | None
    pgmq_problem: str | None
    schema_version: int
    required_version: int

    @property
    def ready(self) -> bool:
        """True when this release can run on the database without installing anything."""
        return (
            self.method is not None
            and self.pgmq_problem is None
            and self.schema_version >= self.required_version
        )


def status(dsn: str) -> SchemaStatus:
    """Report PGMQ and the kombu_pgmq schema version of the database at ``dsn`` (a libpq
    URL/DSN); runs only read-only statements (the checks of :func:`verify`).

    Raises:
        BrokerConnectionError: the server cannot be reached.
    """
    client = Connector(dsn)
    try:
        store = SchemaStore(client)
        applied = store.applied_if_any()
        version: str | None = None
        method: str | None = None
        problem: str | None = None
        extension = store.pgmq_extension_version()
        if extension:
            version, method = extension, "extension"
        elif store.pgmq_schema_present():
            recorded = store.pgmq_sql_version() if 1 in applied else None
            version, method = str(recorded or "unknown"), "sql"
        if version is not None:
            try:
                _check_pgmq(store, version)
            except errors.UnsupportedPgmqVersion as exc:
                problem = str(exc)
        available = store.pgmq_extension_available()
        return SchemaStatus(
            pgmq_version=version,
            method=method,
            pgmq_available=available,
            pgmq_problem=problem,
            schema_version=len(applied),
            required_version=len(migrations()),
        )
    finally:
        client.close()


#: Kinds of roles :func:`grant` knows (see "Least privilege" in the module docstring).
ROLE_KINDS = ("producer", "worker")


def grant(dsn: str, role: str, kind: str) -> None:
    """Give an existing role the privileges of a ``"producer"`` (publish only) or a
    ``"worker"`` (consume, ack, declare its queues, and publish); run as the schema owner.
    Recorded in ``kombu_pgmq.roles``: later migrations grant what they add to it too.
    A role granted before gets the new kind (a worker made producer loses the rest).

    Raises:
        ConfigurationError: ``kind`` is not ``"producer"`` or ``"worker"``.
        StatementError: the role does not exist (``CREATE ROLE ... LOGIN`` first) or this
            role cannot grant (not the schema owner).
        BootstrapError: the schema has no roles to grant yet (an install older than
            version 10: run :func:`bootstrap`).
    """
    if kind not in ROLE_KINDS:
        raise errors.ConfigurationError(
            f"role kind {kind!r} is unknown: use {' or '.join(ROLE_KINDS)}"
        )
    client = Connector(dsn)
    try:
        store = _require_current(client)
        store.grant_role(role, kind)
    finally:
        client.close()


def revoke(dsn: str, role: str) -> bool:
    """Take back every privilege :func:`grant` gave ``role``; False if it had none
    recorded. Run as the schema owner."""
    client = Connector(dsn)
    try:
        return _require_current(client).revoke_role(role)
    finally:
        client.close()


def grants(dsn: str) -> list[tuple[str, str]]:
    """``[(role, kind)]`` of the roles granted with :func:`grant`."""
    client = Connector(dsn)
    try:
        return _require_current(client).granted_roles()
    finally:
        client.close()


def _require_current(client: Connector) -> SchemaStore:
    """The schema store of ``client``, once the schema is checked to be current.

    Raises:
        BootstrapError: migrations are missing (the message says what to run).
    """
    store = SchemaStore(client)
    applied = store.applied_if_any()
    if len(applied) < len(migrations()):
        raise errors.BootstrapError(
            f"kombu_pgmq schema is at version {len(applied)}, this release needs "
            f"{len(migrations())}: run 'kombu-pgmq schema install --url <url>' first"
        )
    return store
