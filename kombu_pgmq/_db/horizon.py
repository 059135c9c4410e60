"""The xmin horizon and the dead rows it keeps: who holds the horizon of the broker's
database, and how many dead row versions each queue table has. Named statements of
``sql/queries/admin.sql`` (``xmin_horizon``, ``queue_table_dead_tuples``) sent through a
:class:`~kombu_pgmq._db.connector.Connector`; used by the maintenance thread
(:mod:`kombu_pgmq.transport._maintenance`), :mod:`kombu_pgmq.management` and
:mod:`kombu_pgmq.metrics`.

PostgreSQL removes a dead row version (VACUUM), and marks its index entries dead so
that scans skip them, only once no snapshot that could still see it is open: while an
older snapshot is held in the database (a long query, a session idle in transaction,
``pg_dump``, a standby with ``hot_standby_feedback``, a replication slot, a prepared
transaction), every delivery and ack leaves row versions that stay, and VACUUM removes
none of them.
"""

from __future__ import annotations

from typing import NamedTuple

from .connector import Connector

__all__ = ["OLD_SECONDS", "Horizon", "HorizonStore"]

#: A holder of the xmin horizon is reported (``kombu-pgmq queues``, the worker's log)
#: once its transaction is this old (seconds): shorter ones come and go by the hundred.
OLD_SECONDS = 60.0


class Horizon(NamedTuple):
    """The oldest holder of the database's xmin horizon.

    ``kind``: ``session`` (a backend of this database or a WAL sender), ``replication_slot``
    or ``prepared_transaction``; ``pid`` (None for a prepared transaction or an inactive
    slot); ``xmin`` (the transaction id, as text) and ``xmin_age_xids`` (transactions
    since); ``age_seconds``: since its transaction started (None when the server hides it
    from this role: ``GRANT pg_read_all_stats``); ``state`` and ``query`` (its first 200
    characters) likewise; ``name``: the slot's name or the prepared transaction's gid.
    """

    kind: str
    pid: int | None
    application_name: str | None
    role: str | None
    state: str | None
    xmin: str
    xmin_age_xids: int
    age_seconds: float | None
    query: str | None
    name: str | None

    @property
    def old(self) -> bool | None:
        """Held for :data:`OLD_SECONDS` or more (None: its age is hidden from this role)."""
        return None if self.age_seconds is None else self.age_seconds >= OLD_SECONDS

    @property
    def key(self) -> tuple[str, int | None, str]:
        """Identifies one holder across reads (one warning per holder)."""
        return (self.kind, self.pid, self.xmin)

    def describe(self) -> str:
        """One line for logs and the CLI, e.g. ``session pid 4242 (application_name
        'psql', role app, idle in transaction, 6 min 2 s): SELECT ...``."""
        age = "age hidden from this role" if self.age_seconds is None else _age(self.age_seconds)
        if self.kind == "replication_slot":
            old = f"xmin {self.xmin_age_xids:,} transactions old"
            return f"replication slot {self.name!r} ({self.state}, {old})"
        if self.kind == "prepared_transaction":
            return f"prepared transaction {self.name!r} (role {self.role}, prepared {age} ago)"
        parts = [f"application_name {self.application_name!r}" if self.application_name else ""]
        parts += [f"role {self.role}" if self.role else "", self.state or "", age]
        where = ", ".join(p for p in parts if p)
        query = f": {' '.join(self.query.split())[:120]}" if self.query else ""
        return f"session pid {self.pid} ({where}){query}"


def _age(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{seconds:.1f} s"


class _DeadTuples(NamedTuple):
    pgmq_queue: str
    dead_tuples: int


class HorizonStore:
    """The horizon's holder and the queue tables' dead rows, over one connector."""

    def __init__(self, db: Connector) -> None:
        self.db = db

    def oldest_holder(self) -> Horizon | None:
        """The oldest holder of this database's xmin horizon other than this session
        (None: none)."""
        rows = self.db.fetch("xmin_horizon", None, Horizon)
        return rows[0] if rows else None

    def dead_tuples(self) -> dict[str, int]:
        """``{PGMQ queue: dead row versions of pgmq.q_<queue>}`` from the server's
        cumulative statistics (a few seconds behind; tables without statistics yet are
        left out)."""
        rows = self.db.fetch("queue_table_dead_tuples", None, _DeadTuples)
        return {r.pgmq_queue: int(r.dead_tuples) for r in rows}
