"""Archive retention: delete archived messages older than an age, in small batches.

Acks move messages to the archive ``pgmq.a_<queue>`` (the audit trail), which grows
without end; PGMQ prunes only partitioned archives. :func:`prune_archives` deletes
messages archived more than ``older_than_seconds`` ago, ``batch_size`` rows per
transaction (oldest first, through the archive's ``archived_at`` index, ``FOR UPDATE SKIP
LOCKED``): no long locks, no long transactions, several pruners never wait for each other.
The space is reused after VACUUM (autovacuum, or the queue's consumers).

Run it from cron (``kombu-pgmq archive prune --older-than 7d``) or Celery beat::

    from kombu_pgmq.retention import add_beat_task
    add_beat_task(app, older_than_seconds=7 * 86400, every_seconds=3600)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _conninfo as conninfo
from . import errors
from ._db.admin import Admin
from ._db.connector import Connector
from ._db.declarations import Declarations
from ._naming import pgmq_queue_name

#: Name of the Celery task registered by :func:`add_beat_task`.
BEAT_TASK_NAME = "kombu_pgmq.prune_archives"


def prune_archives(
    url: str | None = None,
    *,
    older_than_seconds: float,
    queues: Sequence[str] | None = None,
    batch_size: int = 5000,
) -> dict[str, int]:
    """Delete archived messages older than ``older_than_seconds`` from the archives of
    ``queues`` (Kombu names; None: every PGMQ queue's archive, priority bands included).

    Returns ``{pgmq queue: rows deleted}`` (queues with none left out).

    Raises:
        ConfigurationError: ``older_than_seconds`` < 0 or ``batch_size`` < 1.
        QueueNotFound: a queue named in ``queues`` does not exist.
        BrokerConnectionError: the database cannot be reached.
    """
    if older_than_seconds < 0:
        raise errors.ConfigurationError(
            f"older_than_seconds={older_than_seconds!r} is invalid: expected seconds >= 0"
        )
    if batch_size < 1:
        raise errors.ConfigurationError(f"batch_size={batch_size!r} is invalid: expected >= 1")
    if not url:
        raise errors.ConfigurationError("prune_archives needs a broker url (postgresql://...)")
    db = Connector(conninfo.to_dsn(url))
    admin, declarations = Admin(db), Declarations(db)
    try:
        tables = dict(admin.queue_tables())
        if queues is None:
            names = [name for name, archived in tables.items() if archived]
        else:
            names = []
            for queue in queues:
                info = declarations.queue_info(queue)
                bands = info.band_queues if info and info.band_queues else None
                for name in bands or [pgmq_queue_name(queue)]:
                    if name not in tables:
                        raise errors.QueueNotFound(
                            f"queue {queue!r} has no PGMQ queue {name!r}: check the name "
                            "(Kombu queue names, as in your Celery/Kombu config)"
                        )
                    names.append(name)
        deleted: dict[str, int] = {}
        for name in names:
            total = 0
            while True:
                try:
                    n = admin.prune_archive(name, older_than_seconds, batch_size)
                except errors.QueueNotFound:
                    break  # dropped meanwhile
                total += n
                if n < batch_size:
                    break
            if total:
                deleted[name] = total
        return deleted
    finally:
        db.close()


def add_beat_task(
    app: Any,
    *,
    older_than_seconds: float,
    every_seconds: float = 3600.0,
    queues: Sequence[str] | None = None,
    batch_size: int = 5000,
) -> Any:
    """Register the Celery task ``kombu_pgmq.prune_archives`` on ``app`` and schedule it
    with Celery beat every ``every_seconds``; it prunes the archives of the app's broker
    (``broker_url``). Returns the task. Run ``celery beat`` (or ``worker -B``) for it to
    fire."""

    @app.task(name=BEAT_TASK_NAME, ignore_result=True)
    def prune() -> dict[str, int]:
        return prune_archives(
            app.conf.broker_url,
            older_than_seconds=older_than_seconds,
            queues=queues,
            batch_size=batch_size,
        )

    app.conf.beat_schedule = {
        **(app.conf.beat_schedule or {}),
        BEAT_TASK_NAME: {"task": BEAT_TASK_NAME, "schedule": every_seconds},
    }
    return prune
