"""The result store: Celery task results, saved groups, chord counters and durable
revocations (tables ``kombu_pgmq.results``, ``chords``, ``revoked``), as named statements
of ``sql/queries/results.sql`` sent through a
:class:`~kombu_pgmq._db.connector.Connector`. Used by :mod:`kombu_pgmq.results`.

Errors are the connector's (:func:`kombu_pgmq.errors.translate`): a lost server is a
:class:`~kombu_pgmq.errors.BrokerConnectionError`, a refused privilege
:class:`~kombu_pgmq.errors.PermissionDenied`, any other failure a
:class:`~kombu_pgmq.errors.StatementError`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import NamedTuple

from .connector import Connector

__all__ = ["CHANNEL", "ChordPart", "PartResult", "ResultStats", "ResultStore", "Revocation"]

#: The NOTIFY channel of stored results and revocations.
CHANNEL = "kombu_pgmq_results"


class _Stored(NamedTuple):
    key: str
    meta: bytes | None
    revoked: bool


class ChordPart(NamedTuple):
    """What counting one header task did: ``fire`` (this call completed the chord and
    claimed its callback), ``done`` parts counted, ``total`` expected (None: unknown)."""

    fire: bool
    done: int
    total: int | None


class PartResult(NamedTuple):
    """One counted header task's encoded result."""

    task_id: str
    state: str
    result: bytes


class ResultStats(NamedTuple):
    """Results of one state: how many, the oldest ``date_done``, their size (bytes),
    and how many are past their expiry."""

    state: str
    results: int
    oldest: datetime | None
    bytes: int
    expired: int


class Revocation(NamedTuple):
    """A revoked task id and until when it stays revoked (None: for good)."""

    task_id: str
    revoked_at: datetime
    expires_at: datetime | None


class ResultStore:
    """Typed result-backend statements over one connector (autocommit unless inside
    :meth:`transaction`)."""

    def __init__(self, db: Connector) -> None:
        self.db = db

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction (a savepoint when nested)."""
        with self.db.transaction():
            yield

    # -- results -------------------------------------------------------------------------

    def store(
        self,
        key: str,
        state: str,
        meta: bytes,
        expires_seconds: float | None,
        keep_success: bool,
        *,
        synchronous: bool = True,
    ) -> bool:
        """Insert or replace ``key``'s encoded meta and notify waiters; False when a
        stored SUCCESS was kept (``keep_success``). ``synchronous=False``: the commit does
        not wait for the WAL flush (a server crash may forget it)."""
        params = {
            "key": key,
            "state": state,
            "meta": meta,
            "expires_seconds": expires_seconds,
            "keep_success": keep_success,
        }
        rows: list[tuple[bool]] = self.db.fetch("results_store", params, synchronous=synchronous)
        return bool(rows[0][0])

    def save_group(self, key: str, meta: bytes, expires_seconds: float | None) -> None:
        """Store a saved GroupResult's encoded meta (a producer role may write nothing
        else)."""
        params = {"key": key, "meta": meta, "expires_seconds": expires_seconds}
        self.db.execute("results_save_group", params)

    def get(self, keys: Sequence[str], task_ids: Sequence[str | None]) -> dict[str, bytes | None]:
        """``{key: meta}`` of the keys stored; a task key without a result whose task is
        revoked maps to None (report REVOKED); other keys are left out."""
        params = {"keys": list(keys), "task_ids": list(task_ids)}
        rows = self.db.fetch("results_get", params, _Stored, binary=True)
        return {r.key: (None if r.revoked else bytes(r.meta or b"")) for r in rows}

    def delete(self, keys: Sequence[str]) -> int:
        """Remove keys; how many were there."""
        return int(self.db.scalar("results_delete", {"keys": list(keys)}) or 0)

    def expire_at(self, keys: Sequence[str], expires_seconds: float | None) -> None:
        """Keys expire ``expires_seconds`` from now (None or 0: never)."""
        self.db.execute(
            "results_expire_at", {"keys": list(keys), "expires_seconds": expires_seconds}
        )

    def expire(self, batch: int) -> int:
        """Delete up to ``batch`` expired results (and expired chords and revocations);
        how many results."""
        return int(self.db.scalar("results_expire", {"batch": batch}) or 0)

    def stats(self) -> list[ResultStats]:
        """Counts, oldest, bytes and expired by state."""
        return self.db.fetch("results_stats", None, ResultStats)

    # -- chords --------------------------------------------------------------------------

    def chord_start(self, group_id: str, expires_seconds: float | None) -> None:
        """A new run of chord ``group_id`` (a previous run's counts are forgotten)."""
        self.db.execute("chord_start", {"group_id": group_id, "expires_seconds": expires_seconds})

    def chord_size(
        self, group_id: str, size: int | None, added: int, expires_seconds: float | None
    ) -> None:
        """Set the chord's header size (None: keep it) and add ``added`` parts."""
        params = {
            "group_id": group_id,
            "size": size,
            "added": added,
            "expires_seconds": expires_seconds,
        }
        self.db.execute("chord_size", params)

    def chord_part(
        self,
        group_id: str,
        task_id: str,
        group_index: int | None,
        state: str,
        result: bytes,
        fallback_size: int | None,
        expires_seconds: float | None,
    ) -> ChordPart:
        """Count header task ``task_id`` once (see :class:`ChordPart`)."""
        params = {
            "group_id": group_id,
            "task_id": task_id,
            "group_index": group_index,
            "state": state,
            "result": result,
            "fallback_size": fallback_size,
            "expires_seconds": expires_seconds,
        }
        return self.db.fetch("chord_part", params, ChordPart)[0]

    def chord_results(self, group_id: str) -> list[PartResult]:
        """The counted header results in header order."""
        rows = self.db.fetch("chord_results", {"group_id": group_id}, PartResult, binary=True)
        return [r._replace(result=bytes(r.result)) for r in rows]

    def chord_done(self, group_id: str, expires_seconds: float | None) -> None:
        """Drop a fired chord's parts (its row stays until it expires)."""
        self.db.execute("chord_done", {"group_id": group_id, "expires_seconds": expires_seconds})

    # -- revocations ---------------------------------------------------------------------

    def revoke(self, task_ids: Sequence[str], expires_seconds: float | None) -> int:
        """Record durable revocations (and notify waiters); how many were new."""
        params = {"task_ids": list(task_ids), "expires_seconds": expires_seconds}
        return int(self.db.scalar("revoke_tasks", params) or 0)

    def revoked(self, max_rows: int) -> list[Revocation]:
        """Revocations in force, newest first."""
        return self.db.fetch("revoked_tasks", {"max_rows": max_rows}, Revocation)

    # -- notifications -------------------------------------------------------------------

    def listen(self) -> None:
        """``LISTEN`` on :data:`CHANNEL` (this connector then receives every store)."""
        self.db.execute("listen_results")
