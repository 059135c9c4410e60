"""Schema statements: what PGMQ and kombu_pgmq's migrations are installed, installing
them, and role grants. Named statements of ``sql/queries/install.sql`` (and the scripts
``sql/schema.sql`` and ``sql/migrations/``) sent through a
:class:`~kombu_pgmq._db.connector.Connector`; used by
:mod:`kombu_pgmq.schema`, which decides what to install.

Errors are the connector's (:func:`kombu_pgmq.errors.translate`): a failed statement is a
:class:`~kombu_pgmq.errors.StatementError`, a refused privilege
:class:`~kombu_pgmq.errors.PermissionDenied`, a lost server
:class:`~kombu_pgmq.errors.BrokerConnectionError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .connector import Connector

__all__ = ["SchemaStore"]


class SchemaStore:
    """Typed schema statements over one connector (autocommit unless inside
    :meth:`transaction`)."""

    def __init__(self, db: Connector) -> None:
        self.db = db

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction (a savepoint when nested): everything in it or nothing."""
        with self.db.transaction():
            yield

    # -- what is installed (read-only) ---------------------------------------------------

    def pgmq_extension_version(self) -> str | None:
        """Version of the installed ``pgmq`` extension (``"1.13.0"``), else None."""
        version = self.db.scalar("pgmq_extension_version")
        return str(version) if version else None

    def pgmq_extension_available(self) -> str | None:
        """Version of the ``pgmq`` extension the server offers, else None."""
        version = self.db.scalar("pgmq_extension_available")
        return str(version) if version else None

    def pgmq_schema_present(self) -> bool:
        """PGMQ is installed, as the extension or SQL-only (``pgmq.meta`` exists)."""
        return bool(self.db.scalar("pgmq_schema_present"))

    def pgmq_sql_version(self) -> str | None:
        """Version of the SQL-only PGMQ kombu_pgmq installed (``kombu_pgmq.settings``),
        else None. Needs the table ``kombu_pgmq.settings``."""
        version = self.db.scalar("pgmq_sql_version")
        return str(version) if version else None

    def pgmq_missing_functions(self) -> list[str]:
        """Signatures of the PGMQ functions kombu_pgmq calls that are missing, e.g.
        ``["pgmq.pop(text,integer)"]``."""
        return [str(signature) for signature in self.db.column("pgmq_missing_functions")]

    def migrations_table_present(self) -> bool:
        """``kombu_pgmq.migrations`` exists (cheap: no error when it does not)."""
        return bool(self.db.scalar("schema_version"))

    def applied_migrations(self) -> list[int]:
        """Versions recorded in ``kombu_pgmq.migrations``, ascending (the table must
        exist: see :meth:`migrations_table_present`)."""
        return [int(version) for version in self.db.column("applied_migrations")]

    def applied_if_any(self) -> list[int]:
        """:meth:`applied_migrations`, or ``[]`` when kombu_pgmq is not installed."""
        return self.applied_migrations() if self.migrations_table_present() else []

    # -- installing (inside one transaction: see kombu_pgmq.schema.bootstrap) -------------

    def lock_bootstrap(self, key: int) -> None:
        """Take the transaction-level advisory lock ``key`` (waits for another
        bootstrap; released when the transaction ends)."""
        self.db.scalar("bootstrap_lock", {"key": key})

    def create_extension(self) -> None:
        """``CREATE EXTENSION IF NOT EXISTS pgmq`` (run it in a nested transaction: a
        refusal then undoes only this)."""
        self.db.scalar("create_extension")

    def run_script(self, script: str) -> None:
        """Run a SQL script of several statements (PGMQ's SQL-only install)."""
        self.db.script(script)

    def install_current(self, script: str, versions: list[tuple[int, str]]) -> None:
        """Run the current schema's ``script`` (``sql/schema.sql``: it creates schema
        ``kombu_pgmq`` and ``kombu_pgmq.migrations``) and record every migration of
        ``versions`` (``(version, name)``) as applied."""
        self.db.script(script)
        for version, name in versions:
            self.record_migration(version, name)

    def apply_migration(self, version: int, name: str, script: str) -> None:
        """Run migration ``script`` and record it as ``version``/``name``."""
        self.db.script(script)
        self.record_migration(version, name)

    def record_migration(self, version: int, name: str) -> None:
        """Record migration ``version``/``name`` as applied."""
        self.db.scalar("record_migration", {"version": version, "name": name})

    def record_pgmq_install(self, version: str) -> None:
        """Record the version of the SQL-only PGMQ just installed."""
        self.db.scalar("record_pgmq_install", {"version": version})

    def apply_grants(self) -> None:
        """Grant every recorded role (``kombu_pgmq.roles``) what its kind allows again,
        so functions added by new migrations reach them."""
        self.db.column("apply_grants")

    # -- roles (kombu_pgmq.grant_role, revoke_role, apply_grants) --------------------------

    def grant_role(self, role: str, kind: str) -> None:
        """Give existing ``role`` the privileges of ``kind`` (``"producer"``/``"worker"``)
        and record it."""
        self.db.execute("grant_role", {"role": role, "kind": kind})

    def revoke_role(self, role: str) -> bool:
        """Take back what :meth:`grant_role` gave; False if ``role`` had nothing recorded."""
        return bool(self.db.scalar("revoke_role", {"role": role}))

    def granted_roles(self) -> list[tuple[str, str]]:
        """``[(role, kind)]`` recorded by :meth:`grant_role`, by role."""
        rows: list[tuple[str, str]] = self.db.fetch("granted_roles")
        return [(str(role), str(kind)) for role, kind in rows]
