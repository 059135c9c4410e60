"""See and steer the broker: queue statistics, messages peeked without consuming them,
paused queues, Celery tasks found and cancelled by id (what RabbitMQ's management API
and ``rabbitmqctl`` give an operator; the SQL functions ``kombu_pgmq.queue_stats``,
``pause``, ``resume``, ``peek``, ``find_task`` and ``cancel_task``).

:class:`Management` is the Python API; ``kombu-pgmq queues|messages|queue|task`` the
command line (:mod:`kombu_pgmq.cli`), :mod:`kombu_pgmq.metrics` the Prometheus exporter and
:mod:`kombu_pgmq.flower` Flower's Broker page are built on :meth:`Management.queues`.

States of a message (columns of ``pgmq.q_<queue>``):

* ``ready``: visible now (``vt <= now()``), what a consumer reads next; AMQP's
  ``message_count`` and ``celery inspect``'s view of a queue's length count these;
* ``in_flight``: delivered and held by a consumer's visibility timeout (``read_ct > 0``);
* ``delayed``: not visible yet and never delivered (Celery countdown/ETA, ``x-delay``).

Pausing (:meth:`Management.pause`) is durable (a row of ``kombu_pgmq.paused``, survives
restarts of workers and of PostgreSQL): kombu_pgmq consumers read nothing from a paused
queue from their next read on (at most ``polling_interval`` seconds), publishes still
land, messages already delivered are acked or renewed as usual, and Celery's view
(``celery inspect active_queues``) does not change. PGMQ's own functions and clients do
not know about it.

Limits (:meth:`Management.limits`, :meth:`Management.set_limits`; table
``kombu_pgmq.queue_limits``, see
:mod:`kombu_pgmq.limits`): each queue's fleet-wide concurrency and rate limits and their
use now. :meth:`Management.queues` adds them to the statistics (``QueueStats.limits``) with
one more statement, and leaves them out (None) when the database has no
``kombu_pgmq.limits_info`` or the role may not read them (a ``producer`` role:
``limits_info`` is granted to workers).

Dead rows and the xmin horizon (:meth:`Management.horizon`): ``QueueStats.dead_tuples``
counts the dead row versions of a queue's tables (the server's statistics, a few seconds
behind), and :meth:`Management.horizon` names the oldest holder of the database's xmin
horizon (a session's snapshot, a standby or replication slot, a prepared transaction):
while one is old, VACUUM removes none of the rows deliveries and acks leave (see
:mod:`kombu_pgmq._db.horizon`; reads of one queue start at a position and do not walk
them: :mod:`kombu_pgmq._db.positions`).

Cancelling (:meth:`Management.cancel_task`) is a durable revoke: the task's messages no
consumer holds (ready, delayed, or whose lease lapsed) are removed from their queue and
archived with the headers ``x-archive-reason: cancelled``, ``x-cancelled-at`` and
``x-cancelled-by``, so no worker ever receives them (unlike Celery's revoke, kept in the
workers' memory). A message already delivered is revoked as ``celery control revoke``
does (a broadcast on Celery's remote-control exchange).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from . import _conninfo as conninfo
from . import errors, revocations
from ._db.admin import Admin, BandStats, PeekedRow, TaskRow
from ._db.beat import BeatStore, LeaderInfo, StoredEntry, StoredTick
from ._db.connector import Connector
from ._db.horizon import Horizon, HorizonStore
from ._db.limits import LimitInfo, LimitStore
from ._db.results import ResultStats, ResultStore
from .dlq import DEFAULT_DEAD_LETTER_QUEUE

__all__ = [
    "CancelResult",
    "Horizon",
    "LimitInfo",
    "Management",
    "PeekedMessage",
    "QueueStats",
    "ResultStats",
    "TaskLocation",
    "queue_stats",
]

#: Above this many archived rows a queue's archive size is PostgreSQL's estimate
#: (``pg_class.reltuples``, kept fresh by autovacuum) instead of ``count(*)``.
EXACT_ARCHIVE_BELOW = 100_000
_PREVIEW_CHARS = 80

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueueStats:
    """One Kombu queue, its priority bands summed.

    Counts are messages; ``oldest_age_seconds`` is the age since publish of the oldest
    ready or in-flight message (None: there is none); ``archived`` is exact unless
    ``archived_estimated`` (see :data:`EXACT_ARCHIVE_BELOW`; None: the archive was
    locked); ``dead_letters`` counts the dead-letter queue's messages from this queue;
    ``bands`` has one entry per PGMQ queue (band floor ``band``; one entry without
    priorities); ``limits``: the queue's limits and their use (None: not limited, or
    not read: see :meth:`Management.queues`); ``dead_tuples``: dead row versions of its
    tables (None: no statistics yet); ``settled_in_transaction``: messages of the queue
    archived by their task's own transaction (:class:`~kombu_pgmq.AtomicTask`), since the
    schema counts them (None: not read, see :meth:`Management.queues`).
    """

    name: str
    ready: int
    in_flight: int
    delayed: int
    oldest_age_seconds: float | None
    archived: int | None
    archived_estimated: bool
    consumers: int
    dead_letters: int
    paused: bool
    bands: tuple[BandStats, ...]
    limits: LimitInfo | None = None
    dead_tuples: int | None = None
    settled_in_transaction: int | None = None

    @property
    def messages(self) -> int:
        """Every message in the queue: ready + in flight + delayed."""
        return self.ready + self.in_flight + self.delayed

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields, ``messages``, and ``bands`` as a list of dicts."""
        return {
            "queue": self.name,
            "messages": self.messages,
            "ready": self.ready,
            "in_flight": self.in_flight,
            "delayed": self.delayed,
            "oldest_age_seconds": self.oldest_age_seconds,
            "archived": self.archived,
            "archived_estimated": self.archived_estimated,
            "consumers": self.consumers,
            "dead_letters": self.dead_letters,
            "paused": self.paused,
            "bands": [
                {
                    "band": b.band,
                    "pgmq_queue": b.pgmq_queue,
                    "ready": b.ready,
                    "in_flight": b.in_flight,
                    "delayed": b.delayed,
                }
                for b in self.bands
            ],
            "limits": None if self.limits is None else self.limits.as_dict(queue=False),
            "dead_tuples": self.dead_tuples,
            "settled_in_transaction": self.settled_in_transaction,
        }


def queue_stats(rows: Iterable[BandStats]) -> list[QueueStats]:
    """Sum band rows (``kombu_pgmq.queue_stats()``, ordered by queue) per Kombu queue."""
    grouped: dict[str, list[BandStats]] = {}
    for row in rows:
        grouped.setdefault(row.queue, []).append(row)
    result = []
    for name, bands in grouped.items():
        ages = [b.oldest_age_seconds for b in bands if b.oldest_age_seconds is not None]
        archived = [b.archived for b in bands]
        result.append(
            QueueStats(
                name=name,
                ready=sum(b.ready for b in bands),
                in_flight=sum(b.in_flight for b in bands),
                delayed=sum(b.delayed for b in bands),
                oldest_age_seconds=max(ages) if ages else None,
                archived=None if None in archived else sum(a or 0 for a in archived),
                archived_estimated=any(b.archived_estimated for b in bands),
                consumers=max(b.consumers for b in bands),
                dead_letters=max(b.dead_letters for b in bands),
                paused=any(b.paused for b in bands),
                bands=tuple(bands),
            )
        )
    return result


def _summed(dead: Mapping[str, int], bands: Iterable[BandStats]) -> int | None:
    """Dead tuples of a queue's band tables (None: none has statistics yet)."""
    found = [dead[b.pgmq_queue] for b in bands if b.pgmq_queue in dead]
    return sum(found) if found else None


def _counted(settled: Mapping[str, int], bands: Iterable[BandStats]) -> int:
    """Messages of a queue's bands settled in a transaction."""
    return sum(settled.get(b.pgmq_queue, 0) for b in bands)


def _headers(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _preview(text: str, limit: int = _PREVIEW_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class PeekedMessage:
    """A message seen without consuming it.

    ``task``/``task_id``: Celery's ``task`` and ``id`` headers (None for other messages);
    ``args``: a preview (Celery's ``argsrepr`` and ``kwargsrepr``, else the body's
    first characters); ``visible_at``: when it is (or was) visible; ``body``: the stored
    JSON text of the body; ``headers``: the stored headers.
    """

    queue: str
    band: int
    state: str
    msg_id: int
    read_ct: int
    enqueued_at: datetime
    visible_at: datetime
    task: str | None
    task_id: str | None
    args: str
    body: str
    headers: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (times as ISO 8601)."""
        return {
            "queue": self.queue,
            "band": self.band,
            "state": self.state,
            "msg_id": self.msg_id,
            "read_ct": self.read_ct,
            "enqueued_at": self.enqueued_at.isoformat(),
            "visible_at": self.visible_at.isoformat(),
            "task": self.task,
            "task_id": self.task_id,
            "args": self.args,
        }

    @classmethod
    def from_row(cls, queue: str, row: PeekedRow) -> PeekedMessage:
        headers = _headers(row.headers)
        if "argsrepr" in headers or "kwargsrepr" in headers:
            args = _preview(f"{headers.get('argsrepr', '')} {headers.get('kwargsrepr', '')}")
        else:
            args = _preview(row.message)
        return cls(
            queue=queue,
            band=row.band,
            state=row.state,
            msg_id=row.msg_id,
            read_ct=row.read_ct,
            enqueued_at=row.enqueued_at,
            visible_at=row.visible_at,
            task=headers.get("task"),
            task_id=headers.get("id"),
            args=args,
            body=row.message,
            headers=headers,
        )


@dataclass(frozen=True)
class TaskLocation:
    """Where one message of a Celery task is: ``state`` is ``ready``, ``in_flight``,
    ``delayed`` (in ``queue``) or ``archived`` (in its archive; ``reason`` e.g.
    ``cancelled``, None for an ack). A dead letter is a message of the dead-letter queue
    (``reason``: why it was dead-lettered)."""

    queue: str
    pgmq_queue: str
    state: str
    msg_id: int
    read_ct: int
    enqueued_at: datetime
    visible_at: datetime
    archived_at: datetime | None
    reason: str | None
    task: str | None

    @classmethod
    def from_row(cls, row: TaskRow) -> TaskLocation:
        return cls(
            queue=row.queue,
            pgmq_queue=row.pgmq_queue,
            state=row.state,
            msg_id=row.msg_id,
            read_ct=row.read_ct,
            enqueued_at=row.enqueued_at,
            visible_at=row.visible_at,
            archived_at=row.archived_at,
            reason=row.reason,
            task=_headers(row.headers).get("task"),
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (times as ISO 8601)."""
        return {
            "queue": self.queue,
            "pgmq_queue": self.pgmq_queue,
            "state": self.state,
            "msg_id": self.msg_id,
            "read_ct": self.read_ct,
            "enqueued_at": self.enqueued_at.isoformat(),
            "visible_at": self.visible_at.isoformat(),
            "archived_at": self.archived_at.isoformat() if self.archived_at else None,
            "reason": self.reason,
            "task": self.task,
        }


@dataclass(frozen=True)
class CancelResult:
    """What :meth:`Management.cancel_task` did: ``cancelled`` messages (queue, msg_id)
    were removed and archived (reason ``cancelled``); ``in_flight`` ones were already
    delivered; ``revoked`` tells whether the workers were told to revoke the task
    (``terminated``: and to terminate it if it runs)."""

    task_id: str
    cancelled: tuple[tuple[str, int], ...]
    in_flight: tuple[TaskLocation, ...]
    revoked: bool
    terminated: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "cancelled": [{"queue": q, "msg_id": m} for q, m in self.cancelled],
            "in_flight": [loc.as_dict() for loc in self.in_flight],
            "revoked": self.revoked,
            "terminated": self.terminated,
        }


class Management:
    """Operations on every queue of one database.

    Arguments:
        url: the broker URL (``postgresql://...``) or a libpq connection string.
        dead_letter_queue: Kombu name of the dead-letter queue (the transport option
            ``dead_letter_queue``), for the per-queue dead-letter counts.

    Raises (every method):
        BrokerConnectionError: the database cannot be reached.
        PermissionDenied: the role may not (statistics need a role granted ``producer``
            or ``worker``, or the owner; the rest the owner).
        ConfigurationError: the kombu_pgmq schema is missing or older than version 12
            (the message says how to install it).
    """

    def __init__(self, url: str, *, dead_letter_queue: str = DEFAULT_DEAD_LETTER_QUEUE) -> None:
        if not url:
            raise errors.ConfigurationError("Management needs a broker url (postgresql://...)")
        self.dead_letter_queue = dead_letter_queue
        self._url = url
        self._db = Connector(conninfo.to_dsn(url))
        self._checked = False
        self._results_checked = False
        self._beat_checked = False
        self._limits_readable: bool | None = None  # None: not tried yet
        self._settled_readable: bool | None = None  # None: not tried yet
        self._admin_ops = Admin(self._db)

    @property
    def _admin(self) -> Admin:
        if not self._checked:
            if not self._admin_ops.operations_installed():
                raise errors.ConfigurationError(
                    "this database has no kombu_pgmq schema of version 12 or later (queue "
                    "statistics, pause, cancel): run 'kombu-pgmq schema install' with the same "
                    "URL, or start a worker on it once (it installs what is missing)"
                )
            self._checked = True
        return self._admin_ops

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Management:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def queues(
        self, *, exact_archive_below: int = EXACT_ARCHIVE_BELOW, limits: bool = True
    ) -> list[QueueStats]:
        """Every queue's statistics (one statement: one scan of each queue table), sorted
        by name, with its dead row versions and the messages settled in a transaction
        (``QueueStats.settled_in_transaction``: one statement each; the latter None when
        the database has no ``kombu_pgmq.settled_in_transaction()`` or the role may not
        call it); with ``limits``, each limited queue's limits and their use
        (``QueueStats.limits``: one more statement, which counts the in-flight messages
        of each limited queue), left out when they cannot be read (see
        :meth:`limits_readable`)."""
        from ._naming import pgmq_queue_name

        rows = self._admin.queue_stats(pgmq_queue_name(self.dead_letter_queue), exact_archive_below)
        dead = HorizonStore(self._db).dead_tuples()
        settled = self._settled_in_transaction()
        stats = [
            dataclasses.replace(
                q,
                dead_tuples=_summed(dead, q.bands),
                settled_in_transaction=None if settled is None else _counted(settled, q.bands),
            )
            for q in queue_stats(rows)
        ]
        if not limits or not self.limits_readable():
            return stats
        try:
            found = {info.queue: info for info in LimitStore(self._db).info()}
        except errors.PermissionDenied as exc:
            logger.info("kombu_pgmq: queue limits left out: %s", exc)
            self._limits_readable = False
            return stats
        return [dataclasses.replace(q, limits=found.get(q.name)) for q in stats]

    def _settled_in_transaction(self) -> dict[str, int] | None:
        """Messages settled in a transaction per PGMQ queue (None: the database has no
        ``kombu_pgmq.settled_in_transaction()``, or the role may not call it: logged,
        and not tried again)."""
        if self._settled_readable is None:
            self._settled_readable = self._admin.settled_in_transaction_installed()
        if not self._settled_readable:
            return None
        try:
            return self._admin.settled_in_transaction()
        except errors.PermissionDenied as exc:
            logger.info("kombu_pgmq: messages settled in a transaction left out: %s", exc)
            self._settled_readable = False
            return None

    def horizon(self) -> Horizon | None:
        """The oldest holder of the database's xmin horizon other than this connection
        (None: none): while it is old, VACUUM removes none of the dead rows deliveries
        and acks leave (``QueueStats.dead_tuples``). See
        :class:`~kombu_pgmq._db.horizon.Horizon`."""
        return HorizonStore(self._db).oldest_holder()

    # -- limits (kombu_pgmq.limits, table kombu_pgmq.queue_limits) ------------------------

    def limits_readable(self) -> bool:
        """The limits (``kombu_pgmq.limits_info``) are in this database and this role may
        read them (checked once; False also after a read was refused: a ``producer`` role)."""
        if self._limits_readable is None:
            self._limits_readable = bool(self._db.scalar("limits_installed"))
        return self._limits_readable

    def _limit_store(self) -> LimitStore:
        if not self.limits_readable():
            raise errors.ConfigurationError(
                "this database has no kombu_pgmq queue limits (schema version 21): run "
                "'kombu-pgmq schema install' with the same URL, or start a worker on it once "
                "(it installs them)"
            )
        return LimitStore(self._db)

    def limits(self, queue: str | None = None) -> list[LimitInfo]:
        """Every limited queue (or only ``queue``; empty: not limited) with its limits and
        their use now: messages in flight, tokens left, keys at their limit, reads held
        back (:class:`~kombu_pgmq._db.limits.LimitInfo`).

        Raises:
            QueueNotFound: ``queue`` is not declared.
            ConfigurationError: no limits in this database (the message says how to install
                them).
            PermissionDenied: the role is not granted ``worker``.
        """
        found = self._limit_store().info(queue)
        if (
            queue is not None
            and not found
            and not self._db.scalar("kombu_queue_declared", {"queue": queue})
        ):
            raise errors.QueueNotFound(
                f"queue {queue!r} does not exist: declare it first (start a worker that "
                "consumes it, or publish to it; see kombu-pgmq queues)"
            )
        return found

    def set_limits(
        self, queue: str, limits: Mapping[str, Any], *, replace: bool = False
    ) -> LimitInfo | None:
        """Change Kombu queue ``queue``'s limits (names of
        :data:`kombu_pgmq.limits.LIMIT_NAMES`; None or 0 removes one; the others are kept,
        or removed with ``replace``); persisted, in force at the consumers' next read.
        Returns what is in force afterwards (None: not limited). A FIFO queue keeps its
        group limit (key ``x-group-id``, one message per group at a time).

        Raises:
            ConfigurationError: a limit is invalid (:func:`kombu_pgmq.limits.validate_limits`)
                or no limits in this database.
            StatementError: the queue does not exist, or the server refuses a limit (a key
                limit on a FIFO queue, a burst without its rate): the message says why.
        """
        from .limits import validate_limits

        checked = validate_limits(queue, limits, complete=replace)
        store = self._limit_store()
        with self._db.transaction():
            store.set(queue, checked, replace=replace)
            found = store.info(queue)
        return found[0] if found else None

    # -- Celery results (table kombu_pgmq.results) -----------------------------------------

    @property
    def _results(self) -> ResultStore:
        if not self._results_checked:
            if not self._admin_ops.results_installed():
                raise errors.ConfigurationError(
                    "this database has no kombu_pgmq result backend tables (schema version "
                    "18): run 'kombu-pgmq schema install' with the same URL, or use "
                    'result_backend = "postgresql://..." once (it installs them)'
                )
            self._results_checked = True
        return ResultStore(self._db)

    def results(self) -> list[ResultStats]:
        """Stored Celery results by state (one scan of ``kombu_pgmq.results``): how many,
        the oldest ``date_done``, their size in bytes, and how many are past their expiry
        but not deleted yet (the worker's sweep runs every ``expire_interval_seconds``)."""
        return self._results.stats()

    def expire_results(self, batch_size: int = 5000) -> int:
        """Delete every expired result now, ``batch_size`` rows per statement (what a
        worker's sweep and ``celery.backend_cleanup`` do); how many were deleted.

        Raises:
            ConfigurationError: ``batch_size`` is not positive.
        """
        if batch_size < 1:
            raise errors.ConfigurationError(f"batch_size={batch_size}: delete at least 1 row")
        store, total = self._results, 0
        while (removed := store.expire(batch_size)) > 0:
            total += removed
            if removed < batch_size:
                break
        return total

    # -- the beat scheduler (table kombu_pgmq.beat_entries) --------------------------------

    @property
    def _beat(self) -> BeatStore:
        if not self._beat_checked:
            if not self.beat_installed():
                raise errors.ConfigurationError(
                    "this database has no kombu_pgmq beat tables (schema version 20): run "
                    "'kombu-pgmq schema install' with the same URL, or start a beat with "
                    "-S kombu_pgmq.beat:Scheduler once (it installs them)"
                )
            self._beat_checked = True
        return BeatStore(self._db)

    def beat_installed(self) -> bool:
        """The beat scheduler's tables (``kombu_pgmq.beat_entries``...) are in this database;
        the other ``beat_*`` methods raise ``ConfigurationError`` (naming the fix) when
        not."""
        return BeatStore(self._db).installed()

    def beat_entries(self) -> list[StoredEntry]:
        """The beat scheduler's periodic tasks, by name: schedule, enabled, last and next
        run, run count, missed ticks, last error (:mod:`kombu_pgmq.beat`; no Celery
        needed to read them)."""
        return self._beat.entries()

    def beat_leader(self) -> LeaderInfo | None:
        """The leading beat of record (None: no beat ever led here); ``alive`` False: it
        is gone (its session ended) and no other took over yet."""
        return self._beat.leader()

    def beat_history(self, name: str | None = None, limit: int = 50) -> list[StoredTick]:
        """Ticks sent (or skipped), newest first, of ``name`` or of every entry."""
        return self._beat.history(name, limit)

    def messages(self, queue: str, limit: int = 20) -> list[PeekedMessage]:
        """Up to ``limit`` messages of Kombu queue ``queue`` (higher priority bands first,
        then publish order), without consuming them.

        Raises:
            QueueNotFound: there is no such queue.
            ConfigurationError: ``limit`` is not positive.
        """
        if limit < 1:
            raise errors.ConfigurationError(f"limit={limit}: show at least 1 message")
        rows = self._admin.peek(queue, limit)
        return [PeekedMessage.from_row(queue, r) for r in rows[:limit]]

    def pause(self, queue: str) -> list[str]:
        """Pause Kombu queue ``queue`` (see the module docstring); returns its PGMQ queues.
        Pausing a paused queue changes nothing.

        Raises:
            QueueNotFound: the queue was never declared.
        """
        with self._db.transaction():
            return self._admin.pause(queue)

    def resume(self, queue: str) -> list[str]:
        """Resume Kombu queue ``queue`` and wake its waiting consumers; returns the PGMQ
        queues that were paused (empty: it was not paused).

        Raises:
            QueueNotFound: the queue was never declared.
        """
        with self._db.transaction():
            return self._admin.resume(queue)

    def find_task(self, task_id: str, *, archives: bool = True) -> list[TaskLocation]:
        """Every message of Celery task ``task_id`` (its ``id`` header) in the queues
        and, with ``archives``, the archives. Scans every queue table: an operator's
        lookup, not for a hot path."""
        return [TaskLocation.from_row(r) for r in self._admin.find_task(task_id, archives=archives)]

    def cancel_task(
        self,
        task_id: str,
        *,
        revoke: bool = True,
        terminate: bool = False,
        control_exchange: str = "celery",
    ) -> CancelResult:
        """Cancel Celery task ``task_id``, queued, delayed or running: its messages no
        consumer holds are removed and archived with reason ``cancelled``, and with
        ``revoke`` the task is revoked on every worker as ``celery control revoke`` does
        (``terminate``: a running task is killed too, as ``revoke --terminate``): a
        ``revoke`` broadcast on Celery's remote-control exchange (``control_exchange``,
        Celery's ``control_exchange`` setting), which every worker keeps in memory (and
        its ``--statedb``). The broadcast goes whether or not a message of the task is
        left: a running task whose message was acked when it started (Celery's default
        early ack) has none.

        The revocation is recorded in the database too (:mod:`kombu_pgmq.revocations`):
        workers started later refuse the task, and kombu_pgmq's result backend reports it
        REVOKED."""
        with self._db.transaction():
            cancelled = self._admin.cancel_task(task_id)
            revocations.record(self._db, [task_id])
        in_flight = tuple(
            loc for loc in self.find_task(task_id, archives=False) if loc.state == "in_flight"
        )
        if revoke:
            self._broadcast_revoke(task_id, terminate, control_exchange)
        return CancelResult(
            task_id=task_id,
            cancelled=tuple((q, m) for q, _pgmq, m in cancelled),
            in_flight=in_flight,
            revoked=revoke,
            terminated=revoke and terminate,
        )

    def _broadcast_revoke(self, task_id: str, terminate: bool, control_exchange: str) -> None:
        """Celery's ``revoke`` remote-control command (kombu's pidbox, as Celery's
        ``app.control.revoke`` sends it), on this database's broker."""
        from kombu import Connection
        from kombu.pidbox import Mailbox

        mailbox = Mailbox(control_exchange, type="fanout", accept=["json"], serializer="json")
        with Connection(self._url) as connection:
            mailbox(connection)._broadcast(
                "revoke", {"task_id": task_id, "terminate": terminate, "signal": "SIGTERM"}
            )
