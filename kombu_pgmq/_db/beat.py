"""The beat store: periodic tasks, their ticks and the leader (tables
``kombu_pgmq.beat_entries``, ``beat_ticks``, ``beat_leader``), as named statements of
``sql/queries/beat.sql`` sent through a
:class:`~kombu_pgmq._db.connector.Connector`. Used by :mod:`kombu_pgmq.beat`.

Errors are the connector's (:func:`kombu_pgmq.errors.translate`): a lost server is a
:class:`~kombu_pgmq.errors.BrokerConnectionError`, a refused privilege
:class:`~kombu_pgmq.errors.PermissionDenied`, any other failure a
:class:`~kombu_pgmq.errors.StatementError`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, NamedTuple

from .connector import Connector

__all__ = ["CHANNEL", "BeatStore", "Claim", "Election", "LeaderInfo", "StoredEntry", "StoredTick"]

#: The NOTIFY channel of schedule changes and run-now requests.
CHANNEL = "kombu_pgmq_beat"


class Election(NamedTuple):
    """One election round: ``leader`` (this session holds the lock), the leader of
    record (``epoch``, ``leader_identity``, ``leader_pid``, ``heartbeat_age`` seconds),
    and ``deposed`` (this round ended a hung leader's session)."""

    leader: bool
    epoch: int | None
    leader_identity: str | None
    leader_pid: int | None
    heartbeat_age: float | None
    deposed: bool


class LeaderInfo(NamedTuple):
    """The leader of record; ``alive``: its session still holds the lock (False after
    a clean stop: the lock was released, ``heartbeat_at`` is when)."""

    identity: str
    backend_pid: int
    epoch: int
    since: datetime
    heartbeat_at: datetime
    heartbeat_age: float
    alive: bool


class StoredEntry(NamedTuple):
    """One row of ``kombu_pgmq.beat_entries`` (schedule and options as JSON values)."""

    name: str
    task: str
    schedule_kind: str
    schedule: dict[str, Any]
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    enabled: bool
    catch_up: str
    source: str
    last_run_at: datetime | None
    next_run_at: datetime | None
    total_run_count: int
    missed_ticks: int
    last_error: str | None
    run_requested_at: datetime | None
    created_at: datetime
    updated_at: datetime


class StoredTick(NamedTuple):
    """One tick of ``kombu_pgmq.beat_ticks``."""

    entry: str
    due_at: datetime
    sent_at: datetime
    kind: str
    missed: int
    task_id: str | None
    leader: str
    epoch: int


class Claim(NamedTuple):
    """A tick to claim: entry ``name``, its ``due_at``, the ``expected`` last run (a
    manual tick: its request time), the ``next_run`` after it, ``kind`` and ``missed``
    ticks folded into it."""

    name: str
    due_at: datetime
    expected: datetime | None
    next_run: datetime | None
    task_id: str | None
    kind: str
    missed: int


class BeatStore:
    """Typed beat statements over one connector (autocommit unless inside
    :meth:`transaction`)."""

    def __init__(self, db: Connector) -> None:
        self.db = db

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction (a savepoint when nested)."""
        with self.db.transaction():
            yield

    def installed(self) -> bool:
        """The beat tables and functions (``kombu_pgmq.beat_list``...) are installed."""
        return bool(self.db.scalar("beat_installed"))

    # -- leader --------------------------------------------------------------------------

    def elect(self, me: str, stale_seconds: float) -> Election:
        """One election round for this session (identity ``me``)."""
        params = {"me": me, "stale_seconds": stale_seconds}
        return self.db.fetch("beat_elect", params, Election)[0]

    def resign(self) -> bool:
        """Release the lead if this session holds it."""
        return bool(self.db.scalar("beat_resign"))

    def leader(self) -> LeaderInfo | None:
        """The leader of record (None: no beat has ever led here)."""
        rows = self.db.fetch("beat_leader_info", None, LeaderInfo)
        return rows[0] if rows else None

    # -- ticks ---------------------------------------------------------------------------

    def claim(self, epoch: int, me: str, claims: Sequence[Claim]) -> set[str] | None:
        """Claim ticks (inside the publishing transaction); the names claimed, or None
        when this session no longer leads at ``epoch`` (fenced: nothing claimed)."""
        params = {
            "epoch": epoch,
            "me": me,
            "entries": [c.name for c in claims],
            "due_ats": [c.due_at for c in claims],
            "expected": [c.expected for c in claims],
            "next_runs": [c.next_run for c in claims],
            "task_ids": [c.task_id for c in claims],
            "kinds": [c.kind for c in claims],
            "missed": [c.missed for c in claims],
        }
        claimed = self.db.scalar("beat_claim", params)
        return None if claimed is None else set(claimed)

    def note(
        self,
        epoch: int,
        names: Sequence[str],
        next_runs: Sequence[datetime | None],
        errors: Sequence[str | None],
    ) -> bool:
        """Record next runs and errors of entries (False: not the leader at ``epoch``)."""
        params = {
            "epoch": epoch,
            "entries": list(names),
            "next_runs": list(next_runs),
            "errors": list(errors),
        }
        return bool(self.db.scalar("beat_note", params))

    def prune(self, keep_seconds: float, batch: int) -> int:
        """Forget up to ``batch`` ticks sent more than ``keep_seconds`` ago."""
        params = {"keep_seconds": keep_seconds, "batch": batch}
        return int(self.db.scalar("beat_prune", params) or 0)

    # -- entries -------------------------------------------------------------------------

    def sync_config(self, entries: Sequence[dict[str, Any]]) -> tuple[int, int]:
        """Write ``beat_schedule``'s entries (rows as :meth:`upsert` takes them, with
        ``name``); delete config entries not named. ``(written, removed)``."""
        rows: list[Any] = self.db.fetch("beat_sync_config", {"config": json.dumps(list(entries))})
        return int(rows[0][0]), int(rows[0][1])

    def upsert(self, entry: dict[str, Any], *, replace: bool) -> bool:
        """Add an entry (``name``, ``task``, ``schedule_kind``, ``schedule``, ``args``,
        ``kwargs``, ``options``, ``enabled``, ``catch_up``); True when added, False when
        replaced.

        Raises:
            StatementError: it exists and ``replace`` is False.
        """
        params = {
            "name": entry["name"],
            "task": entry["task"],
            "schedule_kind": entry["schedule_kind"],
            "schedule": json.dumps(entry["schedule"]),
            "args": json.dumps(entry.get("args", [])),
            "kwargs": json.dumps(entry.get("kwargs", {})),
            "options": json.dumps(entry.get("options", {})),
            "enabled": bool(entry.get("enabled", True)),
            "catch_up": entry.get("catch_up", "once"),
            "replace": replace,
        }
        return bool(self.db.scalar("beat_upsert", params))

    def set_enabled(self, name: str, enabled: bool) -> bool:
        """Enable or disable ``name``; False if there is no such entry."""
        return bool(self.db.scalar("beat_set_enabled", {"name": name, "enabled": enabled}))

    def remove(self, name: str) -> bool:
        """Delete ``name``; False if there was none."""
        return bool(self.db.scalar("beat_remove", {"name": name}))

    def run_now(self, name: str) -> datetime | None:
        """Ask the leader to send ``name`` once now; the request time (None: no entry)."""
        value: datetime | None = self.db.scalar("beat_run_now", {"name": name})
        return value

    def entries(self) -> list[StoredEntry]:
        """Every entry, by name."""
        return self.db.fetch("beat_list", None, StoredEntry)

    def entry(self, name: str) -> StoredEntry | None:
        """The entry ``name`` (None: there is none)."""
        rows = self.db.fetch("beat_entry", {"name": name}, StoredEntry)
        return rows[0] if rows else None

    def history(self, name: str | None, max_rows: int) -> list[StoredTick]:
        """Ticks of ``name`` (None: all entries), newest first."""
        return self.db.fetch("beat_history", {"name": name, "max_rows": max_rows}, StoredTick)

    # -- notifications -------------------------------------------------------------------

    def listen(self) -> None:
        """``LISTEN`` on :data:`CHANNEL` (this connector then hears every change)."""
        self.db.execute("listen_beat")
