"""Administrative operations: dead letters, archive retention, schema bootstrap, database
creation. Named statements of ``sql/queries.sql`` sent through a
:class:`~kombu_pgmq._db.connector.Connector`; used by :mod:`kombu_pgmq.dlq`,
:mod:`kombu_pgmq.retention`, :mod:`kombu_pgmq.schema` and :mod:`kombu_pgmq.embedded`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .connector import Connector

__all__ = ["Admin", "DeadLetter"]


class DeadLetter(NamedTuple):
    """A row of a dead-letter queue: ``message``/``headers`` are JSON text."""

    msg_id: int
    read_ct: int
    enqueued_at: Any  # datetime (timezone-aware)
    message: str
    headers: str | None


class _QueueTable(NamedTuple):
    queue: str
    archived: bool


class Admin:
    """Typed administrative operations over one connector."""

    def __init__(self, db: Connector) -> None:
        self.db = db

    # -- dead letters and archive retention ---------------------------------------------

    def dead_letters(
        self,
        queue: str,
        *,
        take: bool = False,
        msg_ids: Sequence[int] | None = None,
        original_queue: str | None = None,
        reason: str | None = None,
        task: str | None = None,
        after_id: int = 0,
        limit: int = 100,
        any_header: bool = True,
    ) -> list[DeadLetter]:
        """Rows of dead-letter queue ``queue`` matching the filters (None: any), oldest
        first, msg_id > ``after_id``, at most ``limit``. ``take=True`` deletes them too
        (use inside a transaction to send them elsewhere atomically).
        ``any_header=False``: only rows with an ``x-dead-letter`` header.

        Raises:
            QueueNotFound: the dead-letter queue does not exist.
        """
        statement = self.db.compose(
            "take_dead_letters" if take else "dead_letters", queue_table=("pgmq", f"q_{queue}")
        )
        params = {
            "msg_ids": None if msg_ids is None else list(msg_ids),
            "queue": original_queue,
            "reason": reason,
            "task": task,
            "after_id": after_id,
            "limit": limit,
            "any_header": any_header,
        }
        return self.db.fetch(statement, params, DeadLetter)

    def queue_tables(self) -> list[tuple[str, bool]]:
        """Every PGMQ queue: ``(name, has_archive_table)``."""
        return [
            (r.queue, bool(r.archived)) for r in self.db.fetch("queue_tables", None, _QueueTable)
        ]

    def prune_archive(self, queue: str, older_than_seconds: float, batch_size: int) -> int:
        """Delete up to ``batch_size`` messages archived more than ``older_than_seconds``
        ago from ``pgmq.a_<queue>`` (one short transaction); return how many."""
        statement = self.db.compose("prune_archive", archive_table=("pgmq", f"a_{queue}"))
        params = {"older_than_seconds": older_than_seconds, "batch_size": batch_size}
        return int(self.db.scalar(statement, params))

    # -- server and schema (kombu_pgmq.embedded, kombu_pgmq.schema) --------------------

    def create_database_if_missing(self, name: str, *, lock_key: int) -> bool:
        """Create database *name* unless it exists; True if created.

        Concurrent callers are serialized by the session advisory lock *lock_key*
        (``CREATE DATABASE`` cannot run inside a transaction block).
        """
        self.db.execute("session_lock", {"key": lock_key})
        try:
            if self.db.scalar("database_exists", {"name": name}):
                return False
            self.db.execute(self.db.compose("create_database", database=name))
            return True
        finally:
            self.db.execute("session_unlock", {"key": lock_key})
