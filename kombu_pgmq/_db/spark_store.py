"""The Spark store: staged writes, snapshots and stream ranges of the ``pgmq`` Spark data
source (:mod:`kombu_pgmq.spark.datasource`; table ``kombu_pgmq.spark_writes``), as named
statements of ``sql/queries/spark.sql`` sent through a
:class:`~kombu_pgmq._db.connector.Connector`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import NamedTuple

from psycopg import sql

from .connector import Connector

__all__ = ["SnapshotRow", "SparkStore"]


class SnapshotRow(NamedTuple):
    """A queue or archive row as the data source's schema orders it."""

    msg_id: int
    read_ct: int
    enqueued_at: datetime
    last_read_at: datetime | None
    vt: datetime
    archived_at: datetime | None
    task: str | None
    task_id: str | None
    message: str
    headers: str | None


class _Range(NamedTuple):
    lo: int | None
    hi: int | None


class SparkStore:
    """Typed Spark data source operations over one connector."""

    def __init__(self, db: Connector) -> None:
        self.db = db

    def open_write(self, write_id: str, queue: str) -> int:
        """Register a Spark write (``kombu_pgmq.spark_writes``) on the queue; return the
        queue's highest msg_id now (every message the write stages will be above it)."""
        return int(self.db.scalar("open_write", {"write_id": write_id, "queue": queue}))

    def stage_messages(self, write_id: str, messages: Sequence[str], headers: Sequence[str]) -> int:
        """Send a batch of a Spark write hidden for 10 years (``headers`` carry the task
        attempt's marker); return how many. Made visible by :meth:`commit_write`.

        Raises:
            StatementError: the write is no longer open (committed or aborted).
        """
        params = {"write_id": write_id, "messages": list(messages), "headers": list(headers)}
        return int(self.db.scalar("stage_messages", params))

    def commit_write(self, write_id: str, attempts: Sequence[str]) -> int:
        """End the write: make the messages of the committed task ``attempts``
        (``"<write id>/<partition>/<attempt>"``) visible and delete what other attempts
        staged, in one transaction, after staging in flight finished; return how many
        became visible.

        Raises:
            StatementError: the write is not open (aborted, committed, unknown).
        """
        return int(
            self.db.scalar("commit_write", {"write_id": write_id, "attempts": list(attempts)})
        )

    def abort_write(self, write_id: str) -> int:
        """End the write: delete every message it staged (after staging in flight
        finished); return how many. 0 if the write was not open."""
        return int(self.db.scalar("abort_write", {"write_id": write_id}))

    @staticmethod
    def _table(queue: str, archive: bool) -> sql.Identifier:
        return sql.Identifier("pgmq", f"{'a' if archive else 'q'}_{queue}")

    def msg_id_range(self, queue: str, *, archive: bool = False) -> tuple[int, int] | None:
        """``(lowest, highest)`` msg_id of the queue or its archive; None when empty."""
        query = sql.SQL(self.db.statement("msg_id_range")).format(table=self._table(queue, archive))
        found = self.db.fetch(query, None, _Range)[0]
        return None if found.lo is None or found.hi is None else (int(found.lo), int(found.hi))

    def snapshot(
        self, queue: str, lo: int, hi: int, *, archive: bool = False, batch_rows: int = 10_000
    ) -> Iterator[SnapshotRow]:
        """Rows with ``lo < msg_id <= hi`` of the queue or its archive, by msg_id, through a
        server-side cursor (``batch_rows`` per fetch); nothing is consumed."""
        table = f"pgmq.{'a' if archive else 'q'}_{queue}"
        present = set(self.db.column("table_columns", {"table": table}))
        cols = {
            name: sql.Identifier(name) if name in present else sql.SQL("NULL::timestamptz")
            for name in ("last_read_at", "archived_at")
        }
        query = sql.SQL(self.db.statement("snapshot")).format(
            table=self._table(queue, archive), **cols
        )
        yield from self.db.stream(
            query, {"lo": lo, "hi": hi}, SnapshotRow, name="snapshot", itersize=batch_rows
        )

    def stream_horizon(self, queue: str, after_id: int, max_rows: int, wait_seconds: float) -> int:
        """Highest msg_id a streaming reader may take after ``after_id`` (see migration
        0005); ``after_id`` itself when nothing can be taken yet."""
        params = {
            "queue": queue,
            "after_id": after_id,
            "max_rows": max_rows,
            "wait_seconds": wait_seconds,
        }
        return int(self.db.scalar("stream_horizon", params))

    def archive_range(self, queue: str, lo: int, hi: int) -> int:
        """Archive the messages with ``lo < msg_id <= hi``; return how many."""
        statement = self.db.compose("archive_range", queue_table=("pgmq", f"q_{queue}"))
        return int(self.db.scalar(statement, {"queue": queue, "lo": lo, "hi": hi}))
