"""The heartbeat thread of a consuming connection: consumer heartbeats, the reaper of
abandoned queues, looks below the read positions, and VACUUM of busy queue tables.

Every ``consumer_heartbeat_interval`` seconds while the connection has consumers:

* marks its consumers live in ``kombu_pgmq.consumers`` (their ``auto_delete`` and
  ``x-expires`` queues stay; see :mod:`kombu_pgmq.transport`, "Exchanges and queue
  lifetime");
* runs the reaper (``kombu_pgmq.reap``), which drops queues whose consumers' processes
  died and queues unused past ``x-expires``;
* looks below the read positions of the consumed queues every
  :data:`~kombu_pgmq._db.positions.LOOK_SECONDS` (a row outside the rules that bound
  where reads start, e.g. a ``pgmq.send`` with a past visibility time: see
  :mod:`kombu_pgmq._db.positions`). Behind an old snapshot the look walks every dead row
  version below the positions; on this thread's connection it holds up no read and no
  hand-off. A queue with a visible row there is read from the start. A role that may
  not read PGMQ's tables does not look: its reads start from the beginning now and then
  instead.
* VACUUMs a consumed queue table whose statistics show more than ``vacuum_threshold``
  dead tuples. Each delivery updates a row (its visibility timeout) and each ack deletes
  it, so a busy queue table collects dead row versions faster than autovacuum (once a
  minute at best, and sometimes off) removes them; see ``benchmarks/README.md`` (``churn.py``).
  VACUUM runs on a short-lived connection of its own (it takes a while, and must not
  hold up the consumer's statements); ``SKIP_LOCKED``, so workers never queue behind each
  other, and not within :data:`VACUUM_MIN_INTERVAL_SECONDS` of the last VACUUM of the
  table (the statistics lag: many consumers of one table ran VACUUMs back to back). A
  refusal (the role does not own the table) is logged once per table.
* backs off while an old snapshot holds the database's xmin horizon: a VACUUM removes
  only row versions that died before the horizon, so once a table was VACUUMed under
  the current horizon, another VACUUM of it would remove nothing and is skipped until
  the horizon moves. The holder (session pid, ``application_name``, state, age and
  query, or the replication slot, standby or prepared transaction) is logged once, as a
  warning, once it is :data:`~kombu_pgmq._db.horizon.OLD_SECONDS` old; once it is gone, an
  INFO line says so and VACUUMs resume.

The thread has a PostgreSQL connection of its own with ``lock_timeout`` set
(:class:`~kombu_pgmq.transport._service.Service`): a heartbeat or reaper blocked by a lock
gives up after :data:`~kombu_pgmq.transport._service.LOCK_TIMEOUT` and tries again next
round, and the reaper skips a queue whose table is locked (``kombu_pgmq.reap`` locks it
NOWAIT). Lease renewal has a thread and connection of its own
(:mod:`kombu_pgmq.transport._leases`): a long VACUUM or a blocked reaper never delays a
renewal. The set of consumers is read as a
snapshot taken under the transport's lock, never iterated while the main thread changes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .. import errors
from .._db.connector import Connector
from .._db.consumers import Consumers
from .._db.horizon import Horizon, HorizonStore
from .._db.positions import ReadPositions
from ._service import Service

logger = logging.getLogger(__name__)

#: A table VACUUMed (by any process, or autovacuum) less than this long ago is not
#: VACUUMed again yet: its statistics lag, and every consumer of it checks them.
VACUUM_MIN_INTERVAL_SECONDS = 1.0

#: Rounds a holder of the xmin horizon whose age the server hides from this role keeps
#: tables from being VACUUMed before it is logged (with its age known: once it is
#: :data:`~kombu_pgmq._db.horizon.OLD_SECONDS` old).
HIDDEN_AGE_ROUNDS = 3


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
        positions: the read positions of the connection's reads (None while it has no
            broker connection).
        found_below: gets the queues a look found a visible row below the position of.
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
        positions: Callable[[], ReadPositions | None] = lambda: None,
        found_below: Callable[[set[str]], None] = lambda queues: None,
    ) -> None:
        super().__init__(dsn, interval_seconds)
        self._consumers: Consumers | None = None
        self._owner = owner
        self._consumed_tables = consumed_tables
        self.vacuum_threshold = vacuum_threshold
        self._positions = positions
        self._found_below = found_below
        #: False once the role turned out not to be allowed to read PGMQ's tables
        self.looks = True
        self._refused: set[str] = set()
        #: table -> the horizon's xmin when it was last VACUUMed here (None: no holder)
        self._vacuumed_under: dict[str, str | None] = {}
        #: the holder that keeps tables from being VACUUMed, rounds it did, and whether
        #: it was logged
        self._holder: Horizon | None = None
        self._held_rounds = 0
        self._warned = False
        #: VACUUMs run and skipped under an unmoved horizon (for tests and diagnostics)
        self.vacuums = 0
        self.vacuums_skipped = 0

    @property
    def consumers(self) -> Consumers:
        """Consumers' statements on this service's connection (one per connection)."""
        connector = self.connector
        consumers = self._consumers
        if consumers is None or consumers.db is not connector:
            consumers = self._consumers = Consumers(connector)
        return consumers

    def round(self) -> None:
        """One round: heartbeat, reap, VACUUM what is due (skipped without consumers).

        Raises:
            KombuPgmqError: a statement failed (the next round tries again).
        """
        tables = self._consumed_tables()
        if not tables:
            return
        consumers = self.consumers
        consumers.heartbeat(self._owner())
        dropped = consumers.reap()
        if dropped:
            logger.info("dropped %d abandoned queue(s): %s", len(dropped), ", ".join(dropped))
        self.look_below(consumers)
        if self.vacuum_threshold:
            self.vacuum(consumers, tables)

    def look_below(self, consumers: Consumers) -> None:
        """Look below the read positions that are due (see the module docstring)."""
        positions = self._positions()
        if positions is None or not self.looks:
            return
        looks = positions.looks_due()
        if not looks:
            return
        started = time.monotonic()
        try:
            found = consumers.visible_below(looks)
        except errors.PermissionDenied:
            self.looks = False  # its reads start from the beginning now and then
            return
        except errors.QueueNotFound:
            return  # one is gone: the next round asks again
        positions.looked_below(looks, started)
        if found:
            self._found_below(found)

    def vacuum(self, consumers: Consumers, tables: list[str]) -> None:
        """VACUUM consumed queue tables with more than ``vacuum_threshold`` dead tuples,
        except those already VACUUMed under the current xmin horizon (nothing more to
        remove until it moves)."""
        dead = consumers.dead_tuples(tables, VACUUM_MIN_INTERVAL_SECONDS)
        due = [
            name
            for name, count in dead.items()
            if count > self.vacuum_threshold and name not in self._refused
        ]
        if not due:
            return
        holder = HorizonStore(self.connector).oldest_holder()
        xmin = holder.xmin if holder is not None else None
        held = [n for n in due if xmin is not None and self._vacuumed_under.get(n) == xmin]
        if held and holder is not None:
            self.vacuums_skipped += len(held)
            self._held_by(holder, {n: dead[n] for n in held})
        else:
            self._horizon_moved(holder)
        due = [n for n in due if n not in held]
        if not due:
            return
        vacuumer = Connector(self._dsn, role="vacuum")
        try:
            vacuums = Consumers(vacuumer)
            for name in due:
                try:
                    vacuums.vacuum(name)
                    self.vacuums += 1
                    self._vacuumed_under[name] = xmin
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

    def _held_by(self, holder: Horizon, held: dict[str, int]) -> None:
        """Tables ``held`` ({PGMQ queue: dead rows}) were skipped: ``holder`` keeps their
        dead rows; logged once per holder, once it held long enough."""
        if self._holder is None or self._holder.key != holder.key:
            self._holder, self._held_rounds, self._warned = holder, 0, False
        self._held_rounds += 1
        old = holder.old
        old_enough = old if old is not None else self._held_rounds >= HIDDEN_AGE_ROUNDS
        if self._warned or not old_enough:
            return
        self._warned = True
        tables = ", ".join(f"pgmq.q_{n} ({d:,} dead rows)" for n, d in sorted(held.items()))
        logger.warning(
            "VACUUM cannot remove the dead rows of %s: %s holds the database's xmin "
            "horizon, so every delivery and ack leaves row versions that stay; VACUUM of "
            "these tables waits until it ends (end or time out long "
            "transactions: idle_in_transaction_session_timeout, statement_timeout; see "
            "kombu-pgmq queues)",
            tables,
            holder.describe(),
        )

    def _horizon_moved(self, holder: Horizon | None) -> None:
        """The holder that kept tables from being VACUUMed is gone (``holder``: the
        oldest one now, or None)."""
        if self._holder is None or (holder is not None and holder.key == self._holder.key):
            return
        if self._warned:
            logger.info(
                "the xmin horizon moved on (%s no longer holds it): VACUUM of the queue "
                "tables resumes",
                self._holder.describe(),
            )
        self._holder, self._held_rounds, self._warned = None, 0, False
