"""The heartbeat thread of a consuming connection: consumer heartbeats, the reaper of
abandoned queues, and VACUUM of busy queue tables.

Every ``consumer_heartbeat_interval`` seconds while the connection has consumers:

* marks its consumers live in ``kombu_pgmq.consumers`` (their ``auto_delete`` and
  ``x-expires`` queues stay; see :mod:`kombu_pgmq.transport`, "Exchanges and queue
  lifetime");
* runs the reaper (``kombu_pgmq.reap``), which drops queues whose consumers' processes
  died and queues unused past ``x-expires``;
* VACUUMs a consumed queue table whose statistics show more than ``vacuum_threshold``
  dead tuples. Each delivery updates a row (its visibility timeout) and each ack deletes
  it, so a busy queue table collects dead row versions faster than autovacuum (once a
  minute at best, and sometimes off) removes them; see ``benchmarks/README.md`` (churn).
  VACUUM runs on a short-lived connection of its own (it takes a while, and must not
  hold up the consumer's statements); ``SKIP_LOCKED``, so workers never queue behind each
  other, and not within :data:`VACUUM_MIN_INTERVAL_SECONDS` of the last VACUUM of the
  table (the statistics lag: many consumers of one table ran VACUUMs back to back). A
  refusal (the role does not own the table) is logged once per table.

The thread has a PostgreSQL connection of its own with ``lock_timeout`` set
(:class:`~kombu_pgmq.transport._service.Service`): a heartbeat or reaper blocked by a lock
gives up after :data:`~kombu_pgmq.transport._service.LOCK_TIMEOUT` and tries again next
round, and the reaper skips a queue whose table is locked (migration 0006). Lease renewal
has a thread and connection of its own (:mod:`kombu_pgmq.transport._leases`): a long
VACUUM or a blocked reaper never delays a renewal. The set of consumers is read as a
snapshot taken under the transport's lock, never iterated while the main thread changes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .. import errors
from .._db.connector import Connector
from .._db.consumers import Consumers
from ._service import Service

logger = logging.getLogger(__name__)

#: A table VACUUMed (by any process, or autovacuum) less than this long ago is not
#: VACUUMed again yet: its statistics lag, and every consumer of it checks them.
VACUUM_MIN_INTERVAL_SECONDS = 1.0


class Maintainer(Service):
    """Runs heartbeat, reaper and VACUUM for one Kombu connection, in a thread, on a
    connection of its own.

    Arguments:
        dsn: libpq connection string of the broker database.
        owner: the connection's id in ``kombu_pgmq.consumers``.
        interval_seconds: seconds between rounds (``consumer_heartbeat_interval``).
        consumed_tables: PGMQ queue names of the consumed queues (every priority band),
            empty while the connection has no consumers (rounds are skipped then).
        vacuum_threshold: dead tuples above which a table is VACUUMed (0: never).
    """

    name = "consumer heartbeat"
    role = "heartbeat"

    def __init__(
        self,
        dsn: str,
        *,
        owner: Callable[[], str],
        interval_seconds: float,
        consumed_tables: Callable[[], list[str]],
        vacuum_threshold: int,
    ) -> None:
        super().__init__(dsn, interval_seconds)
        self._owner = owner
        self._consumed_tables = consumed_tables
        self.vacuum_threshold = vacuum_threshold
        self._refused: set[str] = set()

    def round(self) -> None:
        """One round: heartbeat, reap, VACUUM what is due (skipped without consumers).

        Raises:
            KombuPgmqError: a statement failed (the next round tries again).
        """
        tables = self._consumed_tables()
        if not tables:
            return
        consumers = Consumers(self.connector)
        consumers.heartbeat(self._owner())
        dropped = consumers.reap()
        if dropped:
            logger.info("dropped %d abandoned queue(s): %s", len(dropped), ", ".join(dropped))
        if self.vacuum_threshold:
            self.vacuum(consumers, tables)

    def vacuum(self, consumers: Consumers, tables: list[str]) -> None:
        """VACUUM consumed queue tables with more than ``vacuum_threshold`` dead tuples."""
        due = [
            name
            for name, dead in consumers.dead_tuples(tables, VACUUM_MIN_INTERVAL_SECONDS).items()
            if dead > self.vacuum_threshold and name not in self._refused
        ]
        if not due:
            return
        vacuumer = Connector(self._dsn, role="vacuum")
        try:
            for name in due:
                try:
                    Consumers(vacuumer).vacuum(name)
                except errors.QueueNotFound:
                    continue
                except errors.BrokerConnectionError:
                    raise
                except errors.KombuPgmqError as exc:
                    self._refused.add(name)
                    logger.warning(
                        "cannot VACUUM queue table pgmq.q_%s (%s): leaving it to autovacuum; "
                        "set transport option vacuum_threshold=0 to stop trying",
                        name,
                        exc,
                    )
        finally:
            vacuumer.close()
