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
  other. A refusal (the role does not own the table) is logged once per table.

Lease renewal has a thread of its own (:mod:`kombu_pgmq.transport._leases`): a long VACUUM must
never delay a renewal.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .. import errors
from .._db.client import PgmqClient

logger = logging.getLogger(__name__)


class Maintainer:
    """Runs heartbeat, reaper and VACUUM for one Kombu connection, in a thread.

    Arguments:
        client: returns the connection's :class:`PgmqClient`, or None once closed (the
            thread never opens a client: that would reopen a closed connection).
        owner: the connection's id in ``kombu_pgmq.consumers``.
        interval_seconds: seconds between rounds (``consumer_heartbeat_interval``).
        consuming: True while the connection has consumers (rounds are skipped otherwise).
        consumed_tables: PGMQ queue names of the consumed queues (every priority band).
        reap: runs the reaper on the given client.
        conninfo: libpq connection string, for the VACUUM connection.
        vacuum_threshold: dead tuples above which a table is VACUUMed (0: never).
    """

    def __init__(
        self,
        *,
        client: Callable[[], PgmqClient | None],
        owner: str,
        interval_seconds: float,
        consuming: Callable[[], bool],
        consumed_tables: Callable[[], list[str]],
        reap: Callable[[PgmqClient], Any],
        conninfo: Callable[[], str],
        vacuum_threshold: int,
    ) -> None:
        self._client = client
        self._owner = owner
        self.interval_seconds = interval_seconds
        self._consuming = consuming
        self._consumed_tables = consumed_tables
        self._reap = reap
        self._conninfo = conninfo
        self.vacuum_threshold = vacuum_threshold
        self._refused: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="kombu_pgmq-heartbeat", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop after the current round (as a process that died would: no more beats)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            client = self._client()
            if client is None or not self._consuming():
                continue
            try:
                self.round(client)
            except errors.KombuPgmqError as exc:
                if not self._stop.is_set():  # else: closing, not a failure
                    logger.warning("consumer heartbeat failed (%s); retrying", exc)

    def round(self, client: PgmqClient) -> None:
        """One round: heartbeat, reap, VACUUM what is due.

        Raises:
            KombuPgmqError: a statement failed (the next round tries again).
        """
        client.heartbeat(self._owner)
        self._reap(client)
        if self.vacuum_threshold:
            self.vacuum(client)

    def vacuum(self, client: PgmqClient) -> None:
        """VACUUM consumed queue tables with more than ``vacuum_threshold`` dead tuples."""
        due = [
            name
            for name, dead in client.dead_tuples(self._consumed_tables()).items()
            if dead > self.vacuum_threshold and name not in self._refused
        ]
        if not due:
            return
        vacuumer = PgmqClient(self._conninfo())
        try:
            for name in due:
                try:
                    vacuumer.vacuum(name)
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
