"""Dead-letter queue operations: list, replay, purge (mirrors SQS's DLQ redrive).

Messages reach the dead-letter queue (transport option ``dead_letter_queue``, default
``kombu_pgmq_dlq``, a PGMQ queue like any other) after ``max_deliveries`` deliveries, or
when rejected without requeue. Each keeps its body and headers and gains an
``x-dead-letter`` header: ``{queue, pgmq_queue, msg_id, read_ct, reason, enqueued_at,
dead_lettered_at}``. In SQL::

    SELECT msg_id, headers->'x-dead-letter'->>'queue', headers->>'task'
    FROM pgmq.q_kombu_pgmq_dlq;

:class:`DeadLetterQueue` is the Python API; ``kombu-pgmq dlq list|replay|purge`` the
command line (:mod:`kombu_pgmq.cli`). Replay moves a message back to its original Kombu
queue (the priority band of its priority) in one transaction per batch: it is removed
from the dead-letter queue and sent to its queue together, or not at all. The replayed
copy loses ``x-dead-letter`` (and its count of restores, ``x-kombu-restored``) and counts
its replays in ``x-dead-letter-replays``; its ``read_ct`` starts again at 0, so it gets
``max_deliveries`` fresh deliveries.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from . import _conninfo as conninfo
from . import _priorities as priorities
from . import errors
from ._db.admin import Admin, DeadLetter
from ._db.broker import Broker
from ._db.connector import Connector
from ._encoding import ENVELOPE_KEY, RESTORED_KEY, dumps
from ._naming import pgmq_queue_name

#: The transport's default dead-letter queue (Kombu name).
DEFAULT_DEAD_LETTER_QUEUE = "kombu_pgmq_dlq"
_HEADER = "x-dead-letter"
_REPLAYS = "x-dead-letter-replays"


@dataclass(frozen=True)
class DeadLetterInfo:
    """One dead letter, decoded.

    ``queue``/``pgmq_queue``: where it came from (None if it lacks ``x-dead-letter``);
    ``read_ct``: its read count there (see :attr:`deliveries`); ``reason``:
    ``"max_deliveries"``, ``"rejected"``, ``"undecodable"`` or ``"consumer_error"``;
    ``task``/``task_id``:
    Celery's headers (None for plain Kombu messages); ``body``: the stored message as
    JSON text; times are timezone-aware.
    """

    msg_id: int
    queue: str | None
    pgmq_queue: str | None
    original_msg_id: int | None
    read_ct: int | None
    reason: str | None
    enqueued_at: datetime | None
    dead_lettered_at: datetime | None
    task: str | None
    task_id: str | None
    body: str
    headers: dict[str, Any] = field(repr=False)

    @property
    def deliveries(self) -> int | None:
        """Times it reached a consumer: ``read_ct``, less its restores (deliveries
        returned unprocessed, header ``x-kombu-restored``) and the read that found it
        over ``max_deliveries`` (that read moved it instead of delivering it)."""
        if self.read_ct is None:
            return None
        restored = self.headers.get(RESTORED_KEY)
        if not isinstance(restored, int) or isinstance(restored, bool):
            restored = 0
        moved = 1 if self.reason == "max_deliveries" else 0
        return self.read_ct - restored - moved

    @classmethod
    def from_row(cls, row: DeadLetter) -> DeadLetterInfo:
        headers = json.loads(row.headers) if row.headers else {}
        dead = headers.get(_HEADER) or {}

        def when(value: Any) -> datetime | None:
            try:
                return datetime.fromisoformat(value) if value else None
            except (TypeError, ValueError):
                return None

        return cls(
            msg_id=row.msg_id,
            queue=dead.get("queue"),
            pgmq_queue=dead.get("pgmq_queue"),
            original_msg_id=dead.get("msg_id"),
            read_ct=dead.get("read_ct"),
            reason=dead.get("reason"),
            enqueued_at=when(dead.get("enqueued_at")),
            dead_lettered_at=when(dead.get("dead_lettered_at")),
            task=headers.get("task"),
            task_id=headers.get("id"),
            body=row.message,
            headers=headers,
        )


@dataclass(frozen=True)
class ReplayResult:
    """``replayed``: messages sent back, per original Kombu queue; ``skipped``: msg_ids
    matched but not replayable (no ``x-dead-letter`` header to tell their queue)."""

    replayed: dict[str, int]
    skipped: list[int]


class DeadLetterQueue:
    """Operations on one dead-letter queue.

    Arguments:
        url: the broker URL (``postgresql://...``) or a libpq connection string.
        queue: Kombu name of the dead-letter queue (the transport option
            ``dead_letter_queue``).

    Filters (every method): ``ids`` (dead-letter msg_ids), ``queue`` (original Kombu
    queue), ``reason``, ``task`` (Celery task name); None matches anything. ``replay``
    and ``purge`` need a filter or ``all=True``.

    Raises (every method):
        BrokerConnectionError: the database cannot be reached.
    """

    def __init__(
        self,
        url: str,
        *,
        queue: str = DEFAULT_DEAD_LETTER_QUEUE,
    ) -> None:
        if not url:
            raise errors.ConfigurationError("DeadLetterQueue needs a broker url (postgresql://...)")
        self.queue = queue
        self.pgmq_queue = pgmq_queue_name(queue)
        self._db = Connector(conninfo.to_dsn(url))
        self._admin = Admin(self._db)
        self._broker = Broker(self._db)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> DeadLetterQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def list(
        self,
        *,
        ids: Sequence[int] | None = None,
        queue: str | None = None,
        reason: str | None = None,
        task: str | None = None,
        limit: int = 100,
        after_id: int = 0,
    ) -> list[DeadLetterInfo]:
        """Dead letters matching the filters, oldest first (at most ``limit``, msg_id >
        ``after_id``). An absent dead-letter queue has none."""
        where = _Where(ids, queue, reason, task)
        rows = self._rows(where, take=False, after_id=after_id, limit=limit)
        return [DeadLetterInfo.from_row(r) for r in rows or []]

    def _rows(
        self, where: _Where, *, take: bool, after_id: int, limit: int, any_header: bool = True
    ) -> Sequence[DeadLetter] | None:
        """The matching rows (deleted too if ``take``); None if the dead-letter queue does
        not exist."""
        try:
            return self._admin.dead_letters(
                self.pgmq_queue,
                take=take,
                msg_ids=where.ids,
                original_queue=where.queue,
                reason=where.reason,
                task=where.task,
                after_id=after_id,
                limit=limit,
                any_header=any_header,
            )
        except errors.QueueNotFound:
            return None

    def replay(
        self,
        *,
        ids: Sequence[int] | None = None,
        queue: str | None = None,
        reason: str | None = None,
        task: str | None = None,
        all: bool = False,
        batch_size: int = 500,
    ) -> ReplayResult:
        """Send matching dead letters back to their original queues (one transaction per
        batch of ``batch_size``: removed here and sent there together).

        Raises:
            ConfigurationError: no filter and not ``all``.
            QueueNotFound: an original queue no longer exists (that batch stays in the
                dead-letter queue; declare the queue, or purge those dead letters).
        """
        where = _Where(ids, queue, reason, task)
        where.require("replay", all)
        replayed: Counter[str] = Counter()
        targets: dict[str, priorities.Bands] = {}  # original queue -> its bands, this call
        after_id = 0
        while True:
            with self._db.transaction():
                # only rows with an x-dead-letter header: the others have no known queue
                rows = self._rows(
                    where, take=True, after_id=after_id, limit=batch_size, any_header=False
                )
                if rows is None:
                    return ReplayResult({}, [])
                for row in rows:
                    info = DeadLetterInfo.from_row(row)
                    if info.queue is None:
                        raise _NotReplayable(row.msg_id)
                    self._send_back(info, targets)
                    replayed[info.queue] += 1
            if rows:
                after_id = rows[-1].msg_id
            if len(rows) < batch_size:
                break
        skipped = [
            d.msg_id
            for d in self.list(ids=ids, queue=queue, reason=reason, task=task, limit=10_000)
            if d.queue is None
        ]
        return ReplayResult(dict(replayed), skipped)

    def _send_back(self, info: DeadLetterInfo, targets: dict[str, priorities.Bands]) -> None:
        assert info.queue is not None
        bands = targets.get(info.queue)
        if bands is None:
            stored = self._broker.declarations.queue_info(info.queue)
            if stored is None:
                raise errors.QueueNotFound(
                    f"dead letter {info.msg_id} came from queue {info.queue!r}, which no "
                    "longer exists: declare that queue (start its consumers) and replay "
                    "again, or purge these dead letters; nothing was replayed from this batch"
                )
            bands = targets[info.queue] = priorities.stored(
                pgmq_queue_name(info.queue), stored.floors, stored.band_queues
            )
        properties = (info.headers.get(ENVELOPE_KEY) or {}).get("properties") or {}
        try:
            priority = int(properties.get("priority") or 0)  # queue_for clamps it
        except (TypeError, ValueError):
            priority = 0
        headers = {k: v for k, v in info.headers.items() if k not in (_HEADER, RESTORED_KEY)}
        headers[_REPLAYS] = int(headers.get(_REPLAYS) or 0) + 1
        self._broker.send(bands.queue_for(priority), info.body, dumps(headers))

    def purge(
        self,
        *,
        ids: Sequence[int] | None = None,
        queue: str | None = None,
        reason: str | None = None,
        task: str | None = None,
        all: bool = False,
        batch_size: int = 5000,
    ) -> int:
        """Delete matching dead letters for good; return how many.

        Raises:
            ConfigurationError: no filter and not ``all``.
        """
        where = _Where(ids, queue, reason, task)
        where.require("purge", all)
        deleted = 0
        after_id = 0
        while True:
            rows = self._rows(where, take=True, after_id=after_id, limit=batch_size)
            if rows is None:
                return deleted
            deleted += len(rows)
            if rows:
                after_id = rows[-1].msg_id
            if len(rows) < batch_size:
                return deleted


class _NotReplayable(errors.StatementError):
    """A dead letter whose x-dead-letter header does not name its queue (written by
    something other than kombu_pgmq)."""

    def __init__(self, msg_id: int) -> None:
        super().__init__(
            f"dead letter {msg_id} has no x-dead-letter header, so its original queue is "
            "unknown: purge it (kombu-pgmq dlq purge --id) or move it by hand"
        )


class _Where(NamedTuple):
    """The filters of a dead-letter operation (None: any)."""

    ids: Sequence[int] | None
    queue: str | None
    reason: str | None
    task: str | None

    def require(self, action: str, all: bool) -> None:
        """Refuse an unfiltered replay or purge unless ``all``.

        Raises:
            ConfigurationError: no filter and not ``all``.
        """
        if not all and self == (None, None, None, None):
            raise errors.ConfigurationError(
                f"dlq {action}: say which dead letters (ids, queue, reason or task), or "
                "all=True for every one"
            )
