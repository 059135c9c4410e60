"""Administrative operations: dead letters, archive retention, statistics and steering,
database creation. Named statements of ``sql/queries/admin.sql`` sent through a
:class:`~kombu_pgmq._db.connector.Connector`; used by :mod:`kombu_pgmq.dlq`,
:mod:`kombu_pgmq.retention`, :mod:`kombu_pgmq.management` and :mod:`kombu_pgmq.embedded`
(the schema's statements: :mod:`kombu_pgmq._db.schema_store`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ..errors import ConfigurationError
from .connector import Connector

__all__ = ["Admin", "BandStats", "DeadLetter", "PeekedRow", "TaskRow"]


class DeadLetter(NamedTuple):
    """A row of a dead-letter queue: ``message``/``headers`` are JSON text."""

    msg_id: int
    read_ct: int
    enqueued_at: Any  # datetime (timezone-aware)
    message: str
    headers: str | None


class BandStats(NamedTuple):
    """A row of ``kombu_pgmq.queue_stats()``: one PGMQ queue (priority band)."""

    queue: str
    pgmq_queue: str
    band: int
    ready: int
    in_flight: int
    delayed: int
    oldest_age_seconds: float | None
    archived: int | None
    archived_estimated: bool
    consumers: int
    dead_letters: int
    paused: bool


class PeekedRow(NamedTuple):
    """A row of ``kombu_pgmq.peek()``: ``message``/``headers`` are JSON text."""

    pgmq_queue: str
    band: int
    state: str
    msg_id: int
    read_ct: int
    enqueued_at: Any  # datetime (timezone-aware)
    visible_at: Any
    message: str
    headers: str | None


class TaskRow(NamedTuple):
    """A row of ``kombu_pgmq.find_task()``."""

    queue: str
    pgmq_queue: str
    state: str
    msg_id: int
    read_ct: int
    enqueued_at: Any
    visible_at: Any
    archived_at: Any
    reason: str | None
    headers: str | None


class _Cancelled(NamedTuple):
    queue: str
    pgmq_queue: str
    msg_id: int


class _Settled(NamedTuple):
    pgmq_queue: str
    settled: int


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

    # -- statistics and steering (kombu_pgmq.management) ---------------------------------

    def operations_installed(self) -> bool:
        """The statistics, pause and cancel functions (``kombu_pgmq.queue_stats``...) are in
        this database."""
        return bool(self.db.scalar("operations_installed"))

    def results_installed(self) -> bool:
        """The result backend (``kombu_pgmq.results``) is in this database."""
        return bool(self.db.scalar("results_installed"))

    def queue_stats(self, dead_letter_queue: str, exact_archive_below: int) -> list[BandStats]:
        """One row per PGMQ queue (priority band) of every queue, in one statement."""
        params = {
            "dead_letter_queue": dead_letter_queue,
            "exact_archive_below": exact_archive_below,
        }
        return self.db.fetch("queue_stats", params, BandStats)

    def settled_in_transaction_installed(self) -> bool:
        """``kombu_pgmq.settled_in_transaction()`` is in this database (schema version
        32)."""
        return bool(self.db.scalar("settled_in_transaction_installed"))

    def settled_in_transaction(self) -> dict[str, int]:
        """Messages settled inside an application's transaction
        (:class:`~kombu_pgmq.AtomicTask`, committed ones), per PGMQ queue that has any.

        Raises:
            PermissionDenied: the role is not granted ``producer`` or ``worker``.
            StatementError: the function is missing (see
                :meth:`settled_in_transaction_installed`).
        """
        return {
            r.pgmq_queue: r.settled for r in self.db.fetch("settled_in_transaction", None, _Settled)
        }

    def pause(self, queue: str) -> list[str]:
        """Pause Kombu queue ``queue``; its PGMQ queues.

        Raises:
            QueueNotFound: the queue was never declared.
        """
        return [str(q) for q in self.db.column("pause_queue", {"kombu_queue": queue})]

    def resume(self, queue: str) -> list[str]:
        """Resume Kombu queue ``queue``; the PGMQ queues that were paused.

        Raises:
            QueueNotFound: the queue was never declared.
        """
        return [str(q) for q in self.db.column("resume_queue", {"kombu_queue": queue})]

    def peek(self, queue: str, limit: int) -> list[PeekedRow]:
        """Up to ``limit`` messages per band of Kombu queue ``queue``, unconsumed.

        Raises:
            QueueNotFound: no such queue.
        """
        return self.db.fetch("peek", {"kombu_queue": queue, "qty": limit}, PeekedRow)

    def find_task(self, task_id: str, *, archives: bool) -> list[TaskRow]:
        """Messages whose ``id`` header is ``task_id``, in queues (and archives)."""
        return self.db.fetch("find_task", {"task_id": task_id, "archives": archives}, TaskRow)

    def cancel_task(self, task_id: str) -> list[tuple[str, str, int]]:
        """Remove and archive (reason ``cancelled``) the task's undelivered messages;
        ``(queue, pgmq_queue, msg_id)`` of each."""
        rows = self.db.fetch("cancel_task", {"task_id": task_id}, _Cancelled)
        return [(r.queue, r.pgmq_queue, r.msg_id) for r in rows]

    # -- server (kombu_pgmq.embedded) -----------------------------------------------------

    def create_database_if_missing(self, name: str, *, lock_key: int) -> bool:
        """Create database *name* unless it exists; True if created.

        Concurrent callers are serialized by the session advisory lock *lock_key*
        (``CREATE DATABASE`` cannot run inside a transaction block): a direct connection
        only.

        Raises:
            ConfigurationError: ``db`` goes through a transaction pooler (a session lock
                there would be held by a server connection other clients share).
        """
        if self.db.pooled:
            raise ConfigurationError(
                "creating a database takes a session advisory lock: connect directly, "
                "not through a transaction pooler"
            )
        self.db.execute("session_lock", {"key": lock_key})
        try:
            if self.db.scalar("database_exists", {"name": name}):
                return False
            self.db.execute(self.db.compose("create_database", database=name))
            return True
        finally:
            self.db.execute("session_unlock", {"key": lock_key})
